//! Fused linear + log-softmax + gather: token log-probabilities and
//! entropies straight from final hidden states, never holding the full
//! `[N, V]` logits.
//!
//! For row `n` with hidden `h_n`, LM-head `W: [V, H]` and target `y_n`,
//! `z = W h_n`:
//! - `lse_n = log sum_v exp(z_v)`
//! - `logp_n = z_{y_n} - lse_n`
//! - `H_n = lse_n - sum_v softmax(z)_v z_v` (entropy)
//!
//! Forward walks the rows in chunks of `chunk_elems / V` rows: one matmul
//! per chunk, then one pass over each row with an online (max, sum, weighted
//! sum) state. Backward recomputes the logits in **vocabulary** chunks of
//! `chunk_elems / N` columns, using the saved `lse` and `H`:
//! `dz = g_lp (1[v = y] - p) - g_ent p (z - lse + H) + g_lse p`, `p = exp(z - lse)`,
//! writes `dW[chunk] = dz^T h` directly into the output and accumulates
//! `dh += dz W[chunk]`. Peak extra memory is one chunk (default 2^25
//! elements) plus one `[N, H]` buffer, whatever N and V are.
//!
//! The CPU path is the reference (f64 accumulation, f32/f64 storage; bf16 and
//! f16 inputs are upcast to f32), except for f32 hidden rows over a bf16
//! head, or over an f32 head rounded to bf16 inside the op
//! ([`fused_logprobs_bf16`], the CPU's mixed precision, whose head gradient
//! stays f32): there the three products run through
//! the bf16 dot products of [`crate::cpu::matmul`] (hidden rows and `dz`
//! rounded to bf16, f32 sums) and the row passes in f32 lanes with a
//! polynomial `exp`, the row sums in f64. The CUDA path uses cuBLAS for the matmuls
//! and `kernels/logprob.cu` for the row passes, with `dh` summed over the
//! vocabulary chunks in f32. Known limit of the CUDA bf16/f16 path: each
//! chunk's logits leave cuBLAS in the input dtype (f32 accumulation inside,
//! one rounding at the end), so a log-probability carries an error of about
//! `|z| 2^-9` (an f32-output GEMM, `cublasGemmEx`, would remove it).

use std::borrow::Cow;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};
use multiversion::multiversion;
use rayon::prelude::*;

use crate::cpu::exp::exp_f32;
use crate::cpu::matmul::{single, single_into, to_bf16, transposed, WeightRows::Bf16};

/// Default chunk size in logits elements (128 MiB of f32).
pub const DEFAULT_CHUNK_ELEMS: usize = 1 << 25;

/// `[N, 3]` columns `(logp, entropy, lse)` for `hidden: [N, H]`,
/// `weight: [V, H]`, `targets: [N]` (u32). Differentiable in `hidden` and
/// `weight` through all three columns. Output dtype is f32 (f64 for f64
/// inputs). `hidden` and `weight` share a dtype, except f32 `hidden` over a
/// bf16 `weight` on the CPU.
pub fn fused_logprobs(
    hidden: &Tensor,
    weight: &Tensor,
    targets: &Tensor,
    chunk_elems: usize,
) -> Result<Tensor> {
    apply(hidden, weight, targets, chunk_elems, false)
}

/// [`fused_logprobs`] of f32 `hidden` over an f32 `weight` (the master LM
/// head of the CPU's mixed-precision training) through bf16 products: the
/// weight is rounded to bf16 inside the op, in both passes, and its
/// gradient comes back in f32, unrounded (see the module docs). CPU only.
pub fn fused_logprobs_bf16(
    hidden: &Tensor,
    weight: &Tensor,
    targets: &Tensor,
    chunk_elems: usize,
) -> Result<Tensor> {
    if hidden.dtype() != DType::F32 || weight.dtype() != DType::F32 || !hidden.device().is_cpu() {
        candle_core::bail!(
            "fused_logprobs_bf16: f32 hidden and weight on the CPU, got {:?} and {:?} on {:?}",
            hidden.dtype(),
            weight.dtype(),
            hidden.device().location()
        );
    }
    apply(hidden, weight, targets, chunk_elems, true)
}

fn apply(
    hidden: &Tensor,
    weight: &Tensor,
    targets: &Tensor,
    chunk_elems: usize,
    bf16: bool,
) -> Result<Tensor> {
    let (n, h) = hidden.dims2()?;
    let (v, h2) = weight.dims2()?;
    if h != h2 {
        candle_core::bail!("fused_logprobs: hidden [{n}, {h}] does not match weight [{v}, {h2}]");
    }
    if targets.dims() != [n] || targets.dtype() != DType::U32 {
        candle_core::bail!(
            "fused_logprobs: targets must be u32 [{n}], got {:?} {:?}",
            targets.dtype(),
            targets.dims()
        );
    }
    // f32 hidden states over a bf16 LM head (CPU bf16 matrices): the CPU
    // path upcasts the weight once.
    let mixed =
        hidden.dtype() == DType::F32 && weight.dtype() == DType::BF16 && hidden.device().is_cpu();
    if hidden.dtype() != weight.dtype() && !mixed {
        candle_core::bail!(
            "fused_logprobs: hidden is {:?} but weight is {:?}",
            hidden.dtype(),
            weight.dtype()
        );
    }
    if let Some(bad) = targets
        .to_vec1::<u32>()?
        .into_iter()
        .find(|&t| t as usize >= v)
    {
        candle_core::bail!("fused_logprobs: target token {bad} is outside the vocabulary ({v})");
    }
    if n == 0 {
        return Tensor::zeros((0, 3), out_dtype(hidden.dtype()), hidden.device());
    }
    hidden.contiguous()?.apply_op3(
        &weight.contiguous()?,
        &targets.contiguous()?,
        FusedLogprob {
            chunk_elems: chunk_elems.max(1),
            bf16,
        },
    )
}

