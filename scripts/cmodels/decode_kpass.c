// C model of the key pass of paged attention for one decode step at batch
// 32 (AVX2 + FMA), to separate its arithmetic from its memory access:
// GROUPS sequences of one new token each, 129 context rows of K laid out
// [slot][3 KV heads][64] (the engine's cache row), 9 query heads (3 per KV
// head), scores q . k / 8 for every row, LAYERS layer caches (30 exceed the
// L3, as in a real step; 1 stays in L3), two threads with half the groups.
// Each dot product is the engine's: q0 k0, then FMAs over the 8-lane
// vectors in order, lanes summed by hsum8x8's tree.
//   VARIANT 0: Arbor's order: 8-row chunks; per KV head, a pair of queries
//              against 4 keys twice, then the third query against 8 keys
//              (score2x4, score8); a head's 4 lines of each row, head by head.
//   VARIANT 1: the same chunks, three queries against 4 keys (score3x4).
//   VARIANT 2: row by row, all 9 queries against the row's 3 heads: the
//              row's 12 lines read in order.
//   PF: prefetch (T0) every line of the rows PF ahead (0: none).
//   gcc -O3 -mavx2 -mfma -pthread decode_kpass.c -o decode_kpass
//   ./decode_kpass VARIANT GROUPS LAYERS REPS PF     e.g. 2 32 30 20 8
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

