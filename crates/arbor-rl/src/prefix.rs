//! Prefix Sampling (PS): replay prefixes of the policy's own trajectories to
//! steer skewed groups toward a 50% pass rate.
//!
//! A group of `N` binary rewards with `k` successes falls in a *bucket*
//! `k/N`. All-fail (`0/N`) and all-pass (`N/N`) groups carry no contrast and
//! are dropped; balanced groups (`|k/N - 1/2| <= band`, default band `1/8`,
//! so `3/8..5/8` for `N = 8`) are kept as they are; skewed groups (`1/8`,
//! `2/8`, `6/8`, `7/8`) get a group of re-rollouts that all continue from
//! one replayed prefix of one source trajectory of the group (one prefix,
//! one baseline):
//!
//! - hard bucket (`k/N < 1/2`): the source is a *successful* trajectory
//!   (a head start);
//! - easy bucket (`k/N > 1/2`): a *failed* one (a handicap).
//!
//! The prefix length is `ratio * len` of the source's generated tokens,
//! snapped to an allowed cut: an action/turn boundary (agents) or any token
//! (single-turn tasks); replayed tokens are masked in the loss
//! ([`crate::tree::TokenKind::Replayed`]). A re-rollout group whose members
//! all end alike carries no contrast; [`CutSearch`] then bisects the cut
//! (longer or shorter prefix, by which way the group missed) for the
//! group's next attempt.
//! Each bucket `b` has its own ratio, driven by an EMA of the bucket's
//! re-rollout pass rate (one update per step):
//!
//! ```text
//! ema_b   <- d * ema_b + (1 - d) * pass_rate_b          (first observation: ema_b = pass_rate_b)
//! ratio_b <- clamp(ratio_b + eta * sign_b * (0.5 - ema_b), r_min, r_max)
//! sign_b  = +1 for hard buckets (longer success prefix raises the pass rate)
//!           -1 for easy buckets (longer failure prefix lowers it)
//! ```
//!
//! `eta = 0` gives the fixed-ratio ablation. [`TokenLedger`] keeps the
//! step's generated-token budget equal to the baseline's and reports
//! generated and replayed tokens separately.
//!
//! Why 50%: for `N` Bernoulli(`p`) rewards, `p = 1/2` maximises all four of
//! [`reward_entropy`], [`filter_survival`], [`rloo_advantage_energy`] and
//! [`expected_contrastive_pairs`] (property-tested).

use std::collections::BTreeMap;

use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};

use crate::error::{check_range, Result, RlError};

fn check_p(p: f64) -> Result<()> {
    if (0.0..=1.0).contains(&p) {
        Ok(())
    } else {
        Err(RlError::input("p", format!("{p} is not a probability")))
    }
}

/// Reward entropy `H(p) = -p ln p - (1-p) ln(1-p)` (nats; `H(0) = H(1) = 0`).
pub fn reward_entropy(p: f64) -> Result<f64> {
    check_p(p)?;
    let h = |x: f64| if x > 0.0 { -x * x.ln() } else { 0.0 };
    Ok(h(p) + h(1.0 - p))
}

/// Probability that a group of `n` survives group filtering (is neither
/// all-fail nor all-pass): `1 - p^n - (1-p)^n`.
pub fn filter_survival(p: f64, n: u32) -> Result<f64> {
    check_p(p)?;
    if n == 0 {
        return Err(RlError::input("n", "a group needs at least one member"));
    }
    let n = n as i32;
    Ok(1.0 - p.powi(n) - (1.0 - p).powi(n))
}

/// RLOO advantage energy: `E[A_i^2]` of the leave-one-out advantage
/// `A_i = r_i - mean_{j != i} r_j` (mean zero), which is
/// `Var(r_i) + Var(r_i)/(n-1) = p(1-p) * n/(n-1)`.
pub fn rloo_advantage_energy(p: f64, n: u32) -> Result<f64> {
    check_p(p)?;
    if n < 2 {
        return Err(RlError::input("n", "leave-one-out needs n >= 2"));
    }
    let n = f64::from(n);
    Ok(p * (1.0 - p) * n / (n - 1.0))
}

/// Success/failure pairs in a group with `k` successes of `n`: `k(n-k)`.
pub fn contrastive_pairs(k: u32, n: u32) -> Result<u64> {
    if k > n {
        return Err(RlError::input(
            "k",
            format!("{k} successes in a group of {n}"),
        ));
    }
    Ok(u64::from(k) * u64::from(n - k))
}

/// Expected contrastive pairs for `k ~ Binomial(n, p)`:
/// `E[k(n-k)] = n(n-1) p(1-p)`.
pub fn expected_contrastive_pairs(p: f64, n: u32) -> Result<f64> {
    check_p(p)?;
    let n = f64::from(n);
    Ok(n * (n - 1.0) * p * (1.0 - p))
}

/// Which way a skewed group must be pushed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    /// Pass rate below 1/2: replay a successful prefix.
    Hard,
    /// Pass rate above 1/2: replay a failed prefix.
    Easy,
}

impl Direction {
    /// `sign_b` of the controller: `+1` hard, `-1` easy.
    pub fn sign(self) -> f64 {
        match self {
            Direction::Hard => 1.0,
            Direction::Easy => -1.0,
        }
    }

    /// The outcome a prefix source must have.
    pub fn source_success(self) -> bool {
        self == Direction::Hard
    }
}

/// A pass-rate bucket `successes / group_size`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Bucket {
    pub successes: u32,
    pub group_size: u32,
}

impl Bucket {
    /// `k / N`.
    pub fn pass_rate(&self) -> f64 {
        f64::from(self.successes) / f64::from(self.group_size)
    }

    /// Hard below 1/2, easy above (a skewed bucket is never exactly 1/2).
    pub fn direction(&self) -> Direction {
        if 2 * self.successes < self.group_size {
            Direction::Hard
        } else {
            Direction::Easy
        }
    }
}

impl std::fmt::Display for Bucket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.successes, self.group_size)
    }
}

/// What a group's pass rate says about it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GroupClass {
    AllFail,
    AllPass,
    /// Close enough to 1/2: used as is.
    Balanced,
    /// A skew bucket for Prefix Sampling.
    Skewed(Bucket),
}

