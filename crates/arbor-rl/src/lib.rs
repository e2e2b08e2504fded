//! # arbor-rl
//!
//! The RL core of Arbor, pure math on plain data (no tensors, no I/O):
//!
//! - [`tree`]: the rollout tree (resumable states, segments with loss-mask
//!   kinds and behaviour log-probs, terminal rewards, in-flight continuations,
//!   serde);
//! - [`focus`]: FOCUS allocation (Beta posterior, expected MSE reduction `g`,
//!   caps, budgets) and the ablation selectors;
//! - [`diagnostics`]: where an allocator spent the budget (by depth,
//!   score, `n_eff`, settled states) and critic-quality statistics;
//! - [`credit`]: FOCUS credit (recursive backups `Gbar` / `Vtilde`, TD(lambda)
//!   advantages, critic targets) and the per-token arrays the loss reads;
//! - [`prefix`]: Prefix Sampling (pass-rate buckets, source selection, prefix
//!   cuts, the per-bucket ratio controller, token accounting, the four
//!   "why 50%" functions);
//! - [`baselines`]: PPO+GAE, GRPO, RLOO, DAPO dynamic sampling and VinePPO
//!   behind one advantage interface;
//! - [`ppo`]: the policy-loss settings and the aggregation weights that
//!   turn per-token losses (the `arbor-ops` kernels) into one batch loss;
//! - [`audit`]: the synthetic audit-tree diagnostic of `arbor bench audit`;
//! - [`sim`]: a simulated Prefix Sampling run.
//!
//! The methods as implemented: `docs/focus.md`, `docs/prefix-sampling.md`.
//!
//! One FOCUS step, end to end:
//!
//! ```
//! use arbor_rl::credit::{focus_credit, loss_rows, CreditConfig, Sharing};
//! use arbor_rl::focus::{Allocator, AllocatorConfig, AsyncGain, Budget, Focus};
//! use arbor_rl::{RolloutTree, Segment, Step};
//!
//! let mut tree = RolloutTree::new();
//! let root = tree.add_episode("task-1", vec![1, 2, 3], Some(0.5))?;
//! let cfg = AllocatorConfig::new(4, Budget::Continuations(3), 7);
//! let mut alloc = Allocator::new(cfg, Focus::new(1.0, AsyncGain::EffectiveCount)?)?;
//! while !alloc.is_done() {
//!     for ticket in alloc.fill(&mut tree)? {
//!         // The harness generates from ticket.node() and reports the path.
//!         let act = Segment::policy(&[10, 11], &[-0.3, -0.2])?;
//!         let done = Segment::policy(&[12], &[-0.1])?;
//!         let steps = vec![Step::new(act).value(0.6), Step::new(done).terminal(1.0)];
//!         alloc.complete(&mut tree, ticket, steps)?;
//!     }
//! }
//! let credit = focus_credit(&tree, &CreditConfig::default())?;
//! let rows = loss_rows(&tree, &credit.tokens, Some(&credit.backup.gbar), Sharing::Once)?;
//! assert_eq!(rows.len(), 3);
//! # Ok::<(), arbor_rl::RlError>(())
//! ```

pub mod audit;
pub mod baselines;
pub mod credit;
pub mod diagnostics;
pub mod error;
pub mod focus;
pub mod ppo;
pub mod prefix;
pub mod sim;
pub mod tree;

pub use error::{Result, RlError};
pub use tree::{Episode, Node, NodeId, RolloutTree, Segment, Step, Ticket, TokenKind};
