//! SWE-style environments: the sandboxed executor ([`sandbox`]), repository
//! tasks with hidden tests or localization rewards ([`task`]), and
//! HumanEval-derived bug-fix tasks ([`humaneval`]).

pub mod humaneval;
pub mod sandbox;
pub mod task;

pub use sandbox::{bubblewrap_works, Limits, RunOutput, Sandbox};
pub use task::{load_instances, swe_env, Evaluation, SweConfig, SweInstance, SweReward, SweTask};
