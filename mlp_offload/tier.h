// What the engine knows about a storage tier (one path of the multi-path
// virtual tier of the paper (arXiv 2509.02480)).
#ifndef MLP_OFFLOAD_MLP_OFFLOAD_TIER_H_
#define MLP_OFFLOAD_MLP_OFFLOAD_TIER_H_

#include <cstdint>
#include <string>

namespace mlp_offload {

struct TierSpec {
  std::string path;  // directory; the run's files go in a subdirectory
  std::string name;  // for messages and statistics ("nvme", "pfs"...)
  double read_bytes_per_sec = 0;  // measured or given; 0: unknown (probe)
  double write_bytes_per_sec = 0;
  uint64_t capacity_bytes = 0;  // 0: the filesystem's free space
  int shared_by = 1;            // processes of the node that use this tier
  // Optional caps that emulate a slower tier (token bucket in io/); <= 0: none.
  double throttle_read_bytes_per_sec = 0;
  double throttle_write_bytes_per_sec = 0;
  // Whether those caps are one device shared by every process of the node
  // whose tier is this directory (a node-local state file beside the tier
  // locks, SharedThrottlePath in engine.h; io/shared_throttle.h) instead of
  // each process's own: emulates the ranks of a node sharing one drive.
  bool throttle_shared = false;
  // For a shared throttle: with k processes streaming at once the device
  // gives cap / (1 + contention * (k - 1)) in total; 0: no loss. >= 0.
  double throttle_contention = 0;
  // Whether the caps emulate a half-duplex device: reads and writes take
  // turns on one clock (a read of n bytes and a write of m take n / read cap
  // + m / write cap together). false: each direction has its cap to itself
  // (full duplex, as an SSD that reads and writes at once at full speed).
  bool throttle_half_duplex = false;
  // Tiers with the same non-empty pool share one bandwidth (two directories
  // on one device); the planner then splits the pool's bandwidth.
  std::string bandwidth_pool;
};

}  // namespace mlp_offload

#endif  // MLP_OFFLOAD_MLP_OFFLOAD_TIER_H_
