//! One forest grown on every rank of a data-parallel group, for methods
//! whose launches depend on the whole step's tree (FOCUS's allocation,
//! VinePPO's samples from each main trajectory's states).
//!
//! Every rank holds the same [`RolloutTree`] and makes the same launch
//! decisions from it; the rank that owns a task (its share of the step's
//! tasks, by index) runs the continuations launched in that task's tree
//! and keeps its environment snapshots. Each [`SpanLoop::turn`] is one turn
//! of every rank's event loop ([`Scheduler::poll`]: one engine step and the
//! environment steps it triggers), after which the ranks all-gather the
//! continuations that ended, as tree steps (with the owner's critic values
//! where the method has a critic), and every rank completes them in launch
//! order. Launch indices, and so sampling seeds, count the whole group's
//! launches. While no rank's engine defers work, the engines step in
//! lockstep as one engine over all the continuations would, and a run on
//! several ranks makes the launches and draws the samples of a run on one.
//! On one rank a turn exchanges nothing, and the loop is the scheduler's.

use std::collections::HashMap;
use std::ops::Range;

use arbor_rl::{NodeId, RolloutTree, Step, Ticket};

use super::conts::{cont_for, keep_snapshots, segment_values, to_steps, SegmentRecord, Snapshots};
use super::sched::Scheduler;
use super::{RolloutStats, StepContext};
use crate::dist::Collective;
use crate::learner::Learner;
use crate::TrainError;

/// A continuation that ended in a turn: its launch index, its ticket in the
/// tree, and its steps.
pub(crate) struct Ended {
    pub(crate) key: usize,
    pub(crate) ticket: Ticket,
    pub(crate) steps: Vec<Step>,
}

/// The event loop of a forest shared by the group; see the module docs.
pub(crate) struct SpanLoop<'a> {
    sched: Scheduler<'a>,
    group: &'a mut dyn Collective,
    owned: Range<usize>,
    /// The whole group's continuations in flight, by launch index.
    tickets: HashMap<usize, Ticket>,
    /// This rank's ended continuations' segment records (their environment
    /// snapshots), until the tree gives their new states ids.
    records: HashMap<usize, Vec<SegmentRecord>>,
    /// A digest of every launch so far (launch index and node), the same
    /// on every rank while they agree.
    trace: u64,
}

impl<'a> SpanLoop<'a> {
    /// The loop of `ctx`'s step, keeping environment snapshots after each
    /// segment if `keep_snapshots` (forks start there).
    pub(crate) fn new(ctx: StepContext<'a>, keep_snapshots: bool) -> Result<Self, TrainError> {
        let sched = Scheduler::new(
            ctx.engine,
            ctx.rollout,
            ctx.seed,
            keep_snapshots,
            ctx.env_workers,
        )?;
        Ok(SpanLoop {
            sched,
            group: ctx.group,
            owned: ctx.owned,
            tickets: HashMap::new(),
            records: HashMap::new(),
            trace: 0,
        })
    }

    /// Whether this rank runs the continuations of `episode` (task index).
    pub(crate) fn owns(&self, episode: usize) -> bool {
        self.owned.contains(&episode)
    }

    /// Launch the continuation of `ticket` (begun in `tree`): run here if
    /// this rank owns its task (from the environment kept in `snapshots`),
    /// else only numbered.
    pub(crate) fn launch(
        &mut self,
        tree: &RolloutTree,
        snapshots: &Snapshots,
        ticket: Ticket,
    ) -> Result<(), TrainError> {
        let key = if self.owns(tree.node(ticket.node())?.episode()) {
            self.sched.launch(cont_for(tree, snapshots, ticket)?)?
        } else {
            self.sched.skip_launch()
        };
        self.tickets.insert(key, ticket);
        self.trace = check_of(&[self.trace, key as u64, u64::from(ticket.node().0)]);
        Ok(())
    }

    /// Begin and launch one continuation from each of `from`.
    pub(crate) fn launch_from(
        &mut self,
        tree: &mut RolloutTree,
        snapshots: &Snapshots,
        from: &[NodeId],
    ) -> Result<(), TrainError> {
        for &n in from {
            let t = tree.begin(n)?;
            self.launch(tree, snapshots, t)?;
        }
        Ok(())
    }

    /// Continuations launched so far by the whole group.
    pub(crate) fn launched(&self) -> usize {
        self.sched.launched()
    }

