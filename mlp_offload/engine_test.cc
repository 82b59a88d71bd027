#include "mlp_offload/engine.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <future>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "io/fault_injection.h"
#include "io/internal/test_util.h"
#include "io/tier_lock.h"
#include "mlp_offload/base/clock.h"
#include "mlp_offload/base/threads.h"
#include "mlp_offload/state_store.h"

namespace mlp_offload {
namespace {

std::string TempDir(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string dir = absl::StrCat(base ? base : "/tmp", "/", name, "_", getpid(),
                                 "_", std::rand());
  mkdir(dir.c_str(), 0700);
  return dir;
}

uint16_t ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

// A model: subgroups of given sizes, two params per subgroup (segments), bf16
// gradients and bf16 model params.
struct Model {
  std::vector<uint64_t> sizes;
  std::vector<std::vector<float>> init;            // fp32 initial params
  std::vector<std::vector<uint16_t>> params_bf16;  // the model's copy
  std::vector<std::vector<uint16_t>> grads;        // this step's grads

  explicit Model(std::vector<uint64_t> s, uint32_t seed) : sizes(std::move(s)) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> d(0, 1);
    for (uint64_t n : sizes) {
      init.emplace_back(n);
      for (float& x : init.back()) x = d(rng);
      params_bf16.emplace_back(n, 0);
      grads.emplace_back(n, 0);
    }
  }
  void NewGrads(uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> d(0, 0.1f);
    for (auto& g : grads) {
      for (auto& x : g) x = ToBf16(d(rng));
    }
  }
  std::vector<Segment> Segments(int i) {
    uint64_t n = sizes[i], half = n / 2;
    std::vector<Segment> segs(2);
    segs[0] = {0, half, grads[i].data(), params_bf16[i].data()};
    segs[1] = {half, n - half, grads[i].data() + half,
               params_bf16[i].data() + half};
    if (half == 0) segs.erase(segs.begin());
    return segs;
  }
};

// Every subgroup of `e` initialised from the model's fp32 parameters.
void InitializeFrom(Engine& e, const Model& model) {
  for (int i = 0; i < e.num_subgroups(); ++i) {
    ASSERT_TRUE(
        e.InitializeSubgroup(i, model.init[i].data(), DType::kFloat32).ok());
  }
}

OptimizerHyperparams AdamW() {
  OptimizerHyperparams hp;
  hp.kind = OptimizerKind::kAdamW;
  hp.lr = 1e-2f;
  hp.weight_decay = 0.1f;
  return hp;
}

// One AdamW input per subgroup of `model`, over its current gradients.
// An engine made from `cfg` and initialised with `model`'s parameters; null
// (the failure reported) if either fails.
std::unique_ptr<Engine> CreateFrom(const EngineConfig& cfg,
                                   const Model& model) {
  absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(cfg);
  EXPECT_TRUE(engine.ok()) << engine.status();
  if (!engine.ok()) return nullptr;
  InitializeFrom(**engine, model);
  if (::testing::Test::HasFatalFailure()) return nullptr;
  return *std::move(engine);
}

std::vector<SubgroupStepInput> AdamWInputs(Model& model) {
  std::vector<SubgroupStepInput> in(model.sizes.size());
  for (size_t i = 0; i < in.size(); ++i) {
    in[i].hp = AdamW();
    in[i].segments = model.Segments(static_cast<int>(i));
  }
  return in;
}

// Reference: the same kernel over the whole state in memory.
struct Reference {
  std::vector<std::vector<float>> master, m, v;
  std::vector<std::vector<uint16_t>> out;
  explicit Reference(const Model& model) {
    for (size_t i = 0; i < model.sizes.size(); ++i) {
      master.push_back(model.init[i]);
      m.emplace_back(model.sizes[i], 0.0f);
      v.emplace_back(model.sizes[i], 0.0f);
      out.emplace_back(model.sizes[i], 0);
    }
  }
  void Step(Model& model, int64_t step, float grad_scale) {
    for (size_t i = 0; i < master.size(); ++i) {
      OptimizerHyperparams hp = AdamW();
      hp.step = step;
      for (const Segment& s : model.Segments(static_cast<int>(i))) {
        UpdateSpans sp;
        sp.n = s.numel;
        sp.param = master[i].data() + s.offset;
        sp.state[0] = m[i].data() + s.offset;
        sp.state[1] = v[i].data() + s.offset;
        sp.grad = s.grad;
        sp.grad_dtype = DType::kBFloat16;
        sp.param_out = out[i].data() + s.offset;
        sp.param_out_dtype = DType::kBFloat16;
        GradTransform t;
        t.grad_scale = grad_scale;
        ASSERT_TRUE(ApplyOptimizer(hp, sp, t, nullptr).ok());
      }
    }
  }
};

// The reference state after a first step with new gradients (seed 1),
// which `model` then holds.
Reference ReferenceOfStep1(Model& model) {
  Reference ref(model);
  model.NewGrads(1);
  ref.Step(model, 1, 1.0f);
  return ref;
}

// Every subgroup of `e` holds `ref`'s master (with `moments`, its m and v
// too), updated `step` times.
void ExpectMatchesReference(Engine& e, const Reference& ref, int64_t step,
                            bool moments = false) {
  for (int i = 0; i < e.num_subgroups(); ++i) {
    std::vector<float> master(ref.master[i].size()), m(master.size()),
        v(master.size());
    int64_t got_step = 0;
    ASSERT_TRUE(
        e.ReadSubgroup(i, master.data(), {m.data(), v.data()}, &got_step).ok());
    EXPECT_EQ(got_step, step) << i;
    EXPECT_EQ(master, ref.master[i]) << i;
    if (moments) {
      EXPECT_EQ(m, ref.m[i]) << i;
      EXPECT_EQ(v, ref.v[i]) << i;
    }
  }
}

struct Case {
  int tiers;
  double budget_records;  // host budget in units of one buffer
  Techniques techniques;
  bool throttled;
};

class EngineParityTest : public ::testing::TestWithParam<Case> {};

TEST_P(EngineParityTest, MatchesInMemoryKernelBitForBit) {
  const Case c = GetParam();
  Model model({5000, 7000, 3000, 6000, 4096, 1, 5555}, 7);
  EngineConfig cfg;
  for (int t = 0; t < c.tiers; ++t) {
    TierSpec spec;
    spec.path = TempDir(absl::StrCat("tier", t));
    spec.read_bytes_per_sec = spec.write_bytes_per_sec = (t + 1) * 1e9;
    if (c.throttled) {
      spec.throttle_read_bytes_per_sec = spec.throttle_write_bytes_per_sec =
          200e6;
    }
    cfg.tiers.push_back(spec);
  }
  cfg.subgroup_numel = model.sizes;
  cfg.num_state_arrays = 2;
  cfg.grad_dtype = DType::kBFloat16;
  cfg.techniques = c.techniques;
  uint64_t buffer =
      4096 + AlignedRecordBytes(7000, 3) +
      (c.techniques.delayed_grad_conversion ? 0 : AlignedRecordBytes(7000, 1));
  cfg.host_budget_bytes = static_cast<uint64_t>(c.budget_records * buffer);
  cfg.compute_threads = 2;
  std::unique_ptr<Engine> engine = CreateFrom(cfg, model);
  ASSERT_NE(engine, nullptr);
  Engine& e = *engine;
  Reference ref(model);
  const int steps = 5;
  for (int step = 1; step <= steps; ++step) {
    model.NewGrads(100 + step);
    ref.Step(model, step, 0.5f);
    std::vector<SubgroupStepInput> inputs(e.num_subgroups());
    for (int i = 0; i < e.num_subgroups(); ++i) {
      inputs[i].hp = AdamW();
      inputs[i].segments = model.Segments(i);
      ASSERT_TRUE(e.OffloadGradients(i, inputs[i].segments).ok());
    }
    StepOptions opts;
    opts.grad_scale = 0.5f;
    auto stats = e.Step(inputs, opts);
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_FALSE(stats->skipped);
    EXPECT_LE(stats->peak_host_bytes, cfg.host_budget_bytes);
    if (step >= 3) {
      // Steady state: exactly the plan's traffic on every tier.
      const Plan& plan = e.plan();
      for (int t = 0; t < c.tiers; ++t) {
        // The plan counts payload bytes; the engine moves whole slots
        // (header page + aligned record) and aligned gradients.
        uint64_t want_r = 0, want_w = 0;
        std::vector<int> order = plan.Order(step - 1),
                         prev = plan.Order(step - 2);
        std::vector<bool> hit(model.sizes.size(), false);
        for (int p = static_cast<int>(order.size()) - plan.num_cached;
             p < static_cast<int>(order.size()); ++p) {
          if (c.techniques.cache_reuse) hit[prev[p]] = true;
        }
        for (size_t p = 0; p < order.size(); ++p) {
          int i = order[p];
          if (plan.tier_of_subgroup[i] != t) continue;
          uint64_t slot = 4096 + AlignedRecordBytes(model.sizes[i], 3);
          uint64_t g = c.techniques.delayed_grad_conversion
                           ? 0
                           : AlignedRecordBytes(model.sizes[i], 1);
          if (!hit[i]) want_r += slot;
          want_r += g;
          if (!plan.KeptAfterUpdate(step - 1, static_cast<int>(p)))
            want_w += slot;
          want_w += g;
        }
        EXPECT_EQ(stats->bytes_read[t], want_r)
            << "tier " << t << " step " << step;
        EXPECT_EQ(stats->bytes_written[t], want_w)
            << "tier " << t << " step " << step;
      }
    }
    for (size_t i = 0; i < model.sizes.size(); ++i) {
      ASSERT_EQ(0, std::memcmp(model.params_bf16[i].data(), ref.out[i].data(),
                               model.sizes[i] * 2))
          << "subgroup " << i << " step " << step;
    }
  }
  for (int i = 0; i < e.num_subgroups(); ++i) {
    std::vector<float> master(model.sizes[i]), m(model.sizes[i]),
        v(model.sizes[i]);
    int64_t got_step = 0;
    ASSERT_TRUE(
        e.ReadSubgroup(i, master.data(), {m.data(), v.data()}, &got_step).ok());
    EXPECT_EQ(got_step, steps);
    EXPECT_EQ(
        0, std::memcmp(master.data(), ref.master[i].data(), master.size() * 4))
        << i;
    EXPECT_EQ(0, std::memcmp(m.data(), ref.m[i].data(), m.size() * 4)) << i;
    EXPECT_EQ(0, std::memcmp(v.data(), ref.v[i].data(), v.size() * 4)) << i;
  }
}

Techniques Only(bool mp, bool cache, bool delayed, bool lock) {
  return Techniques{mp, cache, delayed, lock};
}

INSTANTIATE_TEST_SUITE_P(
    Configs, EngineParityTest,
    ::testing::Values(Case{1, 2, Techniques::Baseline(), false},
                      Case{1, 3, Techniques::All(), false},
                      Case{2, 4, Techniques::All(), false},
                      Case{3, 5, Techniques::All(), true},
                      Case{3, 100, Techniques::All(),
                           false},  // everything cached
                      Case{2, 6, Only(true, true, false, false), false},
                      Case{2, 4, Only(false, true, true, true), false},
                      Case{3, 3, Only(true, false, true, false), true},
                      Case{2, 7.5, Techniques::Baseline(), false}));

EngineConfig SmallConfig(int tiers) {
  EngineConfig cfg;
  for (int t = 0; t < tiers; ++t) {
    TierSpec spec;
    spec.path = TempDir(absl::StrCat("small", t));
    cfg.tiers.push_back(spec);
  }
  cfg.subgroup_numel = {1000, 2000, 3000, 1500};
  cfg.num_state_arrays = 2;
  cfg.host_budget_bytes = 4 * (4096 + AlignedRecordBytes(3000, 3));
  cfg.tier_lock_dir = TempDir("locks");
  return cfg;
}

// The sg_* files in `dir`, sorted.
std::vector<std::string> RecordFilesIn(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* d = opendir(dir.c_str())) {
    while (struct dirent* ent = readdir(d)) {
      const std::string name = ent->d_name;
      if (name.rfind("sg_", 0) == 0) names.push_back(name);
    }
    closedir(d);
  }
  std::sort(names.begin(), names.end());
  return names;
}

TEST(EngineTest, AFreshStartRemovesTheRecordFilesOfAnEarlierStartItDoesNotUse) {
  // A run started afresh under a name an earlier start used, placed
  // otherwise (multipath off) and with fewer subgroups and no gradient
  // files: the earlier start's records on the other tier, of the dropped
  // subgroup and its gradient files would hold their space for ever.
  EngineConfig cfg = SmallConfig(2);
  cfg.run_name = "stale";
  cfg.techniques = Only(true, false, false, false);
  cfg.host_budget_bytes *= 4;
  {
    Model model(cfg.subgroup_numel, 1);
    std::unique_ptr<Engine> e = CreateFrom(cfg, model);
    ASSERT_NE(e, nullptr);
    ASSERT_EQ(std::set<int>(e->plan().tier_of_subgroup.begin(),
                            e->plan().tier_of_subgroup.end()),
              (std::set<int>{0, 1}));
  }
  const std::string dir0 = cfg.tiers[0].path + "/stale";
  const std::string dir1 = cfg.tiers[1].path + "/stale";
  ASSERT_FALSE(RecordFilesIn(dir1).empty());
  // Files that are not records of the run stay.
  for (const char* name : {"sg_x.state", "sg_1.state.bak", "notes"}) {
    std::FILE* f = std::fopen(absl::StrCat(dir0, "/", name).c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fclose(f);
  }
  cfg.techniques = Only(false, false, true, false);
  cfg.subgroup_numel.pop_back();
  Model model(cfg.subgroup_numel, 2);
  std::unique_ptr<Engine> e = CreateFrom(cfg, model);
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(
      RecordFilesIn(dir0),
      (std::vector<std::string>{"sg_0.state", "sg_1.state", "sg_1.state.bak",
                                "sg_2.state", "sg_x.state"}));
  EXPECT_TRUE(RecordFilesIn(dir1).empty());
  struct stat st;
  EXPECT_EQ(stat((dir0 + "/notes").c_str(), &st), 0);
  // The run steps as usual.
  model.NewGrads(3);
  std::vector<SubgroupStepInput> in = AdamWInputs(model);
  EXPECT_TRUE(e->Step(in, StepOptions()).ok());
}

TEST(EngineTest, SegmentsMustCoverTheSubgroupOnceWithoutWrapping) {
  // Offsets near 2^64 (their sum wraps), overlaps and gaps are refused by
  // name before anything is read or written, in the step, the gradient
  // check and the baseline's gradient offload.
  for (bool eager : {false, true}) {
    EngineConfig cfg = SmallConfig(1);
    cfg.techniques.delayed_grad_conversion = !eager;
    if (eager) {
      cfg.host_budget_bytes = 4 * (4096 + AlignedRecordBytes(3000, 3) +
                                   AlignedRecordBytes(3000, 1));
    }
    Model model(cfg.subgroup_numel, 3);
    auto engine = Engine::Create(cfg);
    ASSERT_TRUE(engine.ok()) << engine.status();
    Engine& e = **engine;
    ASSERT_NO_FATAL_FAILURE(InitializeFrom(e, model));
    const std::vector<Segment> good = model.Segments(0);  // 1000 elements
    auto with = [&](std::vector<std::pair<uint64_t, uint64_t>> spans) {
      std::vector<Segment> out;
      for (const auto& [offset, n] : spans) {
        Segment s = good[0];
        s.offset = offset;
        s.numel = n;
        out.push_back(s);
      }
      return out;
    };
    const uint64_t kWrap = ~uint64_t{0} - 9;  // + 10 wraps to 0
    const std::vector<std::pair<std::vector<Segment>, std::string>> bad = {
        {with({{kWrap, 10}, {0, 1000}}), "bad segment for subgroup 0 (offset"},
        {with({{0, 1000}, {1000, kWrap}}), "bad segment"},
        {with({{0, 500}, {0, 500}}),
         "segments of subgroup 0 overlap at "
         "element 0"},
        {with({{0, 400}, {500, 500}}), "leave a gap at element 400"},
        {with({{0, 999}}), "segments cover 999 of subgroup 0's 1000"},
    };
    for (const auto& [segments, message] : bad) {
      std::vector<SubgroupStepInput> in = AdamWInputs(model);
      in[0].segments = segments;
      absl::Status s = eager ? e.OffloadGradients(0, segments)
                             : e.Step(in, StepOptions()).status();
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      EXPECT_NE(s.message().find(message), std::string::npos) << s;
      if (!eager) {
        s = e.GradientsNonfinite(in, 1.0f).status();
        EXPECT_NE(s.message().find(message), std::string::npos) << s;
      }
    }
    // Pieces in any order that tile the subgroup are fine.
    std::vector<SubgroupStepInput> in = AdamWInputs(model);
    in[0].segments = {good[1], good[0]};
    for (int i = 0; eager && i < e.num_subgroups(); ++i) {
      ASSERT_TRUE(e.OffloadGradients(i, in[i].segments).ok());
    }
    auto stats = e.Step(in, StepOptions());
    EXPECT_TRUE(stats.ok()) << stats.status();
  }
}

TEST(EngineTest, RefusesJunkThreadCounts) {
  // A thread each: refused before any is started.
  for (int threads : {0, kMaxComputeThreads + 1, 100000}) {
    EngineConfig cfg = SmallConfig(1);
    cfg.compute_threads = threads;
    auto e = Engine::Create(cfg);
    EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument) << threads;
    EXPECT_NE(e.status().message().find("compute_threads"), std::string::npos)
        << e.status();
  }
  EngineConfig cfg = SmallConfig(1);
  cfg.io.num_threads = kMaxIoThreads + 1;
  auto e = Engine::Create(cfg);
  EXPECT_NE(e.status().message().find("num_threads"), std::string::npos)
      << e.status();
}

TEST(EngineTest, RefusesBadTiers) {
  EngineConfig cfg = SmallConfig(1);
  cfg.tiers[0].path = "/nonexistent/tier";
  auto e = Engine::Create(cfg);
  EXPECT_EQ(e.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(e.status().message().find("/nonexistent/tier"), std::string::npos)
      << e.status();

  cfg = SmallConfig(2);
  cfg.tiers[1].path = cfg.tiers[0].path + "/.";
  e = Engine::Create(cfg);
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(e.status().message().find("same directory"), std::string::npos)
      << e.status();

  cfg = SmallConfig(1);
  cfg.host_budget_bytes = 100;
  e = Engine::Create(cfg);
  EXPECT_EQ(e.status().code(), absl::StatusCode::kResourceExhausted);
  // Refused before anything was written: no run directory.
  struct stat st;
  EXPECT_NE(stat((cfg.tiers[0].path + "/" + cfg.run_name).c_str(), &st), 0);

  cfg = SmallConfig(1);
  cfg.subgroup_numel[2] = 0;
  e = Engine::Create(cfg);
  EXPECT_NE(e.status().message().find("size 0"), std::string::npos)
      << e.status();

  if (geteuid() != 0) {  // root writes anywhere
    cfg = SmallConfig(1);
    chmod(cfg.tiers[0].path.c_str(), 0500);
    e = Engine::Create(cfg);
    EXPECT_EQ(e.status().code(), absl::StatusCode::kPermissionDenied)
        << e.status();
  }
}

TEST(EngineTest, TierInUseByAnotherLiveRunIsRefused) {
  EngineConfig cfg = SmallConfig(1);
  auto first = Engine::Create(cfg);
  ASSERT_TRUE(first.ok()) << first.status();
  // The run lock is a flock on its own open file description, so a second
  // engine in this process is refused exactly as another process would be
  // (and the test needs no fork, which ThreadSanitizer does not support).
  auto second = Engine::Create(cfg);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kAlreadyExists)
      << second.status();
  EXPECT_NE(second.status().message().find(cfg.run_name), std::string::npos)
      << second.status();
  first->reset();  // released: the tier can be used again
  EXPECT_TRUE(Engine::Create(cfg).ok());
}

// The names in `dir` other than . and .., sorted; empty if there is none.
std::vector<std::string> NamesIn(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* d = opendir(dir.c_str())) {
    while (struct dirent* ent = readdir(d)) {
      const std::string name = ent->d_name;
      if (name != "." && name != "..") names.push_back(name);
    }
    closedir(d);
  }
  std::sort(names.begin(), names.end());
  return names;
}

