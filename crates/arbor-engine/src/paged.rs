//! KV storage for the paged cache, and paged attention over block tables
//! (CPU, multi-threaded with rayon).
//!
//! Storage per layer: `K, V: [num_blocks * block_size, n_kv_heads, head_dim]`
//! in f32, or in bf16 for a model whose K/V values are bf16 already
//! ([`Transformer::kv_dtype`](arbor_model::Transformer::kv_dtype): bf16
//! matrices on the CPU), which halves the bytes each decode step streams;
//! token slot `s` of the [`arbor_kv`] manager is row `s`.
//!
//! For a new token `i` of sequence `s` at position `p`, query head `h`
//! (KV head `h / g`, `g = n_heads / n_kv_heads`):
//! `o_h = sum_{j <= p} softmax_j(q_h . k_j / sqrt(D)) v_j`, with `k_j, v_j`
//! read through the sequence's block table. Every new token's K/V is
//! written before any attention is computed, so a prefill chunk attends
//! causally to itself and to its cached prefix in one pass. This is
//! numerically the same computation as the training forward's
//! [`arbor_ops::packed_causal_attention`] (f32 accumulation), tested against
//! it.

use arbor_kv::CopyOp;
use arbor_model::model::with_cpu_f32;
use arbor_model::{AttentionBackend, ModelConfig, ModelError};
use candle_core::{DType, Tensor};
use half::bf16;
use half::slice::HalfBitsSliceExt;

/// One layer's K and V rows: f32, or bf16 bits (allocated as zeroed `u16`s,
/// so the pool's pages are only touched when used, as with f32).
#[derive(Debug, Clone)]
enum LayerKv {
    F32 { k: Vec<f32>, v: Vec<f32> },
    Bf16 { k: Vec<u16>, v: Vec<u16> },
}

/// Paged K/V storage of every layer.
#[derive(Debug, Clone)]
pub struct PagedKvCache {
    layers: Vec<LayerKv>,
    n_kv: usize,
    head_dim: usize,
    block_size: usize,
    num_blocks: usize,
}

impl PagedKvCache {
    /// An f32 cache.
    pub fn new(cfg: &ModelConfig, num_blocks: usize, block_size: usize) -> Self {
        Self::alloc(cfg, num_blocks, block_size, DType::F32)
    }

    /// A cache holding `dtype` (f32 or bf16; a bf16 cache rounds the K/V it
    /// is given to nearest even, exact for a model whose
    /// [`kv_dtype`](arbor_model::Transformer::kv_dtype) is bf16).
    pub fn with_dtype(
        cfg: &ModelConfig,
        num_blocks: usize,
        block_size: usize,
        dtype: DType,
    ) -> arbor_model::Result<Self> {
        match dtype {
            DType::F32 | DType::BF16 => Ok(Self::alloc(cfg, num_blocks, block_size, dtype)),
            other => Err(ModelError::Input(format!(
                "host KV cache: {other:?} is not supported (f32 or bf16)"
            ))),
        }
    }

    fn alloc(cfg: &ModelConfig, num_blocks: usize, block_size: usize, dtype: DType) -> Self {
        let row = cfg.num_key_value_heads * cfg.head_dim;
        let n = num_blocks * block_size * row;
        let layer = || match dtype {
            DType::BF16 => LayerKv::Bf16 {
                k: vec![0; n],
                v: vec![0; n],
            },
            _ => LayerKv::F32 {
                k: vec![0.0; n],
                v: vec![0.0; n],
            },
        };
        PagedKvCache {
            layers: (0..cfg.num_hidden_layers).map(|_| layer()).collect(),
            n_kv: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
            block_size,
            num_blocks,
        }
    }

    /// Bytes of f32 KV storage per token slot.
    pub fn bytes_per_token(cfg: &ModelConfig) -> usize {
        Self::bytes_per_token_in(cfg, DType::F32)
    }

    /// Bytes of KV storage per token slot in `dtype`.
    pub fn bytes_per_token_in(cfg: &ModelConfig, dtype: DType) -> usize {
        2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * dtype.size_in_bytes()
    }

    /// The element type held.
    pub fn dtype(&self) -> DType {
        match self.layers.first() {
            Some(LayerKv::Bf16 { .. }) => DType::BF16,
            _ => DType::F32,
        }
    }

