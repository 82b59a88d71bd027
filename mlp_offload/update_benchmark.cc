// The update phase of MLP-Offload against its ZeRO-Infinity-like baseline,
// in one process on the same data: baseline, each technique alone, and all
// together, over two throttled tiers (a fast local drive and a shared file
// system with half its bandwidth, PAPER.md's 2:1 split).
//
//   bazel run -c opt //mlp_offload:update_benchmark -- --params=2e8 --json
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "mlp_offload/engine.h"

ABSL_FLAG(double, params, 2e8,
          "parameters (AdamW: 12 bytes of fp32 state each)");
ABSL_FLAG(double, subgroup, 2.5e6, "parameters per subgroup");
ABSL_FLAG(double, budget_fraction, 0.25,
          "host budget as a fraction of the state");
ABSL_FLAG(std::string, tiers, "",
          "two comma-separated directories (default: temp dirs)");
ABSL_FLAG(double, fast_mbps, 120,
          "cap of the fast tier, MB/s, each for reads and writes");
ABSL_FLAG(double, slow_ratio, 0.5,
          "the slow tier's cap relative to the fast one");
ABSL_FLAG(int, steps, 5, "measured steps (after one warm-up step)");
ABSL_FLAG(int, threads, 2, "compute threads");
ABSL_FLAG(
    std::string, configs,
    "baseline,multipath,cache_reuse,delayed_grad_conversion,tier_lock,mlp",
    "configurations to run, in order");
ABSL_FLAG(bool, json, false, "print one JSON object per configuration");

