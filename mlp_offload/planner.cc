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
#include <string>
#include <utility>
#include <vector>

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
  double Seconds(double r, double w) const {
    double tr = r / read_bw, tw = w / write_bw;
    return duplex ? std::max(tr, tw) : tr + tw;
  }
};

// Bytes one subgroup moves in a steady-state step, by the model above.
struct SubgroupTraffic {
  double read = 0;   // its record (unless a cache hit) and eager gradient
  double write = 0;  // its record (unless kept for the next step)
  double grad = 0;   // its eager fp32 gradient, written in backward
  double total() const { return read + write + grad; }
};

// What a placement puts on one tier.
struct TierLoad {
  double read = 0;
  double write = 0;
  double grad = 0;
  double disk = 0;
  void Add(const SubgroupTraffic& s, double d, double sign) {
    read += sign * s.read;
    write += sign * s.write;
    grad += sign * s.grad;
    disk += sign * d;
  }
};

// The placement problem over the active tiers.
struct Placement {
  const std::vector<EffectiveTier>& eff;
  const std::vector<double>& capacity;  // per active tier, INFINITY: none
  const std::vector<double>& target;    // disk bytes the bandwidths ask for
  const std::vector<uint64_t>& disk;    // per subgroup
  const std::vector<SubgroupTraffic>& traffic;  // per subgroup
  int active() const { return static_cast<int>(capacity.size()); }
  int size() const { return static_cast<int>(disk.size()); }

  // Predicted busy time of tier `t` under `load` for the update phase and for
  // the eager gradients.
  double UpdateSeconds(int t, const TierLoad& load) const {
    return eff[t].Seconds(load.read, load.write);
  }
  double GradSeconds(int t, const TierLoad& load) const {
    return load.grad / eff[t].write_bw;
  }
  std::vector<TierLoad> Loads(const std::vector<int>& tier_of) const {
    std::vector<TierLoad> load(active());
    for (int i = 0; i < size(); ++i) {
      load[tier_of[i]].Add(traffic[i], static_cast<double>(disk[i]), 1);
    }
    return load;
  }
  bool Fits(int t, const TierLoad& load, int i) const {
    return load.disk + static_cast<double>(disk[i]) <= capacity[t];
  }
};

// A placement's quality: the predicted I/O time (the slowest tier's update
// plus the slowest tier's gradient writes, as the plan predicts it), then,
// to break ties, the spread of the tiers' busy times (sum of squares).
struct Score {
  double io = 0;
  double spread = 0;
  // Whether this score is strictly better than `other`.
  bool Beats(const Score& other) const {
    constexpr double kRel = 1e-12;
    if (io < other.io * (1 - kRel)) return true;
    return io <= other.io && spread < other.spread * (1 - kRel);
  }
};

// The score of `load`, with tiers `a` and `b` (-1: none) replaced by `la`
// and `lb`.
Score Evaluate(const Placement& p, const std::vector<TierLoad>& load,
               int a = -1, const TierLoad* la = nullptr, int b = -1,
               const TierLoad* lb = nullptr) {
  Score s;
  double max_update = 0, max_grad = 0;
  for (int t = 0; t < p.active(); ++t) {
    const TierLoad& l = t == a ? *la : t == b ? *lb : load[t];
    double update = p.UpdateSeconds(t, l), grad = p.GradSeconds(t, l);
    max_update = std::max(max_update, update);
    max_grad = std::max(max_grad, grad);
    s.spread += (update + grad) * (update + grad);
  }
  s.io = max_update + max_grad;
  return s;
}

