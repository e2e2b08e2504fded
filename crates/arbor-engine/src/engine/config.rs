//! Engine sizing: block size, pool memory, batch limits.

use serde::{Deserialize, Serialize};

#[cfg(doc)]
use super::Engine;
#[cfg(doc)]
use arbor_model::Transformer;

/// Engine sizing.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EngineConfig {
    /// Token slots per KV block.
    pub block_size: usize,
    /// KV blocks in the pool; 0 derives it from `kv_memory_mib`.
    pub num_blocks: usize,
    /// Memory for the KV pool when `num_blocks` is 0.
    pub kv_memory_mib: usize,
    /// Most sequences in one forward step: admission stops there, and
    /// running sequences beyond it (a fan-out wider than `max_seqs`) keep
    /// their KV and wait for a later step.
    pub max_seqs: usize,
    /// Most new tokens in one forward step (a single longer prompt still
    /// runs, alone).
    pub max_batch_tokens: usize,
    /// Longest sequence (prompt + generated); 0 means the model's
    /// `max_position_embeddings`.
    pub max_context: usize,
    /// Keep the KV cache as device tensors in the model's dtype
    /// ([`crate::paged::DeviceKvCache`]: the CUDA kernels on a GPU) instead
    /// of host slices (f32, or bf16 for a model whose
    /// [`Transformer::kv_dtype`] is bf16). `None`: on the device whenever
    /// the model is not on the CPU.
    #[serde(default)]
    pub kv_on_device: Option<bool>,
    /// Back the model's CPU weight matrices with transparent huge pages
    /// when the engine is built ([`Transformer::back_weights_with_huge_pages`]:
    /// 0.2-0.7 s once for 500 MB; generation then ran 3-13% faster on a
    /// 2-core Zen 2). Best effort; Linux with glibc only.
    #[serde(default = "yes")]
    pub huge_pages: bool,
    /// On a GPU, generate from an f32 model through the dedicated bf16 step
    /// ([`crate::fast`]): the step keeps a bf16 copy of the weights, which
    /// [`Engine::invalidate`] refreshes in place (so captured graphs stay
    /// valid), and the KV cache holds bf16. Behaviour logprobs are then
    /// those of the bf16 model, as with any bf16 inference engine feeding
    /// an f32 learner. Steps the dedicated step does not take (a sequence
    /// with top-k / top-p / min-p cuts, a step larger than its buffers, or
    /// a model it cannot run, which is warned about) run the f32 weights
    /// over the bf16 KV cache. A bf16 model takes the dedicated step
    /// regardless.
    #[serde(default)]
    pub bf16_rollouts: bool,
    /// Keep the engine's f32 CPU weight matrices repacked for the
    /// outer-product matmul ([`Transformer::pack_weights`]; a copy of
    /// each, refreshed by [`Engine::invalidate`]). Off, the same bits come
    /// from packing every matrix on every call.
    #[serde(default = "yes")]
    pub pack_weights: bool,
}

fn yes() -> bool {
    true
}

/// Physical memory in bytes (`MemTotal` of `/proc/meminfo`), where known.
pub(super) fn physical_memory() -> Option<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: usize = info
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse()
        .ok()?;
    kib.checked_mul(1024)
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            block_size: 16,
            num_blocks: 0,
            kv_memory_mib: 2048,
            max_seqs: 256,
            max_batch_tokens: 2048,
            max_context: 0,
            kv_on_device: None,
            bf16_rollouts: false,
            huge_pages: true,
            pack_weights: true,
        }
    }
}
