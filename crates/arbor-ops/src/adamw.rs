//! The AdamW update in place, and the gradient's squared norm.
//!
//! For a parameter `p` with gradient `g` scaled by `s` (gradient clipping),
//! moments `m, v`, step size `lr`, bias corrections `c1 = 1 - b1^t`,
//! `c2 = 1 - b2^t`:
//!
//! ```text
//! m <- b1 m + (1 - b1) s g
//! v <- b2 v + (1 - b2) (s g)^2
//! p <- p - lr ((m / c1) / (sqrt(v / c2) + eps) + wd p)
//! ```
//!
//! On the CPU (f32, contiguous) each line is one pass over the tensor,
//! written into the existing storage (candle's in-place ops): no new
//! parameter-sized tensors, so no page faults for fresh memory every step.
//! Elsewhere the same formula is composed from candle ops.

use candle_core::{CpuStorage, DType, InplaceOp2, InplaceOp3, Layout, Result, Tensor, Var};
use rayon::prelude::*;

/// Hyper-parameters of one [`adamw_step`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// Bias corrections `1 - beta^t`.
    pub bias1: f64,
    pub bias2: f64,
    /// Gradient scale (clipping), applied before the moments.
    pub grad_scale: f64,
}

const CHUNK: usize = 1 << 15;

fn f32s_mut<'a>(s: &'a mut CpuStorage, l: &Layout) -> Result<&'a mut [f32]> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("adamw: not contiguous".into()))?;
    match s {
        CpuStorage::F32(v) => Ok(&mut v[a..b]),
        _ => candle_core::bail!("adamw: f32 expected"),
    }
}

fn f32s<'a>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [f32]> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("adamw: not contiguous".into()))?;
    match s {
        CpuStorage::F32(v) => Ok(&v[a..b]),
        _ => candle_core::bail!("adamw: f32 expected"),
    }
}

/// `x <- beta x + (1 - beta) (s g)` (or `(s g)^2`).
struct Moment {
    beta: f32,
    scale: f32,
    square: bool,
}

impl InplaceOp2 for Moment {
    fn name(&self) -> &'static str {
        "arbor-adamw-moment"
    }

    fn cpu_fwd(&self, x: &mut CpuStorage, xl: &Layout, g: &CpuStorage, gl: &Layout) -> Result<()> {
        let (x, g) = (f32s_mut(x, xl)?, f32s(g, gl)?);
        let (b, c, s) = (self.beta, 1.0 - self.beta, self.scale);
        x.par_chunks_mut(CHUNK)
            .zip(g.par_chunks(CHUNK))
            .for_each(|(x, g)| {
                if self.square {
                    for (x, &g) in x.iter_mut().zip(g) {
                        let g = s * g;
                        *x = b * *x + c * (g * g);
                    }
                } else {
                    for (x, &g) in x.iter_mut().zip(g) {
                        *x = b * *x + c * (s * g);
                    }
                }
            });
        Ok(())
    }
}

/// `p <- p - lr ((m / c1) / (sqrt(v / c2) + eps) + wd p)`.
struct Param(AdamWStep);

impl InplaceOp3 for Param {
    fn name(&self) -> &'static str {
        "arbor-adamw-param"
    }

    fn cpu_fwd(
        &self,
        p: &mut CpuStorage,
        pl: &Layout,
        m: &CpuStorage,
        ml: &Layout,
        v: &CpuStorage,
        vl: &Layout,
    ) -> Result<()> {
        let (p, m, v) = (f32s_mut(p, pl)?, f32s(m, ml)?, f32s(v, vl)?);
        let h = self.0;
        let (lr, eps, wd) = (h.lr as f32, h.eps as f32, h.weight_decay as f32);
        let (i1, i2) = (1.0 / h.bias1 as f32, 1.0 / h.bias2 as f32);
        p.par_chunks_mut(CHUNK)
            .zip(m.par_chunks(CHUNK).zip(v.par_chunks(CHUNK)))
            .for_each(|(p, (m, v))| {
                for ((p, &m), &v) in p.iter_mut().zip(m).zip(v) {
                    let upd = (m * i1) / ((v * i2).sqrt() + eps) + wd * *p;
                    *p -= lr * upd;
                }
            });
        Ok(())
    }
}

fn in_place_here(ts: &[&Tensor]) -> bool {
    ts.iter()
        .all(|t| t.device().is_cpu() && t.dtype() == DType::F32 && t.is_contiguous())
}

