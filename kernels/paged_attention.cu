// Paged attention over the engine's block tables (decode, and prefill over
// cached prefixes), bf16/f16/f32 storage with f32 accumulation.
//
// New token i (sequence s = seq[i], position p = pos[i]), query head h, KV
// head h / (nh / nkv):
//   o = sum_{j <= p} softmax_j(q . k_j / sqrt(d)) v_j,
//   k_j at cache row (table_s[j / bs] * bs + j % bs) * nkv + kvh.
// q: [t, nh, d]; caches: [slots, nkv, d]; tables: [S, maxb]; out: [t, nh, d].
// One block per (token, query head); each warp runs an online softmax over
// keys j = warp, warp + nwarps, ...; lanes split the head dimension (d <= 256);
// warps merge through shared memory at the end.
#include "common.cuh"

#define MAXE 8

template <typename T>
__device__ void paged_attn(const T* __restrict__ q, const T* __restrict__ kc, const T* __restrict__ vc,
                           const uint32_t* __restrict__ pos, const uint32_t* __restrict__ seq,
                           const uint32_t* __restrict__ tables, T* __restrict__ out, int nh, int nkv, int d,
                           int bs, int maxb, float scale) {
  extern __shared__ float sacc[];  // [nwarps, d]
  __shared__ float sm_m[32], sm_l[32];
  const int i = blockIdx.x, h = blockIdx.y;
  const int kvh = h / (nh / nkv);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int ctx = (int)pos[i] + 1;
  const uint32_t* table = tables + (size_t)seq[i] * maxb;
  const T* qrow = q + ((size_t)i * nh + h) * d;
  float qr[MAXE], acc[MAXE];
#pragma unroll
  for (int k = 0; k < MAXE; ++k) {
    const int e = lane + 32 * k;
    qr[k] = e < d ? to_f(qrow[e]) * scale : 0.f;
    acc[k] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  for (int j = warp; j < ctx; j += nw) {
    const size_t slot = (size_t)table[j / bs] * bs + (j % bs);
    const T* kr = kc + (slot * nkv + kvh) * d;
    const T* vr = vc + (slot * nkv + kvh) * d;
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < MAXE; ++k) {
      const int e = lane + 32 * k;
      if (e < d) s += qr[k] * to_f(kr[e]);
    }
    s = warp_sum(s);
    const float mn = fmaxf(m, s);
    const float corr = __expf(m - mn);
    const float p = __expf(s - mn);
    l = l * corr + p;
#pragma unroll
    for (int k = 0; k < MAXE; ++k) {
      const int e = lane + 32 * k;
      acc[k] = acc[k] * corr + (e < d ? p * to_f(vr[e]) : 0.f);
    }
    m = mn;
  }
  if (lane == 0) { sm_m[warp] = m; sm_l[warp] = l; }
#pragma unroll
  for (int k = 0; k < MAXE; ++k) {
    const int e = lane + 32 * k;
    if (e < d) sacc[warp * d + e] = acc[k];
  }
  __syncthreads();
  float M = -INFINITY;
  for (int w = 0; w < nw; ++w) M = fmaxf(M, sm_m[w]);
  float L = 0.f;
  for (int w = 0; w < nw; ++w)
    if (sm_m[w] > -INFINITY) L += sm_l[w] * __expf(sm_m[w] - M);
  T* orow = out + ((size_t)i * nh + h) * d;
  for (int e = threadIdx.x; e < d; e += blockDim.x) {
    float o = 0.f;
    for (int w = 0; w < nw; ++w)
      if (sm_m[w] > -INFINITY) o += sacc[w * d + e] * __expf(sm_m[w] - M);
    orow[e] = from_f<T>(o / L);
  }
}

// Write the step's new K or V rows (src: [t, row]) into their cache slots.
// A slot past the cache (n_slots) is skipped, never written out of bounds;
// callers validate slots on the host, where they come from.
template <typename T>
__device__ void cache_write(const T* __restrict__ src, T* __restrict__ cache, const uint32_t* __restrict__ slots,
                            int t, int row, uint32_t n_slots) {
  const size_t total = (size_t)t * row;
  for (size_t x = (size_t)blockIdx.x * blockDim.x + threadIdx.x; x < total; x += (size_t)gridDim.x * blockDim.x) {
    const size_t i = x / row, e = x % row;
    if (slots[i] < n_slots) cache[(size_t)slots[i] * row + e] = src[x];
  }
}

#define PAGED_OPS(TY, SUF)                                                                              \
  extern "C" __global__ void paged_attention_##SUF(const TY* q, const TY* kc, const TY* vc,              \
                                                   const uint32_t* pos, const uint32_t* seq,              \
                                                   const uint32_t* tables, TY* out, int nh, int nkv,      \
                                                   int d, int bs, int maxb, float scale) {                \
    paged_attn<TY>(q, kc, vc, pos, seq, tables, out, nh, nkv, d, bs, maxb, scale);                     \
  }                                                                                                     \
  extern "C" __global__ void cache_write_##SUF(const TY* src, TY* cache, const uint32_t* slots, int t,   \
                                               int row, uint32_t n_slots) {                             \
    cache_write<TY>(src, cache, slots, t, row, n_slots);                                                \
  }

PAGED_OPS(float, f32)
PAGED_OPS(__nv_bfloat16, bf16)
PAGED_OPS(__half, f16)
