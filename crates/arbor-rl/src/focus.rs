//! FOCUS allocation: spend the rollout budget where one more continuation is
//! expected to shrink the critic's error the most.
//!
//! For a node `c` with critic prediction `v = V_phi(c)` (clamped to
//! `[0, 1]`), `n` completed outcomes with mean `cbar` (which ones:
//! [`Evidence`], below), and `m` continuations in flight from it, the value of `c` gets the Beta prior
//! `Beta(kappa*v, kappa*(1-v))` and, after the `n` Bernoulli outcomes,
//!
//! ```text
//! alpha = kappa*v + n*cbar,   beta = kappa*(1-v) + n*(1-cbar),   a = alpha + beta = kappa + n
//! mu    = (kappa*v + n*cbar) / (kappa + n)               posterior mean
//! E     = mu*(1-mu) / (a + 1)                            posterior variance (expected sq. error)
//! g     = mu*(1-mu) / (a + 1)^2                          expected decrease of E by one more outcome
//! ```
//!
//! `g` is exact: by the law of total variance the expected posterior
//! variance after one more outcome `X ~ Bernoulli(mu)` is
//! `E - Var(mu')`, and `mu' - mu` is `(1-mu)/(a+1)` or `-mu/(a+1)`, so
//! `Var(mu') = mu*(1-mu)/(a+1)^2` (checked against brute-force enumeration
//! and numerical integration over the prior in the tests).
//!
//! Async execution: outcomes in flight will arrive, so the spec uses the
//! effective count `a = kappa + n + m` in `g` (mu uses only completed
//! outcomes): `g_eff = mu*(1-mu) / (kappa + n + m + 1)^2`. That is exact
//! for `m = 0` and a heuristic for `m > 0`: the exact expected gain of one
//! more outcome *after* the `m` pending ones have arrived is
//!
//! ```text
//! g_look = mu*(1-mu) * a / ((a+1) * (a+m) * (a+m+1))          (a = kappa + n)
//! ```
//!
//! and `g_look / g_eff = a*(a+m+1) / ((a+1)*(a+m))` lies in `(a/(a+1), 1]`:
//! the spec's form slightly over-scores busy nodes. Both are available
//! ([`AsyncGain`]); the default follows the spec.
//!
//! Which outcomes count in `n` ([`Evidence`], project choice): the spec says
//! "completed continuations observed below c". The default reads this as the
//! *on-policy* outcomes of `c` (continuations launched at `c` or above it
//! that passed through `c`; see [`crate::tree`]): they are Bernoulli draws
//! of `c`'s value, so the Beta update is a true posterior, they are exactly
//! the continuations whose in-flight count is `m` (so `n + m` is the count
//! once the pending ones land), and the spec's own credit section warns that
//! leaves below `c` reached through branching elsewhere are not on-policy
//! samples from `c`. The literal reading, every terminal outcome in the
//! subtree, is [`Evidence::Subtree`] (compared in `arbor bench audit`).
//!
//! Selection ([`Allocator`]): candidates are non-terminal, resumable nodes
//! with a positive score and fewer than `max_in_flight_per_node` (2)
//! continuations in flight; at most `worker_capacity` continuations run over
//! the whole tree; the candidate with the largest score is launched until the
//! budget (continuations or generated tokens) is spent. Exact ties are broken
//! uniformly at random by a seeded RNG. The ablation selectors ([`Uniform`],
//! [`RandomSelect`], [`RawResidual`]) plug into the same allocator through
//! the [`Selector`] trait.

use std::collections::BTreeMap;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::error::{check_positive, Result, RlError};
use crate::tree::{Node, NodeId, RolloutTree, Step, Ticket};

/// Beta posterior of a node's success probability.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Posterior {
    /// Posterior mean `mu = (kappa*v + n*cbar) / (kappa + n)`.
    pub mu: f64,
    /// Total pseudo-count `a = alpha + beta = kappa + n`.
    pub a: f64,
}

impl Posterior {
    /// Posterior after `n` outcomes summing to `sum = n*cbar`, under the
    /// prior `Beta(kappa*v, kappa*(1-v))` with `v` clamped to `[0, 1]`.
    /// Needs `kappa > 0` or `n > 0` (otherwise `mu` is undefined and
    /// `mu = v` is returned).
    pub fn new(kappa: f64, v: f64, n: f64, sum: f64) -> Self {
        let v = v.clamp(0.0, 1.0);
        let a = kappa + n;
        let mu = if a > 0.0 {
            ((kappa * v + sum) / a).clamp(0.0, 1.0)
        } else {
            v
        };
        Posterior { mu, a }
    }

    /// Posterior of a tree node (`None` if the critic has not scored it).
    pub fn of(node: &Node, kappa: f64, evidence: Evidence) -> Option<Self> {
        let v = node.value()?;
        let (n, sum) = match evidence {
            Evidence::OnPolicy => (node.completed(), node.reward_sum()),
            Evidence::Subtree => (node.subtree_completed(), node.subtree_reward_sum()),
        };
        Some(Posterior::new(kappa, v, f64::from(n), sum))
    }

    /// `E = mu*(1-mu)/(a+1)`: posterior variance, the expected squared error
    /// of `mu` as an estimate of the node's value.
    pub fn variance(&self) -> f64 {
        self.mu * (1.0 - self.mu) / (self.a + 1.0)
    }

    /// Spec form with `m` continuations in flight:
    /// `g = mu*(1-mu) / (a + m + 1)^2`.
    pub fn gain(&self, m: f64) -> f64 {
        let d = self.a + m + 1.0;
        self.mu * (1.0 - self.mu) / (d * d)
    }

