// The io_uring engine: one ring per engine (one engine per tier), owned by a
// single event-loop thread.
//
// Why one thread owns the ring: liburing's submission and completion queues
// are not thread-safe, and sharing them between submitters and a reaper needs
// a lock around every SQE and a reaper woken for every submission. Instead,
// submitters only append pieces to a locked queue and poke an eventfd; the
// loop keeps a poll on that eventfd in the ring, so one
// io_uring_submit_and_wait both pushes new SQEs and sleeps until either a
// transfer completes or new work arrives. The loop follows liburing's
// io_uring-cp pattern: at most queue_depth pieces in flight, the piece pointer
// in user_data, every CQE consumed (failed ones too), short transfers and
// -EAGAIN resubmitted (after RetryDelay: a timed wait bounds the sleep).
#include <fcntl.h>
#include <liburing.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "io/internal/engines.h"
#include "io/internal/request.h"
#include "mlp_offload/base/clock.h"
#include "mlp_offload/base/mutex.h"
#include "mlp_offload/base/status_macros.h"
#include "mlp_offload/base/threads.h"

namespace mlp_offload {
namespace internal_io {
namespace {

// user_data of the eventfd poll; pieces are heap pointers, never this value.
constexpr uint64_t kWakeTag = 1;

// MAX_RW_COUNT (INT_MAX rounded down to a page): also fits the unsigned
// length liburing takes.
constexpr size_t kMaxKernelTransfer = 0x7ffff000;

// Failing ring submissions: back-off between attempts, and how long they
// may fail (with nothing completing) before new requests are refused.
constexpr absl::Duration kMinBackoff = absl::Microseconds(50);
constexpr absl::Duration kMaxBackoff = absl::Milliseconds(20);
constexpr absl::Duration kRingGiveUp = absl::Seconds(2);

class UringEngine final : public IoEngine {
 public:
  UringEngine(const IoEngineOptions& options, int event_fd)
      : queue_depth_(std::max(1u, options.queue_depth)),
        block_size_(options.block_size),
        event_fd_(event_fd) {}

  ~UringEngine() override {
    Shutdown();
    {
      ::mlp_offload::MutexLock lock(&join_mu_);
      if (loop_.joinable()) loop_.join();
    }
    if (initialized_) io_uring_queue_exit(&ring_);
    close(event_fd_);
  }

  absl::Status Init() {
    // +1: the eventfd poll is always in the ring besides the transfers.
    const int rc = io_uring_queue_init(queue_depth_ + 1, &ring_, 0);
    if (rc < 0) return ErrnoStatus(-rc, "io_uring_queue_init", "");
    initialized_ = true;
    ::mlp_offload::MutexLock lock(&join_mu_);
    absl::StatusOr<std::thread> loop =
        StartThread("the io_uring completion thread", [this] { Loop(); });
    if (!loop.ok()) return loop.status();
    loop_ = *std::move(loop);
    loop_id_ = loop_.get_id();
    return absl::OkStatus();
  }

  std::string name() const override { return "io_uring"; }

  void Submit(const IoRequest& request, IoCallback done) override {
    SubmitBatch(absl::MakeConstSpan(&request, 1), absl::MakeSpan(&done, 1));
  }

  void SubmitBatch(absl::Span<const IoRequest> requests,
                   absl::Span<IoCallback> done) override {
    if (requests.size() != done.size()) {
      FailMismatchedBatch(requests.size(), done);
      return;
    }
    std::vector<Piece> pieces;
    bool stopping;
    absl::Status broken;
    {
      ::mlp_offload::MutexLock lock(&mu_);
      stopping = stopping_;
      broken = broken_;
    }
    if (stopping) {
      for (auto& d : done) d(Stopped());
      return;
    }
    if (!broken.ok()) {
      for (size_t i = 0; i < requests.size(); ++i)
        done[i](RingError(requests[i], broken));
      return;
    }
    for (size_t i = 0; i < requests.size(); ++i) {
      absl::Status valid = ValidateRequest(requests[i]);
      if (!valid.ok()) {
        done[i](std::move(valid));
        continue;
      }
      std::vector<Piece> split =
          SplitRequest(requests[i], std::move(done[i]), block_size_);
      for (auto& p : split) pieces.push_back(std::move(p));
    }
    if (pieces.empty()) return;
    bool stopped = false;
    {
      ::mlp_offload::MutexLock lock(&mu_);
      // Shutdown may have started since the check above; it drains what is
      // queued, so only refuse if the loop has already gone.
      stopped = loop_exited_;
      if (!stopped) {
        for (auto& p : pieces) pending_.push_back(std::move(p));
      }
    }
    if (stopped) {
      for (auto& p : pieces) p.tracker->PieceDone(p.offset, Stopped());
      return;
    }
    Wake();
  }

