// Memory read bandwidth of this machine: THREADS threads each sum their
// share of a 256 MiB f32 buffer (4 independent 8-lane adds, so the loads,
// not the adds, set the pace), 5 passes. The bound for any kernel that
// must read a decode step's KV cache once (~190 MB at batch 32).
//   gcc -O2 -mavx2 -pthread stream_read.c -o stream_read && ./stream_read 2
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define N (64L << 20)
static float *buf;
static int nth;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void *run(void *a) {
  long id = (long)a, per = N / nth;
  float *p = buf + id * per;
  __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  for (int r = 0; r < 5; r++)
    for (long i = 0; i < per; i += 32) {
      s0 = _mm256_add_ps(s0, _mm256_load_ps(p + i));
      s1 = _mm256_add_ps(s1, _mm256_load_ps(p + i + 8));
      s2 = _mm256_add_ps(s2, _mm256_load_ps(p + i + 16));
      s3 = _mm256_add_ps(s3, _mm256_load_ps(p + i + 24));
    }
  float o[8];
  _mm256_storeu_ps(o, _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
  return (void *)(long)o[0];
}

int main(int argc, char **argv) {
  nth = argc > 1 ? atoi(argv[1]) : 2;
  if (nth < 1 || nth > 64) return 1;
  buf = aligned_alloc(64, N * 4);
  for (long i = 0; i < N; i++) buf[i] = 1;
  pthread_t t[64];
  double t0 = now();
  for (long i = 0; i < nth; i++) pthread_create(&t[i], 0, run, (void *)i);
  for (int i = 0; i < nth; i++) pthread_join(t[i], 0);
  double dt = now() - t0;
  printf("%d threads: %.1f GB/s\n", nth, 5.0 * N * 4 / dt / 1e9);
  return 0;
}
