//! Row-invariant CPU matmul: `y[m, n] = x[m, k] w[n, k]^T` in f32, for
//! every row count (a decode step of 1 row, a batch of 32, a
//! prefill of thousands); and its bf16-weight twin (`x` rounded to bf16,
//! `vdpbf16ps`, f32 sums: [`matmul_nt_bf16`]), with grouped calls
//! ([`matmul_nt_multi_into`]) for several weights of one input.
//!
//! **f32 weights** run in [`crate::cpu::packed`]: each output is one FMA chain
//! over `k` in order, from zero, so every CPU gives the same bits (AVX2
//! 4 x 24 outer-product tiles, or the portable `f32::mul_add` chains). The
//! weights are packed for the call ([`WeightRows::F32`]) or were packed
//! once ([`WeightRows::Packed`], as the engine keeps its static weights).
//! The outer product needs no lane sums, which cost ~12% of the
//! dot-product tiles below.
//!
//! **bf16 weights** run dot-product tiles. Each output is a dot product
//! computed the same way whatever the tile it falls in: with AVX-512 BF16,
//! `vdpbf16ps` into 16 lane-wise chains over `k` in order, then the fixed
//! pairwise tree `lane i + lane i+8`, `i + i+4`, `i + i+2`, `i + i+1`
//! (`store_sums`); elsewhere the weights are widened to f32 (exactly) into
//! 8 lane-wise FMA chains ([`MatmulIsa`]: AVX2 with FMA, or portable Rust,
//! 8 lanes of separate multiplies and adds). Those results differ across
//! CPUs in the last bits.
//!
//! Either way, on one CPU a row's result depends only on that row and the
//! weights, never on how many other rows share the call or where it sits
//! among them. The engine relies on this: a sequence's logits (and
//! therefore its sampled tokens) must not depend on the batch it decodes
//! in, on whether its prefix was prefilled or served from the cache, or on
//! whether a run was resumed.
//!
//! The bf16 tiles read both operands in their natural layouts (`w` is a
//! `Linear` weight, `[out, in]`): a register tile of `MR x NR` (4 x 6) dot
//! products (on AVX2, in passes of up to 3 weight rows: `tile_avx2`)
//! loads `MR + NR` vectors per `MR * NR` FMAs; a weight tile of 6 rows
//! stays in L1 while a 64-row block of `x` streams past it from L2, and the
//! next weight tile is prefetched while the block's rows meet the current
//! one, its rows shared out among the block's first row tiles (one row each
//! from 21 rows of `x` up; all six by the one tile of a 1-4 row call) so
//! that only a few misses are in flight at a time and they overlap the
//! arithmetic (issuing all six rows' misses from the first row tile
//! stalled it and left weight streaming and compute in series: cold
//! weights at 32 rows ran 35% below hot ones); calls of up to 64 rows also
//! prefetch the tile [`FAR_TILES`] further on into L2, so the weight stream
//! is not bound by the L1 miss queues. With AVX-512 the tile's 24
//! accumulators stay in registers through the loop: their lane sums are
//! taken 16 at a time by one transposing tree of 512-bit instructions (a
//! 128-bit reduction per sum would confine them to the 16 registers such
//! instructions can name, and the compiler then spilled a third of them
//! inside the loop, costing 1.3 to 1.5x at 8 to 32 rows). Threads split the
//! weight rows (and, for long inputs, `x`). At decode sizes each weight is
//! read from memory once per call. On AVX2, calls of a few rows that do
//! not fill the tiles ([`sweeps`]) instead sweep the weights one row at a
//! time against every row of `x` ([`sweep_avx2`]): one sequential stream.
//! Each dot product is summed exactly as in a tile.
//!
//! [`matmul_nt_op`] is a candle op (f32 `x`; f32 or bf16 `w`; CPU) with the
//! usual matmul backward. Every CPU runs it: candle's GEMM is not
//! row-invariant (on a Zen 2, the same row's logprobs moved by an ulp with
//! the batch around it).

use crate::cpu::packed::PackedWeights;
use rayon::prelude::*;
use std::ops::Range;

#[cfg(target_arch = "x86_64")]
use crate::cpu::simd::{hsum16, hsum8};

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
/// 23-38% and 7-9% (the decode step's matmuls timed alone).
const FAR_TILES: usize = 2;
/// Elements past the next weight tile's rows from which a tile of a call
/// of `m` rows also prefetches into L2 (0 = none): [`FAR_TILES`] tiles on
/// for decode-sized calls, which stream each weight once (bf16 weights on
/// a 2-core Zen 2, 4 rows: 13.2-13.8 ms a step with, 14.2-14.3 without).
fn far_ahead(m: usize, k: usize) -> usize {
    if m <= MB {
        FAR_TILES * NR * k
    } else {
        0
    }
}

/// Multiply-adds below which a call runs on one thread (~10 us of work),
/// unless its weights reach [`SERIAL_WEIGHTS`].
pub(crate) const SERIAL_MACS: usize = 1 << 20;
/// Weight elements from which a call runs in parallel however few rows of
/// `x` it has: a decode step of one sequence streams its weights from
/// memory, and one core draws about half the bandwidth two do (a
/// SmolLM2-135M f32 step on a 2-core Zen 2: 30-34 ms with its q/k/v, o and
/// down projections on one thread, 23-26 ms with all in parallel).
pub(crate) const SERIAL_WEIGHTS: usize = 1 << 16;

/// Rows of `x` up to which the AVX2 kernel sweeps the weights a row at a
/// time against every row of `x` ([`sweep_avx2`]) instead of in register
/// tiles.
const SWEEP_ROWS: usize = 8;
// `sweep_avx2` has kernels for 1 to 8 rows (8 accumulators fit the registers).
const _: () = assert!(SWEEP_ROWS <= 8);
/// How far ahead of its reads the sweep prefetches a weight row, in bytes
/// (four bf16 rows of a 576-wide model).
#[cfg(target_arch = "x86_64")]
const SWEEP_AHEAD: usize = 4608;

/// Whether the AVX2 kernel sweeps ([`sweep_avx2`]) a call of `m` rows of
/// bf16 weights: bf16 weights are half the bytes, so bound by the
/// arithmetic, where full 4-row tiles load fewer vectors per FMA; the
/// sweep serves the row counts the tiles leave ragged. A decode step's
/// matmuls on a Zen 2, ms a step, tiles vs sweep: m = 1 15.4 / 13.2, m = 4 14.9 / 15.8,
/// m = 5 22 / 16.1, m = 8 22.7 / 24.4.
fn sweeps(m: usize) -> bool {
    m <= SWEEP_ROWS && !m.is_multiple_of(MR)
}