    /// Exact expected variance decrease of one outcome after `m` pending
    /// ones: `mu*(1-mu)*a / ((a+1)(a+m)(a+m+1))` (equals [`Self::gain`] at
    /// `m = 0`).
    pub fn gain_lookahead(&self, m: f64) -> f64 {
        let a = self.a;
        if a + m <= 0.0 {
            return self.gain(m);
        }
        self.mu * (1.0 - self.mu) * a / ((a + 1.0) * (a + m) * (a + m + 1.0))
    }
}

/// How FOCUS accounts for continuations still in flight.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AsyncGain {
    /// The spec: `a = kappa + n + m` in `g`.
    #[default]
    EffectiveCount,
    /// The exact expectation after the pending outcomes arrive.
    Lookahead,
}

/// Which terminal outcomes form a node's evidence `n`, `cbar`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Evidence {
    /// Continuations through the node launched at it or above it.
    #[default]
    OnPolicy,
    /// Every terminal outcome in the node's subtree.
    Subtree,
}

/// A scoring rule for the allocator: higher priority is launched first.
pub trait Selector {
    /// Short name for reports.
    fn name(&self) -> &'static str;
    /// Priority of one more continuation from `node` (already known to be
    /// non-terminal, resumable and under its in-flight cap). `None` (or a
    /// NaN) excludes the node.
    fn priority(&mut self, id: NodeId, node: &Node, rng: &mut StdRng) -> Option<f64>;
    /// Called once before each pick with the whole tree (selectors whose
    /// score depends on a node's ancestors precompute it here).
    fn prepare(&mut self, _tree: &RolloutTree) {}
}

impl<S: Selector + ?Sized> Selector for Box<S> {
    fn name(&self) -> &'static str {
        (**self).name()
    }
    fn prepare(&mut self, tree: &RolloutTree) {
        (**self).prepare(tree);
    }
    fn priority(&mut self, id: NodeId, node: &Node, rng: &mut StdRng) -> Option<f64> {
        (**self).priority(id, node, rng)
    }
}

/// Variants of FOCUS's score, each an option beside the spec's `g`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Score {
    /// The spec: `g = mu*(1-mu) / (a + m + 1)^2`.
    #[default]
    Spec,
    /// `g` plus the expected shrinkage of the critic's bias: with the
    /// bias estimated from the evidence, `b = cbar - v` (`n > 0`), the
    /// prior's share of the squared error is `kappa^2 b^2 / (kappa + n)^2`,
    /// and one more outcome removes
    /// `kappa^2 b^2 * (1/(kappa+n_eff)^2 - 1/(kappa+n_eff+1)^2)`.
    /// A confident but wrong critic no longer starves its state.
    Bias,
    /// `g` times `1 + sum over ancestors a of w(a, c)^2`, where
    /// `w(a, c) = prod over the path a .. parent(c) of 1/(kappa + |C(x)|)`
    /// is `c`'s weight in `Vtilde(a)` (Eq. 1): one more outcome at `c`
    /// also cuts the variance of every ancestor's backed-up value.
    Propagated,
}

impl Score {
    /// Report name.
    pub fn name(self) -> &'static str {
        match self {
            Score::Spec => "spec",
            Score::Bias => "bias",
            Score::Propagated => "propagated",
        }
    }
}

/// FOCUS: priority `g` (see the module docs); candidates need `g > 0` and a
/// critic value.
#[derive(Clone, Debug, PartialEq)]
pub struct Focus {
    kappa: f64,
    async_gain: AsyncGain,
    evidence: Evidence,
    score: Score,
    /// Skip states whose subtree has at least this many outcomes, all
    /// equal (0: never).
    prune_settled: u32,
    /// Roots with fewer continuations than this (completed and in flight)
    /// go before every other state (0: never).
    root_samples: u32,
    /// [`Score::Propagated`]: `1 + sum_a w(a, c)^2` by node index.
    factor: Vec<f64>,
    /// States below a doubted token go last (0: never; see
    /// [`Focus::with_slip_nats`]).
    slip_nats: f64,
    /// Whether each node's path holds a doubted token, by node index
    /// (extended as the tree grows).
    slipped: Vec<bool>,
}

/// The factor on a slipped state's score ([`Focus::with_slip_nats`]):
/// small enough that a state with a clean path and up to about 30 outcomes
/// still goes first.
const SLIP_FACTOR: f64 = 1e-3;

impl Focus {
    /// FOCUS with prior strength `kappa > 0` and on-policy evidence.
    pub fn new(kappa: f64, async_gain: AsyncGain) -> Result<Self> {
        check_positive("kappa", kappa)?;
        Ok(Focus {
            kappa,
            async_gain,
            evidence: Evidence::OnPolicy,
            score: Score::Spec,
            prune_settled: 0,
            root_samples: 0,
            factor: Vec::new(),
            slip_nats: 0.0,
            slipped: Vec::new(),
        })
    }

    /// Exclude *settled* states: those whose subtree already ended with at
    /// least `k` outcomes, all 0 or all 1 (`k = 0`: none are excluded; the
    /// spec has no such rule). More samples there rarely change the
    /// credit: every trajectory through them gets the same reward.
    pub fn with_prune_settled(mut self, k: u32) -> Self {
        self.prune_settled = k;
        self
    }

    /// Give every root `k` continuations before any other state (not in
    /// the spec, which treats a root as any other state): a root with
    /// fewer than `k` launched scores `1 + g` (`g <= 1/4` otherwise), so
    /// each task gets a group of samples from its start, as GRPO's, and
    /// the rest of the budget follows `g`.
    pub fn with_root_samples(mut self, k: u32) -> Self {
        self.root_samples = k;
        self
    }

