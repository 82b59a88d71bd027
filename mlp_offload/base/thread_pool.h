// A fixed-size pool of worker threads that runs a parallel-for over index
// ranges. Used by the kernels (chunks of a span) and the engine. The caller
// chooses the size; a pool of 1 runs everything on the calling thread.
#ifndef MLP_OFFLOAD_BASE_THREAD_POOL_H_
#define MLP_OFFLOAD_BASE_THREAD_POOL_H_

#include <cstddef>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "mlp_offload/base/mutex.h"

namespace mlp_offload {

class ThreadPool {
 public:
  // Starts `num_threads - 1` workers; the calling thread is the last one.
  // num_threads < 1 is treated as 1. Never throws: where a worker cannot be
  // started the pool has fewer (num_threads() says how many), and
  // start_status() says why; callers that need them all check it.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return num_threads_; }
  const absl::Status& start_status() const { return start_status_; }

  // Calls fn(task) for every task in [0, num_tasks), spread over the pool,
  // and returns when all have finished. Tasks are claimed dynamically, so the
  // assignment of tasks to threads varies; callers that need bit-identical
  // results must make each task's result depend only on its index. Not
  // reentrant: one ParallelFor at a time per pool.
  void ParallelFor(size_t num_tasks, const std::function<void(size_t)>& fn);

 private:
  void WorkerLoop();
  void RunTasks();

  int num_threads_;  // fixed after construction
  absl::Status start_status_;
  std::vector<std::thread> workers_;
  Mutex mu_;
  // Generation of the current job; workers wait for it to change.
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  const std::function<void(size_t)>* fn_ ABSL_GUARDED_BY(mu_) = nullptr;
  size_t num_tasks_ ABSL_GUARDED_BY(mu_) = 0;
  size_t next_task_ ABSL_GUARDED_BY(mu_) = 0;
  size_t done_tasks_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace mlp_offload

#endif  // MLP_OFFLOAD_BASE_THREAD_POOL_H_