fn out_dtype(dt: DType) -> DType {
    if dt == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// The forward op (see the module docs).
#[derive(Debug, Clone, Copy)]
pub struct FusedLogprob {
    pub chunk_elems: usize,
    /// An f32 weight multiplies through bf16 products
    /// ([`fused_logprobs_bf16`]).
    pub bf16: bool,
}

/// The backward op: `(hidden, weight, aux [N, 6] = (y, g_lp, g_ent, g_lse,
/// lse, H))` -> packed `[N*H + V*H]` = `dh` then `dW` (`[N*H]`, `dh` only,
/// when `need_dw` is false: a frozen LM head), in the input dtype.
#[derive(Debug, Clone, Copy)]
pub struct FusedLogprobGrad {
    pub chunk_elems: usize,
    pub need_dw: bool,
    /// As [`FusedLogprob::bf16`].
    pub bf16: bool,
}

impl FusedLogprobGrad {
    /// Elements of the packed output: `dh`, then `dW` when needed.
    fn out_len(&self, n: usize, v: usize, h: usize) -> usize {
        (n + if self.need_dw { v } else { 0 }) * h
    }
}

/// Rows per forward chunk / columns per backward chunk.
fn chunk_len(chunk_elems: usize, other: usize) -> usize {
    (chunk_elems / other.max(1)).max(1)
}

fn rhs_t(wl: &Layout, start_row: usize, rows: usize, h: usize) -> Result<Layout> {
    Layout::contiguous_with_offset((rows, h), wl.start_offset() + start_row * h).transpose(0, 1)
}

/// Row statistics `(logp, H, lse)` of one logits row, f64 accumulation.
fn row_stats<T: Copy + Into<f64>>(z: &[T], y: usize) -> [f64; 3] {
    let mut m = f64::NEG_INFINITY;
    for &x in z {
        m = m.max(x.into());
    }
    let (mut s, mut t) = (0.0f64, 0.0f64);
    for &x in z {
        let x: f64 = x.into();
        let e = (x - m).exp();
        s += e;
        t += e * x;
    }
    let lse = m + s.ln();
    [z[y].into() - lse, lse - t / s, lse]
}

/// `dz` of one logits row in place; `a = (y, g_lp, g_ent, g_lse, lse, H)`.
fn row_grad<T: Copy + Into<f64> + FromF64>(z: &mut [T], v0: usize, a: &[T]) {
    let y = a[0].into() as usize;
    let (g_lp, g_ent, g_lse, lse, h) = (
        a[1].into(),
        a[2].into(),
        a[3].into(),
        a[4].into(),
        a[5].into(),
    );
    for (j, x) in z.iter_mut().enumerate() {
        let lp = (*x).into() - lse;
        let p = lp.exp();
        let onehot = if v0 + j == y { 1.0 } else { 0.0 };
        *x = T::from_f64(g_lp * (onehot - p) - g_ent * p * (lp + h) + g_lse * p);
    }
}

/// [`row_stats`] of an f32 row (the bf16 head's logits) with the
/// polynomial `exp` in f32 lanes ([`exp_f32`], relative error below
/// 3e-7), summed per 256 values in f32, then in f64: the libm f64 `exp`
/// of each of a row's `V` logits cost more than the row's products.
#[multiversion(targets("x86_64+avx512f+avx512vl+fma", "x86_64+avx2+fma"))]
fn row_stats_f32(z: &[f32], y: usize) -> [f64; 3] {
    const L: usize = 16;
    let m = z.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let (mut s, mut t) = (0f64, 0f64);
    for block in z.chunks(256) {
        let (mut sl, mut tl) = ([0f32; L], [0f32; L]);
        let mut lanes = block.chunks_exact(L);
        for c in &mut lanes {
            for j in 0..L {
                let e = exp_f32(c[j] - m);
                sl[j] += e;
                tl[j] += e * c[j];
            }
        }
        for &x in lanes.remainder() {
            let e = exp_f32(x - m);
            sl[0] += e;
            tl[0] += e * x;
        }
        s += sl.iter().map(|&x| x as f64).sum::<f64>();
        t += tl.iter().map(|&x| x as f64).sum::<f64>();
    }
    let lse = m as f64 + s.ln();
    [z[y] as f64 - lse, lse - t / s, lse]
}

/// [`row_grad`] of an f32 row in f32 arithmetic with the polynomial `exp`
/// (the bf16 head's backward; its products round `dz` to bf16 anyway).
#[multiversion(targets("x86_64+avx512f+avx512vl+fma", "x86_64+avx2+fma"))]
fn row_grad_f32(z: &mut [f32], v0: usize, a: &[f32]) {
    let y = a[0] as usize;
    let [g_lp, g_ent, g_lse, lse, h] = [a[1], a[2], a[3], a[4], a[5]];
    for x in z.iter_mut() {
        let lp = *x - lse;
        let p = exp_f32(lp);
        *x = -g_lp * p - g_ent * p * (lp + h) + g_lse * p;
    }
    if let Some(x) = y.checked_sub(v0).and_then(|j| z.get_mut(j)) {
        *x += g_lp;
    }
}

trait FromF64 {
    fn from_f64(x: f64) -> Self;
}
impl FromF64 for f32 {
    fn from_f64(x: f64) -> Self {
        x as f32
    }
}
impl FromF64 for f64 {
    fn from_f64(x: f64) -> Self {
        x
    }
}

/// The f32 hidden rows and bf16 LM head of the mixed CPU cases, as slices
/// (`[N, H]`, `[V, H]`; contiguous, as [`fused_logprobs`] passes them): a
/// bf16 head as it is, an f32 one rounded when `bf16` asks for it.
fn bf16_operands<'a>(
    hs: &'a CpuStorage,
    hl: &Layout,
    ws: &'a CpuStorage,
    wl: &Layout,
    (n, v, h): (usize, usize, usize),
    bf16: bool,
) -> Option<(&'a [f32], Cow<'a, [half::bf16]>)> {
    let wr = wl.start_offset()..wl.start_offset() + v * h;
    let w = match ws {
        CpuStorage::BF16(w) => Cow::Borrowed(&w[wr]),
        CpuStorage::F32(w) if bf16 => Cow::Owned(to_bf16(&w[wr])),
        _ => return None,
    };
    match hs {
        CpuStorage::F32(hid) => Some((&hid[hl.start_offset()..hl.start_offset() + n * h], w)),
        _ => None,
    }
}

