//! The Qwen2 / Qwen3 / Llama decoder, written once for training and generation.
//!
//! The training forward ([`Transformer::forward_packed`]) runs sequences
//! packed back to back in one token stream (no padding computed) through
//! `arbor-ops`' fused ops with hand-written backward: RMSNorm, RoPE (after
//! the q/k RMSNorm for Qwen3), SwiGLU and causal attention that respects the
//! sequence boundaries without keeping a `[T, T]` matrix. None of
//! candle-nn's backward-less fused kernels (`softmax_last_dim`, `rms_norm`,
//! `rope*`, `sdpa`) are used.
//!
//! For generation a layer is split into [`Attention::project`] (QKV
//! projection, q/k norm, RoPE at per-token positions) and an
//! [`AttentionBackend`] that turns the new `q, k, v` into attention output:
//! the paged engine supplies its backend over the KV cache and runs the very
//! same layers, so there is one copy of the weights.

use arbor_ops::cpu::packed::PackedWeights;
use candle_core::{DType, Device, Module, Tensor, D};
use std::sync::Arc;

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::rope::{apply_rope, Rope};
use crate::weights::{Init, ParamLoader};

/// Std of the normal init used for fresh (random) weights.
pub const INIT_STD: f64 = 0.02;

/// `y = x W^T + b` with `W: [out, in]`, on inputs of any rank; with a LoRA
/// adapter, `y = x W^T + b + s (x A^T) B^T` (`A: [r, in]`, `B: [out, r]`,
/// `s = alpha / r`).
#[derive(Debug, Clone)]
pub struct Linear {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
    pub lora: Option<LoraAdapter>,
    /// `weight` repacked for the generation forward's f32 CPU matmuls
    /// ([`Transformer::pack_weights`]); `None`: packed per call. The same
    /// bits either way; a pack is a copy, so it is stale once `weight`
    /// changes (the engine's `invalidate` calls `pack_weights` again).
    pub packed: Option<Arc<PackedWeights>>,
}

/// A low-rank adapter on a [`Linear`] (Hu et al., LoRA): `A` drawn
/// `N(0, 1/in)`, `B` zero, so training starts from the base model.
#[derive(Debug, Clone)]
pub struct LoraAdapter {
    pub a: Tensor,
    pub b: Tensor,
    pub scale: f64,
}

/// LoRA on the policy: which projections get adapters, rank and alpha. The
/// base weights stay frozen; only the adapters (and a value head) train.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoraConfig {
    /// Rank `r` of each adapter `B A` (`A: [r, in]`, `B: [out, r]`, >= 1).
    pub rank: usize,
    /// Scale numerator: the adapter adds `(alpha / rank) B A x`.
    pub alpha: f64,
    /// Projection names (`q_proj`, `k_proj`, `v_proj`, `o_proj`,
    /// `gate_proj`, `up_proj`, `down_proj`).
    pub targets: Vec<String>,
}

/// Every projection an adapter can target (the default targets all).
const LORA_TARGETS: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

impl Default for LoraConfig {
    fn default() -> Self {
        LoraConfig {
            rank: 16,
            alpha: 32.0,
            targets: LORA_TARGETS.map(String::from).to_vec(),
        }
    }
}

impl LoraConfig {
    /// Names a target that is no projection, or a zero rank.
    pub fn validate(&self) -> std::result::Result<(), String> {
        if self.rank == 0 {
            return Err("rank must be >= 1".into());
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            return Err(format!("alpha must be > 0, got {}", self.alpha));
        }
        if self.targets.is_empty() {
            return Err("targets is empty: the frozen policy would not train at all".into());
        }
        if let Some(t) = self
            .targets
            .iter()
            .find(|t| !LORA_TARGETS.contains(&t.as_str()))
        {
            return Err(format!(
                "target `{t}` is not one of {}",
                LORA_TARGETS.join(", ")
            ));
        }
        let mut seen = std::collections::BTreeSet::new();
        if let Some(t) = self.targets.iter().find(|t| !seen.insert(t.as_str())) {
            return Err(format!("target `{t}` is listed twice"));
        }
        Ok(())
    }
}

impl Linear {
    /// A plain linear layer (no adapter).
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Linear {
            weight,
            bias,
            lora: None,
            packed: None,
        }
    }

    fn load(p: &ParamLoader<'_>, name: &str, out: usize, inp: usize, bias: bool) -> Result<Self> {
        let weight = p.get(
            &format!("{name}.weight"),
            &[out, inp],
            Init::Normal(INIT_STD),
        )?;
        let bias = if bias {
            Some(p.get(&format!("{name}.bias"), &[out], Init::Zeros)?)
        } else {
            None
        };
        let short = name.rsplit('.').next().unwrap_or(name);
        let lora = match p.lora() {
            Some(l) if l.targets.iter().any(|t| t == short) => Some(LoraAdapter {
                a: p.get_or_init(
                    &format!("{name}.lora_A.weight"),
                    &[l.rank, inp],
                    Init::Normal(1.0 / (inp as f64).sqrt()),
                )?,
                b: p.get_or_init(
                    &format!("{name}.lora_B.weight"),
                    &[out, l.rank],
                    Init::Zeros,
                )?,
                scale: l.alpha / l.rank as f64,
            }),
            _ => None,
        };
        Ok(Linear {
            weight,
            bias,
            lora,
            packed: None,
        })
    }

    /// `W + s B A` (the weight with the adapter folded in), in `W`'s dtype.
    pub fn merged_weight(&self) -> Result<Tensor> {
        Ok(match &self.lora {
            None => self.weight.clone(),
            Some(l) => {
                let ba = (l.b.matmul(&l.a)? * l.scale)?.to_dtype(self.weight.dtype())?;
                (&self.weight + ba)?
            }
        })
    }
}

impl Linear {
    /// [`Linear::forward`] with the weight cast to `dt` first, inside the
    /// autograd graph (`None`: as it is): the training forward's bf16
    /// matmuls over an f32 master weight on the CPU
    /// ([`Transformer::set_train_matmul_dtype`]), whose gradient reaches
    /// the weight in f32.
    ///
    /// On the CPU, f32 `x` over an f32 weight cast to bf16 multiplies
    /// through [`arbor_ops::matmul_nt_bf16_op`], which rounds the weight
    /// itself and whose backward uses the same bf16 dot products, the
    /// weight's gradient summed and kept in f32.
    pub fn forward_cast(&self, x: &Tensor, dt: Option<DType>) -> candle_core::Result<Tensor> {
        match dt {
            Some(DType::BF16)
                if x.device().is_cpu()
                    && x.dtype() == DType::F32
                    && self.weight.dtype() == DType::F32 =>
            {
                self.forward_with(x, &self.weight, arbor_ops::matmul_nt_bf16_op)
            }
            Some(dt) if dt != self.weight.dtype() => {
                self.forward_with(x, &self.weight.to_dtype(dt)?, matmul_nt)
            }
            _ => self.forward(x),
        }
    }

