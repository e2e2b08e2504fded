//! FOCUS: one root per task; the allocator places each continuation at the
//! tree state where one more sample cuts the expected critic MSE most;
//! Eq. 1 backups, TD(lambda) advantages and critic targets.

use arbor_rl::credit::{focus_credit, loss_rows, CreditConfig, Sharing};
use arbor_rl::focus::{Allocator, AllocatorConfig, AsyncGain, Budget, Focus};
use arbor_rl::RolloutTree;

use super::conts::{cont_for, keep_snapshots, root_values, segment_values, to_steps, Snapshots};
use super::{RolloutPolicy, RolloutStats, StepContext, StepRollouts, TaskInstance};
use crate::config::FocusConfig;
use crate::TrainError;

/// `tasks` roots a step and `budget` continuations among their states.
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
        let acfg = AllocatorConfig::new(
            fcfg.worker_capacity,
            Budget::Continuations(self.budget),
            *ctx.seed,
        );
        let mut alloc = Allocator::new(acfg, Focus::new(fcfg.kappa, AsyncGain::EffectiveCount)?)?;
        let mut stats = RolloutStats {
            episodes: tree.episodes().len(),
            ..Default::default()
        };
        while !alloc.is_done() {
            let tickets = alloc.fill(&mut tree)?;
            if tickets.is_empty() {
                if stats.continuations == 0 {
                    return Err(TrainError::Rollout(
                        "FOCUS launched no continuation: no candidate state has a positive gain"
                            .into(),
                    ));
                }
                break;
            }
            let mut conts = tickets
                .into_iter()
                .map(|t| cont_for(&tree, &snapshots, t))
                .collect::<Result<Vec<_>, _>>()?;
            stats.continuations += conts.len();
            ctx.run(&mut conts, &mut stats, true)?;
            let values = segment_values(learner, &conts, &tree)?;
            for (c, v) in conts.into_iter().zip(values) {
                let steps = to_steps(&c, Some(&v))?;
                let ticket = c.ticket.expect("FOCUS continuations have tickets");
                let new = alloc.complete(&mut tree, ticket, steps)?;
                keep_snapshots(&mut snapshots, new, c.steps);
            }
        }
        let ccfg = CreditConfig {
            kappa: fcfg.kappa,
            gamma: fcfg.gamma,
            lambda: fcfg.lambda,
        };
        let credit = focus_credit(&tree, &ccfg)?;
        let rows = loss_rows(
            &tree,
            &credit.tokens,
            Some(&credit.backup.gbar),
            Sharing::Once,
        )?;
        let mut critic_vs_target = Vec::new();
        for (id, node) in tree.nodes() {
            if let (Some(v), Some(g)) = (node.value(), credit.backup.gbar[id.index()]) {
                if !node.children().is_empty() {
                    critic_vs_target.push((v, g));
                }
            }
        }
        Ok(StepRollouts::new(tree, rows, stats, critic_vs_target))
    }
}