/// The backward over a bf16 head through bf16 dot products (f32 sums), in
/// vocabulary chunks of `cols` columns: logits `z = bf16(h) W_c^T` as the
/// forward computes them, `dz` in f32 ([`row_grad_f32`]), `dW_c = bf16(dz)^T
/// bf16(h)` and `dh += bf16(dz) W_c`, each product in the `x w^T` form
/// with its summed dimension contiguous (`dz`, `h` and `W_c` transposed
/// for it). Returns the packed `[dh | dW]` in f32.
fn grad_bf16(
    hid: &[f32],
    w: &[half::bf16],
    aux: &[f32],
    (n, v, h): (usize, usize, usize),
    cols: usize,
    need_dw: bool,
) -> Vec<f32> {
    let mut out = vec![0f32; (n + if need_dw { v } else { 0 }) * h];
    let (dh, dw) = out.split_at_mut(n * h);
    let hid_t = need_dw.then(|| transposed(hid, n, h, half::bf16::from_f32));
    let mut v0 = 0;
    while v0 < v {
        let vc = cols.min(v - v0);
        let wc = &w[v0 * h..(v0 + vc) * h];
        let mut z = single(hid, Bf16(wc), n, h, vc);
        z.par_chunks_mut(vc)
            .zip(aux.par_chunks(6))
            .for_each(|(z, a)| row_grad_f32(z, v0, a));
        if let Some(ht) = &hid_t {
            let zt = transposed(&z, n, vc, |x| x);
            single_into(&zt, Bf16(ht), vc, n, h, &mut dw[v0 * h..(v0 + vc) * h]);
        }
        let part = single(&z, Bf16(&transposed(wc, vc, h, |x| x)), n, vc, h);
        dh.par_iter_mut().zip(&part).for_each(|(a, b)| *a += b);
        v0 += vc;
    }
    out
}

/// CPU inputs as f32/f64 storages (bf16/f16 upcast to f32), contiguous.
fn cpu_float(s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Layout)> {
    match s.dtype() {
        DType::F32 | DType::F64 => Ok((s.try_clone(l)?, l.clone())),
        _ => {
            let c = s.to_dtype(l, DType::F32)?;
            Ok((c, Layout::contiguous(l.shape())))
        }
    }
}