    /// `x w^T` through `mm` (over `[n, in]` rows), plus the adapter and the
    /// bias.
    fn forward_with(
        &self,
        x: &Tensor,
        w: &Tensor,
        mm: fn(&Tensor, &Tensor) -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<Tensor> {
        let dims = x.dims();
        let inp = dims[dims.len() - 1];
        let n = x.elem_count() / inp;
        let x2 = x.reshape((n, inp))?;
        let mut y = mm(&x2, w)?;
        if let Some(l) = &self.lora {
            y = (y + (matmul_nt(&matmul_nt(&x2, &l.a)?, &l.b)? * l.scale)?)?;
        }
        let y = match &self.bias {
            Some(b) if b.dtype() == y.dtype() => y.broadcast_add(b)?,
            // A bias of another dtype (an f32 master bias under bf16
            // compute): added in f32, so its gradient, a sum over every
            // row, is summed in f32; then cast back.
            Some(b) => {
                let acc = accum_dtype(y.dtype());
                y.to_dtype(acc)?
                    .broadcast_add(&b.to_dtype(acc)?)?
                    .to_dtype(y.dtype())?
            }
            None => y,
        };
        let mut out_dims = dims.to_vec();
        *out_dims.last_mut().expect("rank >= 1") = self.weight.dim(0)?;
        y.reshape(out_dims)
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.forward_with(x, &self.weight, matmul_nt)
    }
}

/// `x [n, in] @ w[out, in]^T`. On the CPU, for f32 `x`, Arbor's
/// row-invariant kernel ([`arbor_ops::matmul_nt_op`]: a row's result never
/// depends on the other rows of the call, so a sequence's logits are the
/// same whatever batch it decodes in, prefilled or cached); otherwise
/// candle's matmul.
///
/// f32 `x` with bf16 `w` (bf16 matrices under f32 compute,
/// [`ParamLoader::bf16_matrices`]) computes `bf16(x) w^T` with f32 sums
/// through [`arbor_ops::matmul_nt_op`] on the CPU; the pair on another
/// device gets the same exact products through candle in f32 (a per-call
/// f32 copy of `w`; only the summation order differs).
///
/// bf16 (or f16) `x` with an f32 `w` (mixed precision: f32 master weights
/// under a half-precision training forward, [`Transformer::train_dtype`])
/// casts `w` to `x`'s dtype first, inside the autograd graph, so the
/// gradient reaches the f32 weight as f32.
pub fn matmul_nt(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    let cpu = x.device().is_cpu();
    match (x.dtype(), w.dtype()) {
        (DType::F32, DType::F32 | DType::BF16) if cpu => arbor_ops::matmul_nt_op(x, w),
        (DType::F32, DType::BF16) => x
            .to_dtype(DType::BF16)?
            .to_dtype(DType::F32)?
            .matmul(&w.to_dtype(DType::F32)?.t()?),
        (DType::BF16 | DType::F16, DType::F32) => x.matmul(&w.to_dtype(x.dtype())?.t()?),
        _ => x.matmul(&w.t()?),
    }
}

/// `x W_g^T + b_g` for several linear layers of one input `x: [1, T, in]`
/// in one grouped matmul ([`arbor_ops::matmul_nt_multi`]: one thread
/// hand-off, each product computed exactly as [`matmul_nt`] computes it
/// alone, from the layer's pack when it has one, [`Linear::packed`]).
/// Generation forward only (no autograd graph). Falls back to one
/// [`Linear::forward`] each when a layer has an adapter, a weight is not a
/// contiguous f32 or bf16 CPU tensor.
fn linear_rows_group(x: &Tensor, lins: &[&Linear]) -> Result<Vec<Tensor>> {
    let separate = || -> Result<Vec<Tensor>> { lins.iter().map(|l| Ok(l.forward(x)?)).collect() };
    let dims = x.dims().to_vec();
    let k = dims[dims.len() - 1];
    let m = x.elem_count() / k.max(1);
    let usable = |w: &Tensor| matches!(w.dtype(), DType::F32 | DType::BF16);
    if x.dtype() != DType::F32
        || !x.device().is_cpu()
        || lins.iter().any(|l| {
            l.lora.is_some()
                || !l.weight.is_contiguous()
                || !l.weight.device().is_cpu()
                || l.weight.dim(1).ok() != Some(k)
                || !usable(&l.weight)
        })
    {
        return separate();
    }
    let guards: Vec<_> = lins.iter().map(|l| l.weight.storage_and_layout()).collect();
    let mut ws = Vec::with_capacity(lins.len());
    for ((storage, layout), l) in guards.iter().zip(lins) {
        if let Some(p) = l.pack_of_width(k) {
            ws.push(arbor_ops::WeightRows::Packed(p));
            continue;
        }
        let (start, len) = (layout.start_offset(), l.weight.elem_count());
        ws.push(match &**storage {
            candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)) => {
                arbor_ops::WeightRows::F32(&v[start..start + len])
            }
            candle_core::Storage::Cpu(candle_core::CpuStorage::BF16(v)) => {
                arbor_ops::WeightRows::Bf16(&v[start..start + len])
            }
            _ => return separate(),
        });
    }
    let ns = lins
        .iter()
        .map(|l| l.weight.dim(0))
        .collect::<candle_core::Result<Vec<usize>>>()?;
    let ys = with_cpu_f32(x, |xs| arbor_ops::matmul_nt_multi(xs, &ws, m, k, &ns))?;
    ys.into_iter()
        .zip(lins)
        .zip(ns)
        .map(|((y, l), n)| {
            let mut out_dims = dims.clone();
            *out_dims.last_mut().expect("rank >= 1") = n;
            let y = Tensor::from_vec(y, out_dims, x.device())?;
            Ok(match &l.bias {
                Some(b) => y.broadcast_add(b)?,
                None => y,
            })
        })
        .collect()
}

/// One layer of the generation forward ([`linear_rows_group`] of one), so
/// it reads the layer's pack ([`Linear::packed`]) when there is one.
fn linear_rows(x: &Tensor, l: &Linear) -> Result<Tensor> {
    Ok(linear_rows_group(x, &[l])?
        .pop()
        .expect("one product per layer"))
}

impl Linear {
    /// The pack ([`Linear::packed`]) of this f32 weight when it takes inputs
    /// of width `k`.
    fn pack_of_width(&self, k: usize) -> Option<&PackedWeights> {
        self.packed.as_deref().filter(|p| {
            self.weight.dtype() == DType::F32
                && p.k() == k
                && self.weight.dim(0).ok() == Some(p.n())
        })
    }
}

/// The pack of `l` when the generation forward can compute `x W^T` from it
/// alone: `x` a CPU f32 tensor, `l` without bias or adapter
/// ([`Linear::pack_of_width`]).
fn pack_for<'a>(x: &Tensor, l: &'a Linear) -> Option<&'a PackedWeights> {
    let cpu_f32 = x.dtype() == DType::F32 && x.device().is_cpu();
    let plain = l.lora.is_none() && l.bias.is_none();
    if !(cpu_f32 && plain) {
        return None;
    }
    l.pack_of_width(*x.dims().last()?)
}