TEST(EngineTest, AFailedCreateLeavesNoRunDirectoryItMadeButKeepsAnOlderOne) {
  // A private run's name is never taken up again: a run directory that a
  // failed Create left behind (its LOCK in it) would stay for ever.
  struct Bad {
    std::string what;  // in the error
    std::function<void(EngineConfig&)> edit;
  };
  const std::vector<Bad> bad = {
      {"queue_depth", [](EngineConfig& c) { c.io.queue_depth = 0; }},
      {"block_size", [](EngineConfig& c) { c.io.block_size = 4097; }},
      {"/nonexistent/locks",
       [](EngineConfig& c) { c.tier_lock_dir = "/nonexistent/locks"; }},
      {"shared throttle",
       [](EngineConfig& c) {
         c.techniques.tier_lock = false;
         c.tier_lock_dir = "/nonexistent/locks";
         c.tiers[1].throttle_shared = true;
         c.tiers[1].throttle_read_bytes_per_sec = 1e9;
       }},
      // Refused once tier 0's run directory is made: tier 1's is a file.
      {"is not a directory",
       [](EngineConfig& c) {
         std::FILE* f =
             std::fopen((c.tiers[1].path + "/" + c.run_name).c_str(), "w");
         ASSERT_NE(f, nullptr);
         std::fclose(f);
       }},
      // Refused after every tier's: nothing to resume.
      {"MANIFEST", [](EngineConfig& c) { c.resume = true; }},
  };
  for (const Bad& b : bad) {
    EngineConfig cfg = SmallConfig(2);
    cfg.run_name = "mlp_offload-1-0123abcd-g1-r0-kboot";
    ASSERT_NO_FATAL_FAILURE(b.edit(cfg));
    auto e = Engine::Create(cfg);
    ASSERT_FALSE(e.ok()) << b.what;
    EXPECT_NE(e.status().message().find(b.what), std::string::npos)
        << e.status();
    EXPECT_EQ(NamesIn(cfg.tiers[0].path), std::vector<std::string>{}) << b.what;
    struct stat st;
    EXPECT_TRUE(stat((cfg.tiers[1].path + "/" + cfg.run_name).c_str(), &st) !=
                    0 ||
                S_ISREG(st.st_mode))
        << b.what;

    // A run directory that was there before stays as it was, whatever it
    // holds (a committed run's state), and so does its LOCK.
    cfg = SmallConfig(2);
    cfg.run_name = "mlp_offload-1-0123abcd-g1-r0-kboot";
    const std::string dir0 = cfg.tiers[0].path + "/" + cfg.run_name;
    ASSERT_EQ(mkdir(dir0.c_str(), 0700), 0);
    for (const char* name : {"LOCK", "COMMIT"}) {
      std::FILE* f = std::fopen(absl::StrCat(dir0, "/", name).c_str(), "w");
      ASSERT_NE(f, nullptr);
      std::fclose(f);
    }
    ASSERT_NO_FATAL_FAILURE(b.edit(cfg));
    e = Engine::Create(cfg);
    ASSERT_FALSE(e.ok()) << b.what;
    EXPECT_EQ(NamesIn(dir0), (std::vector<std::string>{"COMMIT", "LOCK"}))
        << b.what << ": " << e.status();
    // An empty one too: it was not this Create's to remove.
    ASSERT_EQ(unlink((dir0 + "/COMMIT").c_str()), 0);
    ASSERT_EQ(unlink((dir0 + "/LOCK").c_str()), 0);
    e = Engine::Create(cfg);
    ASSERT_FALSE(e.ok()) << b.what;
    EXPECT_EQ(stat(dir0.c_str(), &st), 0) << b.what << ": " << e.status();
  }
  // The run lock of a live run is refused as before: its directory stays.
  EngineConfig cfg = SmallConfig(1);
  auto first = Engine::Create(cfg);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(Engine::Create(cfg).status().code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(
      NamesIn(cfg.tiers[0].path + "/" + cfg.run_name),
      (std::vector<std::string>{"LOCK", "MANIFEST", "sg_0.state", "sg_1.state",
                                "sg_2.state", "sg_3.state"}));
}

Engine& Initialized(std::unique_ptr<Engine>& e, const EngineConfig& cfg,
                    uint32_t seed) {
  std::mt19937 rng(seed);
  for (size_t i = 0; i < cfg.subgroup_numel.size(); ++i) {
    std::vector<float> p(cfg.subgroup_numel[i]);
    for (float& x : p) x = std::uniform_real_distribution<float>(-1, 1)(rng);
    EXPECT_TRUE(
        e->InitializeSubgroup(static_cast<int>(i), p.data(), DType::kFloat32)
            .ok());
  }
  return *e;
}

TEST(EngineTest, GenericPathHandsRecordsToTheCaller) {
  EngineConfig cfg = SmallConfig(2);
  cfg.num_state_arrays = 1;
  auto engine = Engine::Create(cfg);
  ASSERT_TRUE(engine.ok()) << engine.status();
  Engine& e = Initialized(*engine, cfg, 3);
  std::vector<std::vector<float>> before(4);
  for (int i = 0; i < 4; ++i) {
    before[i].resize(cfg.subgroup_numel[i]);
    std::vector<float> s(cfg.subgroup_numel[i]);
    ASSERT_TRUE(e.ReadSubgroup(i, before[i].data(), {s.data()}, nullptr).ok());
  }
  for (int step = 0; step < 3; ++step) {
    ASSERT_TRUE(e.BeginStep().ok());
    std::vector<int> seen;
    for (;;) {
      auto v = e.Next();
      ASSERT_TRUE(v.ok()) << v.status();
      if (v->subgroup < 0) break;
      seen.push_back(v->subgroup);
      for (uint64_t k = 0; k < v->numel; ++k) {
        v->state[0][k] += 1.0f;  // a "momentum" that counts steps
        v->master[k] -= 0.5f * v->state[0][k];
      }
      ASSERT_TRUE(e.Done().ok());
    }
    EXPECT_EQ(seen, e.plan().Order(step));
    ASSERT_TRUE(e.EndStep().ok());
  }
  for (int i = 0; i < 4; ++i) {
    std::vector<float> master(cfg.subgroup_numel[i]), s(cfg.subgroup_numel[i]);
    int64_t step = 0;
    ASSERT_TRUE(e.ReadSubgroup(i, master.data(), {s.data()}, &step).ok());
    EXPECT_EQ(step, 3);
    for (size_t k = 0; k < master.size(); ++k) {
      ASSERT_EQ(s[k], 3.0f);
      ASSERT_EQ(master[k], before[i][k] - 0.5f * (1 + 2 + 3));
    }
  }
}

// What one generic step could do while another holder (another rank) held
// the tier's lock `held_lock` ("", ".read" or ".write"): hand out its first
// record (which must be read: no cache), and finish (its writes done: two
// buffers for four subgroups, so the third record waits for the first one's
// write).
struct HeldLockProbe {
  bool read = false;
  bool finished = false;
};

HeldLockProbe StepWithAHeldLock(TierLockMode mode,
                                const std::string& held_lock) {
  EngineConfig cfg = SmallConfig(1);
  cfg.num_state_arrays = 1;
  cfg.host_budget_bytes = 2 * (4096 + AlignedRecordBytes(3000, 2));
  cfg.techniques.cache_reuse = false;
  cfg.tier_lock_mode = mode;
  HeldLockProbe probe;
  auto engine = Engine::Create(cfg);
  EXPECT_TRUE(engine.ok()) << engine.status();
  if (!engine.ok()) return probe;
  Engine& e = Initialized(*engine, cfg, 5);
  auto prefix = TierLockPrefix(cfg.tier_lock_dir, cfg.tiers[0].path);
  EXPECT_TRUE(prefix.ok()) << prefix.status();
  auto other = TierLock::Open(*prefix + held_lock);
  EXPECT_TRUE(other.ok()) << other.status();
  EXPECT_TRUE((*other)->Acquire().ok());
  EXPECT_TRUE(e.BeginStep().ok());
  std::promise<void> first_read;
  auto step = std::async(std::launch::async, [&e, &first_read] {
    bool first = true;
    for (;;) {
      auto v = e.Next();
      EXPECT_TRUE(v.ok()) << v.status();
      if (first) first_read.set_value();
      first = false;
      if (!v.ok() || v->subgroup < 0) break;
      EXPECT_TRUE(e.Done().ok());
    }
    EXPECT_TRUE(e.EndStep().ok());
  });
  // The waits only bound how long blocked I/O is given: I/O that passes the
  // held lock takes milliseconds.
  probe.read = first_read.get_future().wait_for(std::chrono::seconds(2)) ==
               std::future_status::ready;
  probe.finished = step.wait_for(std::chrono::seconds(probe.read ? 2 : 0)) ==
                   std::future_status::ready;
  (*other)->Release();
  step.get();
  return probe;
}

// One tier, four subgroups, room for three records and no cache reuse:
// records are read during the step.
EngineConfig ThreeBufferConfig() {
  EngineConfig cfg = SmallConfig(1);
  cfg.techniques.cache_reuse = false;
  cfg.host_budget_bytes = 3 * (4096 + AlignedRecordBytes(3000, 3));
  return cfg;
}

// Every record of an engine of ThreeBufferConfig holds `steps` steps from
// `model`, each of which added 1 to every master value.
void ExpectEveryRecordAt(Engine& e, const EngineConfig& cfg, const Model& model,
                         int64_t steps) {
  for (int i = 0; i < 4; ++i) {
    std::vector<float> master(cfg.subgroup_numel[i]), m(master.size()),
        v(master.size());
    int64_t step = 0;
    ASSERT_TRUE(
        e.ReadSubgroup(i, master.data(), {m.data(), v.data()}, &step).ok());
    EXPECT_EQ(step, steps) << i;
    for (size_t k = 0; k < master.size(); ++k) {
      float want = model.init[i][k];
      for (int64_t s = 0; s < steps; ++s) want += 1.0f;
      ASSERT_EQ(master[k], want) << i << " " << k;
    }
  }
}

// Done without the Next that hands the record out (before any, or twice
// after one) is refused and changes nothing: it used to checksum and write a
// buffer still being read into (or buffers[-1]), a torn record that became
// the subgroup's latest version.
TEST(EngineTest, DoneWithoutNextIsRefused) {
  const EngineConfig cfg = ThreeBufferConfig();
  Model model(cfg.subgroup_numel, 9);
  std::unique_ptr<Engine> engine = CreateFrom(cfg, model);
  ASSERT_NE(engine, nullptr);
  Engine& e = *engine;
  ASSERT_TRUE(e.BeginStep().ok());
  absl::Status early = e.Done();
  EXPECT_EQ(early.code(), absl::StatusCode::kFailedPrecondition) << early;
  EXPECT_NE(early.message().find("not handed out by Next"), std::string::npos)
      << early;
  int handed = 0;
  for (;;) {
    absl::StatusOr<SubgroupView> v = e.Next();
    ASSERT_TRUE(v.ok()) << v.status();
    if (v->subgroup < 0) break;
    for (uint64_t k = 0; k < v->numel; ++k) v->master[k] += 1.0f;
    ASSERT_TRUE(e.Done().ok());
    EXPECT_EQ(e.Done().code(), absl::StatusCode::kFailedPrecondition);
    ++handed;
  }
  EXPECT_EQ(handed, 4);
  ASSERT_TRUE(e.EndStep().ok());
  ExpectEveryRecordAt(e, cfg, model, 1);
}

// EndStep before every record was handed out fails the step as AbortStep
// does: the reads ahead are waited for and dropped (they were left claimed,
// still in flight), and the next step resumes it, updating only the records
// the first attempt did not.
TEST(EngineTest, AnEarlyEndStepDropsTheReadsAheadAndTheStepResumes) {
  const EngineConfig cfg = ThreeBufferConfig();
  Model model(cfg.subgroup_numel, 9);
  std::unique_ptr<Engine> engine = CreateFrom(cfg, model);
  ASSERT_NE(engine, nullptr);
  Engine& e = *engine;
  ASSERT_TRUE(e.BeginStep().ok());
  absl::StatusOr<SubgroupView> first = e.Next();
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_GE(first->subgroup, 0);
  for (uint64_t k = 0; k < first->numel; ++k) first->master[k] += 1.0f;
  ASSERT_TRUE(e.Done().ok());
  absl::StatusOr<StepStats> early = e.EndStep();
  EXPECT_EQ(early.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(early.status().message().find("was not updated"), std::string::npos)
      << early.status();
  EXPECT_TRUE(e.step_incomplete());
  for (int step = 1; step <= 2; ++step) {
    ASSERT_TRUE(e.BeginStep().ok());
    int handed = 0;
    for (;;) {
      absl::StatusOr<SubgroupView> v = e.Next();
      ASSERT_TRUE(v.ok()) << v.status();
      if (v->subgroup < 0) break;
      if (step == 1) {
        EXPECT_NE(v->subgroup, first->subgroup);
      }
      for (uint64_t k = 0; k < v->numel; ++k) v->master[k] += 1.0f;
      ASSERT_TRUE(e.Done().ok());
      ++handed;
    }
    EXPECT_EQ(handed, step == 1 ? 3 : 4);
    absl::StatusOr<StepStats> end = e.EndStep();
    ASSERT_TRUE(end.ok()) << end.status();
    // No cache: every record is read in the step that updates it (before,
    // the reads left from the first attempt counted as cache hits).
    EXPECT_EQ(end->cache_hits, 0) << "step " << step;
  }
  ExpectEveryRecordAt(e, cfg, model, 2);
}

TEST(EngineTest, PerDirectionTierLockReadsWhileAnotherProcessWrites) {
  // Per direction: reads take the tier's read lock and writes its write
  // lock, so a rank reads while another writes, but writes wait for it.
  HeldLockProbe p = StepWithAHeldLock(TierLockMode::kPerDirection, ".write");
  EXPECT_TRUE(p.read);
  EXPECT_FALSE(p.finished);
  p = StepWithAHeldLock(TierLockMode::kPerDirection, ".read");
  EXPECT_FALSE(p.read);
  // Exclusive: one lock for both directions.
  p = StepWithAHeldLock(TierLockMode::kExclusive, "");
  EXPECT_FALSE(p.read);
}

// One generic step by hand, every record handed out marked updated: the
// first error of BeginStep, Next, Done or EndStep.
absl::Status StepByHand(Engine& e) {
  absl::Status s = e.BeginStep();
  while (s.ok()) {
    absl::StatusOr<SubgroupView> v = e.Next();
    if (!v.ok()) return v.status();
    if (v->subgroup < 0) return e.EndStep().status();
    s = e.Done();
  }
  return s;
}

// An engine of one tier (SmallConfig(1), no cache reuse, `timeout` for the
// tier lock), initialised, and another holder of that tier's lock (a
// process sharing the tier) that holds it; the lock's file prefix in
// `prefix`.
struct HeldTierLock {
  EngineConfig cfg;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<TierLock> other;
  std::string prefix;
};
void HoldTheTierLock(absl::Duration timeout, HeldTierLock* h) {
  h->cfg = SmallConfig(1);
  h->cfg.num_state_arrays = 1;
  h->cfg.techniques.cache_reuse = false;
  h->cfg.tier_lock_timeout = timeout;
  auto engine = Engine::Create(h->cfg);
  ASSERT_TRUE(engine.ok()) << engine.status();
  h->engine = *std::move(engine);
  Initialized(h->engine, h->cfg, 5);
  auto prefix = TierLockPrefix(h->cfg.tier_lock_dir, h->cfg.tiers[0].path);
  ASSERT_TRUE(prefix.ok()) << prefix.status();
  h->prefix = *prefix;
  auto other = TierLock::Open(h->prefix);
  ASSERT_TRUE(other.ok()) << other.status();
  h->other = *std::move(other);
  ASSERT_TRUE(h->other->Acquire().ok());
}

// After a step that failed waiting for h's lock: once the lock is free (and
// any interruption over), the step retried goes through.
void RetryOnceTheLockIsFree(HeldTierLock& h) {
  Engine& e = *h.engine;
  e.AbortStep();
  e.SetInterrupted(false);
  h.other->Release();
  absl::Status ok = StepByHand(e);
  EXPECT_TRUE(ok.ok()) << ok;
  EXPECT_EQ(e.step(), 1);
}

// A process sharing the tier that holds its lock and makes no progress
// (stopped, hung) fails this one's step after tier_lock_timeout, naming the
// lock, instead of holding it up for ever; once the lock is free the step
// goes through.
TEST(EngineTest, AWaitForTheTierLockPastItsTimeoutFailsTheStep) {
  EngineConfig zero = SmallConfig(1);
  zero.tier_lock_timeout = absl::ZeroDuration();
  EXPECT_EQ(Engine::Create(zero).status().code(),
            absl::StatusCode::kInvalidArgument);
  HeldTierLock h;
  ASSERT_NO_FATAL_FAILURE(HoldTheTierLock(absl::Milliseconds(300), &h));
  Engine& e = *h.engine;
  absl::Status failed = StepByHand(e);
  EXPECT_EQ(failed.code(), absl::StatusCode::kDeadlineExceeded) << failed;
  EXPECT_NE(failed.message().find(h.prefix + ".tickets"), std::string::npos)
      << failed;
  RetryOnceTheLockIsFree(h);
}

TEST(EngineTest, TierLocksAreNodeLocalAndNamedAfterTheTier) {
  EngineConfig cfg = SmallConfig(2);
  auto engine = Engine::Create(cfg);
  ASSERT_TRUE(engine.ok()) << engine.status();
  // One lock file per tier, in the lock directory: none on the tiers (which
  // may be a parallel file system shared with other nodes).
  std::vector<std::string> want;
  char real_lock_dir[PATH_MAX];
  ASSERT_NE(realpath(cfg.tier_lock_dir.c_str(), real_lock_dir), nullptr);
  for (const TierSpec& tier : cfg.tiers) {
    auto prefix = TierLockPrefix(cfg.tier_lock_dir, tier.path);
    ASSERT_TRUE(prefix.ok()) << prefix.status();
    EXPECT_EQ(prefix->rfind(
                  absl::StrCat(real_lock_dir, "/mlp_offload_tier_lock."), 0),
              0u)
        << *prefix;
    struct stat st;
    EXPECT_EQ(stat((*prefix + ".tickets").c_str(), &st), 0) << *prefix;
    want.push_back(*prefix);
  }
  EXPECT_NE(want[0], want[1]);
  // The same directory by another name (a symlink, "/./") is the same lock.
  const std::string link = cfg.tiers[0].path + ".link";
  ASSERT_EQ(symlink(cfg.tiers[0].path.c_str(), link.c_str()), 0);
  EXPECT_EQ(*TierLockPrefix(cfg.tier_lock_dir, link), want[0]);
  EXPECT_EQ(*TierLockPrefix(cfg.tier_lock_dir, cfg.tiers[0].path + "/."),
            want[0]);
  // So is the lock directory: resolved, one name however it is spelt (a
  // fork's child finds the lock's descriptors under that name).
  const std::string lock_link = cfg.tier_lock_dir + ".link";
  ASSERT_EQ(symlink(cfg.tier_lock_dir.c_str(), lock_link.c_str()), 0);
  EXPECT_EQ(*TierLockPrefix(lock_link, cfg.tiers[0].path), want[0]);
  EXPECT_EQ(*TierLockPrefix(cfg.tier_lock_dir + "/", cfg.tiers[0].path),
            want[0]);
  // By default in /dev/shm (or /tmp where there is none).
  auto by_default = TierLockPrefix("", cfg.tiers[0].path);
  ASSERT_TRUE(by_default.ok()) << by_default.status();
  EXPECT_TRUE(by_default->rfind("/dev/shm/mlp_offload_tier_lock.", 0) == 0 ||
              by_default->rfind("/tmp/mlp_offload_tier_lock.", 0) == 0)
      << *by_default;
  // A lock directory that does not exist is an error naming it.
  cfg = SmallConfig(1);
  cfg.tier_lock_dir = "/nonexistent/locks";
  auto bad = Engine::Create(cfg);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("/nonexistent/locks"),
            std::string::npos)
      << bad.status();
  // Without the tier lock no lock directory is needed.
  cfg.techniques.tier_lock = false;
  EXPECT_TRUE(Engine::Create(cfg).ok());
  // A shared throttle's state file is node-local beside the locks too:
  // nothing of it on the tier.
  cfg = SmallConfig(1);
  cfg.tiers[0].throttle_shared = true;
  cfg.tiers[0].throttle_read_bytes_per_sec = 1e9;
  auto throttled = Engine::Create(cfg);
  ASSERT_TRUE(throttled.ok()) << throttled.status();
  auto state = SharedThrottlePath(cfg.tier_lock_dir, cfg.tiers[0].path);
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ(*state, *TierLockPrefix(cfg.tier_lock_dir, cfg.tiers[0].path) +
                        ".throttle");
  struct stat st;
  ASSERT_EQ(stat(state->c_str(), &st), 0) << *state;
  EXPECT_EQ(st.st_size, 32);
  for (const char* name : {"/.mlp_offload_throttle", "/.throttle"}) {
    EXPECT_NE(stat((cfg.tiers[0].path + name).c_str(), &st), 0) << name;
  }
}

TEST(EngineTest, CheckpointRoundTripAndRefusesAnotherModel) {
  EngineConfig cfg = SmallConfig(2);
  auto engine = Engine::Create(cfg);
  ASSERT_TRUE(engine.ok());
  Engine& e = Initialized(*engine, cfg, 5);
  std::string ckpt = TempDir("ckpt") + "/c";
  ASSERT_TRUE(e.SaveCheckpoint(ckpt).ok());
  ASSERT_TRUE(e.SaveCheckpoint(ckpt).ok());  // replaces the previous one
  std::vector<float> want(1000), m(1000), v(1000);
  ASSERT_TRUE(
      e.ReadSubgroup(0, want.data(), {m.data(), v.data()}, nullptr).ok());

  EngineConfig cfg2 = SmallConfig(1);
  auto other = Engine::Create(cfg2);
  ASSERT_TRUE(other.ok());
  Initialized(*other, cfg2, 9);
  ASSERT_TRUE((*other)->LoadCheckpoint(ckpt).ok());
  std::vector<float> got(1000);
  ASSERT_TRUE((*other)
                  ->ReadSubgroup(0, got.data(), {m.data(), v.data()}, nullptr)
                  .ok());
  EXPECT_EQ(got, want);

  EngineConfig cfg3 = SmallConfig(1);
  cfg3.subgroup_numel[1] = 2001;
  auto third = Engine::Create(cfg3);
  ASSERT_TRUE(third.ok());
  absl::Status s = (*third)->LoadCheckpoint(ckpt);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("subgroup 1 has 2000 parameters"),
            std::string::npos)
      << s;
}

TEST(EngineTest, AMissingOrShortRecordFailsALoadBeforeItChangesAnything) {
  // Subgroup 1's record gone, then cut short: CheckCheckpoint says so, and
  // LoadCheckpoint fails the same way before subgroup 0 was loaded (it used
  // to load subgroup 0 first, then fail).
  EngineConfig cfg = SmallConfig(2);
  auto saver = Engine::Create(cfg);
  ASSERT_TRUE(saver.ok()) << saver.status();
  Initialized(*saver, cfg, 5);
  const std::string ckpt = TempDir("ckpt_short") + "/c";
  ASSERT_TRUE((*saver)->SaveCheckpoint(ckpt).ok());
  EngineConfig cfg2 = SmallConfig(1);
  auto engine = Engine::Create(cfg2);
  ASSERT_TRUE(engine.ok()) << engine.status();
  Engine& e = Initialized(*engine, cfg2, 9);
  std::vector<float> own(1000), got(1000), m(1000), v(1000);
  ASSERT_TRUE(
      e.ReadSubgroup(0, own.data(), {m.data(), v.data()}, nullptr).ok());
  const std::string record = ckpt + "/sg_1.ckpt";
  const std::string kept = record + ".kept";
  ASSERT_EQ(rename(record.c_str(), kept.c_str()), 0);
  for (bool check : {true, false}) {
    absl::Status s = check ? e.CheckCheckpoint(ckpt) : e.LoadCheckpoint(ckpt);
    EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
    EXPECT_NE(s.message().find("sg_1.ckpt"), std::string::npos) << s;
  }
  {
    std::vector<char> head(kRecordHeaderBytes + 100);
    const int in = open(kept.c_str(), O_RDONLY);
    const int out = open(record.c_str(), O_WRONLY | O_CREAT, 0600);
    ASSERT_GE(in, 0);
    ASSERT_GE(out, 0);
    ASSERT_EQ(pread(in, head.data(), head.size(), 0),
              static_cast<ssize_t>(head.size()));
    ASSERT_EQ(pwrite(out, head.data(), head.size(), 0),
              static_cast<ssize_t>(head.size()));
    close(in);
    close(out);
  }
  for (bool check : {true, false}) {
    absl::Status s = check ? e.CheckCheckpoint(ckpt) : e.LoadCheckpoint(ckpt);
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
    EXPECT_NE(s.message().find("sg_1.ckpt: 4196 bytes, its record needs"),
              std::string::npos)
        << s;
  }
  ASSERT_TRUE(
      e.ReadSubgroup(0, got.data(), {m.data(), v.data()}, nullptr).ok());
  EXPECT_EQ(got, own) << "a load that failed its checks changed subgroup 0";
  ASSERT_EQ(rename(kept.c_str(), record.c_str()), 0);
  ASSERT_TRUE(e.CheckCheckpoint(ckpt).ok());
  ASSERT_TRUE(e.LoadCheckpoint(ckpt).ok());
  ASSERT_TRUE(
      e.ReadSubgroup(0, got.data(), {m.data(), v.data()}, nullptr).ok());
  EXPECT_NE(got, own);
}

