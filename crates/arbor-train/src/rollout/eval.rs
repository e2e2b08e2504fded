//! Evaluation: one greedy episode per held-out task.

use arbor_engine::Engine;

use super::{run_episodes, RolloutConfig, TaskInstance};
use crate::metrics::ContextMetrics;
use crate::TrainError;

/// Greedy (temperature 0) pass rate over `tasks`: the fraction of episodes
/// ending with reward 1 (`env_workers`: see [`super::sched`]).
pub fn evaluate(
    engine: &mut Engine,
    tasks: Vec<TaskInstance>,
    cfg: &RolloutConfig,
    env_workers: usize,
) -> Result<f64, TrainError> {
    Ok(evaluate_with_context(engine, tasks, cfg, env_workers)?.0)
}

/// [`evaluate`], with the context management of the greedy episodes
/// (`None` for tasks without a bounded context): how the policy compacts
/// when it does not sample.
pub fn evaluate_with_context(
    engine: &mut Engine,
    tasks: Vec<TaskInstance>,
    cfg: &RolloutConfig,
    env_workers: usize,
) -> Result<(f64, Option<ContextMetrics>), TrainError> {
    let n = tasks.len();
    if n == 0 {
        return Ok((0.0, None));
    }
    let greedy = RolloutConfig {
        temperature: 0.0,
        ..cfg.clone()
    };
    let (rewards, stats) = run_episodes(engine, tasks, &greedy, 0, env_workers)?;
    let solved = rewards.iter().filter(|&&r| r >= 1.0).count();
    let context = (stats.context != Default::default())
        .then(|| ContextMetrics::new(&stats.context, stats.finished_episodes));
    Ok((solved as f64 / n as f64, context))
}
