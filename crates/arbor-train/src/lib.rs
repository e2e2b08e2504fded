//! # arbor-train
//!
//! Arbor's training loop. One step:
//!
//! 1. rollouts on [`arbor_engine::Engine`] over the learner's own weights
//!    (GRPO groups, or a FOCUS tree whose continuations the allocator places
//!    by expected critic-MSE reduction) — [`rollout`];
//! 2. credit from [`arbor_rl`] (group-relative, or Eq. 1 backups + TD
//!    advantages + critic targets), flattened into per-token loss rows;
//! 3. the masked clipped-PPO and value update with AdamW — [`learner`],
//!    [`optim`];
//! 4. the engine's KV cache is invalidated: the weights changed.

pub mod learner;
pub mod optim;
pub mod rollout;
pub mod run;
pub mod tasks;
pub mod tensorboard;

/// Errors of the trainer.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error("config: {0}")]
    Config(String),
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    #[error("rollout: {0}")]
    Rollout(String),
    #[error("non-finite value: {0}")]
    NonFinite(String),
    #[error(transparent)]
    Model(#[from] arbor_model::ModelError),
    #[error(transparent)]
    Engine(#[from] arbor_engine::EngineError),
    #[error(transparent)]
    Rl(#[from] arbor_rl::RlError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}
