//! Masked clipped PPO loss and clipped value loss as ops with their own
//! backward, reduced on the device to a few scalars.
//!
//! PPO, per token `t` with `aux_t = (logp_old, A, w, 0)`:
//! `r = exp(logp - logp_old)`,
//! `L_t = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)`;
//! output `[4] = (sum_t w L_t, sum_t w [clipped], sum_t w (r - 1 - log r), sum_t w)`:
//! the loss, the weighted clip fraction, the k3 KL estimate to the old
//! policy, and the total weight. The weight carries the mask and the
//! aggregation, computed by the caller (`arbor_rl::ppo::aggregation_weights`:
//! token mean `w = m / sum(m)`, sequence mean
//! `w = m / (n_seq * sum_{t in seq} m)`). Gradient:
//! `dL_t/dlogp = -A r` where the unclipped term is the minimum, else 0;
//! `d k3/dlogp = r - 1`.
//!
//! Value, `aux_t = (R, v_old, w, 0)`, clip `c` (`c <= 0`: off):
//! `v_c = v_old + clamp(v - v_old, -c, c)`,
//! `L_t = 0.5 max((v - R)^2, (v_c - R)^2)`; output `[2] = (sum w L, sum w [clipped])`.
//!
//! CPU: f64 arithmetic (the reference); CUDA: `kernels/ppo.cu`, f32, the
//! forward summed by many blocks with float atomics (order not fixed).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};

/// Asymmetric ratio clip.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PpoClip {
    pub eps_low: f32,
    pub eps_high: f32,
}

/// `[N, 4]` aux tensor from per-token columns.
pub fn pack_aux(a: &[f32], b: &[f32], w: &[f32], dev: &candle_core::Device) -> Result<Tensor> {
    let n = a.len();
    if b.len() != n || w.len() != n {
        candle_core::bail!("pack_aux: columns of lengths {n}, {}, {}", b.len(), w.len());
    }
    let mut v = Vec::with_capacity(4 * n);
    for i in 0..n {
        v.extend_from_slice(&[a[i], b[i], w[i], 0.0]);
    }
    Tensor::from_vec(v, (n, 4), dev)
}

/// PPO loss terms `[4]` (see the module docs). `logp: [N]`, `aux: [N, 4]`
/// in the same float dtype. Differentiable in `logp` (loss and KL terms).
pub fn ppo_loss(logp: &Tensor, aux: &Tensor, clip: PpoClip) -> Result<Tensor> {
    check(logp, aux, "ppo_loss")?;
    logp.contiguous()?
        .apply_op2(&aux.contiguous()?, Reduce(PpoLoss { clip }))
}

/// Value loss terms `[2]`. `v: [N]`, `aux: [N, 4] = (R, v_old, w, 0)`.
pub fn value_loss(v: &Tensor, aux: &Tensor, clip: f32) -> Result<Tensor> {
    check(v, aux, "value_loss")?;
    v.contiguous()?
        .apply_op2(&aux.contiguous()?, Reduce(ValueLoss { clip }))
}

fn check(x: &Tensor, aux: &Tensor, what: &str) -> Result<()> {
    let n = x.dims1()?;
    if aux.dims() != [n, 4] {
        candle_core::bail!("{what}: aux must be [{n}, 4], got {:?}", aux.dims());
    }
    if x.dtype() != aux.dtype() || !matches!(x.dtype(), DType::F32 | DType::F64) {
        candle_core::bail!(
            "{what}: inputs must be f32 or f64 and alike, got {:?} and {:?}",
            x.dtype(),
            aux.dtype()
        );
    }
    Ok(())
}

fn f64s(s: &CpuStorage, l: &Layout) -> Result<Vec<f64>> {
    match s.to_dtype(l, DType::F64)? {
        CpuStorage::F64(v) => Ok(v),
        _ => unreachable!("to_dtype(F64) gives F64"),
    }
}

fn back(v: Vec<f64>, dt: DType) -> CpuStorage {
    if dt == DType::F64 {
        CpuStorage::F64(v)
    } else {
        CpuStorage::F32(v.into_iter().map(|x| x as f32).collect())
    }
}

