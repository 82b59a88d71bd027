#include "io/shared_throttle.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "io/internal/delay_queue.h"
#include "io/internal/request.h"
#include "mlp_offload/base/mutex.h"
#include "mlp_offload/base/status_macros.h"

namespace mlp_offload {
namespace {

constexpr size_t kPiece = 1 << 20;
constexpr uint64_t kMagic = 0x4d4c50546872746cull;  // "MLPThrtl"

// The file's contents. All zeros is the initial state (clocks in the past,
// nobody streaming), so a file freshly extended by ftruncate is ready once
// its magic is claimed. The atomics are lock-free and address-free, hence
// valid across processes in a MAP_SHARED mapping.
struct SharedState {
  std::atomic<uint64_t> magic;
  // Per direction (IoOp), CLOCK_MONOTONIC ns at which the device is free.
  std::atomic<int64_t> next_free_ns[2];
  // Engines with I/O outstanding.
  std::atomic<int32_t> streaming;
};
static_assert(std::atomic<uint64_t>::is_always_lock_free, "");
static_assert(std::atomic<int64_t>::is_always_lock_free, "");
static_assert(std::atomic<int32_t>::is_always_lock_free, "");

int64_t MonotonicNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

class SharedThrottledEngine final : public IoEngine {
 public:
  SharedThrottledEngine(std::unique_ptr<IoEngine> inner,
                        const SharedThrottleOptions& options,
                        SharedState* state)
      : inner_(std::move(inner)),
        options_(options),
        rate_{options.read_bytes_per_sec, options.write_bytes_per_sec},
        state_(state) {}

  ~SharedThrottledEngine() override {
    Shutdown();
    {
      ::mlp_offload::MutexLock lock(&mu_);
      if (outstanding_ > 0) state_->streaming.fetch_sub(1);
    }
    munmap(state_, sizeof(SharedState));
  }

  std::string name() const override {
    return absl::StrCat("shared_throttle(", inner_->name(), ")");
  }

  void Submit(const IoRequest& request, IoCallback done) override {
    bool stopping;
    {
      ::mlp_offload::MutexLock lock(&mu_);
      stopping = stopping_;
    }
    if (stopping) {
      done(absl::FailedPreconditionError(
          "shared throttled engine is shut down"));
      return;
    }
    absl::Status valid = internal_io::ValidateRequest(request);
    if (!valid.ok()) {
      done(std::move(valid));
      return;
    }
    const int op = static_cast<int>(request.op);
    const double rate = rate_[op];
    Begin();
    // After the request's last piece: the stream ends before the caller
    // hears of it (who may then destroy this engine).
    IoCallback finish = [this, done = std::move(done)](
                            absl::StatusOr<size_t> result) mutable {
      End();
      done(std::move(result));
    };
    if (rate <= 0) {
      inner_->Submit(request, std::move(finish));
      return;
    }
    std::vector<internal_io::Piece> pieces =
        internal_io::SplitRequest(request, std::move(finish), kPiece);
    for (internal_io::Piece& piece : pieces) {
      const int streaming = std::max(1, state_->streaming.load());
      const double factor = 1.0 + options_.contention * (streaming - 1);
      const int64_t cost_ns = static_cast<int64_t>(
          static_cast<double>(piece.length) * factor / rate * 1e9);
      const int64_t now = MonotonicNs();
      int64_t start;
      int64_t cur = state_->next_free_ns[op].load();
      do {
        start = std::max(cur, now);
      } while (!state_->next_free_ns[op].compare_exchange_weak(
          cur, start + cost_ns));
      IoRequest part = request;
      part.offset = piece.offset;
      part.length = piece.length;
      part.buffer = piece.buffer;
      delays_.RunAt(absl::Now() + absl::Nanoseconds(start - now),
                    [this, part, tracker = piece.tracker]() {
                      const uint64_t offset = part.offset;
                      inner_->Submit(part, [tracker, offset](
                                               absl::StatusOr<size_t> result) {
                        tracker->PieceDone(offset, result.status());
                      });
                    });
    }
  }

  void Shutdown() override {
    {
      ::mlp_offload::MutexLock lock(&mu_);
      stopping_ = true;
    }
    delays_.Drain();
    inner_->Shutdown();
  }

  absl::Status RegisterBuffers(absl::Span<const iovec> buffers) override {
    return inner_->RegisterBuffers(buffers);
  }

 private:
  void Begin() {
    ::mlp_offload::MutexLock lock(&mu_);
    if (outstanding_++ == 0) state_->streaming.fetch_add(1);
  }
  void End() {
    ::mlp_offload::MutexLock lock(&mu_);
    if (--outstanding_ == 0) state_->streaming.fetch_sub(1);
  }

  std::unique_ptr<IoEngine> inner_;
  const SharedThrottleOptions options_;
  const double rate_[2];
  SharedState* const state_;
  ::mlp_offload::Mutex mu_;
  int64_t outstanding_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Last: drained before the rest goes away.
  internal_io::DelayQueue delays_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<IoEngine>> MakeSharedThrottledEngine(
    std::unique_ptr<IoEngine> inner, const SharedThrottleOptions& options) {
  if (!(options.contention >= 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared throttle ", options.state_path,
                     ": contention must be >= 0, got ", options.contention));
  }
  const int fd = open(options.state_path.c_str(),
                      O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) return ErrnoStatus(errno, "open", options.state_path);
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int e = errno;
    close(fd);
    return ErrnoStatus(e, "fstat", options.state_path);
  }
  // Extending with zeros is the initial state; a concurrent opener doing
  // the same is harmless. A larger file is someone else's.
  if (static_cast<size_t>(st.st_size) < sizeof(SharedState) &&
      ftruncate(fd, sizeof(SharedState)) != 0) {
    const int e = errno;
    close(fd);
    return ErrnoStatus(e, "ftruncate", options.state_path);
  }
  if (static_cast<size_t>(st.st_size) > sizeof(SharedState)) {
    close(fd);
    return absl::FailedPreconditionError(
        absl::StrCat(options.state_path, " is not a shared throttle state file",
                     " (", st.st_size, " bytes)"));
  }
  void* map = mmap(nullptr, sizeof(SharedState), PROT_READ | PROT_WRITE,
                   MAP_SHARED, fd, 0);
  const int e = errno;
  close(fd);
  if (map == MAP_FAILED) return ErrnoStatus(e, "mmap", options.state_path);
  auto* state = static_cast<SharedState*>(map);
  uint64_t magic = 0;
  if (!state->magic.compare_exchange_strong(magic, kMagic) &&
      magic != kMagic) {
    munmap(map, sizeof(SharedState));
    return absl::FailedPreconditionError(absl::StrCat(
        options.state_path, " is not a shared throttle state file"));
  }
  return std::unique_ptr<IoEngine>(
      new SharedThrottledEngine(std::move(inner), options, state));
}

}  // namespace mlp_offload
