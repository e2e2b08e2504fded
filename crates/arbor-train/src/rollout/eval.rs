//! Evaluation: one greedy episode per held-out task.

use arbor_engine::Engine;

use super::{run_episodes, RolloutConfig, TaskInstance};
use crate::TrainError;

/// Greedy (temperature 0) pass rate over `tasks`: the fraction of episodes
/// ending with reward 1 (`env_workers`: see [`super::sched`]).
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
    let greedy = RolloutConfig {
        temperature: 0.0,
        ..cfg.clone()
    };
    let (rewards, _) = run_episodes(engine, tasks, &greedy, 0, env_workers)?;
    let solved = rewards.iter().filter(|&&r| r >= 1.0).count();
    Ok(solved as f64 / n as f64)
}
