//! The CPU `x w^T` of every `Linear` as a candle op ([`matmul_nt_op`]),
//! with its backward; the products are [`crate::cpu::matmul`]'s
//! row-invariant kernels.

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};

#[cfg(doc)]
use crate::cpu::matmul::{matmul_nt, matmul_nt_bf16};
use crate::cpu::matmul::{single, to_bf16, transposed as transposed_slice, WeightRows};

/// `x [m, k] @ w[n, k]^T` as a candle op on the CPU: `x` f32, `w` f32
/// ([`matmul_nt`]) or bf16 ([`matmul_nt_bf16`]), output f32; with the
/// matmul backward (`dx = g w`, `dw = g^T x` in `w`'s dtype, both
/// detached; for bf16 weights the rounding of `x` is taken as the
/// identity, straight through).
pub fn matmul_nt_op(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    check(x, w)?;
    x.contiguous()?
        .apply_op2(&w.contiguous()?, MatmulNt { bf16: false })
}

/// `x` f32 `[m, k]` and `w` f32 or bf16 `[n, k]`.
fn check(x: &Tensor, w: &Tensor) -> Result<()> {
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
    Ok(())
}

/// `bf16(x) bf16(w)^T` through bf16 dot products (f32 sums), with a
/// backward through the same products (the CPU's mixed-precision
/// training): `dx = bf16(g) bf16(w)` and `dw = bf16(g)^T bf16(x)`, summed
/// in f32. `w` is the f32 master weight, rounded to bf16 inside the op
/// (in parallel, and again, transposed, in the backward: no bf16 copy
/// lives between the passes), whose gradient `dw` it receives in f32,
/// unrounded; or a bf16 weight, whose `dw` is rounded to bf16.
/// [`matmul_nt_op`]'s backward keeps `g` in f32.
pub fn matmul_nt_bf16_op(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    check(x, w)?;
    x.contiguous()?
        .apply_op2(&w.contiguous()?, MatmulNt { bf16: true })
}

