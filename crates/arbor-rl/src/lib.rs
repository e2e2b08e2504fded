//! # arbor-rl
//!
//! The RL core of Arbor, pure math on plain data (no tensors, no I/O):
//!
//! - [`tree`]: the rollout tree (resumable states, segments with loss-mask
//!   kinds and behaviour log-probs, terminal rewards, in-flight continuations,
//!   serde);
//! - [`focus`]: FOCUS allocation (Beta posterior, expected MSE reduction `g`,
//!   caps, budgets) and the ablation selectors;
//! - [`credit`]: FOCUS credit (recursive backups `Gbar` / `Vtilde`, TD(lambda)
//!   advantages, critic targets) and the per-token arrays the loss reads;
//! - [`prefix`]: Prefix Sampling (pass-rate buckets, source selection, prefix
//!   cuts, the per-bucket ratio controller, token accounting, the four
//!   "why 50%" functions);
//! - [`baselines`]: PPO+GAE, GRPO, RLOO, DAPO dynamic sampling and VinePPO
//!   behind one advantage interface;
//! - [`ppo`]: the PPO loss pieces with analytic gradients (the CPU reference
//!   of the CUDA kernels);
//! - [`audit`]: the synthetic audit-tree diagnostic of `arbor bench audit`;
//! - [`sim`]: a simulated Prefix Sampling run.
//!
//! Specs: `shared/spec/focus.md`, `shared/spec/prefix-sampling.md`.

pub mod audit;
pub mod baselines;
pub mod credit;
pub mod error;
pub mod focus;
pub mod ppo;
pub mod prefix;
pub mod sim;
pub mod tree;

pub use error::{Result, RlError};
pub use tree::{Episode, Node, NodeId, RolloutTree, Segment, Step, Ticket, TokenKind};
