//! Row-invariant CPU matmul: `y[m, n] = x[m, k] w[n, k]^T` in f32 with
//! AVX-512, for every row count (a decode step of 1 row, a batch of 32, a
//! prefill of thousands).
//!
//! Each output is a dot product computed the same way whatever the tile it
//! falls in: 16 lane-wise FMA chains over `k` in order (a masked tail for
//! `k % 16`), then the fixed pairwise tree `lane i + lane i+8`, `i + i+4`,
//! `i + i+2`, `i + i+1` ([`hsum`]). So a row's result depends only on that
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
//! streams past it from L2, and the next weight tile is prefetched as the
//! block's first rows meet the current one. Threads split the weight rows
//! (and, for long inputs, `x`). At decode sizes each weight is read from
//! memory once per call.
//!
//! [`matmul_nt_op`] is a candle op (f32, CPU) with the usual matmul
//! backward. Callers check [`matmul_nt_available`] and otherwise use
//! candle's matmul (then, on that CPU, candle's GEMM provides the rows).

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

/// Rows of `x` per register tile.
const MR: usize = 4;
/// Weight rows per register tile.
const NR: usize = 6;
/// Rows of `x` per cache block (kept in L2 while a weight tile sits in L1).
const MB: usize = 64;
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
// SAFETY: every task writes only its own columns `n0..n0 + nb` of `y`.
#[allow(unsafe_code)]
unsafe impl Send for OutPtr {}
#[allow(unsafe_code)]
unsafe impl Sync for OutPtr {}

/// `x: [m, k]`, `w: [n, k]` (both row-major, contiguous) -> `y: [m, n]`.
/// Panics if the CPU lacks AVX-512F (check [`matmul_nt_available`]) or the
/// slices are shorter than the shapes.
pub fn matmul_nt(x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut y = vec![0f32; m * n];
    matmul_nt_into(x, w, m, k, n, &mut y);
    y
}

