// Token sampling on the device: one block per request, over one row of f32
// logits, so only token ids, logprobs and entropies come back to the host.
//
// Request r reads row rows[r] of logits [n_rows, V]; params[3r..3r+3] hold
// (row, 1/T, u) as doubles: 1/T = 0 is greedy (argmax, lowest id on ties),
// u in [0, 1) is the sequence's own uniform draw (from its host RNG, so a
// sequence's samples do not depend on its batch neighbours and match the
// CPU engine's for the same logits).
//
// With s_v = (l_v - max l) / T (T = 1 for greedy) and w_v = exp(s_v),
// Z = sum_v w_v (f64):
//   sampled token: the first v in id order with sum_{j <= v} w_j > u Z
//                  (inverse CDF; the last v with w_v > 0 should rounding
//                  leave the running sum short);
//   logprob:       ln(w_tok / Z)  (greedy: (l_tok - max l) - ln Z);
//   entropy:       ln Z - sum_v w_v s_v / Z.
// A row that holds no distribution (a NaN, +inf, or nothing above -inf)
// gives token 0xffffffff.
//
// out[3r] = token, out[3r+1] = logprob bits, out[3r+2] = entropy bits.
//
// Each thread owns one contiguous chunk of the row; an exclusive scan of
// the chunk sums over the block gives each chunk its start, and the thread
// with start <= u Z < the next chunk's start walks its chunk. Should the
// scan's rounding let two chunks claim the draw, the lower token wins;
// should the walk fall short, the chunk's last token with weight is taken
// (the host reference takes the row's; the two differ only within
// rounding of the chunk's end).
#include "common.cuh"

#define SAMPLE_THREADS 1024