/// The instruction set the kernels use. Every CPU has one
/// ([`MatmulIsa::detect`]). f32 weights give the same bits on every set
/// ([`crate::cpu::packed`]: the AVX2 kernel on `Avx512` and `Avx2`, the
/// portable chains on `Portable`); bf16 weights' results depend on the
/// set, never on the batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatmulIsa {
    /// AVX-512F: bf16 weights by `vdpbf16ps` into 16-lane chains, 4 x 6
    /// register tiles, where the CPU has AVX-512 BF16 (else widened, as
    /// AVX2).
    Avx512,
    /// AVX2 and FMA: bf16 weights widened to f32 (exact) in registers into
    /// 8-lane chains, tiles in passes of 4 x 3 accumulators (or, for a few
    /// rows of `x`, one weight row at a time).
    Avx2,
    /// Plain Rust: bf16 weights widened into 8-lane chains of separate
    /// multiplies and adds, one row of `x` against 6 weight rows at a time.
    Portable,
}

impl MatmulIsa {
    /// The fastest set this CPU runs.
    pub fn detect() -> Self {
        [Self::Avx512, Self::Avx2]
            .into_iter()
            .find(|isa| isa.supported())
            .unwrap_or(Self::Portable)
    }

    /// Whether this CPU runs kernels of this set.
    pub fn supported(self) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            Self::Avx512 => std::is_x86_feature_detected!("avx512f"),
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 => crate::cpu::simd::avx2_fma(),
            #[cfg(not(target_arch = "x86_64"))]
            Self::Avx512 | Self::Avx2 => false,
            Self::Portable => true,
        }
    }

    /// Every set this CPU runs, fastest first.
    pub fn all_supported() -> Vec<Self> {
        [Self::Avx512, Self::Avx2, Self::Portable]
            .into_iter()
            .filter(|isa| isa.supported())
            .collect()
    }

    /// `"avx512"` (`"avx512-bf16"` with bf16 dot products), `"avx2"` or
    /// `"portable"`, for benchmark records.
    pub fn name(self) -> &'static str {
        match self {
            Self::Avx512 if self.bf16_dot() => "avx512-bf16",
            Self::Avx512 => "avx512",
            Self::Avx2 => "avx2",
            Self::Portable => "portable",
        }
    }

    /// Whether bf16 weights meet `x` in `vdpbf16ps` (AVX-512 BF16) rather
    /// than widened to f32.
    fn bf16_dot(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            self == Self::Avx512
                && std::is_x86_feature_detected!("avx512bw")
                && std::is_x86_feature_detected!("avx512bf16")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }
}

/// Raw output pointer shared by the tasks, which write disjoint columns
/// (here and in [`crate::cpu::packed`]).
#[derive(Clone, Copy)]
pub(crate) struct OutPtr(pub(crate) *mut f32);
// SAFETY: every task writes only its own output tiles (columns `n0..n1` of
// one product, in its own block of rows).
#[allow(unsafe_code)]
unsafe impl Send for OutPtr {}
// SAFETY: as for `Send`: tasks sharing it write disjoint tiles.
#[allow(unsafe_code)]
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// The pointer (a method, so closures capture the whole `Sync` wrapper
    /// rather than its raw field).
    pub(crate) fn at(self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }
}

/// `x: [m, k]`, `w: [n, k]` (both row-major, contiguous) -> `y: [m, n]`,
/// each output one FMA chain over `k` ([`crate::cpu::packed`]; `w` is packed
/// for the call). Panics if the slices are shorter than the shapes.
pub fn matmul_nt(x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    single(x, WeightRows::F32(w), m, k, n)
}

/// [`matmul_nt`] into a caller's buffer `y` (`m * n`, overwritten).
pub fn matmul_nt_into(x: &[f32], w: &[f32], m: usize, k: usize, n: usize, y: &mut [f32]) {
    single_into(x, WeightRows::F32(w), m, k, n, y);
}

/// One product through [`matmul_nt_multi_into`]: the first `n` rows of `w`
/// into the first `m * n` values of `y`.
pub(crate) fn single_into(
    x: &[f32],
    w: WeightRows<'_>,
    m: usize,
    k: usize,
    n: usize,
    y: &mut [f32],
) {
    assert!(
        w.len() >= n * k && y.len() >= m * n,
        "matmul_nt: slices shorter than [{m}, {k}] x [{n}, {k}]^T"
    );
    matmul_nt_multi_into(x, &[w.rows(n * k)], m, k, &mut [&mut y[..m * n]]);
}

/// One product into a new buffer ([`matmul_nt_multi`]): the first `n`
/// rows of `w`.
pub(crate) fn single(x: &[f32], w: WeightRows<'_>, m: usize, k: usize, n: usize) -> Vec<f32> {
    assert!(
        w.len() >= n * k,
        "matmul_nt: slices shorter than [{m}, {k}] x [{n}, {k}]^T"
    );
    let mut ys = matmul_nt_multi(x, &[w.rows(n * k)], m, k, &[n]);
    ys.pop().expect("one product")
}

/// `src [rows, cols]` (row-major) transposed to `[cols, rows]`, each value
/// passed through `conv` (a cast to bf16, or none): the operand layout the
/// `x w^T` kernels need for a product summed along `src`'s rows (a
/// backward's `g^T x`). At these sizes a transpose is bound by memory
/// traffic, so each task reads a band of [`BAND`] whole source rows in
/// order (a sequential stream, which the prefetchers follow; bands of
/// result rows, which read every source row in short strided pieces, ran
/// 2x slower on weights fresh from memory) and writes, for each column, the
/// band's [`BAND`] values as one contiguous piece of a result row, in
/// blocks of 64 columns; and the result is not zeroed first (a fill would
/// be a third of the traffic).
pub(crate) fn transposed<S: Copy + Sync, D: Copy + Send>(
    src: &[S],
    rows: usize,
    cols: usize,
    conv: impl Fn(S) -> D + Sync,
) -> Vec<D> {
    const COLS: usize = 64;
    assert!(
        src.len() >= rows * cols,
        "transposed: src shorter than [{rows}, {cols}]"
    );
    let mut dst: Vec<D> = Vec::with_capacity(rows * cols);
    let out = BandPtr(dst.as_mut_ptr());
    (0..rows.div_ceil(BAND)).into_par_iter().for_each(|b| {
        let (r0, out) = (b * BAND, out);
        let nr = BAND.min(rows - r0);
        for c0 in (0..cols).step_by(COLS) {
            for c in c0..(c0 + COLS).min(cols) {
                for i in 0..nr {
                    // SAFETY: `c * rows + r0 + i < cols * rows`, inside the
                    // allocation; this band alone writes result columns
                    // `r0..r0 + nr`.
                    #[allow(unsafe_code)]
                    unsafe {
                        out.at(c * rows + r0 + i)
                            .write(conv(src[(r0 + i) * cols + c]));
                    }
                }
            }
        }
    });
    // SAFETY: the bands cover rows `0..rows`, and each writes its rows'
    // values of every result row `c < cols`: all `rows * cols` values are
    // written. A panic in a task leaves the length 0.
    #[allow(unsafe_code)]
    unsafe {
        dst.set_len(rows * cols);
    }
    dst
}