  void Shutdown() override {
    {
      ::mlp_offload::MutexLock lock(&mu_);
      stopping_ = true;
    }
    Wake();
    // Called from a completion callback (the loop thread itself) it cannot
    // join; the loop still drains and exits, and the destructor joins.
    if (std::this_thread::get_id() == loop_id_) return;
    ::mlp_offload::MutexLock lock(&join_mu_);
    if (loop_.joinable()) loop_.join();
  }

  absl::Status RegisterBuffers(absl::Span<const iovec> buffers) override {
    ::mlp_offload::MutexLock lock(&mu_);
    if (!fixed_.empty()) {
      const int rc = io_uring_unregister_buffers(&ring_);
      if (rc < 0) return ErrnoStatus(-rc, "io_uring_unregister_buffers", "");
      fixed_.clear();
    }
    // The kernel takes no fixed buffer above 1 GiB (EFAULT): those stay
    // unregistered, and requests in them are plain reads and writes.
    std::vector<iovec> taken;
    for (const iovec& b : buffers) {
      if (b.iov_len <= kMaxFixedBufferBytes) taken.push_back(b);
    }
    if (taken.empty()) return absl::OkStatus();
    const int rc = io_uring_register_buffers(
        &ring_, taken.data(), static_cast<unsigned>(taken.size()));
    if (rc == -ENOMEM || rc == -EFAULT || rc == -EPERM || rc == -EOPNOTSUPP) {
      // Over RLIMIT_MEMLOCK, or a kernel that cannot pin these pages:
      // registration is an optimisation, so none (the contract).
      return absl::OkStatus();
    }
    if (rc < 0) {
      return ErrnoStatus(-rc, "io_uring_register_buffers",
                         absl::StrCat(taken.size(), " buffers"));
    }
    for (size_t i = 0; i < taken.size(); ++i) {
      const auto start = reinterpret_cast<uintptr_t>(taken[i].iov_base);
      fixed_[start] =
          FixedBuffer{start + taken[i].iov_len, static_cast<int>(i)};
    }
    return absl::OkStatus();
  }

 private:
  // The largest buffer io_uring registers (IORING_REGISTER_BUFFERS).
  static constexpr size_t kMaxFixedBufferBytes = size_t{1} << 30;
  struct FixedBuffer {
    uintptr_t end;
    int index;
  };

  static absl::Status Stopped() {
    return absl::FailedPreconditionError("io_uring engine is shut down");
  }

  // A request refused or abandoned because the ring cannot submit: the
  // ring's error, naming the request's operation, path and offset.
  static absl::Status RingError(const IoRequest& request,
                                const absl::Status& ring) {
    if (request.file == nullptr) return ring;
    return absl::Status(ring.code(),
                        absl::StrCat(OpName(request.op), " ",
                                     Where(*request.file, request.offset), ": ",
                                     ring.message()));
  }

  static void FailMismatchedBatch(size_t requests,
                                  absl::Span<IoCallback> done) {
    for (auto& d : done) {
      d(absl::InvalidArgumentError(absl::StrCat("SubmitBatch: ", requests,
                                                " requests but ", done.size(),
                                                " callbacks")));
    }
  }

  void Wake() {
    const uint64_t one = 1;
    // Cannot fail short of a counter overflow (2^64 - 1 pokes); a failed poke
    // would at worst delay pickup until the next completion.
    ssize_t n;
    do {
      n = write(event_fd_, &one, sizeof(one));
    } while (n < 0 && errno == EINTR);
  }

  // The buffer index if [addr, addr+len) lies inside a registered buffer.
  int FixedIndex(const char* addr, size_t len)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (fixed_.empty()) return -1;
    const auto start = reinterpret_cast<uintptr_t>(addr);
    auto it = fixed_.upper_bound(start);
    if (it == fixed_.begin()) return -1;
    --it;
    return start + len <= it->second.end ? it->second.index : -1;
  }

  void ArmWakePoll() {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    // The ring has queue_depth + 1 entries and at most queue_depth transfers
    // are queued, so there is always room for the poll.
    io_uring_prep_poll_add(sqe, event_fd_, POLLIN);
    io_uring_sqe_set_data64(sqe, kWakeTag);
  }

