//! Baselines behind one interface: every method turns a [`RolloutTree`]
//! into per-token advantages ([`EdgeAdvantages`]), which
//! [`crate::credit::loss_rows`] turns into loss arrays.
//!
//! - [`Grpo`]: `A_i = (R_i - mean_g R) / (std_g R + eps)` (or without the
//!   std division), one advantage per trajectory;
//! - [`Rloo`]: `A_i = R_i - mean_{j != i} R_j`;
//! - [`PpoGae`]: GAE on a per-segment critic (node values) or a per-token
//!   critic (one value per trained token);
//! - [`VinePpo`]: `A = r + gamma * Vhat(s') - Vhat(s)` with `Vhat` the mean
//!   return of the `K` Monte-Carlo continuations launched at each state;
//! - [`Focus`]: FOCUS credit ([`crate::credit`]);
//! - [`DynamicSampling`]: DAPO's group filter with refill (a sampling rule,
//!   not an estimator; DAPO = GRPO advantages + dynamic sampling +
//!   clip-higher + token-level aggregation in [`crate::ppo`]).
//!
//! Groups (GRPO, RLOO) are the trajectories of all episodes that share a
//! task id. A trajectory is a path from a root to a terminal; its return is
//! the sum of the edge rewards along it (the verified reward included).
//! Truncated trajectories (leaves that are not terminal) have no verified
//! reward: they are left out of their group and untrained (DAPO's overlong
//! filtering; project choice). When trajectories share edges (a branched
//! tree), a shared edge gets the mean advantage of the trajectories through
//! it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::credit::{focus_credit, td_advantages, CreditConfig, EdgeAdvantages, EdgeTokens};
use crate::error::{check_range, Result, RlError};
use crate::tree::{NodeId, RolloutTree};

/// An advantage estimator.
pub trait AdvantageEstimator {
    /// Short name for logs.
    fn name(&self) -> &'static str;
    /// Per-token advantages of every trained edge of `tree`.
    fn advantages(&self, tree: &RolloutTree) -> Result<EdgeAdvantages>;
}

/// FOCUS credit as an estimator.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Focus(pub CreditConfig);

impl AdvantageEstimator for Focus {
    fn name(&self) -> &'static str {
        "focus"
    }
    fn advantages(&self, tree: &RolloutTree) -> Result<EdgeAdvantages> {
        Ok(focus_credit(tree, &self.0)?.tokens)
    }
}

/// Returns of the terminal trajectories, grouped by task id:
/// `task -> [(terminal, return)]`.
pub fn group_returns(tree: &RolloutTree) -> Result<BTreeMap<String, Vec<(NodeId, f64)>>> {
    let mut groups: BTreeMap<String, Vec<(NodeId, f64)>> = BTreeMap::new();
    for (id, node) in tree.nodes() {
        if !node.is_terminal() {
            continue;
        }
        let path = tree.path(id)?;
        let mut ret = 0.0;
        for &c in &path[1..] {
            ret += tree.edge_reward(c)?;
        }
        let task = tree.episodes()[node.episode()].task.clone();
        groups.entry(task).or_default().push((id, ret));
    }
    Ok(groups)
}

/// Spreads per-trajectory advantages over the edges of each trajectory
/// (mean over the trajectories through an edge).
fn trajectory_advantages(
    tree: &RolloutTree,
    per_trajectory: &[(NodeId, f64)],
) -> Result<EdgeAdvantages> {
    let mut sum = vec![(0.0, 0u32); tree.len()];
    for &(leaf, a) in per_trajectory {
        let mut cur = Some(leaf);
        while let Some(c) = cur {
            let n = tree.node(c)?;
            if n.parent().is_some() {
                sum[c.index()].0 += a;
                sum[c.index()].1 += 1;
            }
            cur = n.parent();
        }
    }
    let edge: Vec<Option<f64>> = sum
        .into_iter()
        .map(|(s, k)| (k > 0).then(|| s / f64::from(k)))
        .collect();
    EdgeTokens::from_edges(tree, &edge)
}

/// GRPO group-relative advantages.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Grpo {
    /// Divide by the group's (unbiased, `n - 1`) standard deviation.
    pub normalize_std: bool,
    /// Added to the std (1e-6 by default).
    pub eps: f64,
}

impl Default for Grpo {
    fn default() -> Self {
        Grpo {
            normalize_std: true,
            eps: 1e-6,
        }
    }
}

