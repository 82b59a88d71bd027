// The pread/pwrite thread-pool engine: the fallback where io_uring cannot be
// set up (old kernel, io_uring disabled by sysctl or seccomp). Each worker
// takes one piece at a time from a shared FIFO and loops on the syscall until
// the piece is complete or fails, so num_threads is its queue depth.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "io/internal/engines.h"
#include "io/internal/request.h"
#include "mlp_offload/base/mutex.h"
#include "mlp_offload/base/threads.h"

namespace mlp_offload {
namespace internal_io {
namespace {

class ThreadPoolEngine final : public IoEngine {
 public:
  explicit ThreadPoolEngine(const IoEngineOptions& options)
      : block_size_(options.block_size) {
    const int n = std::max(1, options.num_threads);
    workers_.reserve(n);
    for (int i = 0; i < n; ++i) {
      absl::StatusOr<std::thread> t =
          StartThread("an I/O thread", [this] { WorkerLoop(); });
      if (!t.ok()) {
        start_status_ = t.status();
        return;  // the factory refuses the engine; its destructor joins
      }
      workers_.push_back(*std::move(t));
    }
  }

  const absl::Status& start_status() const { return start_status_; }

  ~ThreadPoolEngine() override {
    Shutdown();
    ::mlp_offload::MutexLock lock(&join_mu_);
    JoinWorkersLocked();
  }

  std::string name() const override { return "threadpool"; }

  void Submit(const IoRequest& request, IoCallback done) override {
    SubmitBatch(absl::MakeConstSpan(&request, 1), absl::MakeSpan(&done, 1));
  }

  void SubmitBatch(absl::Span<const IoRequest> requests,
                   absl::Span<IoCallback> done) override {
    if (requests.size() != done.size()) {
      for (auto& d : done) {
        d(absl::InvalidArgumentError(
            absl::StrCat("SubmitBatch: ", requests.size(), " requests but ",
                         done.size(), " callbacks")));
      }
      return;
    }
    std::vector<Piece> pieces;
    for (size_t i = 0; i < requests.size(); ++i) {
      absl::Status valid = ValidateRequest(requests[i]);
      if (!valid.ok()) {
        done[i](std::move(valid));
        continue;
      }
      bool stopping;
      {
        ::mlp_offload::MutexLock lock(&mu_);
        stopping = stopping_;
      }
      if (stopping) {
        done[i](Stopped());
        continue;
      }
      std::vector<Piece> split =
          SplitRequest(requests[i], std::move(done[i]), block_size_);
      for (auto& p : split) pieces.push_back(std::move(p));
    }
    if (pieces.empty()) return;
    bool exited;
    {
      ::mlp_offload::MutexLock lock(&mu_);
      // Shutdown may have begun since the check above; it drains what is
      // queued, so refuse only if every worker has already gone.
      exited = workers_exited_ == static_cast<int>(workers_.size());
      if (!exited) {
        for (auto& p : pieces) pending_.push_back(std::move(p));
      }
    }
    if (exited) {
      for (auto& p : pieces) p.tracker->PieceDone(p.offset, Stopped());
    }
  }

  void Shutdown() override {
    {
      ::mlp_offload::MutexLock lock(&mu_);
      stopping_ = true;
    }
    // From a completion callback (a worker) joining would deadlock; the
    // workers still drain and exit, and the destructor joins.
    {
      ::mlp_offload::MutexLock lock(&mu_);
      for (const auto& id : worker_ids_) {
        if (id == std::this_thread::get_id()) return;
      }
    }
    ::mlp_offload::MutexLock lock(&join_mu_);
    JoinWorkersLocked();
  }

 private:
  static absl::Status Stopped() {
    return absl::FailedPreconditionError("threadpool engine is shut down");
  }

  void JoinWorkersLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(join_mu_) {
    for (auto& w : workers_) {
      if (w.joinable()) w.join();
    }
  }

  void WorkerLoop() {
    {
      ::mlp_offload::MutexLock lock(&mu_);
      worker_ids_.push_back(std::this_thread::get_id());
    }
    for (;;) {
      Piece piece;
      {
        ::mlp_offload::MutexLock lock(&mu_);
        mu_.Await([this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return stopping_ || !pending_.empty();
        });
        if (pending_.empty()) {
          ++workers_exited_;
          return;
        }
        piece = std::move(pending_.front());
        pending_.pop_front();
      }
      absl::Status status = Transfer(&piece);
      piece.tracker->PieceDone(piece.offset, std::move(status));
    }
  }

  // Runs the piece to completion: short transfers continue where they
  // stopped, EINTR retries at once, EAGAIN and a write that moved nothing
  // after RetryDelay (this worker waits; the others go on), end of file on
  // a read is an error.
  static absl::Status Transfer(Piece* piece) {
    const IoRequest& request = piece->tracker->request();
    const int fd = request.file->fd();
    while (piece->done < piece->length) {
      size_t len = piece->length - piece->done;
      if (const size_t cap = MaxTransferForTesting(); cap > 0)
        len = std::min(len, cap);
      char* buf = piece->buffer + piece->done;
      const off_t off = static_cast<off_t>(piece->offset + piece->done);
      ssize_t n = request.op == IoOp::kRead ? pread(fd, buf, len, off)
                                            : pwrite(fd, buf, len, off);
      int err = n < 0 ? errno : 0;
      if (n >= 0 && InjectEagainForTesting()) {
        n = -1;
        err = EAGAIN;
      }
      if (n < 0) {
        if ((err == EAGAIN || err == EINTR) &&
            ++piece->retries <= kMaxRetries) {
          if (err == EAGAIN) absl::SleepFor(RetryDelay(piece->retries));
          continue;
        }
        return TransferError(request.op, *request.file,
                             piece->offset + piece->done, err);
      }
      if (n == 0) {
        if (request.op == IoOp::kRead) return ShortTransferError(*piece);
        // A write that makes no progress: retry a bounded number of times.
        if (++piece->retries <= kMaxRetries) {
          absl::SleepFor(RetryDelay(piece->retries));
          continue;
        }
        return TransferError(request.op, *request.file,
                             piece->offset + piece->done, EIO);
      }
      piece->retries = 0;
      piece->done += static_cast<size_t>(n);
    }
    return absl::OkStatus();
  }

  const size_t block_size_;
  absl::Status start_status_;
  std::vector<std::thread> workers_;  // fixed after construction
  ::mlp_offload::Mutex join_mu_;

  ::mlp_offload::Mutex mu_;
  std::deque<Piece> pending_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int workers_exited_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::thread::id> worker_ids_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<IoEngine>> CreateThreadPoolEngine(
    const IoEngineOptions& options) {
  auto engine = std::make_unique<ThreadPoolEngine>(options);
  if (!engine->start_status().ok()) return engine->start_status();
  return engine;
}

}  // namespace internal_io
}  // namespace mlp_offload
