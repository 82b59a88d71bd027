// The placement planner: pure functions from (subgroups, tiers, host budget,
// techniques) to a Plan. No I/O, no threads: unit-testable and usable as a
// what-if tool for runs far larger than this machine (`mlp-offload plan`).
#ifndef MLP_OFFLOAD_MLP_OFFLOAD_PLANNER_H_
#define MLP_OFFLOAD_MLP_OFFLOAD_PLANNER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "mlp_offload/tier.h"

namespace mlp_offload {

// The four techniques of the paper (arXiv 2509.02480), each switchable. All
// false is the ZeRO-Infinity-like baseline.
struct Techniques {
  bool multipath = true;                // 1: spread subgroups over all tiers
  bool cache_reuse = true;              // 2: alternating order, keep the last K
  bool delayed_grad_conversion = true;  // 3: grads stay in model dtype
  bool tier_lock = true;                // 4: one process at a time per tier

  static Techniques All() { return Techniques(); }
  static Techniques Baseline() {
    return Techniques{false, false, false, false};
  }
  // "mlp", "baseline", or "+"-joined names of the enabled techniques.
  std::string ToString() const;
};

struct PlannerInput {
  std::vector<uint64_t> subgroup_numel;
  // fp32 arrays per parameter in the offloaded record: the master copy plus
  // the optimizer's state arrays (AdamW: 3).
  int arrays_per_param = 3;
  // Bytes per gradient element in the model's dtype (2 for bf16/fp16).
  int grad_bytes = 2;
  std::vector<TierSpec> tiers;
  uint64_t host_budget_bytes = 0;
  Techniques techniques;
  // Kernel throughput for the compute part of the model (params/s); 0: ignore.
  double compute_params_per_sec = 0;
  // Ranks (processes) per node that run this plan at once on the same tiers,
  // each with its own shard of subgroups (for the what-if model).
  int ranks = 1;
  // Empty: the planner places the subgroups. Else each subgroup's tier,
  // kept as it is (a resumed run's records stay where they were written,
  // whatever the techniques or bandwidths say now): the plan's buffers,
  // traffic and prediction are those of this placement, and the tiers it
  // uses (up to the last one it uses) are the active ones, whatever
  // multipath says. Capacities are not checked (the records exist).
  std::vector<int> placement;
};

// Per-tier bytes moved in one steady-state step (a step after the first).
struct TierTraffic {
  uint64_t bytes_read = 0;
  uint64_t bytes_written = 0;
  double seconds = 0;  // predicted time this tier is busy in a step
};

struct Plan {
  // Tier index of each subgroup's on-disk home.
  std::vector<int> tier_of_subgroup;
  // Bytes of one subgroup's record (state arrays, fp32), before alignment.
  std::vector<uint64_t> record_bytes;
  // Subgroups kept in host memory between steps: the last `num_cached` of
  // each step's order (cache_reuse only).
  int num_cached = 0;
  // Streaming buffers (each the largest record, aligned) besides the cache,
  // and how many reads run ahead of the compute.
  int num_buffers = 0;
  int prefetch_depth = 0;
  uint64_t buffer_bytes = 0;     // size of one buffer
  uint64_t host_bytes_used = 0;  // (num_cached + num_buffers) * buffer_bytes
  // Predicted steady-state update phase.
  std::vector<TierTraffic> traffic;  // per tier
  double predicted_io_seconds = 0;
  double predicted_compute_seconds = 0;
  double predicted_seconds = 0;
  Techniques techniques;
  // Set by a resume whose records were placed otherwise than the planner
  // places them now (other techniques, tiers' bandwidths or capacities):
  // they stay where they are, and this plan is made for that placement.
  bool placement_kept = false;

  // Subgroup ids in the order step `step` (0-based) updates them:
  // alternating 0..N-1 / N-1..0 with cache_reuse, else always 0..N-1.
  std::vector<int> Order(int64_t step) const;
  // Whether the subgroup at `position` of step `step`'s order is kept in
  // memory after its update (not written back).
  bool KeptAfterUpdate(int64_t step, int position) const;
  // Human-readable summary (placement per tier, cache, prediction).
  std::string ToString(const std::vector<TierSpec>& tiers) const;
};

// Makes a plan. Placement: subgroups go in index order to the tier furthest
// behind its bandwidth share (every window of the streaming order is spread
// over the tiers, which then stream side by side); only where that runs out
// of room, they are placed to minimise the slowest tier's predicted time for
// the steady-state traffic each subgroup carries (cached records carry less
// or none), within the tiers' capacities.
// Errors (InvalidArgument / ResourceExhausted) name the problem: no tiers, a
// tier without bandwidth (0: unknown, probe it), a bandwidth or throttle that
// is not finite or a bandwidth below 0, a subgroup of size 0 or so large that
// its bytes overflow 64 bits, a budget below the minimum for double buffering
// (the message says the minimum), the tiers' capacity below the state's size
// or no placement of the subgroups that fits the tiers (the message gives the
// total and each tier's capacity).
absl::StatusOr<Plan> MakePlan(const PlannerInput& input);
// "1.5 GiB": bytes in the largest binary unit below them, for messages.
std::string HumanBytes(double bytes);

// Bytes of a record of `numel` parameters with `arrays_per_param` fp32
// arrays, rounded up to the O_DIRECT alignment. `numel` must be small enough
// that the bytes fit 64 bits (MakePlan checks).
uint64_t AlignedRecordBytes(uint64_t numel, int arrays_per_param);

}  // namespace mlp_offload

#endif  // MLP_OFFLOAD_MLP_OFFLOAD_PLANNER_H_