__device__ __forceinline__ double warp_sum_d(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_rows(const float* __restrict__ logits, const double* __restrict__ params, int V,
                uint32_t* __restrict__ out) {
  __shared__ float s_max[32];
  __shared__ int s_arg[32];
  __shared__ int s_last[32];
  __shared__ double s_sum[32], s_ws[32], s_scan[32];
  __shared__ uint32_t s_tok;
  __shared__ double s_excl[SAMPLE_THREADS];
  const int r = blockIdx.x;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int nw = blockDim.x >> 5;
  const size_t row = (size_t)params[3 * r];
  const double inv_t_req = params[3 * r + 1];
  const double u = params[3 * r + 2];
  const bool greedy = inv_t_req == 0.0;
  const float inv_t = greedy ? 1.f : (float)inv_t_req;
  const float* l = logits + row * (size_t)V;
  const int chunk = (V + blockDim.x - 1) / blockDim.x;
  const int lo = min(V, tid * chunk), hi = min(V, lo + chunk);

  // 1. max and argmax (lowest id on ties; fmaxf skips NaN, which the sum
  //    below then catches).
  float m = -INFINITY;
  int arg = 0x7fffffff;
  for (int i = lo; i < hi; ++i) {
    const float x = l[i];
    if (x > m) { m = x; arg = i; }
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float om = __shfl_xor_sync(0xffffffffu, m, o);
    const int oa = __shfl_xor_sync(0xffffffffu, arg, o);
    if (om > m || (om == m && oa < arg)) { m = om; arg = oa; }
  }
  if (lane == 0) { s_max[warp] = m; s_arg[warp] = arg; }
  __syncthreads();
  if (warp == 0) {
    m = lane < nw ? s_max[lane] : -INFINITY;
    arg = lane < nw ? s_arg[lane] : 0x7fffffff;
    for (int o = 16; o > 0; o >>= 1) {
      const float om = __shfl_xor_sync(0xffffffffu, m, o);
      const int oa = __shfl_xor_sync(0xffffffffu, arg, o);
      if (om > m || (om == m && oa < arg)) { m = om; arg = oa; }
    }
    if (lane == 0) { s_max[0] = m; s_arg[0] = arg; }
  }
  __syncthreads();
  m = s_max[0];
  arg = s_arg[0];

  // 2. This chunk's sum of w and of w s, and its last id with w > 0.
  double cs = 0.0, cws = 0.0;
  int last = -1;
  for (int i = lo; i < hi; ++i) {
    const float s = (l[i] - m) * inv_t;
    const float w = __expf(s);
    cs += (double)w;
    if (w > 0.f) { cws += (double)w * (double)s; last = i; }
  }
  // 3. Exclusive scan of the chunk sums (thread order = id order), and the
  //    block's totals.
  double incl = cs;
  for (int o = 1; o < 32; o <<= 1) {
    const double y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  double ws = warp_sum_d(cws);
  int lst = last;
  for (int o = 16; o > 0; o >>= 1) lst = max(lst, __shfl_xor_sync(0xffffffffu, lst, o));
  if (lane == 31) s_sum[warp] = incl;
  if (lane == 0) { s_ws[warp] = ws; s_last[warp] = lst; }
  __syncthreads();
  if (warp == 0) {
    double t = lane < nw ? s_sum[lane] : 0.0;
    double tin = t;
    for (int o = 1; o < 32; o <<= 1) {
      const double y = __shfl_up_sync(0xffffffffu, tin, o);
      if (lane >= o) tin += y;
    }
    s_scan[lane] = tin - t;  // exclusive prefix of warp `lane`
    double w2 = lane < nw ? s_ws[lane] : 0.0;
    w2 = warp_sum_d(w2);
    int l2 = lane < nw ? s_last[lane] : -1;
    for (int o = 16; o > 0; o >>= 1) l2 = max(l2, __shfl_xor_sync(0xffffffffu, l2, o));
    // Grand total: the last warp's exclusive prefix plus its sum.
    const double total = __shfl_sync(0xffffffffu, tin, 31);
    if (lane == 0) {
      s_sum[0] = total;
      s_ws[0] = w2;
      s_last[0] = l2;
      s_tok = 0xffffffffu;
    }
  }
  __syncthreads();
  const double total = s_sum[0];
  const bool valid = isfinite(m) && total >= 1.0 && isfinite(total);
  if (!valid) {
    if (tid == 0) {
      out[3 * r] = 0xffffffffu;
      out[3 * r + 1] = __float_as_uint(NAN);
      out[3 * r + 2] = __float_as_uint(NAN);
    }
    return;
  }
  const double entropy = log(total) - s_ws[0] / total;
  if (greedy) {
    if (tid == 0) {
      const float lp = (l[arg] - m) - (float)log(total);
      out[3 * r] = (uint32_t)arg;
      out[3 * r + 1] = __float_as_uint(lp);
      out[3 * r + 2] = __float_as_uint((float)entropy);
    }
    return;
  }
  // 4. The crossing: the thread with start <= target < next start walks
  //    (its own last token with w > 0 should rounding leave it short).
  const double target = u * total;
  const double below = __shfl_up_sync(0xffffffffu, incl, 1);
  const double excl = s_scan[warp] + (lane > 0 ? below : 0.0);
  s_excl[tid] = excl;
  __syncthreads();
  const double next = tid + 1 < (int)blockDim.x ? s_excl[tid + 1] : total;
  if (excl <= target && target < next && last >= 0) {
    double acc = excl;
    uint32_t pick = (uint32_t)last;
    for (int i = lo; i < hi; ++i) {
      acc += (double)__expf((l[i] - m) * inv_t);
      if (acc > target) {
        pick = (uint32_t)i;
        break;
      }
    }
    atomicMin(&s_tok, pick);
  }
  __syncthreads();
  if (tid == 0) {
    uint32_t tok = s_tok;
    if (tok == 0xffffffffu) tok = (uint32_t)max(s_last[0], 0);
    const double w = (double)__expf((l[tok] - m) * inv_t);
    out[3 * r] = tok;
    out[3 * r + 1] = __float_as_uint((float)log(w / total));
    out[3 * r + 2] = __float_as_uint((float)entropy);
  }
}
