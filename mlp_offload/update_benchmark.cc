// The update phase of MLP-Offload against its ZeRO-Infinity-like baseline on
// the same data: baseline, each technique alone, and all together, over two
// throttled tiers (a fast local drive and a shared file system with half its
// bandwidth, the paper's 2:1 split).
//
// With --ranks=N, N processes (the ranks of a node, each owning params/N as
// in ZeRO-3) update at once, step after step in lockstep like data-parallel
// training, and the two tiers are two shared devices: their caps hold for
// all ranks together, and --contention says how much bandwidth a device
// loses to concurrent streams (io/shared_throttle.h). That is where the tier
// lock (technique 4) matters; a step is timed from the moment all ranks
// start to the moment the last one is done.
//
//   bazel run -c opt //mlp_offload:update_benchmark -- --params=2e8 --json
//   bazel run -c opt //mlp_offload:update_benchmark -- --params=1e8 --ranks=4
//       --contention=0.5 --configs=mlp-tier_lock,mlp,mlp:per_direction
#include <ftw.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "mlp_offload/base/clock.h"
#include "mlp_offload/base/status_macros.h"
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
    "configurations to run, in order: baseline, mlp, a technique's name "
    "(baseline plus it), or mlp-<technique> (all but it); a name with the "
    "tier lock may add :per_direction (reads and writes locked apart) and "
    ":slots=N (N ranks at a time)");
ABSL_FLAG(int, ranks, 1,
          "processes sharing the tiers, each updating params/ranks; > 1 "
          "makes each tier's caps one shared device");
ABSL_FLAG(double, contention, 0,
          "with --ranks > 1: a tier streamed by k ranks at once gives "
          "cap / (1 + contention * (k - 1)) in total");
ABSL_FLAG(bool, half_duplex, false,
          "the caps emulate devices that read or write, not both at once "
          "(one clock for both directions); default: full duplex, each "
          "direction with its cap to itself");
ABSL_FLAG(std::string, tier_lock_dir, "",
          "directory of the tier locks' files (default: a temporary one, "
          "removed at the end)");
ABSL_FLAG(bool, json, false, "print one JSON object per configuration");

namespace mlp_offload {
namespace {

absl::StatusOr<Techniques> ParseTechniques(const std::string& name) {
  Techniques t = Techniques::Baseline();
  if (name == "baseline") return t;
  if (name == "mlp") return Techniques::All();
  if (name.rfind("mlp-", 0) == 0) {
    Techniques all = Techniques::All();
    const std::string off = name.substr(4);
    if (off == "multipath")
      all.multipath = false;
    else if (off == "cache_reuse")
      all.cache_reuse = false;
    else if (off == "delayed_grad_conversion")
      all.delayed_grad_conversion = false;
    else if (off == "tier_lock")
      all.tier_lock = false;
    else
      return absl::InvalidArgumentError(
          absl::StrCat("unknown technique '", off, "' in config '", name, "'"));
    return all;
  }
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

// A configuration: its techniques and how the tier lock covers a rank's I/O.
struct BenchConfig {
  Techniques techniques;
  TierLockMode lock_mode = TierLockMode::kExclusive;
  int lock_slots = 1;
};

// A techniques name (see ParseTechniques), then optionally, for a config
// with the tier lock, ":per_direction" (reads and writes take separate
// locks) and/or ":slots=N" (N ranks at a time per tier).
absl::StatusOr<BenchConfig> ParseConfig(const std::string& name) {
  std::vector<std::string> parts = absl::StrSplit(name, ':');
  BenchConfig config;
  MLP_ASSIGN_OR_RETURN(config.techniques, ParseTechniques(parts[0]));
  for (size_t i = 1; i < parts.size(); ++i) {
    if (!config.techniques.tier_lock) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config '", name, "': ':", parts[i], "' needs the tier lock"));
    }
    if (parts[i] == "per_direction") {
      config.lock_mode = TierLockMode::kPerDirection;
    } else if (!absl::StartsWith(parts[i], "slots=") ||
               !absl::SimpleAtoi(parts[i].substr(6), &config.lock_slots) ||
               config.lock_slots < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("config '", name, "': unknown option '", parts[i],
                       "' (per_direction or slots=N, N >= 1)"));
    }
  }
  return config;
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

// One rank's part of the model: bf16 params and gradients per subgroup.
struct Shard {
  std::vector<uint64_t> sizes;
  std::vector<std::vector<uint16_t>> model, grads;
  std::mt19937 rng;
};

Shard MakeShard(uint64_t params, uint64_t sg, uint32_t seed) {
  Shard shard;
  for (uint64_t done = 0; done < params; done += sg)
    shard.sizes.push_back(std::min(sg, params - done));
  const size_t n = shard.sizes.size();
  shard.model.resize(n);
  shard.grads.resize(n);
  shard.rng.seed(seed);
  std::normal_distribution<float> dist(0, 1);
  for (size_t i = 0; i < n; ++i) {
    shard.model[i].resize(shard.sizes[i]);
    shard.grads[i].resize(shard.sizes[i]);
    for (auto& x : shard.model[i]) x = ToBf16(dist(shard.rng));
  }
  return shard;
}

struct Setup {
  std::vector<std::string> dirs;
  std::string lock_dir;
  double fast = 0, slow = 0;
  uint64_t budget = 0;  // per rank
  int ranks = 1;
  double contention = 0;
  bool half_duplex = false;
  int threads = 2;  // per rank
};

// The engine's run directory of configuration `name` on rank `rank`.
std::string RunName(const std::string& name, const Setup& setup, int rank) {
  return setup.ranks > 1 ? absl::StrCat("bench_", name, "_r", rank)
                         : absl::StrCat("bench_", name);
}

// Removes `path` and everything under it (never following symlinks).
void RemoveTree(const std::string& path) {
  nftw(
      path.c_str(),
      [](const char* p, const struct stat*, int, struct FTW*) {
        remove(p);
        return 0;
      },
      16, FTW_DEPTH | FTW_PHYS);
}

// Removes the directories added to it when it goes out of scope: the
// benchmark's state files are gigabytes, and a run leaves none behind.
class TreeRemover {
 public:
  TreeRemover() = default;
  void Add(std::string path) { paths_.push_back(std::move(path)); }
  ~TreeRemover() {
    for (const std::string& p : paths_) RemoveTree(p);
  }
  TreeRemover(const TreeRemover&) = delete;
  TreeRemover& operator=(const TreeRemover&) = delete;

