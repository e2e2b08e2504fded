//! Row-invariant CPU matmul: `y[m, n] = x[m, k] w[n, k]^T` in f32 with
//! AVX-512, for every row count (a decode step of 1 row, a batch of 32, a
//! prefill of thousands); and its bf16-weight twin (`x` rounded to bf16,
//! `vdpbf16ps`, f32 sums: [`matmul_nt_bf16`]), with grouped calls
//! ([`matmul_nt_multi_into`]) for several weights of one input.
//!
//! Each output is a dot product computed the same way whatever the tile it
//! falls in: 16 lane-wise FMA chains over `k` in order (a masked tail for
//! `k % 16`), then the fixed pairwise tree `lane i + lane i+8`, `i + i+4`,
//! `i + i+2`, `i + i+1` (`store_sums`). So a row's result depends only on that
//! row and the weights, never on how many other rows share the call or where
//! it sits among them. The engine relies on this: a sequence's logits (and
//! therefore its sampled tokens) must not depend on the batch it decodes in,
//! on whether its prefix was prefilled or served from the cache, or on
//! whether a run was resumed.
//!
//! Both operands are read in their natural layouts (`w` is a `Linear`
//! weight, `[out, in]`), so there is no packing: a register tile of
//! `MR x NR` (4 x 6) dot products loads `MR + NR` vectors per `MR * NR`
//! FMAs; a weight tile of 6 rows stays in L1 while a 64-row block of `x`
//! streams past it from L2, and the next weight tile is prefetched while
//! the block's rows meet the current one, its rows shared out among the
//! block's first row tiles (one row each from 21 rows of `x` up; all six by
//! the one tile of a 1-4 row call) so that only a few misses are in flight
//! at a time and they overlap the arithmetic (issuing all six rows' misses
//! from the first row tile stalled it and left weight streaming and compute
//! in series: cold weights at 32 rows ran 35% below hot ones); calls of up
//! to 64 rows also prefetch the tile [`FAR_TILES`] further on into L2, so
//! the weight stream is not bound by the L1 miss queues. The tile's
//! 24 accumulators stay in registers through the loop: their lane sums are
//! taken 16 at a time by one transposing tree of 512-bit instructions (a
//! 128-bit reduction per sum would confine them to the 16 registers such
//! instructions can name, and the compiler then spilled a third of them
//! inside the loop, costing 1.3 to 1.5x at 8 to 32 rows). Threads split the
//! weight rows (and, for long inputs, `x`). At decode sizes each weight is read from
//! memory once per call.
//!
//! [`matmul_nt_op`] is a candle op (f32 `x`; f32 or bf16 `w`; CPU) with the
//! usual matmul backward. Callers check [`matmul_nt_available`] (f32
//! weights) or [`matmul_nt_bf16_available`] (bf16 weights) and otherwise use
//! candle's matmul (then, on that CPU, candle's GEMM provides the rows).

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use crate::simd::hsum16;

/// Rows of `x` per register tile.
const MR: usize = 4;
/// Weight rows per register tile.
const NR: usize = 6;
/// Rows of `x` per cache block (kept in L2 while a weight tile sits in L1).
const MB: usize = 64;
/// Weight tiles between the next tile (prefetched into L1 by the current
/// one) and the tile whose rows are prefetched into L2 at the same time,
/// for calls of at most [`MB`] rows. With only the next tile prefetched, the
/// weight stream of a decode step ran at 16 GB/s of a 2-core Zen 4's
/// ~29: the L1 miss queues bound it. Two tiles ahead in L2: m = 8, f32
/// 33 -> 18 ms a SmolLM2-135M step, bf16 16.7 -> 10.5 ms; m = 1 and 32 gain
/// 23-38% and 7-9% (`decode_matmuls`).
const FAR_TILES: usize = 2;
/// Multiply-adds below which a call runs on one thread (~10 us of work).
const SERIAL_MACS: usize = 1 << 20;