TEST(EngineTest, LoadsRecordsOfCheckpointsThatOtherEnginesWrote) {
  // Two "ranks" of a 4-subgroup model (subgroups 0, 2 and 1, 3) save; one
  // engine holding all four loads its subgroups from their checkpoints.
  const std::vector<uint64_t> all = {1000, 2000, 3000, 1500};
  std::vector<std::string> dirs;
  std::vector<std::vector<float>> want(4);
  std::vector<int64_t> want_step(4);
  for (int r = 0; r < 2; ++r) {
    EngineConfig cfg = SmallConfig(1);
    cfg.subgroup_numel = {all[r], all[r + 2]};
    auto engine = Engine::Create(cfg);
    ASSERT_TRUE(engine.ok()) << engine.status();
    Engine& e = Initialized(*engine, cfg, 20 + r);
    dirs.push_back(TempDir(absl::StrCat("rank", r)) + "/engine");
    ASSERT_TRUE(e.SaveCheckpoint(dirs.back()).ok());
    for (int j = 0; j < 2; ++j) {
      std::vector<float> m(all[r + 2 * j]), v(all[r + 2 * j]);
      want[r + 2 * j].resize(all[r + 2 * j]);
      ASSERT_TRUE(e.ReadSubgroup(j, want[r + 2 * j].data(),
                                 {m.data(), v.data()}, &want_step[r + 2 * j])
                      .ok());
    }
  }
  EngineConfig cfg = SmallConfig(2);
  cfg.subgroup_numel = all;
  auto engine = Engine::Create(cfg);
  ASSERT_TRUE(engine.ok()) << engine.status();
  Engine& e = Initialized(*engine, cfg, 30);
  ASSERT_TRUE(e.LoadCheckpointRecords(
                   {{dirs[0], 0}, {dirs[1], 0}, {dirs[0], 1}, {dirs[1], 1}})
                  .ok());
  for (int i = 0; i < 4; ++i) {
    std::vector<float> got(all[i]), m(all[i]), v(all[i]);
    int64_t step = -1;
    ASSERT_TRUE(
        e.ReadSubgroup(i, got.data(), {m.data(), v.data()}, &step).ok());
    EXPECT_EQ(got, want[i]) << "subgroup " << i;
    EXPECT_EQ(step, want_step[i]);
  }

  // A record of another size, a missing checkpoint, a damaged record.
  absl::Status s = e.LoadCheckpointRecords(
      {{dirs[0], 0}, {dirs[0], 1}, {dirs[0], 1}, {dirs[1], 1}});
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("has no subgroup 1 of 2000 parameters"),
            std::string::npos)
      << s;
  s = e.LoadCheckpointRecords(
      {{dirs[0], 0}, {dirs[1] + "x", 0}, {dirs[0], 1}, {dirs[1], 1}});
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_NE(s.message().find(dirs[1] + "x/MANIFEST"), std::string::npos) << s;
  {
    // A header (valid in itself) that disagrees with the manifest; the same
    // check as the engine-less reader's.
    const std::string path = dirs[1] + "/sg_0.ckpt";
    int fd = open(path.c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    std::vector<char> page(kRecordHeaderBytes);
    ASSERT_EQ(pread(fd, page.data(), page.size(), 0),
              static_cast<ssize_t>(page.size()));
    auto h = DecodeRecordHeader(page.data(), page.size(), path);
    ASSERT_TRUE(h.ok()) << h.status();
    const RecordHeader good = *h;
    RecordHeader bad = good;
    bad.subgroup = 5;
    EncodeRecordHeader(bad, page.data());
    ASSERT_EQ(pwrite(fd, page.data(), page.size(), 0),
              static_cast<ssize_t>(page.size()));
    for (bool engine : {true, false}) {
      std::vector<float> master(all[1]);
      s = engine ? e.LoadCheckpointRecords(
                       {{dirs[0], 0}, {dirs[1], 0}, {dirs[0], 1}, {dirs[1], 1}})
                 : ReadCheckpointRecord(dirs[1], 0, master.size(),
                                        master.data(), {},
                                        /*verify=*/false, nullptr);
      EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
      EXPECT_NE(s.message().find("sg_0.ckpt: the header says subgroup 5 of "
                                 "2000 parameters and 3 arrays, the manifest "
                                 "subgroup 0 of 2000 and 3"),
                std::string::npos)
          << s;
    }
    EncodeRecordHeader(good, page.data());
    ASSERT_EQ(pwrite(fd, page.data(), page.size(), 0),
              static_cast<ssize_t>(page.size()));
    close(fd);
  }
  {
    const std::string path = dirs[1] + "/sg_1.ckpt";
    int fd = open(path.c_str(), O_WRONLY);
    ASSERT_GE(fd, 0);
    const char byte = 0x5a;
    ASSERT_EQ(pwrite(fd, &byte, 1, kRecordHeaderBytes + 100), 1);
    close(fd);
  }
  s = e.LoadCheckpointRecords(
      {{dirs[0], 0}, {dirs[1], 0}, {dirs[0], 1}, {dirs[1], 1}});
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("sg_1.ckpt: payload checksum mismatch"),
            std::string::npos)
      << s;
}

TEST(EngineTest, AThreadTheSystemRefusesIsAnErrorAtCreate) {
  // Every thread the engine starts, refused in turn (compute, I/O,
  // tier-lock dispatchers, completion deferrers, over two throttled tiers,
  // with both I/O engines): Create says so and leaves nothing running; then
  // the engine is created and works. The throttles' timer threads are the
  // exception: without one, a throttle waits on the submitting thread.
  for (auto kind :
       {IoEngineOptions::Kind::kUring, IoEngineOptions::Kind::kThreadPool}) {
    EngineConfig cfg = SmallConfig(2);
    cfg.compute_threads = 3;
    cfg.io.kind = kind;
    cfg.io.num_threads = 2;
    cfg.techniques.tier_lock = true;
    cfg.tier_lock_mode = TierLockMode::kPerDirection;
    for (TierSpec& t : cfg.tiers) {
      t.throttle_read_bytes_per_sec = 1e9;
      t.throttle_write_bytes_per_sec = 1e9;
    }
    int refused = 0;
    for (int nth = 1; nth <= 30; ++nth) {
      FailNthThreadStartForTesting(nth);
      auto e = Engine::Create(cfg);
      FailNthThreadStartForTesting(0);
      if (e.ok()) {
        Initialized(*e, cfg, 7);
        continue;
      }
      ++refused;
      EXPECT_EQ(e.status().code(), absl::StatusCode::kResourceExhausted)
          << nth << ": " << e.status();
      EXPECT_NE(e.status().message().find("could not start a thread"),
                std::string::npos)
          << e.status();
      EXPECT_TRUE(e.status().GetPayload(kSystemResourcePayload).has_value());
    }
    // 2 compute workers; per tier: the I/O engine's threads (io_uring: 1,
    // the thread pool: 2), 2 dispatchers and a deferrer.
    const int io = kind == IoEngineOptions::Kind::kUring ? 1 : 2;
    EXPECT_EQ(refused, 2 + 2 * (io + 2 + 1)) << static_cast<int>(kind);
  }
}

TEST(EngineTest, CheckpointRecordsReadWithoutAnEngine) {
  // Subgroup 1's payload (3 arrays of 300001 floats) spans several of the
  // checksum's 1 MiB chunks, whose edges fall inside the arrays.
  EngineConfig cfg = SmallConfig(1);
  cfg.subgroup_numel = {1000, 300001};
  cfg.host_budget_bytes = 4 * (4096 + AlignedRecordBytes(300001, 3));
  auto engine = Engine::Create(cfg);
  ASSERT_TRUE(engine.ok()) << engine.status();
  Engine& e = Initialized(*engine, cfg, 41);
  // Non-trivial moments: write them in.
  for (int i = 0; i < 2; ++i) {
    const size_t n = cfg.subgroup_numel[i];
    std::vector<float> p(n), m(n), v(n);
    ASSERT_TRUE(
        e.ReadSubgroup(i, p.data(), {m.data(), v.data()}, nullptr).ok());
    for (size_t k = 0; k < n; ++k) {
      m[k] = 0.5f * p[k] + static_cast<float>(k % 7);
      v[k] = p[k] * p[k] + static_cast<float>(i);
    }
    ASSERT_TRUE(e.WriteSubgroup(i, p.data(), {m.data(), v.data()}, 3 + i).ok());
  }
  const std::string dir = TempDir("records") + "/engine";
  ASSERT_TRUE(e.SaveCheckpoint(dir).ok());
  for (int i = 0; i < 2; ++i) {
    const size_t n = cfg.subgroup_numel[i];
    std::vector<float> p(n), m(n), v(n), gp(n), gm(n), gv(n);
    ASSERT_TRUE(
        e.ReadSubgroup(i, p.data(), {m.data(), v.data()}, nullptr).ok());
    int64_t step = -1;
    absl::Status s =
        ReadCheckpointRecord(dir, i, n, gp.data(), {gm.data(), gv.data()},
                             /*verify=*/true, &step);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(gp, p);
    EXPECT_EQ(gm, m);
    EXPECT_EQ(gv, v);
    EXPECT_EQ(step, 3 + i);
    // The master alone, or the first state array alone, with and without
    // the checksum pass (which reads the whole payload).
    for (bool verify : {true, false}) {
      std::vector<float> only(n, -1.0f);
      ASSERT_TRUE(
          ReadCheckpointRecord(dir, i, n, only.data(), {}, verify, nullptr)
              .ok());
      EXPECT_EQ(only, p) << verify;
      ASSERT_TRUE(ReadCheckpointRecord(dir, i, n, nullptr, {only.data()},
                                       verify, nullptr)
                      .ok());
      EXPECT_EQ(only, m) << verify;
      std::fill(only.begin(), only.end(), -1.0f);
      ASSERT_TRUE(ReadCheckpointRecord(dir, i, n, nullptr,
                                       {nullptr, only.data()}, verify, &step)
                      .ok());
      EXPECT_EQ(only, v) << verify;
      EXPECT_EQ(step, 3 + i);
    }
  }
  std::vector<float> buf(300001);
  absl::Status s =
      ReadCheckpointRecord(dir, 2, buf.size(), buf.data(), {}, true, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange) << s;
  s = ReadCheckpointRecord(dir, 0, 1000, buf.data(),
                           {buf.data(), buf.data(), buf.data()}, true, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  // A reader that expects another size (a layout that does not match the
  // engine files) is refused before anything is written.
  for (bool verify : {true, false}) {
    std::vector<float> small(1000, -1.0f);
    s = ReadCheckpointRecord(dir, 1, small.size(), small.data(), {}, verify,
                             nullptr);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_NE(s.message().find("subgroup 1 holds 300001 parameters, the "
                               "reader expects 1000"),
              std::string::npos)
        << s;
    EXPECT_EQ(small, std::vector<float>(1000, -1.0f));
  }

  // The `.old` copy of a save interrupted between its renames is read too.
  ASSERT_EQ(rename(dir.c_str(), (dir + ".old").c_str()), 0);
  EXPECT_TRUE(
      ReadCheckpointRecord(dir, 1, buf.size(), buf.data(), {}, true, nullptr)
          .ok());
  ASSERT_EQ(rename((dir + ".old").c_str(), dir.c_str()), 0);

  // One flipped byte in the last chunk; then a truncated file.
  const std::string path = dir + "/sg_1.ckpt";
  int fd = open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  const off_t last =
      static_cast<off_t>(kRecordHeaderBytes + 300001ull * 12 - 5);
  char byte = 0;
  ASSERT_EQ(pread(fd, &byte, 1, last), 1);
  byte ^= 0x10;
  ASSERT_EQ(pwrite(fd, &byte, 1, last), 1);
  s = ReadCheckpointRecord(dir, 1, buf.size(), buf.data(), {}, true, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("sg_1.ckpt: payload checksum mismatch"),
            std::string::npos)
      << s;
  // Unverified, the master (which the flip missed) reads as it was.
  std::vector<float> p1(300001), m1(300001);
  ASSERT_TRUE(e.ReadSubgroup(1, p1.data(), {m1.data(), nullptr}, nullptr).ok());
  buf.assign(buf.size(), 0.0f);
  s = ReadCheckpointRecord(dir, 1, buf.size(), buf.data(), {}, false, nullptr);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(buf, p1);
  ASSERT_EQ(ftruncate(fd, last), 0);
  close(fd);
  for (bool verify : {true, false}) {
    // Unverified, the truncated array must be one that is read.
    s = ReadCheckpointRecord(dir, 1, buf.size(), nullptr, {nullptr, buf.data()},
                             verify, nullptr);
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
    EXPECT_NE(s.message().find("truncated"), std::string::npos) << s;
  }
}

TEST(EngineTest, ResumesFromTheLastCommittedStep) {
  EngineConfig cfg = SmallConfig(2);
  cfg.commit_every = 1;
  cfg.run_name = "resume_run";
  Model model(cfg.subgroup_numel, 11);
  std::vector<float> want(1000);
  {
    auto engine = Engine::Create(cfg);
    ASSERT_TRUE(engine.ok()) << engine.status();
    Engine& e = **engine;
    ASSERT_NO_FATAL_FAILURE(InitializeFrom(e, model));
    for (int step = 1; step <= 3; ++step) {
      model.NewGrads(step);
      std::vector<SubgroupStepInput> in = AdamWInputs(model);
      ASSERT_TRUE(e.Step(in, StepOptions()).ok());
    }
    EXPECT_EQ(e.committed_step(), 3);
    std::vector<float> m(1000), v(1000);
    ASSERT_TRUE(
        e.ReadSubgroup(0, want.data(), {m.data(), v.data()}, nullptr).ok());
  }
  cfg.resume = true;
  auto engine = Engine::Create(cfg);
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_TRUE((*engine)->resumed());
  EXPECT_EQ((*engine)->step(), 3);
  std::vector<float> got(1000), m(1000), v(1000);
  int64_t step = 0;
  ASSERT_TRUE(
      (*engine)->ReadSubgroup(0, got.data(), {m.data(), v.data()}, &step).ok());
  EXPECT_EQ(step, 3);
  EXPECT_EQ(got, want);
}

// Every subgroup's master copy and moments, and its step.
struct Snapshot {
  std::vector<std::vector<float>> master, m, v;
  std::vector<int64_t> step;
  bool operator==(const Snapshot& o) const {
    return master == o.master && m == o.m && v == o.v && step == o.step;
  }
};

Snapshot Take(Engine& e, const std::vector<uint64_t>& sizes) {
  Snapshot s;
  for (size_t i = 0; i < sizes.size(); ++i) {
    s.master.emplace_back(sizes[i]);
    s.m.emplace_back(sizes[i]);
    s.v.emplace_back(sizes[i]);
    s.step.push_back(-1);
    absl::Status r = e.ReadSubgroup(static_cast<int>(i), s.master[i].data(),
                                    {s.m[i].data(), s.v[i].data()}, &s.step[i]);
    EXPECT_TRUE(r.ok()) << r;
  }
  return s;
}

// Runs steps first..last of `model` (gradients seeded by the step).
void RunSteps(Engine& e, Model& model, int first, int last) {
  for (int step = first; step <= last; ++step) {
    model.NewGrads(step);
    std::vector<SubgroupStepInput> in = AdamWInputs(model);
    ASSERT_TRUE(e.Step(in, StepOptions()).ok()) << "step " << step;
  }
}

TEST(EngineTest, NoCommitNamesAStateFileDeletedOrReplacedUnderTheRun) {
  // A tier wiped (or its files replaced) while the run uses it: writes still
  // reach the open descriptors, but a commit record naming those files would
  // promise state that no resume finds (likewise without the run's lock or
  // its MANIFEST, which a resume reads first). The commit fails, naming the
  // file, and the committed step stays where the files last were.
  for (const char* what :
       {"delete", "replace", "lock", "manifest", "manifest_changed"}) {
    SCOPED_TRACE(what);
    const std::string kind = what;
    EngineConfig cfg = SmallConfig(2);
    cfg.commit_every = 1;
    cfg.run_name = absl::StrCat("wiped_", what);
    Model model(cfg.subgroup_numel, 11);
    auto engine = Engine::Create(cfg);
    ASSERT_TRUE(engine.ok()) << engine.status();
    Engine& e = **engine;
    ASSERT_NO_FATAL_FAILURE(InitializeFrom(e, model));
    ASSERT_NO_FATAL_FAILURE(RunSteps(e, model, 1, 1));
    ASSERT_EQ(e.committed_step(), 1);
    const int t = e.plan().tier_of_subgroup[1];
    const std::string dir = absl::StrCat(cfg.tiers[t].path, "/", cfg.run_name);
    const std::string victim = kind == "lock" ? dir + "/LOCK"
                               : kind.rfind("manifest", 0) == 0
                                   ? dir + "/MANIFEST"
                                   : dir + "/sg_1.state";
    ASSERT_EQ(unlink(victim.c_str()), 0);
    if (kind == "replace" || kind == "manifest_changed") {
      int fd = open(victim.c_str(), O_CREAT | O_WRONLY, 0600);
      ASSERT_GE(fd, 0);
      ASSERT_EQ(write(fd, "x\n", 2), 2);
      close(fd);
    }
    model.NewGrads(2);
    absl::Status s = e.Step(AdamWInputs(model), StepOptions()).status();
    EXPECT_EQ(s.code(), kind == "replace" || kind == "manifest_changed"
                            ? absl::StatusCode::kFailedPrecondition
                            : absl::StatusCode::kNotFound)
        << s;
    EXPECT_NE(s.message().find("no commit record written"), std::string::npos)
        << s;
    EXPECT_NE(s.message().find(victim), std::string::npos) << s;
    EXPECT_EQ(e.committed_step(), 1);
    EXPECT_FALSE(e.RetryCommit().ok());
    EXPECT_EQ(e.committed_step(), 1);
  }
}

// A run with commits every 2 steps, taken to step 4; `at2` and `at4` get the
// state after steps 2 and 4.
EngineConfig CommittedEveryTwo(const std::string& name, Model& model,
                               Snapshot* at2, Snapshot* at4, int last = 4) {
  EngineConfig cfg = SmallConfig(2);
  cfg.commit_every = 2;
  cfg.run_name = name;
  // No cache between steps: every record is written every step.
  cfg.techniques = Only(true, false, true, false);
  auto engine = Engine::Create(cfg);
  EXPECT_TRUE(engine.ok()) << engine.status();
  if (!engine.ok()) return cfg;
  Engine& e = **engine;
  for (int i = 0; i < 4; ++i)
    EXPECT_TRUE(
        e.InitializeSubgroup(i, model.init[i].data(), DType::kFloat32).ok());
  RunSteps(e, model, 1, 2);
  *at2 = Take(e, cfg.subgroup_numel);
  RunSteps(e, model, 3, 4);
  *at4 = Take(e, cfg.subgroup_numel);
  EXPECT_EQ(e.committed_step(), 4);
  RunSteps(e, model, 5, last);
  return cfg;
}

std::string RunDir(const EngineConfig& cfg, int tier) {
  return absl::StrCat(cfg.tiers[tier].path, "/", cfg.run_name);
}

// A crash between the tiers' commit records comes before any COMMITTED
// mark names that commit: a test making one from a later state puts the
// marks back to `id`, the last commit that reached every tier.
void MarkCommitted(const std::vector<std::string>& run_dirs, CommitId id) {
  for (const std::string& dir : run_dirs) {
    ASSERT_TRUE(WriteFileAtomically(
                    dir + "/COMMITTED",
                    absl::StrCat("a commit of this run reached every tier\n"
                                 "commit ",
                                 id.epoch, " ", id.step, "\n"))
                    .ok());
  }
}
void MarkCommitted(const EngineConfig& cfg, CommitId id) {
  MarkCommitted({RunDir(cfg, 0), RunDir(cfg, 1)}, id);
}

// Each record slot of subgroup i in `dir` that holds a record: its header.
std::vector<std::pair<int, RecordHeader>> SlotHeaders(const std::string& dir,
                                                      int i, uint64_t numel) {
  std::vector<std::pair<int, RecordHeader>> out;
  const std::string path = absl::StrCat(dir, "/sg_", i, ".state");
  int fd = open(path.c_str(), O_RDONLY);
  EXPECT_GE(fd, 0) << path;
  if (fd < 0) return out;
  std::vector<char> page(kRecordHeaderBytes);
  for (int slot = 0; slot < 2; ++slot) {
    const uint64_t at = SlotOffset(slot, AlignedRecordBytes(numel, 3));
    if (pread(fd, page.data(), page.size(), at) !=
        static_cast<ssize_t>(page.size())) {
      continue;
    }
    auto h = DecodeRecordHeader(page.data(), page.size(), path);
    if (h.ok()) out.emplace_back(slot, *h);
  }
  close(fd);
  return out;
}

// Rewrites a run's files as a build of state format 1 wrote them: every
// record's header and payload checksum, the commit records that name those
// checksums, the manifests.
void ConvertRunToFormatOne(const EngineConfig& cfg, int tiers) {
  std::map<uint64_t, uint64_t> new_sum;  // format 2's checksum -> format 1's
  for (int t = 0; t < tiers; ++t) {
    const std::string dir = RunDir(cfg, t);
    auto text = ReadSmallFile(dir + "/MANIFEST");
    ASSERT_TRUE(text.ok()) << text.status();
    auto m = ParseManifest(*text, "MANIFEST");
    ASSERT_TRUE(m.ok()) << m.status();
    ASSERT_EQ(m->format_version, 2u);
    for (size_t i = 0; i < m->tier_of_subgroup.size(); ++i) {
      if (m->tier_of_subgroup[i] != t) continue;
      const uint64_t numel = cfg.subgroup_numel[i];
      const std::string path = absl::StrCat(dir, "/sg_", i, ".state");
      int fd = open(path.c_str(), O_RDWR);
      ASSERT_GE(fd, 0) << path;
      for (auto& [slot, h] : SlotHeaders(dir, static_cast<int>(i), numel)) {
        const uint64_t at = SlotOffset(slot, AlignedRecordBytes(numel, 3));
        std::vector<char> record(kRecordHeaderBytes + h.payload_bytes);
        ASSERT_EQ(pread(fd, record.data(), record.size(), at),
                  static_cast<ssize_t>(record.size()));
        const uint64_t old_sum = PayloadChecksum(
            record.data() + kRecordHeaderBytes, h.payload_bytes, nullptr, 2);
        ASSERT_EQ(old_sum, h.payload_checksum) << path << " slot " << slot;
        h.format_version = 1;
        h.payload_checksum = PayloadChecksum(record.data() + kRecordHeaderBytes,
                                             h.payload_bytes, nullptr, 1);
        ASSERT_NE(h.payload_checksum, old_sum);
        new_sum[old_sum] = h.payload_checksum;
        EncodeRecordHeader(h, record.data());
        ASSERT_EQ(pwrite(fd, record.data(), kRecordHeaderBytes, at),
                  static_cast<ssize_t>(kRecordHeaderBytes));
      }
      close(fd);
    }
    m->format_version = 1;
    ASSERT_TRUE(
        WriteFileAtomically(dir + "/MANIFEST", EncodeManifest(*m)).ok());
  }
  for (int t = 0; t < tiers; ++t) {
    for (const char* name : {"/COMMIT", "/COMMIT.prev"}) {
      const std::string path = RunDir(cfg, t) + name;
      auto bytes = ReadSmallFile(path);
      if (!bytes.ok()) continue;
      auto c = ParseCommitRecord(*bytes, path);
      ASSERT_TRUE(c.ok()) << c.status();
      for (uint64_t& sum : c->subgroup_checksum) {
        if (sum == 0) continue;
        ASSERT_EQ(new_sum.count(sum), 1u) << path;
        sum = new_sum[sum];
      }
      ASSERT_TRUE(WriteFileAtomically(path, EncodeCommitRecord(*c)).ok());
    }
  }
}

TEST(EngineTest, ARunOfStateFormatOneResumesAndItsRewrittenRecordsGetTwo) {
  // Format 2 changed the payload checksum's chunk hash only: a run written
  // before it resumes, each record verified in the format its header names
  // (a damaged one still caught), and each record a step writes is format 2.
  EngineConfig cfg = SmallConfig(2);
  cfg.commit_every = 1;
  cfg.run_name = "format_one_run";
  Model model(cfg.subgroup_numel, 11);
  Snapshot at2, at3;
  std::vector<int> tier_of;
  {
    auto engine = Engine::Create(cfg);
    ASSERT_TRUE(engine.ok()) << engine.status();
    tier_of = (*engine)->plan().tier_of_subgroup;
    ASSERT_NO_FATAL_FAILURE(InitializeFrom(**engine, model));
    ASSERT_NO_FATAL_FAILURE(RunSteps(**engine, model, 1, 2));
    at2 = Take(**engine, cfg.subgroup_numel);
  }
  ASSERT_NO_FATAL_FAILURE(ConvertRunToFormatOne(cfg, 2));
  cfg.resume = true;
  std::string victim;
  uint64_t victim_at = 0;
  {
    // A byte of a committed format-1 record damaged: its read fails.
    auto engine = Engine::Create(cfg);
    ASSERT_TRUE(engine.ok()) << engine.status();
    const int i = 1, t = tier_of[i];
    for (auto& [slot, h] :
         SlotHeaders(RunDir(cfg, t), i, cfg.subgroup_numel[i])) {
      EXPECT_EQ(h.format_version, 1u);
      if (h.step != 2) continue;
      victim = absl::StrCat(RunDir(cfg, t), "/sg_", i, ".state");
      victim_at =
          SlotOffset(slot, AlignedRecordBytes(cfg.subgroup_numel[i], 3)) +
          kRecordHeaderBytes + 4 * 17;
    }
    ASSERT_FALSE(victim.empty());
    int fd = open(victim.c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    char byte;
    ASSERT_EQ(pread(fd, &byte, 1, victim_at), 1);
    byte ^= 0x40;
    ASSERT_EQ(pwrite(fd, &byte, 1, victim_at), 1);
    std::vector<float> got(cfg.subgroup_numel[i]), m(got.size()), v(got.size());
    absl::Status s =
        (*engine)->ReadSubgroup(i, got.data(), {m.data(), v.data()}, nullptr);
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
    EXPECT_NE(s.message().find("payload checksum mismatch"), std::string::npos)
        << s;
    byte ^= 0x40;
    ASSERT_EQ(pwrite(fd, &byte, 1, victim_at), 1);
    close(fd);
  }
  {
    auto engine = Engine::Create(cfg);
    ASSERT_TRUE(engine.ok()) << engine.status();
    EXPECT_EQ((*engine)->step(), 2);
    EXPECT_TRUE(Take(**engine, cfg.subgroup_numel) == at2);
    ASSERT_NO_FATAL_FAILURE(RunSteps(**engine, model, 3, 3));
    EXPECT_EQ((*engine)->committed_step(), 3);
    at3 = Take(**engine, cfg.subgroup_numel);
  }
  // Step 3's records are format 2; step 2's, in the other slots, still 1.
  for (int i = 0; i < 4; ++i) {
    std::map<int64_t, uint32_t> format_of_step;
    for (auto& [slot, h] :
         SlotHeaders(RunDir(cfg, tier_of[i]), i, cfg.subgroup_numel[i])) {
      format_of_step[h.step] = h.format_version;
    }
    EXPECT_EQ(format_of_step, (std::map<int64_t, uint32_t>{{2, 1}, {3, 2}}))
        << "subgroup " << i;
  }
  const std::string ckpt = TempDir("format_one_ckpt");
  {
    auto engine = Engine::Create(cfg);
    ASSERT_TRUE(engine.ok()) << engine.status();
    EXPECT_EQ((*engine)->step(), 3);
    EXPECT_TRUE(Take(**engine, cfg.subgroup_numel) == at3);
    ASSERT_TRUE((*engine)->SaveCheckpoint(ckpt).ok());
  }
  // A checkpoint of format 1 reads, with and without an engine; its records
  // go to the tiers of the run that loads it as they are, still format 1.
  auto text = ReadSmallFile(ckpt + "/MANIFEST");
  ASSERT_TRUE(text.ok()) << text.status();
  auto manifest = ParseManifest(*text, "MANIFEST");
  ASSERT_TRUE(manifest.ok()) << manifest.status();
  manifest->format_version = 1;
  ASSERT_TRUE(
      WriteFileAtomically(ckpt + "/MANIFEST", EncodeManifest(*manifest)).ok());
  for (int i = 0; i < 4; ++i) {
    const std::string path = absl::StrCat(ckpt, "/sg_", i, ".ckpt");
    auto bytes = ReadSmallFile(path, size_t{1} << 20);
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    auto h = DecodeRecordHeader(bytes->data(), kRecordHeaderBytes, path);
    ASSERT_TRUE(h.ok()) << h.status();
    EXPECT_EQ(h->format_version, 2u);
    h->format_version = 1;
    h->payload_checksum = PayloadChecksum(bytes->data() + kRecordHeaderBytes,
                                          h->payload_bytes, nullptr, 1);
    std::string page(kRecordHeaderBytes, '\0');
    EncodeRecordHeader(*h, page.data());
    ASSERT_TRUE(
        WriteFileAtomically(path, page + bytes->substr(kRecordHeaderBytes))
            .ok());
    std::vector<float> master(cfg.subgroup_numel[i]), m(master.size()),
        v(master.size());
    int64_t step = -1;
    absl::Status s = ReadCheckpointRecord(ckpt, i, master.size(), master.data(),
                                          {m.data(), v.data()},
                                          /*verify=*/true, &step);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(master, at3.master[i]);
    EXPECT_EQ(step, 3);
  }
  cfg.run_name = "format_one_loaded";
  cfg.resume = false;
  cfg.techniques = Only(true, false, true, false);  // records not cached
  {
    auto engine = Engine::Create(cfg);
    ASSERT_TRUE(engine.ok()) << engine.status();
    tier_of = (*engine)->plan().tier_of_subgroup;
    ASSERT_TRUE((*engine)->LoadCheckpoint(ckpt).ok());
    ASSERT_TRUE((*engine)->Commit().ok());
  }
  cfg.resume = true;
  auto engine = Engine::Create(cfg);
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_EQ((*engine)->step(), 3);
  EXPECT_TRUE(Take(**engine, cfg.subgroup_numel) == at3);
  for (int i = 0; i < 4; ++i) {
    auto slots = SlotHeaders(RunDir(cfg, tier_of[i]), i, cfg.subgroup_numel[i]);
    ASSERT_EQ(slots.size(), 1u) << "subgroup " << i;
    EXPECT_EQ(slots[0].second.format_version, 1u) << "subgroup " << i;
  }
}

TEST(EngineTest, CrashBetweenTheTiersCommitRecordsResumesTheOlderCommit) {
  Model model({1000, 2000, 3000, 1500}, 21);
  Snapshot at2, at4;
  EngineConfig cfg = CommittedEveryTwo("tiers_apart", model, &at2, &at4);
  // The crash: tier 0's record of step 4 landed, tier 1's did not.
  absl::StatusOr<std::string> prev =
      ReadSmallFile(RunDir(cfg, 1) + "/COMMIT.prev");
  ASSERT_TRUE(prev.ok()) << prev.status();
  ASSERT_TRUE(WriteFileAtomically(RunDir(cfg, 1) + "/COMMIT", *prev).ok());
  ASSERT_NO_FATAL_FAILURE(MarkCommitted(cfg, {0, 2}));

  cfg.resume = true;
  auto engine = Engine::Create(cfg);
  ASSERT_TRUE(engine.ok()) << engine.status();
  Engine& e = **engine;
  ASSERT_EQ(e.step(), 2);
  EXPECT_TRUE(Take(e, cfg.subgroup_numel) == at2);
  // Steps 3 and 4 again: bit for bit what the interrupted run had.
  RunSteps(e, model, 3, 4);
  EXPECT_TRUE(Take(e, cfg.subgroup_numel) == at4);
}

TEST(EngineTest, AStartRemovesTheTemporaryFilesOfDeadWritersOnly) {
  // A process killed while it writes a commit record, the COMMITTED mark or
  // the MANIFEST leaves `<name>.tmp.<pid>` in the run directory. Once the
  // run's lock is taken no live process writes there, so a start (a resume,
  // or a fresh start under the run's name) removes them: before, they
  // stayed for ever, one more with each killed process.
  const std::vector<std::string> dead = {
      "COMMIT.tmp.4242", "COMMIT.prev.tmp.31337", "COMMITTED.tmp.7",
      "MANIFEST.tmp.123456", absl::StrCat("COMMIT.tmp.", getpid())};
  // Names that WriteFileAtomically does not write, and a symlink named like
  // one of its temporary files, which it never makes (it opens them with
  // O_NOFOLLOW): these stay, and so does what the link names.
  const std::vector<std::string> others = {
      "COMMIT.tmp.notes", "OTHER.tmp.123", "MANIFEST.tmp.12x",
      "COMMIT.tmp.0123",  "COMMIT.tmp.",   "sg_0.state.tmp.123",
      "COMMIT.tmp.1.2",   "LOCK.tmp.99"};
  const std::string link = "COMMITTED.tmp.555";
  for (const bool resume : {true, false}) {
    SCOPED_TRACE(resume ? "resume" : "fresh start");
    EngineConfig cfg = SmallConfig(2);
    cfg.commit_every = 1;
    cfg.run_name = "dead_writers";
    Model model(cfg.subgroup_numel, 31);
    {
      std::unique_ptr<Engine> e = CreateFrom(cfg, model);
      ASSERT_NE(e, nullptr);
      ASSERT_NO_FATAL_FAILURE(RunSteps(*e, model, 1, 1));
      ASSERT_EQ(e->committed_step(), 1);
    }
    const std::string outside = TempDir("dead_writers_outside") + "/target";
    {
      std::FILE* f = std::fopen(outside.c_str(), "w");
      ASSERT_NE(f, nullptr);
      std::fputs("not the run's", f);
      std::fclose(f);
    }
    for (int t = 0; t < 2; ++t) {
      for (const std::vector<std::string>* names : {&dead, &others}) {
        for (const std::string& name : *names) {
          const std::string path = absl::StrCat(RunDir(cfg, t), "/", name);
          std::FILE* f = std::fopen(path.c_str(), "w");
          ASSERT_NE(f, nullptr) << path;
          std::fputs("partial", f);
          std::fclose(f);
        }
      }
      ASSERT_EQ(symlink(outside.c_str(),
                        absl::StrCat(RunDir(cfg, t), "/", link).c_str()),
                0);
    }
    cfg.resume = resume;
    std::unique_ptr<Engine> e;
    if (resume) {
      absl::StatusOr<std::unique_ptr<Engine>> resumed = Engine::Create(cfg);
      ASSERT_TRUE(resumed.ok()) << resumed.status();
      e = *std::move(resumed);
      EXPECT_TRUE(e->resumed());
      EXPECT_EQ(e->step(), 1);
    } else {
      e = CreateFrom(cfg, model);
      ASSERT_NE(e, nullptr);
    }
    for (int t = 0; t < 2; ++t) {
      SCOPED_TRACE(absl::StrCat("tier ", t));
      const std::vector<std::string> names = NamesIn(RunDir(cfg, t));
      const std::set<std::string> left(names.begin(), names.end());
      for (const std::string& name : dead)
        EXPECT_EQ(left.count(name), 0) << name;
      for (const std::string& name : others)
        EXPECT_EQ(left.count(name), 1) << name;
      struct stat st;
      ASSERT_EQ(lstat(absl::StrCat(RunDir(cfg, t), "/", link).c_str(), &st), 0);
      EXPECT_TRUE(S_ISLNK(st.st_mode));
    }
    absl::StatusOr<std::string> target = ReadSmallFile(outside);
    ASSERT_TRUE(target.ok()) << target.status();
    EXPECT_EQ(*target, "not the run's");
    // The run goes on, its commits written as before.
    const int64_t before = e->step();
    ASSERT_NO_FATAL_FAILURE(RunSteps(*e, model, 2, 2));
    EXPECT_EQ(e->committed_step(), before + 1);
  }
}

// Two tiers, a commit every step, every record written every step.
EngineConfig CommitEveryStep(const std::string& name) {
  EngineConfig cfg = SmallConfig(2);
  cfg.commit_every = 1;
  cfg.run_name = name;
  cfg.techniques = Only(true, false, true, false);
  return cfg;
}

// A directory made there makes tier `tier`'s COMMIT of the run unwritable
// (its temporary name is taken) until it is removed.
std::string CommitBlocker(const EngineConfig& cfg, int tier) {
  return absl::StrCat(RunDir(cfg, tier), "/COMMIT.tmp.", getpid());
}

// A state file's fdatasync fails during a commit (EIO from a writeback):
// Linux reports that once, and the next fdatasync succeeds although the
// record may never have reached the disk. The retried commit writes the
// record again before it names it (before: it synced, saw success, and
// named the slot).
TEST(EngineTest, ARecordWhoseFsyncFailedIsWrittenAgainBeforeACommitNamesIt) {
  Model model({1000, 2000, 3000, 1500}, 31);
  EngineConfig cfg = CommitEveryStep("sync_lost");
  cfg.fault_injection = true;
  Snapshot at2;
  {
    auto engine = Engine::Create(cfg);
    ASSERT_TRUE(engine.ok()) << engine.status();
    Engine& e = **engine;
    ASSERT_NO_FATAL_FAILURE(InitializeFrom(e, model));
    ASSERT_NO_FATAL_FAILURE(RunSteps(e, model, 1, 1));
    const int t = e.plan().tier_of_subgroup[0];
    FaultSpec sync;
    sync.sync = true;
    sync.path_substring = "/sg_0.state";
    e.fault_injector(t)->AddFault(sync);
    model.NewGrads(2);
    auto r = e.Step(AdamWInputs(model), StepOptions());
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("fdatasync (injected)"),
              std::string::npos)
        << r.status();
    EXPECT_NE(r.status().message().find("sg_0.state"), std::string::npos)
        << r.status();
    EXPECT_EQ(e.committed_step(), 1);
    EXPECT_EQ(e.step(), 2);
    // Counts the writes of subgroup 0's record from here.
    FaultSpec count;
    count.kind = FaultSpec::Kind::kDelay;
    count.op = IoOp::kWrite;
    count.nth = -1;
    count.path_substring = "/sg_0.state";
    e.fault_injector(t)->AddFault(count);
    const int before = e.fault_injector(t)->fired();
    ASSERT_TRUE(e.RetryCommit().ok());
    EXPECT_EQ(e.committed_step(), 2);
    EXPECT_EQ(e.fault_injector(t)->fired(), before + 1);
    // Once written and synced, the next commit does not write it again.
    e.fault_injector(t)->ClearFaults();
    at2 = Take(e, cfg.subgroup_numel);
  }
  cfg.resume = true;
  auto engine = Engine::Create(cfg);
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_EQ((*engine)->step(), 2);
  EXPECT_TRUE(Take(**engine, cfg.subgroup_numel) == at2);
}

TEST(EngineTest, AStepCountRepeatedAfterALoadIsNeverResumedAsAMix) {
  // Step 3 is committed; a load of step 2's checkpoint, a new epoch, and
  // another step 3: commit (epoch 1, step 3). A crash between the tiers'
  // records of it resumes (epoch 0, step 3) from both. (Matched by step
  // count alone, tier 0's new step 3 and tier 1's old one made a mix.)
  Model model({1000, 2000, 3000, 1500}, 24);
  EngineConfig cfg = CommitEveryStep("repeated_step");
  const std::string ckpt = TempDir("repeated_step_ckpt");
  Snapshot first, second;
  absl::StatusOr<std::string> commit, prev;
  {
    auto engine = Engine::Create(cfg);
    ASSERT_TRUE(engine.ok()) << engine.status();
    Engine& e = **engine;
    ASSERT_NO_FATAL_FAILURE(InitializeFrom(e, model));
    ASSERT_NO_FATAL_FAILURE(RunSteps(e, model, 1, 2));
    ASSERT_TRUE(e.SaveCheckpoint(ckpt).ok());
    ASSERT_NO_FATAL_FAILURE(RunSteps(e, model, 3, 3));
    first = Take(e, cfg.subgroup_numel);
    commit = ReadSmallFile(RunDir(cfg, 1) + "/COMMIT");
    prev = ReadSmallFile(RunDir(cfg, 1) + "/COMMIT.prev");
    ASSERT_TRUE(commit.ok() && prev.ok());
    ASSERT_TRUE(e.LoadCheckpoint(ckpt).ok());
    ASSERT_EQ(e.step(), 2);
    model.NewGrads(1003);  // another branch
    // Without a new epoch its commit would repeat (epoch 0, step 3): the
    // step is refused before it changes anything.
    auto refused = e.Step(AdamWInputs(model), StepOptions());
    ASSERT_FALSE(refused.ok());
    EXPECT_NE(refused.status().message().find(
                  "the commit of step 3 (epoch 0) would not be newer than "
                  "the last commit, of step 3 (epoch 0)"),
              std::string::npos)
        << refused.status();
    EXPECT_EQ(e.step(), 2);
    EXPECT_FALSE(e.SetEpoch(-1).ok());
    ASSERT_TRUE(e.SetEpoch(1).ok());
    ASSERT_TRUE(e.Step(AdamWInputs(model), StepOptions()).ok());
    EXPECT_EQ(e.committed_step(), 3);
    EXPECT_EQ(e.committed_epoch(), 1);
    second = Take(e, cfg.subgroup_numel);
    ASSERT_FALSE(second == first);
  }
  // The crash: tier 1's record of (1, 3) never landed.
  ASSERT_TRUE(WriteFileAtomically(RunDir(cfg, 1) + "/COMMIT", *commit).ok());
  ASSERT_TRUE(WriteFileAtomically(RunDir(cfg, 1) + "/COMMIT.prev", *prev).ok());
  ASSERT_NO_FATAL_FAILURE(MarkCommitted(cfg, {0, 3}));
  cfg.resume = true;
  cfg.resume_epoch = 1;  // asked for: not on tier 1
  cfg.resume_step = 3;
  auto refused = Engine::Create(cfg);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find(
                "cannot give the commit of step 3 (epoch 1): it has step 3 "
                "(epoch 0) and step 2 (epoch 0)"),
            std::string::npos)
      << refused.status();
  cfg.resume_epoch = 0;
  cfg.resume_step = -1;
  auto engine = Engine::Create(cfg);
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_EQ((*engine)->step(), 3);
  EXPECT_EQ((*engine)->committed_epoch(), 0);
  EXPECT_EQ((*engine)->epoch(), 0);
  // Tier 0 rolled back to (0, 3), its COMMIT.prev: (0, 2) is on tier 1
  // only, so (0, 3) is the one commit every tier holds.
  EXPECT_EQ((*engine)->kept_commits(), (std::vector<CommitId>{{0, 3}}));
  EXPECT_TRUE(Take(**engine, cfg.subgroup_numel) == first);
}

