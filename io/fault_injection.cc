// The fault-injecting and bandwidth-throttling engine wrappers.
#include "io/fault_injection.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/types/optional.h"
#include "io/aligned_buffer.h"
#include "io/internal/delay_queue.h"
#include "io/internal/paced_engine.h"
#include "io/internal/request.h"
#include "mlp_offload/base/clock.h"
#include "mlp_offload/base/mutex.h"
#include "mlp_offload/base/status_macros.h"

namespace mlp_offload {

using internal_io::DelayQueue;
using internal_io::OpName;
using internal_io::Where;

struct FaultInjectingEngine::Impl {
  struct ActiveFault {
    FaultSpec spec;
    int seen = 0;  // matching requests so far
  };

  std::unique_ptr<IoEngine> inner;
  ::mlp_offload::Mutex mu;
  std::vector<ActiveFault> faults ABSL_GUARDED_BY(mu);
  int fired ABSL_GUARDED_BY(mu) = 0;
  bool stopping ABSL_GUARDED_BY(mu) = false;
  // Declared last: destroyed (drained) first, while `inner` still exists.
  DelayQueue delays;

  // The fault that hits `request`, if any. Every matching fault counts the
  // request, so each fault's `nth` is independent of the others.
  absl::optional<FaultSpec> Match(const IoRequest& request) {
    ::mlp_offload::MutexLock lock(&mu);
    absl::optional<FaultSpec> hit;
    for (ActiveFault& f : faults) {
      if (f.spec.sync || f.spec.op != request.op) continue;
      if (!f.spec.path_substring.empty() &&
          request.file->path().find(f.spec.path_substring) ==
              std::string::npos) {
        continue;
      }
      const int index = f.seen++;
      if (!hit.has_value() && (f.spec.nth < 0 || f.spec.nth == index))
        hit = f.spec;
    }
    if (hit.has_value()) ++fired;
    return hit;
  }
};

FaultInjectingEngine::FaultInjectingEngine(std::unique_ptr<IoEngine> inner)
    : impl_(std::make_unique<Impl>()) {
  impl_->inner = std::move(inner);
}

FaultInjectingEngine::~FaultInjectingEngine() { Shutdown(); }

void FaultInjectingEngine::AddFault(const FaultSpec& fault) {
  ::mlp_offload::MutexLock lock(&impl_->mu);
  impl_->faults.push_back({fault, 0});
}

void FaultInjectingEngine::ClearFaults() {
  ::mlp_offload::MutexLock lock(&impl_->mu);
  impl_->faults.clear();
}

int FaultInjectingEngine::fired() const {
  ::mlp_offload::MutexLock lock(&impl_->mu);
  return impl_->fired;
}

absl::Status FaultInjectingEngine::SyncFault(const File& file) {
  ::mlp_offload::MutexLock lock(&impl_->mu);
  for (Impl::ActiveFault& f : impl_->faults) {
    if (!f.spec.sync || f.spec.kind != FaultSpec::Kind::kError) continue;
    if (!f.spec.path_substring.empty() &&
        file.path().find(f.spec.path_substring) == std::string::npos) {
      continue;
    }
    const int index = f.seen++;
    if (f.spec.nth < 0 || f.spec.nth == index) {
      ++impl_->fired;
      return ErrnoStatus(f.spec.error, "fdatasync (injected)", file.path());
    }
  }
  return absl::OkStatus();
}

std::string FaultInjectingEngine::name() const {
  return absl::StrCat("fault(", impl_->inner->name(), ")");
}

void FaultInjectingEngine::Submit(const IoRequest& request, IoCallback done) {
  bool stopping;
  {
    ::mlp_offload::MutexLock lock(&impl_->mu);
    stopping = impl_->stopping;
  }
  if (stopping) {
    done(absl::FailedPreconditionError("fault-injecting engine is shut down"));
    return;
  }
  absl::Status valid = internal_io::ValidateRequest(request);
  if (!valid.ok()) {
    done(std::move(valid));
    return;
  }
  absl::optional<FaultSpec> fault = impl_->Match(request);
  IoEngine* inner = impl_->inner.get();
  if (!fault.has_value()) {
    inner->Submit(request, std::move(done));
    return;
  }
  switch (fault->kind) {
    case FaultSpec::Kind::kError:
      done(ErrnoStatus(fault->error,
                       absl::StrCat(OpName(request.op), " (injected)"),
                       Where(*request.file, request.offset)));
      return;
    case FaultSpec::Kind::kShortTransfer: {
      size_t half = request.length / 2;
      if (request.file->direct()) half -= half % kDirectIoAlignment;
      IoRequest partial = request;
      partial.length = half;
      inner->Submit(partial, [request, half, done = std::move(done)](
                                 absl::StatusOr<size_t> result) {
        if (!result.ok()) {
          done(std::move(result));
          return;
        }
        done(absl::DataLossError(
            absl::StrCat("short ", OpName(request.op), " (injected) ",
                         Where(*request.file, request.offset), ": ", half,
                         " of ", request.length, " bytes transferred")));
      });
      return;
    }
    case FaultSpec::Kind::kDelay:
      impl_->delays.RunAt(MonoAfter(fault->delay),
                          [inner, request, done = std::move(done)]() mutable {
                            inner->Submit(request, std::move(done));
                          });
      return;
  }
}

void FaultInjectingEngine::Shutdown() {
  {
    ::mlp_offload::MutexLock lock(&impl_->mu);
    impl_->stopping = true;
  }
  // Delayed requests still reach the inner engine, which then drains them.
  impl_->delays.Drain();
  impl_->inner->Shutdown();
}

absl::Status FaultInjectingEngine::RegisterBuffers(
    absl::Span<const iovec> buffers) {
  return impl_->inner->RegisterBuffers(buffers);
}

void FaultInjectingEngine::SetInterrupted(bool interrupted) {
  impl_->inner->SetInterrupted(interrupted);
}

namespace {

// One engine's own clocks, one per direction (one for both when half
// duplex). Virtual scheduling (GCRA without burst): each piece is released
// when the bytes before it have had their time at the capped rate. An idle
// period does not bank credit, since the clock restarts from now.
class LocalClock final : public internal_io::PaceClock {
 public:
  LocalClock(double read_bps, double write_bps, bool half_duplex)
      : rate_{read_bps, write_bps}, half_duplex_(half_duplex) {}

