//! The audit-tree diagnostic behind `arbor bench audit`: how fast does each
//! selection rule shrink the error of the value estimates, per continuation
//! spent?
//!
//! **Environment** (seeded): every task is a complete `branching`-ary tree of
//! abstract states of depth `depth`. The policy moves from a state to child
//! `c` with probability `pi(c)` (normalised `Exp(1)` weights) and survives
//! the step with probability `q(c) ~ U(floor, 1)`, where each task draws its
//! difficulty `floor ~ U(floor_lo, floor_hi)`; a failed step ends the episode
//! with reward 0, reaching depth `depth` ends it with reward 1. True values
//! are exact:
//!
//! ```text
//! V*(s) = sum_c pi(c) * q(c) * V*(c),   V*(s at depth D) = 1
//! ```
//!
//! **Audit tree**: the rollout tree after `trajectories_per_task` on-policy
//! episodes per task. Its non-terminal nodes are the audit nodes: the only
//! states the harness may fork (continuations add fresh, non-resumable
//! branches below them, as LM continuations never revisit a state). The
//! critic is a constant (`v = 0.5`) or random (`v ~ U(0, 1)` per state).
//!
//! **Run**: each selector spends `budget` continuations through the
//! [`Allocator`] with `workers` in flight (2 per node, completions in launch
//! order, so the async effective count matters). At every `record_every`
//! continuations, two estimates of every audit node are scored against
//! `V*` by mean squared error:
//!
//! - `posterior`: the Beta posterior mean `mu = (kappa*v + n*cbar)/(kappa+n)`
//!   on the node's on-policy evidence (the estimate whose expected squared
//!   error FOCUS's `g` measures);
//! - `refined`: `Vtilde` of the recursive backup (Eq. 1, `gamma = 1`).
//!
//! The claim under test (the paper's): FOCUS reaches random selection's
//! final MSE with at most half the budget, and raw-residual selection does
//! worse than FOCUS.
//!
//! As a yardstick, the `oracle` selector knows every audit node's true value
//! and greedily launches where the expected squared error of the posterior
//! mean drops most:
//!
//! ```text
//! MSE(n) = (n*p*(1-p) + kappa^2*(v-p)^2) / (kappa+n)^2,   priority = MSE(n+m) - MSE(n+m+1)
//! ```
//!
//! It bounds what any allocation rule can achieve on the posterior metric
//! in a given world.
//!
//! What the default configuration shows (8 seeds, 72 audit nodes, 512
//! continuations; numbers in the bench output): raw-residual selection is
//! the worst rule everywhere. FOCUS tracks the oracle with the constant
//! critic, but the oracle itself needs ~80% of the budget to reach random's
//! final posterior MSE: the audit nodes' variances are too alike for any
//! allocation to halve the budget, random only loses its sampling
//! imbalance. With the random critic FOCUS trails random on the posterior
//! metric: `g` trusts the prior `Beta(kappa*v, kappa*(1-v))`, so nodes whose
//! (wrong) `v` is near 0 or 1 look certain and are starved, while the
//! oracle sees their bias term. The refined values plateau: fresh branches
//! are one-child chains whose `Vtilde` is pulled toward the critic at every
//! level (with `kappa = 1` a `k`-step chain passes on `2^-k` of its
//! outcome), so under a fixed bad critic Eq. 1 is not consistent in the
//! budget.

use std::collections::VecDeque;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::credit::{backup, CreditConfig};
use crate::error::{check_positive, check_range, Result, RlError};
use crate::focus::{
    Allocator, AllocatorConfig, Budget, Evidence, Posterior, Selector, SelectorKind,
};
use crate::tree::{Node, NodeId, RolloutTree, Segment, Step};

/// The critic used as prior centre (and by the raw residual).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CriticKind {
    /// The same value for every state.
    Constant(f64),
    /// `U(0, 1)` per state, fixed per seed.
    Random,
}

impl CriticKind {
    /// Report name.
    pub fn name(&self) -> String {
        match self {
            CriticKind::Constant(c) => format!("constant({c})"),
            CriticKind::Random => "random".into(),
        }
    }
}

/// Which value estimate is scored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Metric {
    /// Beta posterior mean on on-policy evidence.
    Posterior,
    /// `Vtilde` of Eq. 1.
    Refined,
}

