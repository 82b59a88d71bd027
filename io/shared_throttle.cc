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

#include "absl/strings/str_cat.h"
#include "io/internal/paced_engine.h"
#include "mlp_offload/base/clock.h"
#include "mlp_offload/base/status_macros.h"

namespace mlp_offload {
namespace {

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

// The device's clocks, in the shared file. Reserve is the local throttle's
// virtual scheduling done with a compare-and-swap on the shared clock, each
// piece costing (1 + contention (k - 1)) times its size at the cap, k the
// engines streaming when it is reserved.
class SharedClock final : public internal_io::PaceClock {
 public:
  SharedClock(const SharedThrottleOptions& options, SharedState* state)
      : rate_{options.read_bytes_per_sec, options.write_bytes_per_sec},
        contention_(options.contention),
        state_(state) {}
  ~SharedClock() override { munmap(state_, sizeof(SharedState)); }

  bool Capped(IoOp op) const override {
    return rate_[static_cast<int>(op)] > 0;
  }

  MonoTime Reserve(IoOp op, size_t bytes) override {
    const int o = static_cast<int>(op);
    const int streaming = std::max(1, state_->streaming.load());
    const double factor = 1.0 + contention_ * (streaming - 1);
    const int64_t cost_ns = static_cast<int64_t>(static_cast<double>(bytes) *
                                                 factor / rate_[o] * 1e9);
    const int64_t now = MonotonicNs();
    int64_t start;
    int64_t cur = state_->next_free_ns[o].load();
    do {
      start = std::max(cur, now);
    } while (
        !state_->next_free_ns[o].compare_exchange_weak(cur, start + cost_ns));
    return MonoNow() + std::chrono::duration_cast<MonoClock::duration>(
                           std::chrono::nanoseconds(start - now));
  }

  void StreamStarts() override { state_->streaming.fetch_add(1); }
  void StreamStops() override { state_->streaming.fetch_sub(1); }

 private:
  const double rate_[2];
  const double contention_;
  SharedState* const state_;
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
  if (!state->magic.compare_exchange_strong(magic, kMagic) && magic != kMagic) {
    munmap(map, sizeof(SharedState));
    return absl::FailedPreconditionError(absl::StrCat(
        options.state_path, " is not a shared throttle state file"));
  }
  return internal_io::MakePacedEngine(
      std::move(inner), std::make_unique<SharedClock>(options, state),
      "shared_throttle");
}

}  // namespace mlp_offload