    /// Launch last from states below a token the policy doubted (not in
    /// the spec): a state whose path from its root (through compactions)
    /// holds a trained token sampled at a behaviour logprob below
    /// `-c` nats has its score multiplied by 1e-3, so it is launched from
    /// only when the states with clean paths have little left to gain
    /// (`c = 0`: off). Where a wrong step cannot be undone (a slipped
    /// running sum), every continuation below the slip fails whatever it
    /// does, and the critic rarely knows it; the slip is usually a token
    /// the policy sampled against its own odds, and its parent state,
    /// whose path is clean, is where a continuation re-decides it.
    pub fn with_slip_nats(mut self, c: f64) -> Self {
        self.slip_nats = c.max(0.0);
        self.slipped.clear();
        self
    }

    /// Chooses the score variant.
    pub fn with_score(mut self, score: Score) -> Self {
        self.score = score;
        self
    }

    /// Chooses which outcomes count as evidence.
    pub fn with_evidence(mut self, evidence: Evidence) -> Self {
        self.evidence = evidence;
        self
    }

    /// The spec's score `g` of a node (`None` without a critic value).
    pub fn score(&self, node: &Node) -> Option<f64> {
        let post = Posterior::of(node, self.kappa, self.evidence)?;
        let m = f64::from(node.in_flight());
        Some(match self.async_gain {
            AsyncGain::EffectiveCount => post.gain(m),
            AsyncGain::Lookahead => post.gain_lookahead(m),
        })
    }

    /// The score of node `id` under the configured variant (`None` for a
    /// pruned settled state).
    pub fn variant_score(&self, id: NodeId, node: &Node) -> Option<f64> {
        let k = node.subtree_completed();
        if self.prune_settled > 0 && k >= self.prune_settled {
            let sum = node.subtree_reward_sum();
            if sum == 0.0 || sum == f64::from(k) {
                return None;
            }
        }
        let g = self.score(node)?;
        if node.parent().is_none() && node.completed() + node.in_flight() < self.root_samples {
            return Some(1.0 + g);
        }
        Some(match self.score {
            Score::Spec => g,
            Score::Bias => {
                let (n, sum) = match self.evidence {
                    Evidence::OnPolicy => (node.completed(), node.reward_sum()),
                    Evidence::Subtree => (node.subtree_completed(), node.subtree_reward_sum()),
                };
                if n == 0 {
                    g
                } else {
                    let v = node.value()?.clamp(0.0, 1.0);
                    let b = sum / f64::from(n) - v;
                    let k = self.kappa;
                    let a = k + f64::from(n + node.in_flight());
                    g + k * k * b * b * (1.0 / (a * a) - 1.0 / ((a + 1.0) * (a + 1.0)))
                }
            }
            Score::Propagated => g * self.factor.get(id.index()).copied().unwrap_or(1.0),
        })
    }

    /// [`SLIP_FACTOR`] for a state below a doubted token (as marked by the
    /// last [`Selector::prepare`]), else 1.
    fn slip_factor(&self, id: NodeId) -> f64 {
        if self.slipped.get(id.index()).copied().unwrap_or(false) {
            SLIP_FACTOR
        } else {
            1.0
        }
    }

    /// Extends [`Focus::slipped`] to the nodes added since the last call
    /// (nodes are only appended, parents before children; a smaller tree
    /// is a new one).
    fn mark_slips(&mut self, tree: &RolloutTree) {
        if self.slipped.len() > tree.len() {
            self.slipped.clear();
        }
        let c = -self.slip_nats as f32;
        for (id, node) in tree.nodes().skip(self.slipped.len()) {
            let above = node
                .parent()
                .and_then(|p| self.slipped.get(p.index()).copied())
                .unwrap_or(false);
            let here = node.segment().is_some_and(|seg| {
                seg.kinds
                    .iter()
                    .zip(&seg.logprobs)
                    .any(|(k, &lp)| k.is_trained() && lp < c)
            });
            debug_assert_eq!(id.index(), self.slipped.len());
            self.slipped.push(above || here);
        }
    }
}

impl Selector for Focus {
    fn name(&self) -> &'static str {
        match (self.score, self.evidence) {
            (Score::Spec, Evidence::OnPolicy) => "focus",
            (Score::Spec, Evidence::Subtree) => "focus_subtree",
            (Score::Bias, _) => "focus_bias",
            (Score::Propagated, _) => "focus_propagated",
        }
    }
    fn prepare(&mut self, tree: &RolloutTree) {
        if self.slip_nats > 0.0 {
            self.mark_slips(tree);
        }
        if self.score != Score::Propagated {
            return;
        }
        // Parents come before their children in node order.
        self.factor.clear();
        self.factor.resize(tree.len(), 1.0);
        let mut sum = vec![0.0f64; tree.len()];
        for (id, node) in tree.nodes() {
            if let Some(p) = node.parent() {
                let parent = tree.node(p).map(|n| n.children().len()).unwrap_or(1);
                let w = 1.0 / (self.kappa + parent as f64);
                sum[id.index()] = (sum[p.index()] + 1.0) * w * w;
            }
            self.factor[id.index()] = 1.0 + sum[id.index()];
        }
    }
    fn priority(&mut self, id: NodeId, node: &Node, _: &mut StdRng) -> Option<f64> {
        self.variant_score(id, node)
            .map(|g| g * self.slip_factor(id))
            .filter(|g| *g > 0.0)
    }
}

/// Ablation: spread the budget evenly; priority `-(n + m)` (the node with
/// the least on-policy evidence, completed or pending, goes first; ties at
/// random).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Uniform;

impl Selector for Uniform {
    fn name(&self) -> &'static str {
        "uniform"
    }
    fn priority(&mut self, _: NodeId, node: &Node, _: &mut StdRng) -> Option<f64> {
        Some(-f64::from(node.completed() + node.in_flight()))
    }
}

