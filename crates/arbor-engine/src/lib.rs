//! # arbor-engine
//!
//! Batched generation for Arbor's rollouts, on the same
//! [`arbor_model::Transformer`] the trainer updates (no second copy of the
//! weights: the engine holds a clone of the tensor handles, which share
//! storage with the trainer's `Var`s).
//!
//! - Paged KV cache ([`arbor_kv`] bookkeeping + [`paged::PagedKvCache`]
//!   storage) with prefix caching: a prompt whose prefix was computed before
//!   (a GRPO group, a Prefix-Sampling replay, the next turn of an agent)
//!   reuses those blocks. Prompts sharing blocks that arrive together (a
//!   group sent one request at a time, forks of a sequence whose prompt is
//!   not yet computed) share them too: a waiting sequence whose next
//!   cacheable block another sequence computes in this step is admitted
//!   one step later, and takes it from the cache.
//! - Continuous batching: sequences join between steps and leave when done;
//!   all new tokens of a step (prefills and decodes) run as one packed batch
//!   with per-token positions.
//! - Admission by free blocks; when the pool runs out, the most recently
//!   admitted sequence is preempted (its blocks freed, recomputed later).
//! - Sampling with temperature, top-k, top-p, min-p, per-sequence seeded
//!   RNG, stop tokens, stop strings, max tokens; every generated token comes
//!   with its sampling logprob.
//! - [`Engine::submit`] with several [`SamplingParams`] computes the prompt
//!   once and forks the KV for each sample; [`Engine::fork`] branches a live
//!   sequence (a FOCUS branch point).
//! - [`Engine::invalidate`] after a weight update: cached KV carries the
//!   policy version and stale blocks are never reused.

mod engine;
pub mod fast;
pub mod paged;
pub mod sampling;

pub use engine::{Completion, Engine, EngineConfig, EngineStats, FinishReason};
pub use sampling::SamplingParams;

/// Identifier of a sequence in the engine (the KV manager's).
pub use arbor_kv::SeqId;

/// Errors of the engine. Request errors name the offending field and leave
/// the engine serving other sequences.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("invalid sampling parameters: {0}")]
    InvalidParams(String),
    #[error("unknown or finished sequence {0}")]
    UnknownSequence(SeqId),
    #[error("invalid engine config: {0}")]
    Config(String),
    #[error(transparent)]
    Model(#[from] arbor_model::ModelError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error(transparent)]
    Kv(#[from] arbor_kv::KvError),
}