/// `r + x W^T` for the generation forward: with a pack ([`pack_for`]) and
/// a CPU f32 `r` of the output's size, the residual addition fused into
/// the product ([`arbor_ops::cpu::packed::matmul_packed_add`], the same f32
/// sums); otherwise [`linear_rows`] then [`add_rows`].
fn linear_rows_add(x: &Tensor, l: &Linear, r: &Tensor) -> Result<Tensor> {
    if let Some(p) = pack_for(x, l) {
        let m = x.elem_count() / p.k().max(1);
        if r.dtype() == DType::F32 && r.device().is_cpu() && r.elem_count() == m * p.n() {
            let y = with_cpu_f32(x, |xs| {
                with_cpu_f32(r, |rs| {
                    arbor_ops::cpu::packed::matmul_packed_add(xs, m, p, rs)
                })
            })??;
            return Ok(Tensor::from_vec(y, r.shape(), x.device())?);
        }
    }
    add_rows(r, &linear_rows(x, l)?)
}

/// RMSNorm over the last dim, computed in f32 (f64 for f64 inputs) as in HF:
/// `w * (x / sqrt(mean(x^2) + eps))`.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    pub weight: Tensor,
    pub eps: f64,
}

impl RmsNorm {
    fn load(p: &ParamLoader<'_>, name: &str, dim: usize, eps: f64) -> Result<Self> {
        Ok(RmsNorm {
            weight: p.get(&format!("{name}.weight"), &[dim], Init::Ones)?,
            eps,
        })
    }

    /// The generation forward's fused RMSNorm (CPU, f32).
    fn forward_rows(&self, x: &Tensor) -> Result<Tensor> {
        let out = with_cpu_f32(x, |xs| {
            with_cpu_f32(&self.weight, |w| {
                arbor_ops::cpu::rows::rms_norm_rows(xs, w, self.eps as f32)
            })
        })??;
        Ok(Tensor::from_vec(out, x.shape(), x.device())?)
    }
}

/// Accumulation dtype for reductions: f64 stays f64, everything else is f32.
pub fn accum_dtype(dt: DType) -> DType {
    if dt == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

impl Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let dt = x.dtype();
        let xf = x.to_dtype(accum_dtype(dt))?;
        let var = xf.sqr()?.mean_keepdim(D::Minus1)?;
        let normed = xf.broadcast_div(&(var + self.eps)?.sqrt()?)?;
        normed.to_dtype(dt)?.broadcast_mul(&self.weight)
    }
}

/// SwiGLU MLP: `down(silu(gate x) * up x)`.
#[derive(Debug, Clone)]
pub struct Mlp {
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let g = self.gate.forward(x)?.silu()?;
        self.down.forward(&(g * self.up.forward(x)?)?)
    }
}

impl Mlp {
    /// The generation forward's MLP plus the residual `r`, that is
    /// `r + down(silu(gate x) u x)`: SwiGLU's product fused into the gate
    /// and up products when both have packs
    /// ([`arbor_ops::cpu::packed::swiglu_packed`]; else
    /// [`arbor_ops::cpu::rows::silu_mul`] after them), and the residual addition
    /// into the down projection ([`linear_rows_add`]). The same bits either
    /// way.
    fn forward_rows_add(&self, x: &Tensor, r: &Tensor) -> Result<Tensor> {
        let gu = match (pack_for(x, &self.gate), pack_for(x, &self.up)) {
            (Some(g), Some(u)) if g.n() == u.n() => {
                let k = g.k();
                let m = x.elem_count() / k.max(1);
                let y = with_cpu_f32(x, |xs| arbor_ops::cpu::packed::swiglu_packed(xs, m, g, u))?;
                let mut dims = x.dims().to_vec();
                *dims.last_mut().expect("rank >= 1") = g.n();
                Tensor::from_vec(y, dims, x.device())?
            }
            _ => {
                let gu = linear_rows_group(x, &[&self.gate, &self.up])?;
                let (g, u) = (&gu[0], &gu[1]);
                let y = with_cpu_f32(g, |g| {
                    with_cpu_f32(u, |u| arbor_ops::cpu::rows::silu_mul(g, u))
                })??;
                Tensor::from_vec(y, g.shape(), g.device())?
            }
        };
        linear_rows_add(&gu, &self.down, r)
    }
}

