//! Fused training ops with hand-written backward: RMSNorm, RoPE, SwiGLU and
//! causal attention over a packed batch.
//!
//! Composed from candle ops, these keep every intermediate for the backward
//! (RMSNorm five tensors, RoPE eight, attention the `[T, T]` scores and
//! probabilities per sequence). Each op here keeps its inputs (attention:
//! also its output and one log-sum-exp per query row) and recomputes the
//! rest in its backward.
//!
//! - [`rms_norm`]: `y = w * x r`, `r = 1 / sqrt(mean(x^2) + eps)` over the
//!   last dim (f32: the generation forward's kernel, bit for bit). Backward
//!   with `g = dy * w`: `dx = r g - x r^3 mean(g x)`, `dw = sum_rows dy x r`.
//! - [`rope`]: `x = [x1 | x2]` (halves of the head dim) to
//!   `[x1 c - x2 s | x2 c + x1 s]`, per token `(c, s)` rows; the backward is
//!   the inverse rotation (`s -> -s`).
//! - [`swiglu`]: `silu(g) * u`; with `s = sigmoid(g)`:
//!   `dg = dy u s (1 + g (1 - s))`, `du = dy g s`.
//! - [`packed_causal_attention`]: `q: [N, nh, D]`, `k, v: [N, nkv, D]` of
//!   sequences packed back to back (lengths `seq_lens`, no padding), each
//!   query attending causally within its own sequence, grouped-query heads
//!   (`h -> h / (nh / nkv)`), scale `c = 1 / sqrt(D)`. One task per
//!   (sequence, query head); the forward scores a block of 4 query rows at a
//!   time (`[4, L]` scores, never `[L, L]`) and saves
//!   `lse_i = log sum_j exp(s_ij)`. The backward is FlashAttention-2's,
//!   recomputing the scores block by block: `P_ij = exp(s_ij - lse_i)`,
//!   `delta_i = dO_i . O_i`, `dS_ij = P_ij (dO_i . v_j - delta_i)`,
//!   `dq_i = c sum_j dS_ij k_j`, `dk_j = c sum_i dS_ij q_i`,
//!   `dv_j = sum_i P_ij dO_i`. No `[T, T]` tensor exists in either pass.
//!
//! CPU, f32 (f32 accumulation; `exp` by a polynomial with relative error
//! below 3e-7) or f64 (the finite-difference-tested reference): these
//! kernels, multiversioned for AVX-512 / AVX2, parallel over rows or
//! (sequence, head) tasks (rayon), with every sum in a fixed order: the same
//! bits on every run and at any thread count. CUDA (`cuda` feature), f32
//! or bf16 storage with f32 arithmetic: RMSNorm, RoPE and SwiGLU run
//! `kernels/fused.cu`, forward and backward (RMSNorm's weight gradient
//! summed per block, then over the blocks in a fixed order); an RMSNorm
//! weight of another dtype (an f32 master weight under bf16 compute) is
//! cast to the activations' first. Attention on CUDA and in bf16 runs
//! candle ops one sequence at a time with a hand-written backward that
//! recomputes each sequence's scores (`recomputed_attention`); the other
//! ops on other devices and dtypes compose candle ops, which carry
//! candle's own backward.

use std::sync::Mutex;

use candle_core::{
    CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor, WithDType, D,
};
use multiversion::multiversion;
use num_traits::Float;
use rayon::prelude::*;

/// Element types of the CPU kernels.
trait Elem:
    Float + WithDType + Send + Sync + std::iter::Sum + std::ops::AddAssign + std::ops::MulAssign
{
    /// `exp(x)`: for f32 a polynomial that vectorises
    /// ([`crate::cpu::exp::exp_f32`]); f64
    /// (the reference) the library's.
    fn fast_exp(self) -> Self;
}

impl Elem for f32 {
    #[inline(always)]
    fn fast_exp(self) -> f32 {
        crate::cpu::exp::exp_f32(self)
    }
}

impl Elem for f64 {
    #[inline(always)]
    fn fast_exp(self) -> f64 {
        self.exp()
    }
}

/// `max_i x_i` with sixteen running maxima (vectorises; exact).
#[inline(always)]
fn max_lanes<T: Elem>(x: &[T]) -> T {
    let mut acc = [T::neg_infinity(); 16];
    let c = x.chunks_exact(16);
    let rest = c.remainder();
    for x in c {
        for l in 0..16 {
            acc[l] = if x[l] > acc[l] { x[l] } else { acc[l] };
        }
    }
    let mut m = T::neg_infinity();
    for &v in acc.iter().chain(rest) {
        m = if v > m { v } else { m };
    }
    m
}

/// `sum_i x_i` with sixteen partial sums (vectorises; fixed order).
#[inline(always)]
fn sum_lanes<T: Elem>(x: &[T]) -> T {
    let mut acc = [T::zero(); 16];
    let c = x.chunks_exact(16);
    let rest = c.remainder();
    for x in c {
        for l in 0..16 {
            acc[l] += x[l];
        }
    }
    acc.iter().chain(rest).fold(T::zero(), |a, &b| a + b)
}

/// Reductions of the composed paths: f64 stays f64, the rest is f32.
fn accum_dtype(dt: DType) -> DType {
    if dt == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

fn fused_here(x: &Tensor) -> bool {
    x.device().is_cpu() && matches!(x.dtype(), DType::F32 | DType::F64)
}

/// Widest RMSNorm row the CUDA backward takes (its block's weight-gradient
/// share sits in shared memory, 4 bytes a column).
const CUDA_RMS_MAX_D: usize = 8192;

/// Whether RMSNorm, RoPE and SwiGLU run `kernels/fused.cu` for `x`: a CUDA
/// tensor of f32 or bf16 with elements, in a build with the `cuda` feature.
fn cuda_kernels_here(x: &Tensor) -> bool {
    cfg!(feature = "cuda")
        && x.device().is_cuda()
        && matches!(x.dtype(), DType::F32 | DType::BF16)
        && x.elem_count() > 0
}

/// Whether RMSNorm, RoPE and SwiGLU run their own kernels for `x`: the
/// CPU's or CUDA's.
fn kernels_here(x: &Tensor) -> bool {
    fused_here(x) || cuda_kernels_here(x)
}

/// `$go::<T>(args)` for a CUDA storage's dtype: `T` is `f32` or
/// `half::bf16`.
#[cfg(feature = "cuda")]
macro_rules! by_dtype {
    ($s:expr, $($go:ident)::+ ($($a:expr),*)) => {{
        use candle_core::backend::BackendStorage;
        match $s.dtype() {
            DType::F32 => $($go)::+::<f32>($($a),*),
            DType::BF16 => $($go)::+::<::half::bf16>($($a),*),
            other => candle_core::bail!("arbor fused CUDA kernels take f32 or bf16, not {other:?}"),
        }
    }};
}

/// `$body` for an f32 or f64 CPU storage `$s`, wrapped in a storage of
/// that dtype (the body's `slice` calls take their element type from the
/// arm); any other dtype is an error naming `$op`.
macro_rules! cpu_by_dtype {
    ($s:expr, $op:literal, $body:expr) => {
        match $s {
            CpuStorage::F32(_) => CpuStorage::F32($body),
            CpuStorage::F64(_) => CpuStorage::F64($body),
            _ => candle_core::bail!(concat!($op, ": f32 or f64 expected")),
        }
    };
}

/// The contiguous elements of a CPU tensor of dtype `T`.
fn slice<'a, T: Elem>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [T]> {
    let all = s.as_slice::<T>()?;
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&all[a..b]),
        None => candle_core::bail!("fused op: input is not contiguous"),
    }
}

/// Run `f` on the contiguous elements of a CPU tensor (made contiguous first).
fn with1<T: Elem, R>(a: &Tensor, f: impl FnOnce(&[T]) -> Result<R>) -> Result<R> {
    let a = a.contiguous()?;
    let (sa, la) = a.storage_and_layout();
    match &*sa {
        candle_core::Storage::Cpu(sa) => f(slice(sa, la)?),
        _ => candle_core::bail!("fused op: CPU tensors expected"),
    }
}

/// [`with1`] for two tensors.
fn with2<T: Elem, R>(a: &Tensor, b: &Tensor, f: impl FnOnce(&[T], &[T]) -> Result<R>) -> Result<R> {
    let (a, b) = (a.contiguous()?, b.contiguous()?);
    let (sa, la) = a.storage_and_layout();
    let (sb, lb) = b.storage_and_layout();
    match (&*sa, &*sb) {
        (candle_core::Storage::Cpu(sa), candle_core::Storage::Cpu(sb)) => {
            f(slice(sa, la)?, slice(sb, lb)?)
        }
        _ => candle_core::bail!("fused op: CPU tensors expected"),
    }
}

/// `sum_i a_i b_i` with eight partial sums (vectorises).
#[inline(always)]
fn dot<T: Elem>(a: &[T], b: &[T]) -> T {
    let mut acc = [T::zero(); 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s = acc.iter().copied().sum::<T>();
    for (x, y) in ra.iter().zip(rb) {
        s += *x * *y;
    }
    s
}

/// `y += a x`.
#[inline(always)]
fn axpy<T: Elem>(y: &mut [T], a: T, x: &[T]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * *x;
    }
}

fn inv_rms<T: Elem>(x: &[T], eps: T) -> T {
    let n = T::from(x.len()).expect("length fits a float");
    T::one() / (dot(x, x) / n + eps).sqrt()
}

/// Rows per rayon task for row-wise kernels.
const ROWS_PER_TASK: usize = 8;

// ---------------------------------------------------------------- RMSNorm