/// Source rows per task of [`transposed`].
const BAND: usize = 16;

/// The result of [`transposed`], shared by its tasks, which write disjoint
/// columns of it.
struct BandPtr<D>(*mut D);
impl<D> Clone for BandPtr<D> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<D> Copy for BandPtr<D> {}
// SAFETY: each task writes only the result columns of its own band.
#[allow(unsafe_code)]
unsafe impl<D: Send> Send for BandPtr<D> {}
// SAFETY: as for `Send`.
#[allow(unsafe_code)]
unsafe impl<D: Send> Sync for BandPtr<D> {}

impl<D> BandPtr<D> {
    /// The pointer to element `i` (a method, so closures capture the whole
    /// wrapper rather than its raw field).
    fn at(self, i: usize) -> *mut D {
        self.0.wrapping_add(i)
    }
}

/// `y[m, n] = bf16(x)[m, k] w[n, k]^T` for bf16 weights: `x` is rounded to
/// bf16 (nearest even), every product of two bf16 values is exact in f32,
/// and the products are summed in f32: by `vdpbf16ps` with AVX-512 BF16, 32
/// per instruction (pairs `2i, 2i+1` into lane `i`), then by a fixed lane
/// tree; on other CPUs the weights are widened to f32 (exactly) and meet
/// the rounded `x` in 8-lane FMA chains. Rows are as batch-invariant as
/// [`matmul_nt`]'s, with half the weight bytes; the summation order is not
/// `matmul_nt`'s. Panics if the slices are shorter than the shapes.
pub fn matmul_nt_bf16(x: &[f32], w: &[half::bf16], m: usize, k: usize, n: usize) -> Vec<f32> {
    single(x, WeightRows::Bf16(w), m, k, n)
}

