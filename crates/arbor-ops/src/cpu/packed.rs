//! Packed f32 matmul in the outer-product form: `y[m, n] = x[m, k] w[n, k]^T`
//! with `w` repacked once ([`PackedWeights::pack`]) into panels of [`PANEL`]
//! weight rows, each laid out `[k][PANEL]`.
//!
//! Every output is one FMA chain over `k` in order, from zero:
//! `y[i][j] = fma(x[i][k-1], w[j][k-1], ... fma(x[i][0], w[j][0], 0))`.
//! That is exact to define, so every kernel gives the same bits: the AVX2
//! one, and the portable one (`f32::mul_add`) on any CPU. A row's result
//! never depends on the rows around it or on the tile it falls in.
//!
//! The AVX2 kernel keeps a `4 x 24` output tile in 12 registers. For each
//! `k` it takes the panel's 3 weight vectors (two in registers, the third
//! read by each row's FMA) and broadcasts 4 values of `x`, for 12 FMAs. No
//! output's lanes need summing; in the dot-product form those sums cost
//! ~12% of a tile. `k` is blocked at [`KC`], so a panel's block (18 KiB)
//! stays in L1 for every row tile; the partial sums wait in `y` between
//! blocks. While the first row tiles of a block run, the next block of the
//! weight stream is prefetched, spread over their steps; with fewer than 8
//! row tiles (a decode step of a few sequences, where the product waits on
//! the stream) the block after it is prefetched into L2 too.
//!
//! On a 2-core Zen 2, 32 x 576 x 1536 ran at 155-172 GFLOP/s against
//! 134-143 for dot-product tiles over the same f32 weights, with the
//! weights in cache and streaming from memory; it was faster at every row
//! count from 1 to 64, and at 2,048 rows (`cargo bench -p arbor-ops`
//! measures it on the machine at hand).
//!
//! Every f32 product of [`crate::cpu::matmul`] runs here (so the training
//! forward, the engine and `arbor score` agree bit for bit); the engine
//! packs its weights once ([`crate::WeightRows::Packed`]), other callers per
//! call. The generation forward also uses two fused epilogues that give the
//! unfused ops' bits: [`matmul_packed_add`] (a residual added as the panel
//! is written) and [`swiglu_packed`] (gate and up panels of the same
//! columns, combined by SiLU while in cache).

use crate::cpu::matmul::{OutPtr, SERIAL_MACS, SERIAL_WEIGHTS};
use rayon::prelude::*;

/// Weight rows per panel: three 8-lane vectors.
pub const PANEL: usize = 24;
/// `k` per block: a panel's block is `KC * PANEL * 4` bytes (18 KiB).
pub const KC: usize = 192;
/// Rows of `x` per register tile.
const MR: usize = 4;
/// Below this many row tiles, computing a block takes less time than
/// fetching the next one, so each near prefetch of the next block is
/// paired with a far one ([`FAR`] further, into L2).
const FAR_TILES: usize = 8;
/// How far ahead of the near prefetch the far one runs: one block of a
/// panel (18 KiB), so the weight stream is two blocks ahead of the tiles.
const FAR: usize = KC * PANEL * 4;
/// Rows of `x` per parallel task: long inputs are split so a task's rows
/// of `x` stay in L2 while it runs its panels (64 rows of 1,536 values
/// are 384 KiB). At 256 rows (590 KiB at `k` = 576), a batch-32 prefill
/// of 2,048 tokens took ~3% longer on a 2-core Zen 2 with 512 KiB of L2
/// per core.
const MB: usize = 64;

/// A weight matrix `w: [n, k]` repacked into `n.div_ceil(PANEL)` panels of
/// `[k][PANEL]` (the last panel zero-padded).
#[derive(Debug, Clone, PartialEq)]
pub struct PackedWeights {
    n: usize,
    k: usize,
    /// `[panel][k][3]` vectors of 8 weights (32-byte aligned, so no load
    /// of the kernel crosses a cache line).
    data: Vec<Lanes>,
}

/// Eight weights, aligned for one AVX load.
#[derive(Debug, Clone, Copy, PartialEq)]
#[repr(C, align(32))]
struct Lanes([f32; 8]);

/// Vectors per panel row.
const VECS: usize = PANEL / 8;