/// Ablation: a uniformly random candidate each time.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RandomSelect;

impl Selector for RandomSelect {
    fn name(&self) -> &'static str {
        "random"
    }
    fn priority(&mut self, _: NodeId, _: &Node, rng: &mut StdRng) -> Option<f64> {
        Some(rng.random::<f64>())
    }
}

/// Ablation: the critic's raw residual `|cbar - v|` (on-policy `cbar`) as
/// the score, without the posterior's calibration for evidence size. With no outcome yet
/// (`n = 0`) the residual is undefined; the score is then the expected
/// residual of one outcome under the critic's own prediction,
/// `E|X - v| = 2*v*(1-v)` for `X ~ Bernoulli(v)` (project choice).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RawResidual;

impl Selector for RawResidual {
    fn name(&self) -> &'static str {
        "raw_residual"
    }
    fn priority(&mut self, _: NodeId, node: &Node, _: &mut StdRng) -> Option<f64> {
        let v = node.value()?.clamp(0.0, 1.0);
        Some(match node.outcome_mean() {
            Some(cbar) => (cbar - v).abs(),
            None => 2.0 * v * (1.0 - v),
        })
    }
}

/// The selectors of the audit ablation, by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SelectorKind {
    Focus,
    Random,
    Uniform,
    RawResidual,
    /// FOCUS with [`Evidence::Subtree`] (the literal reading of the spec).
    FocusSubtree,
    /// FOCUS with [`Score::Bias`].
    FocusBias,
    /// FOCUS with [`Score::Propagated`].
    FocusPropagated,
}

impl SelectorKind {
    /// All of them, FOCUS first.
    pub const ALL: [SelectorKind; 7] = [
        SelectorKind::Focus,
        SelectorKind::Random,
        SelectorKind::Uniform,
        SelectorKind::RawResidual,
        SelectorKind::FocusSubtree,
        SelectorKind::FocusBias,
        SelectorKind::FocusPropagated,
    ];

    /// The selector (FOCUS with prior strength `kappa`, spec async form).
    pub fn build(self, kappa: f64) -> Result<Box<dyn Selector>> {
        Ok(match self {
            SelectorKind::Focus => Box::new(Focus::new(kappa, AsyncGain::EffectiveCount)?),
            SelectorKind::Random => Box::new(RandomSelect),
            SelectorKind::Uniform => Box::new(Uniform),
            SelectorKind::RawResidual => Box::new(RawResidual),
            SelectorKind::FocusSubtree => Box::new(
                Focus::new(kappa, AsyncGain::EffectiveCount)?.with_evidence(Evidence::Subtree),
            ),
            SelectorKind::FocusBias => {
                Box::new(Focus::new(kappa, AsyncGain::EffectiveCount)?.with_score(Score::Bias))
            }
            SelectorKind::FocusPropagated => Box::new(
                Focus::new(kappa, AsyncGain::EffectiveCount)?.with_score(Score::Propagated),
            ),
        })
    }

    /// Report name.
    pub fn name(self) -> &'static str {
        match self {
            SelectorKind::Focus => "focus",
            SelectorKind::Random => "random",
            SelectorKind::Uniform => "uniform",
            SelectorKind::RawResidual => "raw_residual",
            SelectorKind::FocusSubtree => "focus_subtree",
            SelectorKind::FocusBias => "focus_bias",
            SelectorKind::FocusPropagated => "focus_propagated",
        }
    }
}

/// A step's generation budget, matched to the baselines' budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Budget {
    /// At most this many continuations launched.
    Continuations(u64),
    /// At most `total` generated (policy) tokens. Every launch reserves
    /// `max_per_continuation` (the harness's generation cap) until it
    /// completes and is charged what it actually generated, so the total
    /// can never be exceeded.
    Tokens {
        total: u64,
        max_per_continuation: u64,
    },
}

/// Allocator settings.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct AllocatorConfig {
    /// Cap on continuations in flight from one node (spec: 2).
    pub max_in_flight_per_node: u32,
    /// Cap on continuations in flight over the tree (rollout workers).
    pub worker_capacity: u32,
    pub budget: Budget,
    /// Seed of the tie-breaking (and random-selector) RNG.
    pub seed: u64,
}

impl AllocatorConfig {
    /// Spec defaults: 2 per node, the given worker capacity and budget.
    pub fn new(worker_capacity: u32, budget: Budget, seed: u64) -> Self {
        AllocatorConfig {
            max_in_flight_per_node: 2,
            worker_capacity,
            budget,
            seed,
        }
    }

    fn validate(&self) -> Result<()> {
        if self.max_in_flight_per_node == 0 {
            return Err(RlError::config("max_in_flight_per_node", "must be >= 1"));
        }
        if self.worker_capacity == 0 {
            return Err(RlError::config("worker_capacity", "must be >= 1"));
        }
        if let Budget::Tokens {
            max_per_continuation: 0,
            ..
        } = self.budget
        {
            return Err(RlError::config(
                "budget.max_per_continuation",
                "must be >= 1",
            ));
        }
        Ok(())
    }
}

/// What the allocator has spent so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Spend {
    pub launched: u64,
    pub completed: u64,
    pub aborted: u64,
    /// Generated tokens of finished (completed or aborted) continuations.
    pub tokens_charged: u64,
    /// Tokens reserved by continuations in flight (token budgets only).
    pub tokens_reserved: u64,
}

