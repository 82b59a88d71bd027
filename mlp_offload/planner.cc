// Placement, caching and the I/O performance model of the update phase.
//
// Model: every step each subgroup's record is read (unless it is a cache
// hit) and written (unless it is kept for the next step). A tier's busy time
// is its bytes over its bandwidth; tiers work in parallel, the compute
// overlaps the I/O, so the step is bounded by the slowest tier or by the
// compute, plus the pipeline's fill and drain (one record read before the
// first update, one written after the last).
#include "mlp_offload/planner.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace mlp_offload {
namespace {

constexpr uint64_t kAlign = 4096;
// Each record is stored in two slots (crash consistency), each with a header.
constexpr uint64_t kHeaderBytes = 4096;

uint64_t RoundUp(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

std::string HumanBytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  while (b >= 1024 && u < 5) {
    b /= 1024;
    ++u;
  }
  return absl::StrFormat("%.1f %s", b, units[u]);
}

// Effective bandwidth of a tier for one rank: the measured (or given) number,
// capped by a throttle, split among the processes and among the tiers of the
// same bandwidth pool.
struct EffectiveTier {
  double read_bw;
  double write_bw;
  bool duplex;  // reads and writes proceed independently (throttled caps)
  // Seconds per byte that is both read and written (a streamed record).
  double cost_per_byte() const {
    return duplex ? std::max(1.0 / read_bw, 1.0 / write_bw)
                  : 1.0 / read_bw + 1.0 / write_bw;
  }
  double Seconds(uint64_t r, uint64_t w) const {
    double tr = r / read_bw, tw = w / write_bw;
    return duplex ? std::max(tr, tw) : tr + tw;
  }
};

}  // namespace

std::string Techniques::ToString() const {
  if (multipath && cache_reuse && delayed_grad_conversion && tier_lock)
    return "mlp";
  if (!multipath && !cache_reuse && !delayed_grad_conversion && !tier_lock) {
    return "baseline";
  }
  std::vector<std::string> on;
  if (multipath) on.push_back("multipath");
  if (cache_reuse) on.push_back("cache_reuse");
  if (delayed_grad_conversion) on.push_back("delayed_grad_conversion");
  if (tier_lock) on.push_back("tier_lock");
  return absl::StrJoin(on, "+");
}

uint64_t AlignedRecordBytes(uint64_t numel, int arrays_per_param) {
  return RoundUp(numel * 4 * static_cast<uint64_t>(arrays_per_param), kAlign);
}

std::vector<int> Plan::Order(int64_t step) const {
  const int n = static_cast<int>(tier_of_subgroup.size());
  std::vector<int> order(n);
  std::iota(order.begin(), order.end(), 0);
  // Step -1 (the state as initialised) is treated as a reversed step, so
  // step 0 starts with the records that initialisation left cached.
  bool reversed = techniques.cache_reuse && (step % 2 != 0);
  if (reversed) std::reverse(order.begin(), order.end());
  return order;
}

bool Plan::KeptAfterUpdate(int64_t step, int position) const {
  const int n = static_cast<int>(tier_of_subgroup.size());
  return techniques.cache_reuse && position >= n - num_cached;
}

