// The dedicated decode step's fused kernels (bf16 storage, f32 arithmetic).
// One decode step of a Qwen-family model over a batch of B tokens runs, per
// layer: fd_add_rmsnorm -> one QKV GEMM (cuBLAS, over the concatenated
// weights) -> fd_qk_rope_write -> paged attention (paged_attention.cu) -> O
// GEMM -> fd_add_rmsnorm -> one gate|up GEMM -> fd_silu_mul -> down GEMM;
// then the final fd_add_rmsnorm,
// the LM head GEMM and sample_rows (sample.cu). The residual stream stays
// in f32 for the whole step.
#include "common.cuh"

typedef __nv_bfloat16 bf16;

// resid[b, :] = embed[ids[b], :] (as f32). Grid B, any block size.
extern "C" __global__ void fd_embed(const bf16* __restrict__ embed, const uint32_t* __restrict__ ids,
                                    float* __restrict__ resid, int H) {
  const int b = blockIdx.x;
  const bf16* row = embed + (size_t)ids[b] * H;
  for (int e = threadIdx.x; e < H; e += blockDim.x) resid[(size_t)b * H + e] = __bfloat162float(row[e]);
}

// RMSNorm of the residual stream after adding `delta` (when add != 0):
//   r += delta;  out = bf16(bf16(r / sqrt(mean(r^2) + eps)) * w)
// (HF's order: normalise in f32, cast, scale by the weight). Grid B,
// block a multiple of 32 (<= 1024).
extern "C" __global__ void fd_add_rmsnorm(float* __restrict__ resid, const bf16* __restrict__ delta,
                                          const bf16* __restrict__ w, bf16* __restrict__ out, int H,
                                          float eps, int add) {
  __shared__ float scratch[32];
  const int b = blockIdx.x;
  float* r = resid + (size_t)b * H;
  float ss = 0.f;
  for (int e = threadIdx.x; e < H; e += blockDim.x) {
    float x = r[e];
    if (add) {
      x += __bfloat162float(delta[(size_t)b * H + e]);
      r[e] = x;
    }
    ss += x * x;
  }
  const float inv = rsqrtf(block_sum(ss, scratch) / (float)H + eps);
  for (int e = threadIdx.x; e < H; e += blockDim.x) {
    const float n = __bfloat162float(__float2bfloat16(r[e] * inv));
    out[(size_t)b * H + e] = __float2bfloat16(n * __bfloat162float(w[e]));
  }
}

// Per token b and head h (grid (B, nh + nkv), block d rounded up to a
// multiple of 32 threads, d even and <= 1024): the projection's bias (when
// given), the head's RMSNorm (Qwen3's q_norm / k_norm, when given), RoPE at
// the token's position (HF's
// rotate_half: [x1 c - x2 s | x2 c + x1 s], angle = pos * inv_freq[i]),
// then query heads to q_out [B, nh, d] and key heads, with their value
// heads (bias only), to cache row slots[b] * nkv + kvh. A slot >= n_slots
// (a padding row) writes nothing to the cache. Token b's projections start
// at q + b q_stride, k + b kv_stride and v + b kv_stride (one QKV GEMM's
// output: q, k and v point into the same rows).
extern "C" __global__ void fd_qk_rope_write(
    const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
    const bf16* __restrict__ q_bias, const bf16* __restrict__ k_bias, const bf16* __restrict__ v_bias,
    const bf16* __restrict__ q_norm, const bf16* __restrict__ k_norm, float eps,
    const float* __restrict__ inv_freq, const uint32_t* __restrict__ pos, const uint32_t* __restrict__ slots,
    uint32_t n_slots, bf16* __restrict__ q_out, bf16* __restrict__ k_cache, bf16* __restrict__ v_cache,
    int nh, int nkv, int d, int q_stride, int kv_stride) {
  __shared__ float x[1024];
  __shared__ float scratch[32];
  const int b = blockIdx.x, h = blockIdx.y, e = threadIdx.x;
  const bool is_q = h < nh;
  const int head = is_q ? h : h - nh;
  const bf16* src = (is_q ? q + (size_t)b * q_stride : k + (size_t)b * kv_stride) + (size_t)head * d;
  const bf16* bias = is_q ? q_bias : k_bias;
  const bf16* norm = is_q ? q_norm : k_norm;
  // Threads past the head (a partial last warp) take part in the sum with 0.
  const bool in_head = e < d;
  float val = in_head ? __bfloat162float(src[e]) : 0.f;
  if (bias && in_head) val = __bfloat162float(__float2bfloat16(val + __bfloat162float(bias[head * d + e])));
  if (norm) {
    const float inv = rsqrtf(block_sum(val * val, scratch) / (float)d + eps);
    if (in_head) val = __bfloat162float(__float2bfloat16(val * inv)) * __bfloat162float(norm[e]);
  }
  if (in_head) x[e] = val;
  __syncthreads();
  if (!in_head) return;
  const int half = d / 2;
  const int i = e < half ? e : e - half;
  const float angle = (float)pos[b] * inv_freq[i];
  const float c = cosf(angle), s = sinf(angle);
  const float y = e < half ? x[e] * c - x[e + half] * s : x[e] * c + x[e - half] * s;
  if (is_q) {
    q_out[((size_t)b * nh + head) * d + e] = __float2bfloat16(y);
    return;
  }
  const uint32_t slot = slots[b];
  if (slot >= n_slots) return;
  const size_t row = ((size_t)slot * nkv + head) * d + e;
  k_cache[row] = __float2bfloat16(y);
  float vv = __bfloat162float(v[(size_t)b * kv_stride + (size_t)head * d + e]);
  if (v_bias) vv += __bfloat162float(v_bias[head * d + e]);
  v_cache[row] = __float2bfloat16(vv);
}

// out [rows, inter] = silu(gate) * up (f32 arithmetic, one rounding) over
// n = rows x inter elements; row r of gate and up starts at r * stride (one
// gate|up GEMM's output: up = gate + inter, stride 2 inter).
extern "C" __global__ void fd_silu_mul(const bf16* __restrict__ gate, const bf16* __restrict__ up,
                                       bf16* __restrict__ out, int n, int inter, int stride) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const size_t at = (size_t)(i / inter) * stride + i % inter;
    const float g = __bfloat162float(gate[at]);
    out[i] = __float2bfloat16(g / (1.f + __expf(-g)) * __bfloat162float(up[at]));
  }
}

// dst[r, :] = src[idx[r], :] (bf16 rows of width H): the last token of each
// sequence, the rows the LM head reads. Grid R, any block size.
extern "C" __global__ void fd_gather_rows(const bf16* __restrict__ src, const uint32_t* __restrict__ idx,
                                          bf16* __restrict__ dst, int H) {
  const int r = blockIdx.x;
  const bf16* s = src + (size_t)idx[r] * H;
  for (int e = threadIdx.x; e < H; e += blockDim.x) dst[(size_t)r * H + e] = s[e];
}

// dst = bf16(src) over n elements: an f32 policy's weights into the fused
// step's bf16 copy (the same buffers each time, so captured graphs stay
// valid).
extern "C" __global__ void fd_cast_bf16(const float* __restrict__ src, bf16* __restrict__ dst, size_t n) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    dst[i] = __float2bfloat16(src[i]);
}

// dst = src over n bf16 elements: a bf16 policy's Q, K, V (and gate, up)
// weights into the fused step's concatenated copy.
extern "C" __global__ void fd_copy_bf16(const bf16* __restrict__ src, bf16* __restrict__ dst, size_t n) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    dst[i] = src[i];
}