/// Turns one layer's new queries, keys and values into attention output.
pub trait AttentionBackend {
    /// `q: [B, n_heads, T, D]`, `k, v: [B, n_kv_heads, T, D]` for the T new
    /// tokens of each of B rows (RoPE applied). Returns `[B, T, n_heads * D]`.
    fn attend(&mut self, layer: usize, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor>;

    /// Whether the forward around this backend is for generation only (no
    /// gradients wanted): on the CPU in f32 the model then runs its fused
    /// row-wise kernels ([`arbor_ops::cpu::rows`]) instead of differentiable
    /// candle op chains. The training path's backends keep the default.
    fn inference(&self) -> bool {
        false
    }
}

/// The contiguous f32 values of a CPU f32 tensor, handed to `f` without a
/// copy (a strided tensor is made contiguous first).
pub fn with_cpu_f32<R>(x: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    let x = x.contiguous()?;
    let (storage, layout) = x.storage_and_layout();
    match &*storage {
        candle_core::Storage::Cpu(c) => {
            let v = c.as_slice::<f32>()?;
            let start = layout.start_offset();
            Ok(f(&v[start..start + x.elem_count()]))
        }
        _ => Err(ModelError::Input(
            "fused CPU kernel given a device tensor".into(),
        )),
    }
}

/// `a + b` for the generation forward ([`arbor_ops::cpu::rows::add`]: the same
/// f32 sums as candle's add, on the rayon pool rather than candle's).
fn add_rows(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let out = with_cpu_f32(a, |a| with_cpu_f32(b, |b| arbor_ops::cpu::rows::add(a, b)))??;
    Ok(Tensor::from_vec(out, a.shape(), a.device())?)
}

/// `f` with an optional per-head norm's `(weight, eps)` as f32 values.
fn with_norm<R>(norm: Option<&RmsNorm>, f: impl FnOnce(Option<(&[f32], f32)>) -> R) -> Result<R> {
    match norm {
        Some(nm) => with_cpu_f32(&nm.weight, |w| f(Some((w, nm.eps as f32)))),
        None => Ok(f(None)),
    }
}

/// Per-token RoPE tables of one fused forward, `[T, D/2]` each.
struct RopeRows {
    cos: Vec<f32>,
    sin: Vec<f32>,
}

/// Self-attention projections of one layer.
#[derive(Debug, Clone)]
pub struct Attention {
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
    pub q_norm: Option<RmsNorm>,
    pub k_norm: Option<RmsNorm>,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Round K and V to bf16 values (after RoPE), as a bf16 model's K/V
    /// tensors are: set for bf16 matrices under f32 compute
    /// ([`ParamLoader::bf16_matrices`]), whose KV cache then holds bf16.
    pub kv_bf16: bool,
}

/// `x` (a CPU f32 tensor: [`Attention::kv_bf16`] is only set for those)
/// rounded to bf16 values (nearest even), kept in f32; the vectorised
/// equivalent of `x.to_dtype(BF16)?.to_dtype(F32)`.
fn round_bf16(x: Tensor) -> Result<Tensor> {
    let r = with_cpu_f32(&x, arbor_ops::round_bf16)?;
    Ok(Tensor::from_vec(r, x.shape(), x.device())?)
}

impl Attention {
    fn load(p: &ParamLoader<'_>, name: &str, cfg: &ModelConfig) -> Result<Self> {
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        let (nh, nkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let norm = |n: &str| -> Result<Option<RmsNorm>> {
            if cfg.qk_norm {
                Ok(Some(RmsNorm::load(
                    p,
                    &format!("{name}.{n}"),
                    d,
                    cfg.rms_norm_eps,
                )?))
            } else {
                Ok(None)
            }
        };
        Ok(Attention {
            q: Linear::load(p, &format!("{name}.q_proj"), nh * d, h, cfg.qkv_bias)?,
            k: Linear::load(p, &format!("{name}.k_proj"), nkv * d, h, cfg.qkv_bias)?,
            v: Linear::load(p, &format!("{name}.v_proj"), nkv * d, h, cfg.qkv_bias)?,
            o: Linear::load(p, &format!("{name}.o_proj"), h, nh * d, cfg.o_bias)?,
            q_norm: norm("q_norm")?,
            k_norm: norm("k_norm")?,
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: d,
            kv_bf16: p.bf16_matrices(),
        })
    }

    /// `x: [B, T, H]` -> `(q [B, nh, T, D], k [B, nkv, T, D], v [B, nkv, T, D])`
    /// with q/k norm and RoPE applied (`cos, sin: [B, 1, T, D/2]`).
    pub fn project(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (b, t, _) = x.dims3()?;
        let d = self.head_dim;
        let heads = |lin: &Linear, n: usize, norm: &Option<RmsNorm>| -> Result<Tensor> {
            let y = lin.forward(x)?.reshape((b, t, n, d))?;
            let y = match norm {
                Some(nm) => nm.forward(&y)?,
                None => y,
            };
            Ok(y.transpose(1, 2)?.contiguous()?)
        };
        let q = heads(&self.q, self.n_heads, &self.q_norm)?;
        let k = heads(&self.k, self.n_kv_heads, &self.k_norm)?;
        let v = heads(&self.v, self.n_kv_heads, &None)?;
        let k = apply_rope(&k, cos, sin)?;
        if self.kv_bf16 {
            return Ok((apply_rope(&q, cos, sin)?, round_bf16(k)?, round_bf16(v)?));
        }
        Ok((apply_rope(&q, cos, sin)?, k, v))
    }
}

impl Attention {
    /// [`Attention::project`] for the generation forward of one packed row
    /// (`x: [1, T, H]`), with the head split, q/k-norm and RoPE fused.
    fn project_rows(&self, x: &Tensor, rope: &RopeRows) -> Result<(Tensor, Tensor, Tensor)> {
        let (b, t, _) = x.dims3()?;
        debug_assert_eq!(b, 1);
        let d = self.head_dim;
        let dev = x.device();
        let qkv = linear_rows_group(x, &[&self.q, &self.k, &self.v])?;
        let heads = |y: &Tensor, n: usize, norm: &Option<RmsNorm>| -> Result<Tensor> {
            let out = with_cpu_f32(y, |ys| {
                with_norm(norm.as_ref(), |nw| {
                    arbor_ops::cpu::rows::heads_rope(ys, t, n, d, nw, &rope.cos, &rope.sin)
                })
            })??;
            Ok(Tensor::from_vec(out, (1, n, t, d), dev)?)
        };
        let q = heads(&qkv[0], self.n_heads, &self.q_norm)?;
        let k = heads(&qkv[1], self.n_kv_heads, &self.k_norm)?;
        let v = qkv[2]
            .reshape((1, t, self.n_kv_heads, d))?
            .transpose(1, 2)?
            .contiguous()?;
        if self.kv_bf16 {
            return Ok((q, round_bf16(k)?, round_bf16(v)?));
        }
        Ok((q, k, v))
    }
}

/// One pre-norm decoder layer.
#[derive(Debug, Clone)]
pub struct DecoderLayer {
    pub input_norm: RmsNorm,
    pub attn: Attention,
    pub post_norm: RmsNorm,
    pub mlp: Mlp,
}

impl DecoderLayer {
    fn load(p: &ParamLoader<'_>, name: &str, cfg: &ModelConfig) -> Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        Ok(DecoderLayer {
            input_norm: RmsNorm::load(p, &format!("{name}.input_layernorm"), h, cfg.rms_norm_eps)?,
            attn: Attention::load(p, &format!("{name}.self_attn"), cfg)?,
            post_norm: RmsNorm::load(
                p,
                &format!("{name}.post_attention_layernorm"),
                h,
                cfg.rms_norm_eps,
            )?,
            mlp: Mlp {
                gate: Linear::load(p, &format!("{name}.mlp.gate_proj"), i, h, false)?,
                up: Linear::load(p, &format!("{name}.mlp.up_proj"), i, h, false)?,
                down: Linear::load(p, &format!("{name}.mlp.down_proj"), h, i, false)?,
            },
        })
    }

    /// [`DecoderLayer::forward`] for the generation forward (CPU, f32, one
    /// packed row): fused row-wise kernels, no autograd graph.
    fn forward_rows(
        &self,
        idx: usize,
        x: &Tensor,
        rope: &RopeRows,
        backend: &mut dyn AttentionBackend,
    ) -> Result<Tensor> {
        let h = self.input_norm.forward_rows(x)?;
        let (q, k, v) = self.attn.project_rows(&h, rope)?;
        let a = backend.attend(idx, &q, &k, &v)?;
        let x = linear_rows_add(&a, &self.attn.o, x)?;
        let h = self.post_norm.forward_rows(&x)?;
        self.mlp.forward_rows_add(&h, &x)
    }

