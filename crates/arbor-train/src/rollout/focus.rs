//! FOCUS: one root per task; the allocator places each continuation at the
//! tree state where one more sample cuts the expected critic MSE most;
//! Eq. 1 backups, TD(lambda) advantages and critic targets.

use arbor_rl::credit::{backup, focus_credit, loss_rows, CreditConfig, Sharing};
use arbor_rl::diagnostics::AllocationLog;
use arbor_rl::focus::{Allocator, AllocatorConfig, AsyncGain, Budget, Focus};
use arbor_rl::RolloutTree;

use std::collections::HashMap;

use arbor_rl::Step;

use super::conts::{
    cont_for, keep_snapshots, root_values, segment_values, to_steps, Cont, Snapshots,
};
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

    /// Every rank grows the same forest: the allocator runs on each with
    /// the same inputs, so all make the same launches; the rank that owns
    /// a launch's task runs it, and after every engine step the ranks
    /// exchange their finished continuations (tree steps with the owner's
    /// critic values) and complete them in launch order.
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
        // Every rank computes every root's value (the same batch, so the
        // same values); a rank keeps the environments of its own tasks.
        let values = root_values(learner, &tasks)?;
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
            .with_prune_settled(fcfg.prune_settled);
        let mut alloc = Allocator::new(acfg, focus)?;
        let mut diag = AllocationLog::default();
        // Continuous allocation: fill the free worker slots, then take one
        // turn of the event loop and allocate again after whatever ended,
        // while the others still run (their `m` counts in n_eff = n + m).
        let group = ctx.group;
        let mut sched =
            super::sched::Scheduler::new(ctx.engine, ctx.rollout, ctx.seed, true, ctx.env_workers)?;
        // In-flight tickets by launch index (the whole group's).
        let mut tickets = HashMap::new();
        let (mut changed, mut launched) = (true, 0usize);
        loop {
            // Nothing changes the allocator's view between turns where no
            // continuation ended.
            while let Some(t) = if changed {
                alloc.launch_next(&mut tree)?
            } else {
                None
            } {
                diag.launched(&tree, t, alloc.last_priority(), fcfg.kappa)?;
                let episode = tree.node(t.node())?.episode();
                let key = if owned.contains(&episode) {
                    sched.launch(cont_for(&tree, &snapshots, t)?)?
                } else {
                    sched.skip_launch()
                };
                tickets.insert(key, t);
                launched += 1;
            }
            if tree.in_flight() == 0 {
                break;
            }
            let (keys, conts): (Vec<usize>, Vec<Cont>) = sched.poll()?.into_iter().unzip();
            let values = if conts.is_empty() {
                Vec::new()
            } else {
                segment_values(learner, &conts, &tree)?
            };
            let mut local = Vec::with_capacity(conts.len());
            let mut records = HashMap::new();
            for ((key, c), v) in keys.into_iter().zip(conts).zip(values) {
                local.push((key, to_steps(&c, Some(&v))?));
                records.insert(key, c.steps);
            }
            let finished = exchange(group, local)?;
            changed = !finished.is_empty();
            for (key, steps) in finished {
                let ticket = tickets.remove(&key).ok_or_else(|| {
                    TrainError::Rollout(format!("continuation {key} finished but was not launched"))
                })?;
                let generated: usize = steps.iter().map(|s| s.segment.generated_tokens()).sum();
                diag.completed(ticket, generated as u64);
                let new = alloc.complete(&mut tree, ticket, steps)?;
                if let Some(r) = records.remove(&key) {
                    keep_snapshots(&mut snapshots, new, r);
                }
            }
        }
        let mut stats = sched.finish();
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

/// Every rank's finished continuations `local` (launch index, tree steps),
/// in launch order, on every rank: the group's shared view of what ended in
/// this turn of the event loop.
fn exchange(
    group: &mut dyn crate::dist::Collective,
    mut local: Vec<(usize, Vec<Step>)>,
) -> Result<Vec<(usize, Vec<Step>)>, TrainError> {
    if group.world() > 1 {
        let mine = serde_json::to_vec(&local).map_err(|e| {
            TrainError::Rollout(format!("cannot encode finished continuations: {e}"))
        })?;
        local = Vec::new();
        for (rank, part) in group.all_gather(&mine)?.iter().enumerate() {
            let theirs: Vec<(usize, Vec<Step>)> = serde_json::from_slice(part).map_err(|e| {
                TrainError::Rollout(format!("rank {rank} sent unreadable continuations: {e}"))
            })?;
            local.extend(theirs);
        }
    }
    local.sort_by_key(|(k, _)| *k);
    Ok(local)
}