/// Whether this CPU runs the kernel (AVX-512F).
pub fn matmul_nt_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Raw output pointer shared by the tasks, which write disjoint columns.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: every task writes only its own output tiles (columns `n0..n1` of
// one product, in its own block of rows).
#[allow(unsafe_code)]
unsafe impl Send for OutPtr {}
#[allow(unsafe_code)]
unsafe impl Sync for OutPtr {}

/// `x: [m, k]`, `w: [n, k]` (both row-major, contiguous) -> `y: [m, n]`.
/// Panics if the CPU lacks AVX-512F (check [`matmul_nt_available`]) or the
/// slices are shorter than the shapes.
pub fn matmul_nt(x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    single(x, WeightRows::F32(w), m, k, n)
}

/// [`matmul_nt`] into a caller's buffer `y` (`m * n`, overwritten).
pub fn matmul_nt_into(x: &[f32], w: &[f32], m: usize, k: usize, n: usize, y: &mut [f32]) {
    single_into(x, WeightRows::F32(w), m, k, n, y)
}

/// One product through [`matmul_nt_multi_into`]: the first `n` rows of `w`
/// into the first `m * n` values of `y`.
fn single_into(x: &[f32], w: WeightRows<'_>, m: usize, k: usize, n: usize, y: &mut [f32]) {
    assert!(
        w.len() >= n * k && y.len() >= m * n,
        "matmul_nt: slices shorter than [{m}, {k}] x [{n}, {k}]^T"
    );
    matmul_nt_multi_into(x, &[w.rows(n * k)], m, k, &mut [&mut y[..m * n]]);
}

/// [`single_into`] into a new buffer.
fn single(x: &[f32], w: WeightRows<'_>, m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut y = vec![0f32; m * n];
    single_into(x, w, m, k, n, &mut y);
    y
}

/// Whether this CPU runs the bf16 kernel (AVX-512F, BW and BF16).
pub fn matmul_nt_bf16_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512bw")
            && std::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `y[m, n] = bf16(x)[m, k] w[n, k]^T` for bf16 weights: `x` is rounded to
/// bf16 (nearest even), every product of two bf16 values is exact in f32,
/// and the products are summed in f32 by `vdpbf16ps`, 32 per instruction
/// (pairs `2i, 2i+1` into lane `i`), then by the same lane tree as the f32
/// kernel. Rows are as batch-invariant as [`matmul_nt`]'s. Twice the
/// multiply-adds per instruction and half the weight bytes of the f32
/// kernel. Panics if the CPU lacks the features
/// ([`matmul_nt_bf16_available`]) or the slices are shorter than the shapes.
pub fn matmul_nt_bf16(x: &[f32], w: &[half::bf16], m: usize, k: usize, n: usize) -> Vec<f32> {
    single(x, WeightRows::Bf16(w), m, k, n)
}

/// The rows of a weight matrix `[n, k]` (row-major) for
/// [`matmul_nt_multi_into`]: f32 ([`matmul_nt`]) or bf16
/// ([`matmul_nt_bf16`]).
#[derive(Debug, Clone, Copy)]
pub enum WeightRows<'a> {
    F32(&'a [f32]),
    Bf16(&'a [half::bf16]),
}

impl<'a> WeightRows<'a> {
    fn len(&self) -> usize {
        match self {
            WeightRows::F32(w) => w.len(),
            WeightRows::Bf16(w) => w.len(),
        }
    }

    /// The first `len` elements.
    fn rows(self, len: usize) -> WeightRows<'a> {
        match self {
            WeightRows::F32(w) => WeightRows::F32(&w[..len]),
            WeightRows::Bf16(w) => WeightRows::Bf16(&w[..len]),
        }
    }
}

/// Several products of one input in one parallel pass: `ys[g] = x
/// ws[g]^T` for `x: [m, k]`, `ws[g]: [n_g, k]` (`n_g = len / k`), `ys[g]:
/// [m, n_g]` (overwritten; for `k = 0`, zeroed whole), each computed
/// exactly as [`matmul_nt`] (f32
/// weights) or [`matmul_nt_bf16`] (bf16 weights) computes it alone. One
/// call for a layer's q/k/v (or gate/up) projections pays one thread
/// hand-off instead of three, with no concatenated copy of the weights.
/// Panics if the CPU lacks a kernel's features, a weight's length is not a
/// multiple of `k`, or a slice is shorter than its shape.
pub fn matmul_nt_multi_into(
    x: &[f32],
    ws: &[WeightRows<'_>],
    m: usize,
    k: usize,
    ys: &mut [&mut [f32]],
) {
    assert_eq!(
        ws.len(),
        ys.len(),
        "matmul_nt: {} weights, {} outputs",
        ws.len(),
        ys.len()
    );
    if k == 0 {
        // Empty dot products: every output is 0 (the weights have no
        // elements, so their row counts are unknown; fill what is given).
        ys.iter_mut().for_each(|y| y.fill(0.0));
        return;
    }
    let ns: Vec<usize> = ws.iter().map(|w| w.len() / k).collect();
    for ((w, y), &n) in ws.iter().zip(ys.iter()).zip(&ns) {
        assert!(
            x.len() >= m * k && w.len() == n * k && y.len() >= m * n,
            "matmul_nt: slices do not fit [{m}, {k}] x [{n}, {k}]^T"
        );
    }
    let any_bf16 = ws.iter().any(|w| matches!(w, WeightRows::Bf16(_)));
    assert!(matmul_nt_available(), "matmul_nt needs AVX-512F");
    assert!(
        !any_bf16 || matmul_nt_bf16_available(),
        "matmul_nt_bf16 needs AVX-512F, BW and BF16"
    );
    let xb: Vec<u16> = if any_bf16 {
        to_bf16_bits(&x[..m * k])
    } else {
        Vec::new()
    };
    let outs: Vec<OutPtr> = ys.iter_mut().map(|y| OutPtr(y.as_mut_ptr())).collect();
    // Decode-sized calls stream each weight once: the rows FAR_TILES tiles
    // past the next one are prefetched into L2 as well (elements past the
    // next tile's rows; 0 = none).
    let far = if m <= MB { FAR_TILES * NR * k } else { 0 };
    drive(m, k, &ns, |g, i, mr, j, nr, pf| {
        let (out, n) = (outs[g], ns[g]);
        // SAFETY: the CPU features were checked above; rows i..i+mr of x
        // and j..j+nr of ws[g] lie inside the slices (asserted), and the
        // outputs ys[g][i.., j..j+nr] belong to the calling task alone.
        #[allow(unsafe_code)]
        #[cfg(target_arch = "x86_64")]
        unsafe {
            let y = out.0.add(i * n + j);
            // The rows of the next weight tile this tile prefetches.
            let (pf_at, npf) = ((j + NR + pf.start) * k, pf.len());
            match ws[g] {
                WeightRows::F32(w) => {
                    let pf = (w.as_ptr().wrapping_add(pf_at), npf);
                    let (x, w) = (x.as_ptr().add(i * k), w.as_ptr().add(j * k));
                    dispatch::<F32Tiles>(mr, nr, x, w, k, y, n, pf, far)
                }
                WeightRows::Bf16(w) => {
                    let pf = (w.as_ptr().wrapping_add(pf_at) as *const u16, npf);
                    let x = xb.as_ptr().add(i * k);
                    let w = w.as_ptr().add(j * k) as *const u16;
                    dispatch::<Bf16Tiles>(mr, nr, x, w, k, y, n, pf, far)
                }
            }
        }
    });
}

/// The bits of `bf16(x)` for every value: exactly `half::bf16::from_f32`
/// (round to nearest even, subnormals kept, NaN made quiet with its
/// payload's top bits), 16 values per step in AVX-512 integer arithmetic
/// (`vcvtneps2bf16` would flush subnormals to zero), in parallel chunks
/// for long inputs. The bf16 kernel rounds its `x` this way; a prefill's
/// `x` has millions of values, which the scalar conversion took ~1 ns each
/// on one thread.
fn to_bf16_bits(x: &[f32]) -> Vec<u16> {
    let mut out = vec![0u16; x.len()];
    const CH: usize = 1 << 14;
    crate::rows::for_rows(&mut out, CH, |c, o| {
        let x = &x[c * CH..c * CH + o.len()];
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: AVX-512F detected; `x` and `o` have the same length.
            #[allow(unsafe_code)]
            unsafe {
                bf16_bits_avx512(x, o)
            };
            return;
        }
        for (o, &v) in o.iter_mut().zip(x) {
            *o = half::bf16::from_f32(v).to_bits();
        }
    });
    out
}

/// Every value rounded to bf16 (nearest even, as [`to_bf16_bits`]) and
/// widened back to f32, exactly: what `x.to_dtype(BF16)?.to_dtype(F32)`
/// gives, vectorised.
pub fn round_bf16(x: &[f32]) -> Vec<f32> {
    to_bf16_bits(x)
        .into_iter()
        .map(|b| f32::from_bits(u32::from(b) << 16))
        .collect()
}

/// [`to_bf16_bits`] of one chunk: `bits(v) + 0x7fff + lsb >> 16` rounds to
/// nearest even (carrying into the exponent, up to infinity, as it
/// should); NaN becomes `bits >> 16 | 0x40`.
///
/// # Safety
/// The CPU supports AVX-512F; `o.len() == x.len()`.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx512f")]
unsafe fn bf16_bits_avx512(x: &[f32], o: &mut [u16]) {
    use std::arch::x86_64::*;
    assert_eq!(x.len(), o.len());
    let n = x.len();
    let one = _mm512_set1_epi32(1);
    let half_ulp = _mm512_set1_epi32(0x7fff);
    let abs = _mm512_set1_epi32(0x7fff_ffff);
    let inf = _mm512_set1_epi32(0x7f80_0000);
    let quiet = _mm512_set1_epi32(0x40);
    let mut i = 0;
    while i < n {
        let len = (n - i).min(16);
        let mask = ((1u32 << len) - 1) as __mmask16;
        let v = _mm512_maskz_loadu_epi32(mask, x.as_ptr().add(i) as *const i32);
        let hi = _mm512_srli_epi32::<16>(v);
        let lsb = _mm512_and_si512(hi, one);
        let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(v, _mm512_add_epi32(half_ulp, lsb)));
        // |v| above infinity's bits (as signed: both sides are positive).
        let nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(v, abs), inf);
        let r = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(hi, quiet));
        let h = _mm512_cvtepi32_epi16(r);
        if len == 16 {
            _mm256_storeu_si256(o.as_mut_ptr().add(i) as *mut __m256i, h);
        } else {
            let mut lanes = [0u16; 16];
            _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, h);
            o[i..i + len].copy_from_slice(&lanes[..len]);
        }
        i += 16;
    }
}

