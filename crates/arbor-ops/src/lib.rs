//! # arbor-ops
//!
//! Arbor's own kernels. Every op has a CPU reference (tested against float64
//! brute force or finite differences) and, with the `cuda` feature, a CUDA
//! kernel from `kernels/*.cu` compiled to PTX by `build.rs`, exposed as a
//! candle `CustomOp` so it sits in the autograd graph:
//!
//! - [`fused_logprobs`]: LM head + log-softmax + gather + entropy in chunks,
//!   with a recomputing backward (no `[N, V]` logits held, ever);
//! - [`ppo_loss`], [`value_loss`]: masked clipped PPO loss (asymmetric clip,
//!   token or sequence aggregation through [`token_weights`]) and clipped
//!   value loss, forward and backward;
//! - [`segment_broadcast`], [`segment_sum`], [`segment_mean`]: per-segment
//!   advantages to token positions and back;
//! - [`paged_attention_op`], [`cache_write`]: attention over the engine's
//!   block tables and KV writes into the paged cache;
//! - [`rows`]: fused row-wise f32 kernels of the generation forward
//!   (RMSNorm, head split + q/k-norm + RoPE, `silu(g) * u`);
//! - [`matmul_nt_op`]: the CPU `x w^T` of every `Linear` (AVX-512; f32
//!   weights, or bf16 weights with AVX-512 BF16), row-invariant: a row's
//!   result never depends on the rest of the batch; grouped calls for
//!   several weights of one input ([`matmul_nt_multi_into`]).
//!
//! The slice-level [`paged_attention`] is the engine's CPU kernel, compiled
//! for several x86 feature levels and picked at run time (`multiversion`).

mod attention;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod logprob;
pub mod matmul;
pub mod paged;
pub mod ppo;
pub mod rows;
pub mod segment;
mod simd;

pub use attention::{paged_attention, PagedAttentionArgs};
pub use logprob::{fused_logprobs, DEFAULT_CHUNK_ELEMS};
pub use matmul::{
    matmul_nt, matmul_nt_available, matmul_nt_bf16, matmul_nt_bf16_available, matmul_nt_into,
    matmul_nt_multi_into, matmul_nt_op, WeightRows,
};
pub use paged::{cache_write, paged_attention_op, PagedMeta};
pub use ppo::{pack_aux, ppo_loss, token_weights, value_loss, Aggregation, PpoClip};
pub use segment::{segment_broadcast, segment_mean, segment_sum};

/// Run `f` on a rayon worker thread when `device` is the CPU (moved there
/// once, unless the caller already is one), else on the calling thread. CPU kernels
/// called from inside the pool push their parallel work onto the worker's
/// own queue; called from outside, each call is injected into the pool and
/// waits on a sleeping worker's wake-up (30-50 us a call on a 2-core
/// machine: a third of a decode-sized matmul). Wrap a whole step (a
/// forward, an update) with it, not single calls. The step runs on a worker's
/// stack (the `arbor` binary gives workers 16 MiB: candle's backward walks
/// the graph recursively), and a worker waiting inside another caller's
/// parallel call may run this step first: fine for compute, but `f` must not
/// wait on locks that such a caller holds.
pub fn in_pool<R: Send>(device: &candle_core::Device, f: impl FnOnce() -> R + Send) -> R {
    if device.is_cpu() && rayon::current_thread_index().is_none() {
        rayon::scope(|_| f())
    } else {
        f()
    }
}

static POISON: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Poison (NaN-fill) the output buffers of the CUDA ops before their kernels
/// write them, so an unwritten element shows up in a check. Off by default
/// (outputs start zeroed); `arbor check-device` turns it on. The CPU ops
/// build every output element explicitly and are unaffected.
pub fn set_poison(on: bool) {
    POISON.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether [`set_poison`] is on.
pub fn poison() -> bool {
    POISON.load(std::sync::atomic::Ordering::Relaxed)
}
