//! The dedicated GPU step on CUDA: a fixed sequence of kernels per layer
//! over buffers allocated once (an arena sized for the largest step), the
//! engine's paged KV cache, and sampling on the device; decode steps are
//! captured as one CUDA graph per (batch bucket, table width) and
//! replayed. The weights: the step keeps its own bf16 copy of the Q, K, V
//! and gate, up matrices, concatenated (one GEMM each), and of every
//! weight of an f32 model; it reads a bf16 model's other weights in place.
//! [`FastDecoder::refresh`] refills the copy in the same buffer after an
//! update, so graphs stay valid. A step uploads one buffer
//! ([`InputLayout`]) and downloads the sampled tokens.
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use arbor_model::Transformer;
use arbor_ops::cuda::{Kernel, PushKernelArg, WrapErr};
use arbor_ops::Sampled;
use candle_core::cuda_backend::cudarc::cublas::{sys as cb, CudaBlas};
use candle_core::cuda_backend::cudarc::driver::{
    sys, CudaGraph, CudaSlice, CudaStream, DevicePtr, LaunchConfig,
};
use candle_core::{DType, Tensor};

use super::plan::{
    bucket, table_width, ArenaPlan, Dims, GraphKey, InputLayout, StepIn, StepShape, BUCKETS,
};
use crate::paged::DeviceKvCache;

type Result<T> = candle_core::Result<T>;

/// Launch `kernel` with `cfg` and the arguments, in order.
macro_rules! launch {
    ($kernel:expr, $cfg:expr, $($arg:expr),+ $(,)?) => {{
        let mut l = $kernel.builder();
        $( l.arg($arg); )+
        // SAFETY: every call site passes the arguments of the kernel's
        // signature (kernels/decode.cu, paged_attention.cu, sample.cu) in
        // order; each pointer is a device buffer of the size the arena
        // plan, the input layout or the model's shapes give for the
        // bucket's rows, alive as long as the decoder.
        unsafe { l.launch($cfg) }.w()
    }};
}

/// Device addresses of one layer's weights and KV cache (0: absent).
#[derive(Debug, Clone, Copy)]
struct LayerPtrs {
    in_norm: u64,
    /// The step's copy of `[W_q; W_k; W_v]`.
    qkv: u64,
    q_bias: u64,
    k_bias: u64,
    v_bias: u64,
    q_norm: u64,
    k_norm: u64,
    o: u64,
    post_norm: u64,
    /// The step's copy of `[W_gate; W_up]`.
    gate_up: u64,
    down: u64,
    k_cache: u64,
    v_cache: u64,
}

/// The step's bf16 weight copy: one buffer, and each source tensor with its
/// element offset in it.
struct WeightCopy {
    buf: CudaSlice<half::bf16>,
    copies: Vec<(Tensor, usize)>,
}

/// Sizes of a [`FastDecoder`]'s buffers, and whether it may copy an f32
/// model's weights to bf16.
#[derive(Debug, Clone, Copy)]
pub struct Sizes {
    /// Most sequences in a step (rounded up to a bucket, at most 256).
    pub max_seqs: usize,
    /// Most new tokens in a step.
    pub max_batch_tokens: usize,
    /// Longest sequence (sets the widest block table).
    pub max_context: usize,
    /// Run an f32 model from a bf16 copy of its weights.
    pub bf16_copy: bool,
}

#[derive(Debug)]
struct Kernels {
    cast: Kernel,
    copy: Kernel,
    gather: Kernel,
    embed: Kernel,
    norm: Kernel,
    rope: Kernel,
    silu: Kernel,
    attn: Kernel,
    sample: Kernel,
}

/// A captured step.
struct Graph(CudaGraph);

// SAFETY: a CUDA graph may be launched from any thread as long as calls on
// it are serialised; the decoder is only reached through `&mut` (its
// engine's step), so they are.
unsafe impl Send for Graph {}

