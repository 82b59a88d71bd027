// A thread that runs closures at given times, for the wrappers that delay
// requests (fault-injected delays, the bandwidth throttle) without blocking
// the submitting thread.
#ifndef MLP_OFFLOAD_IO_INTERNAL_DELAY_QUEUE_H_
#define MLP_OFFLOAD_IO_INTERNAL_DELAY_QUEUE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "mlp_offload/base/clock.h"
#include "mlp_offload/base/mutex.h"

namespace mlp_offload {
namespace internal_io {

class DelayQueue {
 public:
  DelayQueue();
  // Drains.
  ~DelayQueue();
  DelayQueue(const DelayQueue&) = delete;
  DelayQueue& operator=(const DelayQueue&) = delete;

  // Runs `fn` on the queue's thread at `when`, a monotonic time (at once if
  // past). Closures due
  // at the same time run in the order they were added. After Drain, runs
  // `fn` on the calling thread at once. Where the thread could not be
  // started (start_status()), runs `fn` on the calling thread at `when`,
  // after waiting for it.
  void RunAt(MonoTime when, std::function<void()> fn);
  const absl::Status& start_status() const { return start_status_; }
  // Runs every closure queued so far on the calling thread, in the order
  // they would have run, and returns when they have (each sees whatever made
  // the caller hurry, e.g. an interruption, and none is left to run later,
  // after the caller changed its mind). One the queue's thread took already
  // (due) runs there as usual.
  void Hurry();
  // Waits until every closure added so far has run (at its time), then stops
  // the thread. Idempotent.
  void Drain();

 private:
  void Loop();

  ::mlp_offload::Mutex mu_;
  // Keyed by (time, arrival) so equal times keep FIFO order.
  std::map<std::pair<MonoTime, uint64_t>, std::function<void()>> queue_
      ABSL_GUARDED_BY(mu_);
  uint64_t next_seq_ ABSL_GUARDED_BY(mu_) = 0;
  bool changed_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status start_status_;  // fixed after construction
  ::mlp_offload::Mutex join_mu_;
  std::thread thread_ ABSL_GUARDED_BY(join_mu_);
};

}  // namespace internal_io
}  // namespace mlp_offload

#endif  // MLP_OFFLOAD_IO_INTERNAL_DELAY_QUEUE_H_