impl AdvantageEstimator for Grpo {
    fn name(&self) -> &'static str {
        "grpo"
    }
    fn advantages(&self, tree: &RolloutTree) -> Result<EdgeAdvantages> {
        check_range("eps", self.eps, 0.0, f64::MAX)?;
        let mut per = Vec::new();
        for g in group_returns(tree)?.values() {
            let n = g.len() as f64;
            let mean = g.iter().map(|x| x.1).sum::<f64>() / n;
            let std = if g.len() > 1 {
                (g.iter().map(|x| (x.1 - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt()
            } else {
                0.0
            };
            for &(id, r) in g {
                let centred = r - mean;
                let a = if self.normalize_std && centred != 0.0 {
                    centred / (std + self.eps)
                } else {
                    centred
                };
                per.push((id, a));
            }
        }
        trajectory_advantages(tree, &per)
    }
}

/// RLOO leave-one-out advantages (a group of one gets 0: no baseline).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Rloo;

impl AdvantageEstimator for Rloo {
    fn name(&self) -> &'static str {
        "rloo"
    }
    fn advantages(&self, tree: &RolloutTree) -> Result<EdgeAdvantages> {
        let mut per = Vec::new();
        for g in group_returns(tree)?.values() {
            let total: f64 = g.iter().map(|x| x.1).sum();
            let k = g.len() as f64;
            for &(id, r) in g {
                let a = if g.len() > 1 {
                    r - (total - r) / (k - 1.0)
                } else {
                    0.0
                };
                per.push((id, a));
            }
        }
        trajectory_advantages(tree, &per)
    }
}

/// Granularity of the PPO critic.
#[derive(Clone, Copy, Debug)]
pub enum Critic<'a> {
    /// One value per state (node values `V_phi`); each segment is one
    /// action: `delta = r(s,c) + gamma*V(c) - V(s)`, GAE over segments.
    Segment,
    /// One value per trained token: `values.get(edge)[j]` is the critic's
    /// value of the state *before* token `j` of that edge's segment.
    Token(&'a EdgeTokens),
}

/// PPO advantages by GAE.
///
/// Per-token form: the actions are the trained tokens; masked tokens
/// (observations, replayed text) belong to the environment's transition.
/// Along a path with trained tokens `t_1..t_T` and values `V_t`,
///
/// ```text
/// delta_t = r_t + gamma * V_{t+1} - V_t,   A_t = delta_t + gamma*lambda*A_{t+1}
/// ```
///
/// where `r_t` is the edge reward on the last trained token of its edge
/// (plus the rewards of following edges that have no trained token), and
/// past the end `V = 0` at a terminal or `V = V_phi(leaf)` at a truncated
/// leaf. On a tree, `V_{t+1}` and `A_{t+1}` after a branch point are the
/// means over the children (as in [`crate::credit`]).
#[derive(Clone, Copy, Debug)]
pub struct PpoGae<'a> {
    pub gamma: f64,
    pub lambda: f64,
    pub critic: Critic<'a>,
}

/// What the first action after a state sees, averaged over the children:
/// reward accrued before it, its value and its advantage.
#[derive(Clone, Copy, Default)]
struct Entry {
    reward: f64,
    value: f64,
    adv: f64,
}

