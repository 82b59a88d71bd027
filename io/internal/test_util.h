// Helpers for the io tests: scratch paths, random data, engine options.
#ifndef MLP_OFFLOAD_IO_INTERNAL_TEST_UTIL_H_
#define MLP_OFFLOAD_IO_INTERNAL_TEST_UTIL_H_

#include <signal.h>
#include <sys/resource.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "io/io_engine.h"

namespace mlp_offload {
namespace internal_io {

// A fresh path under TEST_TMPDIR (or /tmp) whose name contains `name`.
std::string ScratchPath(absl::string_view name);
// A fresh directory under TEST_TMPDIR (or /tmp).
std::string ScratchDir(absl::string_view name);
// Deterministic pseudo-random bytes.
void FillRandom(void* data, size_t bytes, uint64_t seed);
// The engine kinds usable here: kThreadPool always, kUring when available.
std::vector<IoEngineOptions::Kind> EngineKinds();
std::string KindName(IoEngineOptions::Kind kind);

// While in scope, no file of this process grows past `bytes` (RLIMIT_FSIZE:
// EFBIG, SIGXFSZ ignored): a file system that fills up, for a test. ok():
// whether the limit took.
class ScopedFileSizeLimit {
 public:
  explicit ScopedFileSizeLimit(uint64_t bytes);
  ~ScopedFileSizeLimit();
  ScopedFileSizeLimit(const ScopedFileSizeLimit&) = delete;
  ScopedFileSizeLimit& operator=(const ScopedFileSizeLimit&) = delete;
  bool ok() const { return ok_; }

 private:
  struct rlimit saved_ = {};
  struct sigaction old_ = {};
  bool ok_ = false;
};

}  // namespace internal_io
}  // namespace mlp_offload

#endif  // MLP_OFFLOAD_IO_INTERNAL_TEST_UTIL_H_