/// RMSNorm over the last dim: `x: [.., D]`, `w: [D]` -> `[.., D]`,
/// differentiable in both (see the module docs).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    if w.dims() != [d] {
        candle_core::bail!("rms_norm: weight {:?} for rows of {d}", w.dims());
    }
    if cuda_kernels_here(x) && d <= CUDA_RMS_MAX_D {
        return x
            .contiguous()?
            .apply_op2(&w.to_dtype(x.dtype())?.contiguous()?, RmsNormOp { eps });
    }
    if !fused_here(x) || w.dtype() != x.dtype() {
        let xf = x.to_dtype(accum_dtype(x.dtype()))?;
        let r = (xf.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?;
        let normed = xf.broadcast_div(&r)?;
        if w.dtype() == x.dtype() {
            return normed.to_dtype(x.dtype())?.broadcast_mul(w);
        }
        // A weight of another dtype (an f32 master weight under bf16
        // compute) scales in the accumulation dtype, so its gradient, a sum
        // over every row, is summed there too; then the product is cast.
        return normed
            .broadcast_mul(&w.to_dtype(accum_dtype(x.dtype()))?)?
            .to_dtype(x.dtype());
    }
    x.contiguous()?
        .apply_op2(&w.contiguous()?, RmsNormOp { eps })
}

struct RmsNormOp {
    eps: f64,
}

fn rms_fwd<T: Elem>(x: &[T], w: &[T], eps: f64) -> Vec<T> {
    let d = w.len();
    let eps = T::from(eps).expect("eps fits a float");
    let mut y = vec![T::zero(); x.len()];
    y.par_chunks_mut(d * ROWS_PER_TASK)
        .zip(x.par_chunks(d * ROWS_PER_TASK))
        .for_each(|(y, x)| {
            for (y, x) in y.chunks_mut(d).zip(x.chunks(d)) {
                let r = T::one() / inv_rms(x, eps);
                for i in 0..d {
                    y[i] = (x[i] / r) * w[i];
                }
            }
        });
    y
}

/// `[dx | dw]` in one buffer (the layout of [`rms_norm_bwd_packed`]).
fn rms_bwd<T: Elem>(x: &[T], w: &[T], dy: &[T], eps: f64) -> Vec<T> {
    let d = w.len();
    let eps = T::from(eps).expect("eps fits a float");
    let inv_d = T::one() / T::from(d).expect("length fits a float");
    let mut out = vec![T::zero(); x.len() + d];
    let (dx, dw) = out.split_at_mut(x.len());
    let partial = dx
        .par_chunks_mut(d * ROWS_PER_TASK)
        .zip(x.par_chunks(d * ROWS_PER_TASK))
        .zip(dy.par_chunks(d * ROWS_PER_TASK))
        .map(|((dx, x), dy)| {
            let mut dw = vec![T::zero(); d];
            let mut g = vec![T::zero(); d];
            for ((dx, x), dy) in dx.chunks_mut(d).zip(x.chunks(d)).zip(dy.chunks(d)) {
                let r = inv_rms(x, eps);
                for i in 0..d {
                    g[i] = dy[i] * w[i];
                    dw[i] += dy[i] * x[i] * r;
                }
                let c = dot(&g, x) * inv_d * r * r * r;
                for i in 0..d {
                    dx[i] = r * g[i] - c * x[i];
                }
            }
            dw
        })
        .collect::<Vec<_>>();
    // Summed in chunk order (fixed chunks): the same bits on every run and
    // at any thread count.
    for p in &partial {
        axpy(dw, T::one(), p);
    }
    out
}

impl CustomOp2 for RmsNormOp {
    fn name(&self) -> &'static str {
        "arbor-rms-norm"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        w: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = match x {
            // The generation forward's kernel: the same bits as the engine.
            CpuStorage::F32(_) => CpuStorage::F32(crate::cpu::rows::rms_norm_rows(
                slice(x, xl)?,
                slice(w, wl)?,
                self.eps as f32,
            )),
            CpuStorage::F64(_) => CpuStorage::F64(rms_fwd(slice(x, xl)?, slice(w, wl)?, self.eps)),
            _ => candle_core::bail!("rms_norm: f32 or f64 expected"),
        };
        Ok((out, xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        w: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((
            by_dtype!(x, gpu::rms_fwd(x, xl, w, wl, self.eps))?,
            xl.shape().clone(),
        ))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw) = rms_norm_bwd_packed(x, w, dy, self.eps)?;
        Ok((Some(dx), Some(dw)))
    }
}

/// RMSNorm's backward as one op with one output, `[dx (x's elements) |
/// dw (d)]` ([`rms_bwd`] on the CPU, `kernels/fused.cu` on CUDA), split
/// into `(dx, dw)`.
fn rms_norm_bwd_packed(x: &Tensor, w: &Tensor, dy: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    let n = x.elem_count();
    let packed = x.contiguous()?.apply_op3_no_bwd(
        &w.contiguous()?,
        &dy.contiguous()?,
        &RmsNormBwd { eps },
    )?;
    Ok((
        packed.narrow(0, 0, n)?.reshape(x.shape())?,
        packed.narrow(0, n, w.elem_count())?.reshape(w.shape())?,
    ))
}

/// See [`rms_norm_bwd_packed`].
struct RmsNormBwd {
    eps: f64,
}

impl CustomOp3 for RmsNormBwd {
    fn name(&self) -> &'static str {
        "arbor-rms-norm-bwd"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        w: &CpuStorage,
        wl: &Layout,
        dy: &CpuStorage,
        dl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = cpu_by_dtype!(
            x,
            "rms_norm backward",
            rms_bwd(slice(x, xl)?, slice(w, wl)?, slice(dy, dl)?, self.eps)
        );
        let len = xl.shape().elem_count() + wl.shape().elem_count();
        Ok((out, Shape::from(len)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        w: &candle_core::CudaStorage,
        wl: &Layout,
        dy: &candle_core::CudaStorage,
        dl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let len = xl.shape().elem_count() + wl.shape().elem_count();
        let out = by_dtype!(x, gpu::rms_bwd(x, xl, w, wl, dy, dl, self.eps))?;
        Ok((out, Shape::from(len)))
    }
}

// ---------------------------------------------------------------- RoPE

/// RoPE on `x: [N, n, D]` with per-token `cos, sin: [N, D/2]` (rotate-half
/// convention, as HF), differentiable in `x`.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (n, _, d) = x.dims3()?;
    if d % 2 != 0 || cos.dims() != [n, d / 2] || sin.dims() != [n, d / 2] {
        candle_core::bail!(
            "rope: x {:?} needs cos and sin [{n}, {}], got {:?} and {:?}",
            x.dims(),
            d / 2,
            cos.dims(),
            sin.dims()
        );
    }
    if !kernels_here(x) || cos.dtype() != x.dtype() || sin.dtype() != x.dtype() {
        let half = d / 2;
        let (c, s) = (cos.unsqueeze(1)?, sin.unsqueeze(1)?);
        let x1 = x.narrow(D::Minus1, 0, half)?;
        let x2 = x.narrow(D::Minus1, half, half)?;
        let a = (x1.broadcast_mul(&c)? - x2.broadcast_mul(&s)?)?;
        let b = (x2.broadcast_mul(&c)? + x1.broadcast_mul(&s)?)?;
        return Tensor::cat(&[a, b], D::Minus1);
    }
    x.contiguous()?.apply_op3(
        &cos.contiguous()?,
        &sin.contiguous()?,
        RopeOp { inverse: false },
    )
}

struct RopeOp {
    /// Rotate by `-angle` (the backward).
    inverse: bool,
}

fn rope_rows<T: Elem>(x: &[T], cos: &[T], sin: &[T], half: usize, inverse: bool) -> Vec<T> {
    let n = cos.len() / half;
    let per_token = x.len() / n.max(1);
    let mut y = vec![T::zero(); x.len()];
    y.par_chunks_mut(per_token)
        .zip(x.par_chunks(per_token))
        .enumerate()
        .for_each(|(t, (y, x))| {
            let (c, s) = (
                &cos[t * half..(t + 1) * half],
                &sin[t * half..(t + 1) * half],
            );
            for (y, x) in y.chunks_mut(2 * half).zip(x.chunks(2 * half)) {
                let (x1, x2) = x.split_at(half);
                let (y1, y2) = y.split_at_mut(half);
                for i in 0..half {
                    let si = if inverse { -s[i] } else { s[i] };
                    y1[i] = x1[i] * c[i] - x2[i] * si;
                    y2[i] = x2[i] * c[i] + x1[i] * si;
                }
            }
        });
    y
}