/// `(loss, clipped, k3, dloss/dlogp, dk3/dlogp)` of one token, f64.
fn ppo_token(logp: f64, a: &[f64], clip: PpoClip) -> (f64, f64, f64, f64, f64) {
    let lr = logp - a[0];
    let r = lr.exp();
    let adv = a[1];
    let rc = r.clamp(1.0 - clip.eps_low as f64, 1.0 + clip.eps_high as f64);
    let (un, cl) = (r * adv, rc * adv);
    let use_clip = cl < un;
    (
        -(if use_clip { cl } else { un }),
        if use_clip { 1.0 } else { 0.0 },
        r - 1.0 - lr,
        if use_clip { 0.0 } else { -adv * r },
        r - 1.0,
    )
}

/// `(loss, clipped, dloss/dv)` of one token, f64.
fn value_token(v: f64, a: &[f64], clip: f64) -> (f64, f64, f64) {
    let (ret, vold) = (a[0], a[1]);
    let du = v - ret;
    let lu = 0.5 * du * du;
    if clip <= 0.0 {
        return (lu, 0.0, du);
    }
    // Inside the clip range the clipped prediction is `v` itself (decided
    // from `d`, since `vold + (v - vold)` need not round back to `v`); a
    // clipped token's gradient is zero (the prediction is pinned).
    let d = v - vold;
    let dc = if d > clip {
        vold + clip - ret
    } else if d < -clip {
        vold - clip - ret
    } else {
        du
    };
    let lc = 0.5 * dc * dc;
    if lc > lu {
        (lc, 1.0, 0.0)
    } else {
        (lu, 0.0, du)
    }
}

/// A per-token loss reduced to `OUTS` weighted sums: `out_k = sum_t w_t term_k(x_t)`,
/// with gradient `dx_t = w_t sum_k gout_k d term_k / dx`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
trait TokenLoss: Copy + Send + Sync + 'static {
    const NAME: &'static str;
    const BWD_NAME: &'static str;
    const OUTS: usize;
    /// Kernel names in kernels/ppo.cu.
    const FWD_KERNEL: &'static str;
    const BWD_KERNEL: &'static str;
    /// Extra f32 kernel arguments after `n`.
    fn params(&self) -> Vec<f32>;
    /// `(terms, d terms / dx)` of one token with `aux = a`.
    fn token(&self, x: f64, a: &[f64]) -> ([f64; 4], [f64; 4]);
}

#[derive(Debug, Clone, Copy)]
struct PpoLoss {
    clip: PpoClip,
}

impl TokenLoss for PpoLoss {
    const NAME: &'static str = "arbor-ppo-loss";
    const BWD_NAME: &'static str = "arbor-ppo-loss-bwd";
    const OUTS: usize = 4;
    const FWD_KERNEL: &'static str = "ppo_loss_fwd";
    const BWD_KERNEL: &'static str = "ppo_loss_bwd";
    fn params(&self) -> Vec<f32> {
        vec![self.clip.eps_low, self.clip.eps_high]
    }
    fn token(&self, x: f64, a: &[f64]) -> ([f64; 4], [f64; 4]) {
        let (loss, clipped, k3, dl, dk) = ppo_token(x, a, self.clip);
        ([loss, clipped, k3, 1.0], [dl, 0.0, dk, 0.0])
    }
}

#[derive(Debug, Clone, Copy)]
struct ValueLoss {
    clip: f32,
}

impl TokenLoss for ValueLoss {
    const NAME: &'static str = "arbor-value-loss";
    const BWD_NAME: &'static str = "arbor-value-loss-bwd";
    const OUTS: usize = 2;
    const FWD_KERNEL: &'static str = "value_loss_fwd";
    const BWD_KERNEL: &'static str = "value_loss_bwd";
    fn params(&self) -> Vec<f32> {
        vec![self.clip]
    }
    fn token(&self, x: f64, a: &[f64]) -> ([f64; 4], [f64; 4]) {
        let (loss, clipped, dv) = value_token(x, a, self.clip as f64);
        ([loss, clipped, 0.0, 0.0], [dv, 0.0, 0.0, 0.0])
    }
}