impl Metric {
    pub const ALL: [Metric; 2] = [Metric::Posterior, Metric::Refined];

    /// Report name.
    pub fn name(self) -> &'static str {
        match self {
            Metric::Posterior => "posterior",
            Metric::Refined => "refined",
        }
    }
}

/// Settings of the audit.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AuditConfig {
    pub tasks: usize,
    pub trajectories_per_task: usize,
    pub depth: u32,
    pub branching: u32,
    /// Range of a task's per-step survival floor.
    pub floor_lo: f64,
    pub floor_hi: f64,
    /// Prior strength (FOCUS, posterior estimate, Eq. 1 mixing).
    pub kappa: f64,
    /// Continuations per run.
    pub budget: u64,
    pub workers: u32,
    pub record_every: u64,
    pub seeds: Vec<u64>,
    pub critics: Vec<CriticKind>,
    pub selectors: Vec<SelectorKind>,
    /// Also run the oracle yardstick.
    pub oracle: bool,
}

impl Default for AuditConfig {
    fn default() -> Self {
        AuditConfig {
            tasks: 8,
            trajectories_per_task: 2,
            depth: 6,
            branching: 3,
            floor_lo: 0.7,
            floor_hi: 0.95,
            kappa: 1.0,
            budget: 512,
            workers: 8,
            record_every: 16,
            seeds: (0..8).collect(),
            critics: vec![CriticKind::Constant(0.5), CriticKind::Random],
            selectors: SelectorKind::ALL.to_vec(),
            oracle: true,
        }
    }
}

impl AuditConfig {
    /// Checks every field; the environment must stay small (at most two
    /// million states per task).
    pub fn validate(&self) -> Result<()> {
        let positive = |field: &'static str, x: u64| {
            if x == 0 {
                Err(RlError::config(field, "must be >= 1"))
            } else {
                Ok(())
            }
        };
        positive("tasks", self.tasks as u64)?;
        positive("trajectories_per_task", self.trajectories_per_task as u64)?;
        positive("depth", u64::from(self.depth))?;
        positive("branching", u64::from(self.branching))?;
        positive("budget", self.budget)?;
        positive("workers", u64::from(self.workers))?;
        positive("record_every", self.record_every)?;
        if self.depth > 16 || state_count(self.branching, self.depth) > 2_000_000 {
            return Err(RlError::config(
                "depth",
                format!(
                    "branching {}^depth {} is too large (at most 2e6 states per task)",
                    self.branching, self.depth
                ),
            ));
        }
        check_range("floor_lo", self.floor_lo, 0.0, 1.0)?;
        check_range("floor_hi", self.floor_hi, self.floor_lo, 1.0)?;
        check_positive("kappa", self.kappa)?;
        if self.seeds.is_empty() || self.critics.is_empty() || self.selectors.is_empty() {
            return Err(RlError::config(
                "seeds/critics/selectors",
                "need at least one of each",
            ));
        }
        for c in &self.critics {
            if let CriticKind::Constant(v) = c {
                check_range("critic constant", *v, 0.0, 1.0)?;
            }
        }
        Ok(())
    }

    /// The budgets at which the MSE is recorded: `0, r, 2r, ..., budget`.
    pub fn grid(&self) -> Vec<u64> {
        let mut g: Vec<u64> = (0..=self.budget)
            .step_by(self.record_every as usize)
            .collect();
        if g.last() != Some(&self.budget) {
            g.push(self.budget);
        }
        g
    }
}

fn state_count(b: u32, d: u32) -> u64 {
    (0..=d).map(|k| u64::from(b).saturating_pow(k)).sum()
}

/// One task's generative tree, in complete-tree order: the children of
/// state `s` are `s*B + 1 ..= s*B + B`.
struct TaskEnv {
    branching: usize,
    depth: Vec<u32>,
    /// `pi(s)`: probability of moving into `s` from its parent.
    pi: Vec<f64>,
    /// `q(s)`: probability of surviving the step into `s`.
    q: Vec<f64>,
    value: Vec<f64>,
    critic: Vec<f64>,
    max_depth: u32,
}