    /// Total bytes held.
    pub fn bytes(&self) -> usize {
        2 * self.layers.len()
            * self.num_blocks
            * self.block_size
            * self.n_kv
            * self.head_dim
            * self.dtype().size_in_bytes()
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Copy the first `len` slots of one block into another, in every layer.
    pub fn copy(&mut self, op: &CopyOp) -> arbor_model::Result<()> {
        check_copy(op, self.num_blocks, self.block_size)?;
        let row = self.n_kv * self.head_dim;
        let src = op.src as usize * self.block_size * row;
        let dst = op.dst as usize * self.block_size * row;
        let n = op.len * row;
        for layer in &mut self.layers {
            match layer {
                LayerKv::F32 { k, v } => {
                    k.copy_within(src..src + n, dst);
                    v.copy_within(src..src + n, dst);
                }
                LayerKv::Bf16 { k, v } => {
                    k.copy_within(src..src + n, dst);
                    v.copy_within(src..src + n, dst);
                }
            }
        }
        Ok(())
    }
}

/// A copy-on-write between two blocks of a pool of `num_blocks` blocks of
/// `block_size` slots, of at most one block.
fn check_copy(op: &CopyOp, num_blocks: usize, block_size: usize) -> arbor_model::Result<()> {
    if op.src as usize >= num_blocks || op.dst as usize >= num_blocks || op.len > block_size {
        return Err(ModelError::Input(format!(
            "KV copy of {} slots from block {} to block {}: the cache has {num_blocks} blocks \
             of {block_size}",
            op.len, op.src, op.dst
        )));
    }
    Ok(())
}

/// Write every new token `i`'s K (or V) heads, `src: [nkv, t, d]`, into
/// cache row `slots[i]` of `dst`, each value through `elem`.
fn write_rows<T>(
    dst: &mut [T],
    src: &[f32],
    slots: &[usize],
    (nkv, t, d): (usize, usize, usize),
    elem: impl Fn(f32) -> T,
) {
    let row = nkv * d;
    for (i, &slot) in slots.iter().enumerate() {
        for h in 0..nkv {
            let from = &src[(h * t + i) * d..][..d];
            let at = slot * row + h * d;
            for (o, &x) in dst[at..at + d].iter_mut().zip(from) {
                *o = elem(x);
            }
        }
    }
}

/// Where the new tokens of one forward step go.
#[derive(Debug, Clone, Default)]
pub struct PagedBatch {
    /// Per new token: KV slot to write.
    pub slots: Vec<usize>,
    /// Per new token: position in its sequence.
    pub positions: Vec<u32>,
    /// Per new token: index into `tables`.
    pub token_seq: Vec<usize>,
    /// Per sequence in the step: its block table.
    pub tables: Vec<Vec<u32>>,
}

impl PagedBatch {
    /// The index of each sequence's last new token (`n_seqs` sequences;
    /// tokens are laid out sequence after sequence).
    pub fn last_tokens(&self, n_seqs: usize) -> Vec<u32> {
        let mut rows = vec![0u32; n_seqs];
        for (i, &k) in self.token_seq.iter().enumerate() {
            rows[k] = i as u32;
        }
        rows
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }
}

/// [`arbor_ops::paged_attention`] of `q: [nh, t, d]` over one layer's cache.
#[allow(clippy::too_many_arguments)]
fn attend_rows<E: arbor_ops::KvElem>(
    q: &[f32],
    k_cache: &[E],
    v_cache: &[E],
    n_heads: usize,
    n_kv: usize,
    head_dim: usize,
    block_size: usize,
    batch: &PagedBatch,
) -> Vec<f32> {
    arbor_ops::paged_attention(arbor_ops::PagedAttentionArgs {
        q,
        k_cache,
        v_cache,
        n_heads,
        n_kv,
        head_dim,
        block_size,
        positions: &batch.positions,
        token_seq: &batch.token_seq,
        tables: &batch.tables,
    })
}

/// The engine's [`AttentionBackend`]: writes the step's K/V into the paged
/// cache and attends over each token's sequence through its block table.
#[derive(Debug)]
pub struct PagedAttention<'a> {
    pub cache: &'a mut PagedKvCache,
    pub batch: &'a PagedBatch,
}

