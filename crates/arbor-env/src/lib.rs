//! # arbor-env
//!
//! Everything a rollout talks to besides the model:
//!
//! - [`env`](mod@env): the multi-turn interface ([`Env`]: reset, step, fork, fresh),
//!   [`Episode`] (transcript, per-segment spans with loss-mask kinds, fork,
//!   replay-through-execution), [`Trajectory`] records;
//! - [`vocab`]: the fixed 32-token vocabulary of the small synthetic tasks;
//! - [`synthetic`]: built-in tasks (running sum; a stateful register tool),
//!   token or text surface, seeded, binary reward;
//! - [`chat`]: plain and Qwen3 chat scaffolding of observations;
//! - [`toolcall`]: robust Qwen `<tool_call>` parsing;
//! - [`context`]: a bounded context for the token tasks (compaction,
//!   structured summaries, workspace memory) and its per-episode counts;
//! - [`harness`]: the tool harness (schema-checked tool calls, output
//!   truncation, context budget with policy-written compaction or an
//!   in-memory workspace);
//! - [`math`]: answer extraction, normalisation, equivalence, dataset
//!   loaders and a single-turn math env;
//! - [`swe`]: the bubblewrap sandbox, SWE-bench-style repository tasks
//!   (tools, hidden-test and localization rewards, CoW forks) and the
//!   HumanEval-derived task builder;
//! - [`tasks`]: opening a task from a spec string and replaying recorded
//!   trajectories (`arbor replay`);
//! - [`data`]: JSONL reading (plain or gzip) with `file:line` errors.
//!
//! Methods: `docs/focus.md` (segments, compaction),
//! `docs/prefix-sampling.md` (replay through execution).

pub mod chat;
pub mod context;
pub mod data;
pub mod env;
pub mod error;
pub mod harness;
pub mod math;
pub mod swe;
pub mod synthetic;
pub mod tasks;
pub mod toolcall;
pub mod vocab;

pub use env::{
    replay, Action, Env, Episode, Observation, SegmentSpans, Span, StepOutcome, Trajectory, Turn,
};
pub use error::{EnvError, Result};
pub use vocab::SmallVocab;