std::string Plan::ToString(const std::vector<TierSpec>& tiers) const {
  std::string out;
  const int n = static_cast<int>(tier_of_subgroup.size());
  absl::StrAppend(
      &out, absl::StrFormat("plan (%s): %d subgroups, %d cached in host "
                            "memory, %d streaming buffers "
                            "of %s, prefetch depth %d, host memory %s\n",
                            techniques.ToString(), n, num_cached, num_buffers,
                            HumanBytes(buffer_bytes), prefetch_depth,
                            HumanBytes(host_bytes_used)));
  for (size_t t = 0; t < traffic.size(); ++t) {
    int count = 0;
    uint64_t bytes = 0;
    for (int i = 0; i < n; ++i) {
      if (tier_of_subgroup[i] == static_cast<int>(t)) {
        ++count;
        bytes += record_bytes[i];
      }
    }
    std::string name =
        t < tiers.size()
            ? (tiers[t].name.empty() ? tiers[t].path : tiers[t].name)
            : absl::StrCat("tier", t);
    absl::StrAppend(&out, absl::StrFormat("  tier %d (%s): %d subgroups, %s of "
                                          "state; per step reads %s, writes "
                                          "%s, busy %.2f s\n",
                                          t, name, count, HumanBytes(bytes),
                                          HumanBytes(traffic[t].bytes_read),
                                          HumanBytes(traffic[t].bytes_written),
                                          traffic[t].seconds));
  }
  absl::StrAppend(
      &out,
      absl::StrFormat(
          "  predicted update phase: %.2f s (I/O %.2f s, compute %.2f s)\n",
          predicted_seconds, predicted_io_seconds, predicted_compute_seconds));
  return out;
}

