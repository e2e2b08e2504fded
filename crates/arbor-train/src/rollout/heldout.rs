//! Out-of-sample critic quality: the critic's values against Monte-Carlo
//! values on states it was not trained on.
//!
//! Each held-out task gets one trajectory from the current policy; every
//! non-terminal state on it (the prompt included) then gets `k` more
//! continuations. A state's Monte-Carlo value is the mean outcome of the
//! continuations through it that started at it or above it (the main
//! trajectory and its own `k`: on-policy samples of its value). Nothing here
//! is trained on or counted in a step's budget; sampling uses its own seed
//! stream, so the training rollouts are the same with or without it.

use arbor_engine::Engine;
use arbor_rl::{NodeId, RolloutTree};

use super::conts::{begin_conts, complete_conts, root_values, segment_values, Snapshots};
use super::sched::Scheduler;
use super::{RolloutConfig, TaskInstance};
use crate::learner::Learner;
use crate::TrainError;

/// `(critic value, Monte-Carlo value)` of every non-terminal state on one
/// trajectory per task, with `k` continuations per state.
pub fn critic_vs_monte_carlo(
    engine: &mut Engine,
    learner: &Learner,
    tasks: Vec<TaskInstance>,
    cfg: &RolloutConfig,
    k: usize,
    mut seed: u64,
    env_workers: usize,
) -> Result<Vec<(f64, f64)>, TrainError> {
    if tasks.is_empty() || k == 0 {
        return Ok(Vec::new());
    }
    let mut tree = RolloutTree::new();
    let mut snapshots = Snapshots::new();
    let values = root_values(learner, &tasks)?;
    let mut roots = Vec::new();
    for (t, v) in tasks.into_iter().zip(values) {
        let root = tree.add_episode(t.id, t.prompt, Some(v))?;
        snapshots.insert(root, t.episode);
        roots.push(root);
    }
    let mut sched = Scheduler::new(engine, cfg, &mut seed, true, env_workers)?;
    let main = begin_conts(&mut tree, &snapshots, &roots)?;
    let main = sched.run_all(main)?;
    let values = segment_values(learner, &main, &tree)?;
    complete_conts(&mut tree, &mut snapshots, main, Some(values))?;
    let states: Vec<NodeId> = tree
        .nodes()
        .filter(|(_, n)| !n.is_terminal() && n.is_resumable())
        .map(|(id, _)| id)
        .collect();
    let from: Vec<NodeId> = states
        .iter()
        .flat_map(|&s| std::iter::repeat_n(s, k))
        .collect();
    let mc = begin_conts(&mut tree, &snapshots, &from)?;
    let mc = sched.run_all(mc)?;
    complete_conts(&mut tree, &mut snapshots, mc, None)?;
    let mut out = Vec::with_capacity(states.len());
    for s in states {
        let node = tree.node(s)?;
        if let (Some(v), Some(m)) = (node.value(), node.outcome_mean()) {
            out.push((v, m));
        }
    }
    Ok(out)
}