impl PackedWeights {
    /// Repack the row-major `w: [n, k]`.
    ///
    /// # Panics
    /// If `w.len() != n * k`.
    pub fn pack(w: &[f32], n: usize, k: usize) -> Self {
        let panels = n.div_ceil(PANEL);
        let mut p = PackedWeights {
            n,
            k,
            data: vec![Lanes([0.0; 8]); panels * k * VECS],
        };
        p.repack(w);
        p
    }

    /// Pack new values of the same shape into this allocation (which keeps
    /// its pages, huge ones included).
    ///
    /// # Panics
    /// If `w.len() != n * k`.
    pub fn repack(&mut self, w: &[f32]) {
        let (n, k) = (self.n, self.k);
        assert_eq!(
            w.len(),
            n * k,
            "PackedWeights::pack: {} values for [{n}, {k}]",
            w.len()
        );
        self.data
            .par_chunks_mut((k * VECS).max(1))
            .enumerate()
            .for_each(|(p, panel)| {
                for r in 0..PANEL.min(n - p * PANEL) {
                    let row = &w[(p * PANEL + r) * k..(p * PANEL + r + 1) * k];
                    for (kk, &v) in row.iter().enumerate() {
                        panel[kk * VECS + r / 8].0[r % 8] = v;
                    }
                }
            });
    }

    /// Where the packed values lie: `(address, bytes)` (for
    /// `madvise`-style hints such as huge pages).
    pub fn memory(&self) -> (usize, usize) {
        (
            self.data.as_ptr() as usize,
            std::mem::size_of_val(&self.data[..]),
        )
    }

    /// Panel `p`: `[k][PANEL]` weights.
    fn panel(&self, p: usize) -> &[Lanes] {
        &self.data[p * self.k * VECS..(p + 1) * self.k * VECS]
    }

    /// Output width (rows of `w`).
    pub fn n(&self) -> usize {
        self.n
    }

    /// Input width (columns of `w`).
    pub fn k(&self) -> usize {
        self.k
    }
}

/// `y[m, n] = x[m, k] w^T` (row-major), each output one FMA chain over `k`.
///
/// # Panics
/// If `x.len() < m * w.k()`.
pub fn matmul_packed(x: &[f32], m: usize, w: &PackedWeights) -> Vec<f32> {
    product(x, m, w, avx2())
}

/// [`matmul_packed`] on the AVX2 kernel (`avx2`, which the CPU must run) or
/// the portable one.
fn product(x: &[f32], m: usize, w: &PackedWeights, avx2: bool) -> Vec<f32> {
    let mut y = vec![0f32; m * w.n];
    // SAFETY: y holds [m, n] and nothing else touches it during the call.
    #[allow(unsafe_code)]
    unsafe {
        products(x, m, &[w], &[OutPtr(y.as_mut_ptr())], avx2);
    };
    y
}

/// `outs[g] = x ws[g]^T` (`[m, ws[g].n()]`, row-major, every output
/// written once) for several weights of one input `x: [m, k]`, in one
/// parallel pass.
///
/// # Safety
/// Every `ws[g].k()` equals `k` with `x.len() >= m * k`; `outs[g]` points at
/// room for `m * ws[g].n()` values that nothing else touches during the
/// call; with `avx2`, the CPU runs AVX2 and FMA.
#[allow(unsafe_code)]
pub(crate) unsafe fn products(
    x: &[f32],
    m: usize,
    ws: &[&PackedWeights],
    outs: &[OutPtr],
    avx2: bool,
) {
    let Some(k) = ws.first().map(|w| w.k) else {
        return;
    };
    assert!(
        ws.iter().all(|w| w.k == k) && x.len() >= m * k && outs.len() == ws.len(),
        "matmul_packed: {} values for x [{m}, {k}] against {} weights",
        x.len(),
        ws.len()
    );
    if m == 0 {
        return;
    }
    if k == 0 {
        for (w, out) in ws.iter().zip(outs) {
            std::ptr::write_bytes(out.0, 0, m * w.n);
        }
        return;
    }
    let ns: Vec<usize> = ws.iter().map(|w| w.n).collect();
    each_panel(m, k, &ns, |g, rows, p| {
        let (w, n) = (ws[g], ws[g].n);
        let cols = p * PANEL..((p + 1) * PANEL).min(n);
        let panel = w.panel(p);
        // SAFETY: rows x cols of outs[g] belong to this call alone (calls
        // split the rows and the panels), as the caller vouches.
        panel_rows(x, k, panel, None, rows, cols, outs[g], n, avx2);
    });
}