/// The rows of a weight matrix `[n, k]` (row-major) for
/// [`matmul_nt_multi_into`]: f32 ([`matmul_nt`]) or bf16
/// ([`matmul_nt_bf16`]).
/// f32 weights, plain or already packed ([`PackedWeights`], which the
/// engine keeps for its static weights), both computed by
/// [`crate::cpu::packed`]'s FMA chains, the plain ones packed per call.
#[derive(Debug, Clone, Copy)]
pub enum WeightRows<'a> {
    F32(&'a [f32]),
    Bf16(&'a [half::bf16]),
    Packed(&'a PackedWeights),
}

impl<'a> WeightRows<'a> {
    fn len(&self) -> usize {
        match self {
            WeightRows::F32(w) => w.len(),
            WeightRows::Bf16(w) => w.len(),
            WeightRows::Packed(w) => w.n() * w.k(),
        }
    }

    /// The first `len` elements (all of a packed matrix).
    fn rows(self, len: usize) -> WeightRows<'a> {
        match self {
            WeightRows::F32(w) => WeightRows::F32(&w[..len]),
            WeightRows::Bf16(w) => WeightRows::Bf16(&w[..len]),
            WeightRows::Packed(w) => {
                assert_eq!(len, w.n() * w.k(), "matmul_nt: part of a packed matrix");
                WeightRows::Packed(w)
            }
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
    matmul_nt_multi_into_isa(MatmulIsa::detect(), x, ws, m, k, ys);
}

/// [`matmul_nt_multi_into`] with the kernels of `isa` rather than this
/// CPU's fastest (tests and benchmarks compare the sets). Panics as it
/// does, and if the CPU lacks `isa`.
pub fn matmul_nt_multi_into_isa(
    isa: MatmulIsa,
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
    assert!(isa.supported(), "matmul_nt: this CPU lacks {isa:?}");
    if k == 0 {
        // Empty dot products: every output is 0 (the weights have no
        // elements, so their row counts are unknown; fill what is given).
        ys.iter_mut().for_each(|y| y.fill(0.0));
        return;
    }
    let ns: Vec<usize> = ws.iter().map(|w| w.len() / k).collect();
    for ((w, y), &n) in ws.iter().zip(ys.iter()).zip(&ns) {
        check_fit(x, *w, y.len(), m, k, n);
    }
    let outs: Vec<OutPtr> = ys.iter_mut().map(|y| OutPtr(y.as_mut_ptr())).collect();
    // SAFETY: the CPU runs `isa`, `k > 0`, and every `ys[g]` holds `m *
    // ns[g]` values (asserted above).
    #[allow(unsafe_code)]
    unsafe {
        products(isa, x, ws, m, k, &ns, &outs);
    }
}

/// Several products of one input into new buffers: `ys[g] = x ws[g]^T`,
/// `[m, ns[g]]`, for `ws[g]: [ns[g], k]`, each computed exactly as
/// [`matmul_nt_multi_into`] computes it. The kernels write every output
/// once, so the buffers are not zeroed first: that fill ran on the
/// calling thread alone, ~2% of `arbor bench generate` while the other
/// thread waited. Panics if a weight is not `[ns[g], k]` or `x` is
/// shorter than `[m, k]`.
pub fn matmul_nt_multi(
    x: &[f32],
    ws: &[WeightRows<'_>],
    m: usize,
    k: usize,
    ns: &[usize],
) -> Vec<Vec<f32>> {
    assert_eq!(
        ws.len(),
        ns.len(),
        "matmul_nt: {} weights, {} output widths",
        ws.len(),
        ns.len()
    );
    if k == 0 {
        return ns.iter().map(|&n| vec![0f32; m * n]).collect();
    }
    for (w, &n) in ws.iter().zip(ns) {
        check_fit(x, *w, m * n, m, k, n);
    }
    let mut ys: Vec<Vec<f32>> = ns.iter().map(|&n| Vec::with_capacity(m * n)).collect();
    let outs: Vec<OutPtr> = ys.iter_mut().map(|y| OutPtr(y.as_mut_ptr())).collect();
    // SAFETY: the detected set is supported, `k > 0`, and each `ys[g]` has
    // room for `m * ns[g]` values. `products` writes every one of them
    // before `set_len` makes them readable; a panic leaves the lengths 0.
    #[allow(unsafe_code)]
    unsafe {
        products(MatmulIsa::detect(), x, ws, m, k, ns, &outs);
        for (y, &n) in ys.iter_mut().zip(ns) {
            y.set_len(m * n);
        }
    }
    ys
}

/// Panics unless `x` holds `[m, k]`, `w` is `[n, k]` and an output of
/// `y_len` values holds `[m, n]`.
fn check_fit(x: &[f32], w: WeightRows<'_>, y_len: usize, m: usize, k: usize, n: usize) {
    assert!(
        x.len() >= m * k && w.len() == n * k && y_len >= m * n,
        "matmul_nt: slices do not fit [{m}, {k}] x [{n}, {k}]^T"
    );
}

/// The products of [`matmul_nt_multi_into`] into `outs[g]` (`[m, ns[g]]`,
/// row-major), every output written exactly once and none read.
///
/// # Safety
/// The CPU runs `isa`; `k > 0`; `x.len() >= m * k`; `ws[g].len() ==
/// ns[g] * k`; `outs[g]` points at room for `m * ns[g]` values
/// (initialised or not) that nothing else touches during the call.
#[allow(unsafe_code)]
unsafe fn products(
    isa: MatmulIsa,
    x: &[f32],
    ws: &[WeightRows<'_>],
    m: usize,
    k: usize,
    ns: &[usize],
    outs: &[OutPtr],
) {
    // f32 weights: each output one FMA chain over `k` (crate::cpu::packed), the
    // same bits on every CPU; plain ones are packed for this call.
    let packs: Vec<Option<PackedWeights>> = ws
        .iter()
        .zip(ns)
        .map(|(w, &n)| match w {
            WeightRows::F32(v) => Some(PackedWeights::pack(v, n, k)),
            _ => None,
        })
        .collect();
    let (mut pws, mut pouts) = (Vec::new(), Vec::new());
    for ((w, pack), out) in ws.iter().zip(&packs).zip(outs) {
        match (w, pack) {
            (WeightRows::Packed(p), _) => pws.push(*p),
            (_, Some(p)) => pws.push(p),
            _ => continue,
        }
        pouts.push(*out);
    }
    if !pws.is_empty() {
        let avx2 = isa != MatmulIsa::Portable && crate::cpu::packed::avx2();
        crate::cpu::packed::products(x, m, &pws, &pouts, avx2);
    }
    // bf16 weights: the dot-product tiles below.
    let ns: Vec<usize> = ws
        .iter()
        .zip(ns)
        .map(|(w, &n)| {
            if matches!(w, WeightRows::Bf16(_)) {
                n
            } else {
                0
            }
        })
        .collect();
    let ns = &ns[..];
    let any_bf16 = ws.iter().any(|w| matches!(w, WeightRows::Bf16(_)));
    if !any_bf16 {
        return;
    }
    // bf16 weights meet `bf16(x)`: as bits for `vdpbf16ps`, or widened back
    // to f32 for the 8-lane kernels.
    let dot = any_bf16 && isa.bf16_dot();
    let xb: Vec<u16> = if dot {
        to_bf16_bits(&x[..m * k])
    } else {
        Vec::new()
    };
    let xr: Vec<f32> = if any_bf16 && !dot {
        round_bf16(&x[..m * k])
    } else {
        Vec::new()
    };
    drive(m, k, ns, |g, rows, cols| {
        let (out, n) = (outs[g], ns[g]);
        if isa == MatmulIsa::Avx2 && sweeps(m) {
            // SAFETY: the CPU runs AVX2 and FMA (asserted above); rows of
            // x and cols of ws[g] lie inside the slices (asserted), and the
            // outputs ys[g][rows, cols] belong to the calling task alone.
            #[cfg(target_arch = "x86_64")]
            #[allow(unsafe_code)]
            unsafe {
                let y = out.0.add(rows.start * n + cols.start);
                let (i, j, mr, nc) = (rows.start * k, cols.start * k, rows.len(), cols.len());
                match ws[g] {
                    WeightRows::Bf16(w) => {
                        let w = (w.as_ptr() as *const u16).add(j);
                        sweep_avx2(xr.as_ptr().add(i), mr, w, nc, k, y, n);
                    }
                    WeightRows::F32(_) | WeightRows::Packed(_) => {
                        unreachable!("f32 weights run in crate::cpu::packed")
                    }
                }
            }
            return;
        }
        let far = far_ahead(m, k);
        tiles(rows, cols, |i, mr, j, nr, pf| {
            let at = Tile {
                i,
                mr,
                j,
                nr,
                k,
                // The rows of the next weight tile this tile prefetches.
                pf_at: (j + NR + pf.start) * k,
                npf: pf.len(),
                far,
            };
            // SAFETY: the CPU runs `isa` (asserted above); rows i..i+mr of
            // x and j..j+nr of ws[g] lie inside the slices (asserted), and
            // the outputs ys[g][i.., j..j+nr] belong to the calling task
            // alone.
            #[allow(unsafe_code)]
            unsafe {
                let y = out.0.add(i * n + j);
                match (isa, ws[g]) {
                    #[cfg(target_arch = "x86_64")]
                    (MatmulIsa::Avx512, WeightRows::Bf16(w)) if dot => {
                        at.run::<Bf16Avx512>(xb.as_ptr(), w.as_ptr() as *const u16, y, n);
                    }
                    #[cfg(target_arch = "x86_64")]
                    (MatmulIsa::Avx512 | MatmulIsa::Avx2, WeightRows::Bf16(w)) => {
                        at.run::<Bf16Avx2>(xr.as_ptr(), w.as_ptr() as *const u16, y, n);
                    }
                    (_, WeightRows::Bf16(w)) => {
                        at.run::<Bf16Portable>(xr.as_ptr(), w.as_ptr() as *const u16, y, n);
                    }
                    (_, WeightRows::F32(_) | WeightRows::Packed(_)) => {
                        unreachable!("f32 weights run in crate::cpu::packed")
                    }
                }
            }
        });
    });
}

/// Where one output tile lies: rows `i..i + mr` of `x`, weight rows `j..j +
/// nr`, and the weight rows it prefetches (`npf` from element `pf_at`,
/// `far` elements on into L2).
#[derive(Clone, Copy)]
struct Tile {
    i: usize,
    mr: usize,
    j: usize,
    nr: usize,
    k: usize,
    pf_at: usize,
    npf: usize,
    far: usize,
}

impl Tile {
    /// The tile by kernel `T`, from the starts of `x` and `w`, into `y`
    /// (the tile's first output; row stride `ldy`).
    ///
    /// # Safety
    /// As [`Tiles::tile`], for the rows this tile names.
    #[allow(unsafe_code)]
    #[inline]
    unsafe fn run<T: Tiles>(self, x: *const T::X, w: *const T::W, y: *mut f32, ldy: usize) {
        let pf = (w.wrapping_add(self.pf_at), self.npf);
        let (x, w) = (x.add(self.i * self.k), w.add(self.j * self.k));
        dispatch::<T>(self.mr, self.nr, x, w, self.k, y, ldy, pf, self.far);
    }
}

/// The bits of `bf16(x)` for every value: exactly `half::bf16::from_f32`
/// (round to nearest even, subnormals kept, NaN made quiet with its
/// payload's top bits), 16 values per step in AVX-512 integer arithmetic
/// (`vcvtneps2bf16` would flush subnormals to zero), in parallel chunks
/// for long inputs. The bf16 kernel rounds its `x` this way; a prefill's
/// `x` has millions of values, which the scalar conversion took ~1 ns each
/// on one thread.
fn to_bf16_bits(x: &[f32]) -> Vec<u16> {
    const CH: usize = 1 << 14;
    crate::cpu::rows::new_rows(x.len(), CH, crate::cpu::rows::PAR_MIN, |c, o| {
        let x = &x[c * CH..c * CH + o.len()];
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: AVX-512F detected; `x` and `o` have the same length.
            #[allow(unsafe_code)]
            unsafe {
                bf16_bits_avx512(x, o);
            };
            return;
        }
        for (o, &v) in o.iter_mut().zip(x) {
            *o = half::bf16::from_f32(v).to_bits();
        }
    })
}

/// Every value rounded to bf16 (nearest even, as [`to_bf16_bits`]): a
/// bf16 weight made from an f32 master weight.
pub(crate) fn to_bf16(x: &[f32]) -> Vec<half::bf16> {
    // Same size and alignment: the collect reuses the buffer.
    to_bf16_bits(x)
        .into_iter()
        .map(half::bf16::from_bits)
        .collect()
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

/// Runs `task(g, rows, cols)` over the tasks of the product: rows of `x`
/// and weight rows `cols` of product `g` ([`task_shape`]), on rayon tasks
/// that own disjoint outputs (on the calling thread for small calls).
fn drive(
    m: usize,
    k: usize,
    ns: &[usize],
    task: impl Fn(usize, Range<usize>, Range<usize>) + Sync,
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
    let run = |t: usize| {
        let g = first.partition_point(|&f| f <= t) - 1;
        let (n, n_tasks) = (ns[g], ns[g].div_ceil(nb));
        let local = t - first[g];
        let (mt, nt) = (local / n_tasks, local % n_tasks);
        task(
            g,
            mt * mc..((mt + 1) * mc).min(m),
            nt * nb..((nt + 1) * nb).min(n),
        );
    };
    let tasks = first[ns.len()];
    if m * n_all * k < SERIAL_MACS && n_all * k < SERIAL_WEIGHTS {
        // Small calls stay on the calling thread: a rayon hand-off costs
        // more than the work, and a thread waiting on one would steal
        // unrelated jobs (say, another episode's rollout) meanwhile.
        (0..tasks).for_each(run);
    } else {
        (0..tasks).into_par_iter().for_each(run);
    }
}

/// One task's register tiles: calls `tile(i, mr, j, nr, prefetch)` for the
/// `mr x nr` output tile at `(i, j)`, in cache blocks of [`MB`] rows of
/// `x`. `prefetch` is the range of the next weight tile's rows (`0..NR`)
/// that this tile pulls in, empty for all but a block's first row tiles.
fn tiles(
    rows: Range<usize>,
    cols: Range<usize>,
    mut tile: impl FnMut(usize, usize, usize, usize, Range<usize>),
) {
    for m0 in rows.clone().step_by(MB) {
        let m1 = (m0 + MB).min(rows.end);
        for j in cols.clone().step_by(NR) {
            let nr = NR.min(cols.end - j);
            // The block's first row tiles share out the next weight
            // tile's rows to prefetch (1, 2, 3 or all 6 rows each), so
            // the misses stay few at a time and overlap the arithmetic.
            let n_tiles = (m1 - m0).div_ceil(MR);
            let spread = [6, 3, 2, 1]
                .into_iter()
                .find(|&s| s <= n_tiles)
                .unwrap_or(1);
            let per = NR / spread;
            for (t, i) in (m0..m1).step_by(MR).enumerate() {
                let pf = if t < spread {
                    t * per..(t + 1) * per
                } else {
                    0..0
                };
                tile(i, MR.min(m1 - i), j, nr, pf);
            }
        }
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

/// A register-tile kernel over inputs of element type `X` and weights of
/// type `W`.
trait Tiles {
    type X;
    type W;
    /// `R x C` dot products of rows `k` apart into `y` (row stride `ldy`),
    /// prefetching the `PF` weight rows (`k` apart) from `pf` into L1 and,
    /// unless `far` is 0, those from `pf + far` into L2.
    ///
    /// # Safety
    /// The CPU has the kernel's features; the `R` rows of `x`, the `C` rows
    /// of `w` and the outputs lie inside live allocations.
    #[allow(unsafe_code)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile<const R: usize, const C: usize, const PF: usize>(
        x: *const Self::X,
        w: *const Self::W,
        k: usize,
        y: *mut f32,
        ldy: usize,
        pf: *const Self::W,
        far: usize,
    );
}

/// `impl Tiles for $kernel` over inputs `$x` and weights `$w`, calling the
/// tile function `$tile` (with the trait's `R`, `C`, `PF`).
macro_rules! impl_tiles {
    ($(#[$attr:meta])* $kernel:ident, $x:ty, $w:ty, $($tile:tt)*) => {
        $(#[$attr])*
        struct $kernel;
        $(#[$attr])*
        #[allow(unsafe_code)]
        impl Tiles for $kernel {
            type X = $x;
            type W = $w;
            unsafe fn tile<const R: usize, const C: usize, const PF: usize>(
                x: *const $x,
                w: *const $w,
                k: usize,
                y: *mut f32,
                ldy: usize,
                pf: *const $w,
                far: usize,
            ) {
                $($tile)*(x, w, k, y, ldy, pf, far)
            }
        }
    };
}
impl_tiles!(
    /// bf16 bits (`u16`) with AVX-512 BF16: [`tile_bf16`].
    #[cfg(target_arch = "x86_64")]
    Bf16Avx512, u16, u16, tile_bf16::<R, C, PF>
);
impl_tiles!(
    /// bf16-rounded f32 `x`, bf16 weights widened, AVX2 and FMA.
    #[cfg(target_arch = "x86_64")]
    Bf16Avx2, f32, u16, tile_avx2::<u16, R, C, PF>
);
impl_tiles!(
    /// bf16-rounded f32 `x`, bf16 weights widened, plain Rust.
    Bf16Portable, f32, u16, tile_portable::<u16, R, C>
);

/// The `mr x nr` tile (`mr <= MR`, `nr <= NR`) of kernel `T`.
#[allow(unsafe_code)]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn dispatch<T: Tiles>(
    mr: usize,
    nr: usize,
    x: *const T::X,
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
    );
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

/// The bf16 tile of AVX-512 BF16: `R x C` dot products of bf16 rows (`u16`
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

/// Weight elements of the 8-lane kernels: f32, or bf16 bits (`u16`),
/// widened to f32 exactly (`bits << 16`).
trait Lanes8: Copy {
    /// Whether the elements are bf16 bits.
    const BF16: bool;
}
impl Lanes8 for f32 {
    const BF16: bool = false;
}
impl Lanes8 for u16 {
    const BF16: bool = true;
}

/// The first `n <= 8` elements at `p` as f32 lanes, the rest zero.
///
/// # Safety
/// `p` points at `n` readable elements.
#[allow(unsafe_code)]
#[inline(always)]
unsafe fn lanes8<W: Lanes8>(p: *const W, n: usize) -> [f32; 8] {
    let mut v = [0f32; 8];
    for (l, o) in v.iter_mut().enumerate().take(n) {
        *o = if W::BF16 {
            f32::from_bits(u32::from(*(p as *const u16).add(l)) << 16)
        } else {
            *(p as *const f32).add(l)
        };
    }
    v
}

/// The fixed tree over 8 lanes: `(l + l+4)`, then `+2`, then `+1`.
#[inline(always)]
fn tree8(a: &[f32; 8]) -> f32 {
    let s4 = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    let s2 = [s4[0] + s4[2], s4[1] + s4[3]];
    s2[0] + s2[1]
}

/// The AVX2 tile: `R x C` dot products as 8 lane-wise FMA chains over `k`
/// in order (a zero-padded last step for `k % 8`), then `hsum8`'s tree.
/// At most three weight rows at a time: `R x 3 <= 12` accumulators and
/// three weight vectors fit the 16 registers AVX2 can name (the rows of `x`
/// are FMA memory operands), each weight vector is loaded (and, for bf16,
/// widened) once per step for all `R` rows, and the rows of `x` stay in L1
/// between the passes. Weights are f32 or bf16 (widened exactly; `x` then
/// holds bf16-rounded values, so every product is exact and only the sums
/// round).
///
/// # Safety
/// The CPU has AVX2 and FMA; the rows lie inside live allocations.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2<W: Lanes8, const R: usize, const C: usize, const PF: usize>(
    x: *const f32,
    w: *const W,
    k: usize,
    y: *mut f32,
    ldy: usize,
    pf: *const W,
    far: usize,
) {
    // Weight rows 2.. or 3.. (wrapping: past the tile when C is small, and
    // then never read).
    let (w2, y2) = (w.wrapping_add(2 * k), y.wrapping_add(2));
    let (w3, y3) = (w.wrapping_add(3 * k), y.wrapping_add(3));
    match C {
        1 => cols_avx2::<W, R, 1, 0, PF>(x, w, k, y, ldy, pf, far),
        2 => cols_avx2::<W, R, 2, 0, PF>(x, w, k, y, ldy, pf, far),
        3 => cols_avx2::<W, R, 3, 0, PF>(x, w, k, y, ldy, pf, far),
        4 => {
            cols_avx2::<W, R, 2, 0, PF>(x, w, k, y, ldy, pf, far);
            cols_avx2::<W, R, 2, 2, PF>(x, w2, k, y2, ldy, pf, far);
        }
        5 => {
            cols_avx2::<W, R, 3, 0, PF>(x, w, k, y, ldy, pf, far);
            cols_avx2::<W, R, 2, 3, PF>(x, w3, k, y3, ldy, pf, far);
        }
        _ => {
            cols_avx2::<W, R, 3, 0, PF>(x, w, k, y, ldy, pf, far);
            cols_avx2::<W, R, 3, 3, PF>(x, w3, k, y3, ldy, pf, far);
        }
    }
}

/// The 8 weights at `p` as f32 lanes (bf16 bits widened exactly).
///
/// # Safety
/// The CPU has AVX2; `p` points at 8 readable elements.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn load_w8<W: Lanes8>(p: *const W) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    if W::BF16 {
        let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(h))
    } else {
        _mm256_loadu_ps(p as *const f32)
    }
}

/// Weight rows `J0..J0 + C` (`C <= 3`, `w` and `y` already at row `J0`) of
/// [`tile_avx2`]; they prefetch the next tile's rows below `PF`.
///
/// # Safety
/// As [`tile_avx2`].
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::needless_range_loop)]
unsafe fn cols_avx2<W: Lanes8, const R: usize, const C: usize, const J0: usize, const PF: usize>(
    x: *const f32,
    w: *const W,
    k: usize,
    y: *mut f32,
    ldy: usize,
    pf: *const W,
    far: usize,
) {
    use std::arch::x86_64::*;
    // One prefetch per 64-byte line of a weight row.
    let line = 64 / std::mem::size_of::<W>();
    let full = k / 8 * 8;
    let mut acc = [[_mm256_setzero_ps(); C]; R];
    let mut kk = 0;
    while kk < full {
        let mut wv = [_mm256_setzero_ps(); C];
        for j in 0..C {
            wv[j] = load_w8(w.add(j * k + kk));
            if J0 + j < PF && kk % line == 0 {
                prefetch_weights(pf.wrapping_add((J0 + j) * k + kk), far);
            }
        }
        for i in 0..R {
            let xv = _mm256_loadu_ps(x.add(i * k + kk));
            for j in 0..C {
                acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
            }
        }
        kk += 8;
    }
    if full < k {
        // The last, partial step, zero-padded.
        let t = k - full;
        let mut wv = [_mm256_setzero_ps(); C];
        for j in 0..C {
            wv[j] = _mm256_loadu_ps(lanes8(w.add(j * k + full), t).as_ptr());
        }
        for i in 0..R {
            let xv = _mm256_loadu_ps(lanes8(x.add(i * k + full), t).as_ptr());
            for j in 0..C {
                acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
            }
        }
    }
    for i in 0..R {
        for j in 0..C {
            *y.add(i * ldy + j) = hsum8(acc[i][j]);
        }
    }
}

/// The AVX2 kernel for calls of at most [`SWEEP_ROWS`] rows of `x`: for
/// each of the `nc` weight rows in turn, its `m` dot products with the rows
/// of `x`, each as [`tile_avx2`] computes it (8 lane-wise FMA chains over
/// `k` in order, a zero-padded last step, `hsum8`), so the results are the
/// same bits. The weights are then read as one sequential stream,
/// prefetched [`SWEEP_AHEAD`] bytes ahead, and the rows of `x` (at most
/// 8, so their accumulators fit the registers) stay in L1. With several
/// weight rows in flight at a time (the register tiles), the two cores of
/// a Zen 2 streamed an 8-row decode step's weights at 16 GB/s of the 23 a
/// plain read reaches: the misses and the arithmetic overlapped poorly.
///
/// # Safety
/// The CPU has AVX2 and FMA; `m <= 8`; the `m` rows of `x`, the `nc` rows
/// of `w` (all `k` apart) and the outputs `y[i * ldy + j]` lie inside live
/// allocations.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx2,fma")]
unsafe fn sweep_avx2<W: Lanes8>(
    x: *const f32,
    m: usize,
    w: *const W,
    nc: usize,
    k: usize,
    y: *mut f32,
    ldy: usize,
) {
    match m {
        1 => sweep_rows::<W, 1>(x, w, nc, k, y, ldy),
        2 => sweep_rows::<W, 2>(x, w, nc, k, y, ldy),
        3 => sweep_rows::<W, 3>(x, w, nc, k, y, ldy),
        4 => sweep_rows::<W, 4>(x, w, nc, k, y, ldy),
        5 => sweep_rows::<W, 5>(x, w, nc, k, y, ldy),
        6 => sweep_rows::<W, 6>(x, w, nc, k, y, ldy),
        7 => sweep_rows::<W, 7>(x, w, nc, k, y, ldy),
        8 => sweep_rows::<W, 8>(x, w, nc, k, y, ldy),
        _ => unreachable!("sweep of {m} rows"),
    }
}

/// [`sweep_avx2`] for `R` rows of `x`.
///
/// # Safety
/// As [`sweep_avx2`].
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::needless_range_loop)]
unsafe fn sweep_rows<W: Lanes8, const R: usize>(
    x: *const f32,
    w: *const W,
    nc: usize,
    k: usize,
    y: *mut f32,
    ldy: usize,
) {
    use std::arch::x86_64::*;
    let size = std::mem::size_of::<W>();
    // One prefetch per 64-byte line of the stream.
    let (line, ahead) = (64 / size, SWEEP_AHEAD / size);
    let full = k / 8 * 8;
    for j in 0..nc {
        let wj = w.add(j * k);
        let mut acc = [_mm256_setzero_ps(); R];
        let mut kk = 0;
        while kk < full {
            if kk % line == 0 {
                // SAFETY: a prefetch is a hint; it never faults.
                _mm_prefetch::<_MM_HINT_T0>(wj.wrapping_add(kk + ahead) as *const i8);
            }
            let wv = load_w8(wj.add(kk));
            for i in 0..R {
                let xv = _mm256_loadu_ps(x.add(i * k + kk));
                acc[i] = _mm256_fmadd_ps(xv, wv, acc[i]);
            }
            kk += 8;
        }
        if full < k {
            // The last, partial step, zero-padded.
            let t = k - full;
            let wv = _mm256_loadu_ps(lanes8(wj.add(full), t).as_ptr());
            for i in 0..R {
                let xv = _mm256_loadu_ps(lanes8(x.add(i * k + full), t).as_ptr());
                acc[i] = _mm256_fmadd_ps(xv, wv, acc[i]);
            }
        }
        for i in 0..R {
            *y.add(i * ldy + j) = hsum8(acc[i]);
        }
    }
}

