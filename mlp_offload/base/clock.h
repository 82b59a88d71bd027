// Monotonic time for the library's intervals and deadlines.
//
// absl::Now() reads the wall clock: NTP and manual steps move it, and Debian's
// Abseil (20220623) extrapolates it from the cycle counter between
// calibrations, so two readings a moment apart can differ by seconds. A CI
// run saw one step's measured waits add up to 17 s within a step that took
// 0.6 s. Step statistics, probe timings, pacing and back-off therefore use
// std::chrono::steady_clock (CLOCK_MONOTONIC), never absl::Now().
#ifndef MLP_OFFLOAD_BASE_CLOCK_H_
#define MLP_OFFLOAD_BASE_CLOCK_H_

#include <chrono>
#include <cstdint>

#include "absl/time/time.h"

namespace mlp_offload {

using MonoClock = std::chrono::steady_clock;
using MonoTime = MonoClock::time_point;

inline MonoTime MonoNow() { return MonoClock::now(); }

// `d` as a steady_clock duration; negative durations give zero and infinite
// or huge ones saturate at a century (so that adding one to now cannot
// overflow).
inline MonoClock::duration ToMonoDuration(absl::Duration d) {
  constexpr int64_t kCenturyNs = int64_t{100} * 365 * 24 * 3600 * 1000000000;
  if (d <= absl::ZeroDuration()) return MonoClock::duration::zero();
  if (d >= absl::Nanoseconds(kCenturyNs)) {
    return std::chrono::duration_cast<MonoClock::duration>(
        std::chrono::nanoseconds(kCenturyNs));
  }
  return std::chrono::duration_cast<MonoClock::duration>(
      absl::ToChronoNanoseconds(d));
}

// The moment `d` from now.
inline MonoTime MonoAfter(absl::Duration d) {
  return MonoNow() + ToMonoDuration(d);
}

inline absl::Duration ToAbslDuration(MonoClock::duration d) {
  return absl::FromChrono(
      std::chrono::duration_cast<std::chrono::nanoseconds>(d));
}

// Seconds elapsed since `start`.
inline double SecondsSince(MonoTime start) {
  return std::chrono::duration<double>(MonoNow() - start).count();
}

}  // namespace mlp_offload

#endif  // MLP_OFFLOAD_BASE_CLOCK_H_
