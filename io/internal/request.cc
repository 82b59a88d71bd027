// Request validation, splitting and completion tracking for the engines.
#include "io/internal/request.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <utility>

#include "absl/strings/str_cat.h"
#include "io/aligned_buffer.h"
#include "mlp_offload/base/status_macros.h"

namespace mlp_offload {
namespace internal_io {
namespace {

std::atomic<size_t> g_max_transfer{0};
std::atomic<int> g_eagain_every{0};
std::atomic<uint64_t> g_transfer_count{0};
std::atomic<int> g_ring_submit_error{0};

bool Aligned(uint64_t x) { return x % kDirectIoAlignment == 0; }

}  // namespace

const char* OpName(IoOp op) { return op == IoOp::kRead ? "read" : "write"; }

absl::Duration RetryDelay(int retries) {
  constexpr int kImmediate = 8;
  constexpr absl::Duration kFirst = absl::Microseconds(50);
  constexpr absl::Duration kMost = absl::Milliseconds(20);
  if (retries <= kImmediate) return absl::ZeroDuration();
  // 50 us << 9 already exceeds 20 ms: no shift past that.
  const int doublings = std::min(retries - kImmediate - 1, 10);
  return std::min(kMost, kFirst * (int64_t{1} << doublings));
}

std::string Where(const File& file, uint64_t offset) {
  return absl::StrCat(file.path(), " at offset ", offset);
}

absl::Status TransferError(IoOp op, const File& file, uint64_t offset,
                           int errno_value) {
  return ErrnoStatus(errno_value, OpName(op), Where(file, offset));
}

absl::Status ValidateRequest(const IoRequest& request) {
  if (request.file == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        OpName(request.op), " at offset ", request.offset, ": null file"));
  }
  if (request.buffer == nullptr && request.length > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(OpName(request.op), " ",
                     Where(*request.file, request.offset), ": null buffer"));
  }
  if (request.file->direct() &&
      (!Aligned(request.offset) || !Aligned(request.length) ||
       !Aligned(reinterpret_cast<uintptr_t>(request.buffer)))) {
    return absl::InvalidArgumentError(absl::StrCat(
        OpName(request.op), " ", Where(*request.file, request.offset),
        ": O_DIRECT needs offset (", request.offset, "), length (",
        request.length, ") and buffer address aligned to ",
        kDirectIoAlignment));
  }
  // Both bounds: a length above INT64_MAX would wrap the subtraction (and
  // SplitRequest's piece count) instead of being refused.
  if (request.length > static_cast<uint64_t>(INT64_MAX) ||
      request.offset > static_cast<uint64_t>(INT64_MAX) - request.length) {
    return absl::InvalidArgumentError(absl::StrCat(
        OpName(request.op), " ", Where(*request.file, request.offset),
        ": length ", request.length, " overflows the file offset"));
  }
  return absl::OkStatus();
}

RequestTracker::RequestTracker(const IoRequest& request, IoCallback done,
                               size_t pieces)
    : request_(request), done_(std::move(done)), remaining_(pieces) {}

void RequestTracker::PieceDone(uint64_t offset, absl::Status status) {
  absl::StatusOr<size_t> result;
  {
    ::mlp_offload::MutexLock lock(&mu_);
    if (!status.ok() && offset < error_offset_) {
      error_ = std::move(status);
      error_offset_ = offset;
    }
    if (--remaining_ > 0) return;
    if (error_.ok()) {
      result = request_.length;
    } else {
      result = error_;
    }
  }
  // Only the last piece gets here, so done_ is no longer shared.
  IoCallback done = std::move(done_);
  done(std::move(result));
}

std::vector<Piece> SplitRequest(const IoRequest& request, IoCallback done,
                                size_t block_size) {
  std::vector<Piece> pieces;
  if (request.length == 0) {
    done(size_t{0});
    return pieces;
  }
  const size_t count = (request.length + block_size - 1) / block_size;
  auto tracker =
      std::make_shared<RequestTracker>(request, std::move(done), count);
  pieces.reserve(count);
  char* const base = static_cast<char*>(request.buffer);
  for (size_t start = 0; start < request.length; start += block_size) {
    Piece piece;
    piece.tracker = tracker;
    piece.offset = request.offset + start;
    piece.length = std::min(block_size, request.length - start);
    piece.buffer = base + start;
    pieces.push_back(std::move(piece));
  }
  return pieces;
}

absl::Status ShortTransferError(const Piece& piece) {
  const IoRequest& request = piece.tracker->request();
  return absl::OutOfRangeError(absl::StrCat(
      OpName(request.op), " ", Where(*request.file, piece.offset + piece.done),
      ": unexpected end of file after ", piece.done, " of ", piece.length,
      " bytes of the block at offset ", piece.offset));
}

void SetMaxTransferForTesting(size_t bytes) { g_max_transfer.store(bytes); }
size_t MaxTransferForTesting() {
  return g_max_transfer.load(std::memory_order_relaxed);
}
void SetEagainEveryForTesting(int n) {
  g_transfer_count.store(0);
  g_eagain_every.store(n);
}
void SetRingSubmitErrorForTesting(int errno_value) {
  g_ring_submit_error.store(errno_value);
}
int RingSubmitErrorForTesting() {
  return g_ring_submit_error.load(std::memory_order_relaxed);
}
bool InjectEagainForTesting() {
  const int every = g_eagain_every.load(std::memory_order_relaxed);
  if (every <= 0) return false;
  return g_transfer_count.fetch_add(1) % every ==
         static_cast<uint64_t>(every - 1);
}

}  // namespace internal_io
}  // namespace mlp_offload