impl TaskEnv {
    fn generate(cfg: &AuditConfig, critic: CriticKind, rng: &mut StdRng) -> Self {
        let b = cfg.branching as usize;
        let n = state_count(cfg.branching, cfg.depth) as usize;
        let floor = rng.random_range(cfg.floor_lo..=cfg.floor_hi);
        let mut depth = vec![0u32; n];
        let mut pi = vec![1.0; n];
        let mut q = vec![1.0; n];
        for s in 0..n {
            let first = s * b + 1;
            if first >= n {
                continue;
            }
            let w: Vec<f64> = (0..b).map(|_| -(1.0 - rng.random::<f64>()).ln()).collect();
            let total: f64 = w.iter().sum();
            for (k, wk) in w.iter().enumerate() {
                depth[first + k] = depth[s] + 1;
                pi[first + k] = wk / total;
                q[first + k] = rng.random_range(floor..=1.0);
            }
        }
        let mut value = vec![1.0; n];
        for s in (0..n).rev() {
            let first = s * b + 1;
            if first < n {
                value[s] = (first..first + b).map(|c| pi[c] * q[c] * value[c]).sum();
            }
        }
        let critic = (0..n)
            .map(|_| match critic {
                CriticKind::Constant(v) => v,
                CriticKind::Random => rng.random::<f64>(),
            })
            .collect();
        TaskEnv {
            branching: b,
            depth,
            pi,
            q,
            value,
            critic,
            max_depth: cfg.depth,
        }
    }

    /// Rolls the policy from state `s` to the end: one single-token step per
    /// move. Returns the steps and the state of every non-terminal step.
    fn rollout(&self, mut s: usize, resumable: bool, rng: &mut StdRng) -> (Vec<Step>, Vec<usize>) {
        let (mut steps, mut states) = (Vec::new(), Vec::new());
        let seg = || Segment::policy(&[1], &[-1.0]).unwrap_or_default();
        loop {
            let first = s * self.branching + 1;
            let u = rng.random::<f64>();
            let mut c = first + self.branching - 1;
            let mut acc = 0.0;
            for k in first..first + self.branching {
                acc += self.pi[k];
                if u < acc {
                    c = k;
                    break;
                }
            }
            if rng.random::<f64>() >= self.q[c] {
                steps.push(Step::new(seg()).terminal(0.0));
                return (steps, states);
            }
            if self.depth[c] == self.max_depth {
                steps.push(Step::new(seg()).terminal(1.0));
                return (steps, states);
            }
            steps.push(Step::new(seg()).value(self.critic[c]).resumable(resumable));
            states.push(c);
            s = c;
        }
    }
}

/// The rollout tree of one (seed, critic) with its audit nodes.
struct AuditWorld {
    envs: Vec<TaskEnv>,
    tree: RolloutTree,
    /// Abstract state of every non-terminal node (by node index).
    state: Vec<Option<usize>>,
    audit: Vec<(NodeId, f64)>,
}

impl AuditWorld {
    fn build(cfg: &AuditConfig, seed: u64, critic: CriticKind) -> Result<Self> {
        let mut rng = StdRng::seed_from_u64(seed);
        let envs: Vec<TaskEnv> = (0..cfg.tasks)
            .map(|_| TaskEnv::generate(cfg, critic, &mut rng))
            .collect();
        let mut w = AuditWorld {
            envs,
            tree: RolloutTree::new(),
            state: Vec::new(),
            audit: Vec::new(),
        };
        for k in 0..cfg.tasks {
            let root =
                w.tree
                    .add_episode(format!("task{k}"), vec![0], Some(w.envs[k].critic[0]))?;
            w.state.push(Some(0));
            for _ in 0..cfg.trajectories_per_task {
                let (steps, states) = w.envs[k].rollout(0, true, &mut rng);
                let ids = w.tree.add_path(root, steps)?;
                w.record_states(&ids, &states);
            }
        }
        w.audit = w
            .tree
            .nodes()
            .filter(|(_, n)| !n.is_terminal())
            .map(|(id, n)| {
                let s = w.state[id.index()].unwrap_or(0);
                (id, w.envs[n.episode()].value[s])
            })
            .collect();
        Ok(w)
    }