absl::StatusOr<Plan> MakePlan(const PlannerInput& in) {
  const int n = static_cast<int>(in.subgroup_numel.size());
  if (n == 0) return absl::InvalidArgumentError("plan: no subgroups");
  if (in.tiers.empty())
    return absl::InvalidArgumentError("plan: no tiers given");
  if (in.arrays_per_param < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "plan: arrays_per_param must be >= 1, got ", in.arrays_per_param));
  }
  if (in.ranks < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("plan: ranks must be >= 1, got ", in.ranks));
  }
  for (int i = 0; i < n; ++i) {
    if (in.subgroup_numel[i] == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("plan: subgroup ", i, " has size 0"));
    }
  }
  Plan plan;
  plan.techniques = in.techniques;
  const bool eager_grads = !in.techniques.delayed_grad_conversion;

  // Which tiers are used, and their effective bandwidths.
  const int num_tiers = static_cast<int>(in.tiers.size());
  const int active = in.techniques.multipath ? num_tiers : 1;
  std::map<std::string, int> pool_size;
  for (int t = 0; t < active; ++t) {
    if (!in.tiers[t].bandwidth_pool.empty())
      ++pool_size[in.tiers[t].bandwidth_pool];
  }
  std::vector<EffectiveTier> eff(num_tiers);
  for (int t = 0; t < num_tiers; ++t) {
    const TierSpec& spec = in.tiers[t];
    double r = spec.read_bytes_per_sec, w = spec.write_bytes_per_sec;
    bool throttled = spec.throttle_read_bytes_per_sec > 0 &&
                     spec.throttle_write_bytes_per_sec > 0;
    if (spec.throttle_read_bytes_per_sec > 0) {
      r = r > 0 ? std::min(r, spec.throttle_read_bytes_per_sec)
                : spec.throttle_read_bytes_per_sec;
    }
    if (spec.throttle_write_bytes_per_sec > 0) {
      w = w > 0 ? std::min(w, spec.throttle_write_bytes_per_sec)
                : spec.throttle_write_bytes_per_sec;
    }
    if (!(r > 0) || !(w > 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("plan: tier ", t, " (", spec.path,
                       ") has no read/write bandwidth: give "
                       "them or probe the tier"));
    }
    // Ranks of a node that share the tier see a share of its bandwidth; so
    // do the tiers of one device.
    int sharing = std::max(1, spec.shared_by) * std::max(1, in.ranks);
    if (!spec.bandwidth_pool.empty() && t < active)
      sharing *= pool_size[spec.bandwidth_pool];
    eff[t] = EffectiveTier{r / sharing, w / sharing, throttled};
  }

  // Buffers: one record (+ its header, + an fp32 gradient for the baseline).
  uint64_t max_numel =
      *std::max_element(in.subgroup_numel.begin(), in.subgroup_numel.end());
  plan.record_bytes.resize(n);
  for (int i = 0; i < n; ++i) {
    plan.record_bytes[i] =
        in.subgroup_numel[i] * 4 * static_cast<uint64_t>(in.arrays_per_param);
  }
  plan.buffer_bytes = kHeaderBytes +
                      AlignedRecordBytes(max_numel, in.arrays_per_param) +
                      (eager_grads ? RoundUp(max_numel * 4, kAlign) : 0);
  const uint64_t slots = in.host_budget_bytes / plan.buffer_bytes;
  if (slots < 2) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "plan: host budget %s is too small: double buffering needs at least 2 "
        "buffers of %s (the largest subgroup's record), i.e. %d bytes (%s)",
        HumanBytes(in.host_budget_bytes), HumanBytes(plan.buffer_bytes),
        2 * plan.buffer_bytes, HumanBytes(2.0 * plan.buffer_bytes)));
  }
  // Enough streaming buffers for a read in flight per tier plus one being
  // computed and one being written; the rest of the budget caches records.
  const int want_buffers = std::max(3, 2 * active + 1);
  if (in.techniques.cache_reuse && slots >= static_cast<uint64_t>(n)) {
    plan.num_cached = n;  // everything fits: no I/O after the first touch
    plan.num_buffers = 0;
  } else {
    plan.num_buffers =
        static_cast<int>(std::min<uint64_t>(slots, want_buffers));
    plan.num_cached =
        in.techniques.cache_reuse
            ? static_cast<int>(std::min<uint64_t>(slots - plan.num_buffers, n))
            : 0;
  }
  // Reads may run ahead into every streaming buffer but the one being
  // computed; writes behind free them again.
  plan.prefetch_depth = std::max(1, plan.num_buffers - 1);
  plan.host_bytes_used =
      (plan.num_cached + plan.num_buffers) * plan.buffer_bytes;

  // Placement: targets proportional to each tier's throughput for streamed
  // records, water-filled under capacity (two slots per record on disk), then
  // subgroups assigned in index order to the tier furthest behind its target,
  // so every window of the order is spread in proportion too (both ends of
  // the alternating order, and the prefetch window, keep all tiers busy).
  std::vector<uint64_t> disk_bytes(n);
  uint64_t total_disk = 0;
  for (int i = 0; i < n; ++i) {
    disk_bytes[i] =
        2 * (kHeaderBytes +
             AlignedRecordBytes(in.subgroup_numel[i], in.arrays_per_param)) +
        (eager_grads ? RoundUp(in.subgroup_numel[i] * 4, kAlign) : 0);
    total_disk += disk_bytes[i];
  }
  std::vector<double> capacity(active);
  double total_capacity = 0;
  for (int t = 0; t < active; ++t) {
    capacity[t] = in.tiers[t].capacity_bytes > 0
                      ? static_cast<double>(in.tiers[t].capacity_bytes)
                      : INFINITY;
    total_capacity += capacity[t];
  }
  if (total_capacity < total_disk) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "plan: the tiers hold %s but the state needs %s on disk (two slots per "
        "subgroup)",
        HumanBytes(total_capacity), HumanBytes(total_disk)));
  }
  std::vector<double> target(active, 0);
  {
    std::vector<bool> fixed(active, false);
    double remaining = static_cast<double>(total_disk);
    for (int round = 0; round < active; ++round) {
      double weight_sum = 0;
      for (int t = 0; t < active; ++t) {
        if (!fixed[t]) weight_sum += 1.0 / eff[t].cost_per_byte();
      }
      bool changed = false;
      for (int t = 0; t < active; ++t) {
        if (fixed[t]) continue;
        target[t] = remaining * (1.0 / eff[t].cost_per_byte()) / weight_sum;
        if (target[t] > capacity[t]) {
          target[t] = capacity[t];
          fixed[t] = true;
          remaining -= capacity[t];
          changed = true;
        }
      }
      if (!changed) break;
    }
  }
  plan.tier_of_subgroup.assign(n, 0);
  std::vector<double> assigned(active, 0);
  for (int i = 0; i < n; ++i) {
    int best = -1;
    double best_score = INFINITY;
    for (int t = 0; t < active; ++t) {
      if (assigned[t] + disk_bytes[i] > capacity[t]) continue;
      if (target[t] <= 0) continue;
      double score = (assigned[t] + disk_bytes[i]) / target[t];
      if (score < best_score - 1e-12) {
        best_score = score;
        best = t;
      }
    }
    if (best < 0) {
      return absl::ResourceExhaustedError(
          absl::StrCat("plan: no tier has room for subgroup ", i, " (",
                       disk_bytes[i], " bytes)"));
    }
    plan.tier_of_subgroup[i] = best;
    assigned[best] += disk_bytes[i];
  }

  // Steady-state traffic, averaged over a forward and a reversed step.
  plan.traffic.assign(num_tiers, TierTraffic{});
  std::vector<double> reads(num_tiers, 0), writes(num_tiers, 0),
      grad_writes(num_tiers, 0);
  for (int64_t step = 2; step < 4; ++step) {
    std::vector<int> order = plan.Order(step);
    std::vector<int> prev = plan.Order(step - 1);
    std::vector<bool> hit(n, false);
    if (in.techniques.cache_reuse) {
      for (int p = n - plan.num_cached; p < n; ++p) hit[prev[p]] = true;
    }
    for (int p = 0; p < n; ++p) {
      int i = order[p];
      int t = plan.tier_of_subgroup[i];
      uint64_t rec = plan.record_bytes[i];
      if (!hit[i]) reads[t] += rec;
      if (!plan.KeptAfterUpdate(step, p)) writes[t] += rec;
      if (eager_grads) {  // fp32 gradient written in backward, read in update
        reads[t] += in.subgroup_numel[i] * 4.0;
        grad_writes[t] += in.subgroup_numel[i] * 4.0;
      }
    }
  }
  // The baseline's gradient writes happen in backward, before the update
  // phase can start: they add to the step instead of overlapping it.
  plan.predicted_io_seconds = 0;
  double grad_seconds = 0;
  for (int t = 0; t < num_tiers; ++t) {
    plan.traffic[t].bytes_read = static_cast<uint64_t>(reads[t] / 2);
    plan.traffic[t].bytes_written =
        static_cast<uint64_t>((writes[t] + grad_writes[t]) / 2);
    if (t < active) {
      double update = eff[t].Seconds(static_cast<uint64_t>(reads[t] / 2),
                                     static_cast<uint64_t>(writes[t] / 2));
      double grads = grad_writes[t] / 2 / eff[t].write_bw;
      plan.traffic[t].seconds = update + grads;
      plan.predicted_io_seconds = std::max(plan.predicted_io_seconds, update);
      grad_seconds = std::max(grad_seconds, grads);
    }
  }
  uint64_t total_numel = std::accumulate(in.subgroup_numel.begin(),
                                         in.subgroup_numel.end(), uint64_t{0});
  plan.predicted_compute_seconds = in.compute_params_per_sec > 0
                                       ? total_numel / in.compute_params_per_sec
                                       : 0.0;
  // Fill and drain: the first record must arrive before any update and the
  // last one leaves after all of them; with caching the step starts on a hit.
  double fill = 0;
  if (plan.num_cached < n) {
    double avg_rec = 0;
    for (int i = 0; i < n; ++i) avg_rec += plan.record_bytes[i];
    avg_rec /= n;
    const EffectiveTier& e0 = eff[0];
    fill = (plan.num_cached > 0 ? 0.0 : avg_rec / e0.read_bw) +
           avg_rec / e0.write_bw;
    // The fill's bytes are part of the tier's traffic already; with several
    // tiers the others keep working meanwhile, so only the excess counts.
    fill /= std::max(1, active);
  }
  plan.predicted_seconds =
      std::max(plan.predicted_io_seconds, plan.predicted_compute_seconds) +
      fill + grad_seconds;
  plan.predicted_io_seconds += grad_seconds;
  return plan;
}

}  // namespace mlp_offload
