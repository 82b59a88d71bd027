// Helpers for the io tests.
#include "io/internal/test_util.h"

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"

namespace mlp_offload {
namespace internal_io {
namespace {
std::atomic<int> g_counter{0};

std::string Base() {
  const char* dir = std::getenv("TEST_TMPDIR");
  return dir != nullptr && dir[0] != '\0' ? dir : "/tmp";
}
}  // namespace

std::string ScratchPath(absl::string_view name) {
  return absl::StrCat(Base(), "/", name, ".", getpid(), ".",
                      g_counter.fetch_add(1));
}

std::string ScratchDir(absl::string_view name) {
  std::string dir = ScratchPath(name);
  mkdir(dir.c_str(), 0700);
  return dir;
}

void FillRandom(void* data, size_t bytes, uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto* out = static_cast<unsigned char*>(data);
  size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    const uint64_t v = rng();
    std::memcpy(out + i, &v, 8);
  }
  for (; i < bytes; ++i) out[i] = static_cast<unsigned char>(rng());
}

std::vector<IoEngineOptions::Kind> EngineKinds() {
  std::vector<IoEngineOptions::Kind> kinds = {
      IoEngineOptions::Kind::kThreadPool};
  if (IoUringAvailable(nullptr)) kinds.push_back(IoEngineOptions::Kind::kUring);
  return kinds;
}

std::string KindName(IoEngineOptions::Kind kind) {
  switch (kind) {
    case IoEngineOptions::Kind::kUring:
      return "Uring";
    case IoEngineOptions::Kind::kThreadPool:
      return "ThreadPool";
    case IoEngineOptions::Kind::kAuto:
      return "Auto";
  }
  return "Unknown";
}

ScopedFileSizeLimit::ScopedFileSizeLimit(uint64_t bytes) {
  if (getrlimit(RLIMIT_FSIZE, &saved_) != 0) return;
  struct sigaction ignore = {};
  ignore.sa_handler = SIG_IGN;
  if (sigaction(SIGXFSZ, &ignore, &old_) != 0) return;
  struct rlimit small = saved_;
  small.rlim_cur = bytes;
  if (setrlimit(RLIMIT_FSIZE, &small) != 0) {
    sigaction(SIGXFSZ, &old_, nullptr);
    return;
  }
  ok_ = true;
}

ScopedFileSizeLimit::~ScopedFileSizeLimit() {
  if (!ok_) return;
  setrlimit(RLIMIT_FSIZE, &saved_);
  sigaction(SIGXFSZ, &old_, nullptr);
}

}  // namespace internal_io
}  // namespace mlp_offload
