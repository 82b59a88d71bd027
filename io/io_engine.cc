// IoFuture, the IoEngine defaults, and the engine factory.
#include "io/io_engine.h"

#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "io/aligned_buffer.h"
#include "io/internal/engines.h"
#include "mlp_offload/base/mutex.h"

namespace mlp_offload {
namespace {

// Largest block_size: liburing takes a piece's length as an unsigned int, and
// a piece's count and offsets must not wrap in size_t; 1 GiB is far past the
// size where larger pieces stop helping.
constexpr size_t kMaxBlockSize = size_t{1} << 30;

}  // namespace

struct IoFuture::State {
  ::mlp_offload::Mutex mu;
  bool ready ABSL_GUARDED_BY(mu) = false;
  absl::StatusOr<size_t> result ABSL_GUARDED_BY(mu);
};

IoFuture::IoFuture() : state_(std::make_shared<State>()) {}

absl::StatusOr<size_t> IoFuture::Wait() const {
  ::mlp_offload::MutexLock lock(&state_->mu);
  State* state = state_.get();
  state->mu.Await([state]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(state->mu) {
    return state->ready;
  });
  return state_->result;
}

bool IoFuture::Ready() const {
  ::mlp_offload::MutexLock lock(&state_->mu);
  return state_->ready;
}

void IoFuture::Set(absl::StatusOr<size_t> result) const {
  ::mlp_offload::MutexLock lock(&state_->mu);
  // Engines complete each request exactly once; a second Set is a bug in the
  // caller and is ignored so the first outcome stays observable.
  if (state_->ready) return;
  state_->result = std::move(result);
  state_->ready = true;
}

IoCallback IoFuture::AsCallback() const {
  return [future = *this](absl::StatusOr<size_t> result) {
    future.Set(std::move(result));
  };
}

void IoEngine::SubmitBatch(absl::Span<const IoRequest> requests,
                           absl::Span<IoCallback> done) {
  if (requests.size() != done.size()) {
    for (auto& d : done) {
      d(absl::InvalidArgumentError(
          absl::StrCat("SubmitBatch: ", requests.size(), " requests but ",
                       done.size(), " callbacks")));
    }
    return;
  }
  for (size_t i = 0; i < requests.size(); ++i)
    Submit(requests[i], std::move(done[i]));
}

absl::Status IoEngine::RegisterBuffers(absl::Span<const iovec> buffers) {
  return absl::OkStatus();
}

IoFuture IoEngine::Submit(const IoRequest& request) {
  IoFuture future;
  Submit(request, future.AsCallback());
  return future;
}

absl::StatusOr<std::unique_ptr<IoEngine>> CreateIoEngine(
    const IoEngineOptions& options) {
  if (options.queue_depth == 0 || options.queue_depth > kMaxQueueDepth) {
    return absl::InvalidArgumentError(
        absl::StrCat("CreateIoEngine: queue_depth ", options.queue_depth,
                     " must be in [1, ", kMaxQueueDepth, "]"));
  }
  if (options.num_threads < 1 || options.num_threads > kMaxIoThreads) {
    return absl::InvalidArgumentError(
        absl::StrCat("CreateIoEngine: num_threads ", options.num_threads,
                     " must be in [1, ", kMaxIoThreads, "]"));
  }
  // Pieces of an O_DIRECT request must stay aligned.
  if (options.block_size == 0 || options.block_size % kDirectIoAlignment != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("CreateIoEngine: block_size ", options.block_size,
                     " must be a positive multiple of ", kDirectIoAlignment));
  }
  if (options.block_size > kMaxBlockSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("CreateIoEngine: block_size ", options.block_size,
                     " is above the limit of ", kMaxBlockSize, " (1 GiB)"));
  }
  switch (options.kind) {
    case IoEngineOptions::Kind::kUring:
      return internal_io::CreateUringEngine(options);
    case IoEngineOptions::Kind::kThreadPool:
      return internal_io::CreateThreadPoolEngine(options);
    case IoEngineOptions::Kind::kAuto: {
      absl::StatusOr<std::unique_ptr<IoEngine>> uring =
          internal_io::CreateUringEngine(options);
      if (uring.ok()) return uring;
      return internal_io::CreateThreadPoolEngine(options);
    }
  }
  return absl::InvalidArgumentError("CreateIoEngine: unknown engine kind");
}

}  // namespace mlp_offload
