//! VinePPO: one main trajectory per task, then `k` Monte-Carlo
//! continuations from every state of it (the root's `k` include the main
//! one); advantages `A(s->c) = r + gamma Vhat(c) - Vhat(s)` from the
//! Monte-Carlo values, on the main trajectories only.

use arbor_rl::baselines::{AdvantageEstimator, VinePpo};
use arbor_rl::credit::{loss_rows, Sharing};
use arbor_rl::{NodeId, RolloutTree};

use super::conts::{begin_conts, complete_conts, Snapshots};
use super::{RolloutPolicy, StepContext, StepRollouts, TaskInstance};
use crate::TrainError;

/// `tasks` main trajectories a step, `k` Monte-Carlo samples per state.
#[derive(Debug, Clone)]
pub struct VinePpoPolicy {
    pub tasks: usize,
    pub k: u32,
    pub gamma: f64,
}

impl RolloutPolicy for VinePpoPolicy {
    fn tasks_per_step(&self) -> usize {
        self.tasks
    }

    fn rollouts(
        &mut self,
        mut ctx: StepContext<'_>,
        tasks: Vec<TaskInstance>,
    ) -> Result<StepRollouts, TrainError> {
        let vine = VinePpo { gamma: self.gamma };
        let mut tree = RolloutTree::new();
        let mut snapshots = Snapshots::new();
        let mut roots = Vec::new();
        for t in tasks {
            let root = tree.add_episode(t.id, t.prompt, None)?;
            snapshots.insert(root, t.episode);
            roots.push(root);
        }
        // Each main trajectory's states get their Monte-Carlo samples as
        // soon as it ends, while the other tasks still generate. A
        // continuation launched at a root is a main trajectory itself, so
        // its states are planned when it completes; samples launched below
        // a root add no main states and end the planning.
        let mut sched = ctx.scheduler(true)?;
        for c in begin_conts(&mut tree, &snapshots, &roots)? {
            sched.launch(c)?;
        }
        loop {
            let done = sched.wait()?;
            if done.is_empty() {
                break;
            }
            let conts: Vec<_> = done.into_iter().map(|(_, c)| c).collect();
            complete_conts(&mut tree, &mut snapshots, conts, None)?;
            let from: Vec<NodeId> = vine
                .plan(&tree, self.k)?
                .iter()
                .flat_map(|&(n, c)| std::iter::repeat_n(n, c as usize))
                .collect();
            for c in begin_conts(&mut tree, &snapshots, &from)? {
                sched.launch(c)?;
            }
        }
        let mut stats = sched.finish();
        stats.episodes = roots.len();
        let adv = vine.advantages(&tree)?;
        let rows = loss_rows(&tree, &adv, None, Sharing::Once)?;
        Ok(StepRollouts::new(tree, rows, stats, Vec::new()))
    }
}
