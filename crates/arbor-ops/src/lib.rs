//! # arbor-ops
//!
//! Arbor's own kernels. Every op has a CPU reference (tested against float64
//! brute force or finite differences) and, with the `cuda` feature, a CUDA
//! kernel from `kernels/*.cu` compiled by `build.rs` (SASS + PTX), exposed as a
//! candle `CustomOp` so it sits in the autograd graph:
//!
//! - [`fused_logprobs`]: LM head + log-softmax + gather + entropy in chunks,
//!   with a recomputing backward (no `[N, V]` logits held, ever);
//! - [`ppo_loss`], [`value_loss`]: masked clipped PPO loss (asymmetric clip,
//!   per-token weights carry the mask and the aggregation) and clipped
//!   value loss, forward and backward;
//! - [`rms_norm`], [`rope`], [`swiglu`], [`packed_causal_attention`]: the
//!   training forward's fused ops with hand-written backward (attention over
//!   sequences packed back to back, no `[T, T]` matrix kept);
//! - [`adamw_step`], [`sum_sq`]: the optimizer's update in place and the
//!   gradient norm, without parameter-sized temporaries;
//! - [`segment_broadcast`], [`segment_sum`], [`segment_mean`]: per-segment
//!   advantages to token positions and back;
//! - [`paged_attention_op`], [`cache_write`]: attention over the engine's
//!   block tables and KV writes into the paged cache;
//! - [`sample_rows`]: greedy and tempered sampling with the chosen token's
//!   logprob and the entropy, where the logits are (one launch on a GPU;
//!   only the results come back);
//! - [`decode`]: the fused kernels of the engine's dedicated GPU decode
//!   step (add + RMSNorm, q/k-norm + RoPE + KV write, SiLU x up) and their
//!   host references;
//! - [`cpu::rows`]: fused row-wise f32 kernels of the generation forward
//!   (RMSNorm, head split + q/k-norm + RoPE, `silu(g) * u`);
//! - [`matmul_nt_op`]: the CPU `x w^T` of every `Linear` (f32 or bf16
//!   weights; AVX-512, AVX2 or portable kernels, [`MatmulIsa`]),
//!   row-invariant: a row's result never depends on the rest of the batch;
//!   grouped calls for several weights of one input
//!   ([`matmul_nt_multi_into`]).
//!
//! The slice-level [`paged_attention`] is the engine's CPU kernel, compiled
//! for several x86 feature levels and picked at run time (`multiversion`).

pub mod adamw;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod decode;
pub mod fused;
pub mod linear;
pub mod logprob;
pub mod paged;
pub mod ppo;
pub mod sample;
pub mod segment;
pub mod tuning;

pub use adamw::{adamw_step, sum_sq, AdamWStep};
pub use cpu::attention::{paged_attention, KvElem, PagedAttentionArgs};
pub use cpu::matmul::{
    matmul_nt, matmul_nt_bf16, matmul_nt_into, matmul_nt_multi, matmul_nt_multi_into,
    matmul_nt_multi_into_isa, round_bf16, MatmulIsa, WeightRows,
};
pub use fused::{packed_causal_attention, rms_norm, rope, swiglu};
pub use linear::{matmul_nt_bf16_op, matmul_nt_op};
pub use logprob::{fused_logprobs, fused_logprobs_bf16, DEFAULT_CHUNK_ELEMS};
pub use paged::{cache_write, paged_attention_op, PackedTables, PagedMeta};
pub use ppo::{pack_aux, ppo_loss, value_loss, PpoClip};
pub use sample::{sample_row, sample_rows, SampleRequest, Sampled};
pub use segment::{segment_broadcast, segment_mean, segment_sum};
pub use tuning::GpuCut;

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

