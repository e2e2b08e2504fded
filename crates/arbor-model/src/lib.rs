//! # arbor-model
//!
//! The model layer of Arbor: HF configs for Qwen2 / Qwen2.5 / Qwen3 / Llama,
//! memory-mapped safetensors loading (local or HF hub), tokenizer and chat
//! template, and one decoder implementation that serves both the
//! differentiable training forward over packed sequences
//! ([`Transformer::forward_packed`]) and the
//! paged generation engine (through [`AttentionBackend`]), plus the value
//! head of the critic.
//!
//! ```no_run
//! use arbor_model::{LoadedModel, LoadOptions};
//! let m = LoadedModel::load("Qwen/Qwen3-0.6B", &LoadOptions::default()).unwrap();
//! let ids = m.tokenizer.as_ref().unwrap().encode("1 + 1 =", true).unwrap();
//! let scored = m.score(&ids).unwrap();
//! println!("{:?}", scored.logprobs);
//! ```

pub mod config;
pub mod error;
pub mod hugepages;
mod loaded;
pub mod logprobs;
pub mod model;
pub mod rope;
pub mod tokenizer;
pub mod value;
pub mod weights;

pub use config::{Arch, ModelConfig, RopeScaling};
pub use error::{ModelError, Result};
pub use loaded::{parse_dtype, score, LoadOptions, LoadedModel, Scored};
pub use model::{AttentionBackend, LayerCheckpoints, LoraAdapter, LoraConfig, Transformer};
pub use tokenizer::{ChatOptions, ChatTemplate, Tokenizer};
pub use value::{ActorCritic, CriticMode, ValueHead};
pub use weights::{Checkpoint, Init, ModelFiles, ParamLoader, ParamSource};