// The original placement: subgroups in index order, each to the tier
// furthest behind its target (by disk bytes), so every window of the order is
// spread in proportion. Used as is for equal-size subgroups (existing plans
// and the README depend on it); for equal sizes it fails only when nothing
// fits.
// Returns false (and the subgroup in `*failed`) when a subgroup fits nowhere.
bool IndexOrderPlacement(const Placement& p, std::vector<int>* tier_of,
                         int* failed) {
  std::vector<double> assigned(p.active(), 0);
  for (int i = 0; i < p.size(); ++i) {
    int best = -1;
    double best_score = INFINITY;
    for (int t = 0; t < p.active(); ++t) {
      if (assigned[t] + p.disk[i] > p.capacity[t]) continue;
      if (p.target[t] <= 0) continue;
      double score = (assigned[t] + p.disk[i]) / p.target[t];
      if (score < best_score - 1e-12) {
        best_score = score;
        best = t;
      }
    }
    if (best < 0) {
      *failed = i;
      return false;
    }
    (*tier_of)[i] = best;
    assigned[best] += p.disk[i];
  }
  return true;
}

enum class Choice {
  kEarliestFinish,  // the tier whose busy time ends lowest (disk: the target)
  kBestFit,         // the tier left with the least free capacity
};

// Places the subgroups in `order`, each on a tier with room picked by
// `choice`. Subgroups that move no bytes go where the disk targets say.
// Returns false when a subgroup fits nowhere.
bool PlaceInOrder(const Placement& p, const std::vector<int>& order,
                  Choice choice, std::vector<int>* tier_of) {
  std::vector<TierLoad> load(p.active());
  for (int i : order) {
    int best = -1;
    double best_key = INFINITY, best_tie = INFINITY;
    for (int t = 0; t < p.active(); ++t) {
      if (!p.Fits(t, load[t], i)) continue;
      TierLoad after = load[t];
      after.Add(p.traffic[i], static_cast<double>(p.disk[i]), 1);
      double time = p.UpdateSeconds(t, after) + p.GradSeconds(t, after);
      double fill = p.target[t] > 0 ? after.disk / p.target[t] : INFINITY;
      double key, tie;
      if (choice == Choice::kBestFit) {
        key = p.capacity[t] - after.disk;  // INFINITY for an unbounded tier
        tie = p.traffic[i].total() > 0 ? time : fill;
      } else if (p.traffic[i].total() > 0) {
        key = time;
        tie = fill;
      } else {
        key = fill;
        tie = time;
      }
      if (key < best_key || (key == best_key && tie < best_tie)) {
        best = t;
        best_key = key;
        best_tie = tie;
      }
    }
    if (best < 0) return false;
    (*tier_of)[i] = best;
    load[best].Add(p.traffic[i], static_cast<double>(p.disk[i]), 1);
  }
  return true;
}

// A subgroup's place in the largest-traffic-first order. Subgroups with
// equal keys (but the index) are interchangeable: same traffic, same size.
struct TrafficKey {
  double total;
  uint64_t disk;
  double read;
  double write;
  int index;
  bool SameKind(const TrafficKey& o) const {
    return total == o.total && disk == o.disk && read == o.read &&
           write == o.write;
  }
};

bool LargerTrafficFirst(const TrafficKey& x, const TrafficKey& y) {
  if (x.total != y.total) return x.total > y.total;
  if (x.disk != y.disk) return x.disk > y.disk;
  if (x.read != y.read) return x.read > y.read;
  if (x.write != y.write) return x.write > y.write;
  return x.index < y.index;
}

