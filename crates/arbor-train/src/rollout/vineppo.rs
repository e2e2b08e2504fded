//! VinePPO: one main trajectory per task, then `k` Monte-Carlo
//! continuations from every state of it (the root's `k` include the main
//! one); advantages `A(s->c) = r + gamma Vhat(c) - Vhat(s)` from the
//! Monte-Carlo values, on the main trajectories only.

use arbor_rl::baselines::{AdvantageEstimator, VinePpo};
use arbor_rl::credit::{loss_rows, Sharing};
use arbor_rl::{NodeId, RolloutTree};

use super::conts::Snapshots;
use super::span::SpanLoop;
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

    /// Every rank grows the same trees and plans the same samples
    /// ([`SpanLoop`]); each runs its own tasks'.
    fn spans_ranks(&self) -> bool {
        true
    }

    fn rollouts(
        &mut self,
        ctx: StepContext<'_>,
        tasks: Vec<TaskInstance>,
    ) -> Result<StepRollouts, TrainError> {
        let vine = VinePpo { gamma: self.gamma };
        let owned = ctx.owned.clone();
        let mut tree = RolloutTree::new();
        let mut snapshots = Snapshots::new();
        let mut roots = Vec::new();
        for (i, t) in tasks.into_iter().enumerate() {
            let root = tree.add_episode(t.id, t.prompt, None)?;
            if owned.contains(&i) {
                snapshots.insert(root, t.episode);
            }
            roots.push(root);
        }
        // Each main trajectory's states get their Monte-Carlo samples as
        // soon as it ends, while the other tasks still generate. A
        // continuation launched at a root is a main trajectory itself, so
        // its states are planned when it completes; samples launched below
        // a root add no main states and end the planning.
        let mut span = SpanLoop::new(ctx, true)?;
        span.launch_from(&mut tree, &snapshots, &roots)?;
        while tree.in_flight() > 0 {
            let ended = span.turn(&tree, None)?;
            if ended.is_empty() {
                continue;
            }
            for e in ended {
                let new = tree.complete(e.ticket, e.steps)?;
                span.keep(&mut snapshots, e.key, new);
            }
            let from: Vec<NodeId> = vine
                .plan(&tree, self.k)?
                .iter()
                .flat_map(|&(n, c)| std::iter::repeat_n(n, c as usize))
                .collect();
            span.launch_from(&mut tree, &snapshots, &from)?;
        }
        let mut stats = span.finish();
        stats.episodes = roots.len();
        let adv = vine.advantages(&tree)?;
        // Each rank trains its own tasks' trees (episode i is task i).
        let mut rows = loss_rows(&tree, &adv, None, Sharing::Once)?;
        rows.retain(|r| owned.contains(&r.episode));
        Ok(StepRollouts::new(tree, rows, stats, Vec::new()))
    }
}