    fn record_states(&mut self, ids: &[NodeId], states: &[usize]) {
        // Every step but a terminal last one has a state, in order.
        for (k, _) in ids.iter().enumerate() {
            self.state.push(states.get(k).copied());
        }
    }

    fn mse(&self, cfg: &AuditConfig) -> Result<[f64; 2]> {
        let b = backup(
            &self.tree,
            &CreditConfig {
                gamma: 1.0,
                lambda: 0.0,
                kappa: cfg.kappa,
            },
        )?;
        let (mut post, mut refined) = (0.0, 0.0);
        for &(id, truth) in &self.audit {
            let n = self.tree.node(id)?;
            let mu = Posterior::of(n, cfg.kappa, Evidence::OnPolicy)
                .ok_or(RlError::MissingValue(id))?
                .mu;
            post += (mu - truth).powi(2);
            refined += (b.vtilde[id.index()] - truth).powi(2);
        }
        let k = self.audit.len() as f64;
        Ok([post / k, refined / k])
    }
}

/// The oracle yardstick (see the module docs): true values of the audit
/// nodes by node index.
struct Oracle {
    truth: Vec<Option<f64>>,
    kappa: f64,
}

impl Oracle {
    fn mse(&self, n: f64, p: f64, v: f64) -> f64 {
        let k = self.kappa;
        (n * p * (1.0 - p) + k * k * (v - p) * (v - p)) / ((k + n) * (k + n))
    }
}

impl Selector for Oracle {
    fn name(&self) -> &'static str {
        "oracle"
    }
    fn priority(&mut self, id: NodeId, node: &Node, _: &mut StdRng) -> Option<f64> {
        let p = (*self.truth.get(id.index())?)?;
        let v = node.value()?.clamp(0.0, 1.0);
        let n = f64::from(node.completed() + node.in_flight());
        Some(self.mse(n, p, v) - self.mse(n + 1.0, p, v))
    }
}

/// An audit selector: one of the allocator's, or the oracle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Which {
    Kind(SelectorKind),
    Oracle,
}

impl Which {
    fn name(self) -> &'static str {
        match self {
            Which::Kind(k) => k.name(),
            Which::Oracle => "oracle",
        }
    }
}

/// MSE-vs-budget of one (seed, critic, selector): `[posterior, refined]`
/// at every grid point.
fn run_one(
    cfg: &AuditConfig,
    seed: u64,
    critic: CriticKind,
    which: Which,
) -> Result<(usize, Vec<[f64; 2]>)> {
    let mut w = AuditWorld::build(cfg, seed, critic)?;
    let tag = match which {
        Which::Kind(k) => k as u64,
        Which::Oracle => 99,
    };
    let salt = (tag + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let acfg = AllocatorConfig::new(cfg.workers, Budget::Continuations(cfg.budget), seed ^ salt);
    let selector: Box<dyn Selector> = match which {
        Which::Kind(k) => k.build(cfg.kappa)?,
        Which::Oracle => {
            let mut truth = vec![None; w.tree.len()];
            for &(id, p) in &w.audit {
                truth[id.index()] = Some(p);
            }
            Box::new(Oracle {
                truth,
                kappa: cfg.kappa,
            })
        }
    };
    let mut alloc = Allocator::new(acfg, selector)?;
    let mut rng = StdRng::seed_from_u64(seed.wrapping_add(salt));
    let grid = cfg.grid();
    let mut curve = vec![w.mse(cfg)?];
    let mut queue = VecDeque::new();
    let mut done = 0u64;
    loop {
        queue.extend(alloc.fill(&mut w.tree)?);
        let Some(t) = queue.pop_front() else { break };
        let from = t.node();
        let episode = w.tree.node(from)?.episode();
        let s = w.state[from.index()]
            .ok_or_else(|| RlError::node(from, "audit node without a state"))?;
        let (steps, states) = w.envs[episode].rollout(s, false, &mut rng);
        let ids = alloc.complete(&mut w.tree, t, steps)?;
        w.record_states(&ids, &states);
        done += 1;
        if grid.get(curve.len()) == Some(&done) {
            curve.push(w.mse(cfg)?);
        }
    }
    // Candidates can run out before the budget: carry the last value.
    let last = *curve.last().unwrap_or(&[f64::NAN; 2]);
    curve.resize(grid.len(), last);
    Ok((w.audit.len(), curve))
}

/// MSE-vs-budget curve of one (critic, selector, metric), over the seeds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AuditCurve {
    pub critic: CriticKind,
    /// [`SelectorKind::name`], or `oracle`.
    pub selector: String,
    pub metric: Metric,
    /// Mean over the seeds at every grid budget.
    pub mean: Vec<f64>,
    /// `per_seed[k][i]`: seed `k` at grid budget `i`.
    pub per_seed: Vec<Vec<f64>>,
}