// Local search: moves one subgroup to another tier, or swaps two subgroups
// of different kinds and tiers (one of them on a slowest tier), while that
// strictly improves the score and the tiers' capacities allow; the best such
// step each round. `order` lists the subgroups with each kind contiguous,
// starting at `kind_start` (plus a final end). The work is bounded, so a
// million subgroups plan quickly.
void ImprovePlacement(const Placement& p, const std::vector<int>& order,
                      const std::vector<int>& kind_start,
                      std::vector<int>* tier_of) {
  const int T = p.active();
  const int num_kinds = static_cast<int>(kind_start.size()) - 1;
  if (T < 2 || p.size() < 2) return;
  constexpr int64_t kMaxWork = 2'000'000;
  constexpr int kMaxRounds = 100'000;
  // Subgroups of each (kind, tier).
  std::vector<int> count(static_cast<size_t>(num_kinds) * T, 0);
  for (int k = 0; k < num_kinds; ++k) {
    for (int x = kind_start[k]; x < kind_start[k + 1]; ++x) {
      ++count[static_cast<size_t>(k) * T + (*tier_of)[order[x]]];
    }
  }
  std::vector<TierLoad> load = p.Loads(*tier_of);
  Score current = Evaluate(p, load);
  struct Rep {
    int kind;
    int tier;
    int index;  // one subgroup of the kind (traffic and size)
  };
  std::vector<Rep> reps;
  int64_t work = 0;
  for (int round = 0; round < kMaxRounds && work < kMaxWork; ++round) {
    reps.clear();
    for (int k = 0; k < num_kinds; ++k) {
      for (int t = 0; t < T; ++t) {
        if (count[static_cast<size_t>(k) * T + t] > 0) {
          reps.push_back(Rep{k, t, order[kind_start[k]]});
        }
      }
    }
    work += static_cast<int64_t>(num_kinds) * T;
    // The slowest tiers (update, gradients): a swap that helps involves one.
    int slow_update = 0, slow_grad = 0;
    for (int t = 1; t < T; ++t) {
      if (p.UpdateSeconds(t, load[t]) >
          p.UpdateSeconds(slow_update, load[slow_update])) {
        slow_update = t;
      }
      if (p.GradSeconds(t, load[t]) >
          p.GradSeconds(slow_grad, load[slow_grad])) {
        slow_grad = t;
      }
    }
    Score best = current;
    const Rep* best_x = nullptr;
    const Rep* best_y = nullptr;
    int best_to = -1;
    for (const Rep& x : reps) {
      if (work >= kMaxWork) break;
      work += T * T;
      const int i = x.index, a = x.tier;
      if (p.traffic[i].total() == 0) continue;  // moving it changes nothing
      TierLoad la = load[a];
      la.Add(p.traffic[i], static_cast<double>(p.disk[i]), -1);
      for (int b = 0; b < T; ++b) {
        if (b == a || !p.Fits(b, load[b], i)) continue;
        TierLoad lb = load[b];
        lb.Add(p.traffic[i], static_cast<double>(p.disk[i]), 1);
        Score s = Evaluate(p, load, a, &la, b, &lb);
        if (s.Beats(best)) {
          best = s;
          best_x = &x;
          best_to = b;
        }
      }
    }
    if (best_x == nullptr) {
      // No move helps: try swaps.
      for (const Rep& x : reps) {
        if (work >= kMaxWork) break;
        if (x.tier != slow_update && x.tier != slow_grad) continue;
        const int i = x.index, a = x.tier;
        for (const Rep& y : reps) {
          const int j = y.index, b = y.tier;
          if (a == b || x.kind == y.kind) continue;
          if (p.traffic[i].total() == 0 && p.traffic[j].total() == 0) continue;
          TierLoad la = load[a], lb = load[b];
          la.Add(p.traffic[i], static_cast<double>(p.disk[i]), -1);
          la.Add(p.traffic[j], static_cast<double>(p.disk[j]), 1);
          lb.Add(p.traffic[j], static_cast<double>(p.disk[j]), -1);
          lb.Add(p.traffic[i], static_cast<double>(p.disk[i]), 1);
          if (la.disk > p.capacity[a] || lb.disk > p.capacity[b]) continue;
          Score s = Evaluate(p, load, a, &la, b, &lb);
          if (s.Beats(best)) {
            best = s;
            best_x = &x;
            best_y = &y;
          }
        }
        work += static_cast<int64_t>(reps.size()) * T;
      }
    }
    if (best_x == nullptr) break;
    // Moves the last subgroup (in `order`) of `r`'s kind on `r`'s tier.
    auto move = [&](const Rep& r, int to) {
      int i = -1;
      for (int x = kind_start[r.kind + 1] - 1; x >= kind_start[r.kind]; --x) {
        if ((*tier_of)[order[x]] == r.tier) {
          i = order[x];
          break;
        }
      }
      load[r.tier].Add(p.traffic[i], static_cast<double>(p.disk[i]), -1);
      load[to].Add(p.traffic[i], static_cast<double>(p.disk[i]), 1);
      --count[static_cast<size_t>(r.kind) * T + r.tier];
      ++count[static_cast<size_t>(r.kind) * T + to];
      (*tier_of)[i] = to;
    };
    if (best_y == nullptr) {
      move(*best_x, best_to);
    } else {
      const Rep x = *best_x, y = *best_y;
      move(x, y.tier);
      move(y, x.tier);
    }
    current = best;
  }
}

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