/// Walks the tiles of the products `[m, k] x [ns[g], k]^T`: calls `tile(g,
/// i, mr, j, nr, prefetch)` for the `mr x nr` output tile at `(i, j)` of
/// product `g`, in cache blocks, on rayon tasks that own disjoint output
/// tiles. `prefetch` is the range of the next weight tile's rows (`0..NR`)
/// that this tile pulls in, empty for all but a block's first row tiles.
fn drive(
    m: usize,
    k: usize,
    ns: &[usize],
    tile: impl Fn(usize, usize, usize, usize, usize, std::ops::Range<usize>) + Sync,
) {
    let n_all: usize = ns.iter().sum();
    if m == 0 || n_all == 0 {
        return;
    }
    let (mc, nb) = task_shape(m, n_all);
    let m_tasks = m.div_ceil(mc);
    // Tasks of product g are numbered from first[g].
    let mut first = vec![0usize; ns.len() + 1];
    for (g, &n) in ns.iter().enumerate() {
        first[g + 1] = first[g] + m_tasks * n.div_ceil(nb);
    }
    let run = |task: usize| {
        let g = first.partition_point(|&f| f <= task) - 1;
        let (n, n_tasks) = (ns[g], ns[g].div_ceil(nb));
        let local = task - first[g];
        let (mt, nt) = (local / n_tasks, local % n_tasks);
        let (n0, n1) = (nt * nb, ((nt + 1) * nb).min(n));
        let (ms, me) = (mt * mc, ((mt + 1) * mc).min(m));
        for m0 in (ms..me).step_by(MB) {
            let m1 = (m0 + MB).min(me);
            for j in (n0..n1).step_by(NR) {
                let nr = NR.min(n1 - j);
                // The block's first row tiles share out the next weight
                // tile's rows to prefetch (1, 2, 3 or all 6 rows each), so
                // the misses stay few at a time and overlap the arithmetic.
                let tiles = (m1 - m0).div_ceil(MR);
                let spread = [6, 3, 2, 1].into_iter().find(|&s| s <= tiles).unwrap_or(1);
                let per = NR / spread;
                for (t, i) in (m0..m1).step_by(MR).enumerate() {
                    let pf = if t < spread {
                        t * per..(t + 1) * per
                    } else {
                        0..0
                    };
                    tile(g, i, MR.min(m1 - i), j, nr, pf);
                }
            }
        }
    };
    let tasks = first[ns.len()];
    if m * n_all * k < SERIAL_MACS {
        // Small calls stay on the calling thread: a rayon hand-off costs
        // more than the work, and a thread waiting on one would steal
        // unrelated jobs (say, another episode's rollout) meanwhile.
        (0..tasks).for_each(run);
    } else {
        (0..tasks).into_par_iter().for_each(run);
    }
}