enum { D = 64, NKV = 3, GQ = 3, ROW = NKV * D, CTX = 129 };
static int variant, groups, layers, reps, pfd;
static float **kc;  // per layer: groups * CTX rows
static float *q;    // per group: 9 x 64
static float *sc;   // per thread scores

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static inline __m256 hsum8x8(__m256 *v) {
  __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

static inline __m256 score2x4(const float *qa, const float *qb, const float **kr) {
  __m256 d[8];
  __m256 a0 = _mm256_loadu_ps(qa), b0 = _mm256_loadu_ps(qb);
  for (int l = 0; l < 4; l++) {
    __m256 k = _mm256_loadu_ps(kr[l]);
    d[l] = _mm256_mul_ps(a0, k);
    d[4 + l] = _mm256_mul_ps(b0, k);
  }
  for (int c = 1; c < D / 8; c++) {
    __m256 av = _mm256_loadu_ps(qa + 8 * c), bv = _mm256_loadu_ps(qb + 8 * c);
    for (int l = 0; l < 4; l++) {
      __m256 k = _mm256_loadu_ps(kr[l] + 8 * c);
      d[l] = _mm256_fmadd_ps(av, k, d[l]);
      d[4 + l] = _mm256_fmadd_ps(bv, k, d[4 + l]);
    }
  }
  return _mm256_mul_ps(hsum8x8(d), _mm256_set1_ps(0.125f));
}

static inline __m256 score8(const float *qa, const float **kr) {
  __m256 d[8];
  __m256 a0 = _mm256_loadu_ps(qa);
  for (int l = 0; l < 8; l++) d[l] = _mm256_mul_ps(a0, _mm256_loadu_ps(kr[l]));
  for (int c = 1; c < D / 8; c++) {
    __m256 av = _mm256_loadu_ps(qa + 8 * c);
    for (int l = 0; l < 8; l++) d[l] = _mm256_fmadd_ps(av, _mm256_loadu_ps(kr[l] + 8 * c), d[l]);
  }
  return _mm256_mul_ps(hsum8x8(d), _mm256_set1_ps(0.125f));
}

static inline void score3x4(const float *qa, const float *qb, const float *qc, const float **kr,
                            __m256 *ab, __m256 *cc) {
  __m256 d[12];
  __m256 a0 = _mm256_loadu_ps(qa), b0 = _mm256_loadu_ps(qb), c0 = _mm256_loadu_ps(qc);
  for (int l = 0; l < 4; l++) {
    __m256 k = _mm256_loadu_ps(kr[l]);
    d[l] = _mm256_mul_ps(a0, k);
    d[4 + l] = _mm256_mul_ps(b0, k);
    d[8 + l] = _mm256_mul_ps(c0, k);
  }
  for (int c = 1; c < D / 8; c++) {
    __m256 av = _mm256_loadu_ps(qa + 8 * c), bv = _mm256_loadu_ps(qb + 8 * c),
           cv = _mm256_loadu_ps(qc + 8 * c);
    for (int l = 0; l < 4; l++) {
      __m256 k = _mm256_loadu_ps(kr[l] + 8 * c);
      d[l] = _mm256_fmadd_ps(av, k, d[l]);
      d[4 + l] = _mm256_fmadd_ps(bv, k, d[4 + l]);
      d[8 + l] = _mm256_fmadd_ps(cv, k, d[8 + l]);
    }
  }
  *ab = _mm256_mul_ps(hsum8x8(d), _mm256_set1_ps(0.125f));
  __m256 e[8] = {d[8], d[9], d[10], d[11], d[8], d[9], d[10], d[11]};
  *cc = _mm256_mul_ps(hsum8x8(e), _mm256_set1_ps(0.125f));
}

static void *run(void *arg) {
  long t = (long)arg;
  float *s = sc + t * 9 * 136;
  int g0 = t * groups / 2, g1 = (t + 1) * groups / 2;
  for (int r = 0; r < reps; r++)
    for (int L = 0; L < layers; L++)
      for (int g = g0; g < g1; g++) {
        const float *kg = kc[L] + (long)g * CTX * ROW, *qg = q + g * 9 * D;
        if (variant == 2) {
          // Row by row, every query of every KV head against the row's
          // keys: the row's 12 lines read in order.
          for (int j = 0; j < CTX; j++) {
            const float *kj = kg + (long)j * ROW;
            if (pfd > 0 && j + pfd < CTX)
              for (int c = 0; c < ROW * 4; c += 64) _mm_prefetch((const char *)(kj + pfd * ROW) + c, _MM_HINT_T0);
            __m256 d[9];
            for (int h = 0; h < NKV; h++) {
              __m256 k = _mm256_loadu_ps(kj + h * D);
              for (int r = 0; r < 3; r++) d[h * 3 + r] = _mm256_mul_ps(_mm256_loadu_ps(qg + (h * 3 + r) * D), k);
            }
            for (int c = 1; c < D / 8; c++)
              for (int h = 0; h < NKV; h++) {
                __m256 k = _mm256_loadu_ps(kj + h * D + 8 * c);
                for (int r = 0; r < 3; r++)
                  d[h * 3 + r] = _mm256_fmadd_ps(_mm256_loadu_ps(qg + (h * 3 + r) * D + 8 * c), k, d[h * 3 + r]);
              }
            __m256 e[8] = {d[8], d[8], d[8], d[8], d[8], d[8], d[8], d[8]};
            __m256 lo = _mm256_mul_ps(hsum8x8(d), _mm256_set1_ps(0.125f));
            __m256 hi = _mm256_mul_ps(hsum8x8(e), _mm256_set1_ps(0.125f));
            float o[16];
            _mm256_storeu_ps(o, lo);
            _mm256_storeu_ps(o + 8, hi);
            for (int x = 0; x < 9; x++) s[x * 136 + j] = o[x];
          }
          continue;
        }
        for (int c0 = 0; c0 < CTX; c0 += 8) {
          int n = CTX - c0 < 8 ? CTX - c0 : 8;
          if (pfd > 0) {
            // Rows pfd ahead (within the group; the next group's first rows
            // at the end), every line.
            for (int j = c0 + pfd; j < c0 + pfd + 8; j++) {
              const char *p = j < CTX ? (const char *)(kg + (long)j * ROW)
                                      : (g + 1 < g1 ? (const char *)(kg + (long)(CTX + j - CTX) * ROW) : 0);
              if (p)
                for (int c = 0; c < ROW * 4; c += 64) _mm_prefetch(p + c, _MM_HINT_T0);
            }
          }
          for (int h = 0; h < NKV; h++) {
            const float *kr[8];
            for (int l = 0; l < 8; l++) kr[l] = kg + (c0 + (l < n ? l : 0)) * ROW + h * D;
            const float *qa = qg + (h * 3) * D, *qb = qa + D, *qc = qb + D;
            float *da = s + (h * 3) * 136 + c0, *db = da + 136, *dc = db + 136;
            if (variant == 1) {
              __m256 lo, loc, hi, hic;
              score3x4(qa, qb, qc, kr, &lo, &loc);
              score3x4(qa, qb, qc, kr + 4, &hi, &hic);
              _mm256_storeu_ps(da, _mm256_permute2f128_ps(lo, hi, 0x20));
              _mm256_storeu_ps(db, _mm256_permute2f128_ps(lo, hi, 0x31));
              _mm256_storeu_ps(dc, _mm256_permute2f128_ps(loc, hic, 0x20));
            } else {
              __m256 lo = score2x4(qa, qb, kr), hi = score2x4(qa, qb, kr + 4);
              _mm256_storeu_ps(da, _mm256_permute2f128_ps(lo, hi, 0x20));
              _mm256_storeu_ps(db, _mm256_permute2f128_ps(lo, hi, 0x31));
              _mm256_storeu_ps(dc, score8(qc, kr));
            }
          }
        }
      }
  return 0;
}

int main(int argc, char **argv) {
  variant = argc > 1 ? atoi(argv[1]) : 0;
  groups = argc > 2 ? atoi(argv[2]) : 32;
  layers = argc > 3 ? atoi(argv[3]) : 30;
  reps = argc > 4 ? atoi(argv[4]) : 20;
  pfd = argc > 5 ? atoi(argv[5]) : 0;
  kc = malloc(sizeof(float *) * layers);
  for (int L = 0; L < layers; L++) {
    long n = (long)groups * CTX * ROW;
    kc[L] = aligned_alloc(64, n * 4);
    for (long i = 0; i < n; i++) kc[L][i] = ((i * 7 + L) % 13) * 0.1f - 0.6f;
  }
  q = aligned_alloc(64, groups * 9 * D * 4);
  for (int i = 0; i < groups * 9 * D; i++) q[i] = (i % 17) * 0.05f - 0.4f;
  sc = aligned_alloc(64, 2 * 9 * 136 * 4);
  pthread_t th[2];
  double t0 = now();
  for (long t = 0; t < 2; t++) pthread_create(&th[t], 0, run, (void *)t);
  for (int t = 0; t < 2; t++) pthread_join(th[t], 0);
  double dt = now() - t0;
  double rows = (double)reps * layers * groups * CTX;
  printf("variant %d, %d groups x %d layers: %.3f ms per pass, %.1f ns a row per thread (%.0f cycles at 3.1 GHz), %.1f GB/s of K\n",
         variant, groups, layers, dt / reps * 1e3, dt / (rows / 2) * 1e9, dt / (rows / 2) * 3.1e9,
         rows * ROW * 4 / dt / 1e9);
  return 0;
}
