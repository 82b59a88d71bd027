// Shared by the engines: request validation, splitting a request into
// block-size pieces, gathering the pieces' outcomes into one completion, and
// test hooks that force the rare kernel behaviours (short transfers, EAGAIN).
#ifndef MLP_OFFLOAD_IO_INTERNAL_REQUEST_H_
#define MLP_OFFLOAD_IO_INTERNAL_REQUEST_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "io/io_engine.h"
#include "mlp_offload/base/clock.h"
#include "mlp_offload/base/mutex.h"

namespace mlp_offload {
namespace internal_io {

// "read" / "write".
const char* OpName(IoOp op);
// "<path> at offset <offset>", the object of every error message.
std::string Where(const File& file, uint64_t offset);
// The error for a failed transfer, naming the operation, path and offset.
absl::Status TransferError(IoOp op, const File& file, uint64_t offset,
                           int errno_value);

// InvalidArgument (naming op, path, offset) for a null file or buffer, or for
// an offset, length or address that O_DIRECT on `file` would reject.
absl::Status ValidateRequest(const IoRequest& request);

// Gathers the outcomes of a request's pieces and runs the callback once, after
// the last piece, with the first error (lowest offset wins among errors seen)
// or the full length.
class RequestTracker {
 public:
  RequestTracker(const IoRequest& request, IoCallback done, size_t pieces);
  const IoRequest& request() const { return request_; }
  // Records one piece; the call that records the last one runs the callback
  // (on the calling thread, with no lock held).
  void PieceDone(uint64_t offset, absl::Status status);

 private:
  const IoRequest request_;
  IoCallback done_;
  ::mlp_offload::Mutex mu_;
  size_t remaining_ ABSL_GUARDED_BY(mu_);
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  uint64_t error_offset_ ABSL_GUARDED_BY(mu_) = UINT64_MAX;
};

// One block-size part of a request, as the engines move it through the
// kernel. `done` counts bytes already transferred (short transfers resume).
struct Piece {
  std::shared_ptr<RequestTracker> tracker;
  uint64_t offset = 0;
  size_t length = 0;
  char* buffer = nullptr;
  size_t done = 0;
  int retries = 0;  // consecutive EAGAIN / zero-byte writes
  // Not resubmitted before (io_uring: a retry waiting out RetryDelay).
  MonoTime not_before{};
};

// Consecutive EAGAINs (or zero-byte writes) after which a piece fails instead
// of being resubmitted forever: about 20 s of retries (RetryDelay).
inline constexpr int kMaxRetries = 1000;

// The wait before the `retries`-th consecutive retry of a piece after EAGAIN
// (the kernel short of memory, a file system's transient refusal) or a
// write that moved nothing: none for the first few, then doubling from
// 50 us to 20 ms, so a shortage that lasts is waited out (about 20 s in
// all, kMaxRetries) instead of spun through in a few milliseconds. EINTR
// retries at once.
absl::Duration RetryDelay(int retries);

// Splits `request` into pieces of at most `block_size` bytes sharing one
// tracker. A zero-length request yields no pieces and completes at once.
std::vector<Piece> SplitRequest(const IoRequest& request, IoCallback done,
                                size_t block_size);

// Builds the error of a piece that stopped short (a read at end of file):
// OutOfRange naming op, path, offset and how far it got.
absl::Status ShortTransferError(const Piece& piece);

// Test hooks (process-wide; 0 turns them off). The engines consult them on
// every transfer so tests can drive the resubmission paths through the real
// kernel: a cap on the bytes handed to one read/write call, and every Nth
// transfer reported as EAGAIN (after it actually ran: resubmitting a read or a
// write of the same bytes is idempotent).
void SetMaxTransferForTesting(size_t bytes);
size_t MaxTransferForTesting();
void SetEagainEveryForTesting(int n);
bool InjectEagainForTesting();
// The io_uring engine's ring submission (io_uring_enter) fails with
// `errno_value` instead of being made, until set back to 0: the SQEs stay
// queued in the ring and go in with the first real submission after.
void SetRingSubmitErrorForTesting(int errno_value);
int RingSubmitErrorForTesting();

}  // namespace internal_io
}  // namespace mlp_offload

#endif  // MLP_OFFLOAD_IO_INTERNAL_REQUEST_H_