/// Calls `f(g, rows, p)` once for every panel `p` of every weight `g` (of
/// output widths `ns`, input width `k`) and every block of [`MB`] rows of
/// `m`: in parallel tasks of a few panels each, or on the calling thread
/// when the call is small and its weights are not large enough to stream
/// from memory (as in `crate::cpu::matmul`).
fn each_panel(
    m: usize,
    k: usize,
    ns: &[usize],
    f: impl Fn(usize, std::ops::Range<usize>, usize) + Sync,
) {
    let panels: usize = ns.iter().map(|n| n.div_ceil(PANEL)).sum();
    let row_blocks = m.div_ceil(MB);
    // Panels per task: a few tasks per thread, for balance.
    let threads = rayon::current_num_threads().max(1);
    let per = (panels * row_blocks / (4 * threads)).clamp(1, 16);
    let tasks: Vec<(usize, usize, usize)> = ns
        .iter()
        .enumerate()
        .flat_map(|(g, &n)| {
            let np = n.div_ceil(PANEL);
            (0..row_blocks).flat_map(move |b| (0..np).step_by(per).map(move |p| (g, b, p)))
        })
        .collect();
    let run = |&(g, b, p0): &(usize, usize, usize)| {
        let rows = b * MB..((b + 1) * MB).min(m);
        for p in p0..(p0 + per).min(ns[g].div_ceil(PANEL)) {
            f(g, rows.clone(), p);
        }
    };
    let weights: usize = ns.iter().map(|n| n * k).sum();
    if m * weights < SERIAL_MACS && weights < SERIAL_WEIGHTS {
        tasks.iter().for_each(run);
    } else {
        tasks.par_iter().for_each(run);
    }
}

/// `y = r + x w^T` (`r, y: [m, n]`): the residual addition of a layer's
/// output projection fused into the product. Each value is `r[i][j] +
/// c[i][j]`, with `c[i][j]` the FMA chain of [`matmul_packed`]: the same f32
/// sum as adding `r` afterwards, computed by the thread that wrote the
/// panel while it is in cache.
///
/// # Panics
/// If `x.len() < m * w.k()` or `r.len() != m * w.n()`.
pub fn matmul_packed_add(x: &[f32], m: usize, w: &PackedWeights, r: &[f32]) -> Vec<f32> {
    product_add(x, m, w, r, avx2())
}

/// [`matmul_packed_add`] on the AVX2 kernel (`avx2`) or the portable one.
fn product_add(x: &[f32], m: usize, w: &PackedWeights, r: &[f32], avx2: bool) -> Vec<f32> {
    let (n, k) = (w.n, w.k);
    assert!(
        x.len() >= m * k && r.len() == m * n,
        "matmul_packed_add: x {} and r {} values for [{m}, {k}] x [{n}, {k}]^T",
        x.len(),
        r.len()
    );
    let fill = |out: OutPtr| {
        each_panel(m, k, &[n], |_, rows, p| {
            let cols = p * PANEL..((p + 1) * PANEL).min(n);
            let panel = w.panel(p);
            // SAFETY: y holds [m, n]; rows x cols is this call's alone; with
            // `avx2`, the CPU runs it (the callers check).
            #[allow(unsafe_code)]
            unsafe {
                if k == 0 {
                    for i in rows.clone() {
                        std::ptr::write_bytes(out.at(i * n + cols.start), 0, cols.len());
                    }
                } else {
                    panel_rows(x, k, panel, None, rows.clone(), cols.clone(), out, n, avx2);
                }
                for i in rows {
                    let at = i * n + cols.start;
                    let y = std::slice::from_raw_parts_mut(out.at(at), cols.len());
                    // `c + r`: f32 addition commutes, so these are the bits
                    // of the residual stream's `r + c`.
                    for (v, &a) in y.iter_mut().zip(&r[at..at + cols.len()]) {
                        *v += a;
                    }
                }
            }
        });
    };
    // SAFETY: the panels cover every row and column of y.
    #[allow(unsafe_code)]
    unsafe {
        written(m * n, fill)
    }
}