impl PpoGae<'_> {
    fn leaf_value(tree: &RolloutTree, id: NodeId) -> Result<f64> {
        let n = tree.node(id)?;
        if n.is_terminal() {
            Ok(0.0)
        } else {
            n.value().ok_or(RlError::MissingValue(id))
        }
    }

    fn per_segment(&self, tree: &RolloutTree) -> Result<EdgeAdvantages> {
        let mut values = vec![0.0; tree.len()];
        for (id, n) in tree.nodes() {
            if !n.is_terminal() {
                values[id.index()] = n.value().ok_or(RlError::MissingValue(id))?;
            }
        }
        let edge = td_advantages(tree, &values, self.gamma, self.lambda)?;
        EdgeTokens::from_edges(tree, &edge)
    }

    fn per_token(&self, tree: &RolloutTree, tv: &EdgeTokens) -> Result<EdgeAdvantages> {
        let (g, gl) = (self.gamma, self.gamma * self.lambda);
        let mut entry = vec![Entry::default(); tree.len()];
        let mut out = EdgeTokens::empty(tree);
        for (id, node) in tree.nodes().rev() {
            // Entry of this state: the mean over the children's contributions.
            if node.children().is_empty() {
                entry[id.index()] = Entry {
                    reward: 0.0,
                    value: Self::leaf_value(tree, id)?,
                    adv: 0.0,
                };
            } else {
                let k = node.children().len() as f64;
                let mut e = Entry::default();
                for &c in node.children() {
                    let ce = entry_of_edge(tree, c, &entry, tv, &out)?;
                    e.reward += ce.reward / k;
                    e.value += ce.value / k;
                    e.adv += ce.adv / k;
                }
                entry[id.index()] = e;
            }
            let Some(seg) = node.segment() else { continue };
            let trained: Vec<usize> = (0..seg.len())
                .filter(|&j| seg.kinds[j].is_trained())
                .collect();
            if trained.is_empty() {
                continue;
            }
            let values = token_values(tree, tv, id)?;
            let next = entry[id.index()];
            let mut adv = vec![0.0; seg.len()];
            let (mut v_next, mut a_next) = (next.value, next.adv);
            let mut r = tree.edge_reward(id)? + next.reward;
            for &j in trained.iter().rev() {
                let delta = r + g * v_next - values[j];
                adv[j] = delta + gl * a_next;
                (v_next, a_next, r) = (values[j], adv[j], 0.0);
            }
            out.set(tree, id, adv)?;
        }
        Ok(out)
    }
}

fn token_values<'t>(tree: &RolloutTree, tv: &'t EdgeTokens, id: NodeId) -> Result<&'t [f64]> {
    tv.checked(tree, id)?
        .ok_or_else(|| RlError::node(id, "the token-level critic has no values for this edge"))
}

/// The contribution of the edge into `c` to its parent's entry: its first
/// trained token (value and the advantage already computed for it, since
/// children are visited first), or, without a trained token, its reward
/// plus `c`'s own entry.
fn entry_of_edge(
    tree: &RolloutTree,
    c: NodeId,
    entry: &[Entry],
    tv: &EdgeTokens,
    adv: &EdgeTokens,
) -> Result<Entry> {
    let seg = tree
        .node(c)?
        .segment()
        .ok_or_else(|| RlError::node(c, "child without a segment"))?;
    match seg.kinds.iter().position(|k| k.is_trained()) {
        Some(j) => {
            let values = token_values(tree, tv, c)?;
            Ok(Entry {
                reward: 0.0,
                value: values[j],
                adv: adv.get(c).map_or(0.0, |a| a[j]),
            })
        }
        None => {
            let e = entry[c.index()];
            Ok(Entry {
                reward: tree.edge_reward(c)? + e.reward,
                ..e
            })
        }
    }
}

impl AdvantageEstimator for PpoGae<'_> {
    fn name(&self) -> &'static str {
        "ppo_gae"
    }
    fn advantages(&self, tree: &RolloutTree) -> Result<EdgeAdvantages> {
        check_range("gamma", self.gamma, 0.0, 1.0)?;
        check_range("lambda", self.lambda, 0.0, 1.0)?;
        match self.critic {
            Critic::Segment => self.per_segment(tree),
            Critic::Token(tv) => self.per_token(tree, tv),
        }
    }
}

/// VinePPO: Monte-Carlo value estimates from `K` continuations launched at
/// every state of the main trajectories.
///
/// Main trajectories are those launched from an episode root; they are the
/// only trained edges (the Monte-Carlo branches only estimate values).
/// `Vhat(s)` is the mean return (edge rewards from `s` to the end) of the
/// terminal continuations launched *at* `s` (project choice: the main
/// trajectory through `s` is not counted for `s` itself, as in VinePPO's
/// fresh samples; at the root the main trajectories are those samples);
/// `Vhat(terminal) = 0`. Then `A(s->c) = r(s,c) + gamma*Vhat(c) - Vhat(s)`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct VinePpo {
    pub gamma: f64,
}

impl Default for VinePpo {
    fn default() -> Self {
        VinePpo { gamma: 1.0 }
    }
}

