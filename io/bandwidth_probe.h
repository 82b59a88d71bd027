// Measures the sequential O_DIRECT bandwidth of tier directories, alone and
// all at once, so that directories sharing one device (one bandwidth pool)
// are told apart from independent paths. Used by the engine's tier probe, the
// io_benchmark and `mlp-offload probe`.
#ifndef MLP_OFFLOAD_IO_BANDWIDTH_PROBE_H_
#define MLP_OFFLOAD_IO_BANDWIDTH_PROBE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "io/file.h"
#include "io/io_engine.h"

namespace mlp_offload {

// Limits of the probes' options: the thread-pool engine runs a thread per
// queue slot, and each stream holds two files of `bytes`.
inline constexpr unsigned kMaxProbeQueueDepth = 1024;
inline constexpr int kMaxProbeStreams = 256;

struct ProbeOptions {
  uint64_t bytes = uint64_t{256} << 20;  // per directory and direction
  size_t block_size = 1 << 20;
  unsigned queue_depth = 32;
  IoEngineOptions::Kind engine = IoEngineOptions::Kind::kAuto;
  // Also run every directory at once (skipped for a single directory).
  bool together = true;
};

struct PathBandwidth {
  std::string dir;
  uint64_t device = 0;  // st_dev of the directory
  bool direct = false;  // O_DIRECT was in effect
  std::string direct_fallback_reason;
  // Bytes per second of sequential writes (fdatasync included) and reads.
  double write_alone = 0;
  double read_alone = 0;
  // The same while every probed directory runs at once (== alone for one).
  double write_together = 0;
  double read_together = 0;
  // Other probed directories that share this one's bandwidth: same st_dev, or
  // both lost more than a quarter of their bandwidth when run together.
  std::vector<std::string> shares_device_with;
};

// Writes then reads a temporary file of `options.bytes` in each directory,
// first one directory at a time, then all together; the files are removed
// afterwards (also on error). Errors name the directory and the operation.
absl::StatusOr<std::vector<PathBandwidth>> ProbeBandwidth(
    const std::vector<std::string>& dirs, const ProbeOptions& options);

// How a directory's device serves several processes at once: the ranks of a
// node that share a tier, each reading one file while writing another (an
// offload engine's steady state).
struct ConcurrencyBandwidth {
  std::string dir;
  int streams = 0;  // k, the processes emulated (one I/O engine each)
  // Bytes per second read plus written, in total: one engine alone, then k
  // engines at once.
  double one = 0;
  double many = 0;
  // c such that many = one / (1 + c (k - 1)), the contention model of
  // io/shared_throttle.h (0 when k engines get at least what one gets).
  double contention = 0;
};

// Measures ConcurrencyBandwidth with `options.bytes` read and written per
// engine (the files are written once first, so reads hit the device and
// writes overwrite, and removed afterwards, also on error). `make_engine`
// makes each engine (null: CreateIoEngine with the options' kind, block
// size and queue depth); tests pass emulated devices. InvalidArgument for
// streams < 2; errors name the directory and the operation.
absl::StatusOr<ConcurrencyBandwidth> ProbeConcurrency(
    const std::string& dir, int streams, const ProbeOptions& options,
    const std::function<absl::StatusOr<std::unique_ptr<IoEngine>>()>&
        make_engine = nullptr);

// Transfers [0, bytes) of `file` sequentially in `block_size` requests with
// `queue_depth` of them in flight (like fio's sequential job), and returns the
// elapsed seconds. Writes send a fixed random pattern; `sync` adds an
// fdatasync to the timed write. The first failed request's status is returned.
absl::StatusOr<double> TimeSequentialTransfer(IoEngine& engine, File& file,
                                              IoOp op, uint64_t bytes,
                                              size_t block_size,
                                              unsigned queue_depth, bool sync);

}  // namespace mlp_offload

#endif  // MLP_OFFLOAD_IO_BANDWIDTH_PROBE_H_
