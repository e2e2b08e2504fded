//! Advantage gather/scatter between segments and token positions.
//!
//! A rollout's tokens are cut into segments (a FOCUS tree edge, a GRPO
//! sample, a tool turn); credit lives per segment, the losses per token.
//! `seg: [N]` (i64) names each token's segment, `< 0` for none (prompt,
//! padding).
//! - [`segment_broadcast`]: `out_i = vals[seg_i]` (0 where `seg_i < 0`), `[S] -> [N]`;
//!   its gradient is the segment sum.
//! - [`segment_sum`]: `out_s = sum_{i: seg_i = s} x_i`, `[N] -> [S]`; its
//!   gradient is the broadcast. [`segment_mean`] divides by the counts.
//!
//! CPU: f64 accumulation. CUDA (`kernels/segment.cu`, f32): the sum uses
//! float atomics, so its summation order is not fixed.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};

/// `[S] -> [N]`: each token gets its segment's value.
pub fn segment_broadcast(vals: &Tensor, seg: &Tensor) -> Result<Tensor> {
    let s = vals.dims1()?;
    check_seg(seg, "segment_broadcast")?;
    vals.contiguous()?
        .apply_op2(&seg.contiguous()?, Broadcast { s })
}

/// `[N] -> [S]`: per-segment sums.
pub fn segment_sum(x: &Tensor, seg: &Tensor, num_segments: usize) -> Result<Tensor> {
    let n = x.dims1()?;
    check_seg(seg, "segment_sum")?;
    if seg.dims1()? != n {
        candle_core::bail!("segment_sum: x has {n} tokens but seg {:?}", seg.dims());
    }
    x.contiguous()?
        .apply_op2(&seg.contiguous()?, Sum { s: num_segments })
}

/// `[N] -> [S]`: per-segment means (0 for empty segments).
pub fn segment_mean(x: &Tensor, seg: &Tensor, num_segments: usize) -> Result<Tensor> {
    let mut counts = vec![0f64; num_segments];
    for k in seg.to_vec1::<i64>()? {
        if k >= 0 && (k as usize) < num_segments {
            counts[k as usize] += 1.0;
        }
    }
    let inv: Vec<f64> = counts
        .iter()
        .map(|&c| if c > 0.0 { 1.0 / c } else { 0.0 })
        .collect();
    let inv = Tensor::from_vec(inv, num_segments, x.device())?.to_dtype(x.dtype())?;
    segment_sum(x, seg, num_segments)? * inv
}

fn check_seg(seg: &Tensor, what: &str) -> Result<()> {
    if seg.dtype() != DType::I64 || seg.rank() != 1 {
        candle_core::bail!(
            "{what}: seg must be i64 [N], got {:?} {:?}",
            seg.dtype(),
            seg.dims()
        );
    }
    Ok(())
}

#[derive(Debug, Clone, Copy)]
struct Broadcast {
    s: usize,
}

#[derive(Debug, Clone, Copy)]
struct Sum {
    s: usize,
}

fn host(
    x: &CpuStorage,
    xl: &Layout,
    seg: &CpuStorage,
    sl: &Layout,
) -> Result<(Vec<f64>, Vec<i64>)> {
    let CpuStorage::F64(xs) = x.to_dtype(xl, DType::F64)? else {
        unreachable!("to_dtype(F64) gives F64")
    };
    let ids = match seg {
        CpuStorage::I64(v) => {
            v[sl.start_offset()..sl.start_offset() + sl.shape().elem_count()].to_vec()
        }
        _ => candle_core::bail!("segment ids must be i64"),
    };
    Ok((xs, ids))
}

fn to_dtype(v: Vec<f64>, dt: DType) -> Result<CpuStorage> {
    let n = v.len();
    CpuStorage::F64(v).to_dtype(&Layout::contiguous(n), dt)
}

