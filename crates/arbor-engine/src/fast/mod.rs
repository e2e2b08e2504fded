//! The dedicated GPU step for Qwen-family models (bf16 weights, or a bf16
//! copy of an f32 model's with `bf16_rollouts`; f32 accumulation): per
//! layer, add + RMSNorm, one GEMM over the concatenated Q, K, V weights,
//! q/k-norm + RoPE + KV-cache write in one kernel, paged attention over the
//! engine's block tables, the O GEMM, add + RMSNorm, one GEMM over the
//! concatenated gate and up weights, SiLU x up, the down GEMM;
//! then the final norm, each sequence's last token, the LM head and
//! sampling on the device. Buffers come from one arena allocated once.
//!
//! The engine runs every step on it (prefills and fan-outs included) unless
//! a sequence has top-k / top-p / min-p cuts or the step is larger than its
//! buffers; those go through the candle forward, on the same KV cache.
//! Decode steps (one new token a sequence) are captured as a CUDA graph
//! per (batch bucket, table width) and replayed. [`plan`] is the
//! device-free part (buckets, the input buffer, the arena), tested on the
//! CPU; the kernels are checked against their references, and the step
//! against an f32 model, by `arbor check-device`.

pub mod plan;

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
pub use cuda::{FastDecoder, Sizes};