#[derive(Debug, Clone, Copy)]
struct MatmulNt {
    /// bf16 products both ways, an f32 `w` rounded inside
    /// ([`matmul_nt_bf16_op`]).
    bf16: bool,
}

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
        let rounded: Vec<half::bf16>;
        let w = match ws {
            CpuStorage::F32(w) if self.bf16 => {
                rounded = to_bf16(&w[w0..w1]);
                WeightRows::Bf16(&rounded)
            }
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
        if self.bf16 {
            // Both products through the same bf16 dot products as the
            // forward (the `x w^T` form, both operands contiguous along the
            // sum): `dx = g (w^T)^T` with `w` transposed, `dw = g^T
            // (x^T)^T` with `g` and `x` transposed, `x^T` rounded to bf16.
            // Sums in f32.
            let dx = if x.track_op() {
                Some(matmul_nt_op(g, &transposed(w, DType::BF16)?)?.detach())
            } else {
                None
            };
            let dw = if w.track_op() {
                let dw = matmul_nt_op(&transposed(g, DType::F32)?, &transposed(x, DType::BF16)?)?;
                Some(dw.to_dtype(w.dtype())?.detach())
            } else {
                None
            };
            return Ok((dx, dw));
        }
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

/// `t^T` of a 2-d f32 or bf16 CPU tensor, contiguous, in `dt` (f32 or
/// bf16), through [`transposed_slice`] (bands of source rows over rayon).
fn transposed(t: &Tensor, dt: DType) -> Result<Tensor> {
    let (rows, cols) = t.dims2()?;
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cpu(cpu) = &*storage else {
        candle_core::bail!("matmul_nt: the bf16 backward runs on the CPU");
    };
    let (a, b) = layout
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("matmul_nt: not contiguous".into()))?;
    let dev = t.device();
    let shape = (cols, rows);
    match (cpu, dt) {
        (CpuStorage::F32(v), DType::F32) => {
            Tensor::from_vec(transposed_slice(&v[a..b], rows, cols, |x| x), shape, dev)
        }
        (CpuStorage::F32(v), DType::BF16) => Tensor::from_vec(
            transposed_slice(&v[a..b], rows, cols, half::bf16::from_f32),
            shape,
            dev,
        ),
        (CpuStorage::BF16(v), DType::BF16) => {
            Tensor::from_vec(transposed_slice(&v[a..b], rows, cols, |x| x), shape, dev)
        }
        _ => candle_core::bail!("matmul_nt: transpose of {:?} to {dt:?}", t.dtype()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn transpose_is_candles() -> Result<()> {
        let dev = Device::Cpu;
        for (r, c) in [(1, 1), (5, 70), (67, 33), (64, 64)] {
            let t = Tensor::randn(0f32, 1.0, (r, c), &dev)?;
            let want = t.t()?.contiguous()?;
            assert_eq!(
                transposed(&t, DType::F32)?.to_vec2::<f32>()?,
                want.to_vec2::<f32>()?
            );
            assert_eq!(
                transposed(&t, DType::BF16)?.to_vec2::<half::bf16>()?,
                want.to_dtype(DType::BF16)?.to_vec2::<half::bf16>()?
            );
            let tb = t.to_dtype(DType::BF16)?;
            assert_eq!(
                transposed(&tb, DType::BF16)?.to_vec2::<half::bf16>()?,
                tb.t()?.contiguous()?.to_vec2::<half::bf16>()?
            );
        }
        Ok(())
    }

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

    /// The bf16 backward: `dx` and `dw` are the f32 products of the
    /// bf16-rounded operands (`g`, `w`; `g`, `x`), `dw` rounded to bf16.
    #[test]
    fn bf16_backward_is_the_product_of_the_rounded_operands() -> Result<()> {
        let dev = Device::Cpu;
        let round = |t: &Tensor| t.to_dtype(DType::BF16)?.to_dtype(DType::F32);
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (37, 40), &dev)?)?;
        let w = Var::from_tensor(&Tensor::randn(0f32, 1.0, (9, 40), &dev)?.to_dtype(DType::BF16)?)?;
        let g = Tensor::randn(0f32, 1.0, (37, 9), &dev)?;
        let y = matmul_nt_bf16_op(x.as_tensor(), w.as_tensor())?;
        let plain = matmul_nt_op(x.as_tensor(), w.as_tensor())?;
        assert_eq!(
            y.flatten_all()?.to_vec1::<f32>()?,
            plain.flatten_all()?.to_vec1::<f32>()?,
            "the forward is matmul_nt_op's"
        );
        let grads = (y * &g)?.sum_all()?.backward()?;
        let wf = w.as_tensor().to_dtype(DType::F32)?;
        let want_dx = round(&g)?.matmul(&wf)?;
        let want_dw = round(&round(&g)?.t()?.matmul(&round(x.as_tensor())?)?)?;
        let dx = grads.get(x.as_tensor()).expect("dx");
        let dw = grads.get(w.as_tensor()).expect("dw");
        assert_eq!(dw.dtype(), DType::BF16);
        for (got, want) in [(dx.clone(), want_dx), (dw.to_dtype(DType::F32)?, want_dw)] {
            let d = (got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            let scale = want.abs()?.max_all()?.to_scalar::<f32>()?;
            // f32 sums in another order; dw's bf16 rounding on both sides.
            assert!(d <= 1e-2 * scale, "{d} vs {scale}");
        }
        Ok(())
    }

    /// Over an f32 master weight the op rounds `w` itself: the forward is
    /// the bf16 weight's, `dx` the product with the rounded weight, and
    /// `dw` the same f32 sums as the bf16 weight's, unrounded and in f32.
    #[test]
    fn bf16_products_over_an_f32_master_weight() -> Result<()> {
        let dev = Device::Cpu;
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (37, 40), &dev)?)?;
        let wm = Var::from_tensor(&Tensor::randn(0f32, 1.0, (9, 40), &dev)?)?;
        let wb = Var::from_tensor(&wm.as_tensor().to_dtype(DType::BF16)?)?;
        let g = Tensor::randn(0f32, 1.0, (37, 9), &dev)?;
        let (ym, yb) = (
            matmul_nt_bf16_op(x.as_tensor(), wm.as_tensor())?,
            matmul_nt_bf16_op(x.as_tensor(), wb.as_tensor())?,
        );
        let flat = |t: &Tensor| t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>();
        assert_eq!(flat(&ym)?, flat(&yb)?, "the forward rounds w");
        let gm = (ym * &g)?.sum_all()?.backward()?;
        let gb = (yb * &g)?.sum_all()?.backward()?;
        let (dxm, dxb) = (
            gm.get(x.as_tensor()).expect("dx"),
            gb.get(x.as_tensor()).expect("dx"),
        );
        assert_eq!(flat(dxm)?, flat(dxb)?, "dx through the rounded weight");
        let dwm = gm.get(wm.as_tensor()).expect("dw");
        let dwb = gb.get(wb.as_tensor()).expect("dw");
        assert_eq!(dwm.dtype(), DType::F32);
        assert_eq!(
            flat(&dwm.to_dtype(DType::BF16)?)?,
            flat(dwb)?,
            "dw: the same sums, rounded only for the bf16 weight"
        );
        assert_ne!(flat(dwm)?, flat(dwb)?, "the master's dw is not rounded");
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