std::string HumanBytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  while (b >= 1024 && u < 5) {
    b /= 1024;
    ++u;
  }
  return absl::StrFormat("%.1f %s", b, units[u]);
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
  // Every byte count below (records, slots, headers, gradients, sums) stays
  // below 2^64 when the payload, numel * 4 * (arrays_per_param + 1) bytes,
  // stays below 2^62 for each subgroup and in total.
  constexpr uint64_t kMaxPayload = uint64_t{1} << 62;
  const uint64_t bytes_per_param =
      4 * (static_cast<uint64_t>(in.arrays_per_param) + 1);
  uint64_t total_payload = 0;
  for (int i = 0; i < n; ++i) {
    const uint64_t numel = in.subgroup_numel[i];
    if (numel == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("plan: subgroup ", i, " has size 0"));
    }
    if (numel > kMaxPayload / bytes_per_param) {
      return absl::InvalidArgumentError(absl::StrCat(
          "plan: subgroup_numel[", i, "] = ", numel,
          " is too large: its record (numel * 4 bytes * arrays_per_param ",
          in.arrays_per_param, ") overflows 64-bit byte counts"));
    }
    total_payload += numel * bytes_per_param;
    if (total_payload > kMaxPayload) {
      return absl::InvalidArgumentError(absl::StrCat(
          "plan: subgroup_numel is too large in total (at subgroup ", i,
          "): the state's bytes overflow 64-bit byte counts"));
    }
  }
  if (!std::isfinite(in.compute_params_per_sec)) {
    return absl::InvalidArgumentError(
        absl::StrCat("plan: compute_params_per_sec must be finite (0: ignore "
                     "the compute), got ",
                     in.compute_params_per_sec));
  }
  for (int t = 0; t < static_cast<int>(in.tiers.size()); ++t) {
    const TierSpec& spec = in.tiers[t];
    const std::pair<const char*, double> rates[] = {
        {"read_bytes_per_sec", spec.read_bytes_per_sec},
        {"write_bytes_per_sec", spec.write_bytes_per_sec}};
    for (const auto& [field, value] : rates) {
      if (!std::isfinite(value) || value < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "plan: tier ", t, " (", spec.path, ") ", field,
            " must be a finite number > 0 (0: unknown, probe the tier), "
            "got ",
            value));
      }
    }
    const std::pair<const char*, double> caps[] = {
        {"throttle_read_bytes_per_sec", spec.throttle_read_bytes_per_sec},
        {"throttle_write_bytes_per_sec", spec.throttle_write_bytes_per_sec}};
    for (const auto& [field, value] : caps) {
      if (!std::isfinite(value)) {
        return absl::InvalidArgumentError(
            absl::StrCat("plan: tier ", t, " (", spec.path, ") ", field,
                         " must be finite (<= 0: no throttle), got ", value));
      }
    }
  }
  Plan plan;
  plan.techniques = in.techniques;
  const bool eager_grads = !in.techniques.delayed_grad_conversion;

  // Which tiers are used, and their effective bandwidths.
  const int num_tiers = static_cast<int>(in.tiers.size());
  int active = in.techniques.multipath ? num_tiers : 1;
  const bool fixed = !in.placement.empty();
  if (fixed) {
    active = 1;  // the tiers the placement uses, whatever multipath says
    if (static_cast<int>(in.placement.size()) != n) {
      return absl::InvalidArgumentError(
          absl::StrCat("plan: a placement of ", in.placement.size(),
                       " subgroups for ", n, " subgroups"));
    }
    for (int i = 0; i < n; ++i) {
      const int t = in.placement[i];
      if (t < 0 || t >= num_tiers) {
        return absl::InvalidArgumentError(
            absl::StrCat("plan: the placement puts subgroup ", i, " on tier ",
                         t, " of ", num_tiers));
      }
      active = std::max(active, t + 1);
    }
  }
  std::map<std::string, int> pool_size;
  for (int t = 0; t < active; ++t) {
    if (!in.tiers[t].bandwidth_pool.empty())
      ++pool_size[in.tiers[t].bandwidth_pool];
  }
  std::vector<EffectiveTier> eff(num_tiers);
  for (int t = 0; t < num_tiers; ++t) {
    const TierSpec& spec = in.tiers[t];
    double r = spec.read_bytes_per_sec, w = spec.write_bytes_per_sec;
    // Throttled caps of both directions are a full-duplex device unless
    // they say otherwise; a measured bandwidth is taken as half duplex.
    bool throttled = spec.throttle_read_bytes_per_sec > 0 &&
                     spec.throttle_write_bytes_per_sec > 0 &&
                     !spec.throttle_half_duplex;
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
    double sharing = static_cast<double>(std::max(1, spec.shared_by)) *
                     std::max(1, in.ranks);
    if (!spec.bandwidth_pool.empty() && t < active)
      sharing *= pool_size[spec.bandwidth_pool];
    eff[t] = EffectiveTier{r / sharing, w / sharing, throttled};
    if (!std::isfinite(eff[t].cost_per_byte())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "plan: tier ", t, " (", spec.path, ") has a read/write bandwidth of ",
          eff[t].read_bw, "/", eff[t].write_bw,
          " bytes/s per process: too small to plan with"));
    }
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
  if (!fixed && total_capacity < total_disk) {
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
  // Each subgroup's steady-state traffic, averaged over a forward and a
  // reversed step: its record unless a cache hit, written unless kept for
  // the next step, and the baseline's fp32 gradient written in backward and
  // read in the update.
  std::vector<SubgroupTraffic> sub_traffic(n);
  for (int64_t step = 2; step < 4; ++step) {
    std::vector<int> order = plan.Order(step);
    std::vector<int> prev = plan.Order(step - 1);
    std::vector<bool> hit(n, false);
    if (in.techniques.cache_reuse) {
      for (int p = n - plan.num_cached; p < n; ++p) hit[prev[p]] = true;
    }
    for (int p = 0; p < n; ++p) {
      const int i = order[p];
      const double rec = static_cast<double>(plan.record_bytes[i]);
      if (!hit[i]) sub_traffic[i].read += rec / 2;
      if (!plan.KeptAfterUpdate(step, p)) sub_traffic[i].write += rec / 2;
      if (eager_grads) {
        sub_traffic[i].read += in.subgroup_numel[i] * 4.0 / 2;
        sub_traffic[i].grad += in.subgroup_numel[i] * 4.0 / 2;
      }
    }
  }
  const Placement problem{eff, capacity, target, disk_bytes, sub_traffic};
  // The index-order placement: every window of the streaming order is spread
  // over the tiers in proportion, so the tiers stream side by side all
  // through the step (the engine reads a few records ahead, in order). A
  // placement balanced only in total, e.g. the small records on one tier
  // and a large one on the other, can look faster to the model above, which
  // sums each tier's bytes over the step, while the tiers would take turns.
  // Only when that placement runs out of room: balance the traffic, largest
  // first onto the tier that finishes earliest (by disk size, or best fit,
  // when capacity is tight), improved by moves and swaps.
  std::vector<int> index_order(n, 0);
  int index_order_failed = -1;
  const bool index_order_ok =
      !fixed && IndexOrderPlacement(problem, &index_order, &index_order_failed);
  if (fixed) {
    plan.tier_of_subgroup = in.placement;
  } else if (index_order_ok) {
    plan.tier_of_subgroup = std::move(index_order);
  } else {
    std::vector<TrafficKey> keys(n);
    for (int i = 0; i < n; ++i) {
      keys[i] = TrafficKey{sub_traffic[i].total(), disk_bytes[i],
                           sub_traffic[i].read, sub_traffic[i].write, i};
    }
    std::sort(keys.begin(), keys.end(), LargerTrafficFirst);
    std::vector<int> by_traffic(n), kind_start;
    for (int x = 0; x < n; ++x) {
      by_traffic[x] = keys[x].index;
      if (x == 0 || !keys[x].SameKind(keys[x - 1])) kind_start.push_back(x);
    }
    kind_start.push_back(n);
    std::vector<int> balanced(n, 0);
    bool balanced_ok =
        PlaceInOrder(problem, by_traffic, Choice::kEarliestFinish, &balanced);
    // Capacity is tight: largest on disk first, then best fit.
    std::vector<int> by_disk;
    if (!balanced_ok) {
      by_disk = by_traffic;
      std::stable_sort(by_disk.begin(), by_disk.end(), [&](int x, int y) {
        return disk_bytes[x] > disk_bytes[y];
      });
      balanced_ok =
          PlaceInOrder(problem, by_disk, Choice::kEarliestFinish, &balanced) ||
          PlaceInOrder(problem, by_disk, Choice::kBestFit, &balanced);
    }
    if (!balanced_ok) {
      std::vector<std::string> per_tier;
      for (int t = 0; t < active; ++t) {
        per_tier.push_back(absl::StrCat(
            "tier ", t, " (", in.tiers[t].path, "): ",
            std::isfinite(capacity[t])
                ? absl::StrCat(HumanBytes(capacity[t]), " (",
                               in.tiers[t].capacity_bytes, " bytes)")
                : "unbounded"));
      }
      const int largest = by_disk[0];
      return absl::ResourceExhaustedError(absl::StrFormat(
          "plan: no tier has room for subgroup %d (%d bytes): no placement "
          "found fits the tiers' capacities: the state needs %s (%d bytes) on "
          "disk in total (two slots per subgroup; the largest, subgroup %d, "
          "needs %d bytes on one tier) and the tiers hold %s in total: %s",
          index_order_failed, disk_bytes[index_order_failed],
          HumanBytes(total_disk), total_disk, largest, disk_bytes[largest],
          HumanBytes(total_capacity), absl::StrJoin(per_tier, ", ")));
    }
    ImprovePlacement(problem, by_traffic, kind_start, &balanced);
    plan.tier_of_subgroup = std::move(balanced);
  }

  // Each tier's steady-state traffic: its subgroups'.
  plan.traffic.assign(num_tiers, TierTraffic{});
  std::vector<double> reads(num_tiers, 0), writes(num_tiers, 0),
      grad_writes(num_tiers, 0);
  for (int i = 0; i < n; ++i) {
    const int t = plan.tier_of_subgroup[i];
    reads[t] += sub_traffic[i].read;
    writes[t] += sub_traffic[i].write;
    grad_writes[t] += sub_traffic[i].grad;
  }
  // The baseline's gradient writes happen in backward, before the update
  // phase can start: they add to the step instead of overlapping it.
  plan.predicted_io_seconds = 0;
  double grad_seconds = 0;
  for (int t = 0; t < num_tiers; ++t) {
    plan.traffic[t].bytes_read = static_cast<uint64_t>(reads[t]);
    plan.traffic[t].bytes_written =
        static_cast<uint64_t>(writes[t] + grad_writes[t]);
    if (t < active) {
      double update =
          eff[t].Seconds(static_cast<double>(static_cast<uint64_t>(reads[t])),
                         static_cast<double>(static_cast<uint64_t>(writes[t])));
      double grads = grad_writes[t] / eff[t].write_bw;
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