impl AttentionBackend for PagedAttention<'_> {
    fn inference(&self) -> bool {
        true
    }

    fn attend(
        &mut self,
        layer: usize,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> arbor_model::Result<Tensor> {
        let (b, nh, t, d) = q.dims4()?;
        let nkv = k.dim(1)?;
        if b != 1 || t != self.batch.len() || nkv != self.cache.n_kv || d != self.cache.head_dim {
            return Err(ModelError::Input(format!(
                "paged attention: q {:?} / k {:?} do not match a batch of {} tokens",
                q.dims(),
                k.dims(),
                self.batch.len()
            )));
        }
        let dt = q.dtype();
        let f32_of = |x: &Tensor| x.to_dtype(DType::F32);
        let (q, k, v) = (f32_of(q)?, f32_of(k)?, f32_of(v)?);
        let (slots, shape) = (&self.batch.slots, (nkv, t, d));
        let store = &mut self.cache.layers[layer];
        // k, v: [nkv, t, d] -> each new token's row of the cache.
        with_cpu_f32(&k, |kv| {
            with_cpu_f32(&v, |vv| match store {
                LayerKv::F32 { k, v } => {
                    write_rows(k, kv, slots, shape, |x| x);
                    write_rows(v, vv, slots, shape, |x| x);
                }
                LayerKv::Bf16 { k, v } => {
                    let bits = |x| bf16::from_f32(x).to_bits();
                    write_rows(k, kv, slots, shape, bits);
                    write_rows(v, vv, slots, shape, bits);
                }
            })
        })??;
        let (batch, bs) = (self.batch, self.cache.block_size);
        let out = with_cpu_f32(&q, |qv| match &self.cache.layers[layer] {
            LayerKv::F32 { k, v } => attend_rows(qv, k, v, nh, nkv, d, bs, batch),
            LayerKv::Bf16 { k, v } => {
                let (k, v) = (k.reinterpret_cast::<bf16>(), v.reinterpret_cast::<bf16>());
                attend_rows(qv, k, v, nh, nkv, d, bs, batch)
            }
        })?;
        Ok(Tensor::from_vec(out, (1, t, nh * d), q.device())?.to_dtype(dt)?)
    }
}

/// Paged K/V storage as device tensors (`[slots, n_kv, head_dim]` per layer,
/// in the model's dtype): the layout of [`PagedKvCache`], on any candle
/// device. With the `cuda` feature this is the GPU engine's cache; on the
/// CPU it runs the same kernels as [`PagedAttention`] through
/// `arbor_ops::paged_attention_op`. Not `Clone`: writes go into the
/// tensors' storage in place, so a clone would alias the cache.
#[derive(Debug)]
pub struct DeviceKvCache {
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    block_size: usize,
    num_blocks: usize,
}

