//! Where an allocator spent a step's budget, and how well a critic ranks
//! states: the FOCUS health metrics logged every step.
//!
//! [`AllocationLog`] records each continuation at launch (the state's depth,
//! its score, `n_eff = n + m` before the launch) and at completion (the
//! tokens it generated); [`AllocationLog::summary`] reads the finished tree
//! to say which launches went to *settled* states: states whose subtree
//! ended with at least two outcomes, all equal (all 0 or all 1). Budget
//! spent there bought no contrast for the credit.
//!
//! [`explained_variance`] and [`spearman`] compare critic values with
//! reference values (Monte-Carlo estimates on held-out states).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::tree::{NodeId, RolloutTree, Ticket};

/// Bins of the score histogram: `g / g_max` in tenths, where
/// `g_max = 1/4 / (kappa + 1)^2` is the largest score any state can have
/// (`mu = 1/2`, no evidence).
pub const SCORE_BINS: usize = 10;

/// `n_eff` values at or above this share the last bin.
pub const N_EFF_BINS: usize = 16;

/// One launch, as recorded.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Launch {
    node: NodeId,
    depth: usize,
    /// `g / g_max` at launch, when the selector scores with `g`.
    score: Option<f64>,
    n_eff: u32,
    /// Generated tokens, once completed.
    tokens: Option<u64>,
}

/// Launches and completions of one step's allocation.
#[derive(Clone, Debug, Default)]
pub struct AllocationLog {
    launches: BTreeMap<u64, Launch>,
}

/// Where one step's budget went.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct AllocationSummary {
    /// Launches by the depth of the state they started from (root = 0).
    pub by_depth: Vec<u64>,
    /// Launches by normalised score `g / g_max`, in [`SCORE_BINS`] bins.
    pub by_score: Vec<u64>,
    /// Launches by `n_eff = n + m` of their state before the launch
    /// ([`N_EFF_BINS`] bins, the last one open).
    pub by_n_eff: Vec<u64>,
    /// Share of the generated tokens spent from settled states (subtree
    /// with >= 2 outcomes, all equal).
    pub settled_token_fraction: f64,
    /// Mean depth of the launches.
    pub mean_depth: f64,
    /// Mean `n_eff` of the launches' states before each launch.
    pub mean_n_eff: f64,
}

impl AllocationLog {
    /// Record `ticket`, just launched from its node; `score` is the
    /// priority it was chosen with ([`crate::focus::Allocator::last_priority`]:
    /// FOCUS's `g` with prior strength `kappa`, or a variant's score), `None`
    /// where there is none. Call after [`RolloutTree::begin`]: the node's in-flight
    /// count already includes this launch.
    pub fn launched(
        &mut self,
        tree: &RolloutTree,
        ticket: Ticket,
        score: Option<f64>,
        kappa: f64,
    ) -> Result<()> {
        let node = tree.node(ticket.node())?;
        let g_max = 0.25 / ((kappa + 1.0) * (kappa + 1.0));
        self.launches.insert(
            ticket.id(),
            Launch {
                node: ticket.node(),
                depth: node.depth(),
                score: score.map(|g| g / g_max),
                n_eff: node.completed() + node.in_flight().saturating_sub(1),
                tokens: None,
            },
        );
        Ok(())
    }

    /// Record the tokens `ticket` generated.
    pub fn completed(&mut self, ticket: Ticket, tokens: u64) {
        if let Some(l) = self.launches.get_mut(&ticket.id()) {
            l.tokens = Some(tokens);
        }
    }

    /// The step's summary over the finished `tree`.
    pub fn summary(&self, tree: &RolloutTree) -> Result<AllocationSummary> {
        let mut s = AllocationSummary {
            by_score: vec![0; SCORE_BINS],
            by_n_eff: vec![0; N_EFF_BINS],
            ..Default::default()
        };
        let (mut settled, mut total, mut depth_sum, mut n_eff_sum) = (0u64, 0u64, 0usize, 0u64);
        for l in self.launches.values() {
            if s.by_depth.len() <= l.depth {
                s.by_depth.resize(l.depth + 1, 0);
            }
            s.by_depth[l.depth] += 1;
            depth_sum += l.depth;
            if let Some(x) = l.score {
                let bin = ((x * SCORE_BINS as f64) as usize).min(SCORE_BINS - 1);
                s.by_score[bin] += 1;
            }
            s.by_n_eff[(l.n_eff as usize).min(N_EFF_BINS - 1)] += 1;
            n_eff_sum += u64::from(l.n_eff);
            let tokens = l.tokens.unwrap_or(0);
            total += tokens;
            if is_settled(tree, l.node)? {
                settled += tokens;
            }
        }
        let k = self.launches.len().max(1) as f64;
        s.mean_depth = depth_sum as f64 / k;
        s.mean_n_eff = n_eff_sum as f64 / k;
        s.settled_token_fraction = if total > 0 {
            settled as f64 / total as f64
        } else {
            0.0
        };
        Ok(s)
    }
}

