//! FOCUS: one root per task; the allocator places each continuation at the
//! tree state where one more sample cuts the expected critic MSE most;
//! Eq. 1 backups, TD(lambda) advantages and critic targets.

use arbor_rl::credit::{backup, focus_credit, loss_rows, CreditConfig, LossRow, Sharing};
use arbor_rl::diagnostics::AllocationLog;
use arbor_rl::focus::{Allocator, AllocatorConfig, AsyncGain, Budget, Focus};
use arbor_rl::RolloutTree;

use super::conts::{root_values, Snapshots};
use super::span::SpanLoop;
use super::{RolloutPolicy, StepContext, StepRollouts, TaskInstance};
use crate::config::{CriticTargets, FocusConfig};
use crate::TrainError;

/// `tasks` roots a step and `budget` continuations among their states (or
/// the step's token budget, when the run has one).
#[derive(Debug, Clone)]
pub struct FocusPolicy {
    pub tasks: usize,
    /// Continuations per step.
    pub budget: u64,
    pub cfg: FocusConfig,
}

impl RolloutPolicy for FocusPolicy {
    fn tasks_per_step(&self) -> usize {
        self.tasks
    }

    /// The roots stay `tasks`; the budget is spent among their states.
    fn tasks_for_budget(&self, _tokens: u64, _per_task: f64) -> usize {
        self.tasks
    }

    /// Every rank grows the same forest and runs the same allocator on it
    /// ([`SpanLoop`]).
    fn spans_ranks(&self) -> bool {
        true
    }

    fn rollouts(
        &mut self,
        ctx: StepContext<'_>,
        tasks: Vec<TaskInstance>,
    ) -> Result<StepRollouts, TrainError> {
        let fcfg = &self.cfg;
        let learner = ctx.learner;
        let owned = ctx.owned.clone();
        let mut tree = RolloutTree::new();
        let mut snapshots = Snapshots::new();
        // Each rank scores its own tasks' roots and the values are
        // gathered, so every rank's allocator starts from the same ones; a
        // rank keeps the environments of its own tasks.
        let values = if ctx.group.world() == 1 {
            root_values(learner, &tasks)?
        } else {
            let mine = root_values(learner, &tasks[owned.clone()])?;
            let all = ctx.group.all_gather_f64(&mine)?;
            if all.len() != tasks.len() {
                return Err(TrainError::Rollout(format!(
                    "the ranks scored {} roots of {} tasks",
                    all.len(),
                    tasks.len()
                )));
            }
            all
        };
        for (i, (t, v)) in tasks.into_iter().zip(values).enumerate() {
            let root = tree.add_episode(t.id, t.prompt, Some(v))?;
            if owned.contains(&i) {
                snapshots.insert(root, t.episode);
            }
        }
        let budget = match ctx.budget_tokens {
            // A launch reserves the longest continuation the harness allows,
            // so the step never spends more than its budget (what it leaves
            // carries over to the next step).
            Some(total) => {
                let max = (ctx.rollout.max_segments * ctx.rollout.max_segment_tokens) as u64;
                Budget::Tokens {
                    total: total.max(max),
                    max_per_continuation: max,
                }
            }
            None => Budget::Continuations(self.budget),
        };
        let acfg = AllocatorConfig::new(fcfg.worker_capacity, budget, *ctx.seed);
        let focus = Focus::new(fcfg.kappa, AsyncGain::EffectiveCount)?
            .with_score(fcfg.score)
            .with_evidence(fcfg.evidence)
            .with_prune_settled(fcfg.prune_settled)
            .with_root_samples(fcfg.root_samples)
            .with_slip_nats(fcfg.slip_nats);
        let mut alloc = Allocator::new(acfg, focus)?;
        let mut diag = AllocationLog::default();
        // Continuous allocation: fill the free worker slots, then take one
        // turn of the event loop and allocate again after whatever ended,
        // while the others still run (their `m` counts in n_eff = n + m).
        // Nothing changes the allocator's view in a turn where nothing
        // ended.
        let mut span = SpanLoop::new(ctx, true)?;
        let mut changed = true;
        loop {
            while let Some(t) = if changed {
                alloc.launch_next(&mut tree)?
            } else {
                None
            } {
                diag.launched(&tree, t, alloc.last_priority(), fcfg.kappa)?;
                span.launch(&tree, &snapshots, t)?;
            }
            if tree.in_flight() == 0 {
                break;
            }
            let ended = span.turn(&tree, Some(learner))?;
            changed = !ended.is_empty();
            for e in ended {
                let generated: usize = e.steps.iter().map(|s| s.segment.generated_tokens()).sum();
                diag.completed(e.ticket, generated as u64);
                let new = alloc.complete(&mut tree, e.ticket, e.steps)?;
                span.keep(&mut snapshots, e.key, new);
            }
        }
        let launched = span.launched();
        let mut stats = span.finish();
        stats.episodes = tree.episodes().len();
        if launched == 0 {
            return Err(TrainError::Rollout(
                "FOCUS launched no continuation: no candidate state has a positive gain".into(),
            ));
        }
        if let Budget::Tokens { total, .. } = budget {
            stats.budget_tokens = Some(total);
        }
        let ccfg = CreditConfig {
            kappa: fcfg.kappa,
            gamma: fcfg.gamma,
            lambda: fcfg.lambda,
        };
        let credit = focus_credit(&tree, &ccfg)?;
        let mc;
        let targets = match fcfg.critic_targets {
            CriticTargets::Gbar => &credit.backup.gbar,
            CriticTargets::MonteCarlo => {
                mc = backup(&tree, &CreditConfig { kappa: 0.0, ..ccfg })?.gbar;
                &mc
            }
        };
        // Each rank trains its own tasks' trees (episode i is task i).
        let mut rows = loss_rows(&tree, &credit.tokens, Some(targets), Sharing::Once)?;
        if fcfg.center_advantages {
            // Every rank holds the whole forest: the mean is the step's.
            center_advantages(&mut rows);
        }
        rows.retain(|r| owned.contains(&r.episode));
        let mut critic_vs_target = Vec::new();
        for (id, node) in tree.nodes() {
            if let (Some(v), Some(g)) = (node.value(), targets[id.index()]) {
                if !node.children().is_empty() {
                    critic_vs_target.push((v, g));
                }
            }
        }
        let allocation = diag.summary(&tree)?;
        let mut r = StepRollouts::new(tree, rows, stats, critic_vs_target);
        r.allocation = Some(allocation);
        Ok(r)
    }
}