/// [`matmul_nt`] into a caller's buffer `y` (`m * n`, overwritten).
pub fn matmul_nt_into(x: &[f32], w: &[f32], m: usize, k: usize, n: usize, y: &mut [f32]) {
    assert!(
        x.len() >= m * k && w.len() >= n * k && y.len() >= m * n,
        "matmul_nt: slices shorter than [{m}, {k}] x [{n}, {k}]^T"
    );
    assert!(matmul_nt_available(), "matmul_nt needs AVX-512F");
    if m == 0 || n == 0 {
        return;
    }
    let (mc, nb) = task_shape(m, n);
    let n_tasks = n.div_ceil(nb);
    let out = OutPtr(y.as_mut_ptr());
    let run = |task: usize| {
        let (mt, nt) = (task / n_tasks, task % n_tasks);
        let (n0, n1) = (nt * nb, ((nt + 1) * nb).min(n));
        let (ms, me) = (mt * mc, ((mt + 1) * mc).min(m));
        let out = out;
        for m0 in (ms..me).step_by(MB) {
            let m1 = (m0 + MB).min(me);
            for j in (n0..n1).step_by(NR) {
                let nr = NR.min(n1 - j);
                for i in (m0..m1).step_by(MR) {
                    let mr = MR.min(m1 - i);
                    // While the first rows meet this weight tile, pull the
                    // next one in (prefetches never fault; the address may
                    // lie past the end).
                    let pf = (i == m0).then(|| w.as_ptr().wrapping_add((j + NR) * k));
                    // SAFETY: AVX-512F checked above; rows i..i+mr of x and
                    // j..j+nr of w lie inside the slices (asserted), and the
                    // outputs y[i.., j..j+nr] belong to this task alone.
                    #[allow(unsafe_code)]
                    #[cfg(target_arch = "x86_64")]
                    unsafe {
                        dispatch(
                            mr,
                            nr,
                            x.as_ptr().add(i * k),
                            w.as_ptr().add(j * k),
                            k,
                            out.0.add(i * n + j),
                            n,
                            pf,
                        );
                    }
                }
            }
        }
    };
    let tasks = m.div_ceil(mc) * n_tasks;
    if m * n * k < SERIAL_MACS {
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

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[inline]
unsafe fn dispatch(
    mr: usize,
    nr: usize,
    x: *const f32,
    w: *const f32,
    k: usize,
    y: *mut f32,
    ldy: usize,
    pf: Option<*const f32>,
) {
    macro_rules! go {
        ($($a:literal: $($b:literal)*;)*) => {
            match (mr, nr, pf) {
                $($(
                    ($a, $b, Some(p)) => tile::<$a, $b, true>(x, w, k, y, ldy, p),
                    ($a, $b, None) => tile::<$a, $b, false>(x, w, k, y, ldy, std::ptr::null()),
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

/// `R x C` dot products: `y[i * ldy + j] = hsum(sum_t x[i, 16t..] * w[j,
/// 16t..])` for `i < R`, `j < C`, rows of `x` and `w` `k` apart.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx512f")]
unsafe fn tile<const R: usize, const C: usize, const PF: bool>(
    x: *const f32,
    w: *const f32,
    k: usize,
    y: *mut f32,
    ldy: usize,
    pf: *const f32,
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
            if PF {
                _mm_prefetch::<_MM_HINT_T0>(pf.wrapping_add(j * k + kk) as *const i8);
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
    for (i, row) in acc.iter().enumerate() {
        for (j, a) in row.iter().enumerate() {
            *y.add(i * ldy + j) = hsum(*a);
        }
    }
}

/// Sum of the 16 lanes in a fixed tree: `i + (i+8)`, then `+4`, `+2`, `+1`.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn hsum(v: std::arch::x86_64::__m512) -> f32 {
    use std::arch::x86_64::*;
    let lo = _mm512_castps512_ps256(v);
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    let s8 = _mm256_add_ps(lo, hi);
    let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<0b01>(s2, s2));
    _mm_cvtss_f32(s1)
}

/// `x [m, k] @ w[n, k]^T` as a candle op (f32, CPU, AVX-512F), with the
/// matmul backward (`dx = g w`, `dw = g^T x`).
pub fn matmul_nt_op(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (_, k) = x.dims2()?;
    let (_, k2) = w.dims2()?;
    if k != k2 || x.dtype() != DType::F32 || w.dtype() != DType::F32 {
        candle_core::bail!(
            "matmul_nt: x {:?} {:?} and w {:?} {:?} do not fit",
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
        let (CpuStorage::F32(x), CpuStorage::F32(w)) = (xs, ws) else {
            candle_core::bail!("matmul_nt: f32 only");
        };
        if !matmul_nt_available() {
            candle_core::bail!("matmul_nt: this CPU has no AVX-512F");
        }
        let x = &x[xl.start_offset()..xl.start_offset() + m * k];
        let w = &w[wl.start_offset()..wl.start_offset() + n * k];
        Ok((
            CpuStorage::F32(matmul_nt(x, w, m, k, n)),
            Shape::from((m, n)),
        ))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        // Detached: `w` is usually a variable itself, and candle keeps a
        // variable's gradient as returned, so an attached `g^T x` would hold
        // the whole forward graph alive for as long as the gradient lives.
        let dx = g.matmul(w)?.detach();
        let dw = g.t()?.matmul(x)?.detach();
        Ok((Some(dx), Some(dw)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};
    use rand::{rngs::StdRng, Rng, SeedableRng};

    #[test]
    fn matches_f64_reference_for_every_tile_shape_and_tail() {
        if !matmul_nt_available() {
            eprintln!("SKIP: no AVX-512F");
            return;
        }
        let mut rng = StdRng::seed_from_u64(1);
        for &(k, n) in &[(576usize, 200usize), (37, 130), (16, 3), (1, 5), (100, 7)] {
            for m in (1..=13).chain([64, 67, 130]) {
                let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect();
                let w: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect();
                let y = matmul_nt(&x, &w, m, k, n);
                for i in 0..m {
                    for j in 0..n {
                        let want: f64 = (0..k)
                            .map(|t| x[i * k + t] as f64 * w[j * k + t] as f64)
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
    #[test]
    fn rows_are_bit_identical_whatever_the_batch() {
        if !matmul_nt_available() {
            return;
        }
        let mut rng = StdRng::seed_from_u64(2);
        let (k, n) = (77usize, 53usize);
        let big = 150;
        let x: Vec<f32> = (0..big * k).map(|_| rng.random_range(-1.0..1.0)).collect();
        let w: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect();
        let alone: Vec<Vec<f32>> = (0..big)
            .map(|r| matmul_nt(&x[r * k..(r + 1) * k], &w, 1, k, n))
            .collect();
        for m in [2usize, 3, 5, 8, 32, 65, 150] {
            for start in [0usize, 1, 3] {
                if start + m > big {
                    continue;
                }
                let y = matmul_nt(&x[start * k..(start + m) * k], &w, m, k, n);
                for i in 0..m {
                    let got = &y[i * n..(i + 1) * n];
                    let want = &alone[start + i];
                    assert!(
                        got.iter()
                            .zip(want)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "row {} in a batch of {m} from {start} differs",
                        start + i
                    );
                }
            }
        }
        // Any window of weight rows gives the same columns.
        let full = matmul_nt(&x[..5 * k], &w, 5, k, n);
        for (j0, j1) in [(0usize, 1usize), (7, 20), (13, 53)] {
            let part = matmul_nt(&x[..5 * k], &w[j0 * k..j1 * k], 5, k, j1 - j0);
            for i in 0..5 {
                for j in j0..j1 {
                    assert_eq!(
                        part[i * (j1 - j0) + j - j0].to_bits(),
                        full[i * n + j].to_bits()
                    );
                }
            }
        }
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
}
