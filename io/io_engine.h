// Asynchronous reads and writes of byte ranges of files. Every request
// completes exactly once with its own status and byte count.
//
// Engines: io_uring (liburing; the default), a pread/pwrite thread pool (the
// fallback when io_uring_setup fails), and wrappers that inject faults or
// throttle bandwidth. Knows nothing of optimizers.
#ifndef MLP_OFFLOAD_IO_IO_ENGINE_H_
#define MLP_OFFLOAD_IO_IO_ENGINE_H_

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "io/file.h"

namespace mlp_offload {

enum class IoOp : uint8_t { kRead, kWrite };

struct IoRequest {
  IoOp op = IoOp::kRead;
  File* file = nullptr;  // must outlive the request
  uint64_t offset = 0;   // for O_DIRECT files: multiple of kDirectIoAlignment
  size_t length = 0;     // likewise (the engine rejects misaligned direct I/O)
  void* buffer = nullptr;  // likewise aligned; must outlive the request
};

// Called exactly once per request: the number of bytes transferred (always ==
// length on success; a short transfer that cannot be completed, e.g. a read
// past EOF, is an error) or the error, whose message names the operation, the
// path and the offset. Usually on an engine thread; on the submitting thread,
// inside Submit/SubmitBatch, for a request finished at once (invalid, of
// length 0, after Shutdown or on a broken ring, an injected error), and on
// the thread that calls SetInterrupted for requests a throttle held back. So
// a callback must not take a lock that its submitter holds while submitting.
using IoCallback = std::function<void(absl::StatusOr<size_t>)>;

// The result of one request, waitable. Copyable handle to shared state.
class IoFuture {
 public:
  IoFuture();
  // Blocks until the request completes.
  absl::StatusOr<size_t> Wait() const;
  bool Ready() const;
  // Completes the future (used by engines).
  void Set(absl::StatusOr<size_t> result) const;
  IoCallback AsCallback() const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

// Bounds of IoEngineOptions: a queue slot or a thread each costs memory or
// a kernel task, so junk sizes are refused instead of exhausting the node.
inline constexpr unsigned kMaxQueueDepth = 4096;
inline constexpr int kMaxIoThreads = 1024;

struct IoEngineOptions {
  enum class Kind { kAuto, kUring, kThreadPool };
  Kind kind = Kind::kAuto;    // kAuto: io_uring if it works, else threads
  unsigned queue_depth = 32;  // requests (pieces) in flight, 1..kMaxQueueDepth
  size_t block_size = 1 << 20;  // pieces of a large request; at most 1 GiB
  int num_threads = 4;          // thread-pool engine only, 1..kMaxIoThreads
};

class IoEngine {
 public:
  // Destroy an engine on a thread of its own caller, never from one of its
  // completion callbacks (which run on its threads: the destructor joins
  // them, and a thread cannot join itself).
  virtual ~IoEngine() = default;
  // "io_uring", "threadpool", "fault(io_uring)", "throttle(io_uring)"...
  virtual std::string name() const = 0;
  // Queues one request; `done` runs when it completes. After Shutdown,
  // completes at once with FailedPrecondition.
  virtual void Submit(const IoRequest& request, IoCallback done) = 0;
  // Queues several requests with one submission where the engine can.
  virtual void SubmitBatch(absl::Span<const IoRequest> requests,
                           absl::Span<IoCallback> done);
  // Waits for every in-flight request to complete (their callbacks run) and
  // stops the engine. Idempotent; also called by the destructor. It cannot
  // hang on a broken io_uring ring: once submissions have failed for 2 s,
  // the requests the kernel never took fail with the io_uring_enter error.
  // Requests the kernel did take are always waited for (it may still be
  // reading into or writing from their buffers).
  virtual void Shutdown() = 0;

  // Registers host buffers (e.g. AlignedBuffers) with the engine, replacing
  // any registered before; requests whose buffer lies inside one of them may
  // then skip the per-request page pinning (io_uring fixed buffers). Purely an
  // optimisation: engines that cannot use it return OK and ignore it, and so
  // does io_uring for a buffer it cannot take (over 1 GiB; all of them when
  // the kernel refuses to pin them, e.g. over RLIMIT_MEMLOCK). Call only while
  // no request is in flight (on older kernels registration quiesces the ring,
  // waiting for every outstanding request, the io_uring engine's own wake-up
  // poll included: nothing in this project calls it yet); an empty span
  // unregisters.
  virtual absl::Status RegisterBuffers(absl::Span<const iovec> buffers);

  // While interrupted, requests the engine holds back from the device (a
  // throttle's queued pieces) fail with Cancelled at once instead of waiting
  // for their time, and so do the new ones it would hold back; requests the
  // device has are completed as usual (it may be reading into or writing from
  // their buffers). For a caller that must stop soon (Ctrl-C during a step
  // under a bandwidth cap). Thread-safe. The plain engines hold nothing back:
  // for them it does nothing.
  virtual void SetInterrupted(bool interrupted) { (void)interrupted; }

  // Convenience: Submit returning a future.
  IoFuture Submit(const IoRequest& request);
};

// Whether io_uring can be used in this process; if not, `reason` says why
// (e.g. "io_uring_queue_init: Operation not permitted").
bool IoUringAvailable(std::string* reason);

// Creates an engine. kUring fails with Unavailable if io_uring is not
// usable; kAuto falls back to the thread pool.
absl::StatusOr<std::unique_ptr<IoEngine>> CreateIoEngine(
    const IoEngineOptions& options);

}  // namespace mlp_offload

#endif  // MLP_OFFLOAD_IO_IO_ENGINE_H_