/// Subtract the loss-weighted mean advantage of the trained tokens of
/// `rows` (mask > 0) from each of them.
fn center_advantages(rows: &mut [LossRow]) {
    let (mut sum, mut weight) = (0.0f64, 0.0f64);
    for r in rows.iter() {
        for (&m, &a) in r.mask.iter().zip(&r.advantages) {
            if m > 0.0 {
                sum += f64::from(m) * f64::from(a);
                weight += f64::from(m);
            }
        }
    }
    if weight == 0.0 {
        return;
    }
    let mean = (sum / weight) as f32;
    for r in rows.iter_mut() {
        for (&m, a) in r.mask.iter().zip(r.advantages.iter_mut()) {
            if m > 0.0 {
                *a -= mean;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(mask: Vec<f32>, advantages: Vec<f32>) -> LossRow {
        let n = mask.len();
        LossRow {
            episode: 0,
            leaf: arbor_rl::NodeId(0),
            tokens: vec![0; n],
            mask,
            advantages,
            behaviour_logprobs: vec![0.0; n],
            history_logprobs: Vec::new(),
            value_targets: Vec::new(),
        }
    }

    #[test]
    fn centred_advantages_have_zero_weighted_mean() {
        let mut rows = vec![
            row(vec![0.0, 1.0, 1.0], vec![0.0, -0.5, -0.3]),
            row(vec![0.0, 0.0, 2.0], vec![9.0, 9.0, 0.4]),
        ];
        center_advantages(&mut rows);
        // Mean: (-0.5 - 0.3 + 2 * 0.4) / 4 = 0.
        assert_eq!(rows[0].advantages, vec![0.0, -0.5, -0.3]);
        rows[1].advantages[2] = 1.2;
        center_advantages(&mut rows);
        // Mean: (-0.5 - 0.3 + 2 * 1.2) / 4 = 0.4; untrained tokens keep theirs.
        let close = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-6);
        assert!(
            close(&rows[0].advantages, &[0.0, -0.9, -0.7]),
            "{:?}",
            rows[0].advantages
        );
        assert!(
            close(&rows[1].advantages, &[9.0, 9.0, 0.8]),
            "{:?}",
            rows[1].advantages
        );
    }
}
