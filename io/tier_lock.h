// Cross-process tier lock (technique 4 of the paper): at most K processes of a
// node do I/O on a tier at a time. FIFO-fair enough that no process starves,
// and released by the kernel when a holder dies (file locks), so a SIGKILLed
// holder never wedges the others. Waits sleep in the kernel's lock queue
// (F_OFD_SETLKW), also those with a deadline or a cancel flag (on a helper
// thread; see tier_lock.cc).
#ifndef MLP_OFFLOAD_IO_TIER_LOCK_H_
#define MLP_OFFLOAD_IO_TIER_LOCK_H_

#include <atomic>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace mlp_offload {

class TierLock {
 public:
  // Opens (creating, 0600) the lock files under `lock_path` (a file path
  // prefix on the tier) for at most `max_holders` concurrent holders.
  static absl::StatusOr<std::unique_ptr<TierLock>> Open(
      const std::string& lock_path, int max_holders = 1);
  ~TierLock();  // releases if held

  // Blocks until this process holds one of the K slots, or `timeout` passed
  // (DeadlineExceeded naming the lock; nothing held, and the tickets after
  // ours are not held up by it). Not reentrant per TierLock object (one
  // holder per object); several objects (threads) in one process count as
  // separate holders. With `cancel`, the wait also ends, with Cancelled (and
  // nothing held), soon after *cancel becomes true (checked every 10 ms; the
  // wait for the ticket counter's short critical section polls, every 2 ms
  // at most).
  absl::Status Acquire(absl::Duration timeout = absl::InfiniteDuration(),
                       const std::atomic<bool>* cancel = nullptr);
  void Release();
  bool held() const;
  // Whether another holder took a ticket after ours (someone is waiting or
  // holds another slot). A cheap read without locking: a stale answer only
  // shifts when a holder yields. False when not held.
  bool HasWaiters() const;

 private:
  struct Impl;
  explicit TierLock(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// A lock file that marks a tier directory as in use by one live run:
// AlreadyExists naming the path (and the holder's pid if readable) when
// another live process holds it; taken over silently if the holder died.
class RunLock {
 public:
  static absl::StatusOr<std::unique_ptr<RunLock>> Acquire(
      const std::string& path);
  ~RunLock();
  // OK while the lock file is still at its path; if it was deleted or
  // replaced, another process could take the run: FailedPrecondition.
  absl::Status CheckStillAtPath() const;

 private:
  RunLock(int fd, std::string path);
  int fd_;
  std::string path_;
};

}  // namespace mlp_offload

#endif  // MLP_OFFLOAD_IO_TIER_LOCK_H_