 private:
  std::vector<std::string> paths_;
};

// A rank's engine over its shard, one configuration.
class Worker {
 public:
  static absl::StatusOr<std::unique_ptr<Worker>> Create(
      const std::string& name, const BenchConfig& config, const Setup& setup,
      int rank, Shard* shard) {
    EngineConfig cfg;
    for (int t = 0; t < 2; ++t) {
      TierSpec spec;
      spec.path = setup.dirs[t];
      spec.name = t == 0 ? "fast" : "slow";
      spec.throttle_read_bytes_per_sec = spec.throttle_write_bytes_per_sec =
          t == 0 ? setup.fast : setup.slow;
      spec.throttle_half_duplex = setup.half_duplex;
      spec.shared_by = setup.ranks;
      if (setup.ranks > 1) {
        spec.throttle_shared = true;
        spec.throttle_contention = setup.contention;
      }
      cfg.tiers.push_back(spec);
    }
    cfg.host_budget_bytes = setup.budget;
    cfg.tier_lock_dir = setup.lock_dir;
    cfg.subgroup_numel = shard->sizes;
    cfg.num_state_arrays = 2;
    cfg.grad_dtype = DType::kBFloat16;
    cfg.techniques = config.techniques;
    cfg.tier_lock_mode = config.lock_mode;
    cfg.tier_lock_slots = config.lock_slots;
    cfg.compute_threads = setup.threads;
    cfg.run_name = RunName(name, setup, rank);
    MLP_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::Create(cfg));
    auto w = std::unique_ptr<Worker>(new Worker(std::move(engine), shard));
    for (size_t i = 0; i < shard->sizes.size(); ++i) {
      MLP_RETURN_IF_ERROR(w->engine_->InitializeSubgroup(
          static_cast<int>(i), shard->model[i].data(), DType::kBFloat16));
    }
    return w;
  }

  // Fresh gradients, then the step as the mode does it (the baseline's
  // eager gradient conversion and writes included), timed.
  absl::StatusOr<StepStats> Step(double* seconds) {
    std::normal_distribution<float> dist(0, 1);
    for (auto& g : shard_->grads)
      for (auto& x : g) x = ToBf16(0.01f * dist(shard_->rng));
    const MonoTime start = MonoNow();
    for (size_t i = 0; i < inputs_.size(); ++i) {
      MLP_RETURN_IF_ERROR(
          engine_->OffloadGradients(static_cast<int>(i), inputs_[i].segments));
    }
    MLP_ASSIGN_OR_RETURN(StepStats stats,
                         engine_->Step(inputs_, StepOptions()));
    *seconds = SecondsSince(start);
    return stats;
  }