impl AuditCurve {
    /// Final mean MSE.
    pub fn final_mse(&self) -> f64 {
        self.mean.last().copied().unwrap_or(f64::NAN)
    }

    /// The first grid budget at which the mean MSE is at most `target`.
    pub fn budget_to_reach(&self, grid: &[u64], target: f64) -> Option<u64> {
        self.mean
            .iter()
            .zip(grid)
            .find(|(m, _)| **m <= target)
            .map(|(_, b)| *b)
    }
}

/// The claim, checked for one critic and one metric.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AuditVerdict {
    pub critic: CriticKind,
    pub metric: Metric,
    pub random_final: f64,
    pub focus_final: f64,
    pub residual_final: f64,
    /// First budget at which FOCUS's mean MSE <= random's final MSE.
    pub focus_budget_to_random_final: Option<u64>,
    /// That budget as a fraction of the full budget.
    pub focus_budget_fraction: Option<f64>,
    /// The paper's claim: the fraction is at most 1/2.
    pub focus_within_half_budget: bool,
    pub residual_worse_than_focus: bool,
    pub residual_worse_than_random: bool,
}

/// Everything `arbor bench audit` prints, plots and saves.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AuditReport {
    pub config: AuditConfig,
    /// Mean number of audit nodes per (seed, critic).
    pub audit_nodes: f64,
    pub grid: Vec<u64>,
    pub curves: Vec<AuditCurve>,
    /// Needs FOCUS, random and raw residual among the selectors.
    pub verdicts: Vec<AuditVerdict>,
}

impl AuditReport {
    /// The curve of one (critic, selector name, metric).
    pub fn curve(&self, critic: CriticKind, selector: &str, metric: Metric) -> Option<&AuditCurve> {
        self.curves
            .iter()
            .find(|c| c.critic == critic && c.selector == selector && c.metric == metric)
    }
}