  void PrepPiece(Piece* piece, int fixed_index) {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    const IoRequest& request = piece->tracker->request();
    // Linux moves at most kMaxKernelTransfer bytes per read or write; the
    // rest of a longer piece is resubmitted, as after a short transfer.
    size_t len = std::min(piece->length - piece->done, kMaxKernelTransfer);
    if (const size_t cap = MaxTransferForTesting(); cap > 0)
      len = std::min(len, cap);
    char* buf = piece->buffer + piece->done;
    const uint64_t off = piece->offset + piece->done;
    const int fd = request.file->fd();
    if (fixed_index >= 0) {
      if (request.op == IoOp::kRead) {
        io_uring_prep_read_fixed(sqe, fd, buf, len, off, fixed_index);
      } else {
        io_uring_prep_write_fixed(sqe, fd, buf, len, off, fixed_index);
      }
    } else if (request.op == IoOp::kRead) {
      io_uring_prep_read(sqe, fd, buf, len, off);
    } else {
      io_uring_prep_write(sqe, fd, buf, len, off);
    }
    io_uring_sqe_set_data(sqe, piece);
  }

  // Returns the piece to the front of the queue (resubmission) or completes it.
  void HandleCompletion(Piece* raw, int res) {
    std::unique_ptr<Piece> piece(raw);
    const IoRequest& request = piece->tracker->request();
    if (res >= 0 && InjectEagainForTesting()) res = -EAGAIN;
    if (res == -EAGAIN || res == -EINTR ||
        (res == 0 && request.op == IoOp::kWrite)) {
      if (++piece->retries <= kMaxRetries) {
        if (res != -EINTR) {
          piece->not_before = MonoAfter(RetryDelay(piece->retries));
        }
        retry_.push_back(std::move(piece));
        return;
      }
      if (res == 0) res = -EIO;  // a write that never makes progress
    }
    if (res < 0) {
      piece->tracker->PieceDone(
          piece->offset, TransferError(request.op, *request.file,
                                       piece->offset + piece->done, -res));
      return;
    }
    if (res == 0) {  // a read at end of file: the rest cannot come
      piece->tracker->PieceDone(piece->offset, ShortTransferError(*piece));
      return;
    }
    piece->retries = 0;
    piece->done += static_cast<size_t>(res);
    if (piece->done < piece->length) {
      retry_.push_back(std::move(piece));
      return;
    }
    piece->tracker->PieceDone(piece->offset, absl::OkStatus());
  }

  // Shutdown while the ring cannot submit: once everything the kernel has
  // taken has completed, what is left sits in the submission queue unseen by
  // the kernel (it only takes SQEs inside io_uring_enter, which this thread
  // alone calls, and closing the ring discards them). Those pieces, and the
  // ones waiting to be resubmitted, fail with the ring's error and the loop
  // may exit: their buffers were never handed to the kernel. Returns false
  // (keep waiting) while not stopping or while the kernel holds a request.
  bool AbandonUnsubmittedOnShutdown(unsigned in_flight) {
    absl::Status broken;
    {
      ::mlp_offload::MutexLock lock(&mu_);
      if (!stopping_) return false;
      broken = broken_;
    }
    std::vector<Piece*> unsent;
    const io_uring_sq& sq = ring_.sq;
    for (unsigned i = io_uring_smp_load_acquire(sq.khead); i != sq.sqe_tail;
         ++i) {
      const uint64_t tag = sq.sqes[i & sq.ring_mask].user_data;
      if (tag != kWakeTag) unsent.push_back(reinterpret_cast<Piece*>(tag));
    }
    if (unsent.size() != in_flight) return false;
    std::deque<Piece> queued;  // raced in while the ring broke
    {
      ::mlp_offload::MutexLock lock(&mu_);
      loop_exited_ = true;
      queued.swap(pending_);
    }
    for (Piece* raw : unsent) {
      FailPiece(*raw, broken);
      delete raw;
    }
    for (auto& piece : retry_) FailPiece(*piece, broken);
    retry_.clear();
    for (Piece& p : queued) FailPiece(p, broken);
    return true;
  }

  // Completes a piece that never reached the kernel with the ring's error.
  static void FailPiece(Piece& p, const absl::Status& ring) {
    p.tracker->PieceDone(p.offset, RingError(p.tracker->request(), ring));
  }

