//! Out-of-sample critic quality: the critic's values against Monte-Carlo
//! values on states it was not trained on.
//!
//! Each task gets one trajectory from the current policy; every
//! non-terminal state on it (the prompt included) then gets `k` more
//! continuations. A state's Monte-Carlo value is the mean outcome of the
//! continuations through it that started at it or above it (the main
//! trajectory and its own `k`: on-policy samples of its value). Nothing here
//! is trained on or counted in a step's budget; sampling uses its own seed
//! stream, so the training rollouts are the same with or without it.
//!
//! With few continuations a state, the Monte-Carlo values are noisy enough
//! to cap the rank correlation even the true values would show against
//! them; [`split_half`] estimates that cap from the continuations
//! themselves, so a critic's correlation can be read against it.

use arbor_engine::Engine;
use arbor_rl::diagnostics::spearman;
use arbor_rl::{NodeId, RolloutTree};

use super::conts::{begin_conts, complete_conts, Snapshots};
use super::sched::Scheduler;
use super::{RolloutConfig, TaskInstance};
use crate::learner::Learner;
use crate::TrainError;

/// A state on a sampled trajectory with its Monte-Carlo outcomes.
#[derive(Clone, Debug, PartialEq)]
pub struct StateSample {
    /// Index of the task in the list given to [`sample_states`].
    pub task: usize,
    /// Segments between the prompt and the state (0: the prompt).
    pub depth: usize,
    /// The context the state sees: what the critic reads, its value at the
    /// last token.
    pub context: Vec<u32>,
    /// The trajectory's own outcome first, then the outcomes of the `k`
    /// continuations launched from the state.
    pub outcomes: Vec<f64>,
    /// The behaviour logprobs of the path to the state (`0.0` for tokens
    /// the policy did not generate), ending aligned with `context`: the
    /// critic's surprise features read them.
    pub logprobs: Vec<f32>,
}

impl StateSample {
    /// The Monte-Carlo value: the mean of [`StateSample::outcomes`].
    pub fn monte_carlo(&self) -> f64 {
        self.outcomes.iter().sum::<f64>() / self.outcomes.len().max(1) as f64
    }
}

/// One trajectory per task, then `k` continuations from every non-terminal
/// state on it, sampled at `cfg`'s temperature from `seed`'s stream: the
/// states in task order, each with its outcomes.
pub fn sample_states(
    engine: &mut Engine,
    tasks: Vec<TaskInstance>,
    cfg: &RolloutConfig,
    k: usize,
    mut seed: u64,
    env_workers: usize,
) -> Result<Vec<StateSample>, TrainError> {
    if tasks.is_empty() {
        return Ok(Vec::new());
    }
    let mut tree = RolloutTree::new();
    let mut snapshots = Snapshots::new();
    let mut roots = Vec::new();
    for t in tasks {
        let root = tree.add_episode(t.id, t.prompt, None)?;
        snapshots.insert(root, t.episode);
        roots.push(root);
    }
    let mut sched = Scheduler::new(engine, cfg, &mut seed, true, env_workers)?;
    let main = begin_conts(&mut tree, &snapshots, &roots)?;
    let main = sched.run_all(main)?;
    let rewards: Vec<f64> = main.iter().map(super::conts::Cont::reward).collect();
    complete_conts(&mut tree, &mut snapshots, main, None)?;
    let states: Vec<NodeId> = tree
        .nodes()
        .filter(|(_, n)| !n.is_terminal() && n.is_resumable())
        .map(|(id, _)| id)
        .collect();
    let mut out = Vec::with_capacity(states.len());
    for &s in &states {
        let node = tree.node(s)?;
        let task = node.episode();
        out.push(StateSample {
            task,
            depth: node.depth(),
            context: tree.context_tokens(s)?,
            outcomes: vec![rewards[task]],
            logprobs: tree.path_logprobs(s)?,
        });
    }
    let from: Vec<NodeId> = states
        .iter()
        .flat_map(|&s| std::iter::repeat_n(s, k))
        .collect();
    let mc = begin_conts(&mut tree, &snapshots, &from)?;
    let mc = sched.run_all(mc)?;
    // Continuations come back in launch order: `k` per state, in turn.
    for (sample, conts) in out.iter_mut().zip(mc.chunks(k.max(1))) {
        sample
            .outcomes
            .extend(conts.iter().map(super::conts::Cont::reward));
    }
    Ok(out)
}

/// `(critic value, Monte-Carlo value)` of each state, the critic read at
/// the last token of the state's context (states with an empty context
/// are left out).
pub fn critic_vs_states(
    learner: &Learner,
    states: &[StateSample],
) -> Result<Vec<(f64, f64)>, TrainError> {
    let seqs: Vec<Vec<u32>> = states.iter().map(|s| s.context.clone()).collect();
    let lps: Vec<Vec<f32>> = states.iter().map(|s| s.logprobs.clone()).collect();
    let pos: Vec<Vec<usize>> = seqs
        .iter()
        .map(|s| s.len().checked_sub(1).into_iter().collect())
        .collect();
    Ok(learner
        .values_at(&seqs, &lps, &pos)?
        .into_iter()
        .zip(states)
        .filter_map(|(v, s)| Some((*v.first()?, s.monte_carlo())))
        .collect())
}