/// Classifies `k` successes of `n`: skewed iff `0 < k < n` and
/// `|k/n - 1/2| > band`.
pub fn classify(successes: u32, group_size: u32, band: f64) -> Result<GroupClass> {
    check_range("band", band, 0.0, 0.5)?;
    if group_size == 0 || successes > group_size {
        return Err(RlError::input(
            "group",
            format!("{successes} successes in a group of {group_size}"),
        ));
    }
    let b = Bucket {
        successes,
        group_size,
    };
    Ok(if successes == 0 {
        GroupClass::AllFail
    } else if successes == group_size {
        GroupClass::AllPass
    } else if (b.pass_rate() - 0.5).abs() > band + 1e-12 {
        GroupClass::Skewed(b)
    } else {
        GroupClass::Balanced
    })
}

/// Where a prefix may be cut.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CutGranularity {
    /// Any token boundary (single-turn math).
    #[default]
    Tokens,
    /// Only the source's listed action/turn (or line) boundaries.
    Boundaries,
}

/// How a source's cut is chosen (`[ps] cut_rule`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CutRule {
    /// The allowed cut nearest to `ratio_b * len`: the method's controller
    /// sets the replayed fraction of the source.
    #[default]
    Ratio,
    /// The allowed cut whose [`SourceTrajectory::pass_estimate`] is
    /// nearest to the bucket's aim (the controller's `ratio_b`, read as a
    /// pass probability): each hard group's own cut is placed where its
    /// re-rollouts are expected to pass about as often as the aim, and the
    /// controller moves the aim so that the bucket's re-rollouts pass 50%
    /// of the time. An easy group's failed source is cut where it leaves
    /// the path of the last success it shares a prefix with, so its
    /// re-rollouts face the decision the failure got wrong. A cut whose
    /// estimate is 0 (no success of the group passes through its state) is
    /// never chosen.
    Estimate,
}

/// A finished trajectory of the group, as a candidate prefix source.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SourceTrajectory {
    /// Verified outcome.
    pub success: bool,
    /// Generated (response) tokens.
    pub len: usize,
    /// Allowed cut points (token offsets into the response) for
    /// [`CutGranularity::Boundaries`]; ignored for `Tokens`.
    pub boundaries: Vec<usize>,
    /// Response tokens this trajectory shares, from the start, with a
    /// member of the group that had the other outcome (the longest such
    /// prefix; 0 when none or unknown). For a failure this is where it
    /// left every path known to succeed: the planner's anchor for easy
    /// groups ([`PsConfig::anchor`]).
    #[serde(default)]
    pub shared: usize,
    /// For [`CutRule::Estimate`]: entry `c` (`0..=len`) is a lower bound of
    /// the pass probability of a continuation from the state after the
    /// first `c` response tokens ([`pass_estimate`]; empty: unknown).
    #[serde(default)]
    pub pass_estimate: Vec<f64>,
}

/// A lower bound of the pass probability from each state of a source.
///
/// `len` is the source's response length; each of `successes` is a
/// successful member of the group as `(shared, logprobs)`: the response
/// tokens it shares with the source from the start (the source's own
/// length when it is the source), and its behaviour logprobs, one per
/// response token. The state after `c <= shared` tokens is on that
/// success's path, and the policy that sampled it regenerates the rest of
/// it with probability `exp(sum_{t >= c} logprob_t)`; the bound is the
/// largest such probability over the successes through that state:
///
/// ```text
/// q(c) = max_{m : shared_m >= c} exp( sum_{t = c}^{len_m - 1} lp_m[t] )     (0 when no success passes)
/// ```
///
/// Other successful continuations only add to the true pass probability,
/// so `q` is a lower bound for the policy that sampled the group. Returns
/// `len + 1` entries.
pub fn pass_estimate(len: usize, successes: &[(usize, &[f32])]) -> Vec<f64> {
    let mut q = vec![0.0f64; len + 1];
    for &(shared, lp) in successes {
        let mut tail = 0.0f64;
        let mut tails = vec![0.0f64; lp.len() + 1];
        for t in (0..lp.len()).rev() {
            tail += f64::from(lp[t]);
            tails[t] = tail;
        }
        for (c, qc) in q
            .iter_mut()
            .enumerate()
            .take(shared.min(len).min(lp.len()) + 1)
        {
            *qc = qc.max(tails[c].exp());
        }
    }
    q
}

/// The prefix length for `ratio` of a `len`-token response: the allowed cut
/// nearest to `ratio * len` (ties to the shorter), strictly inside
/// `(0, len)` so that something is replayed and something is left to
/// generate. `None` when no such cut exists.
pub fn snap_cut(
    len: usize,
    ratio: f64,
    granularity: CutGranularity,
    boundaries: &[usize],
) -> Result<Option<usize>> {
    check_range("ratio", ratio, 0.0, 1.0)?;
    let target = ratio * len as f64;
    Ok(match granularity {
        CutGranularity::Tokens => (len >= 2).then(|| (target.round() as usize).clamp(1, len - 1)),
        CutGranularity::Boundaries => allowed_cuts(len, granularity, boundaries)
            .into_iter()
            .min_by(|&a, &b| {
                let (da, db) = ((a as f64 - target).abs(), (b as f64 - target).abs());
                da.total_cmp(&db).then(a.cmp(&b))
            }),
    })
}

/// Every allowed cut strictly inside `(0, len)`, ascending: each token for
/// [`CutGranularity::Tokens`], the listed boundaries otherwise.
pub fn allowed_cuts(len: usize, granularity: CutGranularity, boundaries: &[usize]) -> Vec<usize> {
    match granularity {
        CutGranularity::Tokens => (1..len).collect(),
        CutGranularity::Boundaries => {
            let mut v: Vec<usize> = boundaries
                .iter()
                .copied()
                .filter(|&b| b > 0 && b < len)
                .collect();
            v.sort_unstable();
            v.dedup();
            v
        }
    }
}

/// Bisection of one skewed group's cut over its source's allowed cuts.
///
/// A re-rollout group that came out all-pass or all-fail says which way
/// the prefix was wrong: a hard group (successful source) that all failed
/// needs a longer head start, one that all passed a shorter one; an easy
/// group (failed source) that all passed needs a longer handicap, one that
/// all failed a shorter one (its prefix already holds the error). The next
/// cut is the median allowed cut strictly between the bounds learnt so far
/// (`lo < cut < hi`, starting from `0 < cut < len`), so each attempt halves
/// the interval.
#[derive(Clone, Debug, PartialEq)]
pub struct CutSearch {
    cuts: Vec<usize>,
    direction: Direction,
    lo: usize,
    hi: usize,
    cut: usize,
}