/// The launch loop: picks the highest-priority candidate under the caps
/// until the budget is spent. Works with any [`Selector`].
pub struct Allocator<S: Selector> {
    cfg: AllocatorConfig,
    selector: S,
    rng: StdRng,
    spend: Spend,
    /// Ticket id -> tokens reserved, for this allocator's launches.
    reserved: BTreeMap<u64, u64>,
    /// The priority the last launch was chosen with.
    last_priority: Option<f64>,
}

impl<S: Selector> std::fmt::Debug for Allocator<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Allocator")
            .field("selector", &self.selector.name())
            .field("cfg", &self.cfg)
            .field("spend", &self.spend)
            .finish()
    }
}

impl<S: Selector> Allocator<S> {
    /// A fresh allocator for one step.
    pub fn new(cfg: AllocatorConfig, selector: S) -> Result<Self> {
        cfg.validate()?;
        Ok(Allocator {
            rng: StdRng::seed_from_u64(cfg.seed),
            cfg,
            selector,
            spend: Spend::default(),
            reserved: BTreeMap::new(),
            last_priority: None,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &AllocatorConfig {
        &self.cfg
    }

    /// Spending so far.
    pub fn spend(&self) -> Spend {
        self.spend
    }

    fn reservation(&self) -> u64 {
        match self.cfg.budget {
            Budget::Continuations(_) => 0,
            Budget::Tokens {
                max_per_continuation,
                ..
            } => max_per_continuation,
        }
    }

    /// True while the budget allows one more launch.
    pub fn budget_allows_launch(&self) -> bool {
        match self.cfg.budget {
            Budget::Continuations(k) => self.spend.launched < k,
            Budget::Tokens {
                total,
                max_per_continuation,
            } => {
                self.spend.tokens_charged + self.spend.tokens_reserved + max_per_continuation
                    <= total
            }
        }
    }

    /// True when nothing more can be launched and nothing of ours is in
    /// flight: the step's generation is over.
    pub fn is_done(&self) -> bool {
        !self.budget_allows_launch() && self.reserved.is_empty()
    }

    /// The priority the last [`Allocator::launch_next`] chose its node with
    /// (for FOCUS, its score before the launch).
    pub fn last_priority(&self) -> Option<f64> {
        self.last_priority
    }

    /// The candidate that would be launched next, without launching it.
    pub fn pick(&mut self, tree: &RolloutTree) -> Option<NodeId> {
        self.best(tree).map(|(_, id)| id)
    }

    /// The candidate to launch next and its priority.
    fn best(&mut self, tree: &RolloutTree) -> Option<(f64, NodeId)> {
        if tree.in_flight() >= self.cfg.worker_capacity as usize || !self.budget_allows_launch() {
            return None;
        }
        self.selector.prepare(tree);
        let mut best: Option<(f64, NodeId)> = None;
        let mut ties = 0u32;
        for (id, node) in tree.nodes() {
            if node.is_terminal()
                || !node.is_resumable()
                || node.in_flight() >= self.cfg.max_in_flight_per_node
            {
                continue;
            }
            let Some(p) = self.selector.priority(id, node, &mut self.rng) else {
                continue;
            };
            if p.is_nan() {
                continue;
            }
            match best {
                Some((bp, _)) if p < bp => {}
                Some((bp, _)) if p == bp => {
                    ties += 1;
                    if self.rng.random_range(0..ties) == 0 {
                        best = Some((p, id));
                    }
                }
                _ => {
                    best = Some((p, id));
                    ties = 1;
                }
            }
        }
        best
    }

    /// Launches one continuation from the best candidate, if the caps and
    /// the budget allow and a candidate exists.
    pub fn launch_next(&mut self, tree: &mut RolloutTree) -> Result<Option<Ticket>> {
        let Some((priority, id)) = self.best(tree) else {
            return Ok(None);
        };
        self.last_priority = Some(priority);
        let ticket = tree.begin(id)?;
        let r = self.reservation();
        self.reserved.insert(ticket.id(), r);
        self.spend.tokens_reserved += r;
        self.spend.launched += 1;
        Ok(Some(ticket))
    }

    /// Launches until the worker capacity, the budget or the candidates run
    /// out.
    pub fn fill(&mut self, tree: &mut RolloutTree) -> Result<Vec<Ticket>> {
        let mut out = Vec::new();
        while let Some(t) = self.launch_next(tree)? {
            out.push(t);
        }
        Ok(out)
    }

    fn settle(&mut self, ticket: Ticket, generated: u64) -> Result<u64> {
        let Some(&r) = self.reserved.get(&ticket.id()) else {
            return Err(RlError::Continuation {
                ticket: ticket.id(),
                msg: "was not launched by this allocator or has already finished".into(),
            });
        };
        if matches!(self.cfg.budget, Budget::Tokens { .. }) && generated > r {
            return Err(RlError::Continuation {
                ticket: ticket.id(),
                msg: format!(
                    "generated {generated} tokens, more than the {r} reserved (max_per_continuation)"
                ),
            });
        }
        Ok(r)
    }

    fn release(&mut self, ticket: Ticket, reserved: u64, generated: u64) {
        self.reserved.remove(&ticket.id());
        self.spend.tokens_reserved -= reserved;
        self.spend.tokens_charged += generated;
    }

    /// Completes one of this allocator's continuations (see
    /// [`RolloutTree::complete`]) and charges its generated tokens.
    pub fn complete(
        &mut self,
        tree: &mut RolloutTree,
        ticket: Ticket,
        steps: Vec<Step>,
    ) -> Result<Vec<NodeId>> {
        let generated: u64 = steps
            .iter()
            .map(|s| s.segment.generated_tokens() as u64)
            .sum();
        let r = self.settle(ticket, generated)?;
        let ids = tree.complete(ticket, steps)?;
        self.release(ticket, r, generated);
        self.spend.completed += 1;
        Ok(ids)
    }

    /// Aborts one of this allocator's continuations, charging the tokens it
    /// generated before it died. The launch still counts against a
    /// continuation budget.
    pub fn abort(&mut self, tree: &mut RolloutTree, ticket: Ticket, generated: u64) -> Result<()> {
        let r = self.settle(ticket, generated)?;
        tree.abort(ticket)?;
        self.release(ticket, r, generated);
        self.spend.aborted += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tree::tests::step;
    use crate::tree::{Segment, TokenKind};
    use proptest::prelude::*;

    /// Brute force: posterior variance of Beta(alpha, beta) from the raw
    /// pseudo-counts, `alpha*beta / (a^2 (a+1))`.
    fn beta_var(alpha: f64, beta: f64) -> f64 {
        let a = alpha + beta;
        alpha * beta / (a * a * (a + 1.0))
    }

    /// Expected decrease of the posterior variance from one more outcome,
    /// after `m` pending outcomes, by enumerating every outcome sequence.
    fn brute_force_gain(alpha: f64, beta: f64, m: u32) -> f64 {
        fn rec(alpha: f64, beta: f64, left: u32) -> f64 {
            // Returns E[variance now - variance after one more outcome]
            // averaged over the `left` pending outcomes first.
            let p = alpha / (alpha + beta);
            if left == 0 {
                let after =
                    p * beta_var(alpha + 1.0, beta) + (1.0 - p) * beta_var(alpha, beta + 1.0);
                return beta_var(alpha, beta) - after;
            }
            p * rec(alpha + 1.0, beta, left - 1) + (1.0 - p) * rec(alpha, beta + 1.0, left - 1)
        }
        rec(alpha, beta, m)
    }

    #[test]
    fn gain_matches_brute_force_over_next_outcome() {
        for &kappa in &[0.5, 1.0, 4.0] {
            for &v in &[0.05, 0.3, 0.5, 0.9] {
                for &(n, sum) in &[(0.0, 0.0), (1.0, 1.0), (3.0, 1.0), (10.0, 7.0)] {
                    let post = Posterior::new(kappa, v, n, sum);
                    let alpha = kappa * v + sum;
                    let beta = kappa * (1.0 - v) + n - sum;
                    assert!((post.variance() - beta_var(alpha, beta)).abs() < 1e-14);
                    let bf = brute_force_gain(alpha, beta, 0);
                    assert!(
                        (post.gain(0.0) - bf).abs() < 1e-14,
                        "{} vs {bf}",
                        post.gain(0.0)
                    );
                    for m in 1..=4u32 {
                        let bf = brute_force_gain(alpha, beta, m);
                        let look = post.gain_lookahead(f64::from(m));
                        assert!((look - bf).abs() < 1e-14, "m={m}: {look} vs {bf}");
                        // The spec's effective-count form over-scores, within (a+1)/a.
                        let eff = post.gain(f64::from(m));
                        assert!(eff >= bf - 1e-15 && eff * post.a / (post.a + 1.0) <= bf + 1e-15);
                    }
                }
            }
        }
    }

    /// A first-principles check that does not use the Beta variance
    /// formula: integrate the squared error of the posterior mean over the
    /// prior of the true value numerically (Simpson's rule).
    #[test]
    fn gain_is_expected_mse_reduction_by_quadrature() {
        let (alpha, beta) = (2.5, 4.0);
        let k = 20_000;
        let h = 1.0 / k as f64;
        let dens = |p: f64| p.powf(alpha - 1.0) * (1.0 - p).powf(beta - 1.0);
        let mu = alpha / (alpha + beta);
        let mu1 = (alpha + 1.0) / (alpha + beta + 1.0);
        let mu0 = alpha / (alpha + beta + 1.0);
        let (mut z, mut mse_now, mut mse_next) = (0.0, 0.0, 0.0);
        for i in 0..=k {
            let p = i as f64 * h;
            let w = if i == 0 || i == k {
                1.0
            } else if i % 2 == 1 {
                4.0
            } else {
                2.0
            };
            let d = w * dens(p);
            z += d;
            mse_now += d * (mu - p).powi(2);
            // Next outcome X ~ Bernoulli(p) given the true value p.
            mse_next += d * (p * (mu1 - p).powi(2) + (1.0 - p) * (mu0 - p).powi(2));
        }
        let reduction = (mse_now - mse_next) / z;
        let post = Posterior {
            mu,
            a: alpha + beta,
        };
        assert!(
            (reduction - post.gain(0.0)).abs() < 1e-9,
            "{reduction} vs {}",
            post.gain(0.0)
        );
    }

    fn chain_tree() -> (RolloutTree, NodeId, Vec<NodeId>) {
        let mut t = RolloutTree::new();
        let root = t.add_episode("t", vec![1], Some(0.5)).unwrap();
        let ids = t
            .add_path(
                root,
                vec![
                    step(2).value(0.9),
                    step(2).value(0.5),
                    step(1).terminal(1.0),
                ],
            )
            .unwrap();
        (t, root, ids)
    }

    #[test]
    fn focus_prefers_uncertain_nodes_and_respects_pending() {
        let (mut t, root, ids) = chain_tree();
        let mut f = Focus::new(1.0, AsyncGain::EffectiveCount).unwrap();
        let mut rng = StdRng::seed_from_u64(0);
        let g_root = f.priority(root, t.node(root).unwrap(), &mut rng).unwrap();
        let g_b = f
            .priority(ids[1], t.node(ids[1]).unwrap(), &mut rng)
            .unwrap();
        // Same n = 1 and same outcome; v = 0.5 keeps mu nearer 0.5 than v = 0.9.
        let g_a = f
            .priority(ids[0], t.node(ids[0]).unwrap(), &mut rng)
            .unwrap();
        assert!(g_a < g_b && (g_root - g_b).abs() < 1e-15);
        // A terminal-valued prior with no uncertainty is not a candidate.
        t.set_value(ids[0], 1.0).unwrap();
        assert!(f
            .priority(ids[0], t.node(ids[0]).unwrap(), &mut rng)
            .is_none());
        let tk = t.begin(root).unwrap();
        let g_busy = f.priority(root, t.node(root).unwrap(), &mut rng).unwrap();
        assert!(g_busy < g_root);
        t.abort(tk).unwrap();
        assert!(Focus::new(0.0, AsyncGain::EffectiveCount).is_err());
    }

    /// The variants against hand values on the chain tree (root, a, b each
    /// with one success below them).
    #[test]
    fn score_variants_and_pruning() {
        let (mut t, root, ids) = chain_tree();
        let mut rng = StdRng::seed_from_u64(0);
        let spec = Focus::new(1.0, AsyncGain::EffectiveCount).unwrap();
        // a: v = 0.9, one success: mu = 0.95, a = 2; bias b = 0.1.
        let g = spec.score(t.node(ids[0]).unwrap()).unwrap();
        let mut bias = spec.clone().with_score(Score::Bias);
        let want = g + 0.01 * (1.0 / 4.0 - 1.0 / 9.0);
        let got = bias
            .priority(ids[0], t.node(ids[0]).unwrap(), &mut rng)
            .unwrap();
        assert!((got - want).abs() < 1e-15, "{got} vs {want}");
        // Propagated: b's ancestors are a and the root, each with one child:
        // w(a, b) = 1/2, w(root, b) = 1/4 -> factor 1 + 1/4 + 1/16.
        let mut prop = spec.clone().with_score(Score::Propagated);
        prop.prepare(&t);
        let gb = spec.score(t.node(ids[1]).unwrap()).unwrap();
        let got = prop
            .priority(ids[1], t.node(ids[1]).unwrap(), &mut rng)
            .unwrap();
        assert!((got - gb * (1.0 + 0.25 + 0.0625)).abs() < 1e-15);
        // Root samples: the root goes first until it has k launched.
        let floor = spec.clone().with_root_samples(2);
        let g_root = spec.score(t.node(root).unwrap()).unwrap();
        assert_eq!(
            floor.variant_score(root, t.node(root).unwrap()),
            Some(1.0 + g_root)
        );
        let tk = t.begin(root).unwrap();
        assert_eq!(
            floor.variant_score(root, t.node(root).unwrap()),
            spec.score(t.node(root).unwrap())
        );
        t.abort(tk).unwrap();
        assert_eq!(
            floor.variant_score(ids[1], t.node(ids[1]).unwrap()),
            spec.score(t.node(ids[1]).unwrap())
        );
        // Pruning: a second success below the root settles it at k = 2.
        let mut prune = spec.clone().with_prune_settled(2);
        assert!(prune
            .priority(root, t.node(root).unwrap(), &mut rng)
            .is_some());
        t.add_path(root, vec![step(1).terminal(1.0)]).unwrap();
        assert!(prune
            .priority(root, t.node(root).unwrap(), &mut rng)
            .is_none());
        // A mixed subtree is never pruned.
        t.add_path(root, vec![step(1).terminal(0.0)]).unwrap();
        assert!(prune
            .priority(root, t.node(root).unwrap(), &mut rng)
            .is_some());
    }

    #[test]
    fn slipped_states_go_last() {
        // root -> a (confident) -> b (one doubted token) -> c -> terminal;
        // a second root path through a doubted observation (masked, so it
        // does not count).
        let mut t = RolloutTree::new();
        let root = t.add_episode("t", vec![1], Some(0.5)).unwrap();
        let seg = |lps: &[f32]| {
            let toks: Vec<u32> = (0..lps.len() as u32).collect();
            Segment::policy(&toks, lps).unwrap()
        };
        let ids = t
            .add_path(
                root,
                vec![
                    Step::new(seg(&[-0.1, -0.2])).value(0.5),
                    Step::new(seg(&[-0.1, -1.5])).value(0.5),
                    Step::new(seg(&[-0.1])).value(0.5),
                    Step::new(seg(&[-0.3])).terminal(0.0),
                ],
            )
            .unwrap();
        let mut obs = Segment::new();
        obs.push(TokenKind::Observation, &[7, 8], None).unwrap();
        obs.push(TokenKind::Action, &[9], Some(&[-0.05])).unwrap();
        let other = t
            .add_path(root, vec![Step::new(obs).value(0.5), step(1).terminal(1.0)])
            .unwrap();
        let spec = Focus::new(1.0, AsyncGain::EffectiveCount).unwrap();
        let mut slip = spec.clone().with_slip_nats(1.0);
        slip.prepare(&t);
        let mut rng = StdRng::seed_from_u64(0);
        for (id, factor) in [
            (root, 1.0),
            (ids[0], 1.0),
            (ids[1], SLIP_FACTOR),
            (ids[2], SLIP_FACTOR),
            (other[0], 1.0),
        ] {
            let g = spec.score(t.node(id).unwrap()).unwrap();
            let got = slip.priority(id, t.node(id).unwrap(), &mut rng).unwrap();
            assert!((got - factor * g).abs() < 1e-15, "{id:?}: {got} vs {g}");
        }
        // A looser threshold sees no slip; nodes added later are marked
        // as the tree grows.
        let mut loose = spec.clone().with_slip_nats(2.0);
        loose.prepare(&t);
        let g = spec.score(t.node(ids[2]).unwrap()).unwrap();
        assert_eq!(
            loose.priority(ids[2], t.node(ids[2]).unwrap(), &mut rng),
            Some(g)
        );
        let late = t
            .add_path(
                ids[0],
                vec![Step::new(seg(&[-3.0])).value(0.5), step(1).terminal(1.0)],
            )
            .unwrap();
        loose.prepare(&t);
        let g = spec.score(t.node(late[0]).unwrap()).unwrap();
        let got = loose.priority(late[0], t.node(late[0]).unwrap(), &mut rng);
        assert_eq!(got, Some(SLIP_FACTOR * g));
    }

    #[test]
    fn raw_residual_and_uniform_scores() {
        let (t, root, ids) = chain_tree();
        let mut rng = StdRng::seed_from_u64(0);
        let mut r = RawResidual;
        assert_eq!(
            r.priority(ids[0], t.node(ids[0]).unwrap(), &mut rng),
            Some((1.0f64 - 0.9).abs())
        );
        let mut u = Uniform;
        assert_eq!(
            u.priority(root, t.node(root).unwrap(), &mut rng),
            Some(-1.0)
        );
    }

    #[test]
    fn allocator_is_seeded_and_deterministic() {
        let run = |seed: u64| {
            let mut t = RolloutTree::new();
            for _ in 0..6 {
                t.add_episode("t", vec![], Some(0.5)).unwrap();
            }
            let cfg = AllocatorConfig::new(3, Budget::Continuations(3), seed);
            let mut a =
                Allocator::new(cfg, Focus::new(1.0, AsyncGain::default()).unwrap()).unwrap();
            a.fill(&mut t)
                .unwrap()
                .iter()
                .map(super::super::tree::Ticket::node)
                .collect::<Vec<_>>()
        };
        assert_eq!(run(1), run(1));
        let distinct: std::collections::BTreeSet<_> = (0..20).map(run).collect();
        assert!(distinct.len() > 1, "ties must be broken by the seed");
    }

    #[test]
    fn allocator_rejects_foreign_and_oversized_continuations() {
        let (mut t, root, _) = chain_tree();
        let cfg = AllocatorConfig::new(
            4,
            Budget::Tokens {
                total: 10,
                max_per_continuation: 3,
            },
            0,
        );
        let mut a = Allocator::new(cfg, Uniform).unwrap();
        let foreign = t.begin(root).unwrap();
        assert!(a.complete(&mut t, foreign, vec![step(1)]).is_err());
        let mine = a.launch_next(&mut t).unwrap().unwrap();
        let err = a.complete(&mut t, mine, vec![step(4)]).unwrap_err();
        assert!(
            err.to_string().contains("more than the 3 reserved"),
            "{err}"
        );
        a.complete(&mut t, mine, vec![step(2).terminal(0.0)])
            .unwrap();
        assert_eq!(a.spend().tokens_charged, 2);
        let bad = AllocatorConfig {
            max_in_flight_per_node: 0,
            ..cfg
        };
        assert!(Allocator::new(bad, Uniform).is_err());
    }

    #[derive(Clone, Debug)]
    enum Op {
        Fill,
        Complete {
            pick: usize,
            len: usize,
            terminal: Option<bool>,
        },
        Abort {
            pick: usize,
            generated: u64,
        },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            Just(Op::Fill),
            (any::<usize>(), 1usize..6, prop::option::of(any::<bool>())).prop_map(
                |(pick, len, terminal)| Op::Complete {
                    pick,
                    len,
                    terminal
                }
            ),
            (any::<usize>(), 0u64..4).prop_map(|(pick, generated)| Op::Abort { pick, generated }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn caps_and_budgets_are_never_exceeded(
            episodes in 1usize..5,
            capacity in 1u32..6,
            per_node in 1u32..3,
            tokens in any::<bool>(),
            total in 1u64..40,
            kind in 0usize..5,
            seed in any::<u64>(),
            ops in prop::collection::vec(op(), 1..60),
        ) {
            let mut t = RolloutTree::new();
            for e in 0..episodes {
                t.add_episode("t", vec![], Some(0.2 + 0.15 * e as f64)).unwrap();
            }
            let budget = if tokens {
                Budget::Tokens { total, max_per_continuation: 5 }
            } else {
                Budget::Continuations(total)
            };
            let cfg = AllocatorConfig { max_in_flight_per_node: per_node, worker_capacity: capacity, budget, seed };
            let mut a = Allocator::new(cfg, SelectorKind::ALL[kind].build(1.0).unwrap()).unwrap();
            for op in ops {
                let flying: Vec<Ticket> = t.active().collect();
                match op {
                    Op::Fill => { a.fill(&mut t).unwrap(); }
                    Op::Complete { pick, len, terminal } if !flying.is_empty() => {
                        let tk = flying[pick % flying.len()];
                        let last = match terminal {
                            Some(win) => step(len).terminal(if win { 1.0 } else { 0.0 }),
                            None => step(len).value(0.5),
                        };
                        a.complete(&mut t, tk, vec![step(1).value(0.4), last]).unwrap_or_default();
                    }
                    Op::Abort { pick, generated } if !flying.is_empty() => {
                        a.abort(&mut t, flying[pick % flying.len()], generated).unwrap();
                    }
                    _ => {}
                }
                prop_assert!(t.in_flight() <= capacity as usize);
                prop_assert!(t.nodes().all(|(_, n)| n.in_flight() <= per_node));
                let s = a.spend();
                match budget {
                    Budget::Continuations(k) => prop_assert!(s.launched <= k),
                    Budget::Tokens { total, .. } => prop_assert!(s.tokens_charged + s.tokens_reserved <= total),
                }
                prop_assert_eq!(s.launched, s.completed + s.aborted + t.in_flight() as u64);
                t.validate().unwrap();
            }
        }
    }
}
