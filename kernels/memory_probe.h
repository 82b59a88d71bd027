// A STREAM-like memory bandwidth probe shaped like an optimizer update: some
// fp32 arrays read and written back in place (parameters and state), one
// read-only stream (the gradient) and one write-only stream (the model-dtype
// copy of the parameters). Its result is the ceiling that the kernels'
// bytes moved per second are compared against.
#ifndef MLP_OFFLOAD_KERNELS_MEMORY_PROBE_H_
#define MLP_OFFLOAD_KERNELS_MEMORY_PROBE_H_

#include <cstddef>

#include "absl/status/statusor.h"
#include "mlp_offload/base/thread_pool.h"

namespace mlp_offload {

struct StreamPattern {
  // fp32 arrays each read and written in place (0 to 4): fp32 AdamW has 3
  // (param, exp_avg, exp_avg_sq).
  int update_streams = 3;
  // Bytes per element of the one read-only stream: 4, 2, or 0 for none.
  size_t read_bytes = 4;
  // Bytes per element of the one write-only stream: 4, 2, or 0 for none.
  size_t write_bytes = 0;
};

// Bytes the pattern moves per element: 8 per update stream plus the read and
// write streams (fp32 AdamW: 28).
size_t StreamPatternBytes(const StreamPattern& pattern);

// One untimed pass of the pattern over caller-provided arrays of n elements:
// update[0..update_streams) are read and written in place (each becomes
// 0.5 * itself + |x|, x the read stream's element or 1, so non-negative
// arrays stay non-negative and every value stays bounded), `read` is read,
// `write` is written. Lets a benchmark probe the very buffers its kernel
// uses, interleaved with the kernel's own passes. The pattern must be valid
// (see MeasureStreamBandwidth).
void RunStreamPattern(const StreamPattern& pattern, float* const update[4],
                      const void* read, void* write, size_t n,
                      ThreadPool* pool);

// Runs the pattern over n elements, split in the same fixed chunks as the
// optimizer kernels, over `pool` (nullptr: calling thread), once to warm up
// and then `repetitions` times. Returns the best rate in GB/s (1e9 bytes/s).
// InvalidArgument for an unsupported pattern, n == 0 or repetitions < 1.
absl::StatusOr<double> MeasureStreamBandwidth(const StreamPattern& pattern,
                                              size_t n, int repetitions,
                                              ThreadPool* pool);

}  // namespace mlp_offload

#endif  // MLP_OFFLOAD_KERNELS_MEMORY_PROBE_H_
