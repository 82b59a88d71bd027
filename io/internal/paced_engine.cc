#include "io/internal/paced_engine.h"

#include <atomic>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "io/internal/delay_queue.h"
#include "io/internal/request.h"
#include "mlp_offload/base/mutex.h"

namespace mlp_offload {
namespace internal_io {
namespace {

class PacedEngine final : public IoEngine {
 public:
  PacedEngine(std::unique_ptr<IoEngine> inner, std::unique_ptr<PaceClock> clock,
              std::string name)
      : inner_(std::move(inner)),
        clock_(std::move(clock)),
        name_(std::move(name)) {}

  ~PacedEngine() override {
    Shutdown();
    ::mlp_offload::MutexLock lock(&mu_);
    if (outstanding_ > 0) clock_->StreamStops();
  }

  std::string name() const override {
    return absl::StrCat(name_, "(", inner_->name(), ")");
  }

  void Submit(const IoRequest& request, IoCallback done) override {
    bool stopping;
    {
      ::mlp_offload::MutexLock lock(&mu_);
      stopping = stopping_;
    }
    if (stopping) {
      done(absl::FailedPreconditionError(
          absl::StrCat(name_, " engine is shut down")));
      return;
    }
    absl::Status valid = ValidateRequest(request);
    if (!valid.ok()) {
      done(std::move(valid));
      return;
    }
    Begin();
    // After the request's last piece the stream ends before the caller hears
    // of it (who may then destroy this engine).
    IoCallback finish =
        [this, done = std::move(done)](absl::StatusOr<size_t> result) mutable {
          End();
          done(std::move(result));
        };
    if (!clock_->Capped(request.op)) {
      inner_->Submit(request, std::move(finish));
      return;
    }
    if (Interrupted()) {
      finish(Cancelled());
      return;
    }
    std::vector<Piece> pieces =
        SplitRequest(request, std::move(finish), kPaceChunk);
    for (Piece& piece : pieces) {
      const absl::StatusOr<MonoTime> release =
          clock_->Reserve(request.op, piece.length);
      if (!release.ok()) {
        piece.tracker->PieceDone(piece.offset, release.status());
        continue;
      }
      IoRequest part = request;
      part.offset = piece.offset;
      part.length = piece.length;
      part.buffer = piece.buffer;
      delays_.RunAt(*release, [this, part, tracker = piece.tracker]() {
        const uint64_t offset = part.offset;
        if (Interrupted()) {
          tracker->PieceDone(offset, Cancelled());
          return;
        }
        inner_->Submit(part, [tracker, offset](absl::StatusOr<size_t> result) {
          tracker->PieceDone(offset, result.status());
        });
      });
    }
    // An interruption that came after the check above found these pieces
    // not yet queued: they are hurried too.
    if (Interrupted()) delays_.Hurry();
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

  // Queued pieces run now and, seeing the flag, fail; the device's clock
  // keeps the time they had reserved (they may have been another process's
  // turn).
  void SetInterrupted(bool interrupted) override {
    interrupted_.store(interrupted);
    if (interrupted) {
      delays_.Hurry();
      clock_->Interrupted();
    }
    inner_->SetInterrupted(interrupted);
  }

 private:
  bool Interrupted() const { return interrupted_.load(); }
  absl::Status Cancelled() const {
    return absl::CancelledError(
        absl::StrCat(name_,
                     ": interrupted before the bandwidth cap let the "
                     "request go to the device"));
  }

  void Begin() {
    ::mlp_offload::MutexLock lock(&mu_);
    if (outstanding_++ == 0) clock_->StreamStarts();
  }
  void End() {
    ::mlp_offload::MutexLock lock(&mu_);
    if (--outstanding_ == 0) clock_->StreamStops();
  }

  std::unique_ptr<IoEngine> inner_;
  std::unique_ptr<PaceClock> clock_;
  const std::string name_;
  ::mlp_offload::Mutex mu_;
  int64_t outstanding_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Not under mu_: End() holds that while the shared clock's StreamStops
  // may wait for its file's lock.
  std::atomic<bool> interrupted_{false};
  // Last: drained before the rest goes away.
  DelayQueue delays_;
};

}  // namespace

std::unique_ptr<IoEngine> MakePacedEngine(std::unique_ptr<IoEngine> inner,
                                          std::unique_ptr<PaceClock> clock,
                                          std::string name) {
  return std::make_unique<PacedEngine>(std::move(inner), std::move(clock),
                                       std::move(name));
}

}  // namespace internal_io
}  // namespace mlp_offload
