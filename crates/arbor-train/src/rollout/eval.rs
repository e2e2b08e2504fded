//! Evaluation: one greedy episode per held-out task.

use arbor_engine::Engine;
use arbor_rl::NodeId;

use super::conts::Cont;
use super::sched::Scheduler;
use super::{RolloutConfig, TaskInstance};
use crate::TrainError;

/// Greedy (temperature 0) pass rate over `tasks`: the fraction of episodes
/// ending with reward 1 (`env_workers`: see [`Scheduler`]).
pub fn evaluate(
    engine: &mut Engine,
    tasks: Vec<TaskInstance>,
    cfg: &RolloutConfig,
    env_workers: usize,
) -> Result<f64, TrainError> {
    let n = tasks.len();
    if n == 0 {
        return Ok(0.0);
    }
    let conts: Vec<Cont> = tasks
        .into_iter()
        .map(|t| Cont::new(None, NodeId(0), t.prompt, t.episode))
        .collect();
    let greedy = RolloutConfig {
        temperature: 0.0,
        ..cfg.clone()
    };
    let mut seed = 0;
    let conts = Scheduler::new(engine, &greedy, &mut seed, false, env_workers)?.run_all(conts)?;
    let solved = conts.iter().filter(|c| c.succeeded()).count();
    Ok(solved as f64 / n as f64)
}