impl DeviceKvCache {
    pub fn new(
        cfg: &ModelConfig,
        num_blocks: usize,
        block_size: usize,
        dtype: DType,
        device: &candle_core::Device,
    ) -> arbor_model::Result<Self> {
        let shape = (
            num_blocks * block_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let mut k = Vec::with_capacity(cfg.num_hidden_layers);
        let mut v = Vec::with_capacity(cfg.num_hidden_layers);
        for _ in 0..cfg.num_hidden_layers {
            k.push(Tensor::zeros(shape, dtype, device)?);
            v.push(Tensor::zeros(shape, dtype, device)?);
        }
        Ok(DeviceKvCache {
            k,
            v,
            block_size,
            num_blocks,
        })
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// The element type held.
    pub fn dtype(&self) -> DType {
        self.k.first().map_or(DType::F32, Tensor::dtype)
    }

    /// Errors when a slot is outside the cache (the CUDA write would skip
    /// it rather than fail).
    fn check_slots(&self, slots: &[usize]) -> arbor_model::Result<()> {
        let n_slots = self.num_blocks * self.block_size;
        match slots.iter().find(|&&s| s >= n_slots) {
            Some(&s) => Err(ModelError::Input(format!(
                "paged attention: slot {s} outside the cache ({n_slots} slots)"
            ))),
            None => Ok(()),
        }
    }

    /// Layer `i`'s K and V storage, `[slots, n_kv, head_dim]` each (written
    /// in place by the engine's steps).
    pub fn layer(&self, i: usize) -> (&Tensor, &Tensor) {
        (&self.k[i], &self.v[i])
    }

    /// Copy the first `len` slots of one block into another, in every layer
    /// (copy-on-write of a shared partial block).
    pub fn copy(&self, op: &CopyOp) -> arbor_model::Result<()> {
        let bs = self.block_size;
        check_copy(op, self.num_blocks, bs)?;
        let dev = self
            .k
            .first()
            .map(|t| t.device().clone())
            .unwrap_or(candle_core::Device::Cpu);
        let dst: Vec<u32> = (0..op.len as u32).map(|i| op.dst * bs as u32 + i).collect();
        let dst = Tensor::from_vec(dst, op.len, &dev)?;
        for t in self.k.iter().chain(&self.v) {
            // A fresh buffer of just these rows (not an alias of the cache).
            let rows = t
                .narrow(0, op.src as usize * bs, op.len)?
                .force_contiguous()?;
            arbor_ops::cache_write(t, &rows, &dst)?;
        }
        Ok(())
    }

    /// Total bytes held.
    pub fn bytes(&self) -> usize {
        self.k
            .iter()
            .chain(&self.v)
            .map(|t| t.elem_count() * t.dtype().size_in_bytes())
            .sum()
    }
}

/// [`AttentionBackend`] over a [`DeviceKvCache`]: writes the step's K/V
/// into their slots (`arbor_ops::cache_write`), then attends through the
/// block tables (`arbor_ops::paged_attention_op`).
#[derive(Debug)]
pub struct DevicePagedAttention<'a> {
    cache: &'a DeviceKvCache,
    /// Checked by [`arbor_ops::PagedMeta::new`].
    meta: arbor_ops::PagedMeta,
    /// `[t]` u32 slot of each new token, checked against the cache (the
    /// CUDA write skips slots outside it rather than fail).
    slots: Tensor,
}

impl<'a> DevicePagedAttention<'a> {
    /// Upload a [`PagedBatch`] to the cache's device.
    pub fn new(cache: &'a DeviceKvCache, batch: &PagedBatch) -> arbor_model::Result<Self> {
        let dev = cache
            .k
            .first()
            .map(|t| t.device().clone())
            .unwrap_or(candle_core::Device::Cpu);
        let meta = arbor_ops::PagedMeta::new(
            &batch.positions,
            &batch.token_seq,
            &batch.tables,
            cache.block_size,
            &dev,
        )?;
        cache.check_slots(&batch.slots)?;
        // Table entries are checked by `paged_attention_op` against the cache.
        let slots: Vec<u32> = batch.slots.iter().map(|&s| s as u32).collect();
        let n = slots.len();
        Ok(DevicePagedAttention {
            cache,
            meta,
            slots: Tensor::from_vec(slots, n, &dev)?,
        })
    }
}

impl<'a> DevicePagedAttention<'a> {
    /// Over inputs already on the device: `meta` (from
    /// [`arbor_ops::PagedMeta::from_device`]) and `slots: [t]` u32, the
    /// values of `batch.slots`, which are checked against the cache here.
    pub fn from_parts(
        cache: &'a DeviceKvCache,
        batch: &PagedBatch,
        meta: arbor_ops::PagedMeta,
        slots: Tensor,
    ) -> arbor_model::Result<Self> {
        cache.check_slots(&batch.slots)?;
        if slots.dims1()? != batch.len() {
            return Err(ModelError::Input(format!(
                "paged attention: {} slots for a batch of {} tokens",
                slots.dims1()?,
                batch.len()
            )));
        }
        Ok(DevicePagedAttention { cache, meta, slots })
    }
}

impl AttentionBackend for DevicePagedAttention<'_> {
    fn inference(&self) -> bool {
        true
    }

    fn attend(
        &mut self,
        layer: usize,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> arbor_model::Result<Tensor> {
        let (b, nh, t, d) = q.dims4()?;
        if b != 1 || t != self.slots.dim(0)? {
            return Err(ModelError::Input(format!(
                "paged attention: q {:?} does not match a batch of {} tokens",
                q.dims(),
                self.slots.dim(0)?
            )));
        }
        let (kc, vc) = (&self.cache.k[layer], &self.cache.v[layer]);
        let rows = |x: &Tensor| -> candle_core::Result<Tensor> {
            x.squeeze(0)?
                .transpose(0, 1)?
                .to_dtype(kc.dtype())?
                .contiguous()
        };
        arbor_ops::cache_write(kc, &rows(k)?, &self.slots)?;
        arbor_ops::cache_write(vc, &rows(v)?, &self.slots)?;
        let out = arbor_ops::paged_attention_op(&rows(q)?, kc, vc, &self.meta)?;
        Ok(out.reshape((1, t, nh * d))?.to_dtype(q.dtype())?)
    }
}