impl CutSearch {
    /// The search over `cuts` (ascending, inside `(0, len)`), first trying
    /// `first`.
    pub fn new(cuts: Vec<usize>, len: usize, first: usize, direction: Direction) -> Self {
        CutSearch {
            cuts,
            direction,
            lo: 0,
            hi: len,
            cut: first,
        }
    }

    /// The cut of the current attempt.
    pub fn cut(&self) -> usize {
        self.cut
    }

    /// The attempt at [`cut`](Self::cut) came out all-pass (`all_passed`)
    /// or all-fail: narrow the interval and return the next cut, `None`
    /// when no allowed cut is left inside it.
    pub fn refine(&mut self, all_passed: bool) -> Option<usize> {
        let longer = match self.direction {
            Direction::Hard => !all_passed,
            Direction::Easy => all_passed,
        };
        if longer {
            self.lo = self.cut;
        } else {
            self.hi = self.cut;
        }
        let inside: Vec<usize> = self
            .cuts
            .iter()
            .copied()
            .filter(|&c| c > self.lo && c < self.hi)
            .collect();
        let next = *inside.get(inside.len() / 2)?;
        self.cut = next;
        Some(next)
    }
}

/// Settings of the per-bucket ratio controller.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ControllerConfig {
    /// Pass rate to hold (0.5).
    pub target: f64,
    /// EMA decay `d` in `[0, 1)`.
    pub ema_decay: f64,
    /// Proportional gain `eta >= 0` (0: fixed ratio).
    pub eta: f64,
    /// Smallest replay ratio, in `[0, 1]`.
    pub r_min: f64,
    /// Largest replay ratio, in `[r_min, 1]`.
    pub r_max: f64,
    /// Ratio of a bucket before its first update.
    pub initial_ratio: f64,
}

impl Default for ControllerConfig {
    fn default() -> Self {
        ControllerConfig {
            target: 0.5,
            ema_decay: 0.8,
            eta: 0.25,
            r_min: 0.05,
            r_max: 0.95,
            initial_ratio: 0.5,
        }
    }
}

impl ControllerConfig {
    /// The fixed-ratio ablation: every bucket replays `ratio` forever.
    pub fn fixed(ratio: f64) -> Self {
        ControllerConfig {
            eta: 0.0,
            r_min: 0.0,
            r_max: 1.0,
            initial_ratio: ratio,
            ..ControllerConfig::default()
        }
    }

    /// Checks the ranges.
    pub fn validate(&self) -> Result<()> {
        check_range("target", self.target, 0.0, 1.0)?;
        check_range("ema_decay", self.ema_decay, 0.0, 0.999_999)?;
        check_range("eta", self.eta, 0.0, 10.0)?;
        check_range("r_min", self.r_min, 0.0, 1.0)?;
        check_range("r_max", self.r_max, self.r_min, 1.0)?;
        check_range("initial_ratio", self.initial_ratio, self.r_min, self.r_max)
    }
}

/// Controller state of one bucket.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct BucketState {
    pub ratio: f64,
    pub ema: Option<f64>,
    pub updates: u64,
}

/// Per-bucket EMA controller of the prefix ratio.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PrefixController {
    cfg: ControllerConfig,
    buckets: BTreeMap<Bucket, BucketState>,
    /// What a bucket's ratio sets ([`CutRule`]): the replayed fraction
    /// (`sign_b` by direction) or the aimed pass estimate (`sign_b = +1`
    /// for every bucket: a higher aim raises the pass rate either way).
    #[serde(default)]
    rule: CutRule,
}