    /// The training forward of one layer over packed sequences: `x: [N, H]`,
    /// `cos, sin: [N, D/2]` at each token's position, `seq_lens` summing to
    /// `N`. `x + attn(norm x)`, then `+ mlp(norm ·)`, through the fused ops.
    /// `matmul`: the dtype the projections' weights are cast to
    /// ([`Linear::forward_cast`]; `None`: as they are).
    pub fn forward_packed(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        seq_lens: &[usize],
        matmul: Option<DType>,
    ) -> Result<Tensor> {
        let n = x.dim(0)?;
        let a = &self.attn;
        let h = arbor_ops::rms_norm(x, &self.input_norm.weight, self.input_norm.eps)?;
        let heads = |lin: &Linear, nh: usize, norm: &Option<RmsNorm>| -> Result<Tensor> {
            let y = lin.forward_cast(&h, matmul)?.reshape((n, nh, a.head_dim))?;
            Ok(match norm {
                Some(nm) => arbor_ops::rms_norm(&y, &nm.weight, nm.eps)?,
                None => y,
            })
        };
        let q = arbor_ops::rope(&heads(&a.q, a.n_heads, &a.q_norm)?, cos, sin)?;
        let k = arbor_ops::rope(&heads(&a.k, a.n_kv_heads, &a.k_norm)?, cos, sin)?;
        let v = heads(&a.v, a.n_kv_heads, &None)?;
        let (k, v) = if a.kv_bf16 {
            (round_bf16(k)?, round_bf16(v)?)
        } else {
            (k, v)
        };
        let att = arbor_ops::packed_causal_attention(&q, &k, &v, seq_lens)?
            .reshape((n, a.n_heads * a.head_dim))?;
        let x = (x + a.o.forward_cast(&att, matmul)?)?;
        let h = arbor_ops::rms_norm(&x, &self.post_norm.weight, self.post_norm.eps)?;
        let m = &self.mlp;
        let g = arbor_ops::swiglu(
            &m.gate.forward_cast(&h, matmul)?,
            &m.up.forward_cast(&h, matmul)?,
        )?;
        Ok((&x + m.down.forward_cast(&g, matmul)?)?)
    }

    /// `x + attn(norm x)`, then `+ mlp(norm ·)`.
    pub fn forward(
        &self,
        idx: usize,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        backend: &mut dyn AttentionBackend,
    ) -> Result<Tensor> {
        let h = self.input_norm.forward(x)?;
        let (q, k, v) = self.attn.project(&h, cos, sin)?;
        let a = backend.attend(idx, &q, &k, &v)?;
        let x = (x + self.attn.o.forward(&a)?)?;
        let h = self.post_norm.forward(&x)?;
        Ok((&x + self.mlp.forward(&h)?)?)
    }
}

/// Each layer's input from [`Transformer::forward_checkpoints`], detached,
/// with the RoPE tables and sequence boundaries to recompute the layers.
#[derive(Debug, Clone)]
pub struct LayerCheckpoints {
    /// `x_0` (embeddings) .. `x_L` (the final norm's input), `[N, H]` each.
    xs: Vec<Tensor>,
    cos: Tensor,
    sin: Tensor,
    seq_lens: Vec<usize>,
}

impl LayerCheckpoints {
    /// `x_L` as a new leaf variable: build the loss on it and pass its
    /// gradient to [`Transformer::backward_checkpoints`].
    pub fn last_leaf(&self) -> Result<candle_core::Var> {
        Ok(candle_core::Var::from_tensor(
            self.xs.last().expect("the embedding is first"),
        )?)
    }
}

/// A decoder-only transformer (`*ForCausalLM`).
#[derive(Debug, Clone)]
pub struct Transformer {
    pub cfg: ModelConfig,
    pub embed: Tensor,
    pub layers: Vec<DecoderLayer>,
    pub norm: RmsNorm,
    /// `[vocab, hidden]`; the embedding matrix itself when tied.
    pub lm_head: Tensor,
    /// `lm_head` repacked ([`Transformer::pack_weights`]), as
    /// [`Linear::packed`].
    pub lm_head_packed: Option<Arc<PackedWeights>>,
    pub rope: Rope,
    /// The dtype of activations (and of the KV cache): the parameters'
    /// dtype, except f32 over bf16 matrices
    /// ([`ParamLoader::bf16_matrices`]).
    pub dtype: DType,
    /// The dtype of the training forward's activations
    /// ([`Transformer::forward_packed`], [`Transformer::forward_checkpoints`]),
    /// when it differs from `dtype`: mixed precision, see
    /// [`Transformer::set_train_dtype`]. Generation is not affected.
    pub train_dtype: Option<DType>,
    /// The dtype the decoder layers' projection weights are cast to in the
    /// training forward, activations staying in [`Transformer::train_dtype`]:
    /// see [`Transformer::set_train_matmul_dtype`].
    pub train_matmul_dtype: Option<DType>,
}