/// Rows of `x` and of `w` per parallel task. Decode-sized calls (`m <=
/// MB`) split only the weights, in small tasks (at most 4 tiles) so the two
/// threads of a small machine stay balanced; larger calls also split `x`
/// into 256-row blocks so a task's rows stay in L2.
fn task_shape(m: usize, n: usize) -> (usize, usize) {
    let threads = rayon::current_num_threads().max(1);
    if m <= MB {
        (m, (n / (16 * threads) / NR * NR).clamp(NR, 4 * NR))
    } else {
        (256, (n / (4 * threads) / NR * NR).clamp(NR, 16 * NR))
    }
}

/// A register-tile kernel over weights of element type `W`.
#[cfg(target_arch = "x86_64")]
trait Tiles {
    type W;
    /// `R x C` dot products of rows `k` apart into `y` (row stride `ldy`),
    /// prefetching the `PF` weight rows (`k` apart) from `pf` into L1 and,
    /// unless `far` is 0, those from `pf + far` into L2.
    ///
    /// # Safety
    /// The CPU has the kernel's features; the `R` rows of `x`, the `C` rows
    /// of `w` and the outputs lie inside live allocations.
    #[allow(unsafe_code)]
    unsafe fn tile<const R: usize, const C: usize, const PF: usize>(
        x: *const Self::W,
        w: *const Self::W,
        k: usize,
        y: *mut f32,
        ldy: usize,
        pf: *const Self::W,
        far: usize,
    );
}

/// f32 weights and inputs: [`tile`].
#[cfg(target_arch = "x86_64")]
struct F32Tiles;
/// bf16 weights and inputs (bits as `u16`): [`tile_bf16`].
#[cfg(target_arch = "x86_64")]
struct Bf16Tiles;

/// `impl Tiles for $kernel` over elements `$w`, calling the tile function
/// `$tile`.
macro_rules! impl_tiles {
    ($kernel:ident, $w:ty, $tile:ident) => {
        #[cfg(target_arch = "x86_64")]
        #[allow(unsafe_code)]
        impl Tiles for $kernel {
            type W = $w;
            unsafe fn tile<const R: usize, const C: usize, const PF: usize>(
                x: *const $w,
                w: *const $w,
                k: usize,
                y: *mut f32,
                ldy: usize,
                pf: *const $w,
                far: usize,
            ) {
                $tile::<R, C, PF>(x, w, k, y, ldy, pf, far)
            }
        }
    };
}
impl_tiles!(F32Tiles, f32, tile);
impl_tiles!(Bf16Tiles, u16, tile_bf16);

/// The `mr x nr` tile (`mr <= MR`, `nr <= NR`) of kernel `T`.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn dispatch<T: Tiles>(
    mr: usize,
    nr: usize,
    x: *const T::W,
    w: *const T::W,
    k: usize,
    y: *mut f32,
    ldy: usize,
    pf: (*const T::W, usize),
    far: usize,
) {
    let (p, np) = pf;
    macro_rules! go {
        ($($a:literal: $($b:literal)*;)*) => {
            match (mr, nr, np) {
                $($(
                    ($a, $b, 0) => T::tile::<$a, $b, 0>(x, w, k, y, ldy, p, far),
                    ($a, $b, 1) => T::tile::<$a, $b, 1>(x, w, k, y, ldy, p, far),
                    ($a, $b, 2) => T::tile::<$a, $b, 2>(x, w, k, y, ldy, p, far),
                    ($a, $b, 3) => T::tile::<$a, $b, 3>(x, w, k, y, ldy, p, far),
                    ($a, $b, _) => T::tile::<$a, $b, 6>(x, w, k, y, ldy, p, far),
                )*)*
                _ => unreachable!("tile {mr} x {nr}"),
            }
        };
    }
    // Every (rows of x, rows of w) tile up to MR x NR.
    go!(
        1: 1 2 3 4 5 6;
        2: 1 2 3 4 5 6;
        3: 1 2 3 4 5 6;
        4: 1 2 3 4 5 6;
    )
}