// Steps 1 and 2, a checkpoint `ckpt` of step 2, steps 3 to `last`, then
// that checkpoint loaded and epoch 1 begun: the next steps count 3 again.
void RepeatStepsAfterALoad(Engine& e, Model& model, const std::string& ckpt,
                           int last) {
  ASSERT_NO_FATAL_FAILURE(InitializeFrom(e, model));
  ASSERT_NO_FATAL_FAILURE(RunSteps(e, model, 1, 2));
  ASSERT_TRUE(e.SaveCheckpoint(ckpt).ok());
  ASSERT_NO_FATAL_FAILURE(RunSteps(e, model, 3, last));
  ASSERT_TRUE(e.LoadCheckpoint(ckpt).ok());
  ASSERT_TRUE(e.SetEpoch(1).ok());
}

// Every record of the 4-subgroup run `e` resumed is refused: DataLoss
// whose message contains `why`.
void ExpectNoRecordResumes(Engine& e, const std::string& why) {
  std::vector<float> master(3000), m(3000), v(3000);
  for (int i = 0; i < 4; ++i) {
    absl::Status r =
        e.ReadSubgroup(i, master.data(), {m.data(), v.data()}, nullptr);
    ASSERT_FALSE(r.ok()) << "subgroup " << i;
    EXPECT_EQ(r.code(), absl::StatusCode::kDataLoss);
    EXPECT_NE(r.message().find(why), std::string::npos) << r;
  }
}

TEST(EngineTest, ARecordRewrittenAtItsCommitsStepCountIsNeverResumed) {
  // Commits of steps 3 and 4; a load of step 2, a new epoch and another
  // step 3 write over the slots of (0, 3) with records of step 3 too; their
  // commit fails. Going back to (0, 3) (as the ranks of a group may) finds
  // records whose header step matches but whose payload is not the one the
  // commit names: DataLoss, never that state resumed as (0, 3).
  Model model({1000, 2000, 3000, 1500}, 27);
  EngineConfig cfg = CommitEveryStep("same_step");
  const std::string ckpt = TempDir("same_step_ckpt");
  {
    auto engine = Engine::Create(cfg);
    ASSERT_TRUE(engine.ok()) << engine.status();
    Engine& e = **engine;
    ASSERT_NO_FATAL_FAILURE(RepeatStepsAfterALoad(e, model, ckpt, 4));
    // Tier 0's COMMIT.prev cannot be written: the commit fails before any
    // tier's records change.
    const std::string blocker =
        absl::StrCat(RunDir(cfg, 0), "/COMMIT.prev.tmp.", getpid());
    ASSERT_EQ(mkdir(blocker.c_str(), 0700), 0);
    model.NewGrads(1003);
    ASSERT_FALSE(e.Step(AdamWInputs(model), StepOptions()).ok());
    ASSERT_EQ(rmdir(blocker.c_str()), 0);
    EXPECT_EQ(e.committed_step(), 4);
  }
  cfg.resume = true;
  cfg.resume_step = 3;
  auto engine = Engine::Create(cfg);
  ASSERT_TRUE(engine.ok()) << engine.status();
  ExpectNoRecordResumes(**engine, "another state of step 3");
}

TEST(EngineTest, ACommitThatReachedSomeTiersIsReplacedNotStacked) {
  // Step 3's commit reaches tier 0 only; step 4 first retries it, which
  // fails again, so step 4 is refused before it writes anything (before, it
  // ran, and its commit reached tier 0 too). Tier 0 must still hold step
  // 2's commit, the last one on every tier: its COMMIT.prev is not replaced
  // by a failed attempt's.
  Model model({1000, 2000, 3000, 1500}, 25);
  EngineConfig cfg = CommitEveryStep("partial_commit");
  Snapshot at2;
  {
    auto engine = Engine::Create(cfg);
    ASSERT_TRUE(engine.ok()) << engine.status();
    Engine& e = **engine;
    ASSERT_NO_FATAL_FAILURE(InitializeFrom(e, model));
    ASSERT_NO_FATAL_FAILURE(RunSteps(e, model, 1, 2));
    at2 = Take(e, cfg.subgroup_numel);
    // Tier 1's COMMIT cannot be written: its temporary name is taken.
    const std::string blocker = CommitBlocker(cfg, 1);
    ASSERT_EQ(mkdir(blocker.c_str(), 0700), 0);
    for (int step = 3; step <= 4; ++step) {
      model.NewGrads(step);
      auto r = e.Step(AdamWInputs(model), StepOptions());
      ASSERT_FALSE(r.ok()) << "step " << step;
      EXPECT_NE(r.status().message().find("COMMIT.tmp"), std::string::npos)
          << r.status();
      if (step == 4) {
        EXPECT_NE(r.status().message().find("commit of step 3"),
                  std::string::npos)
            << r.status();
      }
      EXPECT_EQ(e.committed_step(), 2);
      EXPECT_EQ(e.step(), 3);
    }
    absl::StatusOr<std::string> on0 = ReadSmallFile(RunDir(cfg, 0) + "/COMMIT");
    ASSERT_TRUE(on0.ok());
    auto record = ParseCommitRecord(*on0, "COMMIT");
    ASSERT_TRUE(record.ok()) << record.status();
    EXPECT_EQ(record->id, (CommitId{0, 3}));
    ASSERT_EQ(rmdir(blocker.c_str()), 0);
  }
  cfg.resume = true;
  auto engine = Engine::Create(cfg);
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_EQ((*engine)->step(), 2);
  // Tier 0's COMMIT.prev is still step 2's, the last commit on every tier:
  // step 1's is on tier 1 only.
  EXPECT_EQ((*engine)->kept_commits(), (std::vector<CommitId>{{0, 2}}));
  EXPECT_TRUE(Take(**engine, cfg.subgroup_numel) == at2);
}

TEST(EngineTest, ACommitThatReachedEveryTierMarksEachAndAFreshStartUnmarks) {
  // recovery.has_committed_state tells a tier that lost its COMMIT from a
  // first commit that reached some tiers only by the COMMITTED marks.
  Model model({1000, 2000, 3000, 1500}, 26);
  EngineConfig cfg = CommitEveryStep("committed_mark");
  auto mark_of = [&cfg](int t) { return RunDir(cfg, t) + "/COMMITTED"; };
  auto marked = [&mark_of](int t) {
    struct stat st;
    return stat(mark_of(t).c_str(), &st) == 0;
  };
  {
    auto engine = Engine::Create(cfg);
    ASSERT_TRUE(engine.ok()) << engine.status();
    Engine& e = **engine;
    // The initial state's commit reaches tier 0 only: no tier is marked.
    const std::string blocker = CommitBlocker(cfg, 1);
    ASSERT_EQ(mkdir(blocker.c_str(), 0700), 0);
    absl::Status last;
    for (int i = 0; i < e.num_subgroups(); ++i) {
      last = e.InitializeSubgroup(i, model.init[i].data(), DType::kFloat32);
    }
    EXPECT_FALSE(last.ok());
    EXPECT_FALSE(marked(0));
    EXPECT_FALSE(marked(1));
    ASSERT_EQ(rmdir(blocker.c_str()), 0);
    EXPECT_TRUE(e.commit_mark_error().ok());  // none tried yet
    // Tier 1's mark cannot be written (a directory in its place): the
    // commit holds, the mark's error names it, the next commit writes it.
    const std::string mark = mark_of(1);
    ASSERT_EQ(mkdir(mark.c_str(), 0700), 0);
    ASSERT_NO_FATAL_FAILURE(RunSteps(e, model, 1, 1));
    EXPECT_EQ(e.committed_step(), 1);
    EXPECT_TRUE(marked(0));
    EXPECT_TRUE(absl::StrContains(e.commit_mark_error().message(), mark))
        << e.commit_mark_error();
    ASSERT_EQ(rmdir(mark.c_str()), 0);
    ASSERT_NO_FATAL_FAILURE(RunSteps(e, model, 2, 2));
    EXPECT_EQ(e.committed_step(), 2);
    EXPECT_TRUE(e.commit_mark_error().ok()) << e.commit_mark_error();
    EXPECT_TRUE(marked(0));
    EXPECT_TRUE(marked(1));
  }
  {
    EngineConfig again = cfg;
    again.resume = true;  // a resume keeps the marks
    auto resumed = Engine::Create(again);
    ASSERT_TRUE(resumed.ok()) << resumed.status();
    EXPECT_EQ((*resumed)->step(), 2);
    EXPECT_TRUE(marked(0));
    EXPECT_TRUE(marked(1));
  }
  auto fresh = Engine::Create(cfg);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_FALSE(marked(0));
  EXPECT_FALSE(marked(1));
}

