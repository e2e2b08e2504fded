//! FOCUS credit: recursive one-step backups, refined values, TD(lambda)
//! advantages, critic targets, and the per-token arrays the loss reads.
//!
//! The allocator chose where to branch, so the leaves under a node are not
//! on-policy samples from it; values are backed up one step at a time
//! instead (spec Eq. 1). For a node `s` with children `C(s)` and edge
//! rewards `r(s, c)`:
//!
//! ```text
//! Gbar(s)   = (1/|C(s)|) * sum_{c in C(s)} [ r(s,c) + gamma * Vtilde(c) ]
//! Vtilde(s) = (kappa * V_phi(s) + |C(s)| * Gbar(s)) / (kappa + |C(s)|)
//! ```
//!
//! Terminal convention (project choice): the verified reward `R` is paid on
//! the edge into the terminal, `r(s, c) = segment reward + R(c)`, and
//! `Vtilde(terminal) = 0`. An unexpanded non-terminal leaf (truncated, or
//! still waiting for its continuation) has `Vtilde = V_phi`.
//!
//! Advantages are TD residuals between consecutive states; every trained
//! token of the segment `s_t -> s_{t+1}` gets `A_t`:
//!
//! ```text
//! delta_t = r_t + gamma * Vtilde(s_{t+1}) - Vtilde(s_t)
//! A_t     = sum_k (gamma*lambda)^k * delta_{t+k}       (lambda = 0: A_t = delta_t)
//! ```
//!
//! On a tree the future residuals depend on the branch taken below
//! `s_{t+1}`; consistent with `Gbar`'s uniform average over children, the
//! recursion `A(e) = delta(e) + gamma*lambda * mean_{e' below e} A(e')`
//! computes the sum's expectation under a uniformly random descent (equal
//! to the plain sum on a chain; both checked in the tests).
//!
//! The critic regresses onto `Gbar(s)` at every node with children.

use serde::{Deserialize, Serialize};

use crate::error::{check_range, Result, RlError};
use crate::tree::{NodeId, RolloutTree};

/// Discount, trace decay and prior strength of the backups.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct CreditConfig {
    /// `gamma` in `[0, 1]` (paper: 1).
    pub gamma: f64,
    /// `lambda` in `[0, 1]` (paper: 0).
    pub lambda: f64,
    /// Mixing weight `kappa >= 0` of the critic in `Vtilde` (paper: 1).
    pub kappa: f64,
}

impl Default for CreditConfig {
    fn default() -> Self {
        CreditConfig {
            gamma: 1.0,
            lambda: 0.0,
            kappa: 1.0,
        }
    }
}

impl CreditConfig {
    /// Checks the ranges.
    pub fn validate(&self) -> Result<()> {
        check_range("gamma", self.gamma, 0.0, 1.0)?;
        check_range("lambda", self.lambda, 0.0, 1.0)?;
        check_range("kappa", self.kappa, 0.0, f64::MAX)
    }
}

/// `Gbar` and `Vtilde` of every node (indexed by [`NodeId::index`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Backup {
    /// `Gbar(s)` for nodes with children, `None` elsewhere.
    pub gbar: Vec<Option<f64>>,
    /// `Vtilde(s)` for every node.
    pub vtilde: Vec<f64>,
}

impl Backup {
    /// Critic regression targets: `(s, Gbar(s))` for every node with
    /// children.
    pub fn critic_targets(&self) -> Vec<(NodeId, f64)> {
        self.gbar
            .iter()
            .enumerate()
            .filter_map(|(i, g)| g.map(|g| (NodeId(i as u32), g)))
            .collect()
    }
}

/// Computes `Gbar` and `Vtilde` bottom-up (Eq. 1). Errors with
/// [`RlError::MissingValue`] when a non-terminal node whose `V_phi` enters
/// the formulas (every non-terminal leaf, and every inner node when
/// `kappa > 0`) has no critic value.
pub fn backup(tree: &RolloutTree, cfg: &CreditConfig) -> Result<Backup> {
    cfg.validate()?;
    let n = tree.len();
    let mut gbar = vec![None; n];
    let mut vtilde = vec![0.0; n];
    for (id, node) in tree.nodes().rev() {
        let i = id.index();
        if node.is_terminal() {
            continue;
        }
        let value = || node.value().ok_or(RlError::MissingValue(id));
        if node.children().is_empty() {
            vtilde[i] = value()?;
            continue;
        }
        let k = node.children().len() as f64;
        let mut sum = 0.0;
        for &c in node.children() {
            sum += tree.edge_reward(c)? + cfg.gamma * vtilde[c.index()];
        }
        let g = sum / k;
        gbar[i] = Some(g);
        let prior = if cfg.kappa > 0.0 {
            cfg.kappa * value()?
        } else {
            0.0
        };
        vtilde[i] = (prior + k * g) / (cfg.kappa + k);
    }
    Ok(Backup { gbar, vtilde })
}

