//! # arbor-train
//!
//! Arbor's training loop. One step:
//!
//! 1. tasks from the [`tasks::TaskSampler`];
//! 2. rollouts on [`arbor_engine::Engine`] over the learner's own weights
//!    and their credit from [`arbor_rl`], by the configured method's
//!    [`rollout::RolloutPolicy`] (GRPO groups, a FOCUS tree whose
//!    continuations the allocator places by expected critic-MSE reduction,
//!    Prefix Sampling, PPO, VinePPO), flattened into per-token loss rows;
//! 3. the masked clipped-PPO and value update with AdamW — [`learner`],
//!    [`optim`];
//! 4. the engine's KV cache is invalidated: the weights changed;
//! 5. evaluation, [`metrics`] and [`checkpoint`]s.
//!
//! [`trainer::Trainer`] runs the loop; [`config::TrainConfig`] is the whole
//! run's configuration.

pub mod checkpoint;
pub mod config;
pub mod dist;
pub mod learner;
pub mod metrics;
pub mod optim;
pub mod probe;
pub mod rollout;
pub mod tasks;
pub mod tensorboard;
pub mod trainer;

pub use config::{parse_device, Algo, CriticInit, CriticSettings, StepBudget, TrainConfig};
pub use metrics::{read_metrics, StepMetrics, Summary};
pub use trainer::Trainer;

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
    Env(#[from] arbor_env::EnvError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error("data parallel: {0}")]
    Dist(#[from] dist::DistError),
}