impl PrefixController {
    /// A controller with no bucket seen yet.
    pub fn new(cfg: ControllerConfig) -> Result<Self> {
        cfg.validate()?;
        Ok(PrefixController {
            cfg,
            buckets: BTreeMap::new(),
            rule: CutRule::Ratio,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &ControllerConfig {
        &self.cfg
    }

    /// The current ratio of a bucket.
    pub fn ratio(&self, b: Bucket) -> f64 {
        self.buckets
            .get(&b)
            .map_or(self.cfg.initial_ratio, |s| s.ratio)
    }

    /// The state of every bucket seen so far.
    pub fn buckets(&self) -> &BTreeMap<Bucket, BucketState> {
        &self.buckets
    }

    /// A controller resumed from saved bucket states (e.g. a checkpoint's
    /// list of [`buckets`](Self::buckets) entries).
    pub fn restore(cfg: ControllerConfig, buckets: Vec<(Bucket, BucketState)>) -> Result<Self> {
        cfg.validate()?;
        for (b, st) in &buckets {
            check_range("ratio", st.ratio, cfg.r_min, cfg.r_max)?;
            if b.successes > b.group_size {
                return Err(RlError::input(
                    "bucket",
                    format!("{b} has more successes than members"),
                ));
            }
        }
        Ok(PrefixController {
            cfg,
            buckets: buckets.into_iter().collect(),
            rule: CutRule::Ratio,
        })
    }

    /// The same controller with its ratios read under `rule`.
    pub fn with_rule(mut self, rule: CutRule) -> Self {
        self.rule = rule;
        self
    }

    /// `sign_b`: by the bucket's direction for [`CutRule::Ratio`], `+1`
    /// for [`CutRule::Estimate`].
    pub fn sign(&self, b: Bucket) -> f64 {
        match self.rule {
            CutRule::Ratio => b.direction().sign(),
            CutRule::Estimate => 1.0,
        }
    }

    /// One update with a step's re-rollout outcomes of bucket `b`.
    pub fn observe(&mut self, b: Bucket, successes: u64, trials: u64) -> Result<()> {
        if trials == 0 || successes > trials {
            return Err(RlError::input(
                "observation",
                format!("{successes} successes in {trials} re-rollouts of bucket {b}"),
            ));
        }
        let pass = successes as f64 / trials as f64;
        let c = self.cfg;
        let sign = self.sign(b);
        let st = self.buckets.entry(b).or_insert(BucketState {
            ratio: c.initial_ratio,
            ema: None,
            updates: 0,
        });
        let ema = match st.ema {
            None => pass,
            Some(e) => c.ema_decay * e + (1.0 - c.ema_decay) * pass,
        };
        st.ema = Some(ema);
        st.ratio = (st.ratio + c.eta * sign * (c.target - ema)).clamp(c.r_min, c.r_max);
        st.updates += 1;
        Ok(())
    }
}

/// Settings of the Prefix Sampling planner.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct PsConfig {
    pub group_size: u32,
    /// Half-width of the balanced band around 1/2.
    pub band: f64,
    pub granularity: CutGranularity,
    pub controller: ControllerConfig,
    /// Easy groups: cut a failed source no later than the last allowed cut
    /// inside the prefix it shares with a success
    /// ([`SourceTrajectory::shared`]), so the re-rollouts face the decision
    /// where it went wrong instead of a prefix that may already hold the
    /// error. The bucket ratio still sets the cut when it is shorter.
    #[serde(default)]
    pub anchor: bool,
    /// How a source's cut is chosen.
    #[serde(default)]
    pub cut_rule: CutRule,
    /// Seed of the source choice.
    pub seed: u64,
}

impl PsConfig {
    /// Defaults for groups of `group_size` (band 1/8, token cuts).
    pub fn new(group_size: u32, seed: u64) -> Self {
        PsConfig {
            group_size,
            band: 0.125,
            granularity: CutGranularity::Tokens,
            controller: ControllerConfig::default(),
            anchor: false,
            cut_rule: CutRule::Ratio,
            seed,
        }
    }
}

/// What to do with a group.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GroupPlan {
    /// All-fail or all-pass: no contrast, filtered out.
    Drop,
    /// Balanced (or skewed without a usable source): train on it as is.
    Keep,
    /// Skewed: re-roll from the first `cut` response tokens of member
    /// `source` (every re-rollout of the group shares that one prefix).
    Replay {
        bucket: Bucket,
        source: usize,
        cut: usize,
        /// The bucket ratio the cut was snapped from.
        ratio: f64,
    },
}

/// Plans re-rollouts for skewed groups and feeds their outcomes back to the
/// controller once per step.
#[derive(Clone, Debug)]
pub struct PrefixSampler {
    cfg: PsConfig,
    controller: PrefixController,
    rng: StdRng,
    /// This step's re-rollout outcomes per bucket: (successes, trials).
    pending: BTreeMap<Bucket, (u64, u64)>,
}

impl PrefixSampler {
    /// A sampler for groups of `cfg.group_size`.
    pub fn new(cfg: PsConfig) -> Result<Self> {
        if cfg.group_size < 2 {
            return Err(RlError::config(
                "group_size",
                "groups need at least 2 members",
            ));
        }
        check_range("band", cfg.band, 0.0, 0.5)?;
        Ok(PrefixSampler {
            controller: PrefixController::new(cfg.controller)?.with_rule(cfg.cut_rule),
            rng: StdRng::seed_from_u64(cfg.seed),
            cfg,
            pending: BTreeMap::new(),
        })
    }

    /// A sampler continuing with `controller` (resume, or a new step with a
    /// fresh source-choice seed `cfg.seed`).
    pub fn with_controller(cfg: PsConfig, controller: PrefixController) -> Result<Self> {
        let mut s = PrefixSampler::new(cfg)?;
        s.controller = controller.with_rule(cfg.cut_rule);
        Ok(s)
    }

    /// The controller (ratios and EMAs per bucket).
    pub fn controller(&self) -> &PrefixController {
        &self.controller
    }

    /// Plans a group. The source is one member with the outcome the bucket
    /// needs and a usable cut, drawn by the seeded RNG.
    pub fn plan(&mut self, group: &[SourceTrajectory]) -> Result<GroupPlan> {
        if group.len() != self.cfg.group_size as usize {
            return Err(RlError::input(
                "group",
                format!("{} members, expected {}", group.len(), self.cfg.group_size),
            ));
        }
        let k = group.iter().filter(|t| t.success).count() as u32;
        let bucket = match classify(k, self.cfg.group_size, self.cfg.band)? {
            GroupClass::AllFail | GroupClass::AllPass => return Ok(GroupPlan::Drop),
            GroupClass::Balanced => return Ok(GroupPlan::Keep),
            GroupClass::Skewed(b) => b,
        };
        let ratio = self.controller.ratio(bucket);
        let mut sources = Vec::new();
        for (i, t) in group.iter().enumerate() {
            if let Some(cut) = self.cut_for(bucket, t)? {
                sources.push((i, cut));
            }
        }
        let chosen = if self.cfg.cut_rule == CutRule::Estimate {
            // The source whose cut is expected to pass nearest the aim
            // (the first such member on a tie).
            sources.iter().min_by(|a, b| {
                let gap = |&(i, c): &(usize, usize)| self.gap(bucket, &group[i], c);
                gap(a).total_cmp(&gap(b))
            })
        } else {
            sources.choose(&mut self.rng)
        };
        let Some(&(source, cut)) = chosen else {
            return Ok(GroupPlan::Keep);
        };
        Ok(GroupPlan::Replay {
            bucket,
            source,
            cut,
            ratio,
        })
    }

    /// Where member `t` of a group in `bucket` would be cut as a source:
    /// `None` when its outcome is not the one the bucket needs or it has no
    /// allowed cut. The bucket's ratio, snapped to an allowed cut, and for
    /// easy buckets with [`PsConfig::anchor`] no later than the last
    /// allowed cut inside [`SourceTrajectory::shared`]. With
    /// [`CutRule::Estimate`] and a known estimate, among the allowed cuts
    /// with a positive estimate (`None` when there is none): for a hard
    /// bucket the one whose estimate is nearest to the bucket's aim (ties to
    /// the longer prefix, which generates fewer tokens for the same
    /// expected outcome); for an easy bucket the last one, where the
    /// failure leaves the last success's path (before it, the failure's
    /// states are a success's, and pass more often the later they are;
    /// past it no success gives an estimate).
    pub fn cut_for(&self, bucket: Bucket, t: &SourceTrajectory) -> Result<Option<usize>> {
        let want = bucket.direction().source_success();
        if t.success != want {
            return Ok(None);
        }
        let ratio = self.controller.ratio(bucket);
        if self.cfg.cut_rule == CutRule::Estimate && !t.pass_estimate.is_empty() {
            // The cuts with a positive estimate.
            let mut known = self.allowed_cuts(t).into_iter();
            return Ok(if want {
                known.min_by(|&a, &b| {
                    self.gap(bucket, t, a)
                        .total_cmp(&self.gap(bucket, t, b))
                        .then(b.cmp(&a))
                })
            } else {
                known.next_back()
            });
        }
        let Some(mut cut) = snap_cut(t.len, ratio, self.cfg.granularity, &t.boundaries)? else {
            return Ok(None);
        };
        if self.cfg.anchor && !want && t.shared > 0 {
            let at_shared = allowed_cuts(t.len, self.cfg.granularity, &t.boundaries)
                .into_iter()
                .rfind(|&c| c <= t.shared);
            if let Some(a) = at_shared {
                cut = cut.min(a);
            }
        }
        Ok(Some(cut))
    }