/// The dedicated decode step of one engine (see the module docs).
pub struct FastDecoder {
    stream: Arc<CudaStream>,
    /// candle's stream, where prefills write the KV this step reads.
    candle_stream: Arc<CudaStream>,
    blas: CudaBlas,
    _workspace: CudaSlice<u8>,
    arena: CudaSlice<u8>,
    plan: ArenaPlan,
    input: CudaSlice<u32>,
    /// Widest block table a step may have (the engine's context).
    max_table: usize,
    inv_freq: CudaSlice<f32>,
    layers: Vec<LayerPtrs>,
    embed: u64,
    final_norm: u64,
    lm_head: u64,
    dims: Dims,
    eps: f32,
    n_slots: u32,
    block_size: u32,
    /// Streaming multiprocessors of the device.
    sms: usize,
    kernels: Kernels,
    graphs: HashMap<GraphKey, Graph>,
    use_graphs: bool,
    /// The tensors whose buffers the step reads: kept alive here.
    _keep: Vec<Tensor>,
    /// The step's bf16 weight copy (concatenated QKV and gate|up; all of
    /// an f32 model's weights).
    copy: WeightCopy,
}

impl std::fmt::Debug for FastDecoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FastDecoder")
            .field("dims", &self.dims)
            .field("graphs", &self.graphs.len())
            .field("use_graphs", &self.use_graphs)
            .finish()
    }
}

/// The device address of contiguous bf16 tensor `t`'s first element.
fn addr(t: &Tensor, stream: &CudaStream) -> Result<u64> {
    if t.dtype() != DType::BF16 {
        candle_core::bail!(
            "fast decode: a {:?} tensor where bf16 was expected",
            t.dtype()
        );
    }
    arbor_ops::cuda::tensor_ptr(t, stream)
}

impl FastDecoder {
    /// The step for `model` over `cache`, or why it cannot run: it needs a
    /// bf16 Qwen-family model (no LoRA adapters) on CUDA with its KV cache
    /// there, head_dim even and <= 256.
    pub fn new(
        model: &Transformer,
        cache: &DeviceKvCache,
        sizes: Sizes,
    ) -> std::result::Result<Self, String> {
        Self::build(model, cache, sizes).map_err(|e| e.to_string())
    }