impl VinePpo {
    /// `Vhat` and the number of finished Monte-Carlo samples per node.
    pub fn mc_values(&self, tree: &RolloutTree) -> Result<Vec<(f64, u32)>> {
        check_range("gamma", self.gamma, 0.0, 1.0)?;
        let mut acc = vec![(0.0, 0u32); tree.len()];
        for (id, node) in tree.nodes() {
            let Some(origin) = node.origin().filter(|_| node.is_terminal()) else {
                continue;
            };
            // Discounted return from the launch node down to this terminal.
            let path = tree.path(id)?;
            let from = path.iter().position(|&p| p == origin).ok_or_else(|| {
                RlError::Corrupt(format!("{id}: origin {origin} is not an ancestor"))
            })?;
            let mut ret = 0.0;
            for (k, &c) in path[from + 1..].iter().enumerate() {
                ret += self.gamma.powi(k as i32) * tree.edge_reward(c)?;
            }
            acc[origin.index()].0 += ret;
            acc[origin.index()].1 += 1;
        }
        Ok(acc
            .into_iter()
            .map(|(s, k)| (if k > 0 { s / f64::from(k) } else { 0.0 }, k))
            .collect())
    }

    /// States of the main trajectories (roots included) that are
    /// non-terminal and resumable, with how many more continuations each
    /// needs to reach `k` (finished or in flight).
    pub fn plan(&self, tree: &RolloutTree, k: u32) -> Result<Vec<(NodeId, u32)>> {
        let mc = self.mc_values(tree)?;
        let mut out = Vec::new();
        for (id, node) in tree.nodes() {
            if node.is_terminal() || !node.is_resumable() || !is_main(tree, id)? {
                continue;
            }
            let have = mc[id.index()].1 + node.in_flight();
            if have < k {
                out.push((id, k - have));
            }
        }
        Ok(out)
    }
}

/// True for roots and for nodes created by a continuation launched at
/// their episode's root.
fn is_main(tree: &RolloutTree, id: NodeId) -> Result<bool> {
    let n = tree.node(id)?;
    Ok(match n.origin() {
        None => true,
        Some(o) => tree.node(o)?.parent().is_none(),
    })
}

impl AdvantageEstimator for VinePpo {
    fn name(&self) -> &'static str {
        "vineppo"
    }
    fn advantages(&self, tree: &RolloutTree) -> Result<EdgeAdvantages> {
        let mc = self.mc_values(tree)?;
        let vhat = |id: NodeId| -> Result<f64> {
            let n = tree.node(id)?;
            if n.is_terminal() {
                return Ok(0.0);
            }
            match mc[id.index()] {
                (v, k) if k > 0 => Ok(v),
                _ => Err(RlError::node(
                    id,
                    "VinePPO needs at least one finished Monte-Carlo continuation launched here",
                )),
            }
        };
        let mut edge = vec![None; tree.len()];
        for (id, node) in tree.nodes() {
            let Some(p) = node.parent() else { continue };
            if is_main(tree, id)? {
                edge[id.index()] = Some(tree.edge_reward(id)? + self.gamma * vhat(id)? - vhat(p)?);
            }
        }
        EdgeTokens::from_edges(tree, &edge)
    }
}

/// DAPO dynamic sampling: keep sampling groups until `target_groups`
/// informative ones (rewards not all equal, i.e. `0 < k < N` for binary
/// rewards) are collected, or `max_rounds` sampling rounds have run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DynamicSampling {
    pub target_groups: usize,
    pub max_rounds: usize,
}

/// The outcome of [`DynamicSampling::fill`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Filled<G> {
    /// At most `target_groups` informative groups, in sampling order.
    pub groups: Vec<G>,
    /// Groups sampled in all rounds.
    pub sampled: usize,
    /// Uninformative groups filtered out.
    pub filtered: usize,
    /// Informative groups beyond the target, discarded.
    pub surplus: usize,
    pub rounds: usize,
    /// True when the target was reached.
    pub full: bool,
}

impl DynamicSampling {
    /// True when a group's rewards are not all equal (finite rewards only).
    pub fn informative(rewards: &[f64]) -> bool {
        match rewards.first() {
            Some(&r0) => rewards.iter().any(|&r| r != r0),
            None => false,
        }
    }