/// SwiGLU's `silu(x g^T) * (x u^T)` (`[m, n]`) for gate and up weights of
/// one shape: a gate panel and the up panel of the same columns are
/// computed together into a scratch of the task's rows, then combined by
/// [`crate::cpu::rows::silu_mul_into`] while in cache. Every value is that of
/// `rows::silu_mul` over the two [`matmul_packed`] products, bit for bit;
/// neither product is ever written out whole.
///
/// # Panics
/// If the two weights differ in shape or `x.len() < m * k`.
pub fn swiglu_packed(x: &[f32], m: usize, gate: &PackedWeights, up: &PackedWeights) -> Vec<f32> {
    product_swiglu(x, m, gate, up, avx2())
}

/// [`swiglu_packed`] on the AVX2 kernel (`avx2`) or the portable one.
fn product_swiglu(
    x: &[f32],
    m: usize,
    gate: &PackedWeights,
    up: &PackedWeights,
    avx2: bool,
) -> Vec<f32> {
    let (n, k) = (gate.n, gate.k);
    assert!(
        up.n == n && up.k == k && x.len() >= m * k,
        "swiglu_packed: x {} values for [{m}, {k}], gate [{n}, {k}], up [{}, {}]",
        x.len(),
        up.n,
        up.k
    );
    let fill = |out: OutPtr| {
        // Both products' weights count towards the serial threshold.
        each_panel(m, 2 * k, &[n], |_, rows, p| {
            let cols = p * PANEL..((p + 1) * PANEL).min(n);
            let width = cols.len();
            let len = rows.len();
            let xr = &x[rows.start * k..rows.end * k];
            SWIGLU_SCRATCH.with(|sc| {
                let mut gu = sc.borrow_mut();
                if gu.len() < 2 * len * PANEL {
                    gu.resize(2 * len * PANEL, 0.0);
                }
                let (g, u) = gu[..2 * len * PANEL].split_at_mut(len * PANEL);
                if k == 0 {
                    g.fill(0.0);
                    u.fill(0.0);
                } else {
                    // Gate, then up, then the next gate panel: each prefetches the
                    // first block of the one after it while finishing.
                    let next_gate = (p + 1 < n.div_ceil(PANEL)).then(|| gate.panel(p + 1));
                    for (panel, then, s) in [
                        (gate.panel(p), Some(up.panel(p)), &mut *g),
                        (up.panel(p), next_gate, &mut *u),
                    ] {
                        // SAFETY: `s` holds `len` rows of PANEL values, this
                        // closure's own; with `avx2`, the CPU runs it.
                        #[allow(unsafe_code)]
                        unsafe {
                            let out = OutPtr(s.as_mut_ptr());
                            panel_rows(xr, k, panel, then, 0..len, 0..width, out, PANEL, avx2);
                        };
                    }
                }
                for (r, i) in rows.enumerate() {
                    // SAFETY: row i's columns `cols` of y are this closure's alone.
                    #[allow(unsafe_code)]
                    let o = unsafe {
                        std::slice::from_raw_parts_mut(out.at(i * n + cols.start), width)
                    };
                    let at = r * PANEL;
                    crate::cpu::rows::silu_mul_into(&g[at..at + width], &u[at..at + width], o);
                }
            });
        });
    };
    // SAFETY: the panels cover every row and column of y.
    #[allow(unsafe_code)]
    unsafe {
        written(m * n, fill)
    }
}

/// A new vector of `len` values written by `f` through the pointer it is
/// handed, with no zero fill first (a serial fill of the output would run
/// on the calling thread while the others wait).
///
/// # Safety
/// `f` writes every one of the `len` values (or panics).
#[allow(unsafe_code)]
unsafe fn written(len: usize, f: impl FnOnce(OutPtr)) -> Vec<f32> {
    let mut y: Vec<f32> = Vec::with_capacity(len);
    f(OutPtr(y.as_mut_ptr()));
    // SAFETY: the caller vouches every value was written; a panic in `f`
    // leaves the length 0.
    y.set_len(len);
    y
}

