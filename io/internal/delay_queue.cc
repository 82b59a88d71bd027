// A timer thread for delayed closures.
#include "io/internal/delay_queue.h"

#include <vector>

#include "mlp_offload/base/threads.h"

namespace mlp_offload {
namespace internal_io {

DelayQueue::DelayQueue() {
  ::mlp_offload::MutexLock lock(&join_mu_);
  absl::StatusOr<std::thread> t =
      StartThread("a delay queue's timer", [this] { Loop(); });
  if (t.ok()) {
    thread_ = *std::move(t);
  } else {
    start_status_ = t.status();
  }
}

DelayQueue::~DelayQueue() { Drain(); }

void DelayQueue::RunAt(MonoTime when, std::function<void()> fn) {
  if (!start_status_.ok()) {
    // No thread: the caller waits for the time itself.
    std::this_thread::sleep_until(when);
    fn();
    return;
  }
  {
    ::mlp_offload::MutexLock lock(&mu_);
    if (!stopped_) {
      queue_.emplace(std::make_pair(when, next_seq_++), std::move(fn));
      changed_ = true;
      return;
    }
  }
  fn();
}

void DelayQueue::Hurry() {
  std::vector<std::function<void()>> queued;
  {
    ::mlp_offload::MutexLock lock(&mu_);
    queued.reserve(queue_.size());
    for (auto& [key, fn] : queue_) queued.push_back(std::move(fn));
    queue_.clear();
    changed_ = true;
  }
  for (auto& fn : queued) fn();
}

void DelayQueue::Drain() {
  {
    ::mlp_offload::MutexLock lock(&mu_);
    stopping_ = true;
    changed_ = true;
  }
  ::mlp_offload::MutexLock lock(&join_mu_);
  if (thread_.joinable()) thread_.join();
}

void DelayQueue::Loop() {
  for (;;) {
    std::vector<std::function<void()>> due;
    {
      ::mlp_offload::MutexLock lock(&mu_);
      for (;;) {
        if (queue_.empty()) {
          if (stopping_) {
            stopped_ = true;
            return;
          }
          changed_ = false;
          mu_.Await(
              [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return changed_; });
          continue;
        }
        const MonoTime now = MonoNow();
        auto it = queue_.begin();
        if (it->first.first <= now) break;
        // Sleep until the earliest deadline or until RunAt adds an earlier one.
        changed_ = false;
        mu_.AwaitWithDeadline(
            [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return changed_; },
            it->first.first);
      }
      const MonoTime now = MonoNow();
      while (!queue_.empty() && queue_.begin()->first.first <= now) {
        due.push_back(std::move(queue_.begin()->second));
        queue_.erase(queue_.begin());
      }
    }
    // Outside the lock: a closure may call RunAt.
    for (auto& fn : due) fn();
  }
}

}  // namespace internal_io
}  // namespace mlp_offload
