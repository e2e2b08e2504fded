//! Small-batch matmul on the CPU: `y[m, n] = x[m, k] w[n, k]^T` for a few
//! rows (`m <= 16`, the engine's decode steps), streaming each weight row
//! once with AVX-512 FMAs into `m` register accumulators.
//!
//! At decode batch sizes a general GEMM spends its time packing and in a
//! microkernel shaped for large `m`; here the weights are read exactly once
//! per call, so the step runs at memory bandwidth (3.5-5.5x candle's matmul
//! at 8 rows on layer-sized weights; `examples/small_matmul_bench.rs`).
//! [`small_matmul_op`] is a candle op with the usual matmul backward.
//!
//! Not wired into the model yet: its summation order differs from candle's
//! GEMM, so a row's result would depend on whether its decode batch had
//! <= 8 rows. That breaks the engine's batch invariance (same seed, same
//! tokens whatever the batch) and the trainer's bit-exact resume (seen in
//! `tests/train_resume.rs`). Using it for every row count (tiles of 8)
//! keeps invariance but is slower than GEMM at 32 rows and on the LM head.

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

/// Largest row count the kernel takes.
pub const MAX_ROWS: usize = 16;

/// Weight rows per parallel task.
const ROWS_PER_TASK: usize = 64;

/// Whether this CPU runs the kernel (AVX-512F).
pub fn small_matmul_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `x: [m, k]`, `w: [n, k]` (both row-major) -> `y: [m, n]`. Panics if the
/// CPU lacks AVX-512F (check [`small_matmul_available`]) or `m > MAX_ROWS`.
pub fn small_matmul(x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    assert!(m >= 1 && m <= MAX_ROWS, "small_matmul: {m} rows");
    assert!(
        x.len() >= m * k && w.len() >= n * k,
        "small_matmul: short inputs"
    );
    assert!(small_matmul_available(), "small_matmul needs AVX-512F");
    // Column-major result (one weight row -> m outputs), transposed at the end.
    let mut yt = vec![0f32; n * m];
    yt.par_chunks_mut(ROWS_PER_TASK * m)
        .enumerate()
        .for_each(|(t, out)| {
            let j0 = t * ROWS_PER_TASK;
            let rows = out.len() / m;
            let wt = &w[j0 * k..(j0 + rows) * k];
            #[cfg(target_arch = "x86_64")]
            dispatch(x, wt, m, k, rows, out);
        });
    let mut y = vec![0f32; m * n];
    for j in 0..n {
        for i in 0..m {
            y[i * n + j] = yt[j * m + i];
        }
    }
    y
}

#[cfg(target_arch = "x86_64")]
fn dispatch(x: &[f32], w: &[f32], m: usize, k: usize, rows: usize, out: &mut [f32]) {
    macro_rules! go {
        ($($m:literal)*) => {
            match m {
                $($m => {
                    // SAFETY: AVX-512F checked by the caller; slice bounds
                    // checked by `small_matmul`.
                    #[allow(unsafe_code)]
                    unsafe { kernel::<$m>(x, w, k, rows, out) }
                })*
                _ => unreachable!("m <= MAX_ROWS"),
            }
        };
    }
    go!(1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16)
}

