//! PPO with a per-segment critic: `n` full rollouts per task, the critic's
//! value at every state, GAE advantages over segments, and Monte-Carlo
//! returns (`Gbar` with `kappa = 0`) as the critic's targets.

use arbor_rl::baselines::{AdvantageEstimator, Critic, PpoGae};
use arbor_rl::credit::{backup, loss_rows, CreditConfig, Sharing};
use arbor_rl::RolloutTree;

use super::conts::{begin_conts, complete_conts, root_values, segment_values, Snapshots};
use super::{RolloutPolicy, StepContext, StepRollouts, TaskInstance};
use crate::TrainError;

/// `tasks` tasks a step, `n` rollouts each; discount `gamma`, GAE `lambda`.
#[derive(Debug, Clone)]
pub struct PpoPolicy {
    pub tasks: usize,
    pub n: usize,
    pub gamma: f64,
    pub lambda: f64,
}

impl RolloutPolicy for PpoPolicy {
    fn tasks_per_step(&self) -> usize {
        self.tasks
    }

    fn rollouts(
        &mut self,
        mut ctx: StepContext<'_>,
        tasks: Vec<TaskInstance>,
    ) -> Result<StepRollouts, TrainError> {
        let mut tree = RolloutTree::new();
        let mut snapshots = Snapshots::new();
        let values = root_values(ctx.learner, &tasks)?;
        let mut roots = Vec::new();
        for (t, v) in tasks.into_iter().zip(values) {
            for _ in 0..self.n {
                let root = tree.add_episode(t.id.clone(), t.prompt.clone(), Some(v))?;
                snapshots.insert(root, t.episode.fork()?);
                roots.push(root);
            }
        }
        let learner = ctx.learner;
        let conts = begin_conts(&mut tree, &snapshots, &roots)?;
        let mut sched = ctx.scheduler(false)?;
        let conts = sched.run_all(conts)?;
        let mut stats = sched.finish();
        stats.episodes = conts.len();
        let values = segment_values(learner, &conts, &tree)?;
        complete_conts(&mut tree, &mut snapshots, conts, Some(values))?;
        let adv = PpoGae {
            gamma: self.gamma,
            lambda: self.lambda,
            critic: Critic::Segment,
        }
        .advantages(&tree)?;
        let targets = backup(
            &tree,
            &CreditConfig {
                gamma: self.gamma,
                lambda: self.lambda,
                kappa: 0.0,
            },
        )?;
        let rows = loss_rows(&tree, &adv, Some(&targets.gbar), Sharing::Once)?;
        let mut critic_vs_target = Vec::new();
        for (id, node) in tree.nodes() {
            if let (Some(v), Some(g)) = (node.value(), targets.gbar[id.index()]) {
                critic_vs_target.push((v, g));
            }
        }
        Ok(StepRollouts::new(tree, rows, stats, critic_vs_target))
    }
}
