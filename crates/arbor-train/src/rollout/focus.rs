//! FOCUS: one root per task; the allocator places each continuation at the
//! tree state where one more sample cuts the expected critic MSE most;
//! Eq. 1 backups, TD(lambda) advantages and critic targets.

use arbor_rl::credit::{backup, focus_credit, loss_rows, CreditConfig, Sharing};
use arbor_rl::diagnostics::AllocationLog;
use arbor_rl::focus::{Allocator, AllocatorConfig, AsyncGain, Budget, Focus};
use arbor_rl::RolloutTree;

use super::conts::{cont_for, keep_snapshots, root_values, segment_values, to_steps, Snapshots};
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

    fn rollouts(
        &mut self,
        mut ctx: StepContext<'_>,
        tasks: Vec<TaskInstance>,
    ) -> Result<StepRollouts, TrainError> {
        let fcfg = &self.cfg;
        let learner = ctx.learner;
        let mut tree = RolloutTree::new();
        let mut snapshots = Snapshots::new();
        let values = root_values(learner, &tasks)?;
        for (t, v) in tasks.into_iter().zip(values) {
            let root = tree.add_episode(t.id, t.prompt, Some(v))?;
            snapshots.insert(root, t.episode);
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
        // Continuous allocation: fill the free worker slots, then wait for
        // the next continuations to end and allocate again while the others
        // still run (their `m` counts in n_eff = n + m).
        let mut sched = ctx.scheduler(true)?;
        loop {
            while let Some(t) = alloc.launch_next(&mut tree)? {
                diag.launched(&tree, t, alloc.last_priority(), fcfg.kappa)?;
                sched.launch(cont_for(&tree, &snapshots, t)?)?;
            }
            let done = sched.wait()?;
            if done.is_empty() {
                break;
            }
            let conts: Vec<_> = done.into_iter().map(|(_, c)| c).collect();
            let values = segment_values(learner, &conts, &tree)?;
            for (c, v) in conts.into_iter().zip(values) {
                let steps = to_steps(&c, Some(&v))?;
                let ticket = c.ticket.expect("FOCUS continuations have tickets");
                diag.completed(ticket, c.generated() as u64);
                let new = alloc.complete(&mut tree, ticket, steps)?;
                keep_snapshots(&mut snapshots, new, c.steps);
            }
        }
        let mut stats = sched.finish();
        stats.episodes = tree.episodes().len();
        if stats.continuations == 0 {
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
        let rows = loss_rows(&tree, &credit.tokens, Some(targets), Sharing::Once)?;
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