  const Plan& plan() const { return engine_->plan(); }

 private:
  Worker(std::unique_ptr<Engine> engine, Shard* shard)
      : engine_(std::move(engine)),
        shard_(shard),
        inputs_(shard->sizes.size()) {
    for (size_t i = 0; i < inputs_.size(); ++i) {
      inputs_[i].hp.kind = OptimizerKind::kAdamW;
      inputs_[i].hp.lr = 1e-4f;
      inputs_[i].hp.weight_decay = 0.01f;
      inputs_[i].segments = {Segment{0, shard->sizes[i], shard->grads[i].data(),
                                     shard->model[i].data()}};
    }
  }

  std::unique_ptr<Engine> engine_;
  Shard* shard_;
  std::vector<SubgroupStepInput> inputs_;
};

// What a configuration measured: medians over the measured steps (per rank,
// then averaged over ranks), bytes of the last step summed over ranks.
struct Summary {
  double step = 0, read_wait = 0, compute = 0, write_wait = 0, grads = 0,
         checksum = 0;
  double bytes_read[2] = {0, 0}, bytes_written[2] = {0, 0};
  double predicted = 0;
  int cache_hits = 0, num_cached = 0;
};

// Per-rank report sent to the parent through a pipe (fixed size, < PIPE_BUF).
struct RankReport {
  int rank;
  int ok;
  Summary summary;
};

absl::StatusOr<Summary> RunRank(const std::string& name,
                                const BenchConfig& config, const Setup& setup,
                                int rank, Shard* shard,
                                const std::function<void()>& before_step,
                                const std::function<void()>& after_step) {
  // Declared first, so it runs after the engine is gone.
  TreeRemover remove_run_dirs;
  for (const std::string& d : setup.dirs)
    remove_run_dirs.Add(absl::StrCat(d, "/", RunName(name, setup, rank)));
  MLP_ASSIGN_OR_RETURN(std::unique_ptr<Worker> worker,
                       Worker::Create(name, config, setup, rank, shard));
  std::vector<double> times, read_wait, compute, write_wait, grads, checksum;
  StepStats last;
  const int steps = absl::GetFlag(FLAGS_steps);
  for (int step = 0; step <= steps; ++step) {
    before_step();
    double secs = 0;
    MLP_ASSIGN_OR_RETURN(StepStats stats, worker->Step(&secs));
    after_step();
    if (step == 0) continue;  // warm-up: the caches fill
    times.push_back(secs);
    read_wait.push_back(stats.read_wait_seconds);
    compute.push_back(stats.compute_seconds);
    write_wait.push_back(stats.write_wait_seconds);
    grads.push_back(stats.grad_offload_seconds);
    checksum.push_back(stats.checksum_seconds);
    last = stats;
  }
  Summary s;
  s.step = Median(times);
  s.read_wait = Median(read_wait);
  s.compute = Median(compute);
  s.write_wait = Median(write_wait);
  s.grads = Median(grads);
  s.checksum = Median(checksum);
  for (int t = 0; t < 2; ++t) {
    s.bytes_read[t] = static_cast<double>(last.bytes_read[t]);
    s.bytes_written[t] = static_cast<double>(last.bytes_written[t]);
  }
  s.predicted = worker->plan().predicted_seconds;
  s.cache_hits = last.cache_hits;
  s.num_cached = worker->plan().num_cached;
  return s;
}

bool WriteAll(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool ReadAll(int fd, void* data, size_t n) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r = read(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

// Runs one configuration on `ranks` forked processes in lockstep. The parent
// only keeps time: each step starts when every rank is ready and ends when
// the last one is done.
absl::StatusOr<Summary> RunRanks(const std::string& name,
                                 const BenchConfig& config, const Setup& setup,
                                 uint64_t params, uint64_t sg) {
  // Fresh device clocks and stream counts for every configuration, and no
  // state file left behind in the lock directory.
  struct ThrottleStates {
    std::vector<std::string> paths;
    void Remove() const {
      for (const std::string& p : paths) unlink(p.c_str());
    }
    ~ThrottleStates() { Remove(); }
  } throttle_states;
  for (const std::string& d : setup.dirs) {
    absl::StatusOr<std::string> state = SharedThrottlePath(setup.lock_dir, d);
    if (state.ok()) throttle_states.paths.push_back(*state);
  }
  throttle_states.Remove();
  int up[2], go[2], report[2];
  if (pipe(up) != 0 || pipe(go) != 0 || pipe(report) != 0)
    return absl::InternalError(absl::StrCat("pipe: ", std::strerror(errno)));
  std::fflush(stdout);  // or the children's copies of the buffer
  std::vector<pid_t> children;
  for (int r = 0; r < setup.ranks; ++r) {
    const pid_t pid = fork();
    if (pid < 0)
      return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
    if (pid == 0) {
      close(up[0]);
      close(go[1]);
      close(report[0]);
      // Each rank owns params / ranks (the last one the remainder).
      const uint64_t per = params / setup.ranks;
      const uint64_t mine = r + 1 == setup.ranks ? params - per * r : per;
      Shard shard = MakeShard(mine, sg, 1 + r);
      auto barrier_in = [&] {
        const char c = 'r';
        char g;
        if (!WriteAll(up[1], &c, 1) || !ReadAll(go[0], &g, 1)) _exit(3);
      };
      auto barrier_out = [&] {
        const char c = 'd';
        if (!WriteAll(up[1], &c, 1)) _exit(3);
      };
      absl::StatusOr<Summary> s =
          RunRank(name, config, setup, r, &shard, barrier_in, barrier_out);
      RankReport rep{r, s.ok() ? 1 : 0, s.ok() ? *s : Summary()};
      if (!s.ok())
        std::fprintf(stderr, "%s rank %d: %s\n", name.c_str(), r,
                     s.status().ToString().c_str());
      _exit(WriteAll(report[1], &rep, sizeof(rep)) && s.ok() ? 0 : 1);
    }
    children.push_back(pid);
  }
  close(up[1]);
  close(go[0]);
  close(report[1]);
  // A rank that fails closes its pipe ends; when all are gone reads see EOF.
  // A failed rank while others wait at the barrier: the parent kills all.
  std::vector<bool> exited(children.size(), false);
  auto fail = [&](const std::string& why) {
    for (size_t i = 0; i < children.size(); ++i) {
      if (exited[i]) continue;
      kill(children[i], SIGKILL);
      waitpid(children[i], nullptr, 0);
    }
    close(up[0]);
    close(go[1]);
    close(report[0]);
    return absl::InternalError(absl::StrCat(name, ": ", why));
  };
  // A rank done with a step may announce itself ready for the next one
  // before the others are done: count both kinds of byte as they come.
  int seen_ready = 0, seen_done = 0;
  auto gather = [&](char want) -> bool {
    int& seen = want == 'r' ? seen_ready : seen_done;
    while (seen < setup.ranks) {
      pollfd p{up[0], POLLIN, 0};
      const int rc = poll(&p, 1, 200);
      if (rc < 0 && errno != EINTR) return false;
      if (rc > 0) {
        char c;
        if (!ReadAll(up[0], &c, 1) || (c != 'r' && c != 'd')) return false;
        ++(c == 'r' ? seen_ready : seen_done);
        continue;
      }
      // A rank that finished its last step may already be gone (its bytes
      // are still in the pipe); one that died or failed is an error.
      for (size_t i = 0; i < children.size(); ++i) {
        if (exited[i]) continue;
        int status;
        if (waitpid(children[i], &status, WNOHANG) == children[i]) {
          exited[i] = true;
          if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return false;
        }
      }
    }
    seen -= setup.ranks;
    return true;
  };
  std::vector<double> times;
  const int steps = absl::GetFlag(FLAGS_steps);
  for (int step = 0; step <= steps; ++step) {
    if (!gather('r')) return fail("a rank failed (see above)");
    const MonoTime start = MonoNow();
    const std::string bytes(setup.ranks, 'g');
    if (!WriteAll(go[1], bytes.data(), bytes.size()))
      return fail("cannot release the ranks");
    if (!gather('d')) return fail("a rank failed (see above)");
    if (step > 0) times.push_back(SecondsSince(start));
  }
  Summary total;
  for (int r = 0; r < setup.ranks; ++r) {
    RankReport rep;
    if (!ReadAll(report[0], &rep, sizeof(rep)) || !rep.ok)
      return fail("a rank failed to report");
    const double w = 1.0 / setup.ranks;
    total.read_wait += w * rep.summary.read_wait;
    total.compute += w * rep.summary.compute;
    total.write_wait += w * rep.summary.write_wait;
    total.grads += w * rep.summary.grads;
    total.checksum += w * rep.summary.checksum;
    total.predicted = std::max(total.predicted, rep.summary.predicted);
    total.cache_hits += rep.summary.cache_hits;
    total.num_cached += rep.summary.num_cached;
    for (int t = 0; t < 2; ++t) {
      total.bytes_read[t] += rep.summary.bytes_read[t];
      total.bytes_written[t] += rep.summary.bytes_written[t];
    }
  }
  for (size_t i = 0; i < children.size(); ++i) {
    if (exited[i]) continue;  // reaped by gather, with status 0
    int status = 0;
    waitpid(children[i], &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
      return fail("a rank exited with an error");
  }
  close(up[0]);
  close(go[1]);
  close(report[0]);
  total.step = Median(times);
  return total;
}

int Run() {
  const uint64_t params = static_cast<uint64_t>(absl::GetFlag(FLAGS_params));
  const uint64_t sg = static_cast<uint64_t>(absl::GetFlag(FLAGS_subgroup));
  const int ranks = absl::GetFlag(FLAGS_ranks);
  if (ranks < 1 || sg == 0 || params < sg * static_cast<uint64_t>(ranks)) {
    std::fprintf(stderr,
                 "need --ranks >= 1, --subgroup > 0 and at least one subgroup "
                 "per rank\n");
    return 2;
  }
  if (absl::GetFlag(FLAGS_contention) < 0) {
    std::fprintf(stderr, "--contention must be >= 0\n");
    return 2;
  }

  Setup setup;
  setup.ranks = ranks;
  setup.contention = absl::GetFlag(FLAGS_contention);
  setup.threads = std::max(1, absl::GetFlag(FLAGS_threads) / ranks);
  setup.dirs =
      absl::StrSplit(absl::GetFlag(FLAGS_tiers), ',', absl::SkipEmpty());
  TreeRemover remove_made;  // temporary directories, removed at the end
  auto make_temp_dir = [&remove_made](std::string* dir) {
    char tmpl[] = "/tmp/mlp_offload_bench_XXXXXX";
    char* d = mkdtemp(tmpl);
    if (d == nullptr) {
      std::perror("mkdtemp");
      return false;
    }
    *dir = d;
    remove_made.Add(d);
    return true;
  };
  if (setup.dirs.empty()) {
    setup.dirs.resize(2);
    for (std::string& d : setup.dirs) {
      if (!make_temp_dir(&d)) return 1;
    }
  }
  setup.lock_dir = absl::GetFlag(FLAGS_tier_lock_dir);
  if (setup.lock_dir.empty() && !make_temp_dir(&setup.lock_dir)) return 1;
  if (setup.dirs.size() != 2) {
    std::fprintf(stderr, "--tiers needs two directories\n");
    return 2;
  }
  setup.fast = absl::GetFlag(FLAGS_fast_mbps) * 1e6;
  setup.slow = setup.fast * absl::GetFlag(FLAGS_slow_ratio);
  setup.half_duplex = absl::GetFlag(FLAGS_half_duplex);
  const uint64_t state_bytes = params * 12;
  const uint64_t budget =
      static_cast<uint64_t>(state_bytes * absl::GetFlag(FLAGS_budget_fraction));
  setup.budget = budget / ranks;
  const int n = static_cast<int>((params + sg - 1) / sg);
  if (!absl::GetFlag(FLAGS_json)) {
    std::printf(
        "update phase: %.3g params (AdamW, bf16 grads and params), %d "
        "subgroups of %.3g, "
        "state %.2f GB, host budget %.2f GB\n",
        static_cast<double>(params), n, static_cast<double>(sg),
        state_bytes / 1e9, budget / 1e9);
    std::printf(
        "tiers: %s capped at %.0f MB/s read and write; %s capped at %.0f MB/s "
        "(%s)\n",
        setup.dirs[0].c_str(), setup.fast / 1e6, setup.dirs[1].c_str(),
        setup.slow / 1e6,
        setup.half_duplex
            ? absl::StrFormat("half duplex: reads and writes share each cap, "
                              "%.0f MB/s together",
                              (setup.fast + setup.slow) / 1e6)
                  .c_str()
            : absl::StrFormat("full duplex: caps together %.0f MB/s",
                              2 * (setup.fast + setup.slow) / 1e6)
                  .c_str());
    if (ranks > 1) {
      std::printf(
          "%d ranks, each %.3g params, %d compute thread(s) and %.2f GB of "
          "host budget; each tier is one device shared by all ranks, "
          "contention %.2f (k streams at once: cap / (1 + %.2f (k-1)))\n",
          ranks, static_cast<double>(params) / ranks, setup.threads,
          setup.budget / 1e9, setup.contention, setup.contention);
    }
  }

  // One process: the shard is built once and reused by every configuration.
  Shard shard;
  if (ranks == 1) shard = MakeShard(params, sg, 1);

  std::vector<std::string> names =
      absl::StrSplit(absl::GetFlag(FLAGS_configs), ',', absl::SkipEmpty());
  std::vector<std::string> rows;
  for (const std::string& name : names) {
    auto config = ParseConfig(name);
    if (!config.ok()) {
      std::fprintf(stderr, "%s\n",
                   std::string(config.status().message()).c_str());
      return 2;
    }
    absl::StatusOr<Summary> result =
        ranks == 1 ? RunRank(
                         name, *config, setup, 0, &shard, [] {}, [] {})
                   : RunRanks(name, *config, setup, params, sg);
    if (!result.ok()) {
      std::fprintf(stderr, "%s: %s\n", name.c_str(),
                   result.status().ToString().c_str());
      return 1;
    }
    const Summary& s = *result;
    // The I/O lower bound: the slowest tier moving all ranks' bytes at its
    // full cap (no contention loss: what perfect turn-taking achieves), both
    // directions at once (full duplex) or one after the other.
    double br = 0, bw = 0, lower = 0;
    for (int t = 0; t < 2; ++t) {
      br += s.bytes_read[t];
      bw += s.bytes_written[t];
      const double cap = t == 0 ? setup.fast : setup.slow;
      const double moved = setup.half_duplex
                               ? s.bytes_read[t] + s.bytes_written[t]
                               : std::max(s.bytes_read[t], s.bytes_written[t]);
      lower = std::max(lower, moved / cap);
    }
    if (absl::GetFlag(FLAGS_json)) {
      // No caps (--fast_mbps=0): no bound; JSON has no inf.
      auto number = [](double x) {
        return std::isfinite(x) ? absl::StrFormat("%.4f", x)
                                : std::string("null");
      };
      std::printf(
          "{\"config\": \"%s\", \"params\": %llu, \"subgroups\": %d, "
          "\"steps\": %d, \"ranks\": %d, \"contention\": %.3f, "
          "\"step_seconds_median\": %.4f, \"io_lower_bound_seconds\": %s, "
          "\"predicted_seconds\": %s, \"bytes_read\": %.0f, "
          "\"bytes_written\": %.0f, "
          "\"read_wait_seconds\": %.4f, \"compute_seconds\": %.4f, "
          "\"checksum_seconds\": %.4f, "
          "\"write_wait_seconds\": %.4f, \"grad_offload_seconds\": %.4f, "
          "\"cache_hits\": %d, \"num_cached\": %d, \"fast_cap_bytes_per_sec\": "
          "%.0f, "
          "\"slow_cap_bytes_per_sec\": %.0f, \"half_duplex\": %s}\n",
          name.c_str(), static_cast<unsigned long long>(params), n,
          absl::GetFlag(FLAGS_steps), ranks, setup.contention, s.step,
          number(lower).c_str(), number(s.predicted).c_str(), br, bw,
          s.read_wait, s.compute, s.checksum, s.write_wait, s.grads,
          s.cache_hits, s.num_cached, setup.fast, setup.slow,
          setup.half_duplex ? "true" : "false");
    } else {
      rows.push_back(absl::StrFormat(
          "%-24s %8.2f %8.2f %8.2f %7.2f %7.2f %7.2f %7.2f %7.2f %8.2f %8.2f",
          name, s.step, lower, s.predicted, s.read_wait, s.compute, s.checksum,
          s.write_wait, s.grads, br / 1e9, bw / 1e9));
      std::printf("%s done\n", name.c_str());
    }
    std::fflush(stdout);
  }
  if (!absl::GetFlag(FLAGS_json)) {
    std::printf("\n%-24s %8s %8s %8s %7s %7s %7s %7s %7s %8s %8s\n", "config",
                "step_s", "io_lb_s", "pred_s", "rd_wait", "compute", "chksum",
                "wr_wait", "grads", "read_GB", "write_GB");
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
