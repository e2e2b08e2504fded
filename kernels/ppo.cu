// Masked clipped PPO loss and clipped value loss, forward (grid-stride
// blocks, each reduced then added atomically into a zeroed output: the
// summation order is not fixed) and backward (per token).
//
// PPO, token t with aux_t = (logp_old, A, w, _): r = exp(logp - logp_old),
//   L_t = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)
//   out = (sum w L, sum w [clipped], sum w (r - 1 - log r), sum w)
// The weight w carries the mask and the aggregation (token level: 1/sum(mask);
// sequence level: 1/(n_seq * len_seq)); the third term is the k3 KL estimate.
//   dL/dlogp = -A r where the unclipped term is the minimum, else 0.
//   d(k3)/dlogp = r - 1.
//
// Value, aux_t = (R, v_old, w, _), clip c (c <= 0: off):
//   vc = v_old + clamp(v - v_old, -c, c),  L_t = 0.5 max((v - R)^2, (vc - R)^2)
//   out = (sum w L, sum w [clipped term larger])
#include "common.cuh"

__device__ __forceinline__ void ppo_token(float logp, const float* a, float eps_low, float eps_high,
                                          float* loss, float* clipped, float* k3, float* dloss, float* dk3) {
  const float lr = logp - a[0];
  const float r = __expf(lr);
  const float adv = a[1];
  const float rc = fminf(fmaxf(r, 1.f - eps_low), 1.f + eps_high);
  const float un = r * adv, cl = rc * adv;
  const bool use_clip = cl < un;
  *loss = -(use_clip ? cl : un);
  *clipped = use_clip ? 1.f : 0.f;
  *k3 = r - 1.f - lr;
  *dloss = use_clip ? 0.f : -adv * r;
  *dk3 = r - 1.f;
}

extern "C" __global__ void ppo_loss_fwd(const float* logp, const float* aux, float* out, int n,
                                        float eps_low, float eps_high) {
  __shared__ float scratch[32];
  float s_loss = 0.f, s_clip = 0.f, s_kl = 0.f, s_w = 0.f;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const float* a = aux + 4 * (size_t)i;
    const float w = a[2];
    if (w == 0.f) continue;
    float loss, clipped, k3, dl, dk;
    ppo_token(logp[i], a, eps_low, eps_high, &loss, &clipped, &k3, &dl, &dk);
    s_loss += w * loss;
    s_clip += w * clipped;
    s_kl += w * k3;
    s_w += w;
  }
  s_loss = block_sum(s_loss, scratch);
  s_clip = block_sum(s_clip, scratch);
  s_kl = block_sum(s_kl, scratch);
  s_w = block_sum(s_w, scratch);
  if (threadIdx.x == 0) {
    atomicAdd(out + 0, s_loss);
    atomicAdd(out + 1, s_clip);
    atomicAdd(out + 2, s_kl);
    atomicAdd(out + 3, s_w);
  }
}

extern "C" __global__ void ppo_loss_bwd(const float* logp, const float* aux, const float* gout, float* glogp,
                                        int n, float eps_low, float eps_high) {
  const float g_loss = gout[0], g_kl = gout[2];
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const float* a = aux + 4 * (size_t)i;
    const float w = a[2];
    float loss, clipped, k3, dl, dk;
    ppo_token(logp[i], a, eps_low, eps_high, &loss, &clipped, &k3, &dl, &dk);
    glogp[i] = w == 0.f ? 0.f : w * (g_loss * dl + g_kl * dk);
  }
}

__device__ __forceinline__ void value_token(float v, const float* a, float clip, float* loss, float* clipped,
                                            float* dv) {
  const float R = a[0], vold = a[1];
  const float du = v - R;
  const float lu = 0.5f * du * du;
  if (clip <= 0.f) { *loss = lu; *clipped = 0.f; *dv = du; return; }
  // Inside the clip range the clipped prediction is v itself: decide that
  // from d alone, because vold + (v - vold) need not round back to v, and
  // an ulp above lu would count the token as clipped.
  const float d = v - vold;
  const float dc = d > clip ? vold + clip - R : (d < -clip ? vold - clip - R : du);
  const float lc = 0.5f * dc * dc;
  if (lc > lu) {
    *loss = lc;
    *clipped = 1.f;
    *dv = 0.f;
  } else {
    *loss = lu;
    *clipped = 0.f;
    *dv = du;
  }
}

extern "C" __global__ void value_loss_fwd(const float* v, const float* aux, float* out, int n, float clip) {
  __shared__ float scratch[32];
  float s_loss = 0.f, s_clip = 0.f;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const float* a = aux + 4 * (size_t)i;
    const float w = a[2];
    if (w == 0.f) continue;
    float loss, clipped, dv;
    value_token(v[i], a, clip, &loss, &clipped, &dv);
    s_loss += w * loss;
    s_clip += w * clipped;
  }
  s_loss = block_sum(s_loss, scratch);
  s_clip = block_sum(s_clip, scratch);
  if (threadIdx.x == 0) {
    atomicAdd(out + 0, s_loss);
    atomicAdd(out + 1, s_clip);
  }
}

extern "C" __global__ void value_loss_bwd(const float* v, const float* aux, const float* gout, float* gv, int n,
                                          float clip) {
  const float g = gout[0];
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const float* a = aux + 4 * (size_t)i;
    const float w = a[2];
    float loss, clipped, dv;
    value_token(v[i], a, clip, &loss, &clipped, &dv);
    gv[i] = w == 0.f ? 0.f : g * w * dv;
  }
}
