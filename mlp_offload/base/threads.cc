#include "mlp_offload/base/threads.h"

#include <atomic>
#include <cerrno>
#include <cstring>
#include <system_error>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"

namespace mlp_offload {
namespace {

std::atomic<int> thread_starts_until_failure{0};

// Whether this start is the one FailNthThreadStartForTesting picked.
bool InjectedFailure() {
  for (int left = thread_starts_until_failure.load(); left > 0;) {
    if (thread_starts_until_failure.compare_exchange_weak(left, left - 1)) {
      return left == 1;
    }
  }
  return false;
}

}  // namespace

void FailNthThreadStartForTesting(int n) {
  thread_starts_until_failure.store(n < 0 ? 0 : n);
}

absl::StatusOr<std::thread> StartThread(absl::string_view what,
                                        std::function<void()> fn) {
  int code = EAGAIN;
  if (!InjectedFailure()) {
    try {
      return std::thread(std::move(fn));
    } catch (const std::system_error& e) {
      code = e.code().value();
    }
  }
  absl::Status status = absl::ResourceExhaustedError(absl::StrCat(
      "could not start a thread (", what, "): ", std::strerror(code),
      " (the system's limit on threads or processes, such as a container's "
      "pids.max, or its memory)"));
  status.SetPayload(kSystemResourcePayload, absl::Cord("thread"));
  return status;
}

}  // namespace mlp_offload