thread_local! {
    /// Per-thread scratch of [`product_swiglu`]: a task's gate and up
    /// values, `[rows][PANEL]` each (kept between calls, never zeroed).
    static SWIGLU_SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

pub(crate) fn avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        crate::cpu::simd::avx2_fma()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Rows `rows` of `x` against one panel, into columns `cols` of `y` (row
/// stride `n`).
///
/// # Safety
/// `y` holds `[m, n]` with `rows x cols` owned by the caller; `panel` is
/// `k * VECS` vectors; with `avx2`, the CPU runs AVX2 and FMA.
#[allow(unsafe_code)]
#[allow(clippy::too_many_arguments)]
unsafe fn panel_rows(
    x: &[f32],
    k: usize,
    panel: &[Lanes],
    then: Option<&[Lanes]>,
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
    y: OutPtr,
    n: usize,
    avx2: bool,
) {
    let width = cols.len();
    if !avx2 {
        // The panel's 24 chains side by side, `k` in order: independent
        // lanes, which the compiler turns into vector FMAs where the
        // target has them (NEON's `fmla`).
        for i in rows {
            let xi = &x[i * k..(i + 1) * k];
            let mut acc = [0f32; PANEL];
            for (lanes, &v) in panel.chunks_exact(VECS).zip(xi) {
                for (c, a) in acc.iter_mut().enumerate() {
                    *a = v.mul_add(lanes[c / 8].0[c % 8], *a);
                }
            }
            for (c, &a) in acc[..width].iter().enumerate() {
                *y.0.add(i * n + cols.start + c) = a;
            }
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        // A full panel writes y in place; a partial one (the last, when
        // PANEL does not divide n) goes through a scratch of full rows.
        let mut scratch = if width == PANEL {
            Vec::new()
        } else {
            vec![0f32; rows.len() * PANEL]
        };
        let (base, ldy) = if width == PANEL {
            (y.0.add(rows.start * n + cols.start), n)
        } else {
            (scratch.as_mut_ptr(), PANEL)
        };
        let m = rows.len();
        let xb = x.as_ptr().add(rows.start * k);
        let p = panel.as_ptr() as *const f32;
        let mut k0 = 0;
        while k0 < k {
            let k1 = (k0 + KC).min(k);
            // The weight stream's next block: this panel's next `k` block,
            // or the first of the panel computed next (`then`; by default
            // the next in memory, as panels lie back to back).
            let next = match then {
                Some(t) if k1 == k => t.as_ptr() as *const u8,
                _ => p.wrapping_add(k1 * PANEL) as *const u8,
            };
            let lines = ((k1 - k0) * PANEL * 4).div_ceil(64);
            let tiles = m.div_ceil(MR);
            // Few rows: the block's tiles take less time than fetching the
            // next block, so the stream is also prefetched a block further.
            // The decode matmuls of 8 sequences on a 2-core Zen 4: 22.8-38.9
            // -> 16.1-16.8 ms a step.
            let far = tiles < FAR_TILES;
            // Lines each of the first row tiles prefetches: a line per 4
            // `k` steps, spread over as many tiles as that takes (at most
            // 6); with fewer tiles, each takes a share of the block, up to
            // a line a step.
            let per_tile = (k1 - k0)
                .div_ceil(4)
                .max(lines.div_ceil(tiles.min(6)))
                .min(k1 - k0);
            let mut line = 0;
            for t in 0..tiles {
                let i = t * MR;
                let r = MR.min(m - i);
                let npf = per_tile.min(lines - line.min(lines));
                let pf = next.wrapping_add(line * 64);
                line += npf;
                let (xi, yi) = (xb.add(i * k), base.add(i * ldy));
                let first = k0 == 0;
                match (r, far) {
                    (4, false) => tile_avx2::<4, false>(xi, k, p, k0, k1, yi, ldy, first, pf, npf),
                    (3, false) => tile_avx2::<3, false>(xi, k, p, k0, k1, yi, ldy, first, pf, npf),
                    (2, false) => tile_avx2::<2, false>(xi, k, p, k0, k1, yi, ldy, first, pf, npf),
                    (_, false) => tile_avx2::<1, false>(xi, k, p, k0, k1, yi, ldy, first, pf, npf),
                    (4, true) => tile_avx2::<4, true>(xi, k, p, k0, k1, yi, ldy, first, pf, npf),
                    (3, true) => tile_avx2::<3, true>(xi, k, p, k0, k1, yi, ldy, first, pf, npf),
                    (2, true) => tile_avx2::<2, true>(xi, k, p, k0, k1, yi, ldy, first, pf, npf),
                    _ => tile_avx2::<1, true>(xi, k, p, k0, k1, yi, ldy, first, pf, npf),
                }
            }
            k0 = k1;
        }
        if width < PANEL {
            for (r, i) in rows.enumerate() {
                std::ptr::copy_nonoverlapping(
                    scratch.as_ptr().add(r * PANEL),
                    y.0.add(i * n + cols.start),
                    width,
                );
            }
        }
    }
}

/// `R` rows of `x` (stride `ldx`) against a panel's `k0..k1` block,
/// accumulating into `R x PANEL` outputs at `y` (stride `ldy`; from zero
/// when `first`), prefetching `npf` lines from `pf`, spread over the
/// steps, each with the line [`FAR`] bytes further (into L2) when `FAR_PF`.
///
/// # Safety
/// AVX2 and FMA; `p` is 32-byte aligned with `k1 * PANEL` values; `x`
/// and `y` hold what the tile reads and writes.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[allow(clippy::too_many_arguments)]
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2<const R: usize, const FAR_PF: bool>(
    x: *const f32,
    ldx: usize,
    p: *const f32,
    k0: usize,
    k1: usize,
    y: *mut f32,
    ldy: usize,
    first: bool,
    pf: *const u8,
    npf: usize,
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm256_setzero_ps(); 3]; R];
    if !first {
        for i in 0..R {
            for j in 0..3 {
                acc[i][j] = _mm256_loadu_ps(y.add(i * ldy + 8 * j));
            }
        }
    }
    // `npf` lines spread evenly over the block's steps (Bresenham: `due`
    // gains `npf` a step and pays `steps` a line).
    let steps = k1 - k0;
    let (mut pf, mut due) = (pf, 0usize);
    let mut pp = p.add(k0 * PANEL);
    for kk in k0..k1 {
        if npf > 0 {
            due += npf;
            while due >= steps {
                _mm_prefetch::<_MM_HINT_T0>(pf as *const i8);
                if FAR_PF {
                    // Past the weights' end this names no line of them;
                    // a prefetch never faults.
                    _mm_prefetch::<_MM_HINT_T1>(pf.wrapping_add(FAR) as *const i8);
                }
                pf = pf.wrapping_add(64);
                due -= steps;
            }
        }
        // Two weight vectors in registers, the third read by each row's
        // FMA: 12 accumulators + 3 + a broadcast were one register too
        // many, and LLVM spilled an accumulator inside the loop (2x slower).
        let w0 = _mm256_load_ps(pp);
        let w1 = _mm256_load_ps(pp.add(8));
        let w2 = pp.add(16);
        for i in 0..R {
            let b = _mm256_broadcast_ss(&*x.add(i * ldx + kk));
            acc[i][0] = _mm256_fmadd_ps(b, w0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(b, w1, acc[i][1]);
            // SAFETY: `w2` is 32-byte aligned (`Lanes`); volatile keeps
            // LLVM from hoisting the four reads into one register.
            let v2 = std::ptr::read_volatile(w2 as *const __m256);
            acc[i][2] = _mm256_fmadd_ps(b, v2, acc[i][2]);
        }
        pp = pp.add(PANEL);
    }
    for i in 0..R {
        for j in 0..3 {
            _mm256_storeu_ps(y.add(i * ldy + 8 * j), acc[i][j]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(len: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
            })
            .collect()
    }

    /// The definition: one FMA chain over `k` from zero, per output.
    fn chain(x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
        let mut y = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut acc = 0f32;
                for kk in 0..k {
                    acc = x[i * k + kk].mul_add(w[j * k + kk], acc);
                }
                y[i * n + j] = acc;
            }
        }
        y
    }

    /// The kernels this CPU can run: the portable one, and AVX2's.
    fn kernels() -> Vec<bool> {
        if avx2() {
            vec![false, true]
        } else {
            vec![false]
        }
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn every_kernel_is_the_fma_chain_bit_for_bit() {
        for &k in &[1, 7, 8, 191, 192, 193, 400] {
            for &n in &[1, 23, 24, 25, 49, 72] {
                let w = data(n * k, (k * 1000 + n) as u64);
                let p = PackedWeights::pack(&w, n, k);
                for &m in &[0, 1, 2, 3, 4, 5, 7, 9] {
                    let x = data(m * k, (m * 7 + k) as u64);
                    let want = bits(&chain(&x, &w, m, k, n));
                    for avx in kernels() {
                        let got = bits(&product(&x, m, &p, avx));
                        assert_eq!(got, want, "m {m} k {k} n {n} avx2 {avx}");
                    }
                }
            }
        }
    }

    #[test]
    fn a_row_does_not_depend_on_the_rows_around_it() {
        let (m, k, n) = (300, 96, 50);
        let w = data(n * k, 3);
        let x = data(m * k, 4);
        let p = PackedWeights::pack(&w, n, k);
        let all = matmul_packed(&x, m, &p);
        for i in [0, 1, 5, 255, 256, 299] {
            let one = matmul_packed(&x[i * k..(i + 1) * k], 1, &p);
            assert_eq!(bits(&one), bits(&all[i * n..(i + 1) * n]), "row {i}");
        }
    }

    #[test]
    fn products_are_within_the_f32_bound_of_f64() {
        let (m, k, n) = (33, 1536, 30);
        let w = data(n * k, 5);
        let x = data(m * k, 6);
        let y = matmul_packed(&x, m, &PackedWeights::pack(&w, n, k));
        for i in 0..m {
            for j in 0..n {
                let (mut exact, mut mag) = (0f64, 0f64);
                for kk in 0..k {
                    let t = x[i * k + kk] as f64 * w[j * k + kk] as f64;
                    exact += t;
                    mag += t.abs();
                }
                // Sequential summation: |error| <= k u sum |x w| (u = 2^-24).
                let bound = k as f64 * f32::EPSILON as f64 / 2.0 * mag;
                assert!(
                    (y[i * n + j] as f64 - exact).abs() <= bound,
                    "({i}, {j}): {} vs {exact}",
                    y[i * n + j]
                );
            }
        }
    }

    #[test]
    fn the_fused_residual_is_the_sum_after_the_product_bit_for_bit() {
        for &(m, k, n) in &[
            (0, 5, 3),
            (1, 1, 1),
            (4, 192, 25),
            (9, 400, 72),
            (300, 96, 50),
        ] {
            let w = data(n * k, (k + n) as u64);
            let p = PackedWeights::pack(&w, n, k);
            let x = data(m * k, (m + 3 * k) as u64);
            let r = data(m * n, (m + 5 * n) as u64);
            for avx in kernels() {
                let want: Vec<f32> = r
                    .iter()
                    .zip(product(&x, m, &p, avx))
                    .map(|(a, c)| a + c)
                    .collect();
                let got = product_add(&x, m, &p, &r, avx);
                assert_eq!(bits(&got), bits(&want), "m {m} k {k} n {n} avx2 {avx}");
            }
        }
    }

    #[test]
    fn fused_swiglu_is_silu_mul_of_the_two_products_bit_for_bit() {
        for &(m, k, n) in &[
            (0, 5, 3),
            (1, 1, 1),
            (3, 7, 23),
            (4, 192, 25),
            (9, 400, 72),
            (300, 96, 50),
        ] {
            let (g, u) = (data(n * k, (k + n) as u64), data(n * k, (k * n + 1) as u64));
            let (pg, pu) = (PackedWeights::pack(&g, n, k), PackedWeights::pack(&u, n, k));
            // Gate values of magnitudes around 1 to 10, so SiLU's
            // exponential is exercised beyond its linear range.
            let x: Vec<f32> = data(m * k, (m + 7 * k) as u64)
                .into_iter()
                .map(|v| v * 4.0)
                .collect();
            for avx in kernels() {
                let want = crate::cpu::rows::silu_mul(
                    &product(&x, m, &pg, avx),
                    &product(&x, m, &pu, avx),
                );
                let got = product_swiglu(&x, m, &pg, &pu, avx);
                assert_eq!(bits(&got), bits(&want), "m {m} k {k} n {n} avx2 {avx}");
            }
        }
    }

    #[test]
    #[should_panic(expected = "swiglu_packed")]
    fn swiglu_names_mismatched_weights() {
        let (a, b) = (
            PackedWeights::pack(&[0.0; 12], 3, 4),
            PackedWeights::pack(&[0.0; 8], 2, 4),
        );
        swiglu_packed(&[0.0; 4], 1, &a, &b);
    }

    #[test]
    #[should_panic(expected = "matmul_packed_add")]
    fn a_residual_of_the_wrong_length_is_named() {
        let p = PackedWeights::pack(&[0.0; 12], 3, 4);
        matmul_packed_add(&[0.0; 4], 1, &p, &[0.0; 2]);
    }

    #[test]
    #[should_panic(expected = "PackedWeights::pack")]
    fn a_wrong_weight_length_is_named() {
        PackedWeights::pack(&[0.0; 10], 3, 4);
    }
}