/// `R x C` dot products: `y[i * ldy + j] = lane_sum(sum_t x[i, 16t..] * w[j,
/// 16t..])` for `i < R`, `j < C`, rows of `x` and `w` `k` apart.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx512f")]
#[allow(clippy::needless_range_loop)]
unsafe fn tile<const R: usize, const C: usize, const PF: usize>(
    x: *const f32,
    w: *const f32,
    k: usize,
    y: *mut f32,
    ldy: usize,
    pf: *const f32,
    far: usize,
) {
    use std::arch::x86_64::*;
    let full = k / 16 * 16;
    let tail = (k - full) as u32;
    let mut acc = [[_mm512_setzero_ps(); C]; R];
    let mut kk = 0;
    while kk < full {
        let mut xv = [_mm512_setzero_ps(); R];
        for (i, v) in xv.iter_mut().enumerate() {
            *v = _mm512_loadu_ps(x.add(i * k + kk));
        }
        for j in 0..C {
            let wv = _mm512_loadu_ps(w.add(j * k + kk));
            if j < PF {
                prefetch_weights(pf.wrapping_add(j * k + kk), far);
            }
            for i in 0..R {
                acc[i][j] = _mm512_fmadd_ps(xv[i], wv, acc[i][j]);
            }
        }
        kk += 16;
    }
    if tail > 0 {
        let mask: __mmask16 = ((1u32 << tail) - 1) as __mmask16;
        let mut xv = [_mm512_setzero_ps(); R];
        for (i, v) in xv.iter_mut().enumerate() {
            *v = _mm512_maskz_loadu_ps(mask, x.add(i * k + full));
        }
        for j in 0..C {
            let wv = _mm512_maskz_loadu_ps(mask, w.add(j * k + full));
            for i in 0..R {
                acc[i][j] = _mm512_fmadd_ps(xv[i], wv, acc[i][j]);
            }
        }
    }
    store_sums(&acc, y, ldy);
}

/// `y[i * ldy + j] = ` the sum of `acc[i][j]`'s 16 lanes in the fixed tree
/// `i + (i+8)`, then `+4`, `+2`, `+1` (`simd::hsum16`, 16 sums at a
/// time). Only 512-bit instructions touch the accumulators: a 128-bit
/// reduction per sum would confine them to the 16 registers such
/// instructions can name, and the tile's inner loop would spill (`R * C <=
/// 32`).
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn store_sums<const R: usize, const C: usize>(
    acc: &[[std::arch::x86_64::__m512; C]; R],
    y: *mut f32,
    ldy: usize,
) {
    use std::arch::x86_64::*;
    let mut v = [_mm512_setzero_ps(); 32];
    for i in 0..R {
        for j in 0..C {
            v[i * C + j] = acc[i][j];
        }
    }
    let mut s = [0f32; 32];
    let (lo, hi) = v.split_at(16);
    _mm512_storeu_ps(s.as_mut_ptr(), hsum16(lo.try_into().expect("16")));
    if R * C > 16 {
        _mm512_storeu_ps(s.as_mut_ptr().add(16), hsum16(hi.try_into().expect("16")));
    }
    for i in 0..R {
        for j in 0..C {
            *y.add(i * ldy + j) = s[i * C + j];
        }
    }
}

/// The line of a weight row at `p` into L1 and, unless `far` is 0, the
/// line `far` elements on into L2 (see [`FAR_TILES`]).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_weights<W>(p: *const W, far: usize) {
    use std::arch::x86_64::*;
    // SAFETY: a prefetch is a hint; it never faults, whatever the address.
    #[allow(unsafe_code)]
    unsafe {
        _mm_prefetch::<_MM_HINT_T0>(p as *const i8);
        if far > 0 {
            _mm_prefetch::<_MM_HINT_T2>(p.wrapping_add(far) as *const i8);
        }
    }
}

