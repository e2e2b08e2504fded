//! VinePPO: one main trajectory per task, then `k` Monte-Carlo
//! continuations from every state of it (the root's `k` include the main
//! one); advantages `A(s->c) = r + gamma Vhat(c) - Vhat(s)` from the
//! Monte-Carlo values, on the main trajectories only.

use arbor_rl::baselines::{AdvantageEstimator, VinePpo};
use arbor_rl::credit::{loss_rows, Sharing};
use arbor_rl::{NodeId, RolloutTree};

use super::conts::{begin_conts, complete_conts, Snapshots};
use super::{RolloutPolicy, RolloutStats, StepContext, StepRollouts, TaskInstance};
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
        let mut stats = RolloutStats {
            episodes: roots.len(),
            ..Default::default()
        };
        let mut main = begin_conts(&mut tree, &snapshots, &roots)?;
        stats.continuations += main.len();
        ctx.run(&mut main, &mut stats, true)?;
        complete_conts(&mut tree, &mut snapshots, main, None)?;
        // Continuations launched at a root are main trajectories themselves,
        // so their states are planned in the next round; later rounds
        // launch only below the root and end the loop.
        loop {
            let plan = vine.plan(&tree, self.k)?;
            if plan.is_empty() {
                break;
            }
            let from: Vec<NodeId> = plan
                .iter()
                .flat_map(|&(n, c)| std::iter::repeat_n(n, c as usize))
                .collect();
            let mut mc = begin_conts(&mut tree, &snapshots, &from)?;
            stats.continuations += mc.len();
            ctx.run(&mut mc, &mut stats, true)?;
            complete_conts(&mut tree, &mut snapshots, mc, None)?;
        }
        let adv = vine.advantages(&tree)?;
        let rows = loss_rows(&tree, &adv, None, Sharing::Once)?;
        Ok(StepRollouts::new(tree, rows, stats, Vec::new()))
    }
}