TEST(EngineTest, RetryCommitWritesAFailedCommitWhileTheStateIsItsOwn) {
  // Step 3 committed, a load of step 2, a new epoch, step 3 again: its
  // commit fails on tier 1. RetryCommit writes it (before, it took the
  // step count, already committed, for the failed commit's and did
  // nothing); once the state moved on (a later epoch), it writes nothing.
  Model model({1000, 2000, 3000, 1500}, 26);
  EngineConfig cfg = CommitEveryStep("retry_repeated");
  const std::string ckpt = TempDir("retry_repeated_ckpt");
  Snapshot second;
  {
    auto engine = Engine::Create(cfg);
    ASSERT_TRUE(engine.ok()) << engine.status();
    Engine& e = **engine;
    ASSERT_NO_FATAL_FAILURE(RepeatStepsAfterALoad(e, model, ckpt, 3));
    const std::string blocker = CommitBlocker(cfg, 1);
    ASSERT_EQ(mkdir(blocker.c_str(), 0700), 0);
    model.NewGrads(1003);
    ASSERT_FALSE(e.Step(AdamWInputs(model), StepOptions()).ok());
    EXPECT_EQ(e.committed_epoch(), 0);
    EXPECT_FALSE(e.RetryCommit().ok());  // still blocked
    ASSERT_EQ(rmdir(blocker.c_str()), 0);
    absl::Status s = e.RetryCommit();
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(e.committed_step(), 3);
    EXPECT_EQ(e.committed_epoch(), 1);
    EXPECT_EQ(e.kept_commits(), (std::vector<CommitId>{{1, 3}, {0, 3}}));
    second = Take(e, cfg.subgroup_numel);
    // A failed commit, then a later epoch: nothing for RetryCommit.
    ASSERT_EQ(mkdir(blocker.c_str(), 0700), 0);
    model.NewGrads(1004);
    ASSERT_FALSE(e.Step(AdamWInputs(model), StepOptions()).ok());
    ASSERT_EQ(rmdir(blocker.c_str()), 0);
    ASSERT_TRUE(e.SetEpoch(2).ok());
    EXPECT_TRUE(e.RetryCommit().ok());
    EXPECT_EQ(e.committed_step(), 3);
    EXPECT_EQ(e.committed_epoch(), 1);
    // A failed commit, then a record written (a load, even one that failed
    // part-way): nothing for RetryCommit either.
    ASSERT_EQ(mkdir(blocker.c_str(), 0700), 0);
    model.NewGrads(1005);
    ASSERT_FALSE(e.Step(AdamWInputs(model), StepOptions()).ok());
    ASSERT_EQ(rmdir(blocker.c_str()), 0);
    Snapshot now = Take(e, cfg.subgroup_numel);
    ASSERT_TRUE(e.WriteSubgroup(0, now.master[0].data(),
                                {now.m[0].data(), now.v[0].data()}, now.step[0])
                    .ok());
    EXPECT_TRUE(e.RetryCommit().ok());
    EXPECT_EQ(e.committed_step(), 3);
    EXPECT_EQ(e.committed_epoch(), 1);
  }
  cfg.resume = true;
  auto engine = Engine::Create(cfg);
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_EQ((*engine)->committed_epoch(), 1);
  EXPECT_EQ((*engine)->epoch(), 1);
  EXPECT_TRUE(Take(**engine, cfg.subgroup_numel) == second);
}

// A step whose commit failed is done: its I/O counts are not added to the
// next step's stats.
TEST(EngineTest, AStepWhoseCommitFailedLeavesNoCountsToTheNext) {
  Model model({1000, 2000, 3000, 1500}, 27);
  EngineConfig cfg = CommitEveryStep("failed_commit_stats");
  std::unique_ptr<Engine> engine = CreateFrom(cfg, model);
  ASSERT_NE(engine, nullptr);
  Engine& e = *engine;
  std::vector<StepStats> stats;
  const std::string blocker = CommitBlocker(cfg, 1);
  for (int step = 1; step <= 4; ++step) {
    model.NewGrads(2000 + step);
    if (step == 3) {
      ASSERT_EQ(mkdir(blocker.c_str(), 0700), 0);
    }
    auto s = e.Step(AdamWInputs(model), StepOptions());
    if (step == 3) {
      ASSERT_FALSE(s.ok());
      ASSERT_EQ(rmdir(blocker.c_str()), 0);
      ASSERT_TRUE(e.RetryCommit().ok());
      continue;
    }
    ASSERT_TRUE(s.ok()) << s.status();
    stats.push_back(*s);
  }
  // Steps 2 and 4 go the same way (the order alternates): the same I/O.
  EXPECT_EQ(e.plan().Order(1), e.plan().Order(3));
  EXPECT_EQ(stats[2].bytes_read, stats[1].bytes_read);
  EXPECT_EQ(stats[2].bytes_written, stats[1].bytes_written);
  EXPECT_EQ(stats[2].cache_hits, stats[1].cache_hits);
}

TEST(EngineTest, LoadsAreCommittedByCommitNeverHalfWay) {
  // State written outside a step (a load, a re-packed state) is committed by
  // Commit(), records rewritten in the host cache at their own step count
  // included; InitializeSubgroup in a run that has committed commits
  // nothing on its own (before, it committed a half-loaded state, naming the
  // stale disk copy of a record rewritten in the cache).
  Model model({1000, 2000, 3000, 1500}, 33);
  EngineConfig cfg = SmallConfig(2);
  cfg.commit_every = 1;
  cfg.run_name = "explicit_commit";
  cfg.host_budget_bytes *= 4;  // records stay cached
  Snapshot at2, loaded;
  for (bool commit : {false, true}) {
    SCOPED_TRACE(commit ? "committed" : "not committed");
    {
      cfg.resume = commit;  // the second round starts from the first's
      auto engine = Engine::Create(cfg);
      ASSERT_TRUE(engine.ok()) << engine.status();
      Engine& e = **engine;
      if (!commit) {
        ASSERT_NO_FATAL_FAILURE(InitializeFrom(e, model));
        ASSERT_NO_FATAL_FAILURE(RunSteps(e, model, 1, 2));
        at2 = Take(e, cfg.subgroup_numel);
      }
      ASSERT_EQ(e.committed_step(), 2);
      ASSERT_GT(e.plan().num_cached, 0);
      ASSERT_GE(e.plan().tier_of_subgroup.size(), 4u);
      for (int i : {0, 3}) {
        const uint64_t n = cfg.subgroup_numel[i];
        std::vector<float> master(n, 0.5f + i), m(n, 0.25f), v(n, 0.125f);
        ASSERT_TRUE(
            e.WriteSubgroup(i, master.data(), {m.data(), v.data()}, 2).ok());
      }
      ASSERT_TRUE(
          e.InitializeSubgroup(1, model.init[1].data(), DType::kFloat32).ok());
      EXPECT_EQ(e.committed_step(), 2);
      loaded = Take(e, cfg.subgroup_numel);
      if (commit) {
        // Step 2 of epoch 0 is committed already: one commit, one state.
        absl::Status s = e.Commit();
        EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
        EXPECT_NE(s.message().find("SetEpoch to a later epoch first"),
                  std::string::npos)
            << s;
        ASSERT_TRUE(e.SetEpoch(1).ok());
        s = e.Commit();
        ASSERT_TRUE(s.ok()) << s;
        EXPECT_EQ(e.committed_step(), 2);
        EXPECT_EQ(e.committed_epoch(), 1);
        EXPECT_TRUE(e.Commit().ok());  // nothing changed since: nothing to do
      }
    }
    cfg.resume = true;
    auto engine = Engine::Create(cfg);
    ASSERT_TRUE(engine.ok()) << engine.status();
    EXPECT_EQ((*engine)->step(), 2);
    EXPECT_EQ((*engine)->committed_epoch(), commit ? 1 : 0);
    EXPECT_TRUE(Take(**engine, cfg.subgroup_numel) == (commit ? loaded : at2));
  }
  // Refused where it cannot be a whole state.
  cfg.commit_every = 0;
  cfg.resume = false;
  cfg.run_name = "explicit_commit_off";
  auto engine = Engine::Create(cfg);
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_EQ((*engine)->Commit().code(), absl::StatusCode::kFailedPrecondition);
  cfg.commit_every = 1;
  cfg.run_name = "explicit_commit_uninitialised";
  auto fresh = Engine::Create(cfg);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  absl::Status s = (*fresh)->Commit();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("never initialised"), std::string::npos) << s;
}

TEST(EngineTest, CommitWritesWhatACheckpointLoadPutInTheCache) {
  // A checkpoint of step 2 loaded over other records of step 2 (another
  // branch of the run): the cached ones differ from their disk copy at the
  // same step count, and Commit must write them.
  Model model({1000, 2000, 3000, 1500}, 44);
  EngineConfig cfg = SmallConfig(2);
  cfg.commit_every = 1;
  cfg.run_name = "commit_after_load";
  cfg.host_budget_bytes *= 4;
  const std::string ckpt = TempDir("commit_after_load_ckpt");
  Snapshot saved;
  {
    auto engine = Engine::Create(cfg);
    ASSERT_TRUE(engine.ok()) << engine.status();
    Engine& e = **engine;
    ASSERT_GT(e.plan().num_cached, 0);
    ASSERT_NO_FATAL_FAILURE(InitializeFrom(e, model));
    ASSERT_NO_FATAL_FAILURE(RunSteps(e, model, 1, 2));
    ASSERT_TRUE(e.SaveCheckpoint(ckpt).ok());
    saved = Take(e, cfg.subgroup_numel);
    for (int i = 0; i < 4; ++i) {  // the other branch, committed as step 3
      const uint64_t n = cfg.subgroup_numel[i];
      std::vector<float> master(n, -1.0f), m(n, 0.5f), v(n, 0.5f);
      ASSERT_TRUE(
          e.WriteSubgroup(i, master.data(), {m.data(), v.data()}, 2).ok());
    }
    ASSERT_TRUE(e.SetStep(3).ok());
    ASSERT_TRUE(e.Commit().ok());
    ASSERT_TRUE(e.LoadCheckpoint(ckpt).ok());
    ASSERT_TRUE(Take(e, cfg.subgroup_numel) == saved);
    ASSERT_TRUE(e.SetStep(4).ok());
    absl::Status s = e.Commit();
    ASSERT_TRUE(s.ok()) << s;
  }
  cfg.resume = true;
  auto engine = Engine::Create(cfg);
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_EQ((*engine)->step(), 4);
  EXPECT_TRUE(Take(**engine, cfg.subgroup_numel) == saved);
}

TEST(EngineTest, ResumeStepGoesBackOneCommitAndNoFurther) {
  Model model({1000, 2000, 3000, 1500}, 22);
  Snapshot at2, at4;
  EngineConfig cfg = CommittedEveryTwo("go_back", model, &at2, &at4);
  cfg.resume = true;
  {
    auto engine = Engine::Create(cfg);
    ASSERT_TRUE(engine.ok()) << engine.status();
    EXPECT_EQ((*engine)->kept_commits(),
              (std::vector<CommitId>{{0, 4}, {0, 2}}));
  }
  cfg.resume_step = 3;
  auto refused = Engine::Create(cfg);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(refused.status().message().find(
                "cannot give the commit of step 3 (epoch 0): it has step 4 "
                "(epoch 0) and step 2 (epoch 0)"),
            std::string::npos)
      << refused.status();
  cfg.resume_step = 2;
  {
    auto engine = Engine::Create(cfg);
    ASSERT_TRUE(engine.ok()) << engine.status();
    EXPECT_EQ((*engine)->step(), 2);
    EXPECT_EQ((*engine)->kept_commits(), (std::vector<CommitId>{{0, 2}}));
    EXPECT_TRUE(Take(**engine, cfg.subgroup_numel) == at2);
  }
  // Going back rewrote the commit records: step 4 is gone for good. The
  // COMMITTED marks too, which named step 4 (else this resume would take
  // the tiers for older copies).
  cfg.resume_step = -1;
  auto engine = Engine::Create(cfg);
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_EQ((*engine)->step(), 2);
  for (int t = 0; t < 2; ++t) {
    absl::StatusOr<std::string> mark =
        ReadSmallFile(RunDir(cfg, t) + "/COMMITTED");
    ASSERT_TRUE(mark.ok()) << mark.status();
    EXPECT_TRUE(absl::StrContains(*mark, "\ncommit 0 2\n")) << *mark;
  }
}

TEST(EngineTest, ATierRestoredFromAnOlderCopyIsRefusedNotRolledBack) {
  // Tier 1's files replaced by a copy taken one commit earlier (a backup,
  // a snapshot) look like a crash between the tiers' commit records: the
  // newest commit every tier holds is the copy's. Before, a resume went
  // back to it without a word (the step after it lost). The COMMITTED
  // marks name the newest commit that reached every tier, which a crash
  // between the records never does: refused, naming the tier, and nothing
  // is changed. Removing the marks is the way back to the older commit.
  namespace fs = std::filesystem;
  Model model({1000, 2000, 3000, 1500}, 27);
  EngineConfig cfg = CommitEveryStep("restored_copy");
  const std::string backup = TempDir("restored_copy_backup") + "/tier1";
  const std::vector<std::string> dirs = {RunDir(cfg, 0), RunDir(cfg, 1)};
  Snapshot at2;
  {
    auto engine = Engine::Create(cfg);
    ASSERT_TRUE(engine.ok()) << engine.status();
    ASSERT_NO_FATAL_FAILURE(InitializeFrom(**engine, model));
    ASSERT_NO_FATAL_FAILURE(RunSteps(**engine, model, 1, 2));
    at2 = Take(**engine, cfg.subgroup_numel);
  }
  fs::copy(dirs[1], backup, fs::copy_options::recursive);
  cfg.resume = true;
  {
    auto engine = Engine::Create(cfg);
    ASSERT_TRUE(engine.ok()) << engine.status();
    ASSERT_NO_FATAL_FAILURE(RunSteps(**engine, model, 3, 3));
    EXPECT_EQ((*engine)->committed_step(), 3);
  }
  fs::remove_all(dirs[1]);
  fs::copy(backup, dirs[1], fs::copy_options::recursive);
  absl::StatusOr<std::string> commit0 = ReadSmallFile(dirs[0] + "/COMMIT");
  ASSERT_TRUE(commit0.ok()) << commit0.status();

  auto refused = Engine::Create(cfg);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kDataLoss);
  for (const std::string& part :
       {std::string("the commit of step 3 (epoch 0) reached every tier"),
        dirs[1] + " (its COMMIT: step 2 (epoch 0)) holds an older copy",
        std::string("remove the COMMITTED file of every tier")}) {
    EXPECT_TRUE(absl::StrContains(refused.status().message(), part))
        << refused.status() << "\nlacks: " << part;
  }
  EXPECT_FALSE(absl::StrContains(refused.status().message(), dirs[0] + " ("))
      << refused.status();
  auto kept = ReadKeptCommits(dirs);
  EXPECT_EQ(kept.status().code(), absl::StatusCode::kDataLoss) << kept.status();
  absl::StatusOr<std::string> after = ReadSmallFile(dirs[0] + "/COMMIT");
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(*after, *commit0);  // nothing rolled back

  // A mark of the first format names no commit: as before, no check.
  for (const std::string& dir : dirs) {
    ASSERT_TRUE(WriteFileAtomically(dir + "/COMMITTED",
                                    "a commit of this run reached every "
                                    "tier\n")
                    .ok());
  }
  kept = ReadKeptCommits(dirs);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(*kept, (std::vector<CommitId>{{0, 2}}));
  // The marks removed, as the error says: the older commit resumes.
  for (const std::string& dir : dirs) {
    ASSERT_EQ(unlink((dir + "/COMMITTED").c_str()), 0);
  }
  auto engine = Engine::Create(cfg);
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_EQ((*engine)->step(), 2);
  EXPECT_TRUE(Take(**engine, cfg.subgroup_numel) == at2);
}