impl Transformer {
    /// Load (or initialise) every parameter under its HF name.
    pub fn load(cfg: &ModelConfig, p: &ParamLoader<'_>) -> Result<Self> {
        let (v, h) = (cfg.vocab_size, cfg.hidden_size);
        let embed = p.get("model.embed_tokens.weight", &[v, h], Init::Normal(INIT_STD))?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| DecoderLayer::load(p, &format!("model.layers.{i}"), cfg))
            .collect::<Result<Vec<_>>>()?;
        let norm = RmsNorm::load(p, "model.norm", h, cfg.rms_norm_eps)?;
        let lm_head = if cfg.tie_word_embeddings {
            embed.clone()
        } else {
            p.get("lm_head.weight", &[v, h], Init::Normal(INIT_STD))?
        };
        Ok(Transformer {
            cfg: cfg.clone(),
            embed,
            layers,
            norm,
            lm_head,
            lm_head_packed: None,
            rope: Rope::new(cfg),
            dtype: p.compute_dtype(),
            train_dtype: None,
            train_matmul_dtype: None,
        })
    }

    pub fn device(&self) -> &Device {
        self.embed.device()
    }

    /// The dtype of activations (see [`Transformer::dtype`](Self#structfield.dtype)).
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Mixed precision for the training forward: activations in `dt`
    /// (bf16 or f16) while the parameters stay f32 (the master weights the
    /// optimizer updates). Each weight is cast to `dt` where it is used,
    /// inside the autograd graph ([`matmul_nt`], the norms'
    /// [`arbor_ops::rms_norm`]), so gradients reach the parameters in f32;
    /// reductions (norms, softmax, the sums of the norm weights' and biases'
    /// gradients, the LM head's log-softmax in
    /// [`crate::logprobs::token_logprobs`]) accumulate in f32. The residual
    /// stream is in `dt` too (Megatron's default; torch's autocast keeps it
    /// in f32). `None` (or the parameters' dtype) is the plain forward. The
    /// generation forward keeps [`Transformer::dtype`]. A half-precision
    /// `dt` needs f32 parameters.
    pub fn set_train_dtype(&mut self, dt: Option<DType>) -> Result<()> {
        self.train_dtype = self.half_over_f32(dt, &[DType::BF16, DType::F16])?;
        Ok(())
    }

    /// `dt` unless it is the parameters' dtype; an error unless it is one
    /// of `halves` over f32 parameters.
    fn half_over_f32(&self, dt: Option<DType>, halves: &[DType]) -> Result<Option<DType>> {
        match dt.filter(|&d| d != self.dtype) {
            Some(d) if self.dtype != DType::F32 || !halves.contains(&d) => {
                Err(ModelError::Input(format!(
                    "mixed precision computes in {halves:?} over f32 parameters, not {d:?} over {:?}",
                    self.dtype
                )))
            }
            dt => Ok(dt),
        }
    }

    /// Mixed precision as a CPU has it: the training forward's
    /// activations stay f32 (the fused CPU kernels for the norms, RoPE,
    /// SwiGLU and attention), and the decoder layers' projections cast
    /// their f32 weights to `dt` (bf16) and multiply through
    /// [`arbor_ops::matmul_nt_op`]'s bf16 dot products (AVX-512 BF16 where
    /// the CPU has it), forward and backward; their weights' gradients
    /// arrive in f32. The learner's LM head multiplies the same way
    /// ([`Transformer::train_token_logprobs`]; its log-softmax row sums end in f64);
    /// the embeddings and value head stay f32. Needs f32 parameters.
    pub fn set_train_matmul_dtype(&mut self, dt: Option<DType>) -> Result<()> {
        self.train_matmul_dtype = self.half_over_f32(dt, &[DType::BF16])?;
        Ok(())
    }

    /// `log p(targets)` of the training loss from final hidden states
    /// (`[N, H]` -> `[N]`, see [`crate::logprobs::token_logprobs`]): with
    /// [`Transformer::set_train_matmul_dtype`]'s bf16 on the CPU, the LM
    /// head's three products run through bf16 dot products over the f32
    /// head, whose gradient stays f32
    /// ([`crate::logprobs::token_logprobs_bf16`]).
    pub fn train_token_logprobs(
        &self,
        hidden: &Tensor,
        targets: &Tensor,
        chunk_rows: usize,
    ) -> Result<Tensor> {
        match self.train_matmul_dtype {
            Some(DType::BF16) if self.device().is_cpu() && hidden.dtype() == DType::F32 => {
                crate::logprobs::token_logprobs_bf16(hidden, &self.lm_head, targets, chunk_rows)
            }
            _ => crate::logprobs::token_logprobs(hidden, &self.lm_head, targets, chunk_rows),
        }
    }

    /// Mixed precision (bf16 compute over f32 master weights) the way the
    /// model's device does it fastest: on a GPU bf16 activations
    /// ([`Transformer::set_train_dtype`]), on a CPU f32 activations with
    /// bf16 matmuls ([`Transformer::set_train_matmul_dtype`]). `false`:
    /// f32 throughout.
    pub fn set_mixed_precision(&mut self, on: bool) -> Result<()> {
        let bf16 = on.then_some(DType::BF16);
        if self.device().is_cpu() {
            self.set_train_dtype(None)?;
            self.set_train_matmul_dtype(bf16)
        } else {
            self.set_train_matmul_dtype(None)?;
            self.set_train_dtype(bf16)
        }
    }

    /// The dtype of the training forward's activations
    /// ([`Transformer::set_train_dtype`]).
    pub fn train_dtype(&self) -> DType {
        self.train_dtype.unwrap_or(self.dtype)
    }

    /// Token embeddings: `ids: [B, T]` (u32) -> `[B, T, H]`.
    pub fn embed_tokens(&self, ids: &Tensor) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let flat = ids.flatten_all()?;
        let vocab = self.cfg.vocab_size as u32;
        if let Some(bad) = flat.to_vec1::<u32>()?.into_iter().find(|&i| i >= vocab) {
            return Err(ModelError::Input(format!(
                "token id {bad} is outside the vocabulary (vocab_size = {vocab})"
            )));
        }
        Ok(self
            .embed
            .index_select(&flat, 0)?
            .to_dtype(self.dtype)?
            .reshape((b, t, self.cfg.hidden_size))?)
    }

    /// Final hidden states (after the final norm), `[B, T, H]`, for `ids:
    /// [B, T]` at `positions` (row-major, `B*T` entries), attending through
    /// `backend`.
    pub fn forward_with(
        &self,
        ids: &Tensor,
        positions: &[u32],
        backend: &mut dyn AttentionBackend,
    ) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        if positions.len() != b * t {
            return Err(ModelError::Input(format!(
                "{} positions for {b}x{t} tokens",
                positions.len()
            )));
        }
        if b == 1
            && backend.inference()
            && self.device().is_cpu()
            && self.dtype() == DType::F32
            && self.cfg.head_dim.is_multiple_of(2)
        {
            let (cos, sin) = self.rope.cos_sin_f32(positions);
            let rope = RopeRows { cos, sin };
            let mut x = self.embed_tokens(ids)?;
            for (i, layer) in self.layers.iter().enumerate() {
                x = layer.forward_rows(i, &x, &rope, backend)?;
            }
            return self.norm.forward_rows(&x);
        }
        let (cos, sin) = self.rope.cos_sin(positions, self.dtype(), self.device())?;
        self.layers_and_norm(self.embed_tokens(ids)?, &cos, &sin, backend)
    }

    /// Every layer over the embedded tokens `x: [B, T, H]` with RoPE
    /// tables `cos, sin: [B*T, D/2]`, then the final norm.
    fn layers_and_norm(
        &self,
        mut x: Tensor,
        cos: &Tensor,
        sin: &Tensor,
        backend: &mut dyn AttentionBackend,
    ) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let half = self.cfg.head_dim / 2;
        let cos = cos.reshape((b, 1, t, half))?;
        let sin = sin.reshape((b, 1, t, half))?;
        for (i, layer) in self.layers.iter().enumerate() {
            x = layer.forward(i, &x, &cos, &sin, backend)?;
        }
        Ok(self.norm.forward(&x)?)
    }

    /// [`Transformer::forward_with`] for one packed step whose inputs are on
    /// the model's device already: `ids: [n]` (u32 token ids the caller has
    /// checked against the vocabulary: nothing is read back here, so a GPU
    /// step never waits on the host) and `positions: [n]` (u32, below
    /// `max_position_embeddings`; RoPE comes from a table on the device).
    /// Returns the final hidden states, `[1, n, H]`.
    pub fn forward_on_device(
        &self,
        ids: &Tensor,
        positions: &Tensor,
        backend: &mut dyn AttentionBackend,
    ) -> Result<Tensor> {
        let n = ids.dims1()?;
        if positions.dims1()? != n {
            return Err(ModelError::Input(format!(
                "{} positions for {n} tokens",
                positions.dims1()?
            )));
        }
        let (cos, sin) = self.rope.cos_sin_gather(positions, self.dtype)?;
        let x = self
            .embed
            .index_select(ids, 0)?
            .to_dtype(self.dtype)?
            .reshape((1, n, self.cfg.hidden_size))?;
        self.layers_and_norm(x, &cos, &sin, backend)
    }

    /// The same model with every parameter detached from autograd (the
    /// same storage, so in-place updates of the trainer's variables still
    /// show): for generation, whose ops then record no backward graph.
    pub fn detached(&self) -> Transformer {
        let mut m = self.clone();
        let lin = |l: &mut Linear| {
            l.weight = l.weight.detach();
            l.bias = l.bias.as_ref().map(Tensor::detach);
            if let Some(a) = &mut l.lora {
                a.a = a.a.detach();
                a.b = a.b.detach();
            }
        };
        m.embed = m.embed.detach();
        // A tied head stays the embedding itself (one tensor, one id).
        m.lm_head = if self.cfg.tie_word_embeddings {
            m.embed.clone()
        } else {
            m.lm_head.detach()
        };
        m.norm.weight = m.norm.weight.detach();
        for layer in &mut m.layers {
            let a = &mut layer.attn;
            for l in [&mut a.q, &mut a.k, &mut a.v, &mut a.o] {
                lin(l);
            }
            for n in [&mut a.q_norm, &mut a.k_norm].into_iter().flatten() {
                n.weight = n.weight.detach();
            }
            for l in [&mut layer.mlp.gate, &mut layer.mlp.up, &mut layer.mlp.down] {
                lin(l);
            }
            layer.input_norm.weight = layer.input_norm.weight.detach();
            layer.post_norm.weight = layer.post_norm.weight.detach();
        }
        m
    }

    /// Training forward of `B` rows of `T` tokens, `ids: [B, T]`, each row a
    /// sequence from position 0: [`Transformer::forward_packed`] over the
    /// rows. Returns `[B, T, H]`.
    pub fn forward_hidden(&self, ids: &Tensor) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let h = self.forward_packed(&ids.flatten_all()?, &vec![t; b])?;
        Ok(h.reshape((b, t, self.cfg.hidden_size))?)
    }

    /// RoPE tables `cos, sin: [N, D/2]` of packed sequences (each from
    /// position 0), after checking that `seq_lens` are >= 1 and sum to the
    /// `N` tokens of `ids: [N]`.
    fn packed_rope(&self, ids: &Tensor, seq_lens: &[usize]) -> Result<(Tensor, Tensor)> {
        let n = ids.dims1()?;
        if seq_lens.iter().sum::<usize>() != n || seq_lens.contains(&0) {
            return Err(ModelError::Input(format!(
                "sequence lengths {seq_lens:?} must be >= 1 and sum to the {n} tokens"
            )));
        }
        let positions: Vec<u32> = seq_lens.iter().flat_map(|&l| 0..l as u32).collect();
        self.rope
            .cos_sin(&positions, self.train_dtype(), self.device())
    }

    /// Token embeddings of packed `ids: [N]` -> `[N, H]`, in the training
    /// forward's dtype.
    fn embed_packed(&self, ids: &Tensor) -> Result<Tensor> {
        let n = ids.dims1()?;
        Ok(self
            .embed_tokens(&ids.reshape((1, n))?)?
            .to_dtype(self.train_dtype())?
            .reshape((n, self.cfg.hidden_size))?)
    }

    /// Training forward over sequences packed back to back: `ids: [N]`
    /// (u32), `seq_lens` summing to `N`; each sequence starts at position 0
    /// and attends only to itself. Returns the final hidden states (after
    /// the final norm), `[N, H]`, differentiable in every parameter. No
    /// padding is computed and no `[T, T]` attention matrix is kept.
    pub fn forward_packed(&self, ids: &Tensor, seq_lens: &[usize]) -> Result<Tensor> {
        let (cos, sin) = self.packed_rope(ids, seq_lens)?;
        let mut x = self.embed_packed(ids)?;
        for layer in &self.layers {
            x = layer.forward_packed(&x, &cos, &sin, seq_lens, self.train_matmul_dtype)?;
        }
        Ok(arbor_ops::rms_norm(&x, &self.norm.weight, self.norm.eps)?)
    }

    /// The training forward with activation recomputation: runs the layers
    /// without keeping their autograd graphs and keeps only each layer's
    /// input (`[N, H]` per layer instead of every intermediate). The last
    /// checkpoint is the final norm's input: make it a leaf with
    /// [`LayerCheckpoints::last_leaf`], build the loss on
    /// [`Transformer::final_norm`] of it, and hand its gradient to
    /// [`Transformer::backward_checkpoints`].
    pub fn forward_checkpoints(
        &self,
        ids: &Tensor,
        seq_lens: &[usize],
    ) -> Result<LayerCheckpoints> {
        let (cos, sin) = self.packed_rope(ids, seq_lens)?;
        let mut xs = Vec::with_capacity(self.layers.len() + 1);
        xs.push(self.embed_packed(ids)?.detach());
        for layer in &self.layers {
            let x = xs.last().expect("the embedding is first");
            let y = layer
                .forward_packed(x, &cos, &sin, seq_lens, self.train_matmul_dtype)?
                .detach();
            xs.push(y);
        }
        Ok(LayerCheckpoints {
            xs,
            cos,
            sin,
            seq_lens: seq_lens.to_vec(),
        })
    }

    /// The final RMSNorm, differentiable: `[N, H] -> [N, H]`.
    pub fn final_norm(&self, x: &Tensor) -> Result<Tensor> {
        Ok(arbor_ops::rms_norm(x, &self.norm.weight, self.norm.eps)?)
    }

    /// The backward of [`Transformer::forward_checkpoints`]: from
    /// `d_last = dL/dx_L`, each layer (last first) is recomputed from its
    /// checkpoint with its graph, `sum(layer(x) * dL/dy)` is
    /// back-propagated, its gradients (the layer's parameters, and `x`'s,
    /// carried to the layer below) go to `sink`; last the embedding's. The
    /// gradients `sink` receives sum to those of the plain forward.
    pub fn backward_checkpoints<E: From<ModelError>>(
        &self,
        ck: &LayerCheckpoints,
        ids: &Tensor,
        d_last: &Tensor,
        mut sink: impl FnMut(&candle_core::backprop::GradStore) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        let mut dy = d_last.detach();
        for (i, layer) in self.layers.iter().enumerate().rev() {
            let x = candle_core::Var::from_tensor(&ck.xs[i]).map_err(ModelError::from)?;
            let grads = (|| -> Result<_> {
                let y = layer.forward_packed(
                    x.as_tensor(),
                    &ck.cos,
                    &ck.sin,
                    &ck.seq_lens,
                    self.train_matmul_dtype,
                )?;
                Ok((y * &dy)?.sum_all()?.backward()?)
            })()?;
            sink(&grads)?;
            dy = grads
                .get(x.as_tensor())
                .ok_or_else(|| {
                    ModelError::Input(format!("layer {i}: no gradient reached its input"))
                })?
                .detach();
        }
        let grads =
            (|| -> Result<_> { Ok((self.embed_packed(ids)? * &dy)?.sum_all()?.backward()?) })()?;
        sink(&grads)
    }

    /// Every parameter under its HF name (the tied lm_head is not repeated).
    pub fn named_tensors(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = vec![("model.embed_tokens.weight".to_string(), self.embed.clone())];
        let lin = |out: &mut Vec<(String, Tensor)>, name: String, l: &Linear| -> Result<()> {
            // HF-loadable: adapters folded into the weights.
            out.push((format!("{name}.weight"), l.merged_weight()?));
            if let Some(b) = &l.bias {
                out.push((format!("{name}.bias"), b.clone()));
            }
            Ok(())
        };
        for (i, layer) in self.layers.iter().enumerate() {
            let p = format!("model.layers.{i}");
            let a = &layer.attn;
            lin(&mut out, format!("{p}.self_attn.q_proj"), &a.q)?;
            lin(&mut out, format!("{p}.self_attn.k_proj"), &a.k)?;
            lin(&mut out, format!("{p}.self_attn.v_proj"), &a.v)?;
            lin(&mut out, format!("{p}.self_attn.o_proj"), &a.o)?;
            if let Some(n) = &a.q_norm {
                out.push((format!("{p}.self_attn.q_norm.weight"), n.weight.clone()));
            }
            if let Some(n) = &a.k_norm {
                out.push((format!("{p}.self_attn.k_norm.weight"), n.weight.clone()));
            }
            lin(&mut out, format!("{p}.mlp.gate_proj"), &layer.mlp.gate)?;
            lin(&mut out, format!("{p}.mlp.up_proj"), &layer.mlp.up)?;
            lin(&mut out, format!("{p}.mlp.down_proj"), &layer.mlp.down)?;
            out.push((
                format!("{p}.input_layernorm.weight"),
                layer.input_norm.weight.clone(),
            ));
            out.push((
                format!("{p}.post_attention_layernorm.weight"),
                layer.post_norm.weight.clone(),
            ));
        }
        out.push(("model.norm.weight".to_string(), self.norm.weight.clone()));
        if !self.cfg.tie_word_embeddings {
            out.push(("lm_head.weight".to_string(), self.lm_head.clone()));
        }
        Ok(out)
    }

    /// Repack every f32 CPU weight matrix the generation forward reads
    /// (projections without an adapter, the LM head) for
    /// [`arbor_ops::cpu::packed`], replacing any earlier pack: call it again
    /// after the weights change. Returns the bytes packed (a copy of each
    /// matrix; device and bf16 weights are skipped).
    pub fn pack_weights(&mut self) -> usize {
        let mut bytes = 0;
        // An earlier pack of the same shape is refilled in place (keeping
        // its pages); anything else is packed anew.
        let mut pack =
            |w: &Tensor, old: Option<Arc<PackedWeights>>| -> Option<Arc<PackedWeights>> {
                let (n, k) = w.dims2().ok()?;
                if w.dtype() != DType::F32 || !w.device().is_cpu() {
                    return None;
                }
                bytes += n * k * 4;
                with_cpu_f32(w, |v| {
                    if let Some(mut p) = old.filter(|p| p.n() == n && p.k() == k) {
                        if let Some(q) = Arc::get_mut(&mut p) {
                            q.repack(v);
                            return p;
                        }
                    }
                    Arc::new(PackedWeights::pack(v, n, k))
                })
                .ok()
            };
        self.lm_head_packed = pack(&self.lm_head, self.lm_head_packed.take());
        for layer in &mut self.layers {
            let (a, m) = (&mut layer.attn, &mut layer.mlp);
            for l in [
                &mut a.q,
                &mut a.k,
                &mut a.v,
                &mut a.o,
                &mut m.gate,
                &mut m.up,
                &mut m.down,
            ] {
                let old = l.packed.take();
                l.packed = if l.lora.is_none() {
                    pack(&l.weight, old)
                } else {
                    None
                };
            }
        }
        bytes
    }

    /// Logits `h lm_head^T` of hidden states `h: [t, hidden]`: through the
    /// pack ([`Transformer::pack_weights`]) for f32 on the CPU, else
    /// [`matmul_nt`]; the same bits either way.
    pub fn lm_head_logits(&self, h: &Tensor) -> Result<Tensor> {
        let (t, k) = h.dims2()?;
        match &self.lm_head_packed {
            Some(p) if h.dtype() == DType::F32 && h.device().is_cpu() && p.k() == k => {
                let mut ys = with_cpu_f32(h, |xs| {
                    arbor_ops::matmul_nt_multi(
                        xs,
                        &[arbor_ops::WeightRows::Packed(p)],
                        t,
                        k,
                        &[p.n()],
                    )
                })?;
                let y = ys.pop().expect("one product");
                Ok(Tensor::from_vec(y, (t, p.n()), h.device())?)
            }
            _ => Ok(matmul_nt(h, &self.lm_head)?),
        }
    }

    /// Backs the matrices a decode step streams (the embedding / LM head
    /// and every layer's projections, f32 or bf16 in CPU memory; for a
    /// packed one, its pack, [`Transformer::pack_weights`]) with transparent huge pages
    /// ([`crate::hugepages::back_with_huge_pages`]). Returns the bytes
    /// moved; device weights, small models and systems without the feature
    /// give 0. Values never change.
    pub fn back_weights_with_huge_pages(&self) -> usize {
        let mut ranges = Vec::new();
        let mut add = |t: &Tensor| {
            let (storage, _) = t.storage_and_layout();
            if let candle_core::Storage::Cpu(c) = &*storage {
                let (p, bytes) = match c {
                    candle_core::CpuStorage::F32(v) => (v.as_ptr() as usize, v.len() * 4),
                    candle_core::CpuStorage::BF16(v) => (v.as_ptr() as usize, v.len() * 2),
                    _ => return,
                };
                ranges.push((p, p + bytes));
            }
        };
        // A packed matrix is streamed from its pack, not from itself (the
        // embedding rows are still read, tied or not).
        add(&self.embed);
        if self.lm_head_packed.is_none() {
            add(&self.lm_head);
        }
        let mut packs = self.lm_head_packed.iter().collect::<Vec<_>>();
        for layer in &self.layers {
            let (a, m) = (&layer.attn, &layer.mlp);
            for l in [&a.q, &a.k, &a.v, &a.o, &m.gate, &m.up, &m.down] {
                match &l.packed {
                    Some(p) => packs.push(p),
                    None => add(&l.weight),
                }
            }
        }
        for p in packs {
            let (at, bytes) = p.memory();
            ranges.push((at, at + bytes));
        }
        crate::hugepages::back_with_huge_pages(ranges)
    }

    /// Write an HF-loadable checkpoint: `config.json` and `model.safetensors`
    /// (in `dtype`), each written to a temporary file, fsynced and renamed,
    /// so a crash never leaves a half-written file under the final name.
    pub fn save_pretrained(&self, dir: &std::path::Path, dtype: DType) -> Result<()> {
        crate::weights::save_pretrained(dir, &self.cfg, &self.named_tensors()?, dtype)
    }

    /// The dtype whose values K and V hold: bf16 for bf16 matrices under
    /// f32 compute (see [`Attention::kv_bf16`]), else the activations'
    /// dtype. A KV cache in this dtype stores them exactly.
    pub fn kv_dtype(&self) -> DType {
        if self.layers.first().is_some_and(|l| l.attn.kv_bf16) {
            DType::BF16
        } else {
            self.dtype
        }
    }

    /// Full logits `[.., V]` for hidden states `[.., H]`, in the model dtype.
    /// Only for small inputs: use [`crate::logprobs`] for training-size batches.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        Ok(Linear::new(self.lm_head.clone(), None).forward(hidden)?)
    }
}
