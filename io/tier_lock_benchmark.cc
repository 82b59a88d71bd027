// Hand-over latency of the tier lock: how long after a holder releases it a
// rank that has been waiting holds it (the tier idles meanwhile). Side by
// side, in one run:
//
//   kernel         Acquire() with no deadline and no flag: F_OFD_SETLKW on
//                  the waiting thread;
//   kernel+helper  Acquire(timeout, &flag), the engine's wait: a helper
//                  thread sleeps in F_OFD_SETLKW for the waiting one;
//   polled         F_OFD_SETLK tried again with PollWithBackoff (50 us
//                  doubling to 2 ms), as bounded and cancellable waits did
//                  before they got the helper: the same calls on a byte of
//                  a scratch file, the holder's and the waiter's open file
//                  descriptions apart.
//
//   bazel run -c opt //io:tier_lock_benchmark -- [--handovers=200]
//       [--hold_ms=20] [--dir=/dev/shm]
//
// Each hand-over: the holder takes the lock, a waiter starts waiting, the
// holder keeps it --hold_ms plus a random 0-2 ms (so a polled wait is at its
// longest pause, as a rank waiting out another's turn is, at a random phase
// of it), notes the time and releases; the waiter notes when it holds the
// lock.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "io/internal/ofd_lock.h"
#include "io/internal/poll.h"
#include "io/tier_lock.h"
#include "mlp_offload/base/clock.h"

ABSL_FLAG(int, handovers, 200, "hand-overs measured per kind");
ABSL_FLAG(int, hold_ms, 20, "how long the holder keeps the lock each time");
ABSL_FLAG(std::string, dir, "/dev/shm", "directory of the lock files");

namespace mlp_offload {
namespace {

double Micros(MonoClock::duration d) {
  return std::chrono::duration<double, std::micro>(d).count();
}

struct Summary {
  double median = 0, p90 = 0, max = 0;
};

Summary Summarize(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  Summary s;
  if (v.empty()) return s;
  s.median = v[v.size() / 2];
  s.p90 = v[std::min(v.size() - 1, v.size() * 9 / 10)];
  s.max = v.back();
  return s;
}

// One hand-over: `hold` takes the lock, `wait` (on another thread) waits for
// it and returns when it holds it, `release` lets go; returns the latency
// (us) from the release to the waiter holding it, or -1 on an error.
template <typename Hold, typename Wait, typename Release>
double HandOver(Hold hold, Wait wait, Release release,
                std::chrono::microseconds hold_for) {
  if (!hold()) return -1;
  std::atomic<bool> ok{false};
  MonoTime got{};
  std::thread waiter([&] {
    ok = wait();
    got = MonoNow();
  });
  std::this_thread::sleep_for(hold_for);
  const MonoTime released = MonoNow();
  release();
  waiter.join();
  return ok ? Micros(got - released) : -1;
}

int Run() {
  const int n = absl::GetFlag(FLAGS_handovers);
  const int hold_ms = absl::GetFlag(FLAGS_hold_ms);
  if (n < 1 || hold_ms < 0) {
    fprintf(stderr, "--handovers must be >= 1 and --hold_ms >= 0\n");
    return 2;
  }
  const std::string base = absl::StrCat(absl::GetFlag(FLAGS_dir),
                                        "/mlp_offload_lock_bench.", getpid());
  auto a = TierLock::Open(base);
  auto b = TierLock::Open(base);
  if (!a.ok() || !b.ok()) {
    fprintf(stderr, "TierLock::Open %s: %s\n", base.c_str(),
            std::string((a.ok() ? b.status() : a.status()).message()).c_str());
    return 1;
  }
  const std::string scratch = base + ".polled";
  const int holder_fd =
      open(scratch.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  const int waiter_fd = open(scratch.c_str(), O_RDWR | O_CLOEXEC);
  if (holder_fd < 0 || waiter_fd < 0) {
    fprintf(stderr, "open %s: %s\n", scratch.c_str(), strerror(errno));
    return 1;
  }
  unlink(scratch.c_str());

  std::atomic<bool> cancel{false};
  std::mt19937 rng(1);
  std::uniform_int_distribution<int> jitter_us(0, 1999);
  const char* names[] = {"kernel", "kernel+helper", "polled"};
  std::vector<double> latency[3];
  // Alternated, so that a noisy moment hits every kind alike.
  for (int i = 0; i < n; ++i) {
    for (int k = 0; k < 3; ++k) {
      const std::chrono::microseconds hold_for(1000 * hold_ms + jitter_us(rng));
      double us;
      if (k < 2) {
        us = HandOver([&] { return (*a)->Acquire().ok(); },
                      [&] {
                        const bool ok =
                            k == 0
                                ? (*b)->Acquire().ok()
                                : (*b)->Acquire(absl::Hours(1), &cancel).ok();
                        if (ok) (*b)->Release();
                        return ok;
                      },
                      [&] { (*a)->Release(); }, hold_for);
      } else {
        us = HandOver(
            [&] {
              return internal_io::OfdLock(holder_fd, F_WRLCK, 0, false) == 0;
            },
            [&] {
              const int err = internal_io::PollWithBackoff(
                  [&] {
                    const int e =
                        internal_io::OfdLock(waiter_fd, F_RDLCK, 0, false);
                    return e == EACCES ? EAGAIN : e;
                  },
                  std::nullopt, &cancel);
              internal_io::OfdLock(waiter_fd, F_UNLCK, 0, false);
              return err == 0;
            },
            [&] { internal_io::OfdLock(holder_fd, F_UNLCK, 0, false); },
            hold_for);
      }
      if (us < 0) {
        fprintf(stderr, "hand-over %d of kind %s failed\n", i, names[k]);
        return 1;
      }
      latency[k].push_back(us);
    }
  }
  close(holder_fd);
  close(waiter_fd);
  printf(
      "tier lock hand-over latency, %d hand-overs per kind, held %d-%d ms "
      "each (us):\n",
      n, hold_ms, hold_ms + 2);
  printf("%-14s %9s %9s %9s\n", "kind", "median", "p90", "max");
  Summary s[3];
  for (int k = 0; k < 3; ++k) {
    s[k] = Summarize(latency[k]);
    printf("%-14s %9.1f %9.1f %9.1f\n", names[k], s[k].median, s[k].p90,
           s[k].max);
  }
  printf("polled / kernel+helper (medians): %.1fx\n",
         s[1].median > 0 ? s[2].median / s[1].median : 0.0);
  return 0;
}

}  // namespace
}  // namespace mlp_offload

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return mlp_offload::Run();
}