TEST(EngineTest, KeptCommitsAreReadWithoutOpeningTheRun) {
  Model model({1000, 2000, 3000, 1500}, 26);
  Snapshot at2, at4;
  EngineConfig cfg = CommittedEveryTwo("kept_read", model, &at2, &at4);
  const std::vector<std::string> dirs = {RunDir(cfg, 0), RunDir(cfg, 1)};
  EXPECT_TRUE(CheckRunLayout(dirs, 3, cfg.subgroup_numel).ok());
  absl::Status other = CheckRunLayout(dirs, 3, {1000, 2000, 3000, 1501});
  EXPECT_EQ(other.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(other.message().find("subgroup 3 has 1500 parameters, this "
                                 "model's has 1501"),
            std::string::npos)
      << other;
  EXPECT_FALSE(CheckRunLayout(dirs, 2, cfg.subgroup_numel).ok());
  auto kept = ReadKeptCommits(dirs);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(*kept, (std::vector<CommitId>{{0, 4}, {0, 2}}));
  cfg.resume = true;
  {
    auto engine = Engine::Create(cfg);
    ASSERT_TRUE(engine.ok()) << engine.status();
    EXPECT_EQ((*engine)->kept_commits(), *kept);
  }
  // Tier 1's record of step 4 lost (a crash between the tiers): step 2 is
  // the only commit both hold, as for the resume.
  absl::StatusOr<std::string> prev0 = ReadSmallFile(dirs[0] + "/COMMIT.prev");
  absl::StatusOr<std::string> prev1 = ReadSmallFile(dirs[1] + "/COMMIT.prev");
  ASSERT_TRUE(prev0.ok() && prev1.ok());
  ASSERT_TRUE(WriteFileAtomically(dirs[1] + "/COMMIT", *prev1).ok());
  ASSERT_NO_FATAL_FAILURE(MarkCommitted(dirs, {0, 2}));
  kept = ReadKeptCommits(dirs);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(*kept, (std::vector<CommitId>{{0, 2}}));
  // A damaged COMMIT.prev holds nothing: no commit in common.
  ASSERT_TRUE(WriteFileAtomically(dirs[0] + "/COMMIT.prev", "junk").ok());
  kept = ReadKeptCommits(dirs);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_TRUE(kept->empty());
  // A damaged COMMIT is DataLoss; a missing one names the tier.
  ASSERT_TRUE(WriteFileAtomically(dirs[1] + "/COMMIT", "junk").ok());
  kept = ReadKeptCommits(dirs);
  EXPECT_EQ(kept.status().code(), absl::StatusCode::kDataLoss) << kept.status();
  ASSERT_EQ(unlink((dirs[1] + "/COMMIT").c_str()), 0);
  kept = ReadKeptCommits(dirs);
  EXPECT_EQ(kept.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(kept.status().message().find("no committed step on " + dirs[1]),
            std::string::npos)
      << kept.status();
  // One that cannot be read (here a directory in its place: EISDIR, as an
  // I/O error would be) is not "no committed step", which would let a
  // resume start afresh over it: the read's error, naming the file.
  ASSERT_EQ(mkdir((dirs[1] + "/COMMIT").c_str(), 0700), 0);
  kept = ReadKeptCommits(dirs);
  EXPECT_FALSE(kept.ok());
  EXPECT_EQ(kept.status().message().find("no committed step"),
            std::string::npos)
      << kept.status();
  EXPECT_NE(kept.status().message().find(dirs[1] + "/COMMIT"),
            std::string::npos)
      << kept.status();
}

TEST(EngineTest, SlotsRewrittenAfterACommitAreNeverResumedSilently) {
  Model model({1000, 2000, 3000, 1500}, 23);
  Snapshot at2, at4;
  // Step 5 ran after the commit of step 4 and rewrote the slots of step 2.
  EngineConfig cfg =
      CommittedEveryTwo("rewritten", model, &at2, &at4, /*last=*/5);
  cfg.resume = true;
  cfg.resume_step = 2;
  auto engine = Engine::Create(cfg);
  ASSERT_TRUE(engine.ok()) << engine.status();
  ExpectNoRecordResumes(**engine, "holds step 5, expected step 2");
}

TEST(EngineTest, CorruptRecordIsAnErrorNamingFileAndSubgroup) {
  EngineConfig cfg = SmallConfig(1);
  cfg.host_budget_bytes =
      2 * (4096 + AlignedRecordBytes(3000, 3));  // nothing cached
  auto engine = Engine::Create(cfg);
  ASSERT_TRUE(engine.ok());
  Engine& e = Initialized(*engine, cfg, 1);
  // Flip one payload byte of subgroup 2 in whichever slot holds it.
  std::string path = cfg.tiers[0].path + "/mlp_offload_run/sg_2.state";
  FILE* f = fopen(path.c_str(), "r+b");
  ASSERT_NE(f, nullptr);
  fseek(f, 4096 + 100, SEEK_SET);
  int ch = fgetc(f);
  fseek(f, 4096 + 100, SEEK_SET);
  fputc(ch ^ 0x40, f);
  fclose(f);
  std::vector<float> p(3000), m(3000), v(3000);
  absl::Status s = e.ReadSubgroup(2, p.data(), {m.data(), v.data()}, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(s.message().find("sg_2.state"), std::string::npos) << s;
  EXPECT_NE(s.message().find("subgroup 2"), std::string::npos) << s;
}

// Every subgroup's master and state as the engine has them now.
std::vector<std::vector<float>> Snapshot(Engine& e, const EngineConfig& cfg) {
  std::vector<std::vector<float>> out;
  for (size_t i = 0; i < cfg.subgroup_numel.size(); ++i) {
    const size_t n = cfg.subgroup_numel[i];
    std::vector<float> all(3 * n);
    EXPECT_TRUE(e.ReadSubgroup(static_cast<int>(i), all.data(),
                               {all.data() + n, all.data() + 2 * n}, nullptr)
                    .ok());
    out.push_back(std::move(all));
  }
  return out;
}

// A checkpoint record that fails its check is read into the cached record of
// its subgroup, which may hold that subgroup's latest version only (cache
// reuse, no commits): the version goes to its tier first, so nothing is
// lost. Damaging record k fails the load there: the subgroups before it hold
// the checkpoint, the others the state before the load, every one readable,
// and the engine steps on.
TEST(EngineTest, AFailedLoadOverCachedRecordsLosesNoVersion) {
  for (int k = 0; k < 4; ++k) {
    SCOPED_TRACE(absl::StrCat("record ", k, " damaged"));
    EngineConfig cfg = SmallConfig(2);
    cfg.host_budget_bytes = 8 * (4096 + AlignedRecordBytes(3000, 3));
    Model model(cfg.subgroup_numel, 30 + k);
    auto engine = Engine::Create(cfg);
    ASSERT_TRUE(engine.ok()) << engine.status();
    Engine& e = **engine;
    ASSERT_NO_FATAL_FAILURE(InitializeFrom(e, model));
    ASSERT_GT(e.plan().num_cached, 2);
    std::vector<SubgroupStepInput> in = AdamWInputs(model);
    model.NewGrads(1);
    ASSERT_TRUE(e.Step(in, StepOptions()).ok());
    const std::string dir = TempDir(absl::StrCat("cached_load", k)) + "/c";
    ASSERT_TRUE(e.SaveCheckpoint(dir).ok());
    const auto saved = Snapshot(e, cfg);
    model.NewGrads(2);
    ASSERT_TRUE(e.Step(in, StepOptions()).ok());
    const auto live = Snapshot(e, cfg);
    // One payload byte of record k flipped.
    const std::string record = absl::StrCat(dir, "/sg_", k, ".ckpt");
    const int fd = open(record.c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    char byte = 0;
    ASSERT_EQ(pread(fd, &byte, 1, 4096 + 100), 1);
    byte = static_cast<char>(byte ^ 0xff);
    ASSERT_EQ(pwrite(fd, &byte, 1, 4096 + 100), 1);
    close(fd);
    absl::Status s = e.LoadCheckpoint(dir);
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
    EXPECT_NE(s.message().find(record), std::string::npos) << s;
    const auto after = Snapshot(e, cfg);
    for (int i = 0; i < 4; ++i) {
      EXPECT_EQ(after[i], i < k ? saved[i] : live[i]) << "subgroup " << i;
    }
    model.NewGrads(3);
    absl::StatusOr<StepStats> next = e.Step(in, StepOptions());
    EXPECT_TRUE(next.ok()) << next.status();
  }
}

// Checkpoints streamed through `buffers` streaming buffers and no cache: a
// save reads records ahead from the tiers (one per tier in flight) while
// writing the current one; a load writes each record to its tier while
// reading the next. A fault anywhere fails the call naming the record, and
// the next call (the fault cleared) works: no buffer is left claimed.
void StreamCheckpointsThroughFaults(int tiers, int buffers) {
  EngineConfig cfg = SmallConfig(tiers);
  cfg.fault_injection = true;
  cfg.host_budget_bytes = buffers * (4096 + AlignedRecordBytes(3000, 3));
  auto engine = Engine::Create(cfg);
  ASSERT_TRUE(engine.ok()) << engine.status();
  Engine& e = Initialized(*engine, cfg, 51);
  ASSERT_EQ(e.plan().num_cached, 0);
  const auto want = Snapshot(e, cfg);
  const std::string dir =
      TempDir(absl::StrCat("stream", tiers, buffers)) + "/c";
  const int t = tiers - 1;
  std::vector<int> on_t;
  for (int i = 0; i < 4; ++i) {
    if (e.plan().tier_of_subgroup[i] == t) on_t.push_back(i);
  }
  ASSERT_GE(on_t.size(), 2u);
  // An EIO on the tier's first record, then on its second: `call` fails
  // naming that record's file.
  auto fails_on_each = [&](IoOp op, const std::function<absl::Status()>& call) {
    for (int nth : {0, 1}) {
      FaultSpec fault;
      fault.op = op;
      fault.nth = nth;
      e.fault_injector(t)->AddFault(fault);
      absl::Status s = call();
      EXPECT_NE(s.message().find(absl::StrCat("sg_", on_t[nth], ".state")),
                std::string::npos)
          << nth << ": " << s;
      EXPECT_NE(s.message().find("Input/output error"), std::string::npos) << s;
      e.fault_injector(t)->ClearFaults();
    }
  };
  fails_on_each(IoOp::kRead, [&] { return e.SaveCheckpoint(dir); });
  ASSERT_TRUE(e.SaveCheckpoint(dir).ok());
  // The master copies stream the same way (ReadSubgroups, null arrays): a
  // subgroup left out is not touched.
  std::vector<std::vector<float>> masters(4);
  auto read_masters = [&](int skip) {
    std::vector<Engine::SubgroupState> records;
    for (int i = 0; i < 4; ++i) {
      masters[i].assign(cfg.subgroup_numel[i], -1.0f);
      if (i == skip) continue;
      Engine::SubgroupState r;
      r.subgroup = i;
      r.master = masters[i].data();
      r.state = {nullptr, nullptr};
      records.push_back(std::move(r));
    }
    return e.ReadSubgroups(&records);
  };
  fails_on_each(IoOp::kRead, [&] { return read_masters(-1); });
  for (int skip : {-1, 1}) {
    ASSERT_TRUE(read_masters(skip).ok());
    for (int i = 0; i < 4; ++i) {
      const size_t n = cfg.subgroup_numel[i];
      EXPECT_EQ(masters[i], i == skip ? std::vector<float>(n, -1.0f)
                                      : std::vector<float>(want[i].begin(),
                                                           want[i].begin() + n))
          << "subgroup " << i << ", skipping " << skip;
    }
  }
  for (int i = 0; i < 4; ++i) {
    const size_t n = cfg.subgroup_numel[i];
    std::vector<float> got(3 * n);
    ASSERT_TRUE(ReadCheckpointRecord(dir, i, n, got.data(),
                                     {got.data() + n, got.data() + 2 * n},
                                     /*verify=*/true, nullptr)
                    .ok());
    EXPECT_EQ(got, want[i]) << "subgroup " << i;
  }

  Initialized(*engine, cfg, 52);  // other values, then the checkpoint's
  fails_on_each(IoOp::kWrite, [&] { return e.LoadCheckpoint(dir); });
  ASSERT_TRUE(e.LoadCheckpoint(dir).ok());
  EXPECT_EQ(Snapshot(e, cfg), want);
}

TEST(EngineTest, CheckpointsStreamThroughFewBuffersAndSurviveFaults) {
  StreamCheckpointsThroughFaults(/*tiers=*/1, /*buffers=*/2);
  StreamCheckpointsThroughFaults(/*tiers=*/2, /*buffers=*/2);
  StreamCheckpointsThroughFaults(/*tiers=*/2, /*buffers=*/3);
}

// ReadSubgroups, WriteSubgroups and InitializeSubgroups keep every tier
// busy: with tier 0's first request held back (for far longer than the call
// takes otherwise), tier 1's first request is made meanwhile; one subgroup
// after another, it would wait for tier 0's. A batch whose write fails on
// one tier names that subgroup: the others are written, it keeps the record
// it had, and the next call works (no buffer is left claimed). Bad
// arguments change nothing.
TEST(EngineTest, BatchedStateAccessKeepsEveryTierBusy) {
  EngineConfig cfg = SmallConfig(2);
  cfg.fault_injection = true;
  cfg.techniques.cache_reuse = false;
  auto engine = Engine::Create(cfg);
  ASSERT_TRUE(engine.ok()) << engine.status();
  Engine& e = Initialized(*engine, cfg, 61);
  ASSERT_EQ(e.plan().num_cached, 0);
  std::vector<int> on_tier[2];
  for (int i = 0; i < 4; ++i)
    on_tier[e.plan().tier_of_subgroup[i]].push_back(i);
  ASSERT_FALSE(on_tier[0].empty());
  ASSERT_FALSE(on_tier[1].empty());

  // A state for every subgroup: master, two arrays, and a step count.
  struct State {
    std::vector<std::vector<float>> master, m, v;
    std::vector<Engine::SubgroupState> records;
  };
  auto make_state = [&](uint32_t seed, int64_t step) {
    State st;
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-1, 1);
    for (int i = 0; i < 4; ++i) {
      const size_t n = cfg.subgroup_numel[i];
      for (auto* a : {&st.master, &st.m, &st.v}) {
        a->emplace_back(n);
        for (float& x : a->back()) x = u(rng);
      }
    }
    for (int i = 0; i < 4; ++i) {
      Engine::SubgroupState r;
      r.subgroup = i;
      r.master = st.master[i].data();
      r.state = {st.m[i].data(), st.v[i].data()};
      r.step = step + i;
      st.records.push_back(std::move(r));
    }
    return st;
  };
  // Subgroup i of a state as Snapshot gives it.
  auto flat = [&](const State& st, int i) {
    std::vector<float> all = st.master[i];
    all.insert(all.end(), st.m[i].begin(), st.m[i].end());
    all.insert(all.end(), st.v[i].begin(), st.v[i].end());
    return all;
  };
  auto steps_of = [&] {
    std::vector<int64_t> steps;
    for (int i = 0; i < 4; ++i) {
      int64_t step = -1;
      float* none = nullptr;
      EXPECT_TRUE(e.ReadSubgroup(i, none, {none, none}, &step).ok());
      steps.push_back(step);
    }
    return steps;
  };

  // `call` with tier 0's first request of `op` held back kHold: how long
  // after the start tier 1 saw its first.
  const absl::Duration kHold = absl::Seconds(2);
  auto tier1_waited = [&](IoOp op, const std::function<absl::Status()>& call) {
    FaultSpec hold;
    hold.kind = FaultSpec::Kind::kDelay;
    hold.op = op;
    hold.delay = kHold;
    e.fault_injector(0)->AddFault(hold);
    FaultSpec count = hold;  // counts tier 1's first request, delays nothing
    count.delay = absl::ZeroDuration();
    e.fault_injector(1)->AddFault(count);
    const int before = e.fault_injector(1)->fired();
    const MonoTime start = MonoNow();
    std::future<absl::Status> done = std::async(std::launch::async, call);
    while (e.fault_injector(1)->fired() == before &&
           done.wait_for(std::chrono::milliseconds(1)) !=
               std::future_status::ready) {
    }
    const double seen = SecondsSince(start);
    const absl::Status s = done.get();
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_EQ(e.fault_injector(1)->fired(), before + 1);
    e.fault_injector(0)->ClearFaults();
    e.fault_injector(1)->ClearFaults();
    return seen;
  };

  State written = make_state(62, 5);
  const double held = absl::ToDoubleSeconds(kHold);
  EXPECT_LT(tier1_waited(IoOp::kWrite,
                         [&] { return e.WriteSubgroups(written.records); }),
            held / 2)
      << "tier 1's write waited for tier 0's";
  State read = make_state(63, 0);
  EXPECT_LT(
      tier1_waited(IoOp::kRead, [&] { return e.ReadSubgroups(&read.records); }),
      held / 2)
      << "tier 1's read waited for tier 0's";
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(flat(read, i), flat(written, i)) << "subgroup " << i;
    EXPECT_EQ(read.records[i].step, 5 + i);
  }
  EXPECT_EQ(steps_of(), (std::vector<int64_t>{5, 6, 7, 8}));

  // A write that fails on tier 1: its first subgroup keeps its record.
  const int j = on_tier[1][0];
  FaultSpec eio;
  eio.op = IoOp::kWrite;
  eio.path_substring = absl::StrCat("sg_", j, ".state");
  e.fault_injector(1)->AddFault(eio);
  State next = make_state(64, 20);
  absl::Status s = e.WriteSubgroups(next.records);
  e.fault_injector(1)->ClearFaults();
  EXPECT_NE(s.message().find(absl::StrCat("writing subgroup ", j)),
            std::string::npos)
      << s;
  EXPECT_NE(s.message().find("Input/output error"), std::string::npos) << s;
  auto now = Snapshot(e, cfg);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(now[i], flat(i == j ? written : next, i)) << "subgroup " << i;
  }
  std::vector<int64_t> want = {20, 21, 22, 23};
  want[j] = 5 + j;
  EXPECT_EQ(steps_of(), want);
  ASSERT_TRUE(e.WriteSubgroups(next.records).ok());
  now = Snapshot(e, cfg);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(now[i], flat(next, i)) << i;

  // Bad arguments: refused before anything is written.
  State bad = make_state(65, 30);
  auto refused = [&](std::vector<Engine::SubgroupState> records,
                     absl::StatusCode code, const std::string& says) {
    absl::Status w = e.WriteSubgroups(records);
    EXPECT_EQ(w.code(), code) << w;
    EXPECT_NE(w.message().find(says), std::string::npos) << w;
    EXPECT_EQ(Snapshot(e, cfg), now);
    absl::Status r = e.ReadSubgroups(&records);
    EXPECT_EQ(r.code(), code) << r;
  };
  auto twice = bad.records;
  twice[2].subgroup = 1;
  refused(twice, absl::StatusCode::kInvalidArgument, "subgroup 1 given twice");
  auto out_of_range = bad.records;
  out_of_range[3].subgroup = 4;
  refused(out_of_range, absl::StatusCode::kOutOfRange, "no subgroup 4");
  auto arrays = bad.records;
  arrays[3].state.pop_back();
  refused(arrays, absl::StatusCode::kInvalidArgument, "1 state arrays given");
  auto no_master = bad.records;
  no_master[3].master = nullptr;
  EXPECT_EQ(e.WriteSubgroups(no_master).code(),
            absl::StatusCode::kInvalidArgument);
  auto negative = bad.records;
  negative[3].step = -1;
  EXPECT_EQ(e.WriteSubgroups(negative).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Snapshot(e, cfg), now);

  // InitializeSubgroups takes the same turns.
  std::vector<Engine::SubgroupInit> inits;
  for (int i = 0; i < 4; ++i) inits.push_back({i, bad.master[i].data()});
  auto init_refused = [&](std::vector<Engine::SubgroupInit> these,
                          absl::StatusCode code) {
    EXPECT_EQ(e.InitializeSubgroups(these, DType::kFloat32).code(), code);
    EXPECT_EQ(Snapshot(e, cfg), now);
  };
  auto init_twice = inits;
  init_twice[0].subgroup = 3;
  init_refused(init_twice, absl::StatusCode::kInvalidArgument);
  auto init_null = inits;
  init_null[2].params = nullptr;
  init_refused(init_null, absl::StatusCode::kInvalidArgument);
  auto init_out = inits;
  init_out[1].subgroup = -1;
  init_refused(init_out, absl::StatusCode::kOutOfRange);
  EXPECT_LT(tier1_waited(
                IoOp::kWrite,
                [&] { return e.InitializeSubgroups(inits, DType::kFloat32); }),
            held / 2)
      << "tier 1's initialisation waited for tier 0's";
  now = Snapshot(e, cfg);
  for (int i = 0; i < 4; ++i) {
    const size_t n = cfg.subgroup_numel[i];
    std::vector<float> want = bad.master[i];
    want.resize(3 * n, 0.0f);
    EXPECT_EQ(now[i], want) << "subgroup " << i;
  }
  EXPECT_EQ(steps_of(), std::vector<int64_t>(4, 0));

  // Interrupted (Ctrl-C), no further record is written or read.
  e.SetInterrupted(true);
  EXPECT_EQ(e.WriteSubgroups(next.records).code(),
            absl::StatusCode::kCancelled);
  EXPECT_EQ(e.ReadSubgroups(&read.records).code(),
            absl::StatusCode::kCancelled);
  e.SetInterrupted(false);
  EXPECT_EQ(Snapshot(e, cfg), now);
}

// Interrupted while its first writes are in flight, a batch starts no
// further write: the subgroups it wrote hold their new records, the others
// their old ones, and the next call writes them all.
TEST(EngineTest, AnInterruptedBatchStopsAtItsNextRecordAndLosesNone) {
  EngineConfig cfg = SmallConfig(2);
  cfg.fault_injection = true;
  cfg.techniques.cache_reuse = false;
  cfg.host_budget_bytes = 2 * (4096 + AlignedRecordBytes(3000, 3));
  auto engine = Engine::Create(cfg);
  ASSERT_TRUE(engine.ok()) << engine.status();
  Engine& e = Initialized(*engine, cfg, 71);
  ASSERT_EQ(e.plan().num_cached, 0);
  const auto before = Snapshot(e, cfg);
  std::vector<std::vector<float>> values(4);
  std::vector<Engine::SubgroupState> records(4);
  for (int i = 0; i < 4; ++i) {
    const size_t n = cfg.subgroup_numel[i];
    values[i].assign(3 * n, 0.5f + i);
    records[i].subgroup = i;
    records[i].master = values[i].data();
    records[i].state = {values[i].data() + n, values[i].data() + 2 * n};
    records[i].step = 9;
  }
  // Each tier's first write is held back while the interrupt comes (both:
  // with one held, the other tier's buffer came free and, on a loaded
  // machine, the batch started a third write before the interrupt).
  FaultSpec hold;
  hold.kind = FaultSpec::Kind::kDelay;
  hold.op = IoOp::kWrite;
  hold.delay = absl::Milliseconds(1000);
  for (int t = 0; t < 2; ++t) e.fault_injector(t)->AddFault(hold);
  std::future<absl::Status> done =
      std::async(std::launch::async, [&] { return e.WriteSubgroups(records); });
  const MonoTime start = MonoNow();
  while (e.fault_injector(0)->fired() == 0 ||
         e.fault_injector(1)->fired() == 0) {
    // (Both tiers take a write at once: the batch takes the tiers in turn.)
    ASSERT_LT(SecondsSince(start), 10.0) << "a tier's first write never came";
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  e.SetInterrupted(true);
  const absl::Status s = done.get();
  e.SetInterrupted(false);
  for (int t = 0; t < 2; ++t) e.fault_injector(t)->ClearFaults();
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << s;
  // Two buffers: the first record of each tier was written, no other.
  std::set<int> first_of_tier;
  for (int t = 0; t < 2; ++t) {
    for (int i = 0; i < 4; ++i) {
      if (e.plan().tier_of_subgroup[i] == t) {
        first_of_tier.insert(i);
        break;
      }
    }
  }
  const auto now = Snapshot(e, cfg);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(now[i], first_of_tier.count(i) ? values[i] : before[i])
        << "subgroup " << i;
  }
  ASSERT_TRUE(e.WriteSubgroups(records).ok());
  const auto after = Snapshot(e, cfg);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(after[i], values[i]) << i;
}

TEST(EngineTest, ACheckpointLoadedAfterAFailedStepReplacesIt) {
  // The step fails when its writes drain (every subgroup already updated);
  // loading the checkpoint taken before it abandons it, so the next step
  // updates every subgroup, as on an engine that only loaded the checkpoint.
  EngineConfig cfg = SmallConfig(2);
  cfg.fault_injection = true;
  cfg.host_budget_bytes = 3 * (4096 + AlignedRecordBytes(3000, 3));
  Model model(cfg.subgroup_numel, 5);
  auto engine = Engine::Create(cfg);
  ASSERT_TRUE(engine.ok());
  Engine& e = **engine;
  ASSERT_NO_FATAL_FAILURE(InitializeFrom(e, model));
  const std::string dir = TempDir("superseded") + "/c";
  ASSERT_TRUE(e.SaveCheckpoint(dir).ok());
  model.NewGrads(1);
  std::vector<SubgroupStepInput> in = AdamWInputs(model);
  FaultSpec fault;
  fault.op = IoOp::kWrite;
  fault.nth = -1;
  e.fault_injector(1)->AddFault(fault);
  ASSERT_FALSE(e.Step(in, StepOptions()).ok());
  e.fault_injector(1)->ClearFaults();
  ASSERT_TRUE(e.step_incomplete());
  ASSERT_TRUE(e.LoadCheckpoint(dir).ok());
  EXPECT_FALSE(e.step_incomplete());
  ASSERT_TRUE(e.Step(in, StepOptions()).ok());

  EngineConfig cfg2 = SmallConfig(2);
  auto fresh = Engine::Create(cfg2);
  ASSERT_TRUE(fresh.ok());
  Initialized(*fresh, cfg2, 77);
  ASSERT_TRUE((*fresh)->LoadCheckpoint(dir).ok());
  ASSERT_TRUE((*fresh)->Step(in, StepOptions()).ok());
  EXPECT_EQ(Snapshot(e, cfg), Snapshot(**fresh, cfg2));
  EXPECT_EQ(e.step(), 1);
}

class WriteFaultTest : public ::testing::TestWithParam<bool> {};

// With and without the tier lock. Without it requests go straight to the
// tier's I/O engine, and the fault injector (like an engine that finds an
// error before any I/O) completes them inside Submit, where the engine holds
// its mutex: the channel must hand such completions to another thread.
TEST_P(WriteFaultTest, FailsTheStepAndARetryFinishesIt) {
  EngineConfig cfg = SmallConfig(2);
  cfg.techniques.tier_lock = GetParam();
  cfg.fault_injection = true;
  cfg.host_budget_bytes = 3 * (4096 + AlignedRecordBytes(3000, 3));
  Model model(cfg.subgroup_numel, 2);
  auto engine = Engine::Create(cfg);
  ASSERT_TRUE(engine.ok());
  Engine& e = **engine;
  ASSERT_NO_FATAL_FAILURE(InitializeFrom(e, model));
  const Reference ref = ReferenceOfStep1(model);
  std::vector<SubgroupStepInput> in = AdamWInputs(model);
  FaultSpec fault;
  fault.kind = FaultSpec::Kind::kError;
  fault.op = IoOp::kWrite;
  fault.error = 28;  // ENOSPC
  fault.nth = 0;
  e.fault_injector(1)->AddFault(fault);
  auto stats = e.Step(in, StepOptions());
  ASSERT_FALSE(stats.ok());
  EXPECT_EQ(stats.status().code(), absl::StatusCode::kResourceExhausted)
      << stats.status();
  e.fault_injector(1)->ClearFaults();
  stats = e.Step(in, StepOptions());  // the fault is gone: finish the step
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(e.step(), 1);
  ExpectMatchesReference(e, ref, 1);
}

INSTANTIATE_TEST_SUITE_P(TierLock, WriteFaultTest, ::testing::Bool());

// SetInterrupted from another thread stops a step under a tiny bandwidth cap
// at once (not when the cap has let the rest through): Cancelled, the step
// left incomplete; after SetInterrupted(false) a retry finishes it with the
// uninterrupted result.
// A generic step abandoned after its first record (the caller's update
// raised, or Ctrl-C in it) does not wait for the reads ahead that a tiny cap
// holds back: AbortStep drops them.
TEST(EngineTest, AbortStepDoesNotWaitForWhatTheCapHoldsBack) {
  EngineConfig cfg = SmallConfig(1);
  cfg.techniques.cache_reuse = false;
  cfg.tiers[0].throttle_read_bytes_per_sec = 20e3;  // about 1 s a record
  Model model(cfg.subgroup_numel, 12);
  std::unique_ptr<Engine> engine = CreateFrom(cfg, model);
  ASSERT_NE(engine, nullptr);
  Engine& e = *engine;
  EXPECT_TRUE(e.NextIsReady());  // no step: Next returns at once
  ASSERT_TRUE(e.BeginStep().ok());
  absl::StatusOr<SubgroupView> first = e.Next();
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(e.Done(/*updated=*/false).ok());
  EXPECT_FALSE(e.NextIsReady());  // the next record is a second away
  const MonoTime start = MonoNow();
  e.AbortStep();
  // The reads ahead had seconds to go.
  EXPECT_LT(SecondsSince(start), 0.5);
  EXPECT_TRUE(e.step_incomplete());
}

// SetInterrupted ends a wait for the tier lock (held by another process that
// makes no progress) at once, not at tier_lock_timeout.
TEST(EngineTest, AnInterruptedStepDoesNotWaitForTheTierLock) {
  HeldTierLock h;
  ASSERT_NO_FATAL_FAILURE(HoldTheTierLock(absl::Seconds(30), &h));
  Engine& e = *h.engine;
  std::thread interrupter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    e.SetInterrupted(true);
  });
  const MonoTime start = MonoNow();
  absl::Status s = StepByHand(e);
  const double waited = SecondsSince(start);
  interrupter.join();
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << s;
  EXPECT_LT(waited, 5.0);
  RetryOnceTheLockIsFree(h);
}