/// The portable tile: for each of the `R` rows of `x`, `C` dot products as
/// 8 lane-wise chains of separate multiplies and adds over `k` in order
/// (Rust never fuses them, so the rounding is fixed; the compiler
/// vectorises the lanes), a zero-padded last step, then [`tree8`].
///
/// # Safety
/// The rows lie inside live allocations.
#[allow(unsafe_code)]
#[allow(clippy::needless_range_loop)]
unsafe fn tile_portable<W: Lanes8, const R: usize, const C: usize>(
    x: *const f32,
    w: *const W,
    k: usize,
    y: *mut f32,
    ldy: usize,
    _pf: *const W,
    _far: usize,
) {
    let full = k / 8 * 8;
    for i in 0..R {
        let xr = x.add(i * k);
        let mut acc = [[0f32; 8]; C];
        let mut kk = 0;
        while kk < k {
            let t = if kk < full { 8 } else { k - full };
            let xv = lanes8(xr.add(kk), t);
            for j in 0..C {
                let wv = lanes8(w.add(j * k + kk), t);
                for l in 0..8 {
                    acc[j][l] += xv[l] * wv[l];
                }
            }
            kk += 8;
        }
        for j in 0..C {
            *y.add(i * ldy + j) = tree8(&acc[j]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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

    /// A kernel under test: `run(x, w, m, k, n)` by instruction set `isa`,
    /// with `w` as f32 values (bf16-exact for bf16 weights); `round` is
    /// what the kernel does to each input before multiplying (bf16 weights:
    /// rounds `x` to bf16).
    struct Kernel {
        isa: MatmulIsa,
        bf16: bool,
    }

    impl Kernel {
        fn round(&self, v: f32) -> f64 {
            if self.bf16 {
                // f32 -> bf16, nearest even.
                half::bf16::from_f32(v).to_f64()
            } else {
                v as f64
            }
        }

        fn run(&self, x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
            let wb: Vec<half::bf16>;
            let rows = if self.bf16 {
                wb = w.iter().map(|&v| half::bf16::from_f32(v)).collect();
                WeightRows::Bf16(&wb)
            } else {
                WeightRows::F32(w)
            };
            let mut y = vec![0f32; m * n];
            matmul_nt_multi_into_isa(self.isa, x, &[rows], m, k, &mut [&mut y]);
            y
        }
    }

    /// Every kernel this CPU runs: f32 and bf16 weights on each set.
    fn kernels() -> Vec<Kernel> {
        let isas = MatmulIsa::all_supported();
        eprintln!("instruction sets here: {isas:?}");
        isas.into_iter()
            .flat_map(|isa| [false, true].map(|bf16| Kernel { isa, bf16 }))
            .collect()
    }

    fn same(a: &[f32], b: &[f32]) -> bool {
        a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits())
    }

    /// Uniform in [-1, 1), as the kernel's weights can hold them.
    fn values(kn: &Kernel, rng: &mut StdRng, len: usize) -> Vec<f32> {
        (0..len)
            .map(|_| kn.round(rng.random_range(-1.0..1.0)) as f32)
            .collect()
    }

    /// Every output against the f64 sum of the rounded inputs' products,
    /// over every tile shape, tail and cache-block remainder.
    fn check_reference(kn: &Kernel, seed: u64) {
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
                let y = kn.run(&x, &w, m, k, n);
                for i in 0..m {
                    for j in 0..n {
                        // Products of the rounded inputs are exact in f32
                        // for both kernels; only the f32 sums round.
                        let want: f64 = (0..k)
                            .map(|t| kn.round(x[i * k + t]) * w[j * k + t] as f64)
                            .sum();
                        let got = y[i * n + j] as f64;
                        assert!(
                            (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                            "{:?} bf16 {}: m {m} k {k} n {n} [{i},{j}]: {got} vs {want}",
                            kn.isa,
                            kn.bf16
                        );
                    }
                }
            }
        }
    }

    /// A row's output is bit-identical whatever the rows around it: alone,
    /// at every position of batches of every size (all tile remainders and
    /// cache blocks; on AVX2, every row count the weight sweep takes, and
    /// the register tiles past it), and for every slice of the weight rows.
    fn check_rows_bit_identical(kn: &Kernel, seed: u64) {
        let mut rng = StdRng::seed_from_u64(seed);
        let (k, n) = (77usize, 53usize);
        let big = 150;
        let x: Vec<f32> = (0..big * k).map(|_| rng.random_range(-1.0..1.0)).collect();
        let w = values(kn, &mut rng, n * k);
        let alone: Vec<Vec<f32>> = (0..big)
            .map(|r| kn.run(&x[r * k..(r + 1) * k], &w, 1, k, n))
            .collect();
        for m in [2usize, 3, 4, 5, 6, 7, 8, 9, 32, 65, 150] {
            for start in [0usize, 1, 3] {
                if start + m > big {
                    continue;
                }
                let y = kn.run(&x[start * k..(start + m) * k], &w, m, k, n);
                for i in 0..m {
                    assert!(
                        same(&y[i * n..(i + 1) * n], &alone[start + i]),
                        "{:?} bf16 {}: row {} in a batch of {m} from {start} differs",
                        kn.isa,
                        kn.bf16,
                        start + i
                    );
                }
            }
        }
        // Any window of weight rows gives the same columns.
        let full = kn.run(&x[..5 * k], &w, 5, k, n);
        for (j0, j1) in [(0usize, 1usize), (7, 20), (13, 53)] {
            let part = kn.run(&x[..5 * k], &w[j0 * k..j1 * k], 5, k, j1 - j0);
            for i in 0..5 {
                let cols = &full[i * n + j0..i * n + j1];
                assert!(same(&part[i * (j1 - j0)..(i + 1) * (j1 - j0)], cols));
            }
        }
    }

    #[test]
    fn matches_f64_reference_for_every_tile_shape_and_tail() {
        for (s, kn) in kernels().iter().enumerate() {
            check_reference(kn, 1 + s as u64);
        }
    }

    #[test]
    fn rows_are_bit_identical_whatever_the_batch() {
        for (s, kn) in kernels().iter().enumerate() {
            check_rows_bit_identical(kn, 20 + s as u64);
        }
    }

    /// The detected set is what the public functions use.
    #[test]
    fn public_functions_use_the_detected_set() {
        let mut rng = StdRng::seed_from_u64(9);
        let (m, k, n) = (5, 37, 11);
        let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect();
        let w: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect();
        let isa = MatmulIsa::detect();
        assert!(isa.supported());
        let kn = Kernel { isa, bf16: false };
        assert!(same(&matmul_nt(&x, &w, m, k, n), &kn.run(&x, &w, m, k, n)));
        let wb: Vec<half::bf16> = w.iter().map(|&v| half::bf16::from_f32(v)).collect();
        let kn = Kernel { isa, bf16: true };
        assert!(same(
            &matmul_nt_bf16(&x, &wb, m, k, n),
            &kn.run(&x, &w, m, k, n)
        ));
    }

    /// One grouped call gives bit for bit what separate calls give, for
    /// f32 and bf16 weights side by side, at decode and prefill sizes, on
    /// every instruction set.
    #[test]
    fn grouped_products_equal_separate_calls() {
        for isa in MatmulIsa::all_supported() {
            grouped_equal_separate(isa);
        }
    }

    fn grouped_equal_separate(isa: MatmulIsa) {
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
            matmul_nt_multi_into_isa(
                isa,
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
            let alone = |w: WeightRows<'_>, n: usize| {
                let mut y = vec![0f32; m * n];
                matmul_nt_multi_into_isa(isa, &x, &[w], m, k, &mut [&mut y]);
                y
            };
            assert!(
                same(&y1, &alone(WeightRows::F32(&w1), 200)),
                "{isa:?} m {m}: f32 group"
            );
            assert!(
                same(&y2, &alone(WeightRows::Bf16(&w2), 64)),
                "{isa:?} m {m}: bf16 group"
            );
            assert!(
                same(&y3, &alone(WeightRows::F32(&w3), 7)),
                "{isa:?} m {m}: small group"
            );
        }
    }

    /// Every output is written (none is left as the NaN it held before),
    /// on every instruction set, which the unfilled buffers of
    /// [`matmul_nt_multi`] rely on; and those buffers hold the same bits.
    #[test]
    fn every_output_is_written_and_new_buffers_agree() {
        let mut rng = StdRng::seed_from_u64(31);
        let mut r =
            |len: usize| -> Vec<f32> { (0..len).map(|_| rng.random_range(-1.0..1.0)).collect() };
        for k in [0usize, 1, 7, 96] {
            let ns = [1usize, 5, 7, 13, 200];
            let w32: Vec<Vec<f32>> = ns.iter().map(|&n| r(n * k)).collect();
            let w16: Vec<Vec<half::bf16>> = ns
                .iter()
                .map(|&n| r(n * k).into_iter().map(half::bf16::from_f32).collect())
                .collect();
            let ws: Vec<WeightRows<'_>> = (0..ns.len())
                .map(|g| {
                    if g % 2 == 0 {
                        WeightRows::F32(&w32[g])
                    } else {
                        WeightRows::Bf16(&w16[g])
                    }
                })
                .collect();
            for m in [0usize, 1, 3, 8, 9, 32, 65, 300] {
                let x = r(m * k);
                let new = matmul_nt_multi(&x, &ws, m, k, &ns);
                for isa in MatmulIsa::all_supported() {
                    let mut ys: Vec<Vec<f32>> = ns.iter().map(|&n| vec![f32::NAN; m * n]).collect();
                    let mut outs: Vec<&mut [f32]> = ys.iter_mut().map(|y| &mut y[..]).collect();
                    matmul_nt_multi_into_isa(isa, &x, &ws, m, k, &mut outs);
                    for (g, y) in ys.iter().enumerate() {
                        assert!(
                            y.iter().all(|v| v.is_finite()),
                            "{isa:?} k {k} m {m} product {g}: an output left unwritten"
                        );
                        if isa == MatmulIsa::detect() {
                            assert_eq!(new[g].len(), m * ns[g]);
                            assert!(same(&new[g], y), "k {k} m {m} product {g}");
                        }
                    }
                }
            }
        }
    }

    /// Empty shapes: no rows or no weight rows write nothing; an empty
    /// inner dimension gives zeros, as an empty sum should.
    #[test]
    fn empty_shapes() {
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