impl CustomOp3 for RopeOp {
    fn name(&self) -> &'static str {
        "arbor-rope"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        c: &CpuStorage,
        cl: &Layout,
        s: &CpuStorage,
        sl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let half = cl.shape().dims()[1];
        let out = cpu_by_dtype!(
            x,
            "rope",
            rope_rows(
                slice(x, xl)?,
                slice(c, cl)?,
                slice(s, sl)?,
                half,
                self.inverse
            )
        );
        Ok((out, xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        c: &candle_core::CudaStorage,
        cl: &Layout,
        s: &candle_core::CudaStorage,
        sl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let y = by_dtype!(x, gpu::rope(x, xl, c, cl, s, sl, self.inverse))?;
        Ok((y, xl.shape().clone()))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dx = dy.contiguous()?.apply_op3(
            cos,
            sin,
            RopeOp {
                inverse: !self.inverse,
            },
        )?;
        Ok((Some(dx), None, None))
    }
}

// ---------------------------------------------------------------- SwiGLU

/// `silu(g) * u` for `g, u` of one shape, differentiable in both.
pub fn swiglu(g: &Tensor, u: &Tensor) -> Result<Tensor> {
    if g.shape() != u.shape() {
        candle_core::bail!("swiglu: gate {:?} and up {:?}", g.dims(), u.dims());
    }
    if !kernels_here(g) || u.dtype() != g.dtype() {
        return g.silu()? * u;
    }
    g.contiguous()?.apply_op2(&u.contiguous()?, SwigluOp)
}

struct SwigluOp;

const ELEMS_PER_TASK: usize = 1 << 14;

#[inline(always)]
fn sigmoid<T: Elem>(x: T) -> T {
    T::one() / (T::one() + (-x).fast_exp())
}

fn swiglu_fwd<T: Elem>(g: &[T], u: &[T]) -> Vec<T> {
    let mut y = vec![T::zero(); g.len()];
    y.par_chunks_mut(ELEMS_PER_TASK)
        .zip(
            g.par_chunks(ELEMS_PER_TASK)
                .zip(u.par_chunks(ELEMS_PER_TASK)),
        )
        .for_each(|(y, (g, u))| swiglu_fwd_chunk(g, u, y));
    y
}

#[multiversion(targets("x86_64+avx512f+avx512vl+fma", "x86_64+avx2+fma"))]
fn swiglu_fwd_chunk<T: Elem>(g: &[T], u: &[T], y: &mut [T]) {
    for i in 0..y.len() {
        y[i] = g[i] * sigmoid(g[i]) * u[i];
    }
}

#[multiversion(targets("x86_64+avx512f+avx512vl+fma", "x86_64+avx2+fma"))]
fn swiglu_bwd_chunk<T: Elem>(g: &[T], u: &[T], dy: &[T], dg: &mut [T], du: &mut [T]) {
    for i in 0..dg.len() {
        let s = sigmoid(g[i]);
        du[i] = dy[i] * g[i] * s;
        dg[i] = dy[i] * u[i] * s * (T::one() + g[i] * (T::one() - s));
    }
}

/// `[dg | du]` in one buffer (the layout of [`swiglu_bwd_packed`]).
fn swiglu_bwd<T: Elem>(g: &[T], u: &[T], dy: &[T]) -> Vec<T> {
    let mut out = vec![T::zero(); 2 * g.len()];
    let (dg, du) = out.split_at_mut(g.len());
    dg.par_chunks_mut(ELEMS_PER_TASK)
        .zip(du.par_chunks_mut(ELEMS_PER_TASK))
        .zip(
            g.par_chunks(ELEMS_PER_TASK)
                .zip(u.par_chunks(ELEMS_PER_TASK)),
        )
        .zip(dy.par_chunks(ELEMS_PER_TASK))
        .for_each(|(((dg, du), (g, u)), dy)| swiglu_bwd_chunk(g, u, dy, dg, du));
    out
}

impl CustomOp2 for SwigluOp {
    fn name(&self) -> &'static str {
        "arbor-swiglu"
    }

    fn cpu_fwd(
        &self,
        g: &CpuStorage,
        gl: &Layout,
        u: &CpuStorage,
        ul: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = cpu_by_dtype!(g, "swiglu", swiglu_fwd(slice(g, gl)?, slice(u, ul)?));
        Ok((out, gl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        g: &candle_core::CudaStorage,
        gl: &Layout,
        u: &candle_core::CudaStorage,
        ul: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((
            by_dtype!(g, gpu::swiglu_fwd(g, gl, u, ul))?,
            gl.shape().clone(),
        ))
    }

    fn bwd(
        &self,
        g: &Tensor,
        u: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dg, du) = swiglu_bwd_packed(g, u, dy)?;
        Ok((Some(dg), Some(du)))
    }
}

/// SwiGLU's backward as one op with one output, `[dg | du]` ([`swiglu_bwd`]
/// on the CPU, `kernels/fused.cu` on CUDA), split into `(dg, du)`.
fn swiglu_bwd_packed(g: &Tensor, u: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor)> {
    let n = g.elem_count();
    let packed =
        g.contiguous()?
            .apply_op3_no_bwd(&u.contiguous()?, &dy.contiguous()?, &SwigluBwd)?;
    Ok((
        packed.narrow(0, 0, n)?.reshape(g.shape())?,
        packed.narrow(0, n, n)?.reshape(u.shape())?,
    ))
}

/// See [`swiglu_bwd_packed`].
struct SwigluBwd;

impl CustomOp3 for SwigluBwd {
    fn name(&self) -> &'static str {
        "arbor-swiglu-bwd"
    }