#[cfg(feature = "cuda")]
fn launch(
    name: &str,
    x: &candle_core::CudaStorage,
    xl: &Layout,
    seg: &candle_core::CudaStorage,
    sl: &Layout,
    out_len: usize,
    s: usize,
) -> Result<(candle_core::CudaStorage, Shape)> {
    use crate::cuda::{self, PushKernelArg, WrapErr};
    let dev = x.device.clone();
    let xv = cuda::view::<f32>(x, xl)?;
    let sv = cuda::view::<i64>(seg, sl)?;
    let n = sl.shape().elem_count();
    let mut out = cuda::alloc_out::<f32>(&dev, out_len)?;
    let (ni, si) = (n as i32, s as i32);
    if name == "segment_sum" {
        let z = cuda::Kernel::get(&dev, "segment", "segment_zero")?;
        let mut b = z.builder();
        b.arg(&mut out).arg(&si);
        // SAFETY: matches `segment_zero`; out holds s floats.
        #[allow(unsafe_code)]
        unsafe { b.launch(cuda::grid1d(s, 256)) }.w()?;
    }
    let f = cuda::Kernel::get(&dev, "segment", name)?;
    let mut b = f.builder();
    b.arg(&xv).arg(&sv).arg(&mut out).arg(&ni).arg(&si);
    // SAFETY: matches `segment_broadcast` / `segment_sum` in kernels/segment.cu.
    #[allow(unsafe_code)]
    unsafe { b.launch(cuda::grid1d(n, 256)) }.w()?;
    Ok((cuda::wrap(out, &dev), Shape::from(out_len)))
}

impl CustomOp2 for Broadcast {
    fn name(&self) -> &'static str {
        "arbor-segment-broadcast"
    }

    fn cpu_fwd(
        &self,
        v: &CpuStorage,
        vl: &Layout,
        seg: &CpuStorage,
        sl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (vals, ids) = host(v, vl, seg, sl)?;
        let out: Vec<f64> = ids
            .iter()
            .map(|&k| {
                if k >= 0 && (k as usize) < self.s {
                    vals[k as usize]
                } else {
                    0.0
                }
            })
            .collect();
        let n = out.len();
        Ok((to_dtype(out, v.dtype())?, Shape::from(n)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        v: &candle_core::CudaStorage,
        vl: &Layout,
        seg: &candle_core::CudaStorage,
        sl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        launch(
            "segment_broadcast",
            v,
            vl,
            seg,
            sl,
            sl.shape().elem_count(),
            self.s,
        )
    }

    fn bwd(
        &self,
        _v: &Tensor,
        seg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(segment_sum(grad, seg, self.s)?), None))
    }
}

impl CustomOp2 for Sum {
    fn name(&self) -> &'static str {
        "arbor-segment-sum"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        seg: &CpuStorage,
        sl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (xs, ids) = host(x, xl, seg, sl)?;
        let mut out = vec![0f64; self.s];
        for (v, &k) in xs.iter().zip(&ids) {
            if k >= 0 && (k as usize) < self.s {
                out[k as usize] += v;
            }
        }
        Ok((to_dtype(out, x.dtype())?, Shape::from(self.s)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        seg: &candle_core::CudaStorage,
        sl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        launch("segment_sum", x, xl, seg, sl, self.s, self.s)
    }

    fn bwd(
        &self,
        _x: &Tensor,
        seg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(segment_broadcast(grad, seg)?), None))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn broadcast_and_sum_match_loops_and_are_adjoint() -> Result<()> {
        let dev = Device::Cpu;
        let vals = [0.5f64, -1.25, 2.0];
        let seg = [0i64, 0, -1, 2, 2, 2, 1, -1];
        let x = [1.0f64, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
        let st = Tensor::new(&seg, &dev)?;
        let b = segment_broadcast(&Tensor::new(&vals, &dev)?, &st)?.to_vec1::<f64>()?;
        assert_eq!(b, vec![0.5, 0.5, 0.0, 2.0, 2.0, 2.0, -1.25, 0.0]);
        let s = segment_sum(&Tensor::new(&x, &dev)?, &st, 3)?.to_vec1::<f64>()?;
        assert_eq!(s, vec![3.0, 7.0, 15.0]);
        let m = segment_mean(&Tensor::new(&x, &dev)?, &st, 4)?.to_vec1::<f64>()?;
        assert_eq!(m, vec![1.5, 7.0, 5.0, 0.0]);
        // <broadcast(v), x> = <v, sum(x)>: gradients are each other's op.
        let vv = Var::from_slice(&vals, 3, &dev)?;
        let y = Tensor::new(&x, &dev)?;
        let g = (segment_broadcast(vv.as_tensor(), &st)? * &y)?
            .sum_all()?
            .backward()?;
        assert_eq!(g.get(vv.as_tensor()).expect("grad").to_vec1::<f64>()?, s);
        let xv = Var::from_slice(&x, 8, &dev)?;
        let w = Tensor::new(&vals, &dev)?;
        let g = (segment_sum(xv.as_tensor(), &st, 3)? * &w)?
            .sum_all()?
            .backward()?;
        assert_eq!(g.get(xv.as_tensor()).expect("grad").to_vec1::<f64>()?, b);
        Ok(())
    }
}