/// Runs the whole audit (every seed x critic x selector).
pub fn run_audit(cfg: &AuditConfig) -> Result<AuditReport> {
    cfg.validate()?;
    let grid = cfg.grid();
    let mut curves = Vec::new();
    let (mut nodes, mut worlds) = (0usize, 0usize);
    let mut which: Vec<Which> = cfg.selectors.iter().map(|&k| Which::Kind(k)).collect();
    if cfg.oracle {
        which.push(Which::Oracle);
    }
    for &critic in &cfg.critics {
        for &selector in &which {
            let mut per_seed: [Vec<Vec<f64>>; 2] = [Vec::new(), Vec::new()];
            for &seed in &cfg.seeds {
                let (n, curve) = run_one(cfg, seed, critic, selector)?;
                if selector == which[0] {
                    nodes += n;
                    worlds += 1;
                }
                for (m, ps) in per_seed.iter_mut().enumerate() {
                    ps.push(curve.iter().map(|x| x[m]).collect());
                }
            }
            for (metric, ps) in Metric::ALL.into_iter().zip(per_seed) {
                let mean = (0..grid.len())
                    .map(|i| ps.iter().map(|s| s[i]).sum::<f64>() / ps.len() as f64)
                    .collect();
                curves.push(AuditCurve {
                    critic,
                    selector: selector.name().to_string(),
                    metric,
                    mean,
                    per_seed: ps,
                });
            }
        }
    }
    let mut report = AuditReport {
        config: cfg.clone(),
        audit_nodes: nodes as f64 / worlds.max(1) as f64,
        grid,
        curves,
        verdicts: Vec::new(),
    };
    for &critic in &cfg.critics {
        for metric in Metric::ALL {
            let get = |s| report.curve(critic, s, metric);
            let (Some(f), Some(r), Some(x)) = (
                get(SelectorKind::Focus.name()),
                get(SelectorKind::Random.name()),
                get(SelectorKind::RawResidual.name()),
            ) else {
                continue;
            };
            let random_final = r.final_mse();
            let hit = f.budget_to_reach(&report.grid, random_final);
            let fraction = hit.map(|b| b as f64 / cfg.budget as f64);
            report.verdicts.push(AuditVerdict {
                critic,
                metric,
                random_final,
                focus_final: f.final_mse(),
                residual_final: x.final_mse(),
                focus_budget_to_random_final: hit,
                focus_budget_fraction: fraction,
                focus_within_half_budget: fraction.is_some_and(|x| x <= 0.5),
                residual_worse_than_focus: x.final_mse() > f.final_mse(),
                residual_worse_than_random: x.final_mse() > random_final,
            });
        }
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> AuditConfig {
        AuditConfig {
            tasks: 4,
            depth: 4,
            budget: 96,
            workers: 4,
            record_every: 8,
            seeds: vec![1, 2, 3],
            ..AuditConfig::default()
        }
    }

    #[test]
    fn true_values_satisfy_the_recursion() {
        let cfg = small();
        let env = TaskEnv::generate(&cfg, CriticKind::Random, &mut StdRng::seed_from_u64(5));
        let b = env.branching;
        for s in 0..env.value.len() {
            let first = s * b + 1;
            if first < env.value.len() {
                let want: f64 = (first..first + b)
                    .map(|c| env.pi[c] * env.q[c] * env.value[c])
                    .sum();
                assert!((env.value[s] - want).abs() < 1e-12);
                let pis: f64 = (first..first + b).map(|c| env.pi[c]).sum();
                assert!((pis - 1.0).abs() < 1e-12);
            }
            assert!((0.0..=1.0).contains(&env.critic[s]));
        }
        // Monte-Carlo check of V*(root) from the simulator itself.
        let mut rng = StdRng::seed_from_u64(9);
        let k = 20_000;
        let wins = (0..k)
            .filter(|_| {
                let (steps, _) = env.rollout(0, false, &mut rng);
                steps.last().and_then(|s| s.terminal_reward) == Some(1.0)
            })
            .count();
        let p = wins as f64 / k as f64;
        let se = (env.value[0] * (1.0 - env.value[0]) / k as f64).sqrt();
        assert!(
            (p - env.value[0]).abs() < 5.0 * se,
            "{p} vs {}",
            env.value[0]
        );
    }

    #[test]
    fn audit_is_deterministic_and_well_formed() {
        let cfg = small();
        let a = run_audit(&cfg).unwrap();
        let b = run_audit(&cfg).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.grid.len(), 13);
        assert_eq!(a.curves.len(), 2 * (SelectorKind::ALL.len() + 1) * 2);
        assert_eq!(a.verdicts.len(), 4);
        for c in &a.curves {
            assert!(c.mean.iter().all(|m| m.is_finite() && *m >= 0.0));
            // Same world, same starting error, whatever the selector.
            let f = a.curve(c.critic, "focus", c.metric).unwrap();
            assert_eq!(c.mean[0], f.mean[0]);
        }
        // Spending budget helps every selector on average.
        for c in &a.curves {
            assert!(
                c.final_mse() < c.mean[0],
                "{:?} {:?} {:?}",
                c.critic,
                c.selector,
                c.metric
            );
        }
    }

    /// The paper's second claim holds in every panel of the default audit.
    #[test]
    fn raw_residual_is_worse_than_focus() {
        let r = run_audit(&AuditConfig::default()).unwrap();
        assert_eq!(r.verdicts.len(), 4);
        for v in &r.verdicts {
            assert!(v.residual_worse_than_focus, "{v:?}");
        }
    }

    #[test]
    fn bad_configs_are_rejected() {
        let bad = |f: fn(&mut AuditConfig)| {
            let mut c = small();
            f(&mut c);
            run_audit(&c).is_err()
        };
        assert!(bad(|c| c.budget = 0));
        assert!(bad(|c| c.depth = 40));
        assert!(bad(|c| c.floor_hi = 0.1));
        assert!(bad(|c| c.seeds.clear()));
        assert!(bad(|c| c.critics = vec![CriticKind::Constant(2.0)]));
    }
}
