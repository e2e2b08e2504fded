// C model of a packed outer-product f32 matmul for y[m, n] = x[m, k] w[n, k]^T
// at one decode step's shape (m = 32, k = 576, n = 1536), AVX2 + FMA:
// weights repacked in panels of 24 rows as [k][24]; a 4 x 24 register tile
// (12 accumulators) takes 3 weight vectors and 4 broadcasts of x per k step;
// each output is one FMA chain over k (no lane sums), k blocked at KC with
// the partial sums stored between blocks; the next block of the weight
// stream is prefetched a line per 4 k steps over the first 6 row tiles.
// Prints GFLOP/s (best and average of 600 calls) per KC, with and without
// the prefetch. COPIES = 1 keeps the weights in cache; 100 streams them
// from memory (2 MiB pages).
//   gcc -O3 -mavx2 -mfma -fopenmp packed_tiles.c -o packed_tiles
//   OMP_NUM_THREADS=2 ./packed_tiles 32 1; OMP_NUM_THREADS=2 ./packed_tiles 32 100
// With -mavx512f -mavx512vl, MRT selects other tiles of the same panels:
//   MRT=8: 8 x 24 with a zmm and a ymm accumulator per row (16 in all; one
//     zmm and one ymm weight load and 8 broadcasts per k step);
//   MRT=108: 8 x 24 in ymm registers only (24 accumulators), which
//     AVX-512VL raises to 32, the broadcast kept in a register (an empty
//     asm stops gcc from folding it into each FMA as an embedded {1to8}
//     broadcast).
// On a 2-core Zen 4 (docs/benchmarks.md, fifteenth session), KC 192, in
// cache, best of 600 calls: MRT=8 204-205 GFLOP/s; MRT=108 227; the AVX2
// build 226. MRT=4 in this build: 192-193, as gcc keeps the loop's
// counters on the stack (226-227 in a variant of this file where it did
// not). Every ymm tile is at the FMA rate when its loop is clean, so more
// registers buy nothing; streaming from memory
// (`32 100`), MRT=108 drops to 185 against 222 for the 4 x 24 tile, whose
// prefetch spreads over more row tiles. The engine keeps the AVX2 tile.
//   gcc -O3 -mavx512f -mavx512vl -mfma -fopenmp packed_tiles.c -o packed_tiles
//   MRT=8 OMP_NUM_THREADS=2 ./packed_tiles 32 1

#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#define K 576
#define NR 24

// Named accumulators: with an array, gcc spilled them inside the loop.
#define ROW(i, a0, a1, a2)                              \
  do {                                                  \
    __m256 b = _mm256_broadcast_ss(x + (i) * ldx + k);  \
    a0 = _mm256_fmadd_ps(b, w0, a0);                    \
    a1 = _mm256_fmadd_ps(b, w1, a1);                    \
    a2 = _mm256_fmadd_ps(b, w2, a2);                    \
  } while (0)
#define LOAD(v, i, j) v = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + (i) * ldy + 8 * (j))
#define STORE(v, i, j) _mm256_storeu_ps(y + (i) * ldy + 8 * (j), v)

static void tile(const float *x, int ldx, const float *p, float *y, int ldy, int k0, int k1,
                 int first, const char *pf) {
  __m256 a00, a01, a02, a10, a11, a12, a20, a21, a22, a30, a31, a32;
  LOAD(a00, 0, 0); LOAD(a01, 0, 1); LOAD(a02, 0, 2);
  LOAD(a10, 1, 0); LOAD(a11, 1, 1); LOAD(a12, 1, 2);
  LOAD(a20, 2, 0); LOAD(a21, 2, 1); LOAD(a22, 2, 2);
  LOAD(a30, 3, 0); LOAD(a31, 3, 1); LOAD(a32, 3, 2);
  const float *pp = p + k0 * NR;
  for (int k = k0; k < k1; k++, pp += NR) {
    if (pf && ((k - k0) & 3) == 0) {
      _mm_prefetch(pf, _MM_HINT_T0);
      pf += 64;
    }
    __m256 w0 = _mm256_load_ps(pp), w1 = _mm256_load_ps(pp + 8), w2 = _mm256_load_ps(pp + 16);
    ROW(0, a00, a01, a02);
    ROW(1, a10, a11, a12);
    ROW(2, a20, a21, a22);
    ROW(3, a30, a31, a32);
  }
  STORE(a00, 0, 0); STORE(a01, 0, 1); STORE(a02, 0, 2);
  STORE(a10, 1, 0); STORE(a11, 1, 1); STORE(a12, 1, 2);
  STORE(a20, 2, 0); STORE(a21, 2, 1); STORE(a22, 2, 2);
  STORE(a30, 3, 0); STORE(a31, 3, 1); STORE(a32, 3, 2);
}