    fn cpu_fwd(
        &self,
        g: &CpuStorage,
        gl: &Layout,
        u: &CpuStorage,
        ul: &Layout,
        dy: &CpuStorage,
        dl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = cpu_by_dtype!(
            g,
            "swiglu backward",
            swiglu_bwd(slice(g, gl)?, slice(u, ul)?, slice(dy, dl)?)
        );
        Ok((out, Shape::from(2 * gl.shape().elem_count())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        g: &candle_core::CudaStorage,
        gl: &Layout,
        u: &candle_core::CudaStorage,
        ul: &Layout,
        dy: &candle_core::CudaStorage,
        dl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let n = gl.shape().elem_count();
        let out = by_dtype!(g, gpu::swiglu_bwd(g, gl, u, ul, dy, dl))?;
        Ok((out, Shape::from(2 * n)))
    }
}

/// Launches of `kernels/fused.cu` (f32 or bf16 storage, f32 arithmetic).
#[cfg(feature = "cuda")]
mod gpu {
    use crate::cuda::{self, PushKernelArg, WrapErr};
    use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig};
    use candle_core::cuda_backend::CudaDType;
    use candle_core::{CudaStorage, Layout, Result};

    /// Storage types of the kernels.
    pub trait El: CudaDType + DeviceRepr + cuda::Poison {
        const SUFFIX: &'static str;
    }
    impl El for f32 {
        const SUFFIX: &'static str = "f32";
    }
    impl El for ::half::bf16 {
        const SUFFIX: &'static str = "bf16";
    }

    /// Threads per block of the row kernels.
    const THREADS: u32 = 256;
    /// Blocks of the RMSNorm backward (each sums its rows' weight
    /// gradient; the blocks' shares are then summed in order).
    const RMS_BWD_BLOCKS: usize = 264;

    fn kernel<T: El>(s: &CudaStorage, name: &str) -> Result<cuda::Kernel> {
        cuda::Kernel::get(&s.device, "fused", &format!("fused_{name}_{}", T::SUFFIX))
    }

    fn grid(n: usize) -> LaunchConfig {
        cuda::grid1d(n, THREADS)
    }

    pub fn rms_fwd<T: El>(
        x: &CudaStorage,
        xl: &Layout,
        w: &CudaStorage,
        wl: &Layout,
        eps: f64,
    ) -> Result<CudaStorage> {
        let dev = x.device.clone();
        let (n, d) = (xl.shape().elem_count(), wl.shape().elem_count());
        let f = kernel::<T>(x, "rms_fwd")?;
        let (xv, wv) = (cuda::view::<T>(x, xl)?, cuda::view::<T>(w, wl)?);
        let mut y = cuda::alloc_out::<T>(&dev, n)?;
        let (di, e) = (d as i32, eps as f32);
        let mut b = f.builder();
        b.arg(&xv).arg(&wv).arg(&mut y).arg(&di).arg(&e);
        let cfg = LaunchConfig {
            grid_dim: ((n / d) as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches `fused_rms_fwd_*` in kernels/fused.cu; x and
        // y hold n / d rows of d, w holds d.
        #[allow(unsafe_code)]
        unsafe { b.launch(cfg) }.w()?;
        Ok(cuda::wrap(y, &dev))
    }

    /// `[dx | dw]`.
    #[allow(clippy::too_many_arguments)]
    pub fn rms_bwd<T: El>(
        x: &CudaStorage,
        xl: &Layout,
        w: &CudaStorage,
        wl: &Layout,
        dy: &CudaStorage,
        dl: &Layout,
        eps: f64,
    ) -> Result<CudaStorage> {
        let dev = x.device.clone();
        let (n, d) = (xl.shape().elem_count(), wl.shape().elem_count());
        let rows = n / d;
        let p = rows.clamp(1, RMS_BWD_BLOCKS);
        let (xv, wv, gv) = (
            cuda::view::<T>(x, xl)?,
            cuda::view::<T>(w, wl)?,
            cuda::view::<T>(dy, dl)?,
        );
        let mut out = cuda::alloc_out::<T>(&dev, n + d)?;
        let mut part = dev.alloc_zeros::<f32>(p * d)?;
        let (ri, di, pi, e) = (rows as i32, d as i32, p as i32, eps as f32);
        {
            let f = kernel::<T>(x, "rms_bwd")?;
            let mut dx = out.slice_mut(0..n);
            let mut b = f.builder();
            b.arg(&xv).arg(&wv).arg(&gv).arg(&mut dx).arg(&mut part);
            b.arg(&ri).arg(&di).arg(&e);
            let cfg = LaunchConfig {
                grid_dim: (p as u32, 1, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: (4 * d) as u32,
            };
            // SAFETY: matches `fused_rms_bwd_*` in kernels/fused.cu: x,
            // dy and dx hold rows x d, w d, part p x d; d floats of
            // dynamic shared memory (d <= 8192: 32 KiB).
            #[allow(unsafe_code)]
            unsafe { b.launch(cfg) }.w()?;
        }
        {
            let f = kernel::<T>(x, "rms_dw")?;
            let mut dw = out.slice_mut(n..n + d);
            let mut b = f.builder();
            b.arg(&part).arg(&mut dw).arg(&pi).arg(&di);
            // SAFETY: matches `fused_rms_dw_*`: part p x d, dw d.
            #[allow(unsafe_code)]
            unsafe { b.launch(grid(d)) }.w()?;
        }
        Ok(cuda::wrap(out, &dev))
    }

    #[allow(clippy::too_many_arguments)]
    pub fn rope<T: El>(
        x: &CudaStorage,
        xl: &Layout,
        c: &CudaStorage,
        cl: &Layout,
        s: &CudaStorage,
        sl: &Layout,
        inverse: bool,
    ) -> Result<CudaStorage> {
        let dev = x.device.clone();
        let (tokens, half) = cl.shape().dims2()?;
        let n = xl.shape().elem_count();
        let heads = n / (tokens * 2 * half).max(1);
        let f = kernel::<T>(x, "rope")?;
        let (xv, cv, sv) = (
            cuda::view::<T>(x, xl)?,
            cuda::view::<T>(c, cl)?,
            cuda::view::<T>(s, sl)?,
        );
        let mut y = cuda::alloc_out::<T>(&dev, n)?;
        let pairs = (n / 2) as i64;
        let (hi, hf) = (heads as i32, half as i32);
        let sign = if inverse { -1.0f32 } else { 1.0 };
        let mut b = f.builder();
        b.arg(&xv).arg(&cv).arg(&sv).arg(&mut y);
        b.arg(&pairs).arg(&hi).arg(&hf).arg(&sign);
        // SAFETY: matches `fused_rope_*` in kernels/fused.cu: x and y
        // hold tokens x heads x 2 half, cos and sin tokens x half.
        #[allow(unsafe_code)]
        unsafe { b.launch(grid(n / 2)) }.w()?;
        Ok(cuda::wrap(y, &dev))
    }

    pub fn swiglu_fwd<T: El>(
        g: &CudaStorage,
        gl: &Layout,
        u: &CudaStorage,
        ul: &Layout,
    ) -> Result<CudaStorage> {
        let dev = g.device.clone();
        let n = gl.shape().elem_count();
        let f = kernel::<T>(g, "swiglu_fwd")?;
        let (gv, uv) = (cuda::view::<T>(g, gl)?, cuda::view::<T>(u, ul)?);
        let mut y = cuda::alloc_out::<T>(&dev, n)?;
        let ni = n as i64;
        let mut b = f.builder();
        b.arg(&gv).arg(&uv).arg(&mut y).arg(&ni);
        // SAFETY: matches `fused_swiglu_fwd_*`: g, u and y hold n.
        #[allow(unsafe_code)]
        unsafe { b.launch(grid(n)) }.w()?;
        Ok(cuda::wrap(y, &dev))
    }

    /// `[dg | du]`.
    pub fn swiglu_bwd<T: El>(
        g: &CudaStorage,
        gl: &Layout,
        u: &CudaStorage,
        ul: &Layout,
        dy: &CudaStorage,
        dl: &Layout,
    ) -> Result<CudaStorage> {
        let dev = g.device.clone();
        let n = gl.shape().elem_count();
        let f = kernel::<T>(g, "swiglu_bwd")?;
        let (gv, uv, dv) = (
            cuda::view::<T>(g, gl)?,
            cuda::view::<T>(u, ul)?,
            cuda::view::<T>(dy, dl)?,
        );
        let mut out = cuda::alloc_out::<T>(&dev, 2 * n)?;
        let ni = n as i64;
        let mut b = f.builder();
        b.arg(&gv).arg(&uv).arg(&dv).arg(&mut out).arg(&ni);
        // SAFETY: matches `fused_swiglu_bwd_*`: g, u, dy hold n, out 2 n.
        #[allow(unsafe_code)]
        unsafe { b.launch(grid(n)) }.w()?;
        Ok(cuda::wrap(out, &dev))
    }
}

// ---------------------------------------------------------------- attention

/// Shape of a packed attention call.
#[derive(Debug, Clone)]
struct Geom {
    nh: usize,
    nkv: usize,
    d: usize,
    /// Sequence starts, with the total token count last (`S + 1` entries).
    starts: Vec<usize>,
}

impl Geom {
    fn group(&self) -> usize {
        self.nh / self.nkv
    }
}

/// Causal attention within each of the packed sequences (see the module
/// docs): `q: [N, nh, D]`, `k, v: [N, nkv, D]`, `seq_lens` summing to `N`
/// -> `[N, nh, D]`. Differentiable in `q`, `k` and `v`.
pub fn packed_causal_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seq_lens: &[usize],
) -> Result<Tensor> {
    let (n, nh, d) = q.dims3()?;
    let (nk, nkv, dk) = k.dims3()?;
    let total: usize = seq_lens.iter().sum();
    if nk != n || dk != d || v.dims() != k.dims() || nkv == 0 || nh % nkv != 0 || total != n {
        candle_core::bail!(
            "packed_causal_attention: q {:?}, k {:?}, v {:?} and sequences summing to {total}",
            q.dims(),
            k.dims(),
            v.dims()
        );
    }
    let mut starts = Vec::with_capacity(seq_lens.len() + 1);
    let mut at = 0;
    for &l in seq_lens {
        starts.push(at);
        at += l;
    }
    starts.push(at);
    let geom = Geom { nh, nkv, d, starts };
    if !fused_here(q) || k.dtype() != q.dtype() || v.dtype() != q.dtype() {
        return recomputed_attention(q, k, v, &geom);
    }
    q.contiguous()?.apply_op3(
        &k.contiguous()?,
        &v.contiguous()?,
        AttnOp {
            geom,
            lse: Mutex::new(None),
        },
    )
}

impl Geom {
    /// `(start, len)` of each sequence with tokens.
    fn sequences(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.starts
            .windows(2)
            .map(|w| (w[0], w[1] - w[0]))
            .filter(|&(_, l)| l > 0)
    }

    /// Rows `s..s + l` of `x: [N, nh, D]` grouped by KV head: `[nkv, grp
    /// l, D]`, row `g l + t` holding query head `kvh grp + g` at `t`.
    fn group_rows(&self, x: &Tensor, s: usize, l: usize) -> Result<Tensor> {
        let (nkv, grp, d) = (self.nkv, self.group(), self.d);
        x.narrow(0, s, l)?
            .reshape((l, nkv, grp, d))?
            .permute((1, 2, 0, 3))?
            .contiguous()?
            .reshape((nkv, grp * l, d))
    }

    /// The inverse of [`Geom::group_rows`]: `[nkv, grp l, D]` -> `[l, nh, D]`.
    fn ungroup_rows(&self, x: &Tensor, l: usize) -> Result<Tensor> {
        let (nkv, grp, d) = (self.nkv, self.group(), self.d);
        x.reshape((nkv, grp, l, d))?
            .permute((2, 0, 1, 3))?
            .reshape((l, self.nh, d))
    }

    /// Rows `s..s + l` of keys or values `[N, nkv, D]` as `[nkv, l, D]`.
    fn kv_rows(&self, x: &Tensor, s: usize, l: usize) -> Result<Tensor> {
        x.narrow(0, s, l)?.transpose(0, 1)?.contiguous()
    }

    /// One sequence's scores `c q k^T` in the accumulation dtype, causal
    /// (`-inf` where the key is after the query): `[nkv, grp l, l]` for
    /// grouped queries `qs` and keys `ks: [nkv, l, D]`.
    fn scores(&self, qs: &Tensor, ks: &Tensor, l: usize) -> Result<Tensor> {
        let acc = accum_dtype(qs.dtype());
        let scores = (qs.matmul(&ks.t()?)? * (1.0 / (self.d as f64).sqrt()))?.to_dtype(acc)?;
        // The causal mask built on the device: 0 where key <= query, -inf
        // above the diagonal, broadcast over the group's heads.
        let dev = qs.device();
        let pos = Tensor::arange(0u32, l as u32, dev)?;
        let allowed = pos.unsqueeze(1)?.broadcast_ge(&pos.unsqueeze(0)?)?;
        let mask = allowed.where_cond(
            &Tensor::zeros((l, l), acc, dev)?,
            &Tensor::full(f32::NEG_INFINITY, (l, l), dev)?.to_dtype(acc)?,
        )?;
        scores
            .reshape((self.nkv, self.group(), l, l))?
            .broadcast_add(&mask)?
            .reshape((self.nkv, self.group() * l, l))
    }
}

/// Candle ops, one sequence at a time, differentiated by candle (the
/// reference of [`recomputed_attention`]).
#[cfg(test)]
fn composed_attention(q: &Tensor, k: &Tensor, v: &Tensor, g: &Geom) -> Result<Tensor> {
    let mut outs = Vec::with_capacity(g.starts.len() - 1);
    for (s, l) in g.sequences() {
        let scores = g.scores(&g.group_rows(q, s, l)?, &g.kv_rows(k, s, l)?, l)?;
        let m = scores.max_keepdim(D::Minus1)?.detach();
        let e = scores.broadcast_sub(&m)?.exp()?;
        let p = e
            .broadcast_div(&e.sum_keepdim(D::Minus1)?)?
            .to_dtype(q.dtype())?;
        outs.push(g.ungroup_rows(&p.matmul(&g.kv_rows(v, s, l)?)?, l)?);
    }
    Tensor::cat(&outs, 0)
}

/// Attention where the fused kernel does not run (CUDA, bf16): candle ops
/// (cuBLAS matmuls on a GPU), one sequence at a time, FlashAttention's
/// bookkeeping at the granularity of a sequence. The forward runs without
/// a graph and keeps each query row's log-sum-exp `lse`; the backward
/// recomputes a sequence's scores, `P = exp(S - lse)`, and takes
/// `delta = rowsum(dO * O)`, `dS = P (dO V^T - delta)`, `dQ = c dS K`,
/// `dK = c dS^T Q`, `dV = P^T dO`. So no `[l, l]` tensor outlives its
/// sequence's turn in either pass, where candle's own backward of the
/// composed ops would keep several per sequence and layer.
fn recomputed_attention(q: &Tensor, k: &Tensor, v: &Tensor, g: &Geom) -> Result<Tensor> {
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let (qd, kd, vd) = (q.detach(), k.detach(), v.detach());
    let mut outs = Vec::with_capacity(g.starts.len() - 1);
    let mut lse = Vec::with_capacity(g.starts.len() - 1);
    for (s, l) in g.sequences() {
        let scores = g.scores(&g.group_rows(&qd, s, l)?, &g.kv_rows(&kd, s, l)?, l)?;
        let m = scores.max_keepdim(D::Minus1)?;
        let sum = scores.broadcast_sub(&m)?.exp()?.sum_keepdim(D::Minus1)?;
        let row_lse = (sum.log()? + m)?; // [nkv, grp l, 1]
        let p = scores.broadcast_sub(&row_lse)?.exp()?.to_dtype(q.dtype())?;
        outs.push(g.ungroup_rows(&p.matmul(&g.kv_rows(&vd, s, l)?)?, l)?);
        lse.push(row_lse);
    }
    let out = Tensor::cat(&outs, 0)?.contiguous()?;
    q.apply_op3(
        &k,
        &v,
        AttnRecompute {
            geom: g.clone(),
            out: Mutex::new(Some(out)),
            lse,
        },
    )
}

/// The op of [`recomputed_attention`]: its forward hands over the output
/// computed before (once), its backward recomputes.
struct AttnRecompute {
    geom: Geom,
    out: Mutex<Option<Tensor>>,
    /// Per sequence with tokens, `[nkv, grp l, 1]` in the accumulation dtype.
    lse: Vec<Tensor>,
}

impl AttnRecompute {
    /// The forward's output, taken (the graph keeps the op's result).
    fn take_out(&self) -> Result<Tensor> {
        self.out
            .lock()
            .map_err(|_| candle_core::Error::Msg("attention: poisoned lock".into()))?
            .take()
            .ok_or_else(|| candle_core::Error::Msg("attention: forward run twice".into()))
    }
}

impl CustomOp3 for AttnRecompute {
    fn name(&self) -> &'static str {
        "arbor-attention-recompute"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let out = self.take_out()?;
        let (s, l) = out.storage_and_layout();
        match &*s {
            candle_core::Storage::Cpu(c) => Ok((c.try_clone(l)?, out.shape().clone())),
            _ => candle_core::bail!("attention: the output is not on the CPU"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let out = self.take_out()?;
        let (s, l) = out.storage_and_layout();
        match &*s {
            candle_core::Storage::Cuda(c) => Ok((c.try_clone(l)?, out.shape().clone())),
            _ => candle_core::bail!("attention: the output is not on the GPU"),
        }
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        o: &Tensor,
        dout: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let g = &self.geom;
        let (dt, acc) = (q.dtype(), accum_dtype(q.dtype()));
        let c = 1.0 / (g.d as f64).sqrt();
        let dout = dout.contiguous()?;
        let (mut dq, mut dk, mut dv) = (Vec::new(), Vec::new(), Vec::new());
        for ((s, l), lse) in g.sequences().zip(&self.lse) {
            let (qs, ks, vs) = (
                g.group_rows(q, s, l)?,
                g.kv_rows(k, s, l)?,
                g.kv_rows(v, s, l)?,
            );
            let (os, dos) = (g.group_rows(o, s, l)?, g.group_rows(&dout, s, l)?);
            let p = g.scores(&qs, &ks, l)?.broadcast_sub(lse)?.exp()?;
            let pd = p.to_dtype(dt)?;
            let dp = dos.matmul(&vs.t()?)?.to_dtype(acc)?;
            let delta = (dos.to_dtype(acc)? * os.to_dtype(acc)?)?.sum_keepdim(D::Minus1)?;
            let ds = ((p * dp.broadcast_sub(&delta)?)? * c)?.to_dtype(dt)?;
            dq.push(g.ungroup_rows(&ds.matmul(&ks)?, l)?);
            dk.push(ds.t()?.matmul(&qs)?.transpose(0, 1)?);
            dv.push(pd.t()?.matmul(&dos)?.transpose(0, 1)?);
        }
        Ok((
            Some(Tensor::cat(&dq, 0)?),
            Some(Tensor::cat(&dk, 0)?),
            Some(Tensor::cat(&dv, 0)?),
        ))
    }
}

struct AttnOp {
    geom: Geom,
    /// `[N, nh]` log-sum-exp of each query row's scores, from the forward.
    lse: Mutex<Option<Vec<f64>>>,
}

/// One (sequence, query head) pair's keys and values, gathered contiguous:
/// `k [L, D]`, `kt [D, L]` and `v [L, D]` (and `vt [D, L]` for the
/// backward), so the inner loops run along contiguous rows.
struct HeadKv<T> {
    k: Vec<T>,
    kt: Vec<T>,
    v: Vec<T>,
    vt: Vec<T>,
}

#[inline(always)]
fn gather_head<T: Elem>(
    k: &[T],
    v: &[T],
    g: &Geom,
    s0: usize,
    l: usize,
    kh: usize,
    vt: bool,
) -> HeadKv<T> {
    let (nkv, d) = (g.nkv, g.d);
    let mut h = HeadKv {
        k: vec![T::zero(); l * d],
        kt: vec![T::zero(); l * d],
        v: vec![T::zero(); l * d],
        vt: if vt {
            vec![T::zero(); l * d]
        } else {
            Vec::new()
        },
    };
    for j in 0..l {
        let src = ((s0 + j) * nkv + kh) * d;
        h.k[j * d..(j + 1) * d].copy_from_slice(&k[src..src + d]);
        h.v[j * d..(j + 1) * d].copy_from_slice(&v[src..src + d]);
        for e in 0..d {
            h.kt[e * l + j] = k[src + e];
            if vt {
                h.vt[e * l + j] = v[src + e];
            }
        }
    }
    h
}

/// Rows of query-like vectors scored together (register blocking).
const QB: usize = 4;
/// Blocks of [`QB`] rows whose contributions to `dk, dv` the attention
/// backward adds in one pass.
const SB: usize = 4;
/// Score columns per register block.
const JB: usize = 16;

/// `s[r * l + j] = sum_e x[r][e] mt[e][j]` for the `QB` rows `xs` and
/// `j < m` (`mt: [D, l]`): blocks of `QB x JB` sums held in registers, one
/// load of `mt` per `QB` products.
#[inline(always)]
fn rows_times<T: Elem>(xs: [&[T]; QB], mt: &[T], l: usize, m: usize, s: &mut [T]) {
    let d = xs[0].len();
    let mut j = 0;
    while j + JB <= m {
        let mut acc = [[T::zero(); JB]; QB];
        for e in 0..d {
            let kt: &[T; JB] = mt[e * l + j..e * l + j + JB].try_into().expect("JB values");
            for r in 0..QB {
                let xe = xs[r][e];
                for t in 0..JB {
                    acc[r][t] += xe * kt[t];
                }
            }
        }
        for (r, a) in acc.iter().enumerate() {
            s[r * l + j..r * l + j + JB].copy_from_slice(a);
        }
        j += JB;
    }
    for jj in j..m {
        for r in 0..QB {
            let mut acc = T::zero();
            for e in 0..d {
                acc += xs[r][e] * mt[e * l + jj];
            }
            s[r * l + jj] = acc;
        }
    }
}

/// `out = sum_j p_j v[j]` (`v: [>= p.len(), D]` rows), the output held in
/// registers in chunks of 64 values.
#[inline(always)]
fn weighted_rows<T: Elem>(p: &[T], v: &[T], d: usize, out: &mut [T]) {
    const W: usize = 64;
    let mut e0 = 0;
    while e0 + W <= d {
        let mut acc = [T::zero(); W];
        for (j, &pj) in p.iter().enumerate() {
            let vr: &[T; W] = v[j * d + e0..j * d + e0 + W].try_into().expect("W values");
            for t in 0..W {
                acc[t] += pj * vr[t];
            }
        }
        out[e0..e0 + W].copy_from_slice(&acc);
        e0 += W;
    }
    if e0 < d {
        out[e0..d].fill(T::zero());
        for (j, &pj) in p.iter().enumerate() {
            axpy(&mut out[e0..d], pj, &v[j * d + e0..j * d + d]);
        }
    }
}

/// `y += sum_r a[r] x[r]` over the `R` rows in order, `y` held in
/// registers 16 values at a time (one load and store of `y` per `R`
/// products).
#[inline(always)]
fn axpy_rows<T: Elem, const R: usize>(y: &mut [T], a: [T; R], xs: [&[T]; R]) {
    const W: usize = 16;
    let d = y.len();
    let mut e0 = 0;
    while e0 + W <= d {
        let yc: &mut [T; W] = (&mut y[e0..e0 + W]).try_into().expect("W values");
        let mut acc = *yc;
        for r in 0..R {
            let xr: &[T; W] = xs[r][e0..e0 + W].try_into().expect("W values");
            for t in 0..W {
                acc[t] += a[r] * xr[t];
            }
        }
        *yc = acc;
        e0 += W;
    }
    for r in 0..R {
        axpy(&mut y[e0..], a[r], &xs[r][e0..d]);
    }
}

/// The `R` query rows starting at `i0` (repeating the last where the
/// sequence ends), as slices of `x` (`[N, nh, D]`, head `h`).
#[inline(always)]
fn block_rows<T: Elem, const R: usize>(
    x: &[T],
    s0: usize,
    i0: usize,
    l: usize,
    nh: usize,
    h: usize,
    d: usize,
) -> [&[T]; R] {
    std::array::from_fn(|r| {
        let i = (i0 + r).min(l - 1);
        &x[((s0 + i) * nh + h) * d..][..d]
    })
}

/// One (sequence, query head) of the forward: rows `o [L, D]` and `lse [L]`.
#[inline(always)]
fn attn_head_fwd<T: Elem>(
    q: &[T],
    hk: &HeadKv<T>,
    g: &Geom,
    s0: usize,
    l: usize,
    h: usize,
) -> (Vec<T>, Vec<f64>) {
    let (nh, d) = (g.nh, g.d);
    let scale = T::one() / T::from(d).expect("head dim fits a float").sqrt();
    let mut o = vec![T::zero(); l * d];
    let mut lse = vec![0f64; l];
    let mut sc = vec![T::zero(); QB * l];
    for i0 in (0..l).step_by(QB) {
        let mmax = (i0 + QB).min(l);
        rows_times(block_rows(q, s0, i0, l, nh, h, d), &hk.kt, l, mmax, &mut sc);
        for i in i0..mmax {
            let m = i + 1;
            let p = &mut sc[(i - i0) * l..(i - i0) * l + m];
            for pj in p.iter_mut() {
                *pj *= scale;
            }
            let mx = max_lanes(p);
            for pj in p.iter_mut() {
                *pj = (*pj - mx).fast_exp();
            }
            let sum = sum_lanes(p);
            let inv = T::one() / sum;
            for pj in p.iter_mut() {
                *pj *= inv;
            }
            weighted_rows(p, &hk.v, d, &mut o[i * d..(i + 1) * d]);
            lse[i] = WithDType::to_f64(mx + sum.ln());
        }
    }
    (o, lse)
}

/// One (sequence, query head) of the backward: `dq [L, D]` and this
/// head's contributions to `dk, dv [L, D]`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn attn_head_bwd<T: Elem>(
    q: &[T],
    o: &[T],
    dout: &[T],
    lse: &[f64],
    hk: &HeadKv<T>,
    g: &Geom,
    s0: usize,
    l: usize,
    h: usize,
) -> (Vec<T>, Vec<T>, Vec<T>) {
    let (nh, d) = (g.nh, g.d);
    let scale = T::one() / T::from(d).expect("head dim fits a float").sqrt();
    let (mut dq, mut dk, mut dv) = (
        vec![T::zero(); l * d],
        vec![T::zero(); l * d],
        vec![T::zero(); l * d],
    );
    // Scores in blocks of QB rows (register blocking); dk and dv updated
    // once per SB blocks (one pass over dk_j, dv_j for QB * SB rows), the
    // rows added in order as block after block would add them: entries
    // past a block's columns are zero here, and adding a zero product
    // leaves a sum's bits as they were (it is never -0: dk and dv start at
    // +0), so the result is the same as one block at a time.
    const RS: usize = QB * SB;
    let mut ps = vec![T::zero(); RS * l];
    let mut dps = vec![T::zero(); RS * l];
    for i00 in (0..l).step_by(RS) {
        let smax = (i00 + RS).min(l);
        for b in 0..SB {
            let i0 = i00 + b * QB;
            let (pb, dpb) = (
                &mut ps[b * QB * l..(b + 1) * QB * l],
                &mut dps[b * QB * l..(b + 1) * QB * l],
            );
            let mmax = (i0 + QB).min(l);
            if i0 < l {
                rows_times(block_rows(q, s0, i0, l, nh, h, d), &hk.kt, l, mmax, pb);
                rows_times(block_rows(dout, s0, i0, l, nh, h, d), &hk.vt, l, mmax, dpb);
            }
            for r in 0..QB {
                let i = i0 + r;
                let (p, dp) = (&mut pb[r * l..r * l + smax], &mut dpb[r * l..r * l + smax]);
                if i >= l {
                    // Past the sequence's end: a repeated row, no weight.
                    p.fill(T::zero());
                    dp.fill(T::zero());
                    continue;
                }
                let m = i + 1;
                let row = ((s0 + i) * nh + h) * d;
                let (oi, doi) = (&o[row..row + d], &dout[row..row + d]);
                let delta = dot(doi, oi);
                let li = T::from(lse[(s0 + i) * nh + h]).expect("finite");
                // p_j, then dS_j (into dp); zero past the causal limit.
                for (pj, dpj) in p[..m].iter_mut().zip(dp[..m].iter_mut()) {
                    *pj = (*pj * scale - li).fast_exp();
                    *dpj = *pj * (*dpj - delta) * scale;
                }
                p[m..].fill(T::zero());
                dp[m..].fill(T::zero());
                weighted_rows(&dp[..m], &hk.k, d, &mut dq[i * d..(i + 1) * d]);
            }
        }
        // dk_j += sum_r dS_rj q_r and dv_j += sum_r P_rj dO_r over the RS
        // rows (repeating the last past the sequence's end, with weight 0).
        let qs: [&[T]; RS] = block_rows(q, s0, i00, l, nh, h, d);
        let dos: [&[T]; RS] = block_rows(dout, s0, i00, l, nh, h, d);
        for j in 0..smax {
            let ds: [T; RS] = std::array::from_fn(|r| dps[r * l + j]);
            let pr: [T; RS] = std::array::from_fn(|r| ps[r * l + j]);
            axpy_rows(&mut dk[j * d..(j + 1) * d], ds, qs);
            axpy_rows(&mut dv[j * d..(j + 1) * d], pr, dos);
        }
    }
    (dq, dk, dv)
}

/// Forward: `(out [N, nh, D], lse [N, nh])`, one task per (sequence, head).
fn attn_fwd<T: Elem>(q: &[T], k: &[T], v: &[T], g: &Geom) -> (Vec<T>, Vec<f64>) {
    let (nh, d) = (g.nh, g.d);
    let n = q.len() / (nh * d);
    let seqs = g.starts.len() - 1;
    let parts: Vec<(Vec<T>, Vec<f64>)> = (0..seqs * nh)
        .into_par_iter()
        .map(|task| {
            let (si, h) = (task / nh, task % nh);
            let (s0, l) = (g.starts[si], g.starts[si + 1] - g.starts[si]);
            head_fwd(q, k, v, g, s0, l, h)
        })
        .collect();
    let mut out = vec![T::zero(); n * nh * d];
    let mut lse = vec![0f64; n * nh];
    for (task, (o, ls)) in parts.into_iter().enumerate() {
        let (si, h) = (task / nh, task % nh);
        let s0 = g.starts[si];
        for (i, (orow, l)) in o.chunks(d).zip(ls).enumerate() {
            out[((s0 + i) * nh + h) * d..][..d].copy_from_slice(orow);
            lse[(s0 + i) * nh + h] = l;
        }
    }
    (out, lse)
}

/// Backward: `(dq, dk, dv)` from the inputs, output, `lse` and `dO`, one
/// task per (sequence, query head); the heads' `dk, dv` are summed over
/// each group in head order afterwards (fixed order: the same bits on every
/// run).
#[allow(clippy::too_many_arguments)]
fn attn_bwd<T: Elem>(
    q: &[T],
    k: &[T],
    v: &[T],
    o: &[T],
    lse: &[f64],
    dout: &[T],
    g: &Geom,
) -> (Vec<T>, Vec<T>, Vec<T>) {
    let (nh, nkv, d, grp) = (g.nh, g.nkv, g.d, g.group());
    let n = q.len() / (nh * d);
    let seqs = g.starts.len() - 1;
    let parts: Vec<(Vec<T>, Vec<T>, Vec<T>)> = (0..seqs * nh)
        .into_par_iter()
        .map(|task| {
            let (si, h) = (task / nh, task % nh);
            let (s0, l) = (g.starts[si], g.starts[si + 1] - g.starts[si]);
            head_bwd(q, k, v, o, dout, lse, g, s0, l, h)
        })
        .collect();
    let mut dq = vec![T::zero(); n * nh * d];
    let mut dk = vec![T::zero(); n * nkv * d];
    let mut dv = vec![T::zero(); n * nkv * d];
    for (task, (pq, pk, pv)) in parts.into_iter().enumerate() {
        let (si, h) = (task / nh, task % nh);
        let s0 = g.starts[si];
        let kh = h / grp;
        for (r, ((pq, pk), pv)) in pq.chunks(d).zip(pk.chunks(d)).zip(pv.chunks(d)).enumerate() {
            let i = s0 + r;
            dq[(i * nh + h) * d..][..d].copy_from_slice(pq);
            axpy(&mut dk[(i * nkv + kh) * d..][..d], T::one(), pk);
            axpy(&mut dv[(i * nkv + kh) * d..][..d], T::one(), pv);
        }
    }
    (dq, dk, dv)
}

/// One (sequence, query head) task of the forward, its keys and values
/// gathered first; compiled for several x86 feature levels (AVX-512,
/// AVX2 + FMA, baseline) and picked at run time.
#[multiversion(targets("x86_64+avx512f+avx512vl+fma", "x86_64+avx2+fma"))]
fn head_fwd<T: Elem>(
    q: &[T],
    k: &[T],
    v: &[T],
    g: &Geom,
    s0: usize,
    l: usize,
    h: usize,
) -> (Vec<T>, Vec<f64>) {
    let hk = gather_head(k, v, g, s0, l, h / g.group(), false);
    attn_head_fwd(q, &hk, g, s0, l, h)
}

/// One (sequence, query head) task of the backward, as [`head_fwd`].
#[allow(clippy::too_many_arguments)]
#[multiversion(targets("x86_64+avx512f+avx512vl+fma", "x86_64+avx2+fma"))]
fn head_bwd<T: Elem>(
    q: &[T],
    k: &[T],
    v: &[T],
    o: &[T],
    dout: &[T],
    lse: &[f64],
    g: &Geom,
    s0: usize,
    l: usize,
    h: usize,
) -> (Vec<T>, Vec<T>, Vec<T>) {
    let hk = gather_head(k, v, g, s0, l, h / g.group(), true);
    attn_head_bwd(q, o, dout, lse, &hk, g, s0, l, h)
}

impl CustomOp3 for AttnOp {
    fn name(&self) -> &'static str {
        "arbor-packed-causal-attention"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        ql: &Layout,
        k: &CpuStorage,
        kl: &Layout,
        v: &CpuStorage,
        vl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (out, lse) = match q {
            CpuStorage::F32(_) => {
                let (o, l) =
                    attn_fwd::<f32>(slice(q, ql)?, slice(k, kl)?, slice(v, vl)?, &self.geom);
                (CpuStorage::F32(o), l)
            }
            CpuStorage::F64(_) => {
                let (o, l) =
                    attn_fwd::<f64>(slice(q, ql)?, slice(k, kl)?, slice(v, vl)?, &self.geom);
                (CpuStorage::F64(o), l)
            }
            _ => candle_core::bail!("packed_causal_attention: f32 or f64 expected"),
        };
        *self.lse.lock().expect("lse lock") = Some(lse);
        Ok((out, ql.shape().clone()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        dout: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let guard = self.lse.lock().expect("lse lock");
        let Some(lse) = guard.as_ref() else {
            candle_core::bail!("packed_causal_attention: backward before forward")
        };
        fn go<T: Elem>(
            q: &Tensor,
            k: &Tensor,
            v: &Tensor,
            o: &Tensor,
            dout: &Tensor,
            lse: &[f64],
            g: &Geom,
        ) -> Result<(Tensor, Tensor, Tensor)> {
            let (dq, dk, dv) = with2::<T, _>(q, k, |qs, ks| {
                with2::<T, _>(v, o, |vs, os| {
                    with1::<T, _>(dout, |ds| Ok(attn_bwd(qs, ks, vs, os, lse, ds, g)))
                })
            })?;
            Ok((
                Tensor::from_vec(dq, q.shape(), q.device())?,
                Tensor::from_vec(dk, k.shape(), k.device())?,
                Tensor::from_vec(dv, v.shape(), v.device())?,
            ))
        }
        let (dq, dk, dv) = match q.dtype() {
            DType::F32 => go::<f32>(q, k, v, res, dout, lse, &self.geom)?,
            _ => go::<f64>(q, k, v, res, dout, lse, &self.geom)?,
        };
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};
    use rand::{Rng, SeedableRng};

    fn rnd(n: usize, seed: u64) -> Vec<f64> {
        let mut r = rand::rngs::StdRng::seed_from_u64(seed);
        (0..n).map(|_| r.random_range(-1.0..1.0)).collect()
    }

    fn t(v: &[f64], shape: &[usize]) -> Tensor {
        Tensor::from_vec(v.to_vec(), shape, &Device::Cpu).expect("tensor")
    }

    /// `loss(inputs) = sum(f(inputs) * probe)`: the analytic gradient of
    /// each input against central finite differences (f64, h = 1e-6).
    fn check_fd(inputs: &[(Vec<f64>, Vec<usize>)], f: &dyn Fn(&[Tensor]) -> Result<Tensor>) {
        let vars: Vec<Var> = inputs
            .iter()
            .map(|(v, s)| Var::from_tensor(&t(v, s)).expect("var"))
            .collect();
        let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let y = f(&ts).expect("forward");
        let probe = t(&rnd(y.elem_count(), 99), y.dims());
        let grads = (y * &probe)
            .expect("mul")
            .sum_all()
            .expect("sum")
            .backward()
            .expect("backward");
        let loss = |xs: &[Tensor]| -> f64 {
            (f(xs).expect("forward") * &probe)
                .and_then(|p| p.sum_all())
                .and_then(|s| s.to_scalar::<f64>())
                .expect("loss")
        };
        let h = 1e-6;
        for (a, (x, shape)) in inputs.iter().enumerate() {
            let g: Vec<f64> = grads
                .get(vars[a].as_tensor())
                .expect("gradient")
                .flatten_all()
                .and_then(|g| g.to_vec1())
                .expect("grad values");
            for i in 0..x.len() {
                let at = |delta: f64| {
                    let mut xs = ts.clone();
                    let mut v = x.clone();
                    v[i] += delta;
                    xs[a] = t(&v, shape);
                    loss(&xs)
                };
                let fd = (at(h) - at(-h)) / (2.0 * h);
                assert!(
                    (fd - g[i]).abs() < 1e-6 * (1.0 + fd.abs()),
                    "input {a} element {i}: analytic {} vs finite difference {fd}",
                    g[i]
                );
            }
        }
    }

    fn close(a: &Tensor, b: &Tensor, tol: f64) {
        let a: Vec<f64> = a
            .flatten_all()
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap()
            .to_vec1()
            .unwrap();
        let b: Vec<f64> = b
            .flatten_all()
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert!(
                (x - y).abs() <= tol * (1.0 + y.abs()),
                "element {i}: {x} vs {y}"
            );
        }
    }

    #[test]
    fn rms_norm_matches_formula_and_finite_differences() {
        let (x, w) = (rnd(5 * 7, 1), rnd(7, 2));
        let y = rms_norm(&t(&x, &[5, 7]), &t(&w, &[7]), 1e-5).unwrap();
        let mut want = Vec::new();
        for row in x.chunks(7) {
            let r = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / 7.0 + 1e-5).sqrt();
            want.extend(row.iter().zip(&w).map(|(v, w)| v * r * w));
        }
        close(&y, &t(&want, &[5, 7]), 1e-12);
        check_fd(&[(x, vec![5, 7]), (w, vec![7])], &|v| {
            rms_norm(&v[0], &v[1], 1e-5)
        });
    }

    #[test]
    fn rope_matches_rotation_and_finite_differences() {
        let (n, heads, d) = (4, 3, 6);
        let x = rnd(n * heads * d, 3);
        let ang = rnd(n * d / 2, 4);
        let c: Vec<f64> = ang.iter().map(|a| (3.0 * a).cos()).collect();
        let s: Vec<f64> = ang.iter().map(|a| (3.0 * a).sin()).collect();
        let (ct, st) = (t(&c, &[n, d / 2]), t(&s, &[n, d / 2]));
        let y: Vec<f64> = rope(&t(&x, &[n, heads, d]), &ct, &st)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        // Each pair (x_i, x_{i + d/2}) times e^{i angle}.
        for tok in 0..n {
            for h in 0..heads {
                for i in 0..d / 2 {
                    let b = (tok * heads + h) * d;
                    let (re, im) = (x[b + i], x[b + i + d / 2]);
                    let (cc, ss) = (c[tok * d / 2 + i], s[tok * d / 2 + i]);
                    assert!((y[b + i] - (re * cc - im * ss)).abs() < 1e-12);
                    assert!((y[b + i + d / 2] - (im * cc + re * ss)).abs() < 1e-12);
                }
            }
        }
        check_fd(&[(x, vec![n, heads, d])], &|v| rope(&v[0], &ct, &st));
    }

    #[test]
    fn swiglu_matches_formula_and_finite_differences() {
        let (g, u) = (rnd(40, 5), rnd(40, 6));
        let y = swiglu(&t(&g, &[5, 8]), &t(&u, &[5, 8])).unwrap();
        let want: Vec<f64> = g
            .iter()
            .zip(&u)
            .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
            .collect();
        close(&y, &t(&want, &[5, 8]), 1e-12);
        check_fd(&[(g, vec![5, 8]), (u, vec![5, 8])], &|v| {
            swiglu(&v[0], &v[1])
        });
    }

    /// The packed backward ops the CUDA path runs (one output `[dx | dw]`,
    /// `[dg | du]`, split) give the CPU backward's gradients exactly.
    #[test]
    fn packed_backward_ops_split_into_the_backwards_gradients() {
        let (x, w, dy) = (rnd(6 * 9, 11), rnd(9, 12), rnd(6 * 9, 13));
        let (x, w, dy) = (t(&x, &[2, 3, 9]), t(&w, &[9]), t(&dy, &[2, 3, 9]));
        let (vx, vw) = (Var::from_tensor(&x).unwrap(), Var::from_tensor(&w).unwrap());
        let g = (rms_norm(vx.as_tensor(), vw.as_tensor(), 1e-6).unwrap() * &dy)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let (dx, dw) = rms_norm_bwd_packed(&x, &w, &dy, 1e-6).unwrap();
        assert_eq!((dx.dims(), dw.dims()), (x.dims(), w.dims()));
        close(&dx, g.get(vx.as_tensor()).unwrap(), 0.0);
        close(&dw, g.get(vw.as_tensor()).unwrap(), 0.0);

        let (gt, ut) = (t(&rnd(40, 14), &[5, 8]), t(&rnd(40, 15), &[5, 8]));
        let dy = t(&rnd(40, 16), &[5, 8]);
        let (vg, vu) = (
            Var::from_tensor(&gt).unwrap(),
            Var::from_tensor(&ut).unwrap(),
        );
        let g = (swiglu(vg.as_tensor(), vu.as_tensor()).unwrap() * &dy)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let (dg, du) = swiglu_bwd_packed(&gt, &ut, &dy).unwrap();
        assert_eq!((dg.dims(), du.dims()), (gt.dims(), ut.dims()));
        close(&dg, g.get(vg.as_tensor()).unwrap(), 0.0);
        close(&du, g.get(vu.as_tensor()).unwrap(), 0.0);
    }

    /// Brute-force float64 attention: each sequence on its own, GQA by
    /// index, full softmax over the causal window.
    fn attention_reference(
        q: &[f64],
        k: &[f64],
        v: &[f64],
        lens: &[usize],
        nh: usize,
        nkv: usize,
        d: usize,
    ) -> Vec<f64> {
        let mut out = vec![0.0; q.len()];
        let mut s0 = 0;
        for &l in lens {
            for i in s0..s0 + l {
                for h in 0..nh {
                    let kh = h / (nh / nkv);
                    let qi = &q[(i * nh + h) * d..][..d];
                    let sc: Vec<f64> = (s0..=i)
                        .map(|j| {
                            let kj = &k[(j * nkv + kh) * d..][..d];
                            qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>() / (d as f64).sqrt()
                        })
                        .collect();
                    let m = sc.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = sc.iter().map(|s| (s - m).exp()).sum();
                    for (jj, s) in sc.iter().enumerate() {
                        let j = s0 + jj;
                        for e in 0..d {
                            out[(i * nh + h) * d + e] +=
                                (s - m).exp() / z * v[(j * nkv + kh) * d + e];
                        }
                    }
                }
            }
            s0 += l;
        }
        out
    }

    #[test]
    fn packed_attention_matches_reference_composed_and_finite_differences() {
        let (nh, nkv, d) = (4, 2, 6);
        let lens = [3usize, 1, 5];
        let n: usize = lens.iter().sum();
        let (q, k, v) = (rnd(n * nh * d, 7), rnd(n * nkv * d, 8), rnd(n * nkv * d, 9));
        let (qt, kt, vt) = (t(&q, &[n, nh, d]), t(&k, &[n, nkv, d]), t(&v, &[n, nkv, d]));
        let want = t(
            &attention_reference(&q, &k, &v, &lens, nh, nkv, d),
            &[n, nh, d],
        );
        let fused = packed_causal_attention(&qt, &kt, &vt, &lens).unwrap();
        close(&fused, &want, 1e-12);
        let geom = Geom {
            nh,
            nkv,
            d,
            starts: vec![0, 3, 4, 9],
        };
        close(
            &composed_attention(&qt, &kt, &vt, &geom).unwrap(),
            &want,
            1e-12,
        );
        // f32 within f32 rounding of the f64 result.
        let f32s = |x: &Tensor| x.to_dtype(DType::F32).unwrap();
        let y32 = packed_causal_attention(&f32s(&qt), &f32s(&kt), &f32s(&vt), &lens).unwrap();
        close(&y32, &want, 1e-5);
        check_fd(
            &[
                (q, vec![n, nh, d]),
                (k, vec![n, nkv, d]),
                (v, vec![n, nkv, d]),
            ],
            &|x| packed_causal_attention(&x[0], &x[1], &x[2], &lens),
        );
    }

    /// Long enough rows and a head size of 64 for the register-blocked
    /// paths (full blocks of queries, key columns and output values) and
    /// their tails: output and gradients against the composed candle ops'
    /// autograd, in f64.
    #[test]
    fn packed_attention_blocked_paths_match_composed_autograd() {
        let (nh, nkv, d) = (4, 2, 64);
        let lens = [37usize, 20, 3];
        let (qkv, probe, geom) = attention_case(&lens, nh, nkv, d, 21);
        let [q, k, v] = qkv.each_ref().map(Var::as_tensor);
        let fused = packed_causal_attention(q, k, v, &lens).unwrap();
        let composed = composed_attention(q, k, v, &geom).unwrap();
        close(&fused, &composed, 1e-12);
        close_gradients(&qkv, &probe, fused, composed, 1e-11);
    }

    /// Variables `q [N, nh, d]`, `k, v [N, nkv, d]` (seeds `seed` ..
    /// `seed + 2`), a probe of the output's shape (`seed + 3`) and the
    /// geometry of sequences `lens`.
    fn attention_case(
        lens: &[usize],
        nh: usize,
        nkv: usize,
        d: usize,
        seed: u64,
    ) -> ([Var; 3], Tensor, Geom) {
        let n: usize = lens.iter().sum();
        let mk = |v: Vec<f64>, s: &[usize]| Var::from_tensor(&t(&v, s)).unwrap();
        let qkv = [
            mk(rnd(n * nh * d, seed), &[n, nh, d]),
            mk(rnd(n * nkv * d, seed + 1), &[n, nkv, d]),
            mk(rnd(n * nkv * d, seed + 2), &[n, nkv, d]),
        ];
        let probe = t(&rnd(n * nh * d, seed + 3), &[n, nh, d]);
        let mut starts = vec![0];
        for &l in lens {
            starts.push(starts.last().unwrap() + l);
        }
        (qkv, probe, Geom { nh, nkv, d, starts })
    }

    /// The gradients of `sum(a * probe)` and `sum(b * probe)` in each of
    /// `vars` agree within `tol`.
    fn close_gradients(vars: &[Var], probe: &Tensor, a: Tensor, b: Tensor, tol: f64) {
        let grads = |y: Tensor| (y * probe).unwrap().sum_all().unwrap().backward().unwrap();
        let (ga, gb) = (grads(a), grads(b));
        for x in vars {
            close(
                ga.get(x.as_tensor()).unwrap(),
                gb.get(x.as_tensor()).unwrap(),
                tol,
            );
        }
    }

    /// The recomputing attention (the path of CUDA and bf16) gives the
    /// composed candle ops' output and candle's gradients of them (f64,
    /// grouped heads, a one-token sequence).
    #[test]
    fn recomputed_attention_matches_composed_autograd() {
        let (nh, nkv, d) = (6, 2, 8);
        let lens = [11usize, 1, 6];
        let (qkv, probe, geom) = attention_case(&lens, nh, nkv, d, 41);
        let [q, k, v] = qkv.each_ref().map(Var::as_tensor);
        let re = recomputed_attention(q, k, v, &geom).unwrap();
        let co = composed_attention(q, k, v, &geom).unwrap();
        close(&re, &co, 1e-12);
        let vals = |x: &Tensor| x.flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let want = attention_reference(&vals(q), &vals(k), &vals(v), &lens, nh, nkv, d);
        close(&re, &t(&want, re.dims()), 1e-12);
        close_gradients(&qkv, &probe, re, co, 1e-11);
    }

    /// bf16 inputs on the CPU take the paths without a CPU kernel (candle
    /// ops; the recomputing attention, as on a GPU): within bf16 rounding
    /// of the f64 kernels.
    #[test]
    fn composed_paths_match_the_kernels_in_bf16() {
        let rel = |a: &Tensor, b: &Tensor| -> f64 {
            let a = a.to_dtype(DType::F64).unwrap();
            let num = (&a - b).unwrap().sqr().unwrap().sum_all().unwrap();
            let den = b.sqr().unwrap().sum_all().unwrap();
            (num.to_scalar::<f64>().unwrap() / den.to_scalar::<f64>().unwrap()).sqrt()
        };
        let bf = |x: &Tensor| x.to_dtype(DType::BF16).unwrap();
        // Inputs rounded to bf16 first, so both sides see the same values.
        let r64 = |v: Vec<f64>, s: &[usize]| bf(&t(&v, s)).to_dtype(DType::F64).unwrap();
        let (n, nh, nkv, d) = (29, 4, 2, 16);
        let x = r64(rnd(n * 32, 31), &[n, 32]);
        let w = r64(rnd(32, 32), &[32]);
        let e = rel(
            &rms_norm(&bf(&x), &bf(&w), 1e-6).unwrap(),
            &rms_norm(&x, &w, 1e-6).unwrap(),
        );
        assert!(e < 1e-2, "rms_norm {e}");
        let u = r64(rnd(n * 32, 33), &[n, 32]);
        let e = rel(&swiglu(&bf(&x), &bf(&u)).unwrap(), &swiglu(&x, &u).unwrap());
        assert!(e < 1e-2, "swiglu {e}");
        let q = r64(rnd(n * nh * d, 34), &[n, nh, d]);
        let ang = rnd(n * d / 2, 35);
        let c = r64(ang.iter().map(|a| a.cos()).collect(), &[n, d / 2]);
        let sn = r64(ang.iter().map(|a| a.sin()).collect(), &[n, d / 2]);
        let e = rel(
            &rope(&bf(&q), &bf(&c), &bf(&sn)).unwrap(),
            &rope(&q, &c, &sn).unwrap(),
        );
        assert!(e < 1e-2, "rope {e}");
        let k = r64(rnd(n * nkv * d, 36), &[n, nkv, d]);
        let v = r64(rnd(n * nkv * d, 37), &[n, nkv, d]);
        let lens = [20, 9];
        let got = packed_causal_attention(&bf(&q), &bf(&k), &bf(&v), &lens).unwrap();
        let e = rel(&got, &packed_causal_attention(&q, &k, &v, &lens).unwrap());
        assert!(e < 1e-2, "attention {e}");
    }

    #[test]
    fn f32_gradients_match_f64() {
        // The f32 kernels (f32 accumulation) against the f64 ones.
        let (x, w) = (rnd(6 * 64, 11), rnd(64, 12));
        let grads = |dt: DType| -> Vec<f64> {
            let xv = Var::from_tensor(&t(&x, &[6, 64]).to_dtype(dt).unwrap()).unwrap();
            let wv = t(&w, &[64]).to_dtype(dt).unwrap();
            let y = rms_norm(xv.as_tensor(), &wv, 1e-6).unwrap();
            let y = swiglu(&y, &y.sin().unwrap()).unwrap();
            let g = y.sum_all().unwrap().backward().unwrap();
            g.get(xv.as_tensor())
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap()
        };
        let (a, b) = (grads(DType::F32), grads(DType::F64));
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() < 1e-4 * (1.0 + y.abs()), "{x} vs {y}");
        }
    }

    #[test]
    fn bad_shapes_are_errors() {
        let x = t(&rnd(12, 1), &[2, 6]);
        assert!(rms_norm(&x, &t(&rnd(5, 2), &[5]), 1e-6).is_err());
        assert!(swiglu(&x, &t(&rnd(6, 2), &[6])).is_err());
        let q = t(&rnd(24, 3), &[2, 2, 6]);
        assert!(packed_causal_attention(&q, &q, &q, &[1]).is_err());
        assert!(packed_causal_attention(&q, &t(&rnd(36, 4), &[2, 3, 6]), &q, &[2]).is_err());
    }
}