/// Forward op: `(x [N], aux [N, 4]) -> [OUTS]`.
#[derive(Debug, Clone, Copy)]
struct Reduce<L>(L);

/// Backward op: `(x, aux, gout [OUTS]) -> dx [N]`.
#[derive(Debug, Clone, Copy)]
struct ReduceBwd<L>(L);

#[cfg(feature = "cuda")]
mod gpu {
    use crate::cuda::{self, PushKernelArg, WrapErr};
    use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
    use candle_core::{CudaStorage, Layout, Result, Shape};

    /// Forward reduction in one block: `kernel(x, aux, out, n, extra...)`.
    pub fn reduce(
        name: &str,
        x: &CudaStorage,
        xl: &Layout,
        aux: &CudaStorage,
        al: &Layout,
        outs: usize,
        params: &[f32],
    ) -> Result<(CudaStorage, Shape)> {
        let dev = x.device.clone();
        let f = cuda::Kernel::get(&dev, "ppo", name)?;
        let xv = cuda::view::<f32>(x, xl)?;
        let av = cuda::view::<f32>(aux, al)?;
        let n = xl.shape().elem_count() as i32;
        // Blocks add into the output atomically: it starts at zero.
        let mut out = dev.alloc_zeros::<f32>(outs)?;
        let mut b = f.builder();
        b.arg(&xv).arg(&av).arg(&mut out).arg(&n);
        for p in params {
            b.arg(p);
        }
        let blocks = (n as usize).div_ceil(1024).clamp(1, 528) as u32;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches `ppo_loss_fwd` / `value_loss_fwd` in kernels/ppo.cu.
        #[allow(unsafe_code)]
        unsafe { b.launch(cfg) }.w()?;
        Ok((cuda::wrap(out, &dev), Shape::from(outs)))
    }

    /// Per-token backward: `kernel(x, aux, gout, gx, n, extra...)`.
    #[allow(clippy::too_many_arguments)]
    pub fn per_token(
        name: &str,
        x: &CudaStorage,
        xl: &Layout,
        aux: &CudaStorage,
        al: &Layout,
        g: &CudaStorage,
        gl: &Layout,
        params: &[f32],
    ) -> Result<(CudaStorage, Shape)> {
        let dev = x.device.clone();
        let f = cuda::Kernel::get(&dev, "ppo", name)?;
        let xv = cuda::view::<f32>(x, xl)?;
        let av = cuda::view::<f32>(aux, al)?;
        let gv = cuda::view::<f32>(g, gl)?;
        let n = xl.shape().elem_count();
        let mut out = cuda::alloc_out::<f32>(&dev, n)?;
        let ni = n as i32;
        let mut b = f.builder();
        b.arg(&xv).arg(&av).arg(&gv).arg(&mut out).arg(&ni);
        for p in params {
            b.arg(p);
        }
        // SAFETY: matches `ppo_loss_bwd` / `value_loss_bwd` in kernels/ppo.cu.
        #[allow(unsafe_code)]
        unsafe { b.launch(cuda::grid1d(n, 256)) }.w()?;
        Ok((cuda::wrap(out, &dev), Shape::from(n)))
    }
}

impl<L: TokenLoss> CustomOp2 for Reduce<L> {
    fn name(&self) -> &'static str {
        L::NAME
    }

    fn cpu_fwd(
        &self,
        s: &CpuStorage,
        l: &Layout,
        a: &CpuStorage,
        al: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, aux) = (f64s(s, l)?, f64s(a, al)?);
        let mut out = vec![0f64; L::OUTS];
        for (i, &xi) in x.iter().enumerate() {
            let a = &aux[4 * i..4 * i + 4];
            if a[2] == 0.0 {
                continue;
            }
            let (terms, _) = self.0.token(xi, a);
            for (o, t) in out.iter_mut().zip(terms) {
                *o += a[2] * t;
            }
        }
        Ok((back(out, s.dtype()), Shape::from(L::OUTS)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
        a: &candle_core::CudaStorage,
        al: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        gpu::reduce(L::FWD_KERNEL, s, l, a, al, L::OUTS, &self.0.params())
    }

    fn bwd(
        &self,
        x: &Tensor,
        aux: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g =
            x.detach()
                .apply_op3_no_bwd(&aux.detach(), &grad.contiguous()?, &ReduceBwd(self.0))?;
        Ok((Some(g), None))
    }
}