  bool Capped(IoOp op) const override {
    return rate_[static_cast<int>(op)] > 0;
  }

  absl::StatusOr<MonoTime> Reserve(IoOp op, size_t bytes) override {
    ::mlp_offload::MutexLock lock(&mu_);
    MonoTime& next = next_release_[half_duplex_ ? 0 : static_cast<int>(op)];
    const MonoTime release = std::max(next, MonoNow());
    next = release +
           std::chrono::duration_cast<MonoClock::duration>(
               std::chrono::duration<double>(static_cast<double>(bytes) /
                                             rate_[static_cast<int>(op)]));
    return release;
  }

  // The queued pieces' time is given back: the device is free once the
  // pieces already released are through, at most one piece from now.
  void Interrupted() override {
    ::mlp_offload::MutexLock lock(&mu_);
    const MonoTime now = MonoNow();
    for (int o = 0; o < 2; ++o) {
      if (rate_[o] <= 0) continue;
      const MonoTime last_piece_done =
          now +
          std::chrono::duration_cast<MonoClock::duration>(
              std::chrono::duration<double>(
                  static_cast<double>(internal_io::kPaceChunk) / rate_[o]));
      MonoTime& next = next_release_[half_duplex_ ? 0 : o];
      next = std::min(next, last_piece_done);
    }
  }

 private:
  const double rate_[2];  // bytes/s, indexed by IoOp
  const bool half_duplex_;
  ::mlp_offload::Mutex mu_;
  MonoTime next_release_[2] ABSL_GUARDED_BY(mu_) = {MonoTime::min(),
                                                    MonoTime::min()};
};

}  // namespace

std::unique_ptr<IoEngine> MakeThrottledEngine(std::unique_ptr<IoEngine> inner,
                                              double read_bytes_per_sec,
                                              double write_bytes_per_sec,
                                              bool half_duplex) {
  return internal_io::MakePacedEngine(
      std::move(inner),
      std::make_unique<LocalClock>(read_bytes_per_sec, write_bytes_per_sec,
                                   half_duplex),
      "throttle");
}

}  // namespace mlp_offload
