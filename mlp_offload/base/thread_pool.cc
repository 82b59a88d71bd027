// ThreadPool: workers sleep on a condition until a ParallelFor publishes a
// new generation, then claim task indices under the mutex. Tasks are coarse
// (a chunk of hundreds of KiB), so one lock per task is negligible.
#include "mlp_offload/base/thread_pool.h"

#include <utility>

#include "mlp_offload/base/threads.h"

namespace mlp_offload {

ThreadPool::ThreadPool(int num_threads)
    : num_threads_(num_threads < 1 ? 1 : num_threads) {
  for (int i = 1; i < num_threads_; ++i) {
    absl::StatusOr<std::thread> t =
        StartThread("compute thread", [this] { WorkerLoop(); });
    if (!t.ok()) {
      start_status_ = t.status();
      num_threads_ = i;
      break;
    }
    workers_.push_back(*std::move(t));
  }
}

ThreadPool::~ThreadPool() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  for (auto& t : workers_) t.join();
}

void ThreadPool::RunTasks() {
  for (;;) {
    size_t task;
    const std::function<void(size_t)>* fn;
    {
      MutexLock lock(&mu_);
      if (fn_ == nullptr || next_task_ >= num_tasks_) return;
      task = next_task_++;
      fn = fn_;
    }
    (*fn)(task);
    MutexLock lock(&mu_);
    ++done_tasks_;
  }
}

void ThreadPool::WorkerLoop() {
  uint64_t seen = 0;
  for (;;) {
    {
      MutexLock lock(&mu_);
      auto ready = [this, &seen]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || generation_ != seen;
      };
      mu_.Await(ready);
      if (stop_) return;
      seen = generation_;
    }
    RunTasks();
  }
}

void ThreadPool::ParallelFor(size_t num_tasks,
                             const std::function<void(size_t)>& fn) {
  if (num_tasks == 0) return;
  if (num_threads_ == 1 || num_tasks == 1) {
    for (size_t i = 0; i < num_tasks; ++i) fn(i);
    return;
  }
  {
    MutexLock lock(&mu_);
    fn_ = &fn;
    num_tasks_ = num_tasks;
    next_task_ = 0;
    done_tasks_ = 0;
    ++generation_;
  }
  RunTasks();
  MutexLock lock(&mu_);
  auto all_done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return done_tasks_ == num_tasks_;
  };
  mu_.Await(all_done);
  fn_ = nullptr;
}

}  // namespace mlp_offload