    /// One turn of the event loop on every rank: the whole group's
    /// continuations that ended in it, in launch order (possibly none),
    /// with `critic`'s values at their new intermediate states (0.5
    /// without a critic).
    pub(crate) fn turn(
        &mut self,
        tree: &RolloutTree,
        critic: Option<&Learner>,
    ) -> Result<Vec<Ended>, TrainError> {
        let (keys, conts): (Vec<usize>, Vec<_>) = self.sched.poll()?.into_iter().unzip();
        let values = match critic {
            Some(l) if !conts.is_empty() => Some(segment_values(l, &conts, tree)?),
            _ => None,
        };
        let mut local = Vec::with_capacity(conts.len());
        for (i, (key, c)) in keys.into_iter().zip(conts).enumerate() {
            local.push((key, to_steps(&c, values.as_ref().map(|v| v[i].as_slice()))?));
            self.records.insert(key, c.steps);
        }
        let check = check_of(&[
            self.sched.launched() as u64,
            tree.len() as u64,
            tree.in_flight() as u64,
            self.trace,
        ]);
        exchange(&mut *self.group, check, local)?
            .into_iter()
            .map(|(key, steps)| {
                let ticket = self.tickets.remove(&key).ok_or_else(|| {
                    TrainError::Rollout(format!("continuation {key} ended but was not launched"))
                })?;
                Ok(Ended { key, ticket, steps })
            })
            .collect()
    }

    /// Keep the environment states of continuation `key`'s new states
    /// `new` (the ids the tree gave them), where this rank ran it.
    pub(crate) fn keep(&mut self, snapshots: &mut Snapshots, key: usize, new: Vec<NodeId>) {
        if let Some(r) = self.records.remove(&key) {
            keep_snapshots(snapshots, new, r);
        }
    }

    /// This rank's accounting (its engine's tokens and times).
    pub(crate) fn finish(self) -> RolloutStats {
        self.sched.finish()
    }
}

/// The tasks rank `rank` of `world` runs of a step's `n`: a contiguous
/// share, by index.
pub(crate) fn share(n: usize, rank: usize, world: usize) -> Range<usize> {
    n * rank / world..n * (rank + 1) / world
}

/// The rank of `world` that runs task `task` of a step's `n`.
pub(crate) fn owner(task: usize, n: usize, world: usize) -> usize {
    (0..world)
        .find(|&r| share(n, r, world).contains(&task))
        .unwrap_or(world - 1)
}

/// Every rank's `local` items (launch index, item), in launch order, on
/// every rank. `check` sums up the state the ranks must share (counts of
/// launches and nodes, a digest of every launch): a rank whose `check`
/// differs from rank 0's has drifted from the others, and the exchange
/// fails on every rank naming it instead of going on with ranks that
/// decide differently.
pub(crate) fn exchange<T: serde::Serialize + serde::de::DeserializeOwned>(
    group: &mut dyn Collective,
    check: u64,
    mut local: Vec<(usize, T)>,
) -> Result<Vec<(usize, T)>, TrainError> {
    if group.world() > 1 {
        let parts = crate::dist::all_gather_items(group, &(check, local))?;
        let drifted: Vec<String> = (1..parts.len())
            .filter(|&r| parts[r].0 != parts[0].0)
            .map(|r| r.to_string())
            .collect();
        if !drifted.is_empty() {
            return Err(TrainError::Rollout(format!(
                "the rollout state of rank(s) {} differs from rank 0's: the ranks no longer \
                 make the same decisions",
                drifted.join(", ")
            )));
        }
        local = parts.into_iter().flat_map(|(_, items)| items).collect();
    }
    local.sort_by_key(|(k, _)| *k);
    Ok(local)
}

/// A check value for [`exchange`] from counts (and digests) the ranks must
/// agree on.
pub(crate) fn check_of(counts: &[u64]) -> u64 {
    counts
        .iter()
        .fold(0x243F_6A88_85A3_08D3, |h, &c| super::sched::mix64(h ^ c))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dist::ThreadGroup;
    use std::time::Duration;

    #[test]
    fn shares_split_the_tasks_and_name_their_owner() {
        for world in 1..5 {
            for n in 0..11 {
                let mut seen = Vec::new();
                for r in 0..world {
                    for t in share(n, r, world) {
                        assert_eq!(owner(t, n, world), r);
                        seen.push(t);
                    }
                }
                assert_eq!(seen, (0..n).collect::<Vec<_>>(), "{n} tasks, {world} ranks");
            }
        }
    }

    /// Two ranks' items come back on both in launch order; a rank whose
    /// check differs makes the exchange fail on every rank.
    #[test]
    fn exchange_orders_by_launch_and_catches_drift() {
        let run = |checks: [u64; 2]| -> Vec<Result<Vec<(usize, String)>, String>> {
            let ranks = ThreadGroup::new(2, Duration::from_secs(20));
            std::thread::scope(|s| {
                let hs: Vec<_> = ranks
                    .into_iter()
                    .map(|mut g| {
                        s.spawn(move || {
                            let r = g.rank();
                            let local = match r {
                                0 => vec![(2, "b".to_string()), (0, "a".to_string())],
                                _ => vec![(1, "c".to_string())],
                            };
                            exchange(&mut g, checks[r], local).map_err(|e| e.to_string())
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            })
        };
        let want: Vec<(usize, String)> = vec![(0, "a".into()), (1, "c".into()), (2, "b".into())];
        for r in run([7, 7]) {
            assert_eq!(r.unwrap(), want);
        }
        for r in run([7, 8]) {
            let e = r.unwrap_err();
            assert!(e.contains("differs"), "{e}");
        }
    }
}
