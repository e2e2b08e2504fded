// Advantage gather/scatter between segments and token positions.
//
// broadcast: out[i] = vals[seg[i]] (0 where seg[i] < 0), [N] from [S].
// sum:       out[s] = sum_{i: seg[i] = s} x[i], [S] from [N] (out zeroed
//            first by segment_zero; float atomics, order not fixed).
#include "common.cuh"

extern "C" __global__ void segment_broadcast(const float* vals, const int64_t* seg, float* out, int n, int s) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const int64_t k = seg[i];
    out[i] = (k >= 0 && k < s) ? vals[k] : 0.f;
  }
}

extern "C" __global__ void segment_zero(float* out, int s) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < s; i += gridDim.x * blockDim.x) out[i] = 0.f;
}

extern "C" __global__ void segment_sum(const float* x, const int64_t* seg, float* out, int n, int s) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const int64_t k = seg[i];
    if (k >= 0 && k < s) atomicAdd(out + k, x[i]);
  }
}
