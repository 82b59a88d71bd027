// CUDA side of the GPU layer (nvcc, --config=cuda only): host-memory
// registration for DMA and the gradient statistics kernel that gradient
// clipping and loss-scale checks need before the device-to-host copy.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "gpu/internal/cuda_api.h"

namespace mlp_offload {
namespace internal_gpu {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 1024;

// Makes `device` current on the calling thread for the guard's life, and
// the thread's device before it current again after: torch keeps its
// current device (torch.cuda.current_device(), where a bare "cuda" tensor
// goes) in the same per-thread runtime state, which a registration for a
// model on another device must not move. Nothing is switched when `device`
// is current already (the usual case: one device per process, or
// autograd's thread for the gradient's device).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    int current = -1;
    if (cudaGetDevice(&current) == cudaSuccess && current == device) return;
    previous_ = current;
    status_ = cudaSetDevice(device);
  }
  ~DeviceGuard() {
    if (previous_ >= 0 && status_ == cudaSuccess) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  cudaError_t status() const { return status_; }

 private:
  int previous_ = -1;  // -1: nothing to restore
  cudaError_t status_ = cudaSuccess;
};

int Fail(cudaError_t e, const char** error) {
  *error = cudaGetErrorString(e);
  cudaGetLastError();  // clear a non-sticky error so later calls start clean
  return static_cast<int>(e);
}

template <typename T>
__device__ __forceinline__ float Load(const T* p, uint64_t i);
template <>
__device__ __forceinline__ float Load<float>(const float* p, uint64_t i) {
  return p[i];
}
template <>
__device__ __forceinline__ float Load<__nv_bfloat16>(const __nv_bfloat16* p,
                                                     uint64_t i) {
  return __bfloat162float(p[i]);
}
template <>
__device__ __forceinline__ float Load<__half>(const __half* p, uint64_t i) {
  return __half2float(p[i]);
}

// Grid-stride sum of squares and NaN/Inf flag; one atomic per block.
template <typename T>
__global__ void GradStatsKernel(const T* __restrict__ grad, uint64_t n,
                                float* sumsq, int* nonfinite) {
  __shared__ float partial[kThreads];
  __shared__ int bad_block;
  if (threadIdx.x == 0) bad_block = 0;
  __syncthreads();
  float acc = 0.f;
  int bad = 0;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i =
           static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < n; i += stride) {
    const float v = Load<T>(grad, i);
    bad |= !isfinite(v);
    acc += v * v;
  }
  partial[threadIdx.x] = acc;
  if (bad) bad_block = 1;  // benign race: every writer stores 1
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    atomicAdd(sumsq, partial[0]);
    if (bad_block) atomicOr(nonfinite, 1);
  }
}

template <typename T>
void Launch(const void* grad, uint64_t n, float* sumsq, int* nonfinite,
            cudaStream_t stream) {
  uint64_t blocks = (n + kThreads - 1) / kThreads;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  if (blocks == 0) blocks = 1;
  GradStatsKernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<const T*>(grad), n, sumsq, nonfinite);
}

}  // namespace

int DeviceCount(int* count, const char** error) {
  *count = 0;
  const cudaError_t e = cudaGetDeviceCount(count);
  if (e != cudaSuccess) {
    *count = 0;
    return Fail(e, error);
  }
  return 0;
}

int HostRegister(int device, void* data, size_t bytes, const char** error) {
  DeviceGuard guard(device);
  cudaError_t e = guard.status();
  if (e == cudaSuccess)
    e = cudaHostRegister(data, bytes, cudaHostRegisterPortable);
  return e == cudaSuccess ? 0 : Fail(e, error);
}

int HostUnregister(int device, void* data, const char** error) {
  DeviceGuard guard(device);
  cudaError_t e = guard.status();
  if (e == cudaSuccess) e = cudaHostUnregister(data);
  return e == cudaSuccess ? 0 : Fail(e, error);
}

int LaunchGradStats(int device, const void* grad, int type, uint64_t n,
                    float* sumsq, int* nonfinite, void* stream,
                    const char** error) {
  if (n == 0) return 0;
  DeviceGuard guard(device);
  if (guard.status() != cudaSuccess) return Fail(guard.status(), error);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (type) {
    case kGradFloat32:
      Launch<float>(grad, n, sumsq, nonfinite, s);
      break;
    case kGradBFloat16:
      Launch<__nv_bfloat16>(grad, n, sumsq, nonfinite, s);
      break;
    case kGradFloat16:
      Launch<__half>(grad, n, sumsq, nonfinite, s);
      break;
    default:
      *error = "unknown gradient type";
      return static_cast<int>(cudaErrorInvalidValue);
  }
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? 0 : Fail(e, error);
}

}  // namespace internal_gpu
}  // namespace mlp_offload