/// `M` accumulators of 16 lanes per weight row; for `M <= 8` two weight
/// rows at a time, so each `x` load feeds two FMAs (the loop is otherwise
/// bound by loads). The tail of `k` with a masked load. Every output is the
/// same sum in the same order whatever `M`, so results do not depend on the
/// batch composition.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx512f")]
unsafe fn kernel<const M: usize>(x: &[f32], w: &[f32], k: usize, rows: usize, out: &mut [f32]) {
    use std::arch::x86_64::*;
    let full = k / 16 * 16;
    let tail = (k - full) as u32;
    let mask: __mmask16 = ((1u32 << tail) - 1) as __mmask16;
    let xp = x.as_ptr();
    let mut j = 0;
    if M <= 8 {
        while j + 1 < rows {
            let w0 = w.as_ptr().add(j * k);
            let w1 = w.as_ptr().add((j + 1) * k);
            let mut a0 = [_mm512_setzero_ps(); M];
            let mut a1 = [_mm512_setzero_ps(); M];
            let mut kk = 0;
            while kk < full {
                let v0 = _mm512_loadu_ps(w0.add(kk));
                let v1 = _mm512_loadu_ps(w1.add(kk));
                for i in 0..M {
                    let xv = _mm512_loadu_ps(xp.add(i * k + kk));
                    a0[i] = _mm512_fmadd_ps(v0, xv, a0[i]);
                    a1[i] = _mm512_fmadd_ps(v1, xv, a1[i]);
                }
                kk += 16;
            }
            if tail > 0 {
                let v0 = _mm512_maskz_loadu_ps(mask, w0.add(full));
                let v1 = _mm512_maskz_loadu_ps(mask, w1.add(full));
                for i in 0..M {
                    let xv = _mm512_maskz_loadu_ps(mask, xp.add(i * k + full));
                    a0[i] = _mm512_fmadd_ps(v0, xv, a0[i]);
                    a1[i] = _mm512_fmadd_ps(v1, xv, a1[i]);
                }
            }
            for i in 0..M {
                out[j * M + i] = _mm512_reduce_add_ps(a0[i]);
                out[(j + 1) * M + i] = _mm512_reduce_add_ps(a1[i]);
            }
            j += 2;
        }
    }
    while j < rows {
        let wp = w.as_ptr().add(j * k);
        let mut acc = [_mm512_setzero_ps(); M];
        let mut kk = 0;
        while kk < full {
            let wv = _mm512_loadu_ps(wp.add(kk));
            for (i, a) in acc.iter_mut().enumerate() {
                let xv = _mm512_loadu_ps(xp.add(i * k + kk));
                *a = _mm512_fmadd_ps(wv, xv, *a);
            }
            kk += 16;
        }
        if tail > 0 {
            let wv = _mm512_maskz_loadu_ps(mask, wp.add(full));
            for (i, a) in acc.iter_mut().enumerate() {
                let xv = _mm512_maskz_loadu_ps(mask, xp.add(i * k + full));
                *a = _mm512_fmadd_ps(wv, xv, *a);
            }
        }
        for (i, a) in acc.iter().enumerate() {
            out[j * M + i] = _mm512_reduce_add_ps(*a);
        }
        j += 1;
    }
}

/// `x [m, k] @ w[n, k]^T` as a candle op (f32, CPU, `m <= MAX_ROWS`), with
/// the matmul backward (`dx = g w`, `dw = g^T x`).
pub fn small_matmul_op(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (m, k) = x.dims2()?;
    let (_, k2) = w.dims2()?;
    if k != k2 || m == 0 || m > MAX_ROWS || x.dtype() != DType::F32 || w.dtype() != DType::F32 {
        candle_core::bail!(
            "small_matmul: x {:?} {:?} and w {:?} {:?} do not fit",
            x.dims(),
            x.dtype(),
            w.dims(),
            w.dtype()
        );
    }
    x.contiguous()?.apply_op2(&w.contiguous()?, SmallMatmul)
}

#[derive(Debug, Clone, Copy)]
struct SmallMatmul;

impl CustomOp2 for SmallMatmul {
    fn name(&self) -> &'static str {
        "arbor-small-matmul"
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
            candle_core::bail!("small_matmul: f32 only");
        };
        if !small_matmul_available() {
            candle_core::bail!("small_matmul: this CPU has no AVX-512F");
        }
        let x = &x[xl.start_offset()..xl.start_offset() + m * k];
        let w = &w[wl.start_offset()..wl.start_offset() + n * k];
        Ok((
            CpuStorage::F32(small_matmul(x, w, m, k, n)),
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
        let dx = g.matmul(w)?;
        let dw = g.t()?.matmul(x)?;
        Ok((Some(dx), Some(dw)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};
    use rand::{rngs::StdRng, Rng, SeedableRng};

    #[test]
    fn matches_f64_reference_for_every_row_count_and_tail() {
        if !small_matmul_available() {
            eprintln!("SKIP: no AVX-512F");
            return;
        }
        let mut rng = StdRng::seed_from_u64(1);
        for &(k, n) in &[(576usize, 200usize), (37, 130), (16, 3), (1, 5)] {
            for m in 1..=MAX_ROWS {
                let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect();
                let w: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect();
                let y = small_matmul(&x, &w, m, k, n);
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

    #[test]
    fn op_gradients_equal_candle_matmul() -> Result<()> {
        if !small_matmul_available() {
            return Ok(());
        }
        let dev = Device::Cpu;
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (5, 40), &dev)?)?;
        let w = Var::from_tensor(&Tensor::randn(0f32, 1.0, (9, 40), &dev)?)?;
        let c = Tensor::randn(0f32, 1.0, (5, 9), &dev)?;
        let a = (small_matmul_op(x.as_tensor(), w.as_tensor())? * &c)?.sum_all()?;
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
        Ok(())
    }
}
