//! The fused kernels of the engine's dedicated decode step
//! (`kernels/decode.cu`): host references, and on CUDA one launch each on
//! candle tensors, so `arbor check-device` can hold each kernel against its
//! reference. The references round to bf16 where the kernels do:
//!
//! - [`add_rms_norm_row`]: `r += delta` (f32 residual), then
//!   `bf16(bf16(r / sqrt(mean(r^2) + eps)) * w)`;
//! - [`qk_rope_head`]: one head of a projection: `+ bias` (rounded to
//!   bf16), the head's RMSNorm `bf16(x / rms) * w` (Qwen3's q/k norm),
//!   then RoPE `[x1 c - x2 s | x2 c + x1 s]` at angle `pos * inv_freq_i`;
//! - [`silu_mul`]: `bf16(silu(g) * u)`.

use half::bf16;

/// One row of `fd_add_rmsnorm`: adds `delta` to the residual `r` in place
/// (when given) and returns the normalised, scaled row in bf16.
pub fn add_rms_norm_row(r: &mut [f32], delta: Option<&[bf16]>, w: &[bf16], eps: f32) -> Vec<bf16> {
    if let Some(d) = delta {
        for (x, &y) in r.iter_mut().zip(d) {
            *x += y.to_f32();
        }
    }
    let ss: f32 = r.iter().map(|x| x * x).sum();
    let inv = 1.0 / (ss / r.len() as f32 + eps).sqrt();
    r.iter()
        .zip(w)
        .map(|(&x, &w)| bf16::from_f32(bf16::from_f32(x * inv).to_f32() * w.to_f32()))
        .collect()
}

/// One head (`x: [d]`) of `fd_qk_rope_write` before its store: bias, RMSNorm
/// (when `norm` is given), RoPE at `pos`. Returns the head as f32 (the
/// kernel stores it as bf16).
pub fn qk_rope_head(
    x: &[bf16],
    bias: Option<&[bf16]>,
    norm: Option<&[bf16]>,
    eps: f32,
    inv_freq: &[f32],
    pos: u32,
) -> Vec<f32> {
    let d = x.len();
    let mut v: Vec<f32> = x.iter().map(|x| x.to_f32()).collect();
    if let Some(b) = bias {
        for (x, &b) in v.iter_mut().zip(b) {
            *x = bf16::from_f32(*x + b.to_f32()).to_f32();
        }
    }
    if let Some(w) = norm {
        let ss: f32 = v.iter().map(|x| x * x).sum();
        let inv = 1.0 / (ss / d as f32 + eps).sqrt();
        for (x, &w) in v.iter_mut().zip(w) {
            *x = bf16::from_f32(*x * inv).to_f32() * w.to_f32();
        }
    }
    let half = d / 2;
    let mut out = vec![0f32; d];
    for i in 0..half {
        let a = pos as f32 * inv_freq[i];
        let (c, s) = (a.cos(), a.sin());
        out[i] = v[i] * c - v[i + half] * s;
        out[i + half] = v[i + half] * c + v[i] * s;
    }
    out
}

/// `fd_silu_mul`: `silu(g) * u`, each rounded once to bf16.
pub fn silu_mul(g: &[bf16], u: &[bf16]) -> Vec<bf16> {
    g.iter()
        .zip(u)
        .map(|(&g, &u)| {
            let g = g.to_f32();
            bf16::from_f32(g / (1.0 + (-g).exp()) * u.to_f32())
        })
        .collect()
}

/// One launch of each fused kernel on candle tensors (bf16, contiguous, on
/// one CUDA device), for checks.
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
pub mod cuda {
    use candle_core::{DType, Result, Tensor};

    use crate::cuda::{tensor_ptr, Kernel, PushKernelArg, WrapErr};
    use candle_core::cuda_backend::cudarc::driver::LaunchConfig;

    fn device(t: &Tensor) -> Result<&candle_core::CudaDevice> {
        match t.device() {
            candle_core::Device::Cuda(d) => Ok(d),
            _ => candle_core::bail!("decode kernels: a tensor is not on a CUDA device"),
        }
    }