/// The critic against Monte-Carlo values on held-out states.
#[derive(Clone, Debug, PartialEq)]
pub struct HeldoutCheck {
    /// `(critic value, Monte-Carlo value)` of each state
    /// ([`critic_vs_states`]).
    pub pairs: Vec<(f64, f64)>,
    /// The noise ceiling on a rank correlation against those Monte-Carlo
    /// values ([`split_half`]).
    pub rank_ceiling: Option<f64>,
}

/// The critic against Monte-Carlo values on every non-terminal state of
/// one trajectory per task, with `k` continuations per state, and the
/// rank correlation those values' noise allows.
pub fn critic_vs_monte_carlo(
    engine: &mut Engine,
    learner: &Learner,
    tasks: Vec<TaskInstance>,
    cfg: &RolloutConfig,
    k: usize,
    seed: u64,
    env_workers: usize,
) -> Result<HeldoutCheck, TrainError> {
    if k == 0 {
        return Ok(HeldoutCheck {
            pairs: Vec::new(),
            rank_ceiling: None,
        });
    }
    let states = sample_states(engine, tasks, cfg, k, seed, env_workers)?;
    Ok(HeldoutCheck {
        pairs: critic_vs_states(learner, &states)?,
        rank_ceiling: split_half(&states, k).1,
    })
}

/// The rank-correlation ceiling from the split-half rank correlation `r`
/// of two `half`-sample estimates, for an estimate of `n` samples
/// (Spearman-Brown): `sqrt(f r / (1 + (f - 1) r))`, `f = n / half`;
/// `None` when `r <= 0`.
fn rank_ceiling(r: f64, half: usize, n: usize) -> Option<f64> {
    if r <= 0.0 || half == 0 {
        return None;
    }
    let f = n as f64 / half as f64;
    Some((f * r / (1.0 + (f - 1.0) * r)).clamp(0.0, 1.0).sqrt())
}

/// Split-half rank correlation of the states' continuations (outcomes
/// `1..1 + h` against `1 + h..1 + 2h`, `h = k / 2`) and the ceiling it
/// puts on a rank correlation against [`StateSample::monte_carlo`] (`k + 1`
/// outcomes a state): `(None, None)` for `k < 2`.
pub fn split_half(states: &[StateSample], k: usize) -> (Option<f64>, Option<f64>) {
    let h = k / 2;
    if h == 0 {
        return (None, None);
    }
    let mean = |x: &[f64]| x.iter().sum::<f64>() / x.len() as f64;
    let pairs: Vec<(f64, f64)> = states
        .iter()
        .filter(|s| s.outcomes.len() > 2 * h)
        .map(|s| {
            (
                mean(&s.outcomes[1..1 + h]),
                mean(&s.outcomes[1 + h..1 + 2 * h]),
            )
        })
        .collect();
    let r = spearman(&pairs);
    (r, r.and_then(|r| rank_ceiling(r, h, k + 1)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(outcomes: &[f64]) -> StateSample {
        StateSample {
            task: 0,
            depth: 0,
            context: vec![1, 2, 3],
            outcomes: outcomes.to_vec(),
            logprobs: Vec::new(),
        }
    }

    #[test]
    fn the_ceiling_steps_the_split_half_correlation_up() {
        // Spearman-Brown: doubling a test of reliability 0.5 gives 2/3.
        let c = rank_ceiling(0.5, 4, 8).unwrap();
        assert!((c - (2.0f64 / 3.0).sqrt()).abs() < 1e-12);
        // Same length: the ceiling is sqrt(r).
        assert!((rank_ceiling(0.36, 4, 4).unwrap() - 0.6).abs() < 1e-12);
        assert_eq!(rank_ceiling(0.0, 4, 8), None);
        assert_eq!(rank_ceiling(-0.2, 4, 8), None);
        assert_eq!(rank_ceiling(1.0, 2, 5), Some(1.0));
    }

    #[test]
    fn split_halves_compare_each_states_two_halves() {
        // Halves agree perfectly in rank: r = 1.
        let s = vec![
            state(&[1.0, 0.0, 0.0, 0.0, 0.0]),
            state(&[0.0, 1.0, 0.0, 1.0, 0.0]),
            state(&[1.0, 1.0, 1.0, 1.0, 1.0]),
        ];
        let (r, c) = split_half(&s, 4);
        assert!((r.unwrap() - 1.0).abs() < 1e-12);
        assert!((c.unwrap() - 1.0).abs() < 1e-12);
        // Fewer than two continuations: no halves.
        assert_eq!(split_half(&s, 1), (None, None));
    }
}
