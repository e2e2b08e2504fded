//! SWE-style environments: the sandboxed executor ([`sandbox`]), repository
//! tasks with hidden tests or localization rewards ([`task`]), and
//! HumanEval-derived bug-fix tasks ([`humaneval`]).

pub mod humaneval;
pub mod repo;
pub mod sandbox;
pub mod shell;
pub mod spec;
pub mod task;

pub use sandbox::{bubblewrap_works, Limits, RunOutput, Sandbox};
pub use spec::{LogFormat, RepoSpec, TestStatus};
pub use task::{
    load_instances, load_specs, oracle, swe_env, Evaluation, Oracle, SweConfig, SweInstance,
    SweReward, SweTask,
};