impl<L: TokenLoss> CustomOp3 for ReduceBwd<L> {
    fn name(&self) -> &'static str {
        L::BWD_NAME
    }

    fn cpu_fwd(
        &self,
        s: &CpuStorage,
        l: &Layout,
        a: &CpuStorage,
        al: &Layout,
        g: &CpuStorage,
        gl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, aux, g) = (f64s(s, l)?, f64s(a, al)?, f64s(g, gl)?);
        let out: Vec<f64> = x
            .iter()
            .enumerate()
            .map(|(i, &xi)| {
                let a = &aux[4 * i..4 * i + 4];
                if a[2] == 0.0 {
                    return 0.0;
                }
                let (_, d) = self.0.token(xi, a);
                a[2] * g.iter().zip(d).map(|(gk, dk)| gk * dk).sum::<f64>()
            })
            .collect();
        let n = out.len();
        Ok((back(out, s.dtype()), Shape::from(n)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
        a: &candle_core::CudaStorage,
        al: &Layout,
        g: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        gpu::per_token(L::BWD_KERNEL, s, l, a, al, g, gl, &self.0.params())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};
    use rand::{rngs::StdRng, Rng, SeedableRng};

    /// Straight-line f64 reference of the PPO terms, written from the
    /// formula (min of the two surrogates), not from `ppo_token`.
    fn reference(lp: &[f64], old: &[f64], adv: &[f64], w: &[f64], c: PpoClip) -> [f64; 4] {
        let mut o = [0.0; 4];
        for i in 0..lp.len() {
            let r = (lp[i] - old[i]).exp();
            let s1 = r * adv[i];
            let s2 = r.max(1.0 - c.eps_low as f64).min(1.0 + c.eps_high as f64) * adv[i];
            o[0] += w[i] * -(s1.min(s2));
            o[1] += w[i] * if s2 < s1 { 1.0 } else { 0.0 };
            o[2] += w[i] * (r - 1.0 - (lp[i] - old[i]));
            o[3] += w[i];
        }
        o
    }

    fn batch(seed: u64, n: usize) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
        let mut rng = StdRng::seed_from_u64(seed);
        let lp: Vec<f64> = (0..n).map(|_| rng.random_range(-3.0..-0.1)).collect();
        let old: Vec<f64> = lp.iter().map(|x| x + rng.random_range(-0.4..0.4)).collect();
        let adv: Vec<f64> = (0..n).map(|_| rng.random_range(-2.0..2.0)).collect();
        let mask: Vec<f32> = (0..n)
            .map(|_| if rng.random_bool(0.7) { 1.0 } else { 0.0 })
            .collect();
        // Sequence-mean weights over sequences of 5 tokens.
        let live: Vec<f64> = mask
            .chunks(5)
            .map(|c| c.iter().map(|&m| m as f64).sum())
            .collect();
        let n_live = live.iter().filter(|&&s| s > 0.0).count() as f64;
        let w = (0..n)
            .map(|i| match live[i / 5] {
                s if s > 0.0 => mask[i] as f64 / (n_live * s),
                _ => 0.0,
            })
            .collect();
        (lp, old, adv, w)
    }

    fn aux64(a: &[f64], b: &[f64], w: &[f64]) -> Result<Tensor> {
        let v: Vec<f64> = (0..a.len()).flat_map(|i| [a[i], b[i], w[i], 0.0]).collect();
        Tensor::from_vec(v, (a.len(), 4), &Device::Cpu)
    }

    #[test]
    fn ppo_forward_matches_reference_and_gradient_matches_fd() -> Result<()> {
        let clip = PpoClip {
            eps_low: 0.2,
            eps_high: 0.28,
        };
        let n = 41;
        let (lp, old, adv, w) = batch(3, n);
        let want = reference(&lp, &old, &adv, &w, clip);
        let aux = aux64(&old, &adv, &w)?;
        let x = Var::from_vec(lp.clone(), n, &Device::Cpu)?;
        let out = ppo_loss(x.as_tensor(), &aux, clip)?;
        let got = out.to_vec1::<f64>()?;
        for k in 0..4 {
            assert!(
                (got[k] - want[k]).abs() < 1e-12,
                "term {k}: {} vs {}",
                got[k],
                want[k]
            );
        }
        assert!(
            (got[3] - 1.0).abs() < 1e-6,
            "sequence weights sum to 1: {}",
            got[3]
        );
        // d(loss + 0.1 kl)/dlogp against finite differences.
        let obj = (out.get(0)? + (out.get(2)? * 0.1)?)?;
        let g = obj
            .backward()?
            .get(x.as_tensor())
            .expect("grad")
            .to_vec1::<f64>()?;
        let eps = 1e-7;
        for i in 0..n {
            let f = |d: f64| {
                let mut l = lp.clone();
                l[i] += d;
                let r = reference(&l, &old, &adv, &w, clip);
                r[0] + 0.1 * r[2]
            };
            let fd = (f(eps) - f(-eps)) / (2.0 * eps);
            assert!((fd - g[i]).abs() < 1e-6, "token {i}: fd {fd} vs {}", g[i]);
        }
        Ok(())
    }

    #[test]
    fn value_loss_matches_reference_and_fd() -> Result<()> {
        let mut rng = StdRng::seed_from_u64(5);
        let n = 30;
        let v: Vec<f64> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
        let old: Vec<f64> = v.iter().map(|x| x + rng.random_range(-0.5..0.5)).collect();
        let ret: Vec<f64> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
        let w = vec![1.0 / n as f64; n];
        let reference = |v: &[f64], c: f64| -> f64 {
            (0..n)
                .map(|i| {
                    let a = (v[i] - ret[i]).powi(2);
                    let vc = old[i] + (v[i] - old[i]).clamp(-c, c);
                    let b = (vc - ret[i]).powi(2);
                    w[i] * 0.5 * if c > 0.0 { a.max(b) } else { a }
                })
                .sum()
        };
        for c in [0.0f32, 0.2] {
            let x = Var::from_vec(v.clone(), n, &Device::Cpu)?;
            let out = value_loss(x.as_tensor(), &aux64(&ret, &old, &w)?, c)?;
            let got = out.to_vec1::<f64>()?;
            assert!((got[0] - reference(&v, c as f64)).abs() < 1e-12);
            // Clip fraction: weight of tokens whose prediction left the
            // trust region and whose clipped loss is the larger one.
            let c64 = c as f64;
            let frac: f64 = (0..n)
                .filter(|&i| {
                    let d = v[i] - old[i];
                    let vc = old[i] + d.clamp(-c64, c64);
                    c > 0.0 && d.abs() > c64 && (vc - ret[i]).abs() > (v[i] - ret[i]).abs()
                })
                .map(|i| w[i])
                .sum();
            assert!(
                (got[1] - frac).abs() < 1e-12,
                "clip {c}: {} vs {frac}",
                got[1]
            );
            if c > 0.0 {
                assert!(frac > 0.0, "the test should clip some tokens");
            }
            let g = out
                .get(0)?
                .backward()?
                .get(x.as_tensor())
                .expect("grad")
                .to_vec1::<f64>()?;
            for i in 0..n {
                let eps = 1e-7;
                let (mut p, mut m) = (v.clone(), v.clone());
                p[i] += eps;
                m[i] -= eps;
                let fd = (reference(&p, c as f64) - reference(&m, c as f64)) / (2.0 * eps);
                assert!(
                    (fd - g[i]).abs() < 1e-6,
                    "clip {c} token {i}: fd {fd} vs {}",
                    g[i]
                );
            }
        }
        Ok(())
    }
}
