// C model of Arbor's AVX2 f32 matmul scheme (crates/arbor-ops/src/matmul.rs)
// for y[m, n] = x[m, k] w[n, k]^T at one decode step's shape (m = 32,
// k = 576, n = 1536), weights in cache: a weight tile of 6 rows against
// every 4-row tile of x, in two passes of 3 weight rows; 12 accumulators of
// 8 lanes each, FMA chains over k in order; then each output's lanes are
// summed by:
//   sums 0: nothing (the 8-lane partials are stored; what the sums cost),
//   sums 1: hsum8's tree (l + l+4, + 2, + 1), as Arbor does,
//   sums 2: _mm_hadd_ps.
// Prints GFLOP/s (best and average of 600 calls), 5 rounds.
//   gcc -O3 -mavx2 -mfma -fopenmp dot_tiles.c -o dot_tiles
//   OMP_NUM_THREADS=2 ./dot_tiles 1
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#define K 576
#define M 32
#define N 1536

static inline float hsum8(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(a, _mm_shuffle_ps(a, a, 1)));
}

static inline float hadd8(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_hadd_ps(a, a);
  return _mm_cvtss_f32(_mm_hadd_ps(a, a));
}

// Weight rows w[0..6) against all M rows of x; outputs at y (row stride N),
// or 8-lane partials at s.
static void wtile(const float *x, const float *w, float *y, float *s, int sums) {
  for (int r0 = 0; r0 < M; r0 += 4)
    for (int c = 0; c < 6; c += 3) {
      __m256 a[4][3];
      for (int i = 0; i < 4; i++)
        for (int j = 0; j < 3; j++) a[i][j] = _mm256_setzero_ps();
      const float *ww = w + c * K;
      for (int kk = 0; kk < K; kk += 8) {
        __m256 w0 = _mm256_loadu_ps(ww + kk), w1 = _mm256_loadu_ps(ww + K + kk),
               w2 = _mm256_loadu_ps(ww + 2 * K + kk);
        for (int i = 0; i < 4; i++) {
          __m256 xv = _mm256_loadu_ps(x + (r0 + i) * K + kk);
          a[i][0] = _mm256_fmadd_ps(xv, w0, a[i][0]);
          a[i][1] = _mm256_fmadd_ps(xv, w1, a[i][1]);
          a[i][2] = _mm256_fmadd_ps(xv, w2, a[i][2]);
        }
      }
      for (int i = 0; i < 4; i++)
        for (int j = 0; j < 3; j++) {
          if (sums == 0)
            _mm256_store_ps(s + ((r0 + i) * 6 + c + j) * 8, a[i][j]);
          else
            y[(r0 + i) * N + c + j] = sums == 1 ? hsum8(a[i][j]) : hadd8(a[i][j]);
        }
    }
}

int main(int argc, char **argv) {
  int sums = argc > 1 ? atoi(argv[1]) : 1;
  float *w = aligned_alloc(64, (long)N * K * 4), *x = aligned_alloc(64, M * K * 4),
        *y = aligned_alloc(64, M * N * 4);
  for (long i = 0; i < (long)N * K; i++) w[i] = (i % 7) * 0.1f;
  for (int i = 0; i < M * K; i++) x[i] = 0.01f * i;
  for (int rep = 0; rep < 5; rep++) {
    double best = 1e9, total = 0;
    int calls = 600;
    for (int it = 0; it < calls; it++) {
      double t = omp_get_wtime();
#pragma omp parallel
      {
        static __thread float *s;
        if (!s) s = aligned_alloc(64, M * 6 * 8 * 4);
#pragma omp for schedule(static)
        for (int j = 0; j < N; j += 6) wtile(x, w + (long)j * K, y + j, s, sums);
      }
      t = omp_get_wtime() - t;
      best = t < best ? t : best;
      total += t;
    }
    double flop = 2.0 * M * K * N;
    printf("sums %d: best %.1f avg %.1f GFLOP/s\n", sums, flop / best / 1e9,
           flop / (total / calls) / 1e9);
  }
  return 0;
}
