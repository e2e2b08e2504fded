// The training forward's RMSNorm, RoPE and SwiGLU with their backward
// (crates/arbor-ops/src/fused.rs has the formulas and the CPU reference).
// Storage T is f32 or bf16; all arithmetic is f32, each output rounded once.
#include "common.cuh"

typedef __nv_bfloat16 bf16;

// RMSNorm forward: y = x inv w, inv = 1 / sqrt(mean(x^2) + eps) over each
// row of d. Grid: one block per row; block a multiple of 32 (<= 1024).
template <typename T>
__device__ void rms_fwd(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y, int d,
                        float eps) {
  __shared__ float scratch[32];
  const size_t row = blockIdx.x;
  const T* xr = x + row * d;
  T* yr = y + row * d;
  float ss = 0.f;
  for (int e = threadIdx.x; e < d; e += blockDim.x) {
    const float v = to_f(xr[e]);
    ss += v * v;
  }
  const float inv = rsqrtf(block_sum(ss, scratch) / (float)d + eps);
  for (int e = threadIdx.x; e < d; e += blockDim.x) yr[e] = from_f<T>(to_f(xr[e]) * inv * to_f(w[e]));
}

// RMSNorm backward, rows blockIdx.x, blockIdx.x + gridDim.x, ...: with
// g = dy w, dx = inv g - x inv^3 mean(g x); this block's share of the
// weight's gradient, sum over its rows of dy x inv, goes to
// part[blockIdx.x, :] (f32; rms_dw sums the blocks). Dynamic shared memory:
// d floats. Block a multiple of 32 (<= 1024).
template <typename T>
__device__ void rms_bwd(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ dy,
                        T* __restrict__ dx, float* __restrict__ part, int rows, int d, float eps) {
  extern __shared__ float acc[];
  __shared__ float scratch[32];
  for (int e = threadIdx.x; e < d; e += blockDim.x) acc[e] = 0.f;
  for (int row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + (size_t)row * d;
    const T* gr = dy + (size_t)row * d;
    float ss = 0.f, gx = 0.f;
    for (int e = threadIdx.x; e < d; e += blockDim.x) {
      const float xv = to_f(xr[e]);
      ss += xv * xv;
      gx += to_f(gr[e]) * to_f(w[e]) * xv;
    }
    const float inv = rsqrtf(block_sum(ss, scratch) / (float)d + eps);
    const float c = block_sum(gx, scratch) / (float)d * inv * inv * inv;
    T* dxr = dx + (size_t)row * d;
    for (int e = threadIdx.x; e < d; e += blockDim.x) {
      const float xv = to_f(xr[e]), g = to_f(gr[e]);
      dxr[e] = from_f<T>(inv * g * to_f(w[e]) - c * xv);
      // Each thread owns its columns of acc: no race.
      acc[e] += g * xv * inv;
    }
  }
  for (int e = threadIdx.x; e < d; e += blockDim.x) part[(size_t)blockIdx.x * d + e] = acc[e];
}

// dw[e] = sum over p blocks of part[b, e], in block order (the same bits on
// every run). Grid-stride over e.
template <typename T>
__device__ void rms_dw(const float* __restrict__ part, T* __restrict__ dw, int p, int d) {
  for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < d; e += gridDim.x * blockDim.x) {
    float s = 0.f;
    for (int b = 0; b < p; ++b) s += part[(size_t)b * d + e];
    dw[e] = from_f<T>(s);
  }
}

// RoPE on x [n, heads, 2 half] with per-token cos, sin [n, half]:
// [x1 c - x2 s | x2 c + x1 s], s negated by sign = -1 (the backward).
// Grid-stride over the n heads half pairs.
template <typename T>
__device__ void rope(const T* __restrict__ x, const T* __restrict__ cs, const T* __restrict__ sn,
                     T* __restrict__ y, long long pairs, int heads, int half, float sign) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < pairs;
       i += (long long)gridDim.x * blockDim.x) {
    const long long head = i / half;  // token * heads + h
    const int j = (int)(i - head * half);
    const long long t = head / heads;
    const float c = to_f(cs[t * half + j]), s = sign * to_f(sn[t * half + j]);
    const T* xh = x + head * 2 * half;
    T* yh = y + head * 2 * half;
    const float x1 = to_f(xh[j]), x2 = to_f(xh[j + half]);
    yh[j] = from_f<T>(x1 * c - x2 * s);
    yh[j + half] = from_f<T>(x2 * c + x1 * s);
  }
}

__device__ __forceinline__ float sigmoid_f(float g) { return 1.f / (1.f + expf(-g)); }

// SwiGLU forward: y = silu(g) u = g sigmoid(g) u. Grid-stride over n.
template <typename T>
__device__ void swiglu_fwd(const T* __restrict__ g, const T* __restrict__ u, T* __restrict__ y,
                           long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    const float gv = to_f(g[i]);
    y[i] = from_f<T>(gv * sigmoid_f(gv) * to_f(u[i]));
  }
}

// SwiGLU backward into out = [dg (n) | du (n)], s = sigmoid(g):
// dg = dy u s (1 + g (1 - s)), du = dy g s.
template <typename T>
__device__ void swiglu_bwd(const T* __restrict__ g, const T* __restrict__ u, const T* __restrict__ dy,
                           T* __restrict__ out, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    const float gv = to_f(g[i]), uv = to_f(u[i]), d = to_f(dy[i]);
    const float s = sigmoid_f(gv);
    out[i] = from_f<T>(d * uv * s * (1.f + gv * (1.f - s)));
    out[n + i] = from_f<T>(d * gv * s);
  }
}

#define FUSED_OPS(T, SFX)                                                                               \
  extern "C" __global__ void fused_rms_fwd_##SFX(const T* x, const T* w, T* y, int d, float eps) {      \
    rms_fwd<T>(x, w, y, d, eps);                                                                        \
  }                                                                                                     \
  extern "C" __global__ void fused_rms_bwd_##SFX(const T* x, const T* w, const T* dy, T* dx,          \
                                                 float* part, int rows, int d, float eps) {             \
    rms_bwd<T>(x, w, dy, dx, part, rows, d, eps);                                                       \
  }                                                                                                     \
  extern "C" __global__ void fused_rms_dw_##SFX(const float* part, T* dw, int p, int d) {              \
    rms_dw<T>(part, dw, p, d);                                                                          \
  }                                                                                                     \
  extern "C" __global__ void fused_rope_##SFX(const T* x, const T* cs, const T* sn, T* y,              \
                                              long long pairs, int heads, int half, float sign) {      \
    rope<T>(x, cs, sn, y, pairs, heads, half, sign);                                                    \
  }                                                                                                     \
  extern "C" __global__ void fused_swiglu_fwd_##SFX(const T* g, const T* u, T* y, long long n) {       \
    swiglu_fwd<T>(g, u, y, n);                                                                          \
  }                                                                                                     \
  extern "C" __global__ void fused_swiglu_bwd_##SFX(const T* g, const T* u, const T* dy, T* out,      \
                                                    long long n) {                                      \
    swiglu_bwd<T>(g, u, dy, out, n);                                                                    \
  }

FUSED_OPS(float, f32)
FUSED_OPS(bf16, bf16)