#ifdef __AVX512F__
// One row of the 8 x 24 tile: lanes 0-15 in a zmm, 16-23 in a ymm.
#define ROW8(i, z, a)                                          \
  do {                                                         \
    __m512 b = _mm512_set1_ps(x[(i) * ldx + k]);               \
    z = _mm512_fmadd_ps(b, wz, z);                             \
    a = _mm256_fmadd_ps(_mm512_castps512_ps256(b), wy, a);     \
  } while (0)
#define LZ(v, i) v = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + (i) * ldy)
#define LY(v, i) v = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + (i) * ldy + 16)
#define SZ(v, i) _mm512_storeu_ps(y + (i) * ldy, v)
#define SY(v, i) _mm256_storeu_ps(y + (i) * ldy + 16, v)

static void tile8(const float *x, int ldx, const float *p, float *y, int ldy, int k0, int k1,
                  int first, const char *pf) {
  __m512 z0, z1, z2, z3, z4, z5, z6, z7;
  __m256 a0, a1, a2, a3, a4, a5, a6, a7;
  LZ(z0, 0); LZ(z1, 1); LZ(z2, 2); LZ(z3, 3); LZ(z4, 4); LZ(z5, 5); LZ(z6, 6); LZ(z7, 7);
  LY(a0, 0); LY(a1, 1); LY(a2, 2); LY(a3, 3); LY(a4, 4); LY(a5, 5); LY(a6, 6); LY(a7, 7);
  const float *pp = p + k0 * NR;
  for (int k = k0; k < k1; k++, pp += NR) {
    if (pf && ((k - k0) & 3) == 0) {
      _mm_prefetch(pf, _MM_HINT_T0);
      pf += 64;
    }
    __m512 wz = _mm512_loadu_ps(pp);
    __m256 wy = _mm256_load_ps(pp + 16);
    ROW8(0, z0, a0); ROW8(1, z1, a1); ROW8(2, z2, a2); ROW8(3, z3, a3);
    ROW8(4, z4, a4); ROW8(5, z5, a5); ROW8(6, z6, a6); ROW8(7, z7, a7);
  }
  SZ(z0, 0); SZ(z1, 1); SZ(z2, 2); SZ(z3, 3); SZ(z4, 4); SZ(z5, 5); SZ(z6, 6); SZ(z7, 7);
  SY(a0, 0); SY(a1, 1); SY(a2, 2); SY(a3, 3); SY(a4, 4); SY(a5, 5); SY(a6, 6); SY(a7, 7);
}
#endif


#ifdef __AVX512VL__
#define BR(i) ({ __m256 b_ = _mm256_broadcast_ss(x + (i) * ldx + k); __asm__("" : "+v"(b_)); b_; })
#define ROWY(i, a0, a1, a2)                 \
  do {                                      \
    __m256 b = BR(i);                       \
    a0 = _mm256_fmadd_ps(b, w0, a0);        \
    a1 = _mm256_fmadd_ps(b, w1, a1);        \
    a2 = _mm256_fmadd_ps(b, w2, a2);        \
  } while (0)
static void tiley8(const float *x, int ldx, const float *p, float *y, int ldy, int k0, int k1,
                   int first, const char *pf) {
  __m256 a00, a01, a02, a10, a11, a12, a20, a21, a22, a30, a31, a32;
  __m256 a40, a41, a42, a50, a51, a52, a60, a61, a62, a70, a71, a72;
  LOAD(a00, 0, 0); LOAD(a01, 0, 1); LOAD(a02, 0, 2);
  LOAD(a10, 1, 0); LOAD(a11, 1, 1); LOAD(a12, 1, 2);
  LOAD(a20, 2, 0); LOAD(a21, 2, 1); LOAD(a22, 2, 2);
  LOAD(a30, 3, 0); LOAD(a31, 3, 1); LOAD(a32, 3, 2);
  LOAD(a40, 4, 0); LOAD(a41, 4, 1); LOAD(a42, 4, 2);
  LOAD(a50, 5, 0); LOAD(a51, 5, 1); LOAD(a52, 5, 2);
  LOAD(a60, 6, 0); LOAD(a61, 6, 1); LOAD(a62, 6, 2);
  LOAD(a70, 7, 0); LOAD(a71, 7, 1); LOAD(a72, 7, 2);
  const float *pp = p + k0 * NR;
  for (int k = k0; k < k1; k++, pp += NR) {
    if (pf && ((k - k0) & 3) == 0) {
      _mm_prefetch(pf, _MM_HINT_T0);
      pf += 64;
    }
    __m256 w0 = _mm256_load_ps(pp), w1 = _mm256_load_ps(pp + 8), w2 = _mm256_load_ps(pp + 16);
    ROWY(0, a00, a01, a02); ROWY(1, a10, a11, a12); ROWY(2, a20, a21, a22); ROWY(3, a30, a31, a32);
    ROWY(4, a40, a41, a42); ROWY(5, a50, a51, a52); ROWY(6, a60, a61, a62); ROWY(7, a70, a71, a72);
  }
  STORE(a00, 0, 0); STORE(a01, 0, 1); STORE(a02, 0, 2);
  STORE(a10, 1, 0); STORE(a11, 1, 1); STORE(a12, 1, 2);
  STORE(a20, 2, 0); STORE(a21, 2, 1); STORE(a22, 2, 2);
  STORE(a30, 3, 0); STORE(a31, 3, 1); STORE(a32, 3, 2);
  STORE(a40, 4, 0); STORE(a41, 4, 1); STORE(a42, 4, 2);
  STORE(a50, 5, 0); STORE(a51, 5, 1); STORE(a52, 5, 2);
  STORE(a60, 6, 0); STORE(a61, 6, 1); STORE(a62, 6, 2);
  STORE(a70, 7, 0); STORE(a71, 7, 1); STORE(a72, 7, 2);
}
#endif

