// C model of the two inner kernels of Arbor's AVX-512 paged attention
// (`arbor_ops::attention::attend_group`), head size 64, operands in cache:
//  - score16: one query against 16 key rows (64 floats each, at 16
//    pointers): 16 dot products of 4 chains (q0 k0, then FMAs), their
//    lanes summed by the same 16 x 16 shuffle tree as `simd::hsum16`, times
//    the scale, masked store. Called 12 times on the same rows (a fork
//    group's 4 tokens x 3 query heads per KV head).
//  - weigh: sum_j p_rj v_j for 3 query heads sharing the value rows (12
//    accumulators; per row 4 loads, 3 broadcasts, 12 FMAs), 32 rows a call.
// Prints core cycles (at an assumed 3.6 GHz; set GHZ) per call / per row.
// On a 2-core Zen 4 (docs/benchmarks.md, fourteenth session): score16
// 78-81 cycles, weigh 12-14 cycles a row (12 zmm FMAs).
//   gcc -O3 -mavx512f -mfma attn512_kernels.c -o attn512_kernels && ./attn512_kernels
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static inline __m512 hsum16(const __m512 *v) {
  __m512 u[8], w[4];
  for (int p = 0; p < 8; p++)
    u[p] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0xEE));
  for (int r = 0; r < 4; r++)
    w[r] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * r], u[2 * r + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * r], u[2 * r + 1], 0xDD));
  __m512 z0 = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x44), _mm512_shuffle_ps(w[0], w[1], 0xEE));
  __m512 z1 = _mm512_add_ps(_mm512_shuffle_ps(w[2], w[3], 0x44), _mm512_shuffle_ps(w[2], w[3], 0xEE));
  __m512 r = _mm512_add_ps(_mm512_shuffle_ps(z0, z1, 0x88), _mm512_shuffle_ps(z0, z1, 0xDD));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

__attribute__((noinline)) void score16(const float *q, const float *const *kr, float *dst, __m512 scale) {
  __m512 q0 = _mm512_loadu_ps(q), q1 = _mm512_loadu_ps(q + 16), q2 = _mm512_loadu_ps(q + 32),
         q3 = _mm512_loadu_ps(q + 48);
  __m512 d[16];
  for (int l = 0; l < 16; l++) {
    const float *k = kr[l];
    __m512 a = _mm512_mul_ps(q0, _mm512_loadu_ps(k));
    a = _mm512_fmadd_ps(q1, _mm512_loadu_ps(k + 16), a);
    a = _mm512_fmadd_ps(q2, _mm512_loadu_ps(k + 32), a);
    d[l] = _mm512_fmadd_ps(q3, _mm512_loadu_ps(k + 48), a);
  }
  _mm512_mask_storeu_ps(dst, 0xffff, _mm512_mul_ps(hsum16(d), scale));
}

__attribute__((noinline)) void weigh(const long *rows, int n, const float *v, const float *p, int ld, float *o) {
  __m512 a[3][4];
  for (int r = 0; r < 3; r++)
    for (int c = 0; c < 4; c++) a[r][c] = _mm512_loadu_ps(o + r * 64 + 16 * c);
  for (int j = 0; j < n; j++) {
    const float *vr = v + rows[j];
    __m512 v0 = _mm512_loadu_ps(vr), v1 = _mm512_loadu_ps(vr + 16), v2 = _mm512_loadu_ps(vr + 32),
           v3 = _mm512_loadu_ps(vr + 48);
    for (int r = 0; r < 3; r++) {
      __m512 w = _mm512_set1_ps(p[r * ld + j]);
      a[r][0] = _mm512_fmadd_ps(w, v0, a[r][0]);
      a[r][1] = _mm512_fmadd_ps(w, v1, a[r][1]);
      a[r][2] = _mm512_fmadd_ps(w, v2, a[r][2]);
      a[r][3] = _mm512_fmadd_ps(w, v3, a[r][3]);
    }
  }
  for (int r = 0; r < 3; r++)
    for (int c = 0; c < 4; c++) _mm512_storeu_ps(o + r * 64 + 16 * c, a[r][c]);
}

int main(void) {
  double ghz = getenv("GHZ") ? atof(getenv("GHZ")) : 3.6;
  // Cache rows as in the engine: 3 KV heads x 64 floats (768 bytes).
  int nrows = 576;
  float *cache = aligned_alloc(64, (size_t)nrows * 192 * 4);
  for (long i = 0; i < (long)nrows * 192; i++) cache[i] = (i % 7) * 0.01f;
  const float *kr[16];
  for (int l = 0; l < 16; l++) kr[l] = cache + l * 192;
  float *q = aligned_alloc(64, 12 * 64 * 4), dst[12 * 16];
  for (int i = 0; i < 12 * 64; i++) q[i] = 1e-3f * i;
  long calls = 20000000;
  double t = now();
  for (long it = 0; it < calls; it++)
    for (int u = 0; u < 12; u++) score16(q + u * 64, kr, dst + u * 16, _mm512_set1_ps(0.125f));
  t = now() - t;
  printf("score16: %.1f cycles a call (%f)\n", t / (calls * 12.0) * ghz * 1e9, dst[5]);

  long *rows = malloc(nrows * sizeof(long));
  for (int j = 0; j < nrows; j++) rows[j] = (long)j * 192;
  float *p = aligned_alloc(64, 3 * nrows * 4), o[192] = {0};
  for (int i = 0; i < 3 * nrows; i++) p[i] = 1e-3f;
  long reps = 200000;
  t = now();
  for (long it = 0; it < reps; it++)
    for (int j0 = 0; j0 < nrows; j0 += 32) weigh(rows + j0, 32, cache, p + j0, nrows, o);
  t = now() - t;
  printf("weigh: %.1f cycles a row of 3 heads (%f)\n", t / ((double)reps * nrows) * ghz * 1e9, o[0]);
  return 0;
}