/// True when `id`'s subtree has at least two terminal outcomes, all equal.
pub fn is_settled(tree: &RolloutTree, id: NodeId) -> Result<bool> {
    let n = tree.node(id)?;
    let k = n.subtree_completed();
    if k < 2 {
        return Ok(false);
    }
    let sum = n.subtree_reward_sum();
    Ok(sum == 0.0 || sum == f64::from(k))
}

/// Fraction of the reference's variance the predictions explain:
/// `1 - sum (y - p)^2 / sum (y - ybar)^2` over `(p, y)` pairs (`None` with
/// fewer than two pairs or a constant reference).
pub fn explained_variance(pairs: &[(f64, f64)]) -> Option<f64> {
    if pairs.len() < 2 {
        return None;
    }
    let n = pairs.len() as f64;
    let ybar = pairs.iter().map(|p| p.1).sum::<f64>() / n;
    let ss_tot: f64 = pairs.iter().map(|p| (p.1 - ybar).powi(2)).sum();
    if ss_tot <= 0.0 {
        return None;
    }
    let ss_res: f64 = pairs.iter().map(|p| (p.1 - p.0).powi(2)).sum();
    Some(1.0 - ss_res / ss_tot)
}

/// Spearman rank correlation of `(x, y)` pairs (average ranks for ties;
/// `None` with fewer than three pairs, where it can only be +-1, or when
/// either side is constant).
pub fn spearman(pairs: &[(f64, f64)]) -> Option<f64> {
    if pairs.len() < 3 {
        return None;
    }
    let rx = ranks(pairs.iter().map(|p| p.0));
    let ry = ranks(pairs.iter().map(|p| p.1));
    let n = rx.len() as f64;
    let (mx, my) = (rx.iter().sum::<f64>() / n, ry.iter().sum::<f64>() / n);
    let (mut sxy, mut sxx, mut syy) = (0.0, 0.0, 0.0);
    for (a, b) in rx.iter().zip(&ry) {
        sxy += (a - mx) * (b - my);
        sxx += (a - mx) * (a - mx);
        syy += (b - my) * (b - my);
    }
    if sxx <= 0.0 || syy <= 0.0 {
        return None;
    }
    Some(sxy / (sxx * syy).sqrt())
}