// Rows per register tile (MRT=8 selects tile8, MRT=108 tiley8).
static int mrt = 4;

// One packed panel (24 weight rows) against all m rows of x.
static void panel(const float *x, int m, const float *p, float *y, int n, int kc, int prefetch) {
  for (int k0 = 0; k0 < K; k0 += kc) {
    int k1 = k0 + kc < K ? k0 + kc : K;
    const char *next = (const char *)(p + k1 * NR);  // the stream's next block
    int per = (k1 - k0) / 4;
#ifdef __AVX512VL__
    if (mrt == 108) {
      for (int r = 0; r < m; r += 8)
        tiley8(x + r * K, K, p, y + r * n, n, k0, k1, k0 == 0,
               prefetch && r / 8 < 3 ? next + (r / 8) * 2 * per * 64 : 0);
      continue;
    }
#endif
#ifdef __AVX512F__
    if (mrt == 8) {
      // Twice the rows per tile: the block's prefetch over the first 3.
      for (int r = 0; r < m; r += 8)
        tile8(x + r * K, K, p, y + r * n, n, k0, k1, k0 == 0,
              prefetch && r / 8 < 3 ? next + (r / 8) * 2 * per * 64 : 0);
      continue;
    }
#endif
    for (int r = 0; r < m; r += 4)
      tile(x + r * K, K, p, y + r * n, n, k0, k1, k0 == 0,
           prefetch && r / 4 < 6 ? next + (r / 4) * per * 64 : 0);
  }
}

int main(int argc, char **argv) {
  mrt = getenv("MRT") ? atoi(getenv("MRT")) : 4;
  int m = argc > 1 ? atoi(argv[1]) : 32, copies = argc > 2 ? atoi(argv[2]) : 1, n = 1536;
  int mr = mrt > 100 ? mrt - 100 : mrt; if (m < mr || m % mr || copies < 1) return 1;
  long wlen = (long)copies * n * K;
  float *w = aligned_alloc(1 << 21, ((wlen * 4 >> 21) + 1) << 21);
  madvise(w, wlen * 4, MADV_HUGEPAGE);
  for (long i = 0; i < wlen; i++) w[i] = (i % 7) * 0.1f;  // already "packed": values are arbitrary
  float *x = aligned_alloc(64, m * K * 4), *y = aligned_alloc(64, m * n * 4);
  for (int i = 0; i < m * K; i++) x[i] = 0.01f * i;
  int kcs[] = {576, 288, 192, 144, 96};
  for (int rep = 0; rep < 2; rep++)
    for (int prefetch = 0; prefetch < 2; prefetch++)
      for (int ki = 0; ki < 5; ki++) {
        double best = 1e9, sum = 0;
        int calls = 600;
        for (int it = 0; it < calls; it++) {
          const float *wb = w + (long)(it % copies) * n * K;
          double t = omp_get_wtime();
#pragma omp parallel for schedule(static)
          for (int j = 0; j < n; j += NR) panel(x, m, wb + (long)j * K, y + j, n, kcs[ki], prefetch);
          t = omp_get_wtime() - t;
          best = t < best ? t : best;
          sum += t;
        }
        double flop = 2.0 * m * K * n;
        printf("m %d copies %d KC %d prefetch %d: best %.1f avg %.1f GFLOP/s\n", m, copies, kcs[ki],
               prefetch, flop / best / 1e9, flop / (sum / calls) / 1e9);
      }
  return 0;
}