/// The bf16 twin of [`tile`]: `R x C` dot products of bf16 rows (`u16`
/// bits), 32 elements per `vdpbf16ps`, a masked tail for `k % 32`, then
/// [`store_sums`].
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[allow(clippy::needless_range_loop)]
unsafe fn tile_bf16<const R: usize, const C: usize, const PF: usize>(
    x: *const u16,
    w: *const u16,
    k: usize,
    y: *mut f32,
    ldy: usize,
    pf: *const u16,
    far: usize,
) {
    use std::arch::x86_64::*;
    // Same 512 bits, read as 32 bf16 values.
    let bh = |v: __m512i| std::mem::transmute::<__m512i, __m512bh>(v);
    let zero = bh(_mm512_setzero_si512());
    let mut acc = [[_mm512_setzero_ps(); C]; R];
    let full = k / 32 * 32;
    let mut kk = 0;
    while kk < full {
        let load = |p: *const u16| bh(_mm512_loadu_si512(p as *const __m512i));
        let mut xv: [__m512bh; R] = [zero; R];
        for i in 0..R {
            xv[i] = load(x.add(i * k + kk));
        }
        for j in 0..C {
            let wv = load(w.add(j * k + kk));
            if j < PF {
                prefetch_weights(pf.wrapping_add(j * k + kk), far);
            }
            for i in 0..R {
                acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv[i], wv);
            }
        }
        kk += 32;
    }
    if full < k {
        // The last, partial step (`k % 32` lanes).
        let mask = ((1u64 << (k - full)) - 1) as __mmask32;
        let load = |p: *const u16| bh(_mm512_maskz_loadu_epi16(mask, p as *const i16));
        let mut xv: [__m512bh; R] = [zero; R];
        for i in 0..R {
            xv[i] = load(x.add(i * k + full));
        }
        for j in 0..C {
            let wv = load(w.add(j * k + full));
            for i in 0..R {
                acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv[i], wv);
            }
        }
    }
    store_sums(&acc, y, ldy);
}

/// `x [m, k] @ w[n, k]^T` as a candle op on the CPU: `x` f32, `w` f32
/// ([`matmul_nt`], AVX-512F) or bf16 ([`matmul_nt_bf16`], AVX-512
/// BF16), output f32; with the matmul backward (`dx = g w`, `dw = g^T x`
/// in `w`'s dtype, both detached; for bf16 weights the rounding of `x` is
/// taken as the identity, straight through).
pub fn matmul_nt_op(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (_, k) = x.dims2()?;
    let (_, k2) = w.dims2()?;
    if k != k2 || x.dtype() != DType::F32 || !matches!(w.dtype(), DType::F32 | DType::BF16) {
        candle_core::bail!(
            "matmul_nt: x {:?} {:?} and w {:?} {:?} do not fit (want f32 x, f32 or bf16 w)",
            x.dims(),
            x.dtype(),
            w.dims(),
            w.dtype()
        );
    }
    x.contiguous()?.apply_op2(&w.contiguous()?, MatmulNt)
}

#[derive(Debug, Clone, Copy)]
struct MatmulNt;

impl CustomOp2 for MatmulNt {
    fn name(&self) -> &'static str {
        "arbor-matmul-nt"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (m, k) = xl.shape().dims2()?;
        let n = wl.shape().dims()[0];
        let (w0, w1) = (wl.start_offset(), wl.start_offset() + n * k);
        let w = match ws {
            CpuStorage::F32(w) if matmul_nt_available() => WeightRows::F32(&w[w0..w1]),
            CpuStorage::BF16(w) if matmul_nt_bf16_available() => WeightRows::Bf16(&w[w0..w1]),
            _ => candle_core::bail!(
                "matmul_nt: {:?} weights need AVX-512F (f32) or AVX-512 BF16 (bf16) on this CPU",
                candle_core::backend::BackendStorage::dtype(ws)
            ),
        };
        let CpuStorage::F32(x) = xs else {
            candle_core::bail!("matmul_nt: x must be f32");
        };
        let x = &x[xl.start_offset()..xl.start_offset() + m * k];
        Ok((CpuStorage::F32(single(x, w, m, k, n)), Shape::from((m, n))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        // Only for inputs that want one: a frozen weight (a LoRA base, an
        // inference model) gets no `g^T x`, which would cost a matmul as
        // large as the forward's. Detached: `w` is usually a variable
        // itself, and candle keeps a variable's gradient as returned, so an
        // attached `g^T x` would hold the whole forward graph alive for as
        // long as the gradient lives.
        let dx = if x.track_op() {
            Some(g.matmul(&w.to_dtype(DType::F32)?)?.detach())
        } else {
            None
        };
        let dw = if w.track_op() {
            Some(g.t()?.matmul(x)?.to_dtype(w.dtype())?.detach())
        } else {
            None
        };
        Ok((dx, dw))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};
    use rand::{rngs::StdRng, Rng, SeedableRng};

    #[test]
    fn bf16_bits_are_half_from_f32() {
        // Specials, ties, subnormals, the overflow edge, NaN payloads.
        let mut xs: Vec<f32> = [
            0x0000_0000u32,
            0x8000_0000,
            0x0000_0001,
            0x8000_8000,
            0x0001_8000,
            0x0000_7fff,
            0x007f_ffff,
            0x3f80_8000,
            0x3f81_8000,
            0x3f80_8001,
            0x3f80_7fff,
            0x7f7f_ffff,
            0x7f7f_7fff,
            0x7f80_0000,
            0xff80_0000,
            0x7f80_0001,
            0xffc1_2345,
            0x7fbf_ffff,
        ]
        .iter()
        .map(|&b| f32::from_bits(b))
        .collect();
        // Every exponent, with pseudo-random mantissas and signs.
        let mut s = 12345u64;
        for _ in 0..100_000 {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            xs.push(f32::from_bits((s >> 32) as u32));
        }
        let widened = round_bf16(&xs);
        for (&r, &x) in widened.iter().zip(&xs) {
            let want = half::bf16::from_f32(x).to_f32();
            assert_eq!(r.to_bits(), want.to_bits(), "{:#010x}", x.to_bits());
        }
        for n in [xs.len(), 17, 16, 5] {
            let got = to_bf16_bits(&xs[..n]);
            for (i, (&g, &x)) in got.iter().zip(&xs).enumerate() {
                assert_eq!(
                    g,
                    half::bf16::from_f32(x).to_bits(),
                    "{i}: {:#010x}",
                    x.to_bits()
                );
            }
        }
    }

    /// A kernel under test: `run(x, w, m, k, n)` with `w` as f32 values
    /// (bf16-exact for the bf16 kernel); `round` is what the kernel does to
    /// each input before multiplying.
    struct Kernel {
        available: bool,
        round: fn(f32) -> f64,
        run: Run,
    }

    /// `(x, w, m, k, n) -> y`.
    type Run = fn(&[f32], &[f32], usize, usize, usize) -> Vec<f32>;

    fn f32_kernel() -> Kernel {
        Kernel {
            available: matmul_nt_available(),
            round: |v| v as f64,
            run: matmul_nt,
        }
    }

    /// Inputs rounded as `vdpbf16ps` takes them: f32 -> bf16 (nearest even).
    fn bf16_kernel() -> Kernel {
        Kernel {
            available: matmul_nt_bf16_available(),
            round: |v| half::bf16::from_f32(v).to_f64(),
            run: |x, w, m, k, n| {
                let w: Vec<half::bf16> = w.iter().map(|&v| half::bf16::from_f32(v)).collect();
                matmul_nt_bf16(x, &w, m, k, n)
            },
        }
    }

    fn same(a: &[f32], b: &[f32]) -> bool {
        a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits())
    }