/// Per-edge TD(lambda) advantages from state values `values[s]`
/// (`Vtilde` for FOCUS, `V_phi` for a per-segment PPO critic), indexed by
/// the edge's child node; roots get `None`.
///
/// `A(s->c) = r(s,c) + gamma*values[c] - values[s]
///            + gamma*lambda * mean_{c' in C(c)} A(c->c')`.
pub fn td_advantages(
    tree: &RolloutTree,
    values: &[f64],
    gamma: f64,
    lambda: f64,
) -> Result<Vec<Option<f64>>> {
    check_range("gamma", gamma, 0.0, 1.0)?;
    check_range("lambda", lambda, 0.0, 1.0)?;
    if values.len() != tree.len() {
        return Err(RlError::input(
            "values",
            format!("{} values for {} nodes", values.len(), tree.len()),
        ));
    }
    let mut adv: Vec<Option<f64>> = vec![None; tree.len()];
    for (id, node) in tree.nodes().rev() {
        let Some(p) = node.parent() else { continue };
        let delta = tree.edge_reward(id)? + gamma * values[id.index()] - values[p.index()];
        let below = if node.children().is_empty() || lambda == 0.0 {
            0.0
        } else {
            let s: f64 = node
                .children()
                .iter()
                .map(|c| adv[c.index()].unwrap_or(0.0))
                .sum();
            s / node.children().len() as f64
        };
        adv[id.index()] = Some(delta + gamma * lambda * below);
    }
    Ok(adv)
}

/// One `f64` per token of every edge (indexed by the edge's child node):
/// per-token advantages ([`EdgeAdvantages`], `0` on masked tokens; an edge
/// with `None` is not trained at all, e.g. VinePPO's Monte-Carlo branches)
/// or per-token critic values (PPO with a token-level critic).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EdgeTokens {
    per_token: Vec<Option<Vec<f64>>>,
}

/// Per-token advantages of every edge.
pub type EdgeAdvantages = EdgeTokens;

impl EdgeTokens {
    /// No edge set.
    pub fn empty(tree: &RolloutTree) -> Self {
        EdgeTokens {
            per_token: vec![None; tree.len()],
        }
    }

    /// Broadcasts one advantage per edge to the edge's trained tokens.
    pub fn from_edges(tree: &RolloutTree, edge: &[Option<f64>]) -> Result<Self> {
        if edge.len() != tree.len() {
            return Err(RlError::input(
                "edge advantages",
                format!("{} entries for {} nodes", edge.len(), tree.len()),
            ));
        }
        let mut out = EdgeTokens::empty(tree);
        for (id, node) in tree.nodes() {
            if let (Some(a), Some(seg)) = (edge[id.index()], node.segment()) {
                out.per_token[id.index()] = Some(
                    seg.kinds
                        .iter()
                        .map(|k| if k.is_trained() { a } else { 0.0 })
                        .collect(),
                );
            }
        }
        Ok(out)
    }

    /// Sets the per-token values of the edge into `id` (one per token of
    /// its segment; values on masked tokens are ignored).
    pub fn set(&mut self, tree: &RolloutTree, id: NodeId, adv: Vec<f64>) -> Result<()> {
        let seg = tree
            .node(id)?
            .segment()
            .ok_or_else(|| RlError::node(id, "is a root; it has no incoming edge"))?;
        if adv.len() != seg.len() {
            return Err(RlError::input(
                "per-token values",
                format!(
                    "{} values for the {} tokens of edge {id}",
                    adv.len(),
                    seg.len()
                ),
            ));
        }
        if let Some(bad) = adv.iter().find(|a| !a.is_finite()) {
            return Err(RlError::input(
                "per-token values",
                format!("{bad} on edge {id}"),
            ));
        }
        if self.per_token.len() != tree.len() {
            self.per_token.resize(tree.len(), None);
        }
        self.per_token[id.index()] = Some(adv);
        Ok(())
    }