TEST(EngineTest, AnInterruptedStepStopsSoonAndARetryFinishesIt) {
  EngineConfig cfg = SmallConfig(2);
  cfg.techniques.cache_reuse = false;  // every record streams each step
  for (TierSpec& spec : cfg.tiers) {
    spec.throttle_read_bytes_per_sec = spec.throttle_write_bytes_per_sec = 40e3;
  }
  Model model(cfg.subgroup_numel, 6);
  std::unique_ptr<Engine> engine = CreateFrom(cfg, model);
  ASSERT_NE(engine, nullptr);
  Engine& e = *engine;
  const Reference ref = ReferenceOfStep1(model);
  std::vector<SubgroupStepInput> in = AdamWInputs(model);

  std::promise<MonoTime> interrupted_at;
  std::thread interrupter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
    interrupted_at.set_value(MonoNow());
    e.SetInterrupted(true);
  });
  const MonoTime start = MonoNow();
  absl::StatusOr<StepStats> stats = e.Step(in, StepOptions());
  const MonoTime returned = MonoNow();
  interrupter.join();
  const MonoTime at = interrupted_at.get_future().get();
  ASSERT_FALSE(stats.ok())
      << "the step finished in "
      << std::chrono::duration<double>(returned - start).count()
      << " s, before the interruption";
  EXPECT_EQ(stats.status().code(), absl::StatusCode::kCancelled)
      << stats.status();
  // About 1 s of capped I/O per tier was left.
  EXPECT_LT(std::chrono::duration<double>(returned - at).count(), 0.5);
  EXPECT_TRUE(e.step_incomplete());
  EXPECT_EQ(e.step(), 0);
  // Still interrupted: refused again, nothing changed.
  EXPECT_EQ(e.Step(in, StepOptions()).status().code(),
            absl::StatusCode::kCancelled);

  e.SetInterrupted(false);
  stats = e.Step(in, StepOptions());
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_FALSE(e.step_incomplete());
  EXPECT_EQ(e.step(), 1);
  ExpectMatchesReference(e, ref, 1, /*moments=*/true);
}

TEST(EngineTest, NonFiniteGradientSkipsTheWholeStep) {
  EngineConfig cfg = SmallConfig(1);
  Model model(cfg.subgroup_numel, 4);
  auto engine = Engine::Create(cfg);
  ASSERT_TRUE(engine.ok());
  Engine& e = **engine;
  ASSERT_NO_FATAL_FAILURE(InitializeFrom(e, model));
  model.NewGrads(3);
  model.grads[3][17] = 0x7FC0;  // bf16 NaN in the last subgroup
  std::vector<SubgroupStepInput> in = AdamWInputs(model);
  StepOptions opts;
  opts.skip_if_nonfinite = true;
  auto stats = e.Step(in, opts);
  ASSERT_TRUE(stats.ok());
  EXPECT_TRUE(stats->skipped);
  EXPECT_EQ(e.step(), 0);
  std::vector<float> master(1000), m(1000), v(1000);
  int64_t step = -1;
  ASSERT_TRUE(
      e.ReadSubgroup(0, master.data(), {m.data(), v.data()}, &step).ok());
  EXPECT_EQ(step, 0);
  EXPECT_EQ(master, model.init[0]);
}

TEST(EngineTest, GradientCheckAloneAndSkipStepTouchNothing) {
  // What sharded runs use: the check first (the ranks agree on it), then
  // SkipStep on every rank if one found a NaN, else Step (with the engine
  // and gradients of NonFiniteGradientSkipsTheWholeStep).
  EngineConfig cfg = SmallConfig(1);
  Model model(cfg.subgroup_numel, 4);
  absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(cfg);
  ASSERT_TRUE(engine.ok()) << engine.status();
  Engine& e = **engine;
  ASSERT_NO_FATAL_FAILURE(InitializeFrom(e, model));
  model.NewGrads(3);
  const std::vector<SubgroupStepInput> in = AdamWInputs(model);
  auto bad = e.GradientsNonfinite(in, 1.0f);
  ASSERT_TRUE(bad.ok()) << bad.status();
  EXPECT_FALSE(*bad);
  model.grads[2][5] = 0xFF80;  // bf16 -Inf
  bad = e.GradientsNonfinite(in, 1.0f);
  ASSERT_TRUE(bad.ok()) << bad.status();
  EXPECT_TRUE(*bad);
  std::vector<SubgroupStepInput> short_inputs(in.begin(), in.end() - 1);
  EXPECT_EQ(e.GradientsNonfinite(short_inputs, 1.0f).status().code(),
            absl::StatusCode::kInvalidArgument);
  StepStats skipped = e.SkipStep();
  EXPECT_TRUE(skipped.skipped);
  EXPECT_EQ(skipped.step, 0);
  EXPECT_EQ(e.step(), 0);
  const uint64_t n2 = cfg.subgroup_numel[2];
  std::vector<float> master(n2), m(n2), v(n2);
  int64_t step = -1;
  ASSERT_TRUE(
      e.ReadSubgroup(2, master.data(), {m.data(), v.data()}, &step).ok());
  EXPECT_EQ(step, 0);
  EXPECT_EQ(master, model.init[2]);
  model.grads[2][5] = 0;  // the next step updates as usual
  auto stats = e.Step(in, StepOptions());
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_FALSE(stats->skipped);
  EXPECT_EQ(e.step(), 1);
}

TEST(EngineTest, SkippedSubgroupsAreStreamedButNotUpdated) {
  EngineConfig cfg = SmallConfig(2);
  cfg.num_state_arrays = 3;  // room for amsgrad; plain AdamW uses two
  Model model(cfg.subgroup_numel, 8);
  std::unique_ptr<Engine> engine = CreateFrom(cfg, model);
  ASSERT_NE(engine, nullptr);
  Engine& e = *engine;
  for (int step = 1; step <= 2; ++step) {
    model.NewGrads(step);
    std::vector<SubgroupStepInput> in = AdamWInputs(model);
    in[1].hp.amsgrad = true;  // three arrays
    in[2].skip = true;        // a frozen subgroup
    in[2].segments.clear();
    auto stats = e.Step(in, StepOptions());
    ASSERT_TRUE(stats.ok()) << stats.status();
  }
  std::vector<float> p(3000), a(3000), b(3000), c(3000);
  int64_t step = -1;
  ASSERT_TRUE(
      e.ReadSubgroup(2, p.data(), {a.data(), b.data(), c.data()}, &step).ok());
  EXPECT_EQ(step, 0);
  EXPECT_EQ(p, model.init[2]);
  ASSERT_TRUE(
      e.ReadSubgroup(1, p.data(), {a.data(), b.data(), c.data()}, &step).ok());
  EXPECT_EQ(step, 2);
  EXPECT_NE(p, model.init[1]);
  // amsgrad's max_exp_avg_sq >= exp_avg_sq everywhere.
  for (size_t k = 0; k < 2000; ++k) ASSERT_GE(c[k], b[k]);
  // Too many arrays for the engine is refused up front.
  std::vector<SubgroupStepInput> in(4);
  for (int i = 0; i < 4; ++i) {
    in[i].hp.kind = OptimizerKind::kSGD;
    in[i].hp.momentum = 0.9f;
    in[i].segments = model.Segments(i);
  }
  EngineConfig small = SmallConfig(1);
  small.num_state_arrays = 0;
  auto e0 = Engine::Create(small);
  ASSERT_TRUE(e0.ok());
  auto r = (*e0)->Step(in, StepOptions());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
}

// Runs `body` on another thread and fails if it has not returned within
// `limit`. An engine that hangs cannot be shut down, so this ends the test
// process (with a message) instead of letting the suite hang.
void FinishesWithin(absl::Duration limit, const std::string& what,
                    const std::function<void()>& body) {
  std::promise<void> finished;
  std::future<void> done = finished.get_future();
  std::thread runner([&] {
    body();
    finished.set_value();
  });
  if (done.wait_for(absl::ToChronoSeconds(limit)) !=
      std::future_status::ready) {
    std::fprintf(stderr, "FAILED: %s did not finish within %s (a hang)\n",
                 what.c_str(), absl::FormatDuration(limit).c_str());
    std::fflush(stderr);
    std::_Exit(1);
  }
  runner.join();
}

// One tier, `n` subgroups of 1024 parameters (AdamW), every technique but
// the tier lock, and a host budget of six buffers: three cached records and
// three streaming buffers. `eager`: the baseline's gradient conversion
// (delayed_grad_conversion off).
EngineConfig SixBuffers(int n, bool eager) {
  EngineConfig cfg;
  TierSpec spec;
  spec.path = TempDir("six");
  cfg.tiers.push_back(spec);
  cfg.subgroup_numel.assign(n, 1024);
  cfg.num_state_arrays = 2;
  cfg.techniques.tier_lock = false;
  cfg.techniques.delayed_grad_conversion = !eager;
  cfg.host_budget_bytes = 6 * (4096 + AlignedRecordBytes(1024, 3) +
                               (eager ? AlignedRecordBytes(1024, 1) : 0));
  cfg.tier_lock_dir = TempDir("locks");
  return cfg;
}

// BeginStep's skip flags: a subgroup without a gradient stays on its tier,
// neither read nor written, unless resident (then it goes through the step
// untouched); a step that fails forgets which it left there.
TEST(EngineTest, SkippedSubgroupsStayOnTheirTierUnlessResident) {
  const int n = 10;
  EngineConfig cfg = SixBuffers(n, /*eager=*/false);
  auto engine = Engine::Create(cfg);
  ASSERT_TRUE(engine.ok()) << engine.status();
  Engine& e = Initialized(*engine, cfg, 5);
  ASSERT_EQ(e.plan().num_cached, 3);
  std::vector<std::vector<float>> before(n, std::vector<float>(1024));
  std::vector<float> s0(1024), s1(1024);
  for (int i = 0; i < n; ++i) {
    ASSERT_TRUE(
        e.ReadSubgroup(i, before[i].data(), {s0.data(), s1.data()}, nullptr)
            .ok());
  }
  std::vector<bool> skip(n, false);
  skip[0] = skip[4] = skip[9] = true;
  EXPECT_EQ(e.BeginStep(std::vector<bool>(3, true)).code(),
            absl::StatusCode::kInvalidArgument);
  const uint64_t record = 4096 + AlignedRecordBytes(1024, 3);
  // One step of the generic path: returns the subgroups it handed out.
  auto run_step = [&](const std::vector<bool>& flags, StepStats* stats) {
    std::vector<int> seen;
    EXPECT_TRUE(e.BeginStep(flags).ok());
    for (;;) {
      auto v = e.Next();
      EXPECT_TRUE(v.ok()) << v.status();
      if (!v.ok() || v->subgroup < 0) break;
      seen.push_back(v->subgroup);
      const bool skipped = !flags.empty() && flags[v->subgroup];
      if (!skipped) {
        for (uint64_t k = 0; k < v->numel; ++k) v->master[k] -= 1.0f;
      }
      EXPECT_TRUE(e.Done(/*updated=*/!skipped).ok());
    }
    auto end = e.EndStep();
    EXPECT_TRUE(end.ok()) << end.status();
    if (end.ok()) *stats = *end;
    return seen;
  };
  for (int step = 0; step < 4; ++step) {
    StepStats stats;
    const std::vector<int> seen = run_step(skip, &stats);
    // Each record was handed out or left; the ones handed out were cached
    // or read, the left ones not read.
    EXPECT_EQ(static_cast<int>(seen.size()) + stats.subgroups_left_on_tier, n);
    EXPECT_EQ(stats.bytes_read[0], (seen.size() - stats.cache_hits) * record)
        << "step " << step;
    int skipped_seen = 0;
    for (int i : seen) skipped_seen += skip[i];
    EXPECT_EQ(skipped_seen + stats.subgroups_left_on_tier, 3);
    // After the first step the initial records are gone from the buffers:
    // the skipped records outside the cache stay on the tier.
    if (step > 0) {
      EXPECT_GE(stats.subgroups_left_on_tier, 1) << "step " << step;
    }
  }
  for (int i = 0; i < n; ++i) {
    std::vector<float> master(1024);
    int64_t count = -1;
    ASSERT_TRUE(
        e.ReadSubgroup(i, master.data(), {s0.data(), s1.data()}, &count).ok());
    EXPECT_EQ(count, skip[i] ? 0 : 4) << "subgroup " << i;
    for (size_t k = 0; k < master.size(); ++k) {
      float want = before[i][k];
      for (int step = 0; step < (skip[i] ? 0 : 4); ++step) want -= 1.0f;
      ASSERT_EQ(master[k], want);
    }
  }
  // A step that fails at its end (the caller's code threw) and is retried
  // with gradients everywhere updates the subgroups it did not: those it
  // left on their tier and those it passed through from the cache. (A step
  // with every gradient first, which leaves 7, 8 and 9 cached: the cache
  // holds records that went through the step before, so skipped ones leave
  // it.)
  StepStats full;
  run_step({}, &full);
  ASSERT_EQ(e.plan().Order(4).back(), 9);
  ASSERT_EQ(e.plan().Order(5).front(), 9);
  ASSERT_TRUE(e.BeginStep(skip).ok());
  int passed_through = 0;
  for (;;) {
    auto v = e.Next();
    ASSERT_TRUE(v.ok()) << v.status();
    if (v->subgroup < 0) break;
    if (skip[v->subgroup]) {
      ++passed_through;
    } else {
      for (uint64_t k = 0; k < v->numel; ++k) v->master[k] -= 1.0f;
    }
    ASSERT_TRUE(e.Done(/*updated=*/!skip[v->subgroup]).ok());
  }
  EXPECT_EQ(passed_through, 1);  // 9, cached by the step before
  e.AbortStep();
  StepStats stats;
  const std::vector<int> retried = run_step({}, &stats);
  EXPECT_EQ(stats.subgroups_left_on_tier, 0);
  EXPECT_EQ(retried.size(), 3u);
  for (int i = 0; i < n; ++i) {
    std::vector<float> master(1024);
    int64_t count = -1;
    ASSERT_TRUE(
        e.ReadSubgroup(i, master.data(), {s0.data(), s1.data()}, &count).ok());
    EXPECT_EQ(count, skip[i] ? 2 : 6) << "subgroup " << i;
    float want = before[i][0];
    for (int step = 0; step < (skip[i] ? 2 : 6); ++step) want -= 1.0f;
    EXPECT_EQ(master[0], want) << "subgroup " << i;
  }
}

TEST(EngineTest, InitializingAfterAStepKeepsTheCacheWithinItsSize) {
  // After a step the cache holds the records the next step starts with.
  // Initialising every subgroup again (a load of a state dict without
  // state) keeps no more than that in memory: the other records go to their
  // tier, and the streaming buffers stay free for them.
  EngineConfig cfg = SixBuffers(10, /*eager=*/false);
  Model model(cfg.subgroup_numel, 31);
  auto engine = Engine::Create(cfg);
  ASSERT_TRUE(engine.ok()) << engine.status();
  Engine& e = **engine;
  ASSERT_EQ(e.plan().num_cached, 3);
  ASSERT_EQ(e.plan().num_buffers, 3);
  ASSERT_NO_FATAL_FAILURE(InitializeFrom(e, model));
  ASSERT_NO_FATAL_FAILURE(RunSteps(e, model, 1, 1));
  FinishesWithin(absl::Seconds(60), "initialising every subgroup again", [&] {
    for (int i = 0; i < e.num_subgroups(); ++i) {
      absl::Status s =
          e.InitializeSubgroup(i, model.init[i].data(), DType::kFloat32);
      EXPECT_TRUE(s.ok()) << "subgroup " << i << ": " << s;
    }
  });
  // The state is the initial one again: the next step is a first update.
  Reference ref(model);
  model.NewGrads(2);
  ref.Step(model, 1, 1.0f);
  std::vector<SubgroupStepInput> in = AdamWInputs(model);
  absl::StatusOr<StepStats> stats;
  FinishesWithin(absl::Seconds(60), "the step after that",
                 [&] { stats = e.Step(in, StepOptions()); });
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->cache_hits, 3);
  auto got = Take(e, cfg.subgroup_numel);
  for (int i = 0; i < e.num_subgroups(); ++i) {
    EXPECT_EQ(got.step[i], 1) << i;
    EXPECT_EQ(got.master[i], ref.master[i]) << i;
  }
}

TEST(EngineTest, RecordsHeldByAFailedStepMakeRoomForReadsInsteadOfHanging) {
  // Every write of a step fails: the records it updated stay in memory,
  // until every buffer holds one. Reading a subgroup that is not in memory
  // then (a state dict after the error) writes one of them back to make
  // room, and the step retried afterwards finishes as if nothing happened.
  EngineConfig cfg = SmallConfig(1);
  cfg.techniques.cache_reuse = false;
  cfg.fault_injection = true;
  cfg.host_budget_bytes = 3 * (4096 + AlignedRecordBytes(3000, 3));
  Model model(cfg.subgroup_numel, 41);
  std::unique_ptr<Engine> engine = CreateFrom(cfg, model);
  ASSERT_NE(engine, nullptr);
  Engine& e = *engine;
  const Reference ref = ReferenceOfStep1(model);
  std::vector<SubgroupStepInput> in = AdamWInputs(model);
  FaultSpec fault;
  fault.op = IoOp::kWrite;
  fault.nth = -1;
  e.fault_injector(0)->AddFault(fault);
  ASSERT_FALSE(e.Step(in, StepOptions()).ok());
  // Still failing: the write that would make room fails, and says so.
  std::vector<float> p(3000), m(3000), v(3000);
  FinishesWithin(absl::Seconds(60), "a read while the tier fails", [&] {
    absl::Status s = e.ReadSubgroup(3, p.data(), {m.data(), v.data()}, nullptr);
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find("Input/output error"), std::string::npos) << s;
  });
  e.fault_injector(0)->ClearFaults();
  FinishesWithin(absl::Seconds(60), "a read after the failed step", [&] {
    int64_t step = -1;
    absl::Status s = e.ReadSubgroup(3, p.data(), {m.data(), v.data()}, &step);
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_EQ(step, 0);
    EXPECT_EQ(std::vector<float>(p.begin(), p.begin() + 1500), model.init[3]);
  });
  ASSERT_TRUE(e.Step(in, StepOptions()).ok());
  auto got = Take(e, cfg.subgroup_numel);
  for (int i = 0; i < e.num_subgroups(); ++i) {
    EXPECT_EQ(got.step[i], 1) << i;
    EXPECT_EQ(got.master[i], ref.master[i]) << i;
  }
}

constexpr int kNoFault = -2;

// Two steps of the baseline's gradient conversion with cache reuse; unless
// `fault_nth` is kNoFault, the second step's gradient read number fault_nth
// (-1: every one) fails, and the step is retried once the fault is gone.
// `steps` and `state` get each subgroup's step count and arrays at the end.
void TwoEagerSteps(int fault_nth, std::vector<int64_t>* steps,
                   std::vector<std::vector<float>>* state) {
  EngineConfig cfg = SixBuffers(10, /*eager=*/true);
  cfg.fault_injection = true;
  Model model(cfg.subgroup_numel, 51);
  auto engine = Engine::Create(cfg);
  ASSERT_TRUE(engine.ok()) << engine.status();
  Engine& e = **engine;
  ASSERT_EQ(e.plan().num_cached, 3);
  ASSERT_NO_FATAL_FAILURE(InitializeFrom(e, model));
  for (int step = 1; step <= 2; ++step) {
    model.NewGrads(step);
    std::vector<SubgroupStepInput> in = AdamWInputs(model);
    for (int i = 0; i < e.num_subgroups(); ++i) {
      ASSERT_TRUE(e.OffloadGradients(i, in[i].segments).ok());
    }
    if (step == 2 && fault_nth != kNoFault) {
      FaultSpec fault;
      fault.op = IoOp::kRead;
      fault.nth = fault_nth;
      fault.path_substring = ".grad";
      e.fault_injector(0)->AddFault(fault);
      absl::StatusOr<StepStats> failed = e.Step(in, StepOptions());
      EXPECT_FALSE(failed.ok()) << "fault " << fault_nth;
      EXPECT_GE(e.fault_injector(0)->fired(), 1);
      e.fault_injector(0)->ClearFaults();
    }
    absl::StatusOr<StepStats> stats = e.Step(in, StepOptions());
    ASSERT_TRUE(stats.ok()) << "fault " << fault_nth << ": " << stats.status();
  }
  auto got = Take(e, cfg.subgroup_numel);
  *steps = got.step;
  *state = got.master;
  for (size_t i = 0; i < got.m.size(); ++i) {
    state->push_back(got.m[i]);
    state->push_back(got.v[i]);
  }
}

TEST(EngineTest, TheOffloadTakesTheGradientFingerprintInItsOwnPass) {
  // The baseline's offload converts, checks and hashes each 1 MiB chunk of
  // the gradients in one pass: its fingerprint is GradientFingerprint's
  // (segments given in any order, each of several chunks), and a NaN in a
  // later chunk is seen with or without the fingerprint.
  EngineConfig cfg = SmallConfig(1);
  cfg.techniques = Techniques::Baseline();
  cfg.subgroup_numel = {1500000, 3000};  // segments of 1.5 MB of bf16
  cfg.host_budget_bytes = 3 * (4096 + AlignedRecordBytes(1500000, 4));
  auto engine = Engine::Create(cfg);
  ASSERT_TRUE(engine.ok()) << engine.status();
  Engine& e = Initialized(*engine, cfg, 4);
  ASSERT_EQ(cfg.grad_dtype, DType::kBFloat16);
  auto bf16 = [](float f) {  // truncated: any bf16 value will do
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    return static_cast<uint16_t>(bits >> 16);
  };
  std::mt19937 rng(7);
  for (int i = 0; i < 2; ++i) {
    const uint64_t n = cfg.subgroup_numel[i];
    std::vector<uint16_t> grad(n);
    for (uint16_t& g : grad) {
      g = bf16(std::uniform_real_distribution<float>(-1, 1)(rng));
    }
    // Two segments, the second first.
    const uint64_t half = n / 2;
    std::vector<Segment> segs = {{half, n - half, grad.data() + half, nullptr},
                                 {0, half, grad.data(), nullptr}};
    uint64_t fingerprint = 0;
    ASSERT_TRUE(e.OffloadGradients(i, segs, &fingerprint).ok());
    absl::StatusOr<uint64_t> want = e.GradientFingerprint(i, segs);
    ASSERT_TRUE(want.ok()) << want.status();
    EXPECT_EQ(fingerprint, *want) << "subgroup " << i;
    const uint16_t last = grad[n - 1];
    grad[n - 1] ^= 1;  // the last element's lowest bit
    absl::StatusOr<uint64_t> changed = e.GradientFingerprint(i, segs);
    ASSERT_TRUE(changed.ok());
    EXPECT_NE(*changed, *want);
    grad[n - 1] = last;
    e.SkipStep();
    for (bool with_fingerprint : {true, false}) {
      SCOPED_TRACE(with_fingerprint ? "with the fingerprint" : "without");
      // The second chunk of a segment, where there is one.
      const uint64_t at =
          with_fingerprint ? n - 1 : std::min(n - 1, half + 600000);
      const uint16_t kept = grad[at];
      grad[at] = bf16(std::numeric_limits<float>::quiet_NaN());
      ASSERT_TRUE(
          e.OffloadGradients(i, segs, with_fingerprint ? &fingerprint : nullptr)
              .ok());
      std::vector<SubgroupStepInput> in(2);
      for (int j = 0; j < 2; ++j) in[j].skip = j != i;
      in[i].segments = segs;
      absl::StatusOr<bool> bad = e.GradientsNonfinite(in, 1.0f);
      ASSERT_TRUE(bad.ok()) << bad.status();
      EXPECT_TRUE(*bad) << "subgroup " << i << ", element " << at;
      e.SkipStep();
      grad[at] = kept;
    }
  }
}