/// One AdamW update of `p` from `g` (see the module docs), moments `m, v`
/// (f32) updated. In place on the CPU; elsewhere `m` and `v` are replaced
/// by new tensors and `p` is set from the composed result.
pub fn adamw_step(
    p: &Var,
    m: &mut Tensor,
    v: &mut Tensor,
    g: &Tensor,
    h: &AdamWStep,
) -> Result<()> {
    if in_place_here(&[p.as_tensor(), m, v, g]) {
        for (x, beta, square) in [(&*m, h.beta1, false), (&*v, h.beta2, true)] {
            let op = Moment {
                beta: beta as f32,
                scale: h.grad_scale as f32,
                square,
            };
            x.inplace_op2(g, &op)?;
        }
        return p.as_tensor().inplace_op3(m, v, &Param(*h));
    }
    let g = (g.to_dtype(DType::F32)? * h.grad_scale)?;
    *m = ((&*m * h.beta1)? + (&g * (1.0 - h.beta1))?)?;
    *v = ((&*v * h.beta2)? + (g.sqr()? * (1.0 - h.beta2))?)?;
    let mhat = (&*m / h.bias1)?;
    let vhat = (&*v / h.bias2)?;
    let pf = p.as_tensor().to_dtype(DType::F32)?;
    let upd = ((mhat / (vhat.sqrt()? + h.eps)?)? + (&pf * h.weight_decay)?)?;
    p.set(&(pf - (upd * h.lr)?)?.to_dtype(p.dtype())?)
}

/// `sum_i g_i^2` in f64: on the CPU (f32, contiguous) in fixed chunks
/// summed in order (the same bits at any thread count), without an f64
/// copy of `g`; elsewhere through candle.
pub fn sum_sq(g: &Tensor) -> Result<f64> {
    if !in_place_here(&[g]) {
        return g.to_dtype(DType::F64)?.sqr()?.sum_all()?.to_scalar::<f64>();
    }
    let (s, l) = g.storage_and_layout();
    let candle_core::Storage::Cpu(s) = &*s else {
        candle_core::bail!("sum_sq: CPU tensor expected")
    };
    let x = f32s(s, l)?;
    let parts: Vec<f64> = x
        .par_chunks(CHUNK)
        .map(|c| c.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>())
        .collect();
    Ok(parts.iter().sum())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn in_place_update_matches_the_composed_formula() -> Result<()> {
        let dev = Device::Cpu;
        let n = 3 * CHUNK + 17;
        let p0 = Tensor::randn(0f32, 1.0, n, &dev)?;
        let g = Tensor::randn(0f32, 1.0, n, &dev)?;
        let m0 = (Tensor::randn(0f32, 1.0, n, &dev)? * 0.1)?;
        let v0 = Tensor::randn(0f32, 1.0, n, &dev)?.sqr()?;
        let h = AdamWStep {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            bias1: 1.0 - 0.9f64.powi(3),
            bias2: 1.0 - 0.95f64.powi(3),
            grad_scale: 0.5,
        };
        // In place on the CPU.
        let p = Var::from_tensor(&p0)?;
        let (mut m, mut v) = (m0.copy()?, v0.copy()?);
        adamw_step(&p, &mut m, &mut v, &g, &h)?;
        // Composed, in f64.
        let f = |t: &Tensor| t.to_dtype(DType::F64).and_then(|t| t.to_vec1::<f64>());
        let (pv, gv, mv, vv) = (f(&p0)?, f(&g)?, f(&m0)?, f(&v0)?);
        let (pn, mn, vn) = (f(p.as_tensor())?, f(&m)?, f(&v)?);
        for i in 0..n {
            let gs = 0.5 * gv[i];
            let m1 = 0.9 * mv[i] + 0.1 * gs;
            let v1 = 0.95 * vv[i] + 0.05 * gs * gs;
            let p1 = pv[i] - 1e-2 * ((m1 / h.bias1) / ((v1 / h.bias2).sqrt() + 1e-8) + 0.1 * pv[i]);
            assert!((mn[i] - m1).abs() < 1e-6 * (1.0 + m1.abs()), "m[{i}]");
            assert!((vn[i] - v1).abs() < 1e-6 * (1.0 + v1.abs()), "v[{i}]");
            assert!(
                (pn[i] - p1).abs() < 1e-6 * (1.0 + p1.abs()),
                "p[{i}]: {} vs {p1}",
                pn[i]
            );
        }
        let want: f64 = gv.iter().map(|x| x * x).sum();
        assert!((sum_sq(&g)? - want).abs() < 1e-9 * want);
        Ok(())
    }
}