    /// Uniform in [-1, 1), as the kernel's weights can hold them.
    fn values(kn: &Kernel, rng: &mut StdRng, len: usize) -> Vec<f32> {
        (0..len)
            .map(|_| (kn.round)(rng.random_range(-1.0..1.0)) as f32)
            .collect()
    }

    /// Every output against the f64 sum of the rounded inputs' products,
    /// over every tile shape, tail and cache-block remainder.
    fn check_reference(kn: &Kernel, seed: u64) {
        if !kn.available {
            eprintln!("SKIP: this CPU lacks the kernel");
            return;
        }
        let mut rng = StdRng::seed_from_u64(seed);
        for &(k, n) in &[
            (576usize, 200usize),
            (37, 130),
            (16, 3),
            (32, 3),
            (1, 5),
            (100, 7),
        ] {
            for m in (1..=13).chain([64, 67, 130]) {
                let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect();
                let w = values(kn, &mut rng, n * k);
                let y = (kn.run)(&x, &w, m, k, n);
                for i in 0..m {
                    for j in 0..n {
                        // Products of the rounded inputs are exact in f32
                        // for both kernels; only the f32 sums round.
                        let want: f64 = (0..k)
                            .map(|t| (kn.round)(x[i * k + t]) * w[j * k + t] as f64)
                            .sum();
                        let got = y[i * n + j] as f64;
                        assert!(
                            (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                            "m {m} k {k} n {n} [{i},{j}]: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    /// A row's output is bit-identical whatever the rows around it: alone,
    /// at every position of batches of every size (all tile remainders and
    /// cache blocks), and for every slice of the weight rows.
    fn check_rows_bit_identical(kn: &Kernel, seed: u64) {
        if !kn.available {
            return;
        }
        let mut rng = StdRng::seed_from_u64(seed);
        let (k, n) = (77usize, 53usize);
        let big = 150;
        let x: Vec<f32> = (0..big * k).map(|_| rng.random_range(-1.0..1.0)).collect();
        let w = values(kn, &mut rng, n * k);
        let alone: Vec<Vec<f32>> = (0..big)
            .map(|r| (kn.run)(&x[r * k..(r + 1) * k], &w, 1, k, n))
            .collect();
        for m in [2usize, 3, 5, 8, 32, 65, 150] {
            for start in [0usize, 1, 3] {
                if start + m > big {
                    continue;
                }
                let y = (kn.run)(&x[start * k..(start + m) * k], &w, m, k, n);
                for i in 0..m {
                    assert!(
                        same(&y[i * n..(i + 1) * n], &alone[start + i]),
                        "row {} in a batch of {m} from {start} differs",
                        start + i
                    );
                }
            }
        }
        // Any window of weight rows gives the same columns.
        let full = (kn.run)(&x[..5 * k], &w, 5, k, n);
        for (j0, j1) in [(0usize, 1usize), (7, 20), (13, 53)] {
            let part = (kn.run)(&x[..5 * k], &w[j0 * k..j1 * k], 5, k, j1 - j0);
            for i in 0..5 {
                let cols = &full[i * n + j0..i * n + j1];
                assert!(same(&part[i * (j1 - j0)..(i + 1) * (j1 - j0)], cols));
            }
        }
    }

    #[test]
    fn matches_f64_reference_for_every_tile_shape_and_tail() {
        check_reference(&f32_kernel(), 1);
        check_reference(&bf16_kernel(), 3);
    }

    #[test]
    fn rows_are_bit_identical_whatever_the_batch() {
        check_rows_bit_identical(&f32_kernel(), 2);
        check_rows_bit_identical(&bf16_kernel(), 4);
    }

    #[test]
    fn op_gradients_equal_candle_matmul() -> Result<()> {
        if !matmul_nt_available() {
            return Ok(());
        }
        let dev = Device::Cpu;
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (5, 40), &dev)?)?;
        let w = Var::from_tensor(&Tensor::randn(0f32, 1.0, (9, 40), &dev)?)?;
        let c = Tensor::randn(0f32, 1.0, (5, 9), &dev)?;
        let a = (matmul_nt_op(x.as_tensor(), w.as_tensor())? * &c)?.sum_all()?;
        let b = (x.as_tensor().matmul(&w.as_tensor().t()?)? * &c)?.sum_all()?;
        assert!((a.to_scalar::<f32>()? - b.to_scalar::<f32>()?).abs() < 1e-3);
        let (ga, gb) = (a.backward()?, b.backward()?);
        for v in [&x, &w] {
            let d = (ga.get(v.as_tensor()).expect("grad") - gb.get(v.as_tensor()).expect("grad"))?
                .abs()?
                .max_all()?
                .to_scalar::<f32>()?;
            assert!(d < 1e-5, "{d}");
        }
        // The weight's gradient must not hold the forward graph (it would
        // live on in the optimizer's moments).
        let h = (x.as_tensor() * 2.0)?;
        let l = matmul_nt_op(&h, w.as_tensor())?.sum_all()?;
        let g = l.backward()?;
        assert!(!g.get(w.as_tensor()).expect("grad").track_op());
        Ok(())
    }

    #[test]
    fn bf16_op_gradients_are_the_straight_through_matmul() -> Result<()> {
        if !matmul_nt_bf16_available() {
            return Ok(());
        }
        let dev = Device::Cpu;
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (5, 40), &dev)?)?;
        let w = Tensor::randn(0f32, 1.0, (9, 40), &dev)?.to_dtype(DType::BF16)?;
        let wf = w.to_dtype(DType::F32)?;
        let c = Tensor::randn(0f32, 1.0, (5, 9), &dev)?;
        let a = (matmul_nt_op(x.as_tensor(), &w)? * &c)?.sum_all()?;
        let ga = a.backward()?;
        let dx = ga.get(x.as_tensor()).expect("grad");
        let want = c.matmul(&wf)?;
        let d = (dx - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(d < 1e-5, "{d}");
        Ok(())
    }

    /// One grouped call gives bit for bit what separate calls give, for
    /// f32 and (where the CPU has them) bf16 weights side by side, at decode
    /// and prefill sizes.
    #[test]
    fn grouped_products_equal_separate_calls() {
        if !matmul_nt_available() {
            return;
        }
        let bf16 = matmul_nt_bf16_available();
        let mut rng = StdRng::seed_from_u64(5);
        let k = 96;
        let w1: Vec<f32> = (0..200 * k).map(|_| rng.random_range(-1.0..1.0)).collect();
        let w2: Vec<half::bf16> = (0..64 * k)
            .map(|_| half::bf16::from_f32(rng.random_range(-1.0..1.0)))
            .collect();
        let w3: Vec<f32> = (0..7 * k).map(|_| rng.random_range(-1.0..1.0)).collect();
        for m in [1usize, 8, 32, 300] {
            let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect();
            let (mut y1, mut y2, mut y3) =
                (vec![0f32; m * 200], vec![0f32; m * 64], vec![0f32; m * 7]);
            if bf16 {
                matmul_nt_multi_into(
                    &x,
                    &[
                        WeightRows::F32(&w1),
                        WeightRows::Bf16(&w2),
                        WeightRows::F32(&w3),
                    ],
                    m,
                    k,
                    &mut [&mut y1, &mut y2, &mut y3],
                );
                assert!(
                    same(&y2, &matmul_nt_bf16(&x, &w2, m, k, 64)),
                    "m {m}: bf16 group"
                );
            } else {
                matmul_nt_multi_into(
                    &x,
                    &[WeightRows::F32(&w1), WeightRows::F32(&w3)],
                    m,
                    k,
                    &mut [&mut y1, &mut y3],
                );
            }
            assert!(
                same(&y1, &matmul_nt(&x, &w1, m, k, 200)),
                "m {m}: f32 group"
            );
            assert!(
                same(&y3, &matmul_nt(&x, &w3, m, k, 7)),
                "m {m}: small group"
            );
        }
    }

    /// Empty shapes: no rows or no weight rows write nothing; an empty
    /// inner dimension gives zeros, as an empty sum should.
    #[test]
    fn empty_shapes() {
        if !matmul_nt_available() {
            return;
        }
        assert!(matmul_nt(&[], &[1.0; 8], 0, 4, 2).is_empty());
        assert!(matmul_nt(&[1.0; 8], &[], 2, 4, 0).is_empty());
        let mut y = vec![7f32; 6];
        matmul_nt_into(&[], &[], 2, 0, 3, &mut y);
        assert_eq!(y, vec![0f32; 6]);
        let mut y = vec![7f32; 8];
        matmul_nt_into(&[], &[], 2, 0, 3, &mut y);
        assert_eq!(y[6..], [7.0, 7.0], "only [m, n] is written");
    }
}
