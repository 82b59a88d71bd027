// A mutex with absl::Mutex-style Await, built on std::mutex and
// std::condition_variable; used by every layer of the project.
//
// Why not absl::Mutex: Abseil here is Debian's shared library, built without
// ThreadSanitizer instrumentation, so under --config=tsan every absl::Mutex
// handoff is invisible and tsan reports races that are not there (and would
// hide real ones in the noise). std::mutex goes through pthread, which tsan
// intercepts. The Await interface keeps the absl style: state changes happen
// under the lock and every Unlock wakes the waiters, who re-check their
// predicate.
#ifndef MLP_OFFLOAD_BASE_MUTEX_H_
#define MLP_OFFLOAD_BASE_MUTEX_H_

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "absl/base/thread_annotations.h"
#include "mlp_offload/base/clock.h"

namespace mlp_offload {

class ABSL_LOCKABLE Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() {
    // Waiters re-check their predicates; cheap when nobody waits. Notified
    // before unlocking: a waiter that wakes and returns may destroy this
    // Mutex (a future's state, a stack-allocated counter) right away.
    cv_.notify_all();
    mu_.unlock();
  }

  // Blocks (releasing the lock meanwhile) until `pred()` holds. Call locked.
  template <typename Pred>
  void Await(Pred pred) ABSL_EXCLUSIVE_LOCKS_REQUIRED(this) {
    std::unique_lock<std::mutex> lock(mu_, std::adopt_lock);
    cv_.wait(lock, pred);
    lock.release();
  }

  // Like Await, but gives up at `deadline` (monotonic); returns pred().
  template <typename Pred>
  bool AwaitWithDeadline(Pred pred, MonoTime deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(this) {
    std::unique_lock<std::mutex> lock(mu_, std::adopt_lock);
    bool result = pred();
    while (!result) {
      const MonoClock::duration left = deadline - MonoNow();
      if (left <= MonoClock::duration::zero()) break;
      // In slices of at most an hour: wait_for adds `left` to the clock's
      // now, which must not overflow for a far deadline.
      cv_.wait_for(lock,
                   std::min<MonoClock::duration>(left, std::chrono::hours(1)));
      result = pred();
    }
    lock.release();
    return result;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
};

class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) {
    mu_->Lock();
  }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

// absl::Notification on the Mutex above.
class Notification {
 public:
  void Notify() {
    MutexLock lock(&mu_);
    notified_ = true;
  }
  void WaitForNotification() {
    MutexLock lock(&mu_);
    mu_.Await([this]()
                  ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return notified_; });
  }

 private:
  Mutex mu_;
  bool notified_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace mlp_offload

#endif  // MLP_OFFLOAD_BASE_MUTEX_H_
