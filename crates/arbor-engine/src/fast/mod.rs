//! The dedicated decode step for Qwen-family models on a GPU (bf16 weights,
//! f32 accumulation): per layer, add + RMSNorm, the Q/K/V GEMMs, q/k-norm +
//! RoPE + KV-cache write in one kernel, paged attention over the engine's
//! block tables, the O GEMM, add + RMSNorm, the gate and up GEMMs,
//! SiLU x up, the down GEMM; then the final norm, the LM head and sampling
//! on the device. Buffers come from one arena allocated once, and each
//! (batch bucket, table width) is captured as a CUDA graph and replayed.
//!
//! The engine takes this path for steps that only decode (one new token a
//! sequence, no top-k / top-p / min-p cuts); prefills, fan-outs and cuts go
//! through the candle forward, on the same KV cache. [`plan`] is the
//! device-free part (buckets, the input buffer, the arena), tested on the
//! CPU; the kernels are checked against their references by
//! `arbor check-device`.

pub mod plan;

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
pub use cuda::{FastDecoder, Sizes};