    /// Runs the refill loop. `sample(round)` returns one round's groups;
    /// `rewards(group)` their rewards.
    pub fn fill<G>(
        &self,
        mut sample: impl FnMut(usize) -> Vec<G>,
        rewards: impl Fn(&G) -> &[f64],
    ) -> Result<Filled<G>> {
        if self.target_groups == 0 || self.max_rounds == 0 {
            return Err(RlError::config(
                "dynamic_sampling",
                "target_groups and max_rounds must be >= 1",
            ));
        }
        let mut out = Filled {
            groups: Vec::with_capacity(self.target_groups),
            sampled: 0,
            filtered: 0,
            surplus: 0,
            rounds: 0,
            full: false,
        };
        while out.rounds < self.max_rounds && out.groups.len() < self.target_groups {
            let batch = sample(out.rounds);
            out.rounds += 1;
            out.sampled += batch.len();
            for g in batch {
                let r = rewards(&g);
                if let Some(bad) = r.iter().find(|x| !x.is_finite()) {
                    return Err(RlError::input(
                        "rewards",
                        format!("{bad} in a sampled group"),
                    ));
                }
                if !Self::informative(r) {
                    out.filtered += 1;
                } else if out.groups.len() < self.target_groups {
                    out.groups.push(g);
                } else {
                    out.surplus += 1;
                }
            }
        }
        out.full = out.groups.len() == self.target_groups;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tree::tests::step;
    use crate::tree::{Segment, Step, TokenKind};

    fn close(x: f64, y: f64) {
        assert!((x - y).abs() < 1e-9, "{x} vs {y}");
    }

    /// Edge advantage of a trained edge (all its trained tokens agree).
    fn edge_adv(a: &EdgeAdvantages, t: &RolloutTree, id: NodeId) -> Option<f64> {
        let seg = t.node(id).unwrap().segment().unwrap();
        let j = seg.kinds.iter().position(|k| k.is_trained()).unwrap();
        a.get(id).map(|v| v[j])
    }

    /// Task "a": two episodes, rewards [1, 0] and [0, 1] plus one truncated.
    fn group_tree() -> (RolloutTree, Vec<NodeId>, NodeId) {
        let mut t = RolloutTree::new();
        let mut leaves = Vec::new();
        let mut trunc = NodeId(0);
        for rewards in [[1.0, 0.0], [0.0, 1.0]] {
            let r = t.add_episode("a", vec![1], Some(0.5)).unwrap();
            for x in rewards {
                let p = t
                    .add_path(r, vec![step(2).value(0.5), step(1).terminal(x)])
                    .unwrap();
                leaves.push(p[1]);
            }
            trunc = t.add_path(r, vec![step(3).value(0.5)]).unwrap()[0];
        }
        (t, leaves, trunc)
    }

    #[test]
    fn grpo_and_rloo_group_by_task() {
        let (t, leaves, trunc) = group_tree();
        let a = Grpo::default().advantages(&t).unwrap();
        let std = (4.0 * 0.25 / 3.0f64).sqrt();
        for (&l, r) in leaves.iter().zip([1.0, 0.0, 0.0, 1.0]) {
            close(edge_adv(&a, &t, l).unwrap(), (r - 0.5) / (std + 1e-6));
            let parent = t.node(l).unwrap().parent().unwrap();
            close(edge_adv(&a, &t, parent).unwrap(), (r - 0.5) / (std + 1e-6));
        }
        assert_eq!(a.get(trunc), None, "truncated trajectories are untrained");
        let a = Grpo {
            normalize_std: false,
            eps: 0.0,
        }
        .advantages(&t)
        .unwrap();
        close(edge_adv(&a, &t, leaves[0]).unwrap(), 0.5);
        let a = Rloo.advantages(&t).unwrap();
        // 1 - mean(0, 0, 1) = 2/3; 0 - mean(1, 0, 1) = -2/3.
        close(edge_adv(&a, &t, leaves[0]).unwrap(), 2.0 / 3.0);
        close(edge_adv(&a, &t, leaves[1]).unwrap(), -2.0 / 3.0);
    }

    #[test]
    fn shared_edges_get_the_mean_trajectory_advantage() {
        let mut t = RolloutTree::new();
        let r = t.add_episode("a", vec![1], None).unwrap();
        let mid = t.add_path(r, vec![step(1), step(1).terminal(1.0)]).unwrap();
        t.add_path(mid[0], vec![step(1).terminal(0.0)]).unwrap();
        t.add_path(r, vec![step(1).terminal(0.0)]).unwrap();
        let a = Grpo {
            normalize_std: false,
            eps: 0.0,
        }
        .advantages(&t)
        .unwrap();
        // Returns 1, 0, 0: mean 1/3; the shared edge averages 2/3 and -1/3.
        close(
            edge_adv(&a, &t, mid[0]).unwrap(),
            (2.0 / 3.0 - 1.0 / 3.0) / 2.0,
        );
    }

    #[test]
    fn ppo_segment_critic_is_td_on_node_values() {
        let (t, leaves, _) = group_tree();
        let a = PpoGae {
            gamma: 1.0,
            lambda: 1.0,
            critic: Critic::Segment,
        }
        .advantages(&t)
        .unwrap();
        // lambda = 1, gamma = 1: A = return - V(s) at the first edge.
        let first = t.node(leaves[0]).unwrap().parent().unwrap();
        close(edge_adv(&a, &t, first).unwrap(), 1.0 - 0.5);
        let mut t2 = t.clone();
        t2.add_path(first, vec![step(1)]).unwrap();
        assert!(matches!(
            PpoGae {
                gamma: 1.0,
                lambda: 0.0,
                critic: Critic::Segment
            }
            .advantages(&t2),
            Err(RlError::MissingValue(_))
        ));
    }

    /// Textbook GAE over a flat list of (reward, value) actions, V = 0 past the end.
    fn textbook_gae(rewards: &[f64], values: &[f64], g: f64, l: f64) -> Vec<f64> {
        let mut out = vec![0.0; rewards.len()];
        let mut next = (0.0, 0.0);
        for t in (0..rewards.len()).rev() {
            let delta = rewards[t] + g * next.0 - values[t];
            out[t] = delta + g * l * next.1;
            next = (values[t], out[t]);
        }
        out
    }

    #[test]
    fn ppo_token_critic_matches_textbook_gae_on_a_multi_turn_chain() {
        // Turn 1: 3 actions + 2 observation tokens; turn 2: a replayed-only
        // edge with a shaped reward; turn 3: 2 actions then terminal R = 1.
        let mut t = RolloutTree::new();
        let r = t.add_episode("a", vec![1, 2], Some(0.4)).unwrap();
        let mut s1 = Segment::new();
        s1.push(TokenKind::Action, &[3, 4, 5], Some(&[-0.1; 3]))
            .unwrap();
        s1.push(TokenKind::Observation, &[6, 7], None).unwrap();
        let mut s2 = Segment::new();
        s2.push(TokenKind::Replayed, &[8], None).unwrap();
        let s2 = s2.with_reward(0.25);
        let s3 = Segment::policy(&[9, 10], &[-0.2; 2]).unwrap();
        let ids = t
            .add_path(
                r,
                vec![
                    Step::new(s1).value(0.3),
                    Step::new(s2).value(0.3),
                    Step::new(s3).terminal(1.0),
                ],
            )
            .unwrap();
        let mut tv = EdgeTokens::empty(&t);
        tv.set(&t, ids[0], vec![0.1, 0.2, 0.3, 9.0, 9.0]).unwrap();
        tv.set(&t, ids[1], vec![9.0]).unwrap();
        tv.set(&t, ids[2], vec![0.6, 0.7]).unwrap();
        let (g, l) = (0.9, 0.7);
        let a = PpoGae {
            gamma: g,
            lambda: l,
            critic: Critic::Token(&tv),
        }
        .advantages(&t)
        .unwrap();
        // Flattened actions: 5 trained tokens; the shaped reward lands on the
        // last action of turn 1, R on the last token.
        let want = textbook_gae(
            &[0.0, 0.0, 0.25, 0.0, 1.0],
            &[0.1, 0.2, 0.3, 0.6, 0.7],
            g,
            l,
        );
        let got: Vec<f64> = a.get(ids[0]).unwrap()[..3]
            .iter()
            .chain(a.get(ids[2]).unwrap())
            .copied()
            .collect();
        for (x, y) in got.iter().zip(&want) {
            close(*x, *y);
        }
        assert_eq!(
            &a.get(ids[0]).unwrap()[3..],
            &[0.0, 0.0],
            "observations get no advantage"
        );
        assert_eq!(
            a.get(ids[1]),
            None,
            "an edge without actions is not trained"
        );
        // A critic for another tree is rejected, not indexed out of bounds.
        let mut bad = EdgeTokens::empty(&t);
        bad.set(&t, ids[2], vec![0.0, 0.0]).unwrap();
        assert!(PpoGae {
            gamma: g,
            lambda: l,
            critic: Critic::Token(&bad)
        }
        .advantages(&t)
        .is_err());
    }

    #[test]
    fn ppo_token_critic_averages_children_at_a_branch() {
        let mut t = RolloutTree::new();
        let r = t.add_episode("a", vec![1], Some(0.5)).unwrap();
        let a = t.add_path(r, vec![step(2).value(0.5)]).unwrap()[0];
        let c1 = t.add_path(a, vec![step(1).terminal(1.0)]).unwrap()[0];
        let c2 = t.add_path(a, vec![step(1).terminal(0.0)]).unwrap()[0];
        let mut tv = EdgeTokens::empty(&t);
        tv.set(&t, a, vec![0.4, 0.45]).unwrap();
        tv.set(&t, c1, vec![0.8]).unwrap();
        tv.set(&t, c2, vec![0.2]).unwrap();
        let adv = PpoGae {
            gamma: 1.0,
            lambda: 0.0,
            critic: Critic::Token(&tv),
        }
        .advantages(&t)
        .unwrap();
        // Last token of a: delta = 0 + mean(0.8, 0.2) - 0.45.
        close(adv.get(a).unwrap()[1], 0.5 - 0.45);
        close(adv.get(c1).unwrap()[0], 1.0 - 0.8);
    }

    #[test]
    fn vineppo_uses_mc_continuations_and_trains_main_edges_only() {
        let mut t = RolloutTree::new();
        let r = t.add_episode("a", vec![1], Some(0.5)).unwrap();
        let main = t
            .add_path(r, vec![step(1).value(0.5), step(1).terminal(1.0)])
            .unwrap();
        t.add_path(r, vec![step(1).terminal(0.0)]).unwrap();
        let v = VinePpo::default();
        assert_eq!(v.plan(&t, 2).unwrap(), vec![(main[0], 2)]);
        assert!(v.advantages(&t).is_err(), "no MC samples at main[0] yet");
        let mc1 = t.add_path(main[0], vec![step(1).terminal(1.0)]).unwrap()[0];
        t.add_path(main[0], vec![step(1).value(0.5), step(1).terminal(0.0)])
            .unwrap();
        assert!(v.plan(&t, 2).unwrap().is_empty());
        let a = v.advantages(&t).unwrap();
        // Vhat(root) = mean(1, 0) = 0.5; Vhat(main[0]) = mean(1, 0) = 0.5.
        close(edge_adv(&a, &t, main[0]).unwrap(), 0.0);
        close(edge_adv(&a, &t, main[1]).unwrap(), 0.5);
        assert_eq!(a.get(mc1), None);
    }

    #[test]
    fn dynamic_sampling_refills_until_target() {
        let ds = DynamicSampling {
            target_groups: 3,
            max_rounds: 10,
        };
        // Round k yields groups [k, k+1]; even groups are all-zero.
        let out = ds
            .fill(
                |k| vec![2 * k, 2 * k + 1],
                |g| {
                    if g % 2 == 0 {
                        &[0.0, 0.0][..]
                    } else {
                        &[1.0, 0.0][..]
                    }
                },
            )
            .unwrap();
        assert_eq!(out.groups, vec![1, 3, 5]);
        assert_eq!(
            (out.sampled, out.filtered, out.rounds, out.full),
            (6, 3, 3, true)
        );
        let never = ds.fill(|_| vec![0u8], |_| &[1.0, 1.0][..]).unwrap();
        assert!(!never.full && never.rounds == 10 && never.groups.is_empty());
        assert!(DynamicSampling {
            target_groups: 0,
            max_rounds: 1
        }
        .fill(|_| vec![0u8], |_| &[][..])
        .is_err());
        assert!(ds.fill(|_| vec![0u8], |_| &[f64::NAN, 1.0][..]).is_err());
        assert!(!DynamicSampling::informative(&[]));
    }

    #[test]
    fn all_estimators_share_one_interface() {
        let (t, ..) = group_tree();
        let ests: Vec<Box<dyn AdvantageEstimator>> = vec![
            Box::new(Focus::default()),
            Box::new(Grpo::default()),
            Box::new(Rloo),
            Box::new(PpoGae {
                gamma: 1.0,
                lambda: 0.95,
                critic: Critic::Segment,
            }),
        ];
        for e in ests {
            let adv = e.advantages(&t).unwrap();
            let rows =
                crate::credit::loss_rows(&t, &adv, None, crate::credit::Sharing::Once).unwrap();
            assert_eq!(rows.len(), 6, "{}", e.name());
        }
    }
}
