// Starting threads without exceptions: std::thread throws std::system_error
// when the system refuses a thread, and a throw out of a constructor that
// already started some leaves joinable threads to be destroyed, which
// terminates the process.
#ifndef MLP_OFFLOAD_BASE_THREADS_H_
#define MLP_OFFLOAD_BASE_THREADS_H_

#include <functional>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace mlp_offload {

// The payload that marks a status of StartThread's (a resource of the
// system, not of a tier, ran out), for the Python bindings' mapping.
inline constexpr absl::string_view kSystemResourcePayload =
    "mlp_offload/system_resource";

// Starts `fn` on a new thread. Where std::thread would throw (the system
// refuses a thread: a process or thread limit such as a container's
// pids.max, or memory), ResourceExhausted naming `what`, with the
// kSystemResourcePayload payload, instead.
absl::StatusOr<std::thread> StartThread(absl::string_view what,
                                        std::function<void()> fn);

// Tests: the `n`-th StartThread from now on (n >= 1) fails as if the system
// had refused it, and the ones after it succeed; 0 turns it off.
void FailNthThreadStartForTesting(int n);

}  // namespace mlp_offload

#endif  // MLP_OFFLOAD_BASE_THREADS_H_