    /// How far the pass estimate of source `t` cut at `cut` lies from the
    /// bucket's aim, `|q(cut) - aim|` ([`CutRule::Estimate`]; `+inf`
    /// without an estimate). [`plan`](Self::plan) draws the source with
    /// the smallest gap, and further sources of a group are taken in
    /// increasing gap.
    pub fn gap(&self, bucket: Bucket, t: &SourceTrajectory, cut: usize) -> f64 {
        match t.pass_estimate.get(cut) {
            Some(q) => (q - self.controller.ratio(bucket)).abs(),
            None => f64::INFINITY,
        }
    }

    /// The cuts a source's [`CutSearch`] may try: the allowed cuts under
    /// this sampler's granularity, and with [`CutRule::Estimate`] and a
    /// known estimate only those with a positive one (so bisection never
    /// moves a failure's cut past the last success's path, where on a task
    /// whose slips cannot be undone every continuation fails).
    pub fn allowed_cuts(&self, source: &SourceTrajectory) -> Vec<usize> {
        let mut cuts = allowed_cuts(source.len, self.cfg.granularity, &source.boundaries);
        if self.cfg.cut_rule == CutRule::Estimate && !source.pass_estimate.is_empty() {
            cuts.retain(|&c| source.pass_estimate.get(c).is_some_and(|&q| q > 0.0));
        }
        cuts
    }

    /// Records outcomes of re-rollouts planned for `bucket` this step.
    pub fn record(&mut self, bucket: Bucket, successes: u64, trials: u64) -> Result<()> {
        if successes > trials {
            return Err(RlError::input(
                "record",
                format!("{successes} successes in {trials} re-rollouts"),
            ));
        }
        let e = self.pending.entry(bucket).or_insert((0, 0));
        e.0 += successes;
        e.1 += trials;
        Ok(())
    }

    /// Ends the step: one controller update per bucket that had
    /// re-rollouts. Returns the step's pass rate per bucket.
    pub fn end_step(&mut self) -> Result<BTreeMap<Bucket, f64>> {
        let mut out = BTreeMap::new();
        for (b, (s, n)) in std::mem::take(&mut self.pending) {
            if n > 0 {
                self.controller.observe(b, s, n)?;
                out.insert(b, s as f64 / n as f64);
            }
        }
        Ok(out)
    }
}

/// Generated vs replayed tokens of a step, against a generated-token budget
/// held equal to the baseline's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenLedger {
    /// Generated-token budget (`None`: unlimited).
    pub budget: Option<u64>,
    /// Tokens the policy generated (first-pass rollouts and continuations).
    pub generated: u64,
    /// Prefix tokens replayed (not generated, masked in the loss).
    pub replayed: u64,
    pub rollouts: u64,
    pub rerollouts: u64,
}

impl TokenLedger {
    /// A ledger with a generated-token budget.
    pub fn with_budget(budget: u64) -> Self {
        TokenLedger {
            budget: Some(budget),
            ..TokenLedger::default()
        }
    }

    /// Generated tokens left (`u64::MAX` when unlimited).
    pub fn remaining(&self) -> u64 {
        self.budget
            .map_or(u64::MAX, |b| b.saturating_sub(self.generated))
    }

    /// True if `tokens` more generated tokens fit in the budget.
    pub fn fits(&self, tokens: u64) -> bool {
        tokens <= self.remaining()
    }

    fn charge(&mut self, generated: u64) -> Result<()> {
        if !self.fits(generated) {
            return Err(RlError::input(
                "generated tokens",
                format!(
                    "{generated} exceed the {} left in the budget",
                    self.remaining()
                ),
            ));
        }
        self.generated += generated;
        Ok(())
    }

    /// Charges a first-pass rollout.
    pub fn charge_rollout(&mut self, generated: u64) -> Result<()> {
        self.charge(generated)?;
        self.rollouts += 1;
        Ok(())
    }