  // Records the ring's state; when it breaks, the pieces queued but not yet
  // in the ring fail with the error (they never reached the kernel).
  void SetBroken(absl::Status status) {
    std::deque<Piece> failed;
    {
      ::mlp_offload::MutexLock lock(&mu_);
      broken_ = status;
      if (!status.ok()) failed.swap(pending_);
    }
    for (Piece& p : failed) FailPiece(p, status);
  }

  void DrainEventFd() {
    uint64_t value;
    // Non-blocking: the poll said it is readable, and a second wake that
    // raced with this read simply re-fires the next poll.
    (void)read(event_fd_, &value, sizeof(value));
  }

  void Loop() {
    ArmWakePoll();
    unsigned in_flight = 0;
    std::vector<io_uring_cqe*> cqes(2 * (queue_depth_ + 1));
    for (;;) {
      // Resubmissions go first: they are older than anything queued. One
      // waiting out its RetryDelay stays in its place until its time, which
      // bounds the wait below.
      std::optional<MonoTime> next_retry;
      const MonoTime now = MonoNow();
      for (auto it = retry_.begin();
           it != retry_.end() && in_flight < queue_depth_;) {
        if ((*it)->not_before > now) {
          if (!next_retry.has_value() || (*it)->not_before < *next_retry) {
            next_retry = (*it)->not_before;
          }
          ++it;
          continue;
        }
        Piece* piece = it->release();
        it = retry_.erase(it);
        int index;
        {
          ::mlp_offload::MutexLock lock(&mu_);
          index = FixedIndex(piece->buffer + piece->done,
                             piece->length - piece->done);
        }
        PrepPiece(piece, index);
        ++in_flight;
      }
      {
        ::mlp_offload::MutexLock lock(&mu_);
        while (in_flight < queue_depth_ && !pending_.empty()) {
          auto piece = std::make_unique<Piece>(std::move(pending_.front()));
          pending_.pop_front();
          const int index = FixedIndex(piece->buffer, piece->length);
          PrepPiece(piece.release(), index);
          ++in_flight;
        }
        if (stopping_ && pending_.empty() && retry_.empty() && in_flight == 0) {
          loop_exited_ = true;
          break;
        }
      }
      const int injected = RingSubmitErrorForTesting();
      int rc;
      if (injected != 0) {
        rc = -injected;
      } else if (next_retry.has_value()) {
        // Wakes for the first retry due, if nothing completes before.
        const int64_t ns = std::max<int64_t>(
            0, std::chrono::duration_cast<std::chrono::nanoseconds>(
                   *next_retry - MonoNow())
                   .count());
        __kernel_timespec ts;
        ts.tv_sec = ns / 1000000000;
        ts.tv_nsec = ns % 1000000000;
        io_uring_cqe* first = nullptr;
        rc = io_uring_submit_and_wait_timeout(&ring_, &first, 1, &ts, nullptr);
        if (rc == -ETIME) rc = 0;  // a retry is due
      } else {
        rc = io_uring_submit_and_wait(&ring_, 1);
      }
      const unsigned n = io_uring_peek_batch_cqe(
          &ring_, cqes.data(), static_cast<unsigned>(cqes.size()));
      if (rc >= 0 || rc == -EINTR || n > 0) {
        failing_ = false;
        backoff_ = absl::ZeroDuration();
        if (rc >= 0 && ring_broken_) {
          ring_broken_ = false;
          SetBroken(absl::OkStatus());
        }
      } else {
        // The submission failed and nothing completed. The SQEs stay in the
        // ring and go in with the next submission that works: retry, backing
        // off (no spinning). EAGAIN (the kernel is short of memory) and
        // EBUSY (the completion ring is full) pass; anything still failing
        // after kRingGiveUp makes the engine refuse what has not reached the
        // ring yet and every new request, naming the error, until a
        // submission works again. What is already in the ring stays there
        // (its buffers may still be in the kernel's hands) until the ring
        // works or the engine shuts down (AbandonUnsubmittedOnShutdown).
        const MonoTime now = MonoNow();
        if (!failing_) {
          failing_ = true;
          failing_since_ = now;
        }
        backoff_ = std::min(kMaxBackoff, std::max(kMinBackoff, backoff_ * 2));
        if (!ring_broken_ &&
            now - failing_since_ >= ToMonoDuration(kRingGiveUp)) {
          ring_broken_ = true;
          SetBroken(ErrnoStatus(
              -rc, "io_uring_enter",
              absl::StrCat(
                  "submitting to the ring for ",
                  absl::FormatDuration(ToAbslDuration(now - failing_since_)))));
        }
        absl::SleepFor(backoff_);
        if (ring_broken_ && AbandonUnsubmittedOnShutdown(in_flight)) break;
      }
      bool rearm = false;
      for (unsigned i = 0; i < n; ++i) {
        const uint64_t tag = io_uring_cqe_get_data64(cqes[i]);
        const int res = cqes[i]->res;
        if (tag == kWakeTag) {
          rearm = true;
          continue;
        }
        // The timeout liburing adds to a timed wait on kernels without
        // IORING_FEAT_EXT_ARG: not a piece.
        if (tag == LIBURING_UDATA_TIMEOUT) continue;
        --in_flight;
        HandleCompletion(static_cast<Piece*>(io_uring_cqe_get_data(cqes[i])),
                         res);
      }
      io_uring_cq_advance(&ring_, n);
      if (rearm) {
        DrainEventFd();
        ArmWakePoll();
      }
    }
    // The wake poll is still armed; io_uring_queue_exit cancels it, and it
    // references no memory of ours.
  }

