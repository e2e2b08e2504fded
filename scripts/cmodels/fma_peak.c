// f32 FMA peak of this CPU: 12 independent 8-lane FMA chains per thread
// (AVX2 + FMA), 9.6 GFLOP per thread, 3 runs.
//   gcc -O2 -mavx2 -mfma -pthread fma_peak.c -o fma_peak && ./fma_peak 2
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static const long N = 50000000L;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void *run(void *out) {
  __m256 a[12];
  for (int i = 0; i < 12; i++) a[i] = _mm256_set1_ps(1.0f + i);  // distinct, so no chain is merged
  const __m256 x = _mm256_set1_ps(0.999999f), y = _mm256_set1_ps(1e-7f);
  for (long i = 0; i < N; i++)
    for (int j = 0; j < 12; j++) a[j] = _mm256_fmadd_ps(a[j], x, y);
  __m256 s = a[0];
  for (int j = 1; j < 12; j++) s = _mm256_add_ps(s, a[j]);
  float f[8];
  _mm256_storeu_ps(f, s);
  *(float *)out = f[0];  // keeps the chains live
  return 0;
}

int main(int argc, char **argv) {
  int threads = argc > 1 ? atoi(argv[1]) : 2;
  if (threads < 1 || threads > 64) return 1;
  pthread_t th[64];
  float r[64];
  for (int rep = 0; rep < 3; rep++) {
    double t0 = now();
    for (int i = 0; i < threads; i++) pthread_create(&th[i], 0, run, &r[i]);
    for (int i = 0; i < threads; i++) pthread_join(th[i], 0);
    double dt = now() - t0;
    printf("%d threads: %.1f GFLOP/s (%.3f s)\n", threads, threads * N * 12.0 * 16 / dt / 1e9, dt);
  }
  return 0;
}
