//! The CPU `x w^T` of every `Linear` as a candle op ([`matmul_nt_op`]),
//! with its backward; the products are [`crate::cpu::matmul`]'s
//! row-invariant kernels.

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};

#[cfg(doc)]
use crate::cpu::matmul::{matmul_nt, matmul_nt_bf16};
use crate::cpu::matmul::{single, WeightRows};

/// `x [m, k] @ w[n, k]^T` as a candle op on the CPU: `x` f32, `w` f32
/// ([`matmul_nt`]) or bf16 ([`matmul_nt_bf16`]), output f32; with the
/// matmul backward (`dx = g w`, `dw = g^T x` in `w`'s dtype, both
/// detached; for bf16 weights the rounding of `x` is taken as the
/// identity, straight through).
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
            CpuStorage::F32(w) => WeightRows::F32(&w[w0..w1]),
            CpuStorage::BF16(w) => WeightRows::Bf16(&w[w0..w1]),
            _ => candle_core::bail!(
                "matmul_nt: {:?} weights (want f32 or bf16)",
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

    #[test]
    fn op_gradients_equal_candle_matmul() -> Result<()> {
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
}