namespace mlp_offload {
namespace {

absl::StatusOr<Techniques> ParseConfig(const std::string& name) {
  Techniques t = Techniques::Baseline();
  if (name == "baseline") return t;
  if (name == "mlp") return Techniques::All();
  if (name == "multipath")
    t.multipath = true;
  else if (name == "cache_reuse")
    t.cache_reuse = true;
  else if (name == "delayed_grad_conversion")
    t.delayed_grad_conversion = true;
  else if (name == "tier_lock")
    t.tier_lock = true;
  else
    return absl::InvalidArgumentError(
        absl::StrCat("unknown config '", name, "'"));
  return t;
}

uint16_t ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

int Run() {
  const uint64_t params = static_cast<uint64_t>(absl::GetFlag(FLAGS_params));
  const uint64_t sg = static_cast<uint64_t>(absl::GetFlag(FLAGS_subgroup));
  std::vector<uint64_t> sizes;
  for (uint64_t done = 0; done < params; done += sg)
    sizes.push_back(std::min(sg, params - done));
  const int n = static_cast<int>(sizes.size());

  std::vector<std::string> dirs =
      absl::StrSplit(absl::GetFlag(FLAGS_tiers), ',', absl::SkipEmpty());
  if (dirs.empty()) {
    for (int t = 0; t < 2; ++t) {
      char tmpl[] = "/tmp/mlp_offload_bench_XXXXXX";
      char* d = mkdtemp(tmpl);
      if (d == nullptr) {
        std::perror("mkdtemp");
        return 1;
      }
      dirs.push_back(d);
    }
  }
  if (dirs.size() != 2) {
    std::fprintf(stderr, "--tiers needs two directories\n");
    return 2;
  }
  const double fast = absl::GetFlag(FLAGS_fast_mbps) * 1e6;
  const double slow = fast * absl::GetFlag(FLAGS_slow_ratio);
  const uint64_t state_bytes = params * 12;
  const uint64_t budget =
      static_cast<uint64_t>(state_bytes * absl::GetFlag(FLAGS_budget_fraction));
  if (!absl::GetFlag(FLAGS_json)) {
    std::printf(
        "update phase: %.3g params (AdamW, bf16 grads and params), %d "
        "subgroups of %.3g, "
        "state %.2f GB, host budget %.2f GB\n",
        static_cast<double>(params), n, static_cast<double>(sg),
        state_bytes / 1e9, budget / 1e9);
    std::printf(
        "tiers: %s capped at %.0f MB/s read and write; %s capped at %.0f MB/s "
        "(caps together %.0f MB/s)\n",
        dirs[0].c_str(), fast / 1e6, dirs[1].c_str(), slow / 1e6,
        2 * (fast + slow) / 1e6);
  }

  // The model's side: bf16 params and gradients, fresh each step.
  std::vector<std::vector<uint16_t>> model(n), grads(n);
  std::mt19937 rng(1);
  std::normal_distribution<float> dist(0, 1);
  std::vector<float> init;
  for (int i = 0; i < n; ++i) {
    model[i].resize(sizes[i]);
    grads[i].resize(sizes[i]);
    for (auto& x : model[i]) x = ToBf16(dist(rng));
  }

  std::vector<std::string> names =
      absl::StrSplit(absl::GetFlag(FLAGS_configs), ',', absl::SkipEmpty());
  std::vector<std::string> rows;
  for (const std::string& name : names) {
    auto tech = ParseConfig(name);
    if (!tech.ok()) {
      std::fprintf(stderr, "%s\n",
                   std::string(tech.status().message()).c_str());
      return 2;
    }
    EngineConfig cfg;
    for (int t = 0; t < 2; ++t) {
      TierSpec spec;
      spec.path = dirs[t];
      spec.name = t == 0 ? "fast" : "slow";
      spec.throttle_read_bytes_per_sec = spec.throttle_write_bytes_per_sec =
          t == 0 ? fast : slow;
      cfg.tiers.push_back(spec);
    }
    cfg.host_budget_bytes = budget;
    cfg.subgroup_numel = sizes;
    cfg.num_state_arrays = 2;
    cfg.grad_dtype = DType::kBFloat16;
    cfg.techniques = *tech;
    cfg.compute_threads = absl::GetFlag(FLAGS_threads);
    cfg.run_name = absl::StrCat("bench_", name);
    auto engine = Engine::Create(cfg);
    if (!engine.ok()) {
      std::fprintf(stderr, "%s: %s\n", name.c_str(),
                   engine.status().ToString().c_str());
      return 1;
    }
    Engine& e = **engine;
    for (int i = 0; i < n; ++i) {
      absl::Status s =
          e.InitializeSubgroup(i, model[i].data(), DType::kBFloat16);
      if (!s.ok()) {
        std::fprintf(stderr, "init: %s\n", s.ToString().c_str());
        return 1;
      }
    }
    std::vector<SubgroupStepInput> inputs(n);
    for (int i = 0; i < n; ++i) {
      inputs[i].hp.kind = OptimizerKind::kAdamW;
      inputs[i].hp.lr = 1e-4f;
      inputs[i].hp.weight_decay = 0.01f;
      inputs[i].segments = {
          Segment{0, sizes[i], grads[i].data(), model[i].data()}};
    }
    std::vector<double> times, read_wait, compute, write_wait, grad_s;
    StepStats last;
    const int steps = absl::GetFlag(FLAGS_steps);
    for (int step = 0; step <= steps; ++step) {
      for (int i = 0; i < n; ++i) {
        for (auto& g : grads[i]) g = ToBf16(0.01f * dist(rng));
      }
      absl::Time start = absl::Now();
      // The baseline converts and swaps gradients out as backward produces
      // them; that time is part of its step.
      for (int i = 0; i < n; ++i) {
        absl::Status s = e.OffloadGradients(i, inputs[i].segments);
        if (!s.ok()) {
          std::fprintf(stderr, "offload: %s\n", s.ToString().c_str());
          return 1;
        }
      }
      auto stats = e.Step(inputs, StepOptions());
      double secs = absl::ToDoubleSeconds(absl::Now() - start);
      if (!stats.ok()) {
        std::fprintf(stderr, "step: %s\n", stats.status().ToString().c_str());
        return 1;
      }
      if (step == 0) continue;  // warm-up: the caches fill
      times.push_back(secs);
      read_wait.push_back(stats->read_wait_seconds);
      compute.push_back(stats->compute_seconds);
      write_wait.push_back(stats->write_wait_seconds);
      grad_s.push_back(stats->grad_offload_seconds);
      last = *stats;
    }
    uint64_t br = 0, bw = 0;
    double lower = 0;
    for (int t = 0; t < 2; ++t) {
      br += last.bytes_read[t];
      bw += last.bytes_written[t];
      double cap = t == 0 ? fast : slow;
      lower = std::max(
          lower, std::max(last.bytes_read[t], last.bytes_written[t]) / cap);
    }
    double med = Median(times);
    if (absl::GetFlag(FLAGS_json)) {
      std::printf(
          "{\"config\": \"%s\", \"params\": %llu, \"subgroups\": %d, "
          "\"steps\": %d, "
          "\"step_seconds_median\": %.4f, \"io_lower_bound_seconds\": %.4f, "
          "\"predicted_seconds\": %.4f, \"bytes_read\": %llu, "
          "\"bytes_written\": %llu, "
          "\"read_wait_seconds\": %.4f, \"compute_seconds\": %.4f, "
          "\"write_wait_seconds\": %.4f, \"grad_offload_seconds\": %.4f, "
          "\"cache_hits\": %d, \"num_cached\": %d, \"fast_cap_bytes_per_sec\": "
          "%.0f, "
          "\"slow_cap_bytes_per_sec\": %.0f}\n",
          name.c_str(), static_cast<unsigned long long>(params), n, steps, med,
          lower, e.plan().predicted_seconds,
          static_cast<unsigned long long>(br),
          static_cast<unsigned long long>(bw), Median(read_wait),
          Median(compute), Median(write_wait), Median(grad_s), last.cache_hits,
          e.plan().num_cached, fast, slow);
    } else {
      rows.push_back(absl::StrFormat(
          "%-24s %8.2f %8.2f %8.2f %7.2f %7.2f %7.2f %7.2f %8.2f %8.2f", name,
          med, lower, e.plan().predicted_seconds, Median(read_wait),
          Median(compute), Median(write_wait), Median(grad_s), br / 1e9,
          bw / 1e9));
      std::printf("%s done\n", name.c_str());
    }
    std::fflush(stdout);
  }
  if (!absl::GetFlag(FLAGS_json)) {
    std::printf("\n%-24s %8s %8s %8s %7s %7s %7s %7s %8s %8s\n", "config",
                "step_s", "io_lb_s", "pred_s", "rd_wait", "compute", "wr_wait",
                "grads", "read_GB", "write_GB");
    for (const auto& r : rows) std::printf("%s\n", r.c_str());
  }
  return 0;
}

}  // namespace
}  // namespace mlp_offload

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return mlp_offload::Run();
}