    fn build(model: &Transformer, cache: &DeviceKvCache, sizes: Sizes) -> Result<Self> {
        let Sizes {
            max_seqs,
            max_batch_tokens,
            max_context,
            bf16_copy,
        } = sizes;
        let cfg = &model.cfg;
        let candle_core::Device::Cuda(dev) = model.device() else {
            candle_core::bail!("the model is not on a CUDA device");
        };
        let cast_all = match model.dtype() {
            DType::BF16 => false,
            DType::F32 if bf16_copy => true,
            dt => candle_core::bail!(
                "the model computes in {dt:?}, not bf16 (an f32 model needs bf16_rollouts)"
            ),
        };
        if cache.dtype() != DType::BF16 {
            candle_core::bail!("the KV cache holds {:?}, not bf16", cache.dtype());
        }
        if !cfg.head_dim.is_multiple_of(2) || cfg.head_dim > 256 {
            candle_core::bail!("head_dim {} (needs even, <= 256)", cfg.head_dim);
        }
        if model.layers.iter().any(|l| {
            let a = &l.attn;
            [&a.q, &a.k, &a.v, &a.o, &l.mlp.gate, &l.mlp.up, &l.mlp.down]
                .iter()
                .any(|x| x.lora.is_some())
        }) {
            candle_core::bail!("LoRA adapters are not supported by the fused step");
        }
        if model.layers.iter().any(|l| l.attn.o.bias.is_some()) {
            candle_core::bail!("an o_proj bias is not supported by the fused step");
        }
        // The concatenated matrices: each projection's shape, in the
        // model's dtype.
        let (h, qw, kvw) = (
            cfg.hidden_size,
            cfg.num_attention_heads * cfg.head_dim,
            cfg.num_key_value_heads * cfg.head_dim,
        );
        for (i, l) in model.layers.iter().enumerate() {
            let a = &l.attn;
            let want = [
                (&a.q.weight, qw),
                (&a.k.weight, kvw),
                (&a.v.weight, kvw),
                (&l.mlp.gate.weight, cfg.intermediate_size),
                (&l.mlp.up.weight, cfg.intermediate_size),
            ];
            for (t, rows) in want {
                if t.dims() != [rows, h] || t.dtype() != model.dtype() {
                    candle_core::bail!(
                        "layer {i}: a projection of shape {:?} ({:?}) where [{rows}, {h}] ({:?}) \
                         was expected",
                        t.dims(),
                        t.dtype(),
                        model.dtype()
                    );
                }
            }
        }
        let candle_stream = dev.cuda_stream();
        let ctx = candle_stream.context().clone();
        let stream = ctx.new_stream().w()?;
        // The step's own bf16 buffer: per layer the Q, K and V weights back
        // to back (one [(nh + 2 nkv) d, H] matrix, one GEMM) and the gate
        // and up weights back to back; for an f32 model every other weight
        // the step reads too. Each entry: source tensor, element offset.
        let mut copies: Vec<(Tensor, usize)> = Vec::new();
        let mut total = 0usize;
        let mut place = |t: &Tensor, group_start: bool| -> usize {
            if group_start {
                total = total.next_multiple_of(128);
            }
            let at = total;
            copies.push((t.clone(), at));
            total += t.elem_count();
            at
        };
        let mut fused = Vec::with_capacity(model.layers.len());
        for l in &model.layers {
            let a = &l.attn;
            let qkv = place(&a.q.weight, true);
            place(&a.k.weight, false);
            place(&a.v.weight, false);
            let gate_up = place(&l.mlp.gate.weight, true);
            place(&l.mlp.up.weight, false);
            fused.push((qkv, gate_up));
        }
        // An f32 model's other weights (the tied LM head is the embedding:
        // one entry).
        let mut other: HashMap<candle_core::TensorId, usize> = HashMap::new();
        if cast_all {
            let mut rest: Vec<&Tensor> = Vec::new();
            for l in &model.layers {
                let a = &l.attn;
                rest.extend([&l.input_norm.weight, &a.o.weight, &l.post_norm.weight]);
                rest.push(&l.mlp.down.weight);
                rest.extend([&a.q.bias, &a.k.bias, &a.v.bias].into_iter().flatten());
                rest.extend(
                    [&a.q_norm, &a.k_norm]
                        .into_iter()
                        .flatten()
                        .map(|n| &n.weight),
                );
            }
            rest.extend([&model.embed, &model.norm.weight, &model.lm_head]);
            for t in rest {
                other.entry(t.id()).or_insert_with(|| place(t, true));
            }
        }
        tracing::info!(
            "dedicated GPU step: a {} MiB bf16 weight copy",
            (2 * total) >> 20
        );
        let copy_buf = stream.alloc_zeros::<half::bf16>(total.max(1)).w()?;
        let base = copy_buf.device_ptr(&stream).0;
        let in_copy = |off: usize| base + 2 * off as u64;
        let at = |t: &Tensor| -> Result<u64> {
            match other.get(&t.id()) {
                Some(&off) => Ok(in_copy(off)),
                None => addr(t, &stream),
            }
        };
        let opt = |t: Option<&Tensor>| -> Result<u64> { t.map_or(Ok(0), at) };
        let mut layers = Vec::with_capacity(model.layers.len());
        for (i, (l, &(qkv, gate_up))) in model.layers.iter().zip(&fused).enumerate() {
            let a = &l.attn;
            let (kc, vc) = cache.layer(i);
            layers.push(LayerPtrs {
                in_norm: at(&l.input_norm.weight)?,
                qkv: in_copy(qkv),
                q_bias: opt(a.q.bias.as_ref())?,
                k_bias: opt(a.k.bias.as_ref())?,
                v_bias: opt(a.v.bias.as_ref())?,
                q_norm: opt(a.q_norm.as_ref().map(|n| &n.weight))?,
                k_norm: opt(a.k_norm.as_ref().map(|n| &n.weight))?,
                o: at(&a.o.weight)?,
                post_norm: at(&l.post_norm.weight)?,
                gate_up: in_copy(gate_up),
                down: at(&l.mlp.down.weight)?,
                k_cache: addr(kc, &stream)?,
                v_cache: addr(vc, &stream)?,
            });
        }
        let embed = at(&model.embed)?;
        let final_norm = at(&model.norm.weight)?;
        let lm_head = at(&model.lm_head)?;
        // The tensors whose buffers the step reads directly.
        let mut keep: Vec<Tensor> = vec![model.embed.clone(), model.norm.weight.clone()];
        keep.push(model.lm_head.clone());
        for (i, l) in model.layers.iter().enumerate() {
            let a = &l.attn;
            keep.extend(
                [&l.input_norm.weight, &a.o.weight, &l.post_norm.weight].map(Tensor::clone),
            );
            keep.push(l.mlp.down.weight.clone());
            keep.extend(
                [&a.q.bias, &a.k.bias, &a.v.bias]
                    .into_iter()
                    .flatten()
                    .cloned(),
            );
            keep.extend(
                [&a.q_norm, &a.k_norm]
                    .into_iter()
                    .flatten()
                    .map(|n| n.weight.clone()),
            );
            let (k, v) = cache.layer(i);
            keep.extend([k.clone(), v.clone()]);
        }
        let dims = Dims {
            hidden: cfg.hidden_size,
            intermediate: cfg.intermediate_size,
            heads: cfg.num_attention_heads,
            kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
            vocab: cfg.vocab_size,
        };
        let rows = bucket(max_seqs.min(BUCKETS[BUCKETS.len() - 1])).unwrap_or(1);
        let tokens = max_batch_tokens.max(rows);
        let plan = ArenaPlan::new(&dims, tokens, rows);
        let arena = stream.alloc_zeros::<u8>(plan.bytes).w()?;
        let max_table = table_width(max_context.div_ceil(cache.block_size()));
        let words = InputLayout::new(StepShape {
            tokens,
            seqs: rows,
            samples: rows,
            table_width: max_table,
        })
        .words;
        let input = stream.alloc_zeros::<u32>(words).w()?;
        let inv_freq = stream.clone_htod(model.rope.inv_freq()).w()?;
        let blas = CudaBlas::new(stream.clone()).w()?;
        // cuBLAS gets its own workspace, so it allocates nothing while a
        // step is captured.
        let workspace = stream.alloc_zeros::<u8>(32 << 20).w()?;
        {
            let (p, _sync) = workspace.device_ptr(&stream);
            // SAFETY: the workspace lives as long as the handle (both are
            // fields of this decoder); its size is what is passed.
            unsafe { cb::cublasSetWorkspace_v2(*blas.handle(), p as *mut c_void, 32 << 20) }
                .result()
                .w()?;
        }
        let kernel = |module: &'static str, name: &str| -> Result<Kernel> {
            Ok(Kernel::get(dev, module, name)?.on(stream.clone()))
        };
        let kernels = Kernels {
            gather: kernel("decode", "fd_gather_rows")?,
            embed: kernel("decode", "fd_embed")?,
            norm: kernel("decode", "fd_add_rmsnorm")?,
            rope: kernel("decode", "fd_qk_rope_write")?,
            silu: kernel("decode", "fd_silu_mul")?,
            cast: kernel("decode", "fd_cast_bf16")?,
            copy: kernel("decode", "fd_copy_bf16")?,
            attn: kernel("paged_attention", "paged_attention_bf16")?,
            sample: kernel("sample", "sample_rows")?,
        };
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .w()?
            .max(1) as usize;
        // Captured launches must not record events (candle's tracking).
        let use_graphs = arbor_ops::GpuCut::Graphs.on() && !dev.is_event_tracking();
        let mut this = FastDecoder {
            stream,
            candle_stream,
            blas,
            _workspace: workspace,
            arena,
            plan,
            input,
            max_table,
            inv_freq,
            layers,
            embed,
            final_norm,
            lm_head,
            dims,
            eps: cfg.rms_norm_eps as f32,
            n_slots: (cache.num_blocks() * cache.block_size()) as u32,
            block_size: cache.block_size() as u32,
            sms,
            kernels,
            graphs: HashMap::new(),
            use_graphs,
            _keep: keep,
            copy: WeightCopy {
                buf: copy_buf,
                copies,
            },
        };
        this.refresh()?;
        Ok(this)
    }

    /// Refills the step's weight copy in place (the same buffer, so
    /// captured graphs stay valid): after each weight update. bf16 sources
    /// are copied, f32 ones rounded. Returns after the copy is done.
    pub fn refresh(&mut self) -> Result<()> {
        // The update ran on candle's stream.
        self.stream.join(&self.candle_stream).w()?;
        let c = &self.copy;
        let (base, _sync) = c.buf.device_ptr(&self.stream);
        for (t, off) in &c.copies {
            let src = arbor_ops::cuda::tensor_ptr(t, &self.stream)?;
            let dst = base + 2 * *off as u64;
            let n = t.elem_count();
            let k = if t.dtype() == DType::F32 {
                &self.kernels.cast
            } else {
                &self.kernels.copy
            };
            launch!(k, arbor_ops::cuda::grid1d(n, 256), &src, &dst, &n)?;
        }
        self.stream.synchronize().w()
    }

    /// Whether a step of shape `sh` fits the buffers (else the engine runs
    /// it through the candle forward).
    pub fn fits(&self, sh: &StepShape) -> bool {
        sh.tokens <= self.plan.tokens
            && sh.seqs <= self.plan.rows
            && sh.samples <= self.plan.rows
            && sh.table_width <= self.max_table
    }

    /// Run one step: write the new tokens' KV, sample each of
    /// `step.samples` on the device. A decode step (one token a sequence)
    /// replays its bucket's captured graph (capturing it the first time);
    /// any other step (prefills, fan-outs) runs its launches directly.
    /// Returns one result per sample (`None`: the logits held no
    /// distribution).
    pub fn step(&mut self, step: &StepIn<'_>) -> Result<Vec<Option<Sampled>>> {
        let shape = StepShape::of(step);
        if !self.fits(&shape) {
            candle_core::bail!("fast decode: a step larger than its buffers");
        }
        step.check(self.block_size as usize)
            .map_err(|e| candle_core::Error::Msg(format!("fast decode: {e}")))?;
        // The kernels index with these: check them here, on the host.
        if let Some(t) = step.tokens.iter().find(|&&t| t as usize >= self.dims.vocab) {
            candle_core::bail!("fast decode: token {t} outside the vocabulary");
        }
        let n_blocks = self.n_slots / self.block_size;
        if let Some(b) = step
            .tables
            .iter()
            .flat_map(|t| t.iter())
            .find(|&&b| b >= n_blocks)
        {
            candle_core::bail!("fast decode: block {b} outside the cache of {n_blocks}");
        }
        let n = step.tokens.len();
        let key = bucket(n)
            .filter(|&b| step.is_decode() && b <= self.plan.rows)
            .map(|b| GraphKey {
                bucket: b,
                table_width: shape.table_width,
            });
        let layout = InputLayout::new(key.map_or(shape, StepShape::decode));
        let buf = layout
            .pack(step, u32::MAX)
            .map_err(candle_core::Error::Msg)?;
        // Prefills and block copies on candle's stream come first.
        self.stream.join(&self.candle_stream).w()?;
        let r = self.run(key, &layout, &buf, step.samples.len());
        // The candle stream's next work (a prefill, a block copy) waits for
        // this step's KV writes, whatever happened.
        self.candle_stream.join(&self.stream).w()?;
        let words: Vec<u32> = r?
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        Ok(arbor_ops::sample::unpack_samples(&words))
    }

    /// Uploads `buf`, runs the step (its graph, or its launches), and
    /// returns the `r` samples' 12 bytes each.
    fn run(
        &mut self,
        key: Option<GraphKey>,
        layout: &InputLayout,
        buf: &[u32],
        r: usize,
    ) -> Result<Vec<u8>> {
        self.stream
            .memcpy_htod(buf, &mut self.input.slice_mut(0..buf.len()))
            .w()?;
        match key.filter(|_| self.use_graphs) {
            None => self.launch(layout)?,
            Some(key) => {
                if let Some(g) = self.graphs.get(&key) {
                    g.0.launch().w()?;
                } else {
                    // The first step of a key runs eagerly (loads, cuBLAS's
                    // heuristics), then the same launches are captured.
                    self.launch(layout)?;
                    match self.capture(layout) {
                        Ok(Some(g)) => {
                            self.graphs.insert(key, Graph(g));
                        }
                        Ok(None) => {}
                        Err(e) => {
                            // This step's results are in (the eager run);
                            // later steps run eagerly too.
                            tracing::warn!(
                                "CUDA graph capture failed, decoding without graphs: {e}"
                            );
                            self.use_graphs = false;
                        }
                    }
                }
            }
        }
        let at = self.plan.sampled;
        self.stream
            .clone_dtoh(&self.arena.slice(at..at + 12 * r))
            .w()
    }

    /// The launches of one step for `layout`, captured as a graph (not
    /// run).
    fn capture(&self, layout: &InputLayout) -> Result<Option<CudaGraph>> {
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .w()?;
        let recorded = self.launch(layout);
        // Capture ends whatever happened, so the stream is usable again.
        let graph = self
            .stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .w();
        recorded?;
        graph
    }

    /// `y[m, n] = x[m, k] w[n, k]^T`: bf16 inputs, f32 accumulation, `y`
    /// bf16 (or f32 when `f32_out`).
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        m: usize,
        n: usize,
        k: usize,
        x: u64,
        w: u64,
        y: u64,
        f32_out: bool,
    ) -> Result<()> {
        let (alpha, beta) = (1f32, 0f32);
        let out = if f32_out {
            cb::cudaDataType::CUDA_R_32F
        } else {
            cb::cudaDataType::CUDA_R_16BF
        };
        // Row-major y = x w^T is column-major y^T = w^T' x^T': op(A) = w^T
        // (w is column-major k x n), op(B) = x (column-major k x m).
        // SAFETY: x, w and y are device buffers of at least m*k, n*k and
        // m*n elements (the arena plan and the model's shapes), on the
        // handle's stream; alpha and beta are host f32s (the default
        // pointer mode).
        unsafe {
            cb::cublasGemmEx(
                *self.blas.handle(),
                cb::cublasOperation_t::CUBLAS_OP_T,
                cb::cublasOperation_t::CUBLAS_OP_N,
                n as i32,
                m as i32,
                k as i32,
                &alpha as *const f32 as *const c_void,
                w as *const c_void,
                cb::cudaDataType::CUDA_R_16BF,
                k as i32,
                x as *const c_void,
                cb::cudaDataType::CUDA_R_16BF,
                k as i32,
                &beta as *const f32 as *const c_void,
                y as *mut c_void,
                out,
                n as i32,
                cb::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cb::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .result()
        .w()
    }

    /// Every launch of one step for `layout`'s bucket, on the decoder's
    /// stream (run eagerly, or recorded into a graph).
    fn launch(&self, layout: &InputLayout) -> Result<()> {
        let d = self.dims;
        let sh = layout.shape;
        // Token kernels run over the new tokens, the LM head over the
        // sequences, sampling over the samples.
        let (b, s_rows, r_rows) = (sh.tokens, sh.seqs, sh.samples);
        let (arena, _s1) = self.arena.device_ptr(&self.stream);
        let (input, _s2) = self.input.device_ptr(&self.stream);
        let (inv_freq, _s3) = self.inv_freq.device_ptr(&self.stream);
        let a = self.plan;
        let buf = |off: usize| arena + off as u64;
        let (resid, normed, qkv) = (buf(a.resid), buf(a.normed), buf(a.qkv));
        let (q_rope, attn, delta_buf) = (buf(a.q_rope), buf(a.attn), buf(a.delta));
        let (gate_up, act, last_rows, logits, sampled) = (
            buf(a.gate_up),
            buf(a.act),
            buf(a.last),
            buf(a.logits),
            buf(a.sampled),
        );
        let word = |w: usize| input + 4 * w as u64;
        let (ids, pos, slots, seq, tables, last, params) = (
            word(layout.ids),
            word(layout.positions),
            word(layout.slots),
            word(layout.seq),
            word(layout.tables),
            word(layout.last),
            word(layout.params),
        );
        let (h, i) = (d.hidden as i32, d.intermediate as i32);
        let (nh, nkv, hd) = (d.heads as i32, d.kv_heads as i32, d.head_dim as i32);
        let grid = |n: usize, threads: u32| LaunchConfig {
            grid_dim: (n as u32, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let rows = |threads: u32| grid(b, threads);
        let eps = self.eps;
        let (null, add, first) = (0u64, 1i32, 0i32);
        let k = &self.kernels;
        let grid2 = |y: usize, threads: usize, shared: usize| LaunchConfig {
            grid_dim: (b as u32, y as u32, 1),
            block_dim: (threads as u32, 1, 1),
            shared_mem_bytes: shared as u32,
        };
        launch!(k.embed, rows(256), &self.embed, &ids, &resid, &h)?;
        let (qw, kvw) = (d.heads * d.head_dim, d.kv_heads * d.head_dim);
        let qkv_w = qw + 2 * kvw;
        let (k_part, v_part) = (qkv + 2 * qw as u64, qkv + 2 * (qw + kvw) as u64);
        let qkv_stride = qkv_w as i32;
        let (up_part, gu_stride) = (gate_up + 2 * d.intermediate as u64, 2 * i);
        let (bs, maxb) = (self.block_size as i32, sh.table_width as i32);
        let scale = 1.0f32 / (d.head_dim as f32).sqrt();
        // Paged attention runs one block per (token, head), its warps
        // splitting the keys: few blocks (small batches) get more warps, so
        // the GPU's SMs stay busy.
        let blocks = b * d.heads;
        let warps = if blocks < 2 * self.sms {
            16
        } else if blocks < 8 * self.sms {
            8
        } else {
            4
        };
        let n = b as i32 * i;
        let silu_grid = LaunchConfig {
            grid_dim: ((n as u32).div_ceil(256).min(4096), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        for (li, w) in self.layers.iter().enumerate() {
            let (delta, add_now) = if li == 0 {
                (null, first)
            } else {
                (delta_buf, add)
            };
            launch!(
                k.norm,
                rows(256),
                &resid,
                &delta,
                &w.in_norm,
                &normed,
                &h,
                &eps,
                &add_now
            )?;
            // One GEMM: each row of `qkv` is q | k | v.
            self.gemm(b, qkv_w, d.hidden, normed, w.qkv, qkv, false)?;
            launch!(
                k.rope,
                grid2(d.heads + d.kv_heads, d.head_dim.next_multiple_of(32), 0),
                &qkv,
                &k_part,
                &v_part,
                &w.q_bias,
                &w.k_bias,
                &w.v_bias,
                &w.q_norm,
                &w.k_norm,
                &eps,
                &inv_freq,
                &pos,
                &slots,
                &self.n_slots,
                &q_rope,
                &w.k_cache,
                &w.v_cache,
                &nh,
                &nkv,
                &hd,
                &qkv_stride,
                &qkv_stride
            )?;
            launch!(
                k.attn,
                grid2(d.heads, 32 * warps, warps * d.head_dim * 4),
                &q_rope,
                &w.k_cache,
                &w.v_cache,
                &pos,
                &seq,
                &tables,
                &attn,
                &nh,
                &nkv,
                &hd,
                &bs,
                &maxb,
                &scale
            )?;
            self.gemm(b, d.hidden, qw, attn, w.o, delta_buf, false)?;
            launch!(
                k.norm,
                rows(256),
                &resid,
                &delta_buf,
                &w.post_norm,
                &normed,
                &h,
                &eps,
                &add
            )?;
            // One GEMM: each row of `gate_up` is gate | up.
            self.gemm(
                b,
                2 * d.intermediate,
                d.hidden,
                normed,
                w.gate_up,
                gate_up,
                false,
            )?;
            launch!(k.silu, silu_grid, &gate_up, &up_part, &act, &n, &i, &gu_stride)?;
            self.gemm(b, d.hidden, d.intermediate, act, w.down, delta_buf, false)?;
        }
        launch!(
            k.norm,
            rows(256),
            &resid,
            &delta_buf,
            &self.final_norm,
            &normed,
            &h,
            &eps,
            &add
        )?;
        launch!(k.gather, grid(s_rows, 256), &normed, &last, &last_rows, &h)?;
        self.gemm(
            s_rows,
            d.vocab,
            d.hidden,
            last_rows,
            self.lm_head,
            logits,
            true,
        )?;
        let v = d.vocab as i32;
        launch!(k.sample, grid(r_rows, 1024), &logits, &params, &v, &sampled)?;
        Ok(())
    }
}