    /// The per-token values of the edge into `id`.
    pub fn get(&self, id: NodeId) -> Option<&[f64]> {
        self.per_token.get(id.index())?.as_deref()
    }

    /// Like [`Self::get`], but checks the length against the segment of
    /// `id` in `tree` (the arrays may come from another tree or a file).
    pub fn checked(&self, tree: &RolloutTree, id: NodeId) -> Result<Option<&[f64]>> {
        let Some(v) = self.get(id) else {
            return Ok(None);
        };
        let len = tree
            .node(id)?
            .segment()
            .map_or(0, super::tree::Segment::len);
        if v.len() != len {
            return Err(RlError::input(
                "per-token values",
                format!("{} values for the {len} tokens of edge {id}", v.len()),
            ));
        }
        Ok(Some(v))
    }
}

/// Everything FOCUS credit produces for one step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FocusCredit {
    pub backup: Backup,
    /// `A_t` per edge (by child node).
    pub edge: Vec<Option<f64>>,
    pub tokens: EdgeAdvantages,
}

/// Backups, TD(lambda) advantages on `Vtilde`, and their per-token form.
pub fn focus_credit(tree: &RolloutTree, cfg: &CreditConfig) -> Result<FocusCredit> {
    let backup = backup(tree, cfg)?;
    let edge = td_advantages(tree, &backup.vtilde, cfg.gamma, cfg.lambda)?;
    let tokens = EdgeAdvantages::from_edges(tree, &edge)?;
    Ok(FocusCredit {
        backup,
        edge,
        tokens,
    })
}

/// How tokens shared by several root-to-leaf rows are trained.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Sharing {
    /// Each edge (and each value target) is trained in exactly one row: the
    /// row of the leaf reached by always following the first child.
    #[default]
    Once,
    /// Every row trains every edge on its path (shared prefixes count once
    /// per leaf below them).
    EveryPath,
}

/// One training sequence: the path from an episode root to a leaf.
///
/// All arrays are aligned with `tokens` (index `i` describes token `i`,
/// whose log-prob the model computes at position `i - 1`); the prompt is
/// included and always masked.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LossRow {
    pub episode: usize,
    pub leaf: NodeId,
    pub tokens: Vec<u32>,
    /// `1.0` where the policy loss trains the token in this row.
    pub mask: Vec<f32>,
    pub advantages: Vec<f32>,
    /// The behaviour log-probability of every policy token of the row,
    /// trained in this row or not (`0.0` for prompt and observation
    /// tokens).
    pub behaviour_logprobs: Vec<f32>,
    /// The same for every token on the path before the row's context
    /// (empty unless the context restarted: a compaction); the critic's
    /// surprise features count them too.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub history_logprobs: Vec<f32>,
    /// `(position, target)`: the value head's output at `position` (the last
    /// token of state `s`'s context) regresses onto `target` (`Gbar(s)`).
    /// A root with an empty prompt has no position and gets no target.
    pub value_targets: Vec<(usize, f32)>,
}

/// One context window of a row being built (see [`loss_rows`]).
struct Window {
    tokens: Vec<u32>,
    mask: Vec<f32>,
    advantages: Vec<f32>,
    behaviour_logprobs: Vec<f32>,
    /// The path's logprobs before this window (a context restart).
    history: Vec<f32>,
    value_targets: Vec<(usize, f32)>,
    trained: bool,
}

impl Window {
    fn new(tokens: Vec<u32>) -> Self {
        let n = tokens.len();
        Window {
            tokens,
            mask: vec![0.0; n],
            advantages: vec![0.0; n],
            behaviour_logprobs: vec![0.0; n],
            history: Vec::new(),
            value_targets: Vec::new(),
            trained: false,
        }
    }

    fn into_row(self, episode: usize, leaf: NodeId) -> LossRow {
        LossRow {
            episode,
            leaf,
            tokens: self.tokens,
            mask: self.mask,
            advantages: self.advantages,
            behaviour_logprobs: self.behaviour_logprobs,
            history_logprobs: self.history,
            value_targets: self.value_targets,
        }
    }
}

