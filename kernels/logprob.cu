// Fused log-softmax + gather over chunks of logits, and its backward.
//
// Forward, one block per row r of a logits chunk [rows, V]:
//   lse_r = log sum_v exp(z_rv),  logp_r = z_r,y_r - lse_r,
//   H_r = lse_r - sum_v softmax(z_r)_v z_rv   (entropy)
// in one pass with an online (max, sum, weighted sum) state, f32 throughout.
// out[r] = (logp, H, lse), row-major [rows, 3], written at `out + 3*row0`.
//
// Backward over a vocab chunk [N, Vc] starting at column v0 (in place):
//   p = exp(z - lse),
//   dz = g_lp (1[v == y] - p) - g_ent p (z - lse + H) + g_lse p
// with aux[n] = (y, g_lp, g_ent, g_lse, lse, H) as float, [N, 6].
#include "common.cuh"

template <typename T>
__device__ void logprob_rows(const T* __restrict__ logits, const uint32_t* __restrict__ targets,
                             float* __restrict__ out, int vocab) {
  __shared__ float scratch[32];
  __shared__ float sm_m[32], sm_s[32], sm_t[32];
  const int r = blockIdx.x;
  const T* row = logits + (size_t)r * vocab;
  SoftmaxState st = {-INFINITY, 0.f, 0.f};
  for (int v = threadIdx.x; v < vocab; v += blockDim.x) {
    float z = to_f(row[v]);
    SoftmaxState one = {z, 1.f, z};
    st = sm_merge(st, one);
  }
  // Warp then block merge of the online states.
  for (int o = 16; o > 0; o >>= 1) {
    SoftmaxState other;
    other.m = __shfl_xor_sync(0xffffffffu, st.m, o);
    other.s = __shfl_xor_sync(0xffffffffu, st.s, o);
    other.t = __shfl_xor_sync(0xffffffffu, st.t, o);
    st = sm_merge(st, other);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  if (lane == 0) { sm_m[warp] = st.m; sm_s[warp] = st.s; sm_t[warp] = st.t; }
  __syncthreads();
  if (threadIdx.x == 0) {
    SoftmaxState acc = {sm_m[0], sm_s[0], sm_t[0]};
    for (int w = 1; w < nwarps; ++w) {
      SoftmaxState b = {sm_m[w], sm_s[w], sm_t[w]};
      acc = sm_merge(acc, b);
    }
    float lse = acc.m + logf(acc.s);
    float zy = to_f(row[targets[r]]);
    out[3 * r + 0] = zy - lse;
    out[3 * r + 1] = lse - acc.t / acc.s;
    out[3 * r + 2] = lse;
  }
  (void)scratch;
}

template <typename T>
__device__ void logprob_grad(T* __restrict__ z, const float* __restrict__ aux, int rows, int vc, int v0) {
  const size_t total = (size_t)rows * vc;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
    const int r = (int)(i / vc);
    const int v = (int)(i % vc) + v0;
    const float* a = aux + 6 * (size_t)r;
    const float lse = a[4], h = a[5];
    const float zf = to_f(z[i]);
    const float lp = zf - lse;
    const float p = __expf(lp);
    float d = a[1] * (((uint32_t)a[0] == (uint32_t)v ? 1.f : 0.f) - p) - a[2] * p * (lp + h) + a[3] * p;
    z[i] = from_f<T>(d);
  }
}

#define LOGPROB_OPS(TY, SUF)                                                                         \
  extern "C" __global__ void logprob_rows_##SUF(const TY* logits, const uint32_t* targets, float* out, \
                                                int vocab) {                                          \
    logprob_rows<TY>(logits, targets, out, vocab);                                                   \
  }                                                                                                  \
  extern "C" __global__ void logprob_grad_##SUF(TY* z, const float* aux, int rows, int vc, int v0) {  \
    logprob_grad<TY>(z, aux, rows, vc, v0);                                                          \
  }

LOGPROB_OPS(float, f32)
LOGPROB_OPS(__nv_bfloat16, bf16)
LOGPROB_OPS(__half, f16)

// acc += x (n elements) with an f32 accumulator, for summing the chunked
// dh in full precision whatever the input dtype (rounded once at the end).
#define ADD_TO_F32(TY, SUF)                                                                 \
  extern "C" __global__ void add_to_f32_##SUF(float* acc, const TY* x, size_t n) {          \
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;                    \
         i += (size_t)gridDim.x * blockDim.x)                                                \
      acc[i] += to_f(x[i]);                                                                  \
  }
ADD_TO_F32(float, f32)
ADD_TO_F32(__nv_bfloat16, bf16)
ADD_TO_F32(__half, f16)
