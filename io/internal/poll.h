// A wait for something that has no blocking call with a deadline or a
// cancel flag (a non-blocking lock attempt: fcntl F_OFD_SETLK, flock
// LOCK_NB): tries again and again with a growing pause.
#ifndef MLP_OFFLOAD_IO_INTERNAL_POLL_H_
#define MLP_OFFLOAD_IO_INTERNAL_POLL_H_

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <optional>
#include <thread>

#include "mlp_offload/base/clock.h"

namespace mlp_offload {
namespace internal_io {

// Calls `try_once` (returns 0: done; EAGAIN: not yet; another errno: failed)
// until it is done or fails, sleeping from 50 us doubling to 2 ms between
// tries, so what it waits for is seen within 2 ms. Returns 0, the errno of
// the failure, ETIMEDOUT once `deadline` passed (none: no limit) or
// ECANCELED once *cancel is true (null: no flag).
template <typename Try>
int PollWithBackoff(Try try_once, std::optional<MonoTime> deadline,
                    const std::atomic<bool>* cancel) {
  MonoClock::duration pause = std::chrono::microseconds(50);
  for (;;) {
    const int err = try_once();
    if (err != EAGAIN) return err;
    if (cancel != nullptr && cancel->load()) return ECANCELED;
    const MonoTime now = MonoNow();
    if (deadline.has_value() && now >= *deadline) return ETIMEDOUT;
    std::this_thread::sleep_for(
        deadline.has_value()
            ? std::min<MonoClock::duration>(pause, *deadline - now)
            : pause);
    pause =
        std::min<MonoClock::duration>(pause * 2, std::chrono::milliseconds(2));
  }
}

}  // namespace internal_io
}  // namespace mlp_offload

#endif  // MLP_OFFLOAD_IO_INTERNAL_POLL_H_