/// Builds one [`LossRow`] per leaf (in id order) from per-token edge
/// advantages and optional per-node value targets (e.g. [`Backup::gbar`]).
///
/// A path through a context restart ([`crate::Segment::restart`]) is
/// several sequences: the policy generated the tokens before a restart in
/// one context and those after it in another. Such a leaf gets one row per
/// context window, in path order, the last always and an earlier one when
/// it trains a token or holds a value target; each state's value target
/// sits at the end of its own context.
pub fn loss_rows(
    tree: &RolloutTree,
    adv: &EdgeAdvantages,
    value_targets: Option<&[Option<f64>]>,
    sharing: Sharing,
) -> Result<Vec<LossRow>> {
    if let Some(v) = value_targets {
        if v.len() != tree.len() {
            return Err(RlError::input(
                "value_targets",
                format!("{} entries for {} nodes", v.len(), tree.len()),
            ));
        }
    }
    // owner[s]: the leaf whose row trains node s (its edge and its target).
    let mut owner: Vec<NodeId> = (0..tree.len() as u32).map(NodeId).collect();
    for (id, node) in tree.nodes().rev() {
        if let Some(&c) = node.children().first() {
            owner[id.index()] = owner[c.index()];
        }
    }
    let mut rows = Vec::new();
    for leaf in tree.leaves() {
        let path = tree.path(leaf)?;
        let episode = tree.node(leaf)?.episode();
        let root = tree.episodes()[episode].prompt.clone();
        let mut row = Window::new(root);
        for &s in &path {
            let n = tree.node(s)?;
            let owned = sharing == Sharing::EveryPath || owner[s.index()] == leaf;
            if let Some(seg) = n.segment() {
                let a = if owned { adv.checked(tree, s)? } else { None };
                let w = seg.window_len();
                row.tokens.extend_from_slice(&seg.tokens[..w]);
                row.mask.resize(row.tokens.len(), 0.0);
                row.advantages.resize(row.tokens.len(), 0.0);
                row.behaviour_logprobs.resize(row.tokens.len(), 0.0);
                for (j, pos) in n.span().enumerate() {
                    if seg.kinds[j].is_trained() {
                        // Every policy token's logprob, trained here or
                        // not: the critic's surprise features read them.
                        row.behaviour_logprobs[pos] = seg.logprobs[j];
                        if let Some(a) = a {
                            row.mask[pos] = 1.0;
                            row.advantages[pos] = a[j] as f32;
                            row.trained = true;
                        }
                    }
                }
                if w < seg.len() {
                    // A context restart: the row so far is one sequence the
                    // policy saw; the state's context starts a new one.
                    let mut next = Window::new(seg.tokens[w..].to_vec());
                    // The path's logprobs up to the restart context.
                    next.history = tree.path_logprobs(s)?;
                    next.history.truncate(next.history.len() - (seg.len() - w));
                    let done = std::mem::replace(&mut row, next);
                    if done.trained || !done.value_targets.is_empty() {
                        rows.push(done.into_row(episode, leaf));
                    }
                }
            }
            debug_assert_eq!(row.tokens.len(), n.context_len());
            if let (true, Some(t), Some(pos)) = (
                owned,
                value_targets.and_then(|v| v[s.index()]),
                row.tokens.len().checked_sub(1),
            ) {
                row.value_targets.push((pos, t as f32));
            }
        }
        rows.push(row.into_row(episode, leaf));
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tree::tests::step;
    use crate::tree::{Segment, Step, TokenKind};
    use proptest::prelude::*;

    /// r (V=.5) -> a (V=.6) -> {t1: R=0, t2: R=1, c: truncated, V=.3}
    ///   r -> b: R=1
    fn hand_tree() -> (RolloutTree, [NodeId; 6]) {
        let mut t = RolloutTree::new();
        let r = t.add_episode("t", vec![9, 9], Some(0.5)).unwrap();
        let a = t
            .add_path(r, vec![step(2).value(0.6), step(1).terminal(0.0)])
            .unwrap();
        let b = t.add_path(r, vec![step(3).terminal(1.0)]).unwrap()[0];
        let t2 = t.add_path(a[0], vec![step(1).terminal(1.0)]).unwrap()[0];
        let c = t.add_path(a[0], vec![step(2).value(0.3)]).unwrap()[0];
        (t, [r, a[0], a[1], b, t2, c])
    }

    #[test]
    fn backup_matches_hand_worked_tree() {
        let (t, [r, a, t1, b, t2, c]) = hand_tree();
        let cr = focus_credit(&t, &CreditConfig::default()).unwrap();
        let (g, v) = (&cr.backup.gbar, &cr.backup.vtilde);
        let close = |x: f64, y: f64| assert!((x - y).abs() < 1e-12, "{x} vs {y}");
        // Gbar(a) = (0 + 1 + 0.3)/3; Vtilde(a) = (0.6 + 3*Gbar(a))/4 = 0.475.
        close(g[a.index()].unwrap(), 1.3 / 3.0);
        close(v[a.index()], 0.475);
        // Gbar(r) = (0.475 + 1)/2 = 0.7375; Vtilde(r) = (0.5 + 2*0.7375)/3.
        close(g[r.index()].unwrap(), 0.7375);
        close(v[r.index()], 1.975 / 3.0);
        for x in [t1, t2, b] {
            assert_eq!((g[x.index()], v[x.index()]), (None, 0.0));
        }
        close(v[c.index()], 0.3);
        assert_eq!(cr.backup.critic_targets().len(), 2);
        // lambda = 0: A = delta.
        close(cr.edge[a.index()].unwrap(), 0.475 - 1.975 / 3.0);
        close(cr.edge[b.index()].unwrap(), 1.0 - 1.975 / 3.0);
        close(cr.edge[t1.index()].unwrap(), -0.475);
        close(cr.edge[t2.index()].unwrap(), 0.525);
        close(cr.edge[c.index()].unwrap(), -0.175);
        assert_eq!(cr.edge[r.index()], None);
        // lambda = 0.5: A(r->a) = delta + 0.5 * mean(-0.475, 0.525, -0.175).
        let cfg = CreditConfig {
            lambda: 0.5,
            ..CreditConfig::default()
        };
        let cr = focus_credit(&t, &cfg).unwrap();
        close(
            cr.edge[a.index()].unwrap(),
            0.475 - 1.975 / 3.0 + 0.5 * (-0.125 / 3.0),
        );
        // gamma = 0.5, kappa = 0: Vtilde(a) = Gbar(a) = (0 + 1 + 0.5*0.3)/3.
        let cfg = CreditConfig {
            gamma: 0.5,
            kappa: 0.0,
            lambda: 0.0,
        };
        let cr = focus_credit(&t, &cfg).unwrap();
        close(cr.backup.vtilde[a.index()], 1.15 / 3.0);
        close(cr.backup.vtilde[r.index()], (0.5 * 1.15 / 3.0 + 1.0) / 2.0);
    }

    #[test]
    fn missing_value_is_named() {
        let mut t = RolloutTree::new();
        let r = t.add_episode("t", vec![], Some(0.5)).unwrap();
        let x = t.add_path(r, vec![step(1)]).unwrap()[0];
        assert_eq!(
            backup(&t, &CreditConfig::default()),
            Err(RlError::MissingValue(x))
        );
        let bad = CreditConfig {
            gamma: 1.5,
            ..CreditConfig::default()
        };
        assert!(matches!(
            backup(&t, &bad),
            Err(RlError::Config { field: "gamma", .. })
        ));
    }

    #[test]
    fn loss_rows_mask_and_share() {
        let (mut t, [r, a, ..]) = hand_tree();
        // An edge with an observation and a replayed run: only Action tokens train.
        let mut seg = Segment::new();
        seg.push(TokenKind::Replayed, &[5, 5], None).unwrap();
        seg.push(TokenKind::Action, &[6], Some(&[-0.7])).unwrap();
        seg.push(TokenKind::Observation, &[7], None).unwrap();
        let d = t.add_path(a, vec![Step::new(seg).terminal(1.0)]).unwrap()[0];
        let cr = focus_credit(&t, &CreditConfig::default()).unwrap();
        let rows = loss_rows(&t, &cr.tokens, Some(&cr.backup.gbar), Sharing::Once).unwrap();
        assert_eq!(rows.len(), 5);
        let row = rows.iter().find(|x| x.leaf == d).unwrap();
        let span = t.node(d).unwrap().span();
        assert_eq!(&row.mask[span.clone()], &[0.0, 0.0, 1.0, 0.0]);
        assert_eq!(row.behaviour_logprobs[span.start + 2], -0.7);
        assert_eq!(
            row.advantages[span.start + 2],
            cr.edge[d.index()].unwrap() as f32
        );
        assert_eq!(&row.mask[..2], &[0.0, 0.0], "prompt is masked");
        // Each edge is trained exactly once over all rows with Sharing::Once.
        let trained: f32 = rows.iter().map(|x| x.mask.iter().sum::<f32>()).sum();
        let expected: usize = t
            .nodes()
            .filter_map(|(_, n)| n.segment())
            .map(super::super::tree::Segment::generated_tokens)
            .sum();
        assert_eq!(trained as usize, expected);
        let targets: usize = rows.iter().map(|x| x.value_targets.len()).sum();
        assert_eq!(targets, 2);
        let root_target = rows
            .iter()
            .flat_map(|x| &x.value_targets)
            .find(|p| p.0 == 1)
            .unwrap();
        assert_eq!(root_target.1, cr.backup.gbar[r.index()].unwrap() as f32);
        let every = loss_rows(&t, &cr.tokens, None, Sharing::EveryPath).unwrap();
        let trained_every: f32 = every.iter().map(|x| x.mask.iter().sum::<f32>()).sum();
        assert!(trained_every > trained);
        // Every row carries the behaviour logprob of every policy token on
        // its path, trained in that row or not: the state's context's.
        for x in &rows {
            assert_eq!(x.behaviour_logprobs, t.path_logprobs(x.leaf).unwrap());
            assert!(x.history_logprobs.is_empty(), "no restart here");
        }
        assert!(
            rows.iter().any(|x| x
                .mask
                .iter()
                .zip(&x.behaviour_logprobs)
                .any(|(&m, &l)| m == 0.0 && l != 0.0)),
            "a policy token another row trains keeps its logprob"
        );
    }

    #[test]
    fn loss_rows_split_at_context_restarts() {
        // prompt [9, 9] -> a: act [1, 2] obs [3] -> b: summary [4, 5],
        // restart context [6, 7] -> {c: act [8], R=1; d: act [2], R=0}.
        let mut t = RolloutTree::new();
        let r = t.add_episode("t", vec![9, 9], Some(0.5)).unwrap();
        let mut sa = Segment::new();
        sa.push(TokenKind::Action, &[1, 2], Some(&[-0.1, -0.2]))
            .unwrap();
        sa.push(TokenKind::Observation, &[3], None).unwrap();
        let mut sb = Segment::new();
        sb.push(TokenKind::ContextManagement, &[4, 5], Some(&[-0.4, -0.5]))
            .unwrap();
        sb.push(TokenKind::Observation, &[6, 7], None).unwrap();
        let sb = sb.restarting();
        let mut sc = Segment::new();
        sc.push(TokenKind::Action, &[8], Some(&[-0.8])).unwrap();
        let ids = t
            .add_path(
                r,
                vec![
                    Step::new(sa).value(0.5),
                    Step::new(sb).value(0.6),
                    Step::new(sc).terminal(1.0),
                ],
            )
            .unwrap();
        let (a, b, c) = (ids[0], ids[1], ids[2]);
        let d = t.add_path(b, vec![step(1).terminal(0.0)]).unwrap()[0];
        assert_eq!(t.context_tokens(a).unwrap(), vec![9, 9, 1, 2, 3]);
        assert_eq!(t.context_tokens(b).unwrap(), vec![6, 7]);
        assert_eq!(t.context_tokens(c).unwrap(), vec![6, 7, 8]);
        assert_eq!(t.node(b).unwrap().span(), 5..7);
        assert_eq!(t.node(c).unwrap().span(), 2..3);
        t.validate().unwrap();
        let cr = focus_credit(&t, &CreditConfig::default()).unwrap();
        let rows = loss_rows(&t, &cr.tokens, Some(&cr.backup.gbar), Sharing::Once).unwrap();
        // c's path: the window before the restart (trains a and the
        // summary) and the one after; d's path shares both windows' edges
        // with c, so only its own window after the restart is a row.
        assert_eq!(rows.len(), 3);
        let (w0, w1, w2) = (&rows[0], &rows[1], &rows[2]);
        assert_eq!((w0.leaf, w1.leaf, w2.leaf), (c, c, d));
        assert_eq!(w0.tokens, vec![9, 9, 1, 2, 3, 4, 5]);
        assert_eq!(w0.mask, vec![0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0]);
        assert_eq!(w0.behaviour_logprobs[5..], [-0.4, -0.5]);
        let adv_b = cr.edge[b.index()].unwrap() as f32;
        assert_eq!(w0.advantages[5..], [adv_b, adv_b]);
        assert_eq!(w1.tokens, vec![6, 7, 8]);
        assert_eq!(w1.mask, vec![0.0, 0.0, 1.0]);
        assert_eq!(w2.tokens, vec![6, 7, 0]);
        assert_eq!(w2.mask, vec![0.0, 0.0, 1.0]);
        // A window after the restart keeps the path's logprobs before it
        // (the first window's, summary included); history and window
        // together are the path's.
        assert!(w0.history_logprobs.is_empty());
        let before = vec![0.0, 0.0, -0.1, -0.2, 0.0, -0.4, -0.5];
        assert_eq!(w1.history_logprobs, before);
        assert_eq!(w2.history_logprobs, before);
        for w in [w1, w2] {
            let mut path = w.history_logprobs.clone();
            path.extend_from_slice(&w.behaviour_logprobs);
            assert_eq!(path, t.path_logprobs(w.leaf).unwrap());
        }
        // Targets at the end of each state's own context: r and a in the
        // first window, b (the post-compaction state) in the second.
        let gb = |n: NodeId| cr.backup.gbar[n.index()].unwrap() as f32;
        assert_eq!(w0.value_targets, vec![(1, gb(r)), (4, gb(a))]);
        assert_eq!(w1.value_targets, vec![(1, gb(b))]);
        assert!(w2.value_targets.is_empty());
        // Values back up through the compaction: Gbar(b) averages c and d.
        assert!((cr.backup.gbar[b.index()].unwrap() - 0.5).abs() < 1e-12);
    }

    #[test]
    fn loss_rows_carry_the_path_through_two_restarts() {
        // prompt [9] -> a: act [1] obs [2] -> b: summary [3], restart [4]
        // -> c: act [5] obs [6] -> d: summary [7], restart [8] -> e: act
        // [10], R=1.
        let restart = |summary: u32, lp: f32, context: u32| {
            let mut s = Segment::new();
            s.push(TokenKind::ContextManagement, &[summary], Some(&[lp]))
                .unwrap();
            s.push(TokenKind::Observation, &[context], None).unwrap();
            s.restarting()
        };
        let act = |a: u32, lp: f32, obs: u32| {
            let mut s = Segment::new();
            s.push(TokenKind::Action, &[a], Some(&[lp])).unwrap();
            s.push(TokenKind::Observation, &[obs], None).unwrap();
            s
        };
        let mut t = RolloutTree::new();
        let r = t.add_episode("t", vec![9], Some(0.5)).unwrap();
        let mut last = Segment::new();
        last.push(TokenKind::Action, &[10], Some(&[-1.0])).unwrap();
        let ids = t
            .add_path(
                r,
                vec![
                    Step::new(act(1, -0.1, 2)).value(0.5),
                    Step::new(restart(3, -0.3, 4)).value(0.5),
                    Step::new(act(5, -0.5, 6)).value(0.5),
                    Step::new(restart(7, -0.7, 8)).value(0.5),
                    Step::new(last).terminal(1.0),
                ],
            )
            .unwrap();
        t.validate().unwrap();
        let e = ids[4];
        let cr = focus_credit(&t, &CreditConfig::default()).unwrap();
        let rows = loss_rows(&t, &cr.tokens, Some(&cr.backup.gbar), Sharing::Once).unwrap();
        let tokens: Vec<&[u32]> = rows.iter().map(|w| w.tokens.as_slice()).collect();
        assert_eq!(tokens, [&[9, 1, 2, 3][..], &[4, 5, 6, 7], &[8, 10]]);
        assert!(rows.iter().all(|w| w.leaf == e));
        // Each window's history is everything on the path before it, so
        // history and window together are the path up to the window's end.
        let path = t.path_logprobs(e).unwrap();
        assert_eq!(
            path,
            vec![0.0, -0.1, 0.0, -0.3, 0.0, -0.5, 0.0, -0.7, 0.0, -1.0]
        );
        let mut seen = 0;
        for w in &rows {
            assert_eq!(w.history_logprobs, path[..seen]);
            seen += w.tokens.len();
            let mut joined = w.history_logprobs.clone();
            joined.extend_from_slice(&w.behaviour_logprobs);
            assert_eq!(joined, path[..seen]);
        }
        assert_eq!(seen, path.len());
    }

    /// A random tree: node i > 0 hangs under a random earlier non-terminal
    /// node; leaves are terminal with reward bits or truncated.
    fn random_tree(
        parents: &[usize],
        bits: &[bool],
        values: &[f64],
        rewards: &[f64],
    ) -> RolloutTree {
        let mut t = RolloutTree::new();
        let root = t.add_episode("t", vec![1], Some(values[0])).unwrap();
        let mut ids = vec![root];
        for (i, &p) in parents.iter().enumerate() {
            let parent = ids[p % ids.len()];
            let seg = Segment::policy(&[1], &[-0.1])
                .unwrap()
                .with_reward(rewards[i]);
            let id = t
                .add_path(parent, vec![Step::new(seg).value(values[i + 1])])
                .unwrap()[0];
            ids.push(id);
        }
        // Close some leaves with terminal outcomes.
        for (k, leaf) in t.leaves().into_iter().enumerate() {
            if bits[k % bits.len()] {
                t.add_path(leaf, vec![step(1).terminal((k % 2) as f64)])
                    .unwrap();
            }
        }
        t
    }

    /// Direct sum: A(e) = E over uniform descent of sum_k (gamma*lambda)^k delta_{t+k}.
    fn direct(t: &RolloutTree, vals: &[f64], id: NodeId, gamma: f64, lambda: f64) -> f64 {
        let delta = |c: NodeId| {
            let p = t.node(c).unwrap().parent().unwrap();
            t.edge_reward(c).unwrap() + gamma * vals[c.index()] - vals[p.index()]
        };
        // Enumerate every path below id with its probability.
        let mut total = 0.0;
        let mut stack = vec![(id, 1.0, 0usize, 0.0)];
        while let Some((c, prob, k, acc)) = stack.pop() {
            let acc = acc + (gamma * lambda).powi(k as i32) * delta(c);
            let ch = t.node(c).unwrap().children();
            if ch.is_empty() {
                total += prob * acc;
            }
            for &x in ch {
                stack.push((x, prob / ch.len() as f64, k + 1, acc));
            }
        }
        total
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        #[test]
        fn td_lambda_equals_direct_sum(
            parents in prop::collection::vec(any::<usize>(), 1..14),
            bits in prop::collection::vec(any::<bool>(), 1..5),
            values in prop::collection::vec(0.0f64..1.0, 15),
            rewards in prop::collection::vec(-0.2f64..0.2, 14),
            gamma in 0.5f64..1.0,
            lambda in 0.0f64..1.0,
        ) {
            let t = random_tree(&parents, &bits, &values, &rewards);
            let cfg = CreditConfig { gamma, lambda, kappa: 1.0 };
            let b = backup(&t, &cfg).unwrap();
            let adv = td_advantages(&t, &b.vtilde, gamma, lambda).unwrap();
            for (id, n) in t.nodes() {
                if n.parent().is_some() {
                    let want = direct(&t, &b.vtilde, id, gamma, lambda);
                    prop_assert!((adv[id.index()].unwrap() - want).abs() < 1e-10);
                }
            }
        }
    }

    #[test]
    fn td_lambda_on_a_chain_is_the_plain_sum() {
        let mut t = RolloutTree::new();
        let r = t.add_episode("t", vec![1], Some(0.2)).unwrap();
        let vals = [0.2, 0.7, 0.4, 0.9];
        let ids = t
            .add_path(
                r,
                vec![
                    step(1).value(vals[1]),
                    step(1).value(vals[2]),
                    step(1).value(vals[3]),
                    step(1).terminal(1.0),
                ],
            )
            .unwrap();
        let v: Vec<f64> = vals.iter().copied().chain([0.0]).collect();
        let (g, l) = (0.9, 0.8);
        let adv = td_advantages(&t, &v, g, l).unwrap();
        let deltas: Vec<f64> = (0..4)
            .map(|k| {
                let rwd = if k == 3 { 1.0 } else { 0.0 };
                rwd + g * v[k + 1] - v[k]
            })
            .collect();
        for (k, id) in ids.iter().enumerate() {
            let want: f64 = (k..4)
                .map(|j| (g * l).powi((j - k) as i32) * deltas[j])
                .sum();
            assert!((adv[id.index()].unwrap() - want).abs() < 1e-12);
        }
        assert!(td_advantages(&t, &v[..3], g, l).is_err());
    }
}