    /// `fd_add_rmsnorm` over `resid: [B, H]` (f32, updated in place) with
    /// `delta: [B, H]` and `w: [H]` (bf16). Returns the normed rows.
    pub fn add_rms_norm(
        resid: &Tensor,
        delta: Option<&Tensor>,
        w: &Tensor,
        eps: f32,
    ) -> Result<Tensor> {
        let dev = device(resid)?;
        let (b, h) = resid.dims2()?;
        let out = Tensor::zeros((b, h), DType::BF16, resid.device())?;
        let st = dev.cuda_stream();
        let (r, dl, wp, o) = (
            tensor_ptr(resid, &st)?,
            delta.map_or(Ok(0), |d| tensor_ptr(d, &st))?,
            tensor_ptr(w, &st)?,
            tensor_ptr(&out, &st)?,
        );
        let (hi, add) = (h as i32, delta.is_some() as i32);
        let f = Kernel::get(dev, "decode", "fd_add_rmsnorm")?;
        let mut l = f.builder();
        l.arg(&r)
            .arg(&dl)
            .arg(&wp)
            .arg(&o)
            .arg(&hi)
            .arg(&eps)
            .arg(&add);
        let cfg = LaunchConfig {
            grid_dim: (b as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches `fd_add_rmsnorm`; the tensors hold B x H (and H)
        // elements of the dtypes the kernel reads.
        unsafe { l.launch(cfg) }.w()?;
        Ok(out)
    }

    /// Inputs of one `fd_qk_rope_write` launch: projections `q: [B, nh*d]`,
    /// `k, v: [B, nkv*d]`, optional biases and q/k norm weights (bf16),
    /// `inv_freq: [d/2]` (f32), `pos, slots: [B]` (u32), caches
    /// `[slots, nkv, d]` (bf16, written in place). With `fused`, the
    /// projections come from its rows instead, each `q | k | v` (one QKV
    /// GEMM's output, `[B, (nh + 2 nkv) d]`), and `q`, `k`, `v` are unread.
    #[derive(Debug)]
    pub struct RopeWrite<'a> {
        pub fused: Option<&'a Tensor>,
        pub q: &'a Tensor,
        pub k: &'a Tensor,
        pub v: &'a Tensor,
        pub q_bias: Option<&'a Tensor>,
        pub k_bias: Option<&'a Tensor>,
        pub v_bias: Option<&'a Tensor>,
        pub q_norm: Option<&'a Tensor>,
        pub k_norm: Option<&'a Tensor>,
        pub eps: f32,
        pub inv_freq: &'a Tensor,
        pub pos: &'a Tensor,
        pub slots: &'a Tensor,
        pub k_cache: &'a Tensor,
        pub v_cache: &'a Tensor,
        pub heads: usize,
        pub kv_heads: usize,
        pub head_dim: usize,
    }

    /// Runs `fd_qk_rope_write`; returns the RoPE'd queries `[B, nh, d]`.
    pub fn qk_rope_write(a: &RopeWrite<'_>) -> Result<Tensor> {
        let dev = device(a.q)?;
        let b = a.q.dim(0)?;
        let (nh, nkv, d) = (a.heads, a.kv_heads, a.head_dim);
        let out = Tensor::zeros((b, nh, d), DType::BF16, a.q.device())?;
        let st = dev.cuda_stream();
        let p = |t: &Tensor| tensor_ptr(t, &st);
        let o = |t: Option<&Tensor>| t.map_or(Ok(0), |t| tensor_ptr(t, &st));
        let n_slots = a.k_cache.dim(0)? as u32;
        let (q, k, v, qo) = match a.fused {
            Some(t) => {
                let base = p(t)?;
                (
                    base,
                    base + 2 * (nh * d) as u64,
                    base + 2 * ((nh + nkv) * d) as u64,
                    p(&out)?,
                )
            }
            None => (p(a.q)?, p(a.k)?, p(a.v)?, p(&out)?),
        };
        let (qb, kb, vb, qn, kn) = (
            o(a.q_bias)?,
            o(a.k_bias)?,
            o(a.v_bias)?,
            o(a.q_norm)?,
            o(a.k_norm)?,
        );
        let (fr, ps, sl, kc, vc) = (
            p(a.inv_freq)?,
            p(a.pos)?,
            p(a.slots)?,
            p(a.k_cache)?,
            p(a.v_cache)?,
        );
        let (nhi, nkvi, di) = (nh as i32, nkv as i32, d as i32);
        // Separate q and k/v tensors: each row is one projection; fused
        // rows hold all three.
        let (q_stride, kv_stride) = match a.fused {
            Some(_) => (((nh + 2 * nkv) * d) as i32, ((nh + 2 * nkv) * d) as i32),
            None => ((nh * d) as i32, (nkv * d) as i32),
        };
        let f = Kernel::get(dev, "decode", "fd_qk_rope_write")?;
        let mut l = f.builder();
        l.arg(&q).arg(&k).arg(&v).arg(&qb).arg(&kb).arg(&vb);
        l.arg(&qn).arg(&kn).arg(&a.eps).arg(&fr).arg(&ps).arg(&sl);
        l.arg(&n_slots).arg(&qo).arg(&kc).arg(&vc);
        l.arg(&nhi)
            .arg(&nkvi)
            .arg(&di)
            .arg(&q_stride)
            .arg(&kv_stride);
        let cfg = LaunchConfig {
            grid_dim: (b as u32, (nh + nkv) as u32, 1),
            block_dim: (d.next_multiple_of(32) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches `fd_qk_rope_write`; the shapes are the ones the
        // struct documents, and slots past the cache are skipped.
        unsafe { l.launch(cfg) }.w()?;
        Ok(out)
    }

    /// `fd_silu_mul` over the rows of `gate_up: [B, 2 I]` (bf16), each
    /// `gate | up` (one gate|up GEMM's output). Returns `[B, I]`.
    pub fn silu_mul_rows(gate_up: &Tensor) -> Result<Tensor> {
        let dev = device(gate_up)?;
        let (b, two_i) = gate_up.dims2()?;
        let inter = two_i / 2;
        let out = Tensor::zeros((b, inter), DType::BF16, gate_up.device())?;
        let st = dev.cuda_stream();
        let g = tensor_ptr(gate_up, &st)?;
        let (u, o) = (g + 2 * inter as u64, tensor_ptr(&out, &st)?);
        let (ni, ii, stride) = ((b * inter) as i32, inter as i32, two_i as i32);
        let f = Kernel::get(dev, "decode", "fd_silu_mul")?;
        let mut l = f.builder();
        l.arg(&g).arg(&u).arg(&o).arg(&ni).arg(&ii).arg(&stride);
        // SAFETY: matches `fd_silu_mul`; gate_up holds B rows of 2 I bf16s,
        // out B x I.
        unsafe { l.launch(crate::cuda::grid1d(b * inter, 256)) }.w()?;
        Ok(out)
    }

    /// `fd_silu_mul` of `gate, up` (bf16, same shape).
    pub fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        let dev = device(gate)?;
        let n = gate.elem_count();
        if up.elem_count() != n {
            candle_core::bail!("silu_mul: {:?} and {:?}", gate.dims(), up.dims());
        }
        let out = Tensor::zeros(gate.dims(), DType::BF16, gate.device())?;
        let st = dev.cuda_stream();
        let (g, u, o, ni) = (
            tensor_ptr(gate, &st)?,
            tensor_ptr(up, &st)?,
            tensor_ptr(&out, &st)?,
            n as i32,
        );
        // Rows of the last dimension, contiguous.
        let inter = *gate.dims().last().unwrap_or(&1) as i32;
        let f = Kernel::get(dev, "decode", "fd_silu_mul")?;
        let mut l = f.builder();
        l.arg(&g).arg(&u).arg(&o).arg(&ni).arg(&inter).arg(&inter);
        // SAFETY: matches `fd_silu_mul`; the three tensors hold n bf16s.
        unsafe { l.launch(crate::cuda::grid1d(n, 256)) }.w()?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(v: &[f32]) -> Vec<bf16> {
        v.iter().map(|&x| bf16::from_f32(x)).collect()
    }

    #[test]
    fn add_rms_norm_row_against_float64() {
        let h = 64;
        let mut r: Vec<f32> = (0..h).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.3).collect();
        let delta = b(&(0..h).map(|i| (i as f32 * 0.7).sin()).collect::<Vec<_>>());
        let w = b(&(0..h)
            .map(|i| 0.5 + i as f32 / h as f32)
            .collect::<Vec<_>>());
        let want_r: Vec<f64> = r
            .iter()
            .zip(&delta)
            .map(|(&x, &d)| x as f64 + d.to_f64())
            .collect();
        let out = add_rms_norm_row(&mut r, Some(&delta), &w, 1e-6);
        let rms = (want_r.iter().map(|x| x * x).sum::<f64>() / h as f64 + 1e-6).sqrt();
        for i in 0..h {
            assert!((r[i] as f64 - want_r[i]).abs() < 1e-6);
            let want = want_r[i] / rms * w[i].to_f64();
            // Two bf16 roundings: within 2^-7 relative.
            assert!(
                (out[i].to_f64() - want).abs() <= want.abs() / 64.0 + 1e-6,
                "{i}"
            );
        }
        // Without delta the residual is untouched.
        let before = r.clone();
        add_rms_norm_row(&mut r, None, &w, 1e-6);
        assert_eq!(r, before);
    }

    #[test]
    fn qk_rope_head_rotates_pairs_after_the_norm() {
        let d = 16;
        let x = b(&(0..d).map(|i| (i as f32 - 7.5) * 0.2).collect::<Vec<_>>());
        let inv_freq: Vec<f32> = (0..d / 2)
            .map(|i| 1.0 / 10000f32.powf(2.0 * i as f32 / d as f32))
            .collect();
        // Position 0: no rotation; the norm alone (weight 1) gives unit rms.
        let ones = b(&vec![1.0; d]);
        let y0 = qk_rope_head(&x, None, Some(&ones), 0.0, &inv_freq, 0);
        let ms: f32 = y0.iter().map(|v| v * v).sum::<f32>() / d as f32;
        assert!((ms - 1.0).abs() < 2e-2, "{ms}");
        // Any position: each pair (i, i + d/2) keeps its length.
        let y = qk_rope_head(&x, None, None, 0.0, &inv_freq, 37);
        for i in 0..d / 2 {
            let before = x[i].to_f32().hypot(x[i + d / 2].to_f32());
            let after = y[i].hypot(y[i + d / 2]);
            assert!((before - after).abs() < 1e-5);
            let a = 37.0 * inv_freq[i] as f64;
            let want = x[i].to_f64() * a.cos() - x[i + d / 2].to_f64() * a.sin();
            assert!((y[i] as f64 - want).abs() < 1e-4);
        }
        // A bias shifts the head before the rotation.
        let bias = b(&vec![0.5; d]);
        let yb = qk_rope_head(&x, Some(&bias), None, 0.0, &inv_freq, 0);
        assert!((yb[3] - (x[3].to_f32() + 0.5)).abs() < 1e-2);
    }

    #[test]
    fn silu_mul_against_float64() {
        let g = b(&[-3.0, -0.5, 0.0, 0.25, 2.0, 6.0]);
        let u = b(&[1.0, 2.0, -1.0, 0.5, -0.75, 1.5]);
        for ((o, g), u) in silu_mul(&g, &u).iter().zip(&g).zip(&u) {
            let g = g.to_f64();
            let want = g / (1.0 + (-g).exp()) * u.to_f64();
            assert!((o.to_f64() - want).abs() <= want.abs() / 128.0 + 1e-6);
        }
    }
}