TEST(EngineTest, ANonFiniteGradScaleIsRefusedBeforeTheStepBegins) {
  // The kernels refuse it too, but only once the step had begun: the step
  // was left failed part-way (commits and loads refused until a retry).
  EngineConfig cfg = SmallConfig(1);
  Model model(cfg.subgroup_numel, 8);
  std::unique_ptr<Engine> engine = CreateFrom(cfg, model);
  ASSERT_NE(engine, nullptr);
  Engine& e = *engine;
  std::vector<SubgroupStepInput> in = AdamWInputs(model);
  for (float bad : {std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN()}) {
    StepOptions opts;
    opts.grad_scale = bad;
    opts.skip_if_nonfinite = false;
    absl::StatusOr<StepStats> stats = e.Step(in, opts);
    EXPECT_EQ(stats.status().code(), absl::StatusCode::kInvalidArgument)
        << stats.status();
    EXPECT_NE(stats.status().message().find("grad_scale must be finite"),
              std::string::npos)
        << stats.status();
    EXPECT_EQ(e.GradientsNonfinite(in, bad).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_FALSE(e.step_incomplete());
  }
  ASSERT_TRUE(e.Step(in, StepOptions()).ok());
  EXPECT_EQ(e.step(), 1);
}

TEST(EngineTest, ASkippedStepCountsItsGradientWritesAndLeavesNoneRunning) {
  // The baseline writes each gradient as it is offloaded; a step skipped
  // at once (a NaN elsewhere) waits for those writes: their bytes are the
  // skipped step's, and no completion is left to count into the stats
  // SkipStep resets (before: a data race on the stats' vectors).
  EngineConfig cfg = SmallConfig(1);
  cfg.techniques = Techniques::Baseline();
  cfg.host_budget_bytes = 4 * (4096 + AlignedRecordBytes(3000, 4));
  cfg.tiers[0].throttle_write_bytes_per_sec = 100e3;  // 30 KB: 0.3 s
  Model model(cfg.subgroup_numel, 9);
  std::unique_ptr<Engine> engine = CreateFrom(cfg, model);
  ASSERT_NE(engine, nullptr);
  Engine& e = *engine;
  std::vector<SubgroupStepInput> in = AdamWInputs(model);
  uint64_t grad_bytes = 0;
  for (int i = 0; i < e.num_subgroups(); ++i) {
    ASSERT_TRUE(e.OffloadGradients(i, in[i].segments).ok());
    grad_bytes += cfg.subgroup_numel[i] * 4;
  }
  const StepStats skipped = e.SkipStep();
  EXPECT_TRUE(skipped.skipped);
  ASSERT_EQ(skipped.bytes_written.size(), 1u);
  EXPECT_GE(skipped.bytes_written[0], grad_bytes);
  for (int i = 0; i < e.num_subgroups(); ++i) {
    ASSERT_TRUE(e.OffloadGradients(i, in[i].segments).ok());
  }
  absl::StatusOr<StepStats> stats = e.Step(in, StepOptions());
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(e.step(), 1);
}

TEST(EngineTest, AGradientReadErrorOnACacheHitLosesNoUpdate) {
  // A failed gradient read must not drop the record it was read for: on a
  // cache hit that record is the only copy of its latest version.
  std::vector<int64_t> want_steps;
  std::vector<std::vector<float>> want;
  ASSERT_NO_FATAL_FAILURE(TwoEagerSteps(kNoFault, &want_steps, &want));
  EXPECT_EQ(want_steps, std::vector<int64_t>(10, 2));
  // Each subgroup's read in turn, then all of them: the cached records whose
  // reads failed after the step had stopped must not keep the error either.
  for (int nth = -1; nth < 10; ++nth) {
    std::vector<int64_t> steps;
    std::vector<std::vector<float>> got;
    ASSERT_NO_FATAL_FAILURE(TwoEagerSteps(nth, &steps, &got));
    EXPECT_EQ(steps, want_steps) << "fault " << nth;
    EXPECT_TRUE(got == want) << "fault " << nth;
  }
}

// A file system of g_fake_fs_bytes that holds only the files under the
// tier directory (what the test's runs write there).
uint64_t g_fake_fs_bytes = 0;

uint64_t FakeFreeBytes(const std::string& path) {
  const uint64_t used = internal_engine::BytesUnderForTesting(path);
  return used >= g_fake_fs_bytes ? 0 : g_fake_fs_bytes - used;
}

// The engine sees the fake file system while one is in scope.
struct FakeFileSystem {
  FakeFileSystem() {
    internal_engine::SetTierFreeBytesForTesting(&FakeFreeBytes);
  }
  ~FakeFileSystem() { internal_engine::SetTierFreeBytesForTesting(nullptr); }
  FakeFileSystem(const FakeFileSystem&) = delete;
  FakeFileSystem& operator=(const FakeFileSystem&) = delete;
};

// Bytes the state of `cfg` (Adam: 3 arrays) takes on disk: two slots per
// subgroup, each with its header.
uint64_t StateDiskBytes(const EngineConfig& cfg) {
  uint64_t need = 0;
  for (uint64_t n : cfg.subgroup_numel) {
    need += 2 * (4096 + AlignedRecordBytes(n, 3));
  }
  return need;
}

TEST(EngineTest, AResumeCountsTheRunsOwnFilesAsRoomOnTheTier) {
  // A tier whose free space fits the state once, not twice: a fresh run
  // fits, and so does its resume, whose files already take that space.
  EngineConfig cfg = SmallConfig(1);
  cfg.commit_every = 1;
  const uint64_t need = StateDiskBytes(cfg);
  FakeFileSystem fake_fs;
  g_fake_fs_bytes = need - 4096;  // the hook is what the plan goes by
  auto refused = Engine::Create(cfg);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted)
      << refused.status();
  g_fake_fs_bytes = need + need / 2;
  Model model(cfg.subgroup_numel, 61);
  std::vector<std::vector<float>> want;
  {
    auto engine = Engine::Create(cfg);
    ASSERT_TRUE(engine.ok()) << engine.status();
    Engine& e = **engine;
    ASSERT_NO_FATAL_FAILURE(InitializeFrom(e, model));
    ASSERT_NO_FATAL_FAILURE(RunSteps(e, model, 1, 2));
    ASSERT_EQ(e.committed_step(), 2);
    want = Take(e, cfg.subgroup_numel).master;
  }
  ASSERT_LT(FakeFreeBytes(cfg.tiers[0].path), need);  // the files take room
  cfg.resume = true;
  auto engine = Engine::Create(cfg);
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_TRUE((*engine)->resumed());
  EXPECT_EQ((*engine)->step(), 2);
  EXPECT_EQ(Take(**engine, cfg.subgroup_numel).master, want);
  ASSERT_NO_FATAL_FAILURE(RunSteps(**engine, model, 3, 3));
  // A fresh run in the same directory reuses those files too.
  engine->reset();
  cfg.resume = false;
  EXPECT_TRUE(Engine::Create(cfg).ok());
}

TEST(EngineTest, AFailedFirstInitialisationLeavesTheSubgroupUninitialised) {
  // The write of a subgroup's first record fails: the subgroup stays
  // uninitialised (nothing may commit it), and initialising it again makes
  // the run committed and resumable.
  EngineConfig cfg = SmallConfig(1);
  cfg.fault_injection = true;
  cfg.commit_every = 1;
  Model model(cfg.subgroup_numel, 71);
  {
    auto engine = Engine::Create(cfg);
    ASSERT_TRUE(engine.ok()) << engine.status();
    Engine& e = **engine;
    FaultSpec fault;
    fault.op = IoOp::kWrite;
    fault.path_substring = "sg_0.state";
    e.fault_injector(0)->AddFault(fault);
    EXPECT_FALSE(
        e.InitializeSubgroup(0, model.init[0].data(), DType::kFloat32).ok());
    e.fault_injector(0)->ClearFaults();
    for (int i = 1; i < e.num_subgroups(); ++i) {
      ASSERT_TRUE(
          e.InitializeSubgroup(i, model.init[i].data(), DType::kFloat32).ok());
    }
    EXPECT_EQ(e.committed_step(), -1);
    EXPECT_EQ(e.Commit().code(), absl::StatusCode::kFailedPrecondition);
    std::vector<float> p(1000), m(1000), v(1000);
    EXPECT_EQ(e.ReadSubgroup(0, p.data(), {m.data(), v.data()}, nullptr).code(),
              absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(e.BeginStep().code(), absl::StatusCode::kFailedPrecondition);
    ASSERT_TRUE(
        e.InitializeSubgroup(0, model.init[0].data(), DType::kFloat32).ok());
    EXPECT_EQ(e.committed_step(), 0);
  }
  cfg.resume = true;
  auto engine = Engine::Create(cfg);
  ASSERT_TRUE(engine.ok()) << engine.status();
  auto got = Take(**engine, cfg.subgroup_numel);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(got.step[i], 0) << i;
    EXPECT_EQ(got.master[i], model.init[i]) << i;
  }
}

TEST(EngineTest, AReadErrorOutsideAStepIsNotTheNextSteps) {
  // A read that fails outside a step (state_dict, a checkpoint save) is
  // reported to its caller; the next step, the fault gone, does not fail
  // with it, and ends as a step without the earlier fault does.
  EngineConfig cfg = SmallConfig(2);
  cfg.fault_injection = true;
  // Two streaming buffers, no cache: every record is read from its tier.
  cfg.host_budget_bytes = 2 * (4096 + AlignedRecordBytes(3000, 3));
  Model model(cfg.subgroup_numel, 81);
  Model fresh(cfg.subgroup_numel, 81);
  std::vector<std::vector<float>> want;
  for (bool fault : {false, true}) {
    SCOPED_TRACE(fault ? "after a failed read" : "without a fault");
    cfg.run_name = fault ? "stale_error_fault" : "stale_error_clean";
    auto engine = Engine::Create(cfg);
    ASSERT_TRUE(engine.ok()) << engine.status();
    Engine& e = **engine;
    Model& m = fault ? model : fresh;
    InitializeFrom(e, m);
    RunSteps(e, m, 1, 1);
    if (fault) {
      // Every read from a tier fails: the records not cached cannot be read.
      for (size_t t = 0; t < cfg.tiers.size(); ++t) {
        FaultSpec spec;
        spec.op = IoOp::kRead;
        spec.nth = -1;
        e.fault_injector(static_cast<int>(t))->AddFault(spec);
      }
      int failed = 0;
      for (int i = 0; i < e.num_subgroups(); ++i) {
        std::vector<float> p(cfg.subgroup_numel[i]), a(p.size()), b(p.size());
        failed +=
            !e.ReadSubgroup(i, p.data(), {a.data(), b.data()}, nullptr).ok();
      }
      EXPECT_GT(failed, 0);
      for (size_t t = 0; t < cfg.tiers.size(); ++t) {
        e.fault_injector(static_cast<int>(t))->ClearFaults();
      }
    }
    RunSteps(e, m, 2, 3);
    auto got = Take(e, cfg.subgroup_numel);
    std::vector<std::vector<float>> all = got.master;
    all.insert(all.end(), got.m.begin(), got.m.end());
    all.insert(all.end(), got.v.begin(), got.v.end());
    if (!fault) {
      want = all;
    } else {
      EXPECT_TRUE(all == want);
      EXPECT_EQ(got.step, std::vector<int64_t>(got.step.size(), 3));
    }
  }
}

TEST(EngineTest, AFailedRewriteOverTheLatestUncommittedRecordKeepsTheNewOne) {
  // After a step that no commit covers, a subgroup's latest version is in
  // the slot its next write goes to: a rewrite (InitializeSubgroup or
  // WriteSubgroup, as a load does) that fails part-way there keeps its new
  // record in memory as the latest version, and nothing reads the torn slot.
  for (bool initialize : {true, false}) {
    SCOPED_TRACE(initialize ? "InitializeSubgroup" : "WriteSubgroup");
    EngineConfig cfg = SmallConfig(1);
    cfg.fault_injection = true;
    cfg.commit_every = 2;
    cfg.run_name = initialize ? "torn_init" : "torn_write";
    cfg.host_budget_bytes = 2 * (4096 + AlignedRecordBytes(3000, 3));
    Model model(cfg.subgroup_numel, 91);
    auto engine = Engine::Create(cfg);
    ASSERT_TRUE(engine.ok()) << engine.status();
    Engine& e = **engine;
    ASSERT_EQ(e.plan().num_cached, 0);
    InitializeFrom(e, model);
    RunSteps(e, model, 1, 1);
    ASSERT_EQ(e.committed_step(), 0);
    const int i = 1;
    const size_t n = cfg.subgroup_numel[i];
    std::vector<float> master(n, 0.5f), m(n, 0.25f), v(n, 0.125f);
    FaultSpec fault;
    fault.kind = FaultSpec::Kind::kShortTransfer;
    fault.op = IoOp::kWrite;
    fault.path_substring = absl::StrCat("sg_", i, ".state");
    e.fault_injector(0)->AddFault(fault);
    absl::Status s =
        initialize ? e.InitializeSubgroup(i, master.data(), DType::kFloat32)
                   : e.WriteSubgroup(i, master.data(), {m.data(), v.data()}, 7);
    EXPECT_FALSE(s.ok());
    e.fault_injector(0)->ClearFaults();
    std::vector<float> p(n), a(n), b(n);
    int64_t step = -1;
    ASSERT_TRUE(e.ReadSubgroup(i, p.data(), {a.data(), b.data()}, &step).ok());
    EXPECT_EQ(step, initialize ? 0 : 7);
    EXPECT_EQ(p, master);
    if (!initialize) {
      EXPECT_EQ(a, m);
      EXPECT_EQ(b, v);
    }
    // It reaches the disk with the next commit.
    ASSERT_TRUE(e.Commit().ok());
    ASSERT_TRUE(e.ReadSubgroup(i, p.data(), {a.data(), b.data()}, &step).ok());
    EXPECT_EQ(p, master);
  }
}

TEST(EngineTest, AGradientOffloadedTwiceLandsInTheOrderGiven) {
  // The baseline: a subgroup's gradient offloaded again (gradients changed
  // after the first offload) while the first write is still in flight. The
  // step must see the second one, however the writes are scheduled.
  EngineConfig cfg;
  TierSpec spec;
  spec.path = TempDir("gradorder");
  cfg.tiers.push_back(spec);
  cfg.subgroup_numel = {4096};
  cfg.num_state_arrays = 0;
  cfg.techniques = Techniques::Baseline();
  cfg.fault_injection = true;
  cfg.host_budget_bytes = 3 * (4096 + 2 * AlignedRecordBytes(4096, 1));
  auto engine = Engine::Create(cfg);
  ASSERT_TRUE(engine.ok()) << engine.status();
  Engine& e = **engine;
  std::vector<float> zeros(4096, 0.0f);
  ASSERT_TRUE(e.InitializeSubgroup(0, zeros.data(), DType::kFloat32).ok());
  std::vector<uint16_t> stale(4096, ToBf16(2.0f)),
      final_grad(4096, ToBf16(1.0f));
  FaultSpec slow;  // the first gradient write is late
  slow.kind = FaultSpec::Kind::kDelay;
  slow.op = IoOp::kWrite;
  slow.path_substring = ".grad";
  slow.delay = absl::Milliseconds(300);
  e.fault_injector(0)->AddFault(slow);
  ASSERT_TRUE(e.OffloadGradients(0, {{0, 4096, stale.data(), nullptr}}).ok());
  ASSERT_TRUE(
      e.OffloadGradients(0, {{0, 4096, final_grad.data(), nullptr}}).ok());
  std::vector<SubgroupStepInput> in(1);
  in[0].hp.kind = OptimizerKind::kSGD;
  in[0].hp.lr = 1.0f;
  in[0].segments = {{0, 4096, final_grad.data(), nullptr}};
  ASSERT_TRUE(e.Step(in, StepOptions()).ok());
  std::vector<float> master(4096);
  ASSERT_TRUE(e.ReadSubgroup(0, master.data(), {}, nullptr).ok());
  EXPECT_EQ(master, std::vector<float>(4096, -1.0f));
}

TEST(EngineTest, IoBetweenStepsIsNotCountedInTheNextStep) {
  // Initialisation writes and records read between steps (a state_dict)
  // are not the step's: its bytes are those of a step without them.
  EngineConfig cfg = SmallConfig(2);
  // Two streaming buffers, no cache: every step reads and writes it all.
  cfg.host_budget_bytes = 2 * (4096 + AlignedRecordBytes(3000, 3));
  cfg.run_name = "stats_between_steps";
  Model model(cfg.subgroup_numel, 91);
  auto engine = Engine::Create(cfg);
  ASSERT_TRUE(engine.ok()) << engine.status();
  Engine& e = **engine;
  InitializeFrom(e, model);
  std::vector<StepStats> stats;
  for (int step = 1; step <= 3; ++step) {
    if (step == 3) {
      for (int i = 0; i < e.num_subgroups(); ++i) {
        std::vector<float> p(cfg.subgroup_numel[i]), a(p.size()), b(p.size());
        ASSERT_TRUE(
            e.ReadSubgroup(i, p.data(), {a.data(), b.data()}, nullptr).ok());
      }
    }
    model.NewGrads(step);
    auto s = e.Step(AdamWInputs(model), StepOptions());
    ASSERT_TRUE(s.ok()) << s.status();
    stats.push_back(*s);
  }
  for (size_t t = 0; t < cfg.tiers.size(); ++t) {
    SCOPED_TRACE(absl::StrCat("tier ", t));
    EXPECT_GT(stats[1].bytes_read[t], 0u);
    for (int k : {0, 2}) {
      EXPECT_EQ(stats[k].bytes_read[t], stats[1].bytes_read[t]) << k;
      EXPECT_EQ(stats[k].bytes_written[t], stats[1].bytes_written[t]) << k;
    }
  }
}

TEST(EngineTest, ProcessesSharingATierPlanWithTheirShareOfItsFreeSpace) {
  // The shared_by processes of a node that use a tier each plan against the
  // same free space: each takes its share, or together they would overfill
  // it.
  EngineConfig cfg = SmallConfig(1);
  const uint64_t need = StateDiskBytes(cfg);
  FakeFileSystem fake_fs;
  for (int shared_by : {1, 2, 4}) {
    SCOPED_TRACE(absl::StrCat("shared_by ", shared_by));
    // 3x the state free, whatever earlier runs left in the directory.
    g_fake_fs_bytes = uint64_t{1} << 50;
    g_fake_fs_bytes -= FakeFreeBytes(cfg.tiers[0].path);  // used
    g_fake_fs_bytes += 3 * need;
    cfg.run_name = absl::StrCat("shared_capacity_", shared_by);
    cfg.tiers[0].shared_by = shared_by;
    auto engine = Engine::Create(cfg);
    if (shared_by < 4) {
      EXPECT_TRUE(engine.ok()) << engine.status();
    } else {  // 3/4 of the state each
      EXPECT_EQ(engine.status().code(), absl::StatusCode::kResourceExhausted)
          << engine.status();
    }
  }
}

TEST(EngineTest, TheChecksumsHaveTheirOwnTimeInTheStepStats) {
  // Hashing each written record for its header and verifying each read
  // took a third of a step's CPU in a profile; the write side was in no
  // field, the read side in read_wait_seconds.
  Model model({1000, 2000, 3000, 1500}, 28);
  EngineConfig cfg = CommitEveryStep("checksum_time");
  for (bool verify : {true, false}) {
    SCOPED_TRACE(verify ? "verify" : "no verify");
    cfg.verify_checksums = verify;
    cfg.run_name = verify ? "checksum_time" : "checksum_time_nv";
    auto engine = Engine::Create(cfg);
    ASSERT_TRUE(engine.ok()) << engine.status();
    Engine& e = **engine;
    ASSERT_NO_FATAL_FAILURE(InitializeFrom(e, model));
    for (int step = 1; step <= 2; ++step) {
      model.NewGrads(step);
      auto stats = e.Step(AdamWInputs(model), StepOptions());
      ASSERT_TRUE(stats.ok()) << stats.status();
      EXPECT_GT(stats->checksum_seconds, 0);
      EXPECT_LE(stats->checksum_seconds + stats->read_wait_seconds +
                    stats->compute_seconds,
                stats->seconds * 1.01 + 1e-4);
    }
    // Reads between steps (a state_dict, a save) verify what they read: not
    // the next step's time (a review: counted there). A step in which no
    // subgroup has a gradient reads, hashes and writes nothing.
    for (int k = 0; k < 3; ++k) Take(e, cfg.subgroup_numel);
    ASSERT_TRUE(e.BeginStep(std::vector<bool>(4, true)).ok());
    for (;;) {
      auto v = e.Next();
      ASSERT_TRUE(v.ok()) << v.status();
      if (v->subgroup < 0) break;
      ASSERT_TRUE(e.Done(/*updated=*/false).ok());
    }
    auto idle = e.EndStep();
    ASSERT_TRUE(idle.ok()) << idle.status();
    EXPECT_EQ(idle->checksum_seconds, 0);
  }
}

TEST(EngineTest, TiersOnOneFileSystemShareItsFreeSpace) {
  // Two tiers in directories of one file system (the same device): each
  // was credited with all of its free space, the plan passed, and the start
  // failed at a record's fallocate. Each now takes its part, and a plan
  // that does not fit says how every capacity came about.
  EngineConfig cfg = SmallConfig(2);
  struct stat a, b;
  ASSERT_EQ(stat(cfg.tiers[0].path.c_str(), &a), 0);
  ASSERT_EQ(stat(cfg.tiers[1].path.c_str(), &b), 0);
  ASSERT_EQ(a.st_dev, b.st_dev) << "the test's tiers are on one device";
  const uint64_t need = StateDiskBytes(cfg);
  FakeFileSystem fake_fs;
  // 3/4 of the state free: twice that when counted once per tier.
  g_fake_fs_bytes = need * 3 / 4;
  cfg.run_name = "one_fs_small";
  auto refused = Engine::Create(cfg);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted)
      << refused.status();
  for (const std::string& part :
       {absl::StrCat("tier 0 (", cfg.tiers[0].path, ") "),
        absl::StrCat("tier 1 (", cfg.tiers[1].path, ") "),
        std::string(" / 2 tiers on that file system"),
        std::string("give capacity_bytes to set them")}) {
    EXPECT_TRUE(absl::StrContains(refused.status().message(), part))
        << refused.status() << "\nlacks: " << part;
  }
  // shared_by in the message too, where it divides.
  cfg.tiers[0].shared_by = cfg.tiers[1].shared_by = 3;
  refused = Engine::Create(cfg);
  EXPECT_TRUE(absl::StrContains(refused.status().message(),
                                " / 3 processes of the node (shared_by) / 2 "
                                "tiers on that file system"))
      << refused.status();
  // 3/2 of the state free: it fits in the two halves.
  cfg.tiers[0].shared_by = cfg.tiers[1].shared_by = 1;
  g_fake_fs_bytes = need * 3 / 2;
  cfg.run_name = "one_fs_fits";
  auto engine = Engine::Create(cfg);
  EXPECT_TRUE(engine.ok()) << engine.status();
}

TEST(EngineTest, AFreshStartThatFailsPartWayRemovesWhatItWrote) {
  // A start that fails after it preallocated some records (a tier filling
  // up meanwhile; here the file-size limit, EFBIG, on the last and largest
  // record) left the run directories it made with the manifest and those
  // records: their space stayed taken, and a retry found the tiers full of
  // its own failed attempt. Everything it wrote goes with the directories.
  EngineConfig cfg = SmallConfig(2);
  cfg.run_name = "failed_start";
  cfg.subgroup_numel = {1000, 2000, 3000, 400000};  // the last: ~9.6 MB
  cfg.host_budget_bytes = 4 * (4096 + AlignedRecordBytes(400000, 3));
  auto create_under_1mib_files = [&cfg] {
    internal_io::ScopedFileSizeLimit limit(1 << 20);
    EXPECT_TRUE(limit.ok());
    return Engine::Create(cfg);
  };
  auto engine = create_under_1mib_files();
  ASSERT_FALSE(engine.ok());
  EXPECT_TRUE(absl::StrContains(engine.status().message(), "sg_3.state"))
      << engine.status();
  for (int t = 0; t < 2; ++t) {
    struct stat st;
    EXPECT_NE(stat(RunDir(cfg, t).c_str(), &st), 0)
        << RunDir(cfg, t) << " is still there";
  }
  // A directory this start did not make keeps what is in it.
  const std::string kept = RunDir(cfg, 0) + "/keep.me";
  ASSERT_EQ(mkdir(RunDir(cfg, 0).c_str(), 0700), 0);
  ASSERT_TRUE(WriteFileAtomically(kept, "x").ok());
  engine = create_under_1mib_files();
  ASSERT_FALSE(engine.ok());
  struct stat st;
  EXPECT_EQ(stat(kept.c_str(), &st), 0);
}

}  // namespace
}  // namespace mlp_offload