  const unsigned queue_depth_;
  const size_t block_size_;
  const int event_fd_;
  io_uring ring_;
  bool initialized_ = false;
  ::mlp_offload::Mutex join_mu_;
  std::thread loop_ ABSL_GUARDED_BY(join_mu_);
  // Written once before any request exists; read by Shutdown.
  std::thread::id loop_id_;

  ::mlp_offload::Mutex mu_;
  std::deque<Piece> pending_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool loop_exited_ ABSL_GUARDED_BY(mu_) = false;
  // Not OK while the ring cannot submit (see Loop).
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
  // Registered buffers by start address.
  std::map<uintptr_t, FixedBuffer> fixed_ ABSL_GUARDED_BY(mu_);

  // Loop thread only: pieces to resubmit (short transfers, EAGAIN).
  std::deque<std::unique_ptr<Piece>> retry_;
  // Loop thread only: since when submissions have failed without anything
  // completing (if failing_), and the current back-off.
  bool failing_ = false;
  MonoTime failing_since_;
  absl::Duration backoff_ = absl::ZeroDuration();
  bool ring_broken_ = false;  // mirrors !broken_.ok(), without the lock
};

}  // namespace

absl::StatusOr<std::unique_ptr<IoEngine>> CreateUringEngine(
    const IoEngineOptions& options) {
  std::string reason;
  if (!IoUringAvailable(&reason)) return absl::UnavailableError(reason);
  const int event_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (event_fd < 0)
    return ErrnoStatus(errno, "eventfd", "for the io_uring engine");
  auto engine = std::make_unique<UringEngine>(options, event_fd);
  absl::Status status = engine->Init();
  if (absl::IsResourceExhausted(status)) return status;  // a thread
  if (!status.ok()) return absl::UnavailableError(status.message());
  return engine;
}

}  // namespace internal_io

bool IoUringAvailable(std::string* reason) {
  auto set_reason = [reason](std::string why) {
    if (reason != nullptr) *reason = std::move(why);
  };
  const char* disable = getenv("MLP_OFFLOAD_DISABLE_IO_URING");
  if (disable != nullptr && disable[0] != '\0' &&
      std::strcmp(disable, "0") != 0) {
    set_reason(
        absl::StrCat("disabled by MLP_OFFLOAD_DISABLE_IO_URING=", disable));
    return false;
  }
  io_uring ring;
  const int rc = io_uring_queue_init(2, &ring, 0);
  if (rc < 0) {
    set_reason(absl::StrCat("io_uring_queue_init: ", std::strerror(-rc)));
    return false;
  }
  // IORING_OP_READ/WRITE/POLL_ADD need kernel 5.6; older rings fall back.
  bool ok = true;
  io_uring_probe* probe = io_uring_get_probe_ring(&ring);
  if (probe == nullptr) {
    ok = false;
    set_reason("io_uring_get_probe_ring failed (kernel older than 5.6)");
  } else {
    for (int op : {IORING_OP_READ, IORING_OP_WRITE, IORING_OP_POLL_ADD,
                   IORING_OP_READ_FIXED, IORING_OP_WRITE_FIXED}) {
      if (!io_uring_opcode_supported(probe, op)) {
        ok = false;
        set_reason(absl::StrCat("io_uring opcode ", op,
                                " not supported by the kernel"));
        break;
      }
    }
    io_uring_free_probe(probe);
  }
  io_uring_queue_exit(&ring);
  if (ok) set_reason("");
  return ok;
}

}  // namespace mlp_offload