/// [`in_pool`], with the pool's other workers kept polling for `f`'s
/// parallel work until `f` returns, instead of falling asleep between its
/// kernel calls. Rayon puts an idle worker to sleep after about 32 rounds
/// (a few tens of microseconds), and the next call then waits for a futex
/// wake-up while the step's thread works alone: about 15 thousand times in
/// one `arbor bench generate` run, whose decode steps make ~200 short
/// parallel calls with short serial stretches between them; polling made
/// it 5-10% faster. The polling threads yield the CPU when idle, but they
/// still compete for cores with other threads that want them, notably
/// candle's own CPU thread pool (candle >= 0.11 runs elementwise ops on
/// 64K elements and more on it): use this for steps that make no such
/// calls (the engine's generation forward, built on [`cpu::rows`] and
/// [`matmul_nt_op`]), [`in_pool`] for the rest (a learner update).
pub fn in_pool_polling<R: Send>(device: &candle_core::Device, f: impl FnOnce() -> R + Send) -> R {
    if !device.is_cpu() || rayon::current_thread_index().is_some() {
        return f();
    }
    let done = std::sync::atomic::AtomicBool::new(false);
    let done = &done;
    rayon::scope(|s| {
        let owner = rayon::current_thread_index();
        for _ in 1..rayon::current_num_threads() {
            s.spawn(move |_| keep_awake(done, owner));
        }
        let _stop = StopOnDrop(done);
        f()
    })
}

/// Sets its flag when dropped (also while unwinding from a panic, so the
/// pollers of [`in_pool_polling`] stop and the scope can finish).
struct StopOnDrop<'a>(&'a std::sync::atomic::AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Release);
    }
}

/// A polling worker of [`in_pool_polling`]: until `done`, run the step's
/// parallel work as it is posted, yielding the CPU between polls. Returns
/// at once on the step's own thread (`owner`), which may pop this job
/// itself while it waits on a latch.
fn keep_awake(done: &std::sync::atomic::AtomicBool, owner: Option<usize>) {
    if rayon::current_thread_index() == owner {
        return;
    }
    while !done.load(std::sync::atomic::Ordering::Acquire) {
        if rayon::yield_now() != Some(rayon::Yield::Executed) {
            std::thread::yield_now();
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;

    fn work(seed: u64) -> u64 {
        (0..20_000u64)
            .into_par_iter()
            .map(|i| (i ^ seed).wrapping_mul(2654435761) % 1000)
            .sum()
    }

    fn serial(seed: u64) -> u64 {
        (0..20_000u64)
            .map(|i| (i ^ seed).wrapping_mul(2654435761) % 1000)
            .sum()
    }

    #[test]
    fn in_pool_polling_returns_and_runs_parallel_work() {
        let cpu = candle_core::Device::Cpu;
        for seed in 0..20 {
            assert_eq!(in_pool_polling(&cpu, || work(seed)), serial(seed));
            // Nested, and from inside the pool: runs in place.
            let r = in_pool_polling(&cpu, || in_pool_polling(&cpu, || work(seed)));
            assert_eq!(r, serial(seed));
        }
    }

    #[test]
    fn in_pool_polling_from_many_threads_at_once() {
        // Several OS threads each running polled steps, plus plain in_pool
        // ones: pollers of one step run the others' work; nothing deadlocks.
        let cpu = candle_core::Device::Cpu;
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let cpu = &cpu;
                s.spawn(move || {
                    for i in 0..25 {
                        let seed = t * 100 + i;
                        let r = if i % 3 == 0 {
                            in_pool(cpu, || work(seed))
                        } else {
                            in_pool_polling(cpu, || work(seed))
                        };
                        assert_eq!(r, serial(seed));
                    }
                });
            }
        });
    }

    #[test]
    fn in_pool_polling_propagates_a_panic() {
        let cpu = candle_core::Device::Cpu;
        let r = std::panic::catch_unwind(|| {
            in_pool_polling(&cpu, || {
                let _ = work(1);
                panic!("step failed")
            });
        });
        assert!(r.is_err());
        // The pool still serves later steps.
        assert_eq!(in_pool_polling(&cpu, || work(2)), serial(2));
    }
}