    /// Charges a re-rollout: its continuation is generated, its prefix
    /// replayed.
    pub fn charge_rerollout(&mut self, generated: u64, replayed: u64) -> Result<()> {
        self.charge(generated)?;
        self.replayed += replayed;
        self.rerollouts += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    type Curve = fn(f64, u32) -> f64;

    fn curves() -> Vec<(&'static str, Curve)> {
        vec![
            ("entropy", |p, _| reward_entropy(p).unwrap()),
            ("survival", |p, n| filter_survival(p, n).unwrap()),
            ("rloo", |p, n| rloo_advantage_energy(p, n).unwrap()),
            ("pairs", |p, n| expected_contrastive_pairs(p, n).unwrap()),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        fn why_half_functions_peak_at_one_half(p in 0.0f64..=1.0, q in 0.0f64..=1.0, n in 2u32..17) {
            for (name, f) in curves() {
                let peak = f(0.5, n);
                prop_assert!(f(p, n) <= peak + 1e-12, "{name}: f({p}) > f(0.5)");
                // Symmetric, and non-increasing in the distance from 1/2.
                prop_assert!((f(p, n) - f(1.0 - p, n)).abs() < 1e-12, "{name} not symmetric");
                let (near, far) = if (p - 0.5).abs() <= (q - 0.5).abs() { (p, q) } else { (q, p) };
                prop_assert!(f(near, n) + 1e-12 >= f(far, n), "{name}: not unimodal at {near}, {far}");
                if (p - 0.5).abs() > 1e-6 {
                    prop_assert!(f(p, n) < peak, "{name}: 0.5 is not the strict maximum");
                }
            }
        }

                #[test]
        fn ledger_never_exceeds_its_budget(
            budget in 0u64..2_000,
            charges in prop::collection::vec((0u64..300, 0u64..300, any::<bool>()), 0..40),
        ) {
            let mut l = TokenLedger::with_budget(budget);
            for (g, r, re) in charges {
                let before = l;
                let res = if re { l.charge_rerollout(g, r) } else { l.charge_rollout(g) };
                prop_assert_eq!(res.is_ok(), before.generated + g <= budget);
                if res.is_err() {
                    prop_assert_eq!(l, before);
                }
                prop_assert!(l.generated <= budget);
            }
        }

        #[test]
        fn plans_replace_skewed_groups_one_for_one(
            outcomes in prop::collection::vec(any::<bool>(), 8),
            lens in prop::collection::vec(2usize..200, 8),
            seed in any::<u64>(),
            tokens in any::<bool>(),
        ) {
            let mut cfg = PsConfig::new(8, seed);
            if !tokens {
                cfg.granularity = CutGranularity::Boundaries;
            }
            let mut ps = PrefixSampler::new(cfg).unwrap();
            let group: Vec<SourceTrajectory> = outcomes
                .iter()
                .zip(&lens)
                .map(|(&success, &len)| SourceTrajectory {
                    success,
                    len,
                    boundaries: (0..len).step_by(7).collect(),
                    shared: 0,
                    pass_estimate: Vec::new(),
                })
                .collect();
            let k = outcomes.iter().filter(|x| **x).count() as u32;
            match ps.plan(&group).unwrap() {
                GroupPlan::Replay { bucket, source, cut, .. } => {
                    prop_assert_eq!(bucket.successes, k);
                    let src = &group[source];
                    prop_assert_eq!(src.success, bucket.direction().source_success());
                    prop_assert!(cut > 0 && cut < src.len);
                }
                GroupPlan::Drop => prop_assert!(k == 0 || k == 8),
                GroupPlan::Keep => prop_assert!(k > 0 && k < 8),
            }
        }

        #[test]
        fn contrastive_pairs_peak_at_half_the_group(k in 0u32..=16, n in 2u32..17) {
            prop_assume!(k <= n);
            let best = contrastive_pairs(n / 2, n).unwrap();
            prop_assert!(contrastive_pairs(k, n).unwrap() <= best);
        }
    }

    /// The closed forms against enumeration over `k ~ Binomial(n, p)`.
    #[test]
    fn closed_forms_match_enumeration() {
        for n in 2u32..9 {
            for &p in &[0.1, 0.37, 0.5, 0.8] {
                let mut pk = vec![0.0; n as usize + 1];
                // Binomial pmf by repeated convolution.
                pk[0] = 1.0;
                for _ in 0..n {
                    for k in (0..=n as usize).rev() {
                        pk[k] = pk[k] * (1.0 - p) + if k > 0 { pk[k - 1] * p } else { 0.0 };
                    }
                }
                let nf = f64::from(n);
                let (mut pairs, mut energy, mut surv) = (0.0, 0.0, 0.0);
                for (k, w) in pk.iter().enumerate() {
                    let kf = k as f64;
                    pairs += w * kf * (nf - kf);
                    if k > 0 && k < n as usize {
                        surv += w;
                    }
                    // A_i for a success: 1 - (k-1)/(n-1); for a failure: -k/(n-1).
                    let a1 = 1.0 - (kf - 1.0) / (nf - 1.0);
                    let a0 = -kf / (nf - 1.0);
                    energy += w * (kf * a1 * a1 + (nf - kf) * a0 * a0) / nf;
                }
                assert!((pairs - expected_contrastive_pairs(p, n).unwrap()).abs() < 1e-12);
                assert!((energy - rloo_advantage_energy(p, n).unwrap()).abs() < 1e-12);
                assert!((surv - filter_survival(p, n).unwrap()).abs() < 1e-12);
            }
        }
        assert!(reward_entropy(1.5).is_err() && rloo_advantage_energy(0.5, 1).is_err());
        assert!(contrastive_pairs(3, 2).is_err());
    }

    #[test]
    fn buckets_for_groups_of_eight() {
        let skewed: Vec<u32> = (0..=8)
            .filter(|&k| matches!(classify(k, 8, 0.125).unwrap(), GroupClass::Skewed(_)))
            .collect();
        assert_eq!(skewed, vec![1, 2, 6, 7]);
        assert_eq!(classify(0, 8, 0.125).unwrap(), GroupClass::AllFail);
        assert_eq!(classify(8, 8, 0.125).unwrap(), GroupClass::AllPass);
        assert_eq!(classify(4, 8, 0.125).unwrap(), GroupClass::Balanced);
        let b = Bucket {
            successes: 2,
            group_size: 8,
        };
        assert_eq!(b.direction(), Direction::Hard);
        assert_eq!(
            Bucket {
                successes: 6,
                group_size: 8
            }
            .direction(),
            Direction::Easy
        );
        assert!(classify(9, 8, 0.125).is_err());
    }

    #[test]
    fn cuts_snap_to_boundaries() {
        assert_eq!(
            snap_cut(100, 0.33, CutGranularity::Tokens, &[]).unwrap(),
            Some(33)
        );
        assert_eq!(
            snap_cut(100, 0.0, CutGranularity::Tokens, &[]).unwrap(),
            Some(1)
        );
        assert_eq!(
            snap_cut(100, 1.0, CutGranularity::Tokens, &[]).unwrap(),
            Some(99)
        );
        assert_eq!(snap_cut(1, 0.5, CutGranularity::Tokens, &[]).unwrap(), None);
        let b = [0, 20, 45, 70, 100];
        assert_eq!(
            snap_cut(100, 0.32, CutGranularity::Boundaries, &b).unwrap(),
            Some(20)
        );
        assert_eq!(
            snap_cut(100, 0.34, CutGranularity::Boundaries, &b).unwrap(),
            Some(45)
        );
        // Tie (32.5 from 20 and 45) goes to the shorter prefix.
        assert_eq!(
            snap_cut(100, 0.325, CutGranularity::Boundaries, &b).unwrap(),
            Some(20)
        );
        assert_eq!(
            snap_cut(100, 0.99, CutGranularity::Boundaries, &b).unwrap(),
            Some(70)
        );
        assert_eq!(
            snap_cut(100, 0.5, CutGranularity::Boundaries, &[0, 100]).unwrap(),
            None
        );
        assert!(snap_cut(100, 1.5, CutGranularity::Tokens, &[]).is_err());
    }

    /// The bucket of `successes` in a group of 8.
    fn of8(successes: u32) -> Bucket {
        Bucket {
            successes,
            group_size: 8,
        }
    }

    fn member(success: bool) -> SourceTrajectory {
        SourceTrajectory {
            success,
            len: 40,
            boundaries: vec![10, 20, 30],
            shared: 0,
            pass_estimate: Vec::new(),
        }
    }

    #[test]
    fn easy_groups_anchor_at_the_shared_prefix() {
        let mut cfg = PsConfig::new(8, 1);
        cfg.granularity = CutGranularity::Boundaries;
        cfg.controller = ControllerConfig::fixed(0.75);
        // 7/8: the failure shares 14 tokens with a success; ratio 0.75 -> 30.
        let mut g: Vec<_> = (0..8).map(|i| member(i != 3)).collect();
        g[3].shared = 14;
        let cut_of = |anchor: bool, g: &[SourceTrajectory]| {
            let mut ps = PrefixSampler::new(PsConfig { anchor, ..cfg }).unwrap();
            match ps.plan(g).unwrap() {
                GroupPlan::Replay { cut, .. } => cut,
                p => panic!("{p:?}"),
            }
        };
        assert_eq!(cut_of(false, &g), 30);
        assert_eq!(
            cut_of(true, &g),
            10,
            "last boundary inside the shared prefix"
        );
        // Nothing allowed inside it, or a shorter ratio cut: the ratio's.
        g[3].shared = 5;
        assert_eq!(cut_of(true, &g), 30);
        // Hard groups ignore it.
        let mut h: Vec<_> = (0..8).map(|i| member(i == 3)).collect();
        h[3].shared = 14;
        assert_eq!(cut_of(true, &h), 30);
    }

    #[test]
    fn pass_estimates_are_the_best_success_path_through_each_state() {
        // Source of 4 tokens; success A is the source itself, success B
        // shares its first 2 tokens, success C shares none.
        let a = [-0.1f32, -0.2, -0.3, -0.4];
        let b = [-0.1f32, -0.2, -0.05, -0.05, -0.05];
        let c = [-0.01f32; 6];
        let q = pass_estimate(4, &[(4, &a), (2, &b), (0, &c)]);
        // Brute force in f64: for each state, the largest product of the
        // remaining probabilities over the successes through it.
        let tail = |lp: &[f32], from: usize| -> f64 {
            lp[from..].iter().map(|&x| f64::from(x).exp()).product()
        };
        let want = [
            tail(&a, 0).max(tail(&b, 0)).max(tail(&c, 0)),
            tail(&a, 1).max(tail(&b, 1)),
            tail(&a, 2).max(tail(&b, 2)),
            tail(&a, 3),
            1.0,
        ];
        assert_eq!(q.len(), 5);
        for (c, (got, want)) in q.iter().zip(want).enumerate() {
            assert!((got - want).abs() < 1e-12, "state {c}: {got} vs {want}");
        }
        // A failure that no success passes through has no estimate past 0.
        let f = pass_estimate(3, &[(0, &b)]);
        assert_eq!(&f[1..], &[0.0, 0.0, 0.0]);
        assert!(pass_estimate(3, &[]).iter().all(|&x| x == 0.0));
    }

    #[test]
    fn estimate_rule_cuts_where_the_estimate_meets_the_aim() {
        let mut cfg = PsConfig::new(8, 5);
        cfg.granularity = CutGranularity::Boundaries;
        cfg.cut_rule = CutRule::Estimate;
        cfg.controller = ControllerConfig::fixed(0.5);
        let (hard, easy) = (of8(1), of8(7));
        let ps = PrefixSampler::new(cfg).unwrap();
        // Estimates at 0, 10, 20, 30, 40 tokens (boundaries 10, 20, 30).
        let mut src = member(true);
        src.pass_estimate = (0..=40)
            .map(|c| match c {
                0..=9 => 0.05,
                10..=19 => 0.2,
                20..=29 => 0.45,
                30..=39 => 0.9,
                _ => 1.0,
            })
            .collect();
        assert_eq!(ps.cut_for(hard, &src).unwrap(), Some(20));
        // Ties go to the longer prefix.
        src.pass_estimate[20] = 0.25;
        src.pass_estimate[30] = 0.75;
        assert_eq!(ps.cut_for(hard, &src).unwrap(), Some(30));
        // An easy group's failed source is cut at the last cut still on a
        // success's path (past it the estimate is 0), whatever the aim; a
        // source with no positive estimate gives none.
        let mut fail = member(false);
        fail.pass_estimate = (0..=40)
            .map(|c| if c <= 22 { 0.5 + 0.01 * c as f64 } else { 0.0 })
            .collect();
        assert_eq!(ps.cut_for(easy, &fail).unwrap(), Some(20));
        fail.pass_estimate = vec![0.0; 41];
        assert_eq!(ps.cut_for(easy, &fail).unwrap(), None);
        // Without an estimate the ratio rule applies.
        assert_eq!(ps.cut_for(easy, &member(false)).unwrap(), Some(20));

        // Of a 2/8 group's successes, the one whose best cut comes nearest
        // the aim is the source, wherever it sits in the group.
        let mut ps = PrefixSampler::new(cfg).unwrap();
        let mut g: Vec<_> = (0..8).map(|i| member(i == 1 || i == 6)).collect();
        g[1].pass_estimate = vec![0.1; 41];
        g[6].pass_estimate = (0..=40).map(|c| if c == 30 { 0.55 } else { 0.1 }).collect();
        for _ in 0..4 {
            match ps.plan(&g).unwrap() {
                GroupPlan::Replay { source, cut, .. } => assert_eq!((source, cut), (6, 30)),
                p => panic!("{p:?}"),
            }
        }
        assert!((ps.gap(of8(2), &g[6], 30) - 0.05).abs() < 1e-12);
        // The cut search of a failure stays on the successes' path.
        let mut fail = member(false);
        fail.pass_estimate = (0..=40).map(|c| if c <= 22 { 0.9 } else { 0.0 }).collect();
        assert_eq!(ps.allowed_cuts(&fail), vec![10, 20]);
        assert_eq!(ps.allowed_cuts(&member(false)), vec![10, 20, 30]);
        assert_eq!(ps.gap(of8(2), &member(true), 30), f64::INFINITY);
    }

    #[test]
    fn estimate_rule_raises_every_buckets_aim_when_it_passes_too_rarely() {
        let b = of8;
        for rule in [CutRule::Ratio, CutRule::Estimate] {
            let mut c = PrefixController::new(ControllerConfig::default())
                .unwrap()
                .with_rule(rule);
            c.observe(b(1), 0, 8).unwrap();
            c.observe(b(7), 0, 8).unwrap();
            let (hard, easy) = (c.ratio(b(1)), c.ratio(b(7)));
            assert!(hard > 0.5, "{rule:?}: a hard bucket's head start grows");
            match rule {
                // A shorter failed prefix is a smaller handicap.
                CutRule::Ratio => assert!(easy < 0.5),
                // A higher aimed estimate, whichever the direction.
                CutRule::Estimate => assert!(easy > 0.5),
            }
        }
    }

    #[test]
    fn planner_picks_sources_by_direction() {
        let mut cfg = PsConfig::new(8, 3);
        cfg.granularity = CutGranularity::Boundaries;
        let mut ps = PrefixSampler::new(cfg).unwrap();
        // 2/8 hard: sources must be the two successes.
        let mut g: Vec<_> = (0..8).map(|i| member(i == 2 || i == 5)).collect();
        let mut picked = std::collections::BTreeSet::new();
        for _ in 0..32 {
            let GroupPlan::Replay {
                bucket,
                source,
                cut,
                ratio,
            } = ps.plan(&g).unwrap()
            else {
                panic!()
            };
            assert_eq!(
                bucket,
                Bucket {
                    successes: 2,
                    group_size: 8
                }
            );
            assert!((source == 2 || source == 5) && cut == 20 && ratio == 0.5);
            picked.insert(source);
        }
        assert_eq!(picked.len(), 2, "both sources get drawn");
        // 7/8 easy: the one failure.
        g = (0..8).map(|i| i != 6).map(member).collect();
        let GroupPlan::Replay { source, .. } = ps.plan(&g).unwrap() else {
            panic!()
        };
        assert_eq!(source, 6);
        g = (0..8).map(|i| i < 4).map(member).collect();
        assert_eq!(ps.plan(&g).unwrap(), GroupPlan::Keep);
        g = (0..8).map(|_| true).map(member).collect();
        assert_eq!(ps.plan(&g).unwrap(), GroupPlan::Drop);
        assert!(ps.plan(&g[..3]).is_err());
    }

    #[test]
    fn cut_search_bisects_toward_the_missing_outcome() {
        let cuts = allowed_cuts(16, CutGranularity::Tokens, &[]);
        assert_eq!(cuts, (1..16).collect::<Vec<_>>());
        // Hard (successful source): all failed -> longer, all passed -> shorter.
        let mut s = CutSearch::new(cuts.clone(), 16, 8, Direction::Hard);
        assert_eq!(s.refine(false), Some(12));
        assert_eq!(s.refine(true), Some(10));
        assert_eq!(s.refine(true), Some(9));
        assert_eq!(s.refine(false), None, "nothing left between 9 and 10");
        // Easy (failed source): all failed -> shorter, all passed -> longer.
        let mut s = CutSearch::new(cuts, 16, 8, Direction::Easy);
        assert_eq!(s.refine(false), Some(4));
        assert_eq!(s.refine(true), Some(6));
        assert_eq!(s.cut(), 6);
        // Boundaries: only listed cuts, inside (0, len).
        let b = allowed_cuts(40, CutGranularity::Boundaries, &[30, 0, 10, 40, 20, 10]);
        assert_eq!(b, vec![10, 20, 30]);
        let mut s = CutSearch::new(b, 40, 20, Direction::Hard);
        assert_eq!(s.refine(false), Some(30));
        assert_eq!(s.refine(false), None);
    }

    #[test]
    fn controller_moves_ratio_toward_target_and_stays_bounded() {
        let cfg = ControllerConfig {
            ema_decay: 0.5,
            eta: 0.5,
            ..Default::default()
        };
        let mut c = PrefixController::new(cfg).unwrap();
        let (hard, easy) = (of8(1), of8(7));
        c.observe(hard, 1, 10).unwrap(); // pass 0.1 < 0.5: longer success prefix
        assert!((c.ratio(hard) - (0.5 + 0.5 * 0.4)).abs() < 1e-12);
        c.observe(easy, 9, 10).unwrap(); // pass 0.9 > 0.5: longer failure prefix
        assert!((c.ratio(easy) - (0.5 + 0.5 * 0.4)).abs() < 1e-12);
        for _ in 0..100 {
            c.observe(hard, 0, 10).unwrap();
        }
        assert_eq!(c.ratio(hard), cfg.r_max);
        // EMA: 0.5 * 0.1 + 0.5 * 0.5 after one more observation of 0.5.
        let mut c2 = PrefixController::new(cfg).unwrap();
        c2.observe(hard, 1, 10).unwrap();
        c2.observe(hard, 5, 10).unwrap();
        assert!((c2.buckets()[&hard].ema.unwrap() - 0.3).abs() < 1e-12);
        assert!(c.observe(hard, 3, 2).is_err());
        let fixed = ControllerConfig::fixed(0.3);
        let mut f = PrefixController::new(fixed).unwrap();
        f.observe(hard, 0, 10).unwrap();
        assert_eq!(f.ratio(hard), 0.3);
        assert!(PrefixController::new(ControllerConfig {
            r_min: 0.9,
            r_max: 0.1,
            ..cfg
        })
        .is_err());
    }

    #[test]
    fn ledger_holds_the_budget() {
        let mut l = TokenLedger::with_budget(100);
        l.charge_rollout(60).unwrap();
        l.charge_rerollout(30, 50).unwrap();
        assert!(l.charge_rerollout(11, 5).is_err());
        assert_eq!(
            (l.generated, l.replayed, l.rollouts, l.rerollouts),
            (90, 50, 1, 1)
        );
        assert!(l.fits(10) && !l.fits(11));
    }
}