impl CustomOp3 for FusedLogprob {
    fn name(&self) -> &'static str {
        "arbor-fused-logprob"
    }

    fn cpu_fwd(
        &self,
        hs: &CpuStorage,
        hl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
        ts: &CpuStorage,
        tl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (n, h) = hl.shape().dims2()?;
        let v = wl.shape().dims()[0];
        let targets = match ts {
            CpuStorage::U32(t) => &t[tl.start_offset()..tl.start_offset() + n],
            _ => candle_core::bail!("fused_logprobs: targets must be u32"),
        };
        let rows = chunk_len(self.chunk_elems, v);
        if let Some((hid, w)) = bf16_operands(hs, hl, ws, wl, (n, v, h), self.bf16) {
            let mut out = vec![0f32; 3 * n];
            for (r0, o) in (0..n).step_by(rows).zip(out.chunks_mut(3 * rows)) {
                let c = rows.min(n - r0);
                let z = single(&hid[r0 * h..(r0 + c) * h], Bf16(&w), c, h, v);
                o.par_chunks_mut(3)
                    .zip(z.par_chunks(v))
                    .zip(targets[r0..r0 + c].par_iter())
                    .for_each(|((o, z), &y)| {
                        let st = row_stats_f32(z, y as usize);
                        o.iter_mut().zip(st).for_each(|(o, x)| *o = x as f32);
                    });
            }
            return Ok((CpuStorage::F32(out), Shape::from((n, 3))));
        }
        let (hs, hl) = cpu_float(hs, hl)?;
        let (ws, wl) = cpu_float(ws, wl)?;
        let mut out = vec![[0f64; 3]; n];
        let mut r0 = 0;
        while r0 < n {
            let c = rows.min(n - r0);
            let lhs = Layout::contiguous_with_offset((c, h), hl.start_offset() + r0 * h);
            let logits = hs.matmul(&ws, (1, c, v, h), &lhs, &rhs_t(&wl, 0, v, h)?)?;
            let dst = &mut out[r0..r0 + c];
            let tg = &targets[r0..r0 + c];
            match &logits {
                CpuStorage::F32(z) => dst
                    .par_iter_mut()
                    .zip(z.par_chunks(v))
                    .zip(tg.par_iter())
                    .for_each(|((o, z), &y)| *o = row_stats(z, y as usize)),
                CpuStorage::F64(z) => dst
                    .par_iter_mut()
                    .zip(z.par_chunks(v))
                    .zip(tg.par_iter())
                    .for_each(|((o, z), &y)| *o = row_stats(z, y as usize)),
                _ => unreachable!("cpu_float gives f32/f64"),
            }
            r0 += c;
        }
        let flat = out.into_iter().flatten();
        let storage = if hs.dtype() == DType::F64 {
            CpuStorage::F64(flat.collect())
        } else {
            CpuStorage::F32(flat.map(|x| x as f32).collect())
        };
        Ok((storage, Shape::from((n, 3))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        hs: &candle_core::CudaStorage,
        hl: &Layout,
        ws: &candle_core::CudaStorage,
        wl: &Layout,
        ts: &candle_core::CudaStorage,
        tl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda::{self, PushKernelArg, WrapErr};
        use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
        use candle_core::cuda_backend::CudaStorageSlice as S;
        let dev = hs.device.clone();
        let (n, h) = hl.shape().dims2()?;
        let v = wl.shape().dims()[0];
        let suf = cuda::suffix(hs.dtype())?;
        let f = cuda::Kernel::get(&dev, "logprob", &format!("logprob_rows_{suf}"))?;
        let targets = cuda::view::<u32>(ts, tl)?;
        let mut out = cuda::alloc_out::<f32>(&dev, n * 3)?;
        let rows = chunk_len(self.chunk_elems, v);
        let (vocab, mut r0) = (v as i32, 0usize);
        while r0 < n {
            let c = rows.min(n - r0);
            let lhs = Layout::contiguous_with_offset((c, h), hl.start_offset() + r0 * h);
            let logits = hs.matmul(ws, (1, c, v, h), &lhs, &rhs_t(wl, 0, v, h)?)?;
            let tg = targets.slice(r0..r0 + c);
            let mut o = out.slice_mut(3 * r0..3 * (r0 + c));
            let cfg = LaunchConfig {
                grid_dim: (c as u32, 1, 1),
                block_dim: (512, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = f.builder();
            match &logits.slice {
                S::F32(z) => b.arg(z),
                S::BF16(z) => b.arg(z),
                S::F16(z) => b.arg(z),
                _ => candle_core::bail!("fused_logprobs: unsupported CUDA dtype"),
            };
            b.arg(&tg).arg(&mut o).arg(&vocab);
            // SAFETY: argument types and counts match `logprob_rows_*` in
            // kernels/logprob.cu; every pointer covers the ranges it reads.
            #[allow(unsafe_code)]
            unsafe { b.launch(cfg) }.w()?;
            r0 += c;
        }
        Ok((cuda::wrap(out, &dev), Shape::from((n, 3))))
    }

    fn bwd(
        &self,
        hidden: &Tensor,
        weight: &Tensor,
        targets: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (n, h) = hidden.dims2()?;
        let v = weight.dim(0)?;
        let dt = res.dtype();
        let aux = Tensor::cat(
            &[
                &targets.to_dtype(dt)?.unsqueeze(1)?,
                &grad.to_dtype(dt)?,
                &res.narrow(1, 2, 1)?,
                &res.narrow(1, 1, 1)?,
            ],
            1,
        )?
        .detach()
        .contiguous()?;
        // A frozen head (LoRA, or a detached weight) needs no dW: skip its
        // matmuls and its [V, H] buffer.
        let need_dw = weight.track_op();
        let packed = hidden.detach().apply_op3_no_bwd(
            &weight.detach(),
            &aux,
            &FusedLogprobGrad {
                chunk_elems: self.chunk_elems,
                need_dw,
                bf16: self.bf16,
            },
        )?;
        let dh = packed.narrow(0, 0, n * h)?.reshape((n, h))?;
        let dw = if need_dw {
            Some(
                packed
                    .narrow(0, n * h, v * h)?
                    .reshape((v, h))?
                    .to_dtype(weight.dtype())?,
            )
        } else {
            None
        };
        Ok((Some(dh), dw, None))
    }
}

impl CustomOp3 for FusedLogprobGrad {
    fn name(&self) -> &'static str {
        "arbor-fused-logprob-grad"
    }

    fn cpu_fwd(
        &self,
        hs: &CpuStorage,
        hl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
        auxs: &CpuStorage,
        auxl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let in_dtype = hs.dtype();
        let (n, h) = hl.shape().dims2()?;
        let v = wl.shape().dims()[0];
        let cols = chunk_len(self.chunk_elems, n);
        let out_len = self.out_len(n, v, h);
        if let Some((hid, w)) = bf16_operands(hs, hl, ws, wl, (n, v, h), self.bf16) {
            let CpuStorage::F32(aux) = auxs.to_dtype(auxl, DType::F32)? else {
                unreachable!("converted to f32")
            };
            let out = grad_bf16(hid, &w, &aux, (n, v, h), cols, self.need_dw);
            return Ok((CpuStorage::F32(out), Shape::from(out_len)));
        }
        let (hs, hl) = cpu_float(hs, hl)?;
        let (ws, wl) = cpu_float(ws, wl)?;
        let wdt = hs.dtype();
        let (auxs, auxl) = (auxs.to_dtype(auxl, wdt)?, Layout::contiguous((n, 6)));
        let total = out_len;
        let mut out = match wdt {
            DType::F64 => CpuStorage::F64(vec![0.0; total]),
            _ => CpuStorage::F32(vec![0.0; total]),
        };
        let mut dh: Option<CpuStorage> = None;
        let mut v0 = 0;
        while v0 < v {
            let vc = cols.min(v - v0);
            let mut z = hs.matmul(&ws, (1, n, vc, h), &hl, &rhs_t(&wl, v0, vc, h)?)?;
            match (&mut z, &auxs) {
                (CpuStorage::F32(z), CpuStorage::F32(a)) => z
                    .par_chunks_mut(vc)
                    .zip(a[auxl.start_offset()..].par_chunks(6))
                    .for_each(|(z, a)| row_grad(z, v0, a)),
                (CpuStorage::F64(z), CpuStorage::F64(a)) => z
                    .par_chunks_mut(vc)
                    .zip(a[auxl.start_offset()..].par_chunks(6))
                    .for_each(|(z, a)| row_grad(z, v0, a)),
                _ => unreachable!("cpu_float gives f32/f64"),
            }
            let zl = Layout::contiguous((n, vc));
            if self.need_dw {
                // dW[v0..v0+vc] = dz^T h
                let dw = z.matmul(&hs, (1, vc, h, n), &zl.transpose(0, 1)?, &hl)?;
                dw.copy_strided_src(&mut out, (n + v0) * h, &Layout::contiguous((vc, h)))?;
            }
            // dh += dz W[v0..v0+vc]
            let wc = Layout::contiguous_with_offset((vc, h), wl.start_offset() + v0 * h);
            let part = z.matmul(&ws, (1, n, h, vc), &zl, &wc)?;
            dh = Some(match dh {
                None => part,
                Some(acc) => {
                    let l = Layout::contiguous((n, h));
                    acc.binary_impl::<candle_core::op::Add>(&part, &l, &l)?
                }
            });
            v0 += vc;
        }
        if let Some(dh) = dh {
            dh.copy_strided_src(&mut out, 0, &Layout::contiguous((n, h)))?;
        }
        let out = if in_dtype == wdt {
            out
        } else {
            out.to_dtype(&Layout::contiguous(total), in_dtype)?
        };
        Ok((out, Shape::from(total)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        hs: &candle_core::CudaStorage,
        hl: &Layout,
        ws: &candle_core::CudaStorage,
        wl: &Layout,
        auxs: &candle_core::CudaStorage,
        auxl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda::{self, PushKernelArg, WrapErr};
        use candle_core::cuda_backend::CudaStorageSlice as S;
        let dev = hs.device.clone();
        let (n, h) = hl.shape().dims2()?;
        let v = wl.shape().dims()[0];
        let dt = hs.dtype();
        let suf = cuda::suffix(dt)?;
        let grad_f = cuda::Kernel::get(&dev, "logprob", &format!("logprob_grad_{suf}"))?;
        let add_f = cuda::Kernel::get(&dev, "logprob", &format!("add_to_f32_{suf}"))?;
        let aux = cuda::view::<f32>(auxs, auxl)?;
        let total = self.out_len(n, v, h);
        let mut out = match dt {
            DType::F32 => cuda::wrap(cuda::alloc_out::<f32>(&dev, total)?, &dev),
            DType::BF16 => cuda::wrap(cuda::alloc_out::<::half::bf16>(&dev, total)?, &dev),
            _ => cuda::wrap(cuda::alloc_out::<::half::f16>(&dev, total)?, &dev),
        };
        let cols = chunk_len(self.chunk_elems, n);
        // dh summed over vocabulary chunks in f32, rounded once.
        let mut dh = dev.alloc_zeros::<f32>(n * h)?;
        let mut v0 = 0;
        while v0 < v {
            let vc = cols.min(v - v0);
            let mut z = hs.matmul(ws, (1, n, vc, h), hl, &rhs_t(wl, v0, vc, h)?)?;
            {
                let (rows, vci, v0i) = (n as i32, vc as i32, v0 as i32);
                let mut b = grad_f.builder();
                match &mut z.slice {
                    S::F32(s) => b.arg(s),
                    S::BF16(s) => b.arg(s),
                    S::F16(s) => b.arg(s),
                    _ => candle_core::bail!("fused_logprobs: unsupported CUDA dtype"),
                };
                b.arg(&aux).arg(&rows).arg(&vci).arg(&v0i);
                // SAFETY: matches `logprob_grad_*` in kernels/logprob.cu; z
                // holds n*vc elements and aux n*6.
                #[allow(unsafe_code)]
                unsafe { b.launch(cuda::grid1d(n * vc, 256)) }.w()?;
            }
            let zl = Layout::contiguous((n, vc));
            if self.need_dw {
                let dw = z.matmul(hs, (1, vc, h, n), &zl.transpose(0, 1)?, hl)?;
                dw.copy_strided_src(&mut out, (n + v0) * h, &Layout::contiguous((vc, h)))?;
            }
            let wc = Layout::contiguous_with_offset((vc, h), wl.start_offset() + v0 * h);
            let part = z.matmul(ws, (1, n, h, vc), &zl, &wc)?;
            {
                let len = n * h;
                let mut b = add_f.builder();
                b.arg(&mut dh);
                match &part.slice {
                    S::F32(p) => b.arg(p),
                    S::BF16(p) => b.arg(p),
                    S::F16(p) => b.arg(p),
                    _ => candle_core::bail!("fused_logprobs: unsupported CUDA dtype"),
                };
                b.arg(&len);
                // SAFETY: matches `add_to_f32_*`; both hold n*h elements.
                #[allow(unsafe_code)]
                unsafe { b.launch(cuda::grid1d(len, 256)) }.w()?;
            }
            v0 += vc;
        }
        let l = Layout::contiguous((n, h));
        let dh = cuda::wrap(dh, &dev);
        let dh = if dt == DType::F32 {
            dh
        } else {
            dh.to_dtype(&l, dt)?
        };
        dh.copy_strided_src(&mut out, 0, &l)?;
        Ok((out, Shape::from(total)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};
    use rand::{rngs::StdRng, Rng, SeedableRng};

    /// Float64 brute force: full logits, log-softmax, gather, entropy.
    fn brute(hid: &[f64], w: &[f64], y: &[u32], n: usize, v: usize, h: usize) -> Vec<[f64; 3]> {
        (0..n)
            .map(|r| {
                let z: Vec<f64> = (0..v)
                    .map(|j| (0..h).map(|k| hid[r * h + k] * w[j * h + k]).sum())
                    .collect();
                let m = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let lse = m + z.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
                let ent = -z.iter().map(|x| (x - lse).exp() * (x - lse)).sum::<f64>();
                [z[y[r] as usize] - lse, ent, lse]
            })
            .collect()
    }

    fn rand_vec(rng: &mut StdRng, n: usize, scale: f64) -> Vec<f64> {
        (0..n).map(|_| rng.random_range(-scale..scale)).collect()
    }

    #[test]
    fn forward_matches_f64_brute_force_for_any_chunking() -> Result<()> {
        let mut rng = StdRng::seed_from_u64(7);
        let (n, v, h) = (13, 37, 6);
        let hid = rand_vec(&mut rng, n * h, 2.0);
        let w = rand_vec(&mut rng, v * h, 2.0);
        let y: Vec<u32> = (0..n).map(|_| rng.random_range(0..v as u32)).collect();
        let want = brute(&hid, &w, &y, n, v, h);
        let dev = Device::Cpu;
        for chunk in [1, 40, 37 * 5, 1 << 20] {
            for dt in [DType::F64, DType::F32] {
                let ht = Tensor::from_vec(hid.clone(), (n, h), &dev)?.to_dtype(dt)?;
                let wt = Tensor::from_vec(w.clone(), (v, h), &dev)?.to_dtype(dt)?;
                let yt = Tensor::from_vec(y.clone(), n, &dev)?;
                let got = fused_logprobs(&ht, &wt, &yt, chunk)?
                    .to_dtype(DType::F64)?
                    .to_vec2::<f64>()?;
                let tol = if dt == DType::F64 { 1e-10 } else { 1e-4 };
                for (g, w) in got.iter().zip(&want) {
                    for c in 0..3 {
                        assert!(
                            (g[c] - w[c]).abs() < tol,
                            "{dt:?} chunk {chunk}: {g:?} vs {w:?}"
                        );
                    }
                }
            }
        }
        Ok(())
    }

    /// Gradients of `sum(a*logp + b*H + c*lse)` against central finite
    /// differences in f64, with chunking that splits rows and vocabulary.
    #[test]
    fn backward_matches_finite_differences() -> Result<()> {
        let mut rng = StdRng::seed_from_u64(11);
        let (n, v, h) = (5, 9, 4);
        let hid = rand_vec(&mut rng, n * h, 1.0);
        let w = rand_vec(&mut rng, v * h, 1.0);
        let y: Vec<u32> = (0..n).map(|_| rng.random_range(0..v as u32)).collect();
        let coef = [0.7, -0.3, 0.2];
        let dev = Device::Cpu;
        let yt = Tensor::from_vec(y.clone(), n, &dev)?;
        let loss_f64 = |hid: &[f64], w: &[f64]| -> f64 {
            brute(hid, w, &y, n, v, h)
                .iter()
                .map(|r| coef[0] * r[0] + coef[1] * r[1] + coef[2] * r[2])
                .sum()
        };
        for chunk in [4, 18, 1 << 20] {
            let hv = Var::from_vec(hid.clone(), (n, h), &dev)?;
            let wv = Var::from_vec(w.clone(), (v, h), &dev)?;
            let out = fused_logprobs(hv.as_tensor(), wv.as_tensor(), &yt, chunk)?;
            let c = Tensor::new(&coef, &dev)?;
            let loss = out.broadcast_mul(&c)?.sum_all()?;
            let grads = loss.backward()?;
            let gh = grads
                .get(hv.as_tensor())
                .expect("dh")
                .flatten_all()?
                .to_vec1::<f64>()?;
            let gw = grads
                .get(wv.as_tensor())
                .expect("dw")
                .flatten_all()?
                .to_vec1::<f64>()?;
            let eps = 1e-6;
            for (which, base, got) in [(0, &hid, &gh), (1, &w, &gw)] {
                for i in 0..base.len() {
                    let (mut p, mut m) = (base.clone(), base.clone());
                    p[i] += eps;
                    m[i] -= eps;
                    let fd = if which == 0 {
                        (loss_f64(&p, &w) - loss_f64(&m, &w)) / (2.0 * eps)
                    } else {
                        (loss_f64(&hid, &p) - loss_f64(&hid, &m)) / (2.0 * eps)
                    };
                    assert!(
                        (fd - got[i]).abs() < 1e-6 * (1.0 + fd.abs()),
                        "chunk {chunk} {} [{i}]: fd {fd} vs {}",
                        ["hidden", "weight"][which],
                        got[i]
                    );
                }
            }
        }
        Ok(())
    }

    /// f32 hidden rows over a bf16 head (the CPU's mixed precision): the
    /// forward is the f64 brute force of the bf16-rounded operands (f32
    /// sums); the backward's `dh` and `dW` are the analytic gradients of
    /// the rounded operands, up to `dz`'s rounding to bf16 in the products
    /// (relative 2^-9 per term), for chunkings that split the vocabulary;
    /// the same over an f32 head rounded inside the op.
    #[test]
    fn bf16_head_products_match_the_rounded_operands() -> Result<()> {
        let mut rng = StdRng::seed_from_u64(5);
        let (n, v, h) = (19, 53, 40);
        let round = |x: &[f64]| -> Vec<f64> {
            x.iter()
                .map(|&a| half::bf16::from_f64(a).to_f64())
                .collect()
        };
        let hid = rand_vec(&mut rng, n * h, 1.0);
        let w = round(&rand_vec(&mut rng, v * h, 1.0));
        let y: Vec<u32> = (0..n).map(|_| rng.random_range(0..v as u32)).collect();
        let want = brute(&round(&hid), &w, &y, n, v, h);
        // d/dz of sum(c0 logp + c1 H + c2 lse) per row, then dh = dz W and
        // dW = dz^T bf16(h), in f64.
        let coef = [0.7, -0.3, 0.2];
        let hr = round(&hid);
        let (mut dh_want, mut dw_want) = (vec![0f64; n * h], vec![0f64; v * h]);
        for r in 0..n {
            let z: Vec<f64> = (0..v)
                .map(|j| (0..h).map(|k| hr[r * h + k] * w[j * h + k]).sum())
                .collect();
            let [_, ent, lse] = want[r];
            for j in 0..v {
                let p = (z[j] - lse).exp();
                let onehot = if j == y[r] as usize { 1.0 } else { 0.0 };
                let dz = coef[0] * (onehot - p) - coef[1] * p * (z[j] - lse + ent) + coef[2] * p;
                for k in 0..h {
                    dh_want[r * h + k] += dz * w[j * h + k];
                    dw_want[j * h + k] += dz * hr[r * h + k];
                }
            }
        }
        let dev = Device::Cpu;
        let yt = Tensor::from_vec(y.clone(), n, &dev)?;
        // A bf16 head (`fused_logprobs`), and an f32 master head rounded
        // inside the op (`fused_logprobs_bf16`), whose gradient stays f32.
        for (chunk, master) in [
            (n * 7, false),
            (n * 53, false),
            (1 << 20, false),
            (n * 7, true),
        ] {
            let hv = Var::from_tensor(
                &Tensor::from_vec(hid.clone(), (n, h), &dev)?.to_dtype(DType::F32)?,
            )?;
            let wv = Var::from_tensor(
                &Tensor::from_vec(w.clone(), (v, h), &dev)?.to_dtype(if master {
                    DType::F32
                } else {
                    DType::BF16
                })?,
            )?;
            let out = if master {
                fused_logprobs_bf16(hv.as_tensor(), wv.as_tensor(), &yt, chunk)?
            } else {
                fused_logprobs(hv.as_tensor(), wv.as_tensor(), &yt, chunk)?
            };
            let got = out.to_dtype(DType::F64)?.to_vec2::<f64>()?;
            for (g, w) in got.iter().zip(&want) {
                for c in 0..3 {
                    assert!((g[c] - w[c]).abs() < 1e-4, "chunk {chunk}: {g:?} vs {w:?}");
                }
            }
            let c = Tensor::new(&[0.7f32, -0.3, 0.2], &dev)?;
            let grads = out.broadcast_mul(&c)?.sum_all()?.backward()?;
            let dh = grads.get(hv.as_tensor()).expect("dh");
            let dw = grads.get(wv.as_tensor()).expect("dw");
            let wdt = if master { DType::F32 } else { DType::BF16 };
            assert_eq!((dh.dtype(), dw.dtype()), (DType::F32, wdt));
            for (got, want) in [(dh, &dh_want), (dw, &dw_want)] {
                let got = got.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
                let scale = want.iter().fold(0f64, |m, x| m.max(x.abs()));
                for (g, w) in got.iter().zip(want.iter()) {
                    assert!(
                        (g - w).abs() < 1e-2 * scale,
                        "chunk {chunk}: {g} vs {w} (scale {scale})"
                    );
                }
            }
        }
        Ok(())
    }

    /// A frozen (untracked) weight gets no gradient slot and `dh` is
    /// unchanged: the backward skips the `dW` matmuls.
    #[test]
    fn frozen_weight_gets_no_gradient() -> Result<()> {
        let mut rng = StdRng::seed_from_u64(3);
        let (n, v, h) = (4, 11, 3);
        let dev = Device::Cpu;
        let hid = Tensor::from_vec(rand_vec(&mut rng, n * h, 1.0), (n, h), &dev)?;
        let w = Tensor::from_vec(rand_vec(&mut rng, v * h, 1.0), (v, h), &dev)?;
        let y = Tensor::new(&[0u32, 3, 10, 5], &dev)?;
        let grads = |train_w: bool| -> Result<(Tensor, Option<Tensor>)> {
            let hv = Var::from_tensor(&hid)?;
            let wv = Var::from_tensor(&w)?;
            let wt = if train_w {
                wv.as_tensor().clone()
            } else {
                w.clone()
            };
            let g = fused_logprobs(hv.as_tensor(), &wt, &y, 20)?
                .sum_all()?
                .backward()?;
            Ok((
                g.get(hv.as_tensor()).expect("dh").clone(),
                g.get(&wt).cloned(),
            ))
        };
        let (dh_full, dw) = grads(true)?;
        let (dh_frozen, none) = grads(false)?;
        assert!(dw.is_some() && none.is_none());
        let d = (dh_full - dh_frozen)?
            .abs()?
            .max_all()?
            .to_scalar::<f64>()?;
        assert_eq!(d, 0.0);
        Ok(())
    }

    #[test]
    fn bad_inputs_are_errors() -> Result<()> {
        let dev = Device::Cpu;
        let h = Tensor::zeros((2, 3), DType::F32, &dev)?;
        let w = Tensor::zeros((4, 3), DType::F32, &dev)?;
        let y = Tensor::new(&[0u32, 4], &dev)?;
        let e = fused_logprobs(&h, &w, &y, 8).unwrap_err().to_string();
        assert!(e.contains("outside the vocabulary"), "{e}");
        let w2 = Tensor::zeros((4, 5), DType::F32, &dev)?;
        let e = fused_logprobs(&h, &w2, &Tensor::new(&[0u32, 1], &dev)?, 8)
            .unwrap_err()
            .to_string();
        assert!(e.contains("does not match"), "{e}");
        let e = fused_logprobs_bf16(
            &h,
            &w.to_dtype(DType::BF16)?,
            &Tensor::new(&[0u32, 1], &dev)?,
            8,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("f32 hidden and weight"), "{e}");
        Ok(())
    }
}
