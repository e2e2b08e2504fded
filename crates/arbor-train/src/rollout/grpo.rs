//! GRPO: `n` full rollouts per task, group-relative advantages.

use arbor_rl::baselines::{AdvantageEstimator, Grpo};
use arbor_rl::credit::{loss_rows, Sharing};
use arbor_rl::RolloutTree;

use super::conts::{to_steps, Cont};
use super::{RolloutPolicy, StepContext, StepRollouts, TaskInstance};
use crate::TrainError;

/// `tasks` tasks a step, `n` rollouts each.
#[derive(Debug, Clone)]
pub struct GrpoPolicy {
    pub tasks: usize,
    pub n: usize,
}

impl RolloutPolicy for GrpoPolicy {
    fn tasks_per_step(&self) -> usize {
        self.tasks
    }

    fn rollouts(
        &mut self,
        mut ctx: StepContext<'_>,
        tasks: Vec<TaskInstance>,
    ) -> Result<StepRollouts, TrainError> {
        let mut tree = RolloutTree::new();
        let mut conts = Vec::new();
        for t in tasks {
            for _ in 0..self.n {
                let root = tree.add_episode(t.id.clone(), t.prompt.clone(), None)?;
                conts.push(Cont::new(None, root, t.prompt.clone(), t.episode.fork()?));
            }
        }
        let mut sched = ctx.scheduler(false)?;
        let conts = sched.run_all(conts)?;
        let mut stats = sched.finish();
        stats.episodes = conts.len();
        for c in &conts {
            tree.add_path(c.from, to_steps(c, None)?)?;
        }
        let adv = Grpo::default().advantages(&tree)?;
        let rows = loss_rows(&tree, &adv, None, Sharing::Once)?;
        Ok(StepRollouts::new(tree, rows, stats, Vec::new()))
    }
}