/// 1-based ranks, ties sharing their mean rank.
fn ranks(xs: impl Iterator<Item = f64>) -> Vec<f64> {
    let v: Vec<f64> = xs.collect();
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&a, &b| v[a].total_cmp(&v[b]));
    let mut r = vec![0.0; v.len()];
    let mut i = 0;
    while i < idx.len() {
        let mut j = i;
        while j + 1 < idx.len() && v[idx[j + 1]] == v[idx[i]] {
            j += 1;
        }
        let mean = (i + j) as f64 / 2.0 + 1.0;
        for &k in &idx[i..=j] {
            r[k] = mean;
        }
        i = j + 1;
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tree::{Segment, Step};

    fn path(r: f64) -> Vec<Step> {
        let a = Segment::policy(&[5, 6], &[-0.1, -0.2]).unwrap();
        let b = Segment::policy(&[7], &[-0.3]).unwrap();
        vec![Step::new(a).value(0.5), Step::new(b).terminal(r)]
    }

    #[test]
    fn summary_counts_depths_scores_and_settled_budget() {
        let mut tree = RolloutTree::new();
        let root = tree.add_episode("t", vec![1, 2], Some(0.5)).unwrap();
        let mut log = AllocationLog::default();
        // Two launches from the root; both fail: the root is settled.
        let t1 = tree.begin(root).unwrap();
        log.launched(&tree, t1, Some(0.0625), 1.0).unwrap();
        let t2 = tree.begin(root).unwrap();
        log.launched(&tree, t2, Some(0.03), 1.0).unwrap();
        let new = tree.complete(t1, path(0.0)).unwrap();
        log.completed(t1, 3);
        tree.complete(t2, path(0.0)).unwrap();
        log.completed(t2, 3);
        // One from the depth-1 state of the first path: it succeeds, so
        // that state has outcomes {0, 1} and is not settled; the root now
        // has {0, 0, 1}.
        let t3 = tree.begin(new[0]).unwrap();
        log.launched(&tree, t3, Some(0.001), 1.0).unwrap();
        let last = Step::new(Segment::policy(&[7], &[-0.3]).unwrap()).terminal(1.0);
        let s = tree.complete(t3, vec![last]).unwrap();
        assert_eq!(s.len(), 1);
        log.completed(t3, 1);
        let sum = log.summary(&tree).unwrap();
        assert_eq!(sum.by_depth, vec![2, 1]);
        // g_max = 1/16 at kappa = 1: scores 1.0, 0.48, 0.016.
        assert_eq!(sum.by_score[9], 1);
        assert_eq!(sum.by_score[4], 1);
        assert_eq!(sum.by_score[0], 1);
        // n_eff before launch: 0; then 1 (one in flight); then 1 (the
        // depth-1 state has its creating trajectory's outcome).
        assert_eq!(&sum.by_n_eff[..2], &[1, 2]);
        assert!(!is_settled(&tree, root).unwrap());
        assert_eq!(sum.settled_token_fraction, 0.0);
        assert!((sum.mean_depth - 1.0 / 3.0).abs() < 1e-12);
        assert!((sum.mean_n_eff - 2.0 / 3.0).abs() < 1e-12);
    }

    #[test]
    fn settled_needs_two_equal_outcomes() {
        let mut tree = RolloutTree::new();
        let root = tree.add_episode("t", vec![1], Some(0.5)).unwrap();
        let mut log = AllocationLog::default();
        let t = tree.begin(root).unwrap();
        log.launched(&tree, t, None, 1.0).unwrap();
        tree.complete(t, path(1.0)).unwrap();
        log.completed(t, 3);
        assert!(!is_settled(&tree, root).unwrap());
        let t = tree.begin(root).unwrap();
        log.launched(&tree, t, None, 1.0).unwrap();
        tree.complete(t, path(1.0)).unwrap();
        log.completed(t, 5);
        assert!(is_settled(&tree, root).unwrap());
        let s = log.summary(&tree).unwrap();
        assert_eq!(s.settled_token_fraction, 1.0);
        assert_eq!(s.by_score.iter().sum::<u64>(), 0);
    }

    #[test]
    fn rank_and_variance_statistics_match_hand_values() {
        // Perfect monotone but non-linear relation: rank corr 1.
        let p = [(0.1, 1.0), (0.2, 4.0), (0.3, 9.0), (0.4, 16.0)];
        assert!((spearman(&p).unwrap() - 1.0).abs() < 1e-12);
        // Reversed: -1; ties get mean ranks.
        let q = [(1.0, 3.0), (2.0, 2.0), (3.0, 1.0)];
        assert!((spearman(&q).unwrap() + 1.0).abs() < 1e-12);
        let t = [(1.0, 1.0), (1.0, 2.0), (2.0, 3.0)];
        // ranks x: 1.5 1.5 3, y: 1 2 3 -> r = 0.866...
        assert!((spearman(&t).unwrap() - 3f64.sqrt() / 2.0).abs() < 1e-12);
        assert_eq!(spearman(&[(1.0, 1.0), (2.0, 2.0)]), None);
        assert_eq!(spearman(&[(1.0, 1.0), (1.0, 2.0), (1.0, 3.0)]), None);
        // EV: exact predictions 1, the mean 0, hand value otherwise.
        let y = [(1.0, 1.0), (2.0, 2.0), (3.0, 3.0)];
        assert_eq!(explained_variance(&y), Some(1.0));
        let m = [(2.0, 1.0), (2.0, 2.0), (2.0, 3.0)];
        assert_eq!(explained_variance(&m), Some(0.0));
        let h = [(1.5, 1.0), (2.0, 2.0), (2.5, 3.0)];
        assert!((explained_variance(&h).unwrap() - 0.75).abs() < 1e-12);
    }
}
