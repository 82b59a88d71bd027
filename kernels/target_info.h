// Which SIMD target Highway's dynamic dispatch picks on this machine, and
// which targets this binary was compiled for.
#ifndef MLP_OFFLOAD_KERNELS_TARGET_INFO_H_
#define MLP_OFFLOAD_KERNELS_TARGET_INFO_H_

#include <string>
#include <vector>

namespace mlp_offload {

// Name of the target (e.g. "AVX2", "AVX3", "NEON") that dispatched kernels
// run on, chosen at run time from the CPU's features.
std::string SimdTargetName();

// Names of every target compiled into this binary and supported by this CPU,
// best first.
std::vector<std::string> SupportedSimdTargets();

}  // namespace mlp_offload

#endif  // MLP_OFFLOAD_KERNELS_TARGET_INFO_H_
