// kill -9 at random moments (mid-initialisation, mid-step, mid-commit):
// restarting on the same tiers resumes from the last committed step, and the
// finished run is bit-identical to one that was never interrupted.
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "mlp_offload/engine.h"

namespace mlp_offload {
namespace {

constexpr int kSteps = 60;
const std::vector<uint64_t> kSizes = {40000, 30000, 50000, 20000, 35000};

std::vector<float> Init(int i) {
  std::mt19937 rng(1000 + i);
  std::vector<float> v(kSizes[i]);
  for (float& x : v) x = std::uniform_real_distribution<float>(-1, 1)(rng);
  return v;
}

std::vector<float> Grad(int i, int64_t step) {
  std::mt19937 rng(static_cast<uint32_t>(step * 131 + i));
  std::vector<float> v(kSizes[i]);
  for (float& x : v) x = std::normal_distribution<float>(0, 0.1f)(rng);
  return v;
}

OptimizerHyperparams Hp() {
  OptimizerHyperparams hp;
  hp.kind = OptimizerKind::kAdamW;
  hp.lr = 1e-2f;
  hp.weight_decay = 0.05f;
  return hp;
}

EngineConfig Config(const std::vector<std::string>& dirs) {
  EngineConfig cfg;
  for (const std::string& d : dirs) {
    TierSpec t;
    t.path = d;
    // Slow enough that kills land inside steps and commits.
    t.throttle_read_bytes_per_sec = t.throttle_write_bytes_per_sec = 40e6;
    cfg.tiers.push_back(t);
  }
  cfg.subgroup_numel = kSizes;
  cfg.num_state_arrays = 2;
  cfg.grad_dtype = DType::kFloat32;
  cfg.host_budget_bytes =
      4 * (4096 + AlignedRecordBytes(50000, 3));  // 1 cached
  cfg.commit_every = 1;
  cfg.run_name = "crash_run";
  cfg.tier_lock_dir = dirs[0];  // node-local: the test's own directory
  cfg.resume = true;
  return cfg;
}

// The training process: resume if there is a committed step, else start
// fresh; run to kSteps. Exit code 0 when done.
[[noreturn]] void Train(const std::vector<std::string>& dirs) {
  EngineConfig cfg = Config(dirs);
  auto engine = Engine::Create(cfg);
  if (!engine.ok()) {
    if (engine.status().code() != absl::StatusCode::kFailedPrecondition &&
        engine.status().code() != absl::StatusCode::kNotFound) {
      _exit(3);
    }
    cfg.resume = false;
    engine = Engine::Create(cfg);
    if (!engine.ok()) _exit(4);
    for (size_t i = 0; i < kSizes.size(); ++i) {
      std::vector<float> p = Init(static_cast<int>(i));
      if (!(*engine)
               ->InitializeSubgroup(static_cast<int>(i), p.data(),
                                    DType::kFloat32)
               .ok()) {
        _exit(5);
      }
    }
  }
  Engine& e = **engine;
  while (e.step() < kSteps) {
    std::vector<std::vector<float>> grads;
    std::vector<SubgroupStepInput> in(kSizes.size());
    for (size_t i = 0; i < kSizes.size(); ++i)
      grads.push_back(Grad(static_cast<int>(i), e.step() + 1));
    for (size_t i = 0; i < kSizes.size(); ++i) {
      in[i].hp = Hp();
      in[i].segments = {Segment{0, kSizes[i], grads[i].data(), nullptr}};
    }
    if (!e.Step(in, StepOptions()).ok()) _exit(6);
  }
  _exit(0);
}

TEST(EngineCrashTest, KilledAtRandomMomentsResumesBitIdentically) {
  const char* base = std::getenv("TEST_TMPDIR");
  std::vector<std::string> dirs;
  for (int t = 0; t < 2; ++t) {
    dirs.push_back(
        absl::StrCat(base ? base : "/tmp", "/crash_tier", t, "_", getpid()));
    mkdir(dirs.back().c_str(), 0700);
  }
  std::mt19937 rng(12345);
  int kills = 0, finished_early = 0;
  for (int attempt = 0; attempt < 25; ++attempt) {
    pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) Train(dirs);
    usleep(std::uniform_int_distribution<int>(5000, 150000)(rng));
    kill(pid, SIGKILL);
    int status = 0;
    waitpid(pid, &status, 0);
    if (WIFSIGNALED(status)) {
      ++kills;
    } else {
      ASSERT_TRUE(WIFEXITED(status)) << attempt;
      ASSERT_EQ(WEXITSTATUS(status), 0) << "attempt " << attempt;
      ++finished_early;
      break;  // the run completed: no more moments to kill it at
    }
  }
  EXPECT_GE(kills, 20) << "the run finished too soon to test crashes ("
                       << finished_early << ")";
  // Finish without interruption.
  pid_t pid = fork();
  if (pid == 0) Train(dirs);
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;

  // Reference: the same kernel, in memory, never interrupted.
  EngineConfig cfg = Config(dirs);
  auto engine = Engine::Create(cfg);
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_TRUE((*engine)->resumed());
  EXPECT_EQ((*engine)->step(), kSteps);
  for (size_t i = 0; i < kSizes.size(); ++i) {
    std::vector<float> p = Init(static_cast<int>(i)), m(kSizes[i], 0),
                       v(kSizes[i], 0);
    for (int64_t step = 1; step <= kSteps; ++step) {
      std::vector<float> g = Grad(static_cast<int>(i), step);
      OptimizerHyperparams hp = Hp();
      hp.step = step;
      UpdateSpans s;
      s.n = kSizes[i];
      s.param = p.data();
      s.state[0] = m.data();
      s.state[1] = v.data();
      s.grad = g.data();
      ASSERT_TRUE(ApplyOptimizer(hp, s, GradTransform(), nullptr).ok());
    }
    std::vector<float> gp(kSizes[i]), gm(kSizes[i]), gv(kSizes[i]);
    int64_t step = 0;
    ASSERT_TRUE((*engine)
                    ->ReadSubgroup(static_cast<int>(i), gp.data(),
                                   {gm.data(), gv.data()}, &step)
                    .ok());
    EXPECT_EQ(step, kSteps);
    EXPECT_EQ(0, std::memcmp(gp.data(), p.data(), p.size() * 4))
        << "subgroup " << i;
    EXPECT_EQ(0, std::memcmp(gm.data(), m.data(), m.size() * 4))
        << "subgroup " << i;
    EXPECT_EQ(0, std::memcmp(gv.data(), v.data(), v.size() * 4))
        << "subgroup " << i;
  }
}

}  // namespace
}  // namespace mlp_offload
