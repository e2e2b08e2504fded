//! Prefix Sampling: GRPO groups, plus, for each group whose pass rate is
//! skewed, a group of re-rollouts that continue from one replayed prefix of
//! one of its trajectories, with a per-bucket controller steering the
//! prefix ratio toward a 50% pass rate and a per-group bisection of the
//! cut when a re-rollout group comes out all-pass or all-fail.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use arbor_rl::baselines::{AdvantageEstimator, Grpo};
use arbor_rl::credit::{loss_rows, Sharing};
use arbor_rl::prefix::{
    classify, pass_estimate, Bucket, BucketState, CutGranularity, CutRule, CutSearch, GroupClass,
    GroupPlan, PrefixController, PrefixSampler, PsConfig, SourceTrajectory,
};
use arbor_rl::{NodeId, RolloutTree};
use serde::{Deserialize, Serialize};

use super::conts::{advance, to_steps, Cont, Elsewhere, Replayed};
use super::sched::Scheduler;
use super::span::{check_of, exchange, owner};
use super::{
    PolicyState, RolloutConfig, RolloutPolicy, StepContext, StepRollouts, TaskInstance,
    TokenEpisode,
};
use crate::config::{PsCut, PsReplay, PsSettings, TrainConfig};
use crate::dist::Collective;
use crate::TrainError;

/// Prefix Sampling over GRPO groups of `n`, with its controller's state.
#[derive(Debug, Clone)]
pub struct PsPolicy {
    /// Tasks of a step's first pass.
    tasks: usize,
    n: usize,
    /// With a matched budget: the GRPO baseline's tasks per step.
    budget_prompts: Option<usize>,
    settings: PsSettings,
    /// The run seed (each step's source choices derive from it and the step).
    seed: u64,
    /// Controller state per bucket, carried across steps.
    buckets: Vec<(Bucket, BucketState)>,
}

impl PsPolicy {
    /// The policy of `cfg` (`algo = "ps"`): with `ps.match_budget`, the
    /// first pass runs on `cfg.ps_first_pass_prompts()` tasks.
    pub fn new(cfg: &TrainConfig) -> Self {
        let matched = cfg.ps.match_budget;
        PsPolicy {
            tasks: if matched {
                cfg.ps_first_pass_prompts()
            } else {
                cfg.prompts_per_step
            },
            n: cfg.samples_per_prompt,
            budget_prompts: matched.then_some(cfg.prompts_per_step),
            settings: cfg.ps,
            seed: cfg.seed,
            buckets: Vec::new(),
        }
    }
}

impl RolloutPolicy for PsPolicy {
    fn tasks_per_step(&self) -> usize {
        self.tasks
    }

    /// The first pass's share of the budget, at the first pass's tokens
    /// per task (`per_task`); re-rollouts spend the rest.
    fn tasks_for_budget(&self, tokens: u64, per_task: f64) -> usize {
        let share = if self.budget_prompts.is_some() {
            1.0 - self.settings.reserve
        } else {
            1.0
        };
        super::tasks_buying(share * tokens as f64, per_task)
    }

    /// Every rank judges every group and makes the same re-rollout
    /// decisions; each runs its own tasks' trajectories and replays (see
    /// [`PsStep::run`]).
    fn spans_ranks(&self) -> bool {
        true
    }

    fn rollouts(
        &mut self,
        ctx: StepContext<'_>,
        tasks: Vec<TaskInstance>,
    ) -> Result<StepRollouts, TrainError> {
        let cut = cut_mode(self.settings.cut, ctx.rollout);
        let pcfg = PsConfig {
            group_size: self.n as u32,
            band: self.settings.band,
            granularity: match cut {
                PsCut::Tokens => CutGranularity::Tokens,
                _ => CutGranularity::Boundaries,
            },
            controller: self.settings.controller,
            anchor: self.settings.anchor,
            cut_rule: self.settings.cut_rule,
            seed: self.seed ^ ctx.step.wrapping_mul(0x9E37_79B9),
        };
        let ctl = PrefixController::restore(self.settings.controller, self.buckets.clone())?;
        let mut sampler = PrefixSampler::with_controller(pcfg, ctl)?;
        let step = PsStep {
            n: self.n,
            m: match self.settings.rerollouts {
                0 => self.n,
                m => m,
            },
            cut,
            settings: self.settings,
            budget_prompts: self.budget_prompts,
        };
        let r = step.run(ctx, tasks, &mut sampler)?;
        self.buckets = sampler
            .controller()
            .buckets()
            .iter()
            .map(|(b, s)| (*b, *s))
            .collect();
        Ok(r)
    }

    fn state(&self) -> PolicyState {
        PolicyState {
            ps_buckets: self.buckets.clone(),
        }
    }

    fn restore(&mut self, state: &PolicyState) -> Result<(), TrainError> {
        self.buckets = state.ps_buckets.clone();
        Ok(())
    }
}

/// `auto` resolved for the task: segment boundaries where an episode has
/// several segments, tokens where it has one.
fn cut_mode(cut: PsCut, rollout: &RolloutConfig) -> PsCut {
    match cut {
        PsCut::Auto if rollout.max_segments > 1 => PsCut::Boundaries,
        PsCut::Auto => PsCut::Tokens,
        c => c,
    }
}

/// What a Prefix Sampling step did, in `metrics.jsonl` under `ps`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PsReport {
    /// First-pass groups that came out all-fail or all-pass (not trained).
    pub groups_degenerate: usize,
    /// First-pass groups inside the balanced band (trained as they are).
    pub groups_balanced: usize,
    /// First-pass groups with a skewed pass rate (trained as they are with
    /// `keep_skewed`, and given re-rollouts).
    pub groups_skewed: usize,
    /// Skewed groups that got no re-rollouts (no usable source or cut, no
    /// budget left, or a replay dropped); with `sources > 1`, counted per
    /// source.
    pub skewed_unserved: usize,
    /// Re-rollout groups generated (every attempt).
    pub reroll_groups: usize,
    /// Of those, the ones with mixed outcomes (trained).
    pub reroll_trained: usize,
    /// Of those, the ones whose members all ended alike (not trained).
    pub reroll_degenerate: usize,
    /// Probes (the first members of an attempt) whose outcomes all agreed:
    /// no group was formed at that cut, the next attempt bisected it.
    pub probes_agreed: usize,
    /// Attempts after a degenerate one or an agreeing probe.
    pub reroll_retries: usize,
    /// Re-rollouts generated that ended in no trained group (agreeing
    /// probes and degenerate groups), and their generated tokens.
    pub rerollouts_wasted: usize,
    pub reroll_tokens_wasted: u64,
    /// Re-rollouts of the step (every attempt) and their generated tokens.
    pub rerollouts: usize,
    pub reroll_tokens: u64,
    /// Replays dropped because an action of the prefix failed in the
    /// environment.
    pub replay_failed: usize,
    /// Replays dropped because an observation (or the episode's end)
    /// differed from the recorded one.
    pub replay_diverged: usize,
    /// Pass rate of the first pass (all its groups; comparable with GRPO's).
    pub first_pass_pass_rate: f64,
    /// Pass rate of every re-rollout of the step (all attempts).
    pub reroll_pass_rate: Option<f64>,
    /// Per bucket (`1/8`): the step's first-attempt pass rate and trials,
    /// and the controller's EMA and ratio after the step.
    pub buckets: BTreeMap<String, PsBucketReport>,
}

/// One bucket's line of a [`PsReport`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PsBucketReport {
    pub pass_rate: Option<f64>,
    pub trials: u64,
    /// Attempts of the step (all of them) that formed no group: agreeing
    /// probes and degenerate groups.
    pub no_group: u64,
    pub ema: Option<f64>,
    pub ratio: f64,
}

/// One Prefix Sampling step's settings.
struct PsStep {
    /// First-pass group size.
    n: usize,
    /// Re-rollout group size.
    m: usize,
    /// The resolved cut mode (never `Auto`).
    cut: PsCut,
    settings: PsSettings,
    budget_prompts: Option<usize>,
}

/// A skewed group's re-rollouts: its source, its cut search, the attempt
/// in flight.
struct Search {
    /// The group (task index).
    group: usize,
    /// The source member within the group.
    source: usize,
    bucket: Bucket,
    cuts: CutSearch,
    attempt: u32,
    /// The rebuilt start of the current attempt; members fork its
    /// environment.
    prefix: Option<Prefix>,
    /// Members launched at the current cut, those before the wave in
    /// flight, and those finished.
    launched: usize,
    wave_start: usize,
    done: Vec<Cont>,
    /// Generated tokens reserved for the wave in flight.
    reserved: u64,
}

/// The re-rollout phase's books: the budget, who owns which launch, and
/// the outcomes the report and the controller need.
#[derive(Default)]
struct Accounts {
    /// Generated tokens spent or reserved so far in the step.
    committed: u64,
    budget: Option<u64>,
    /// Scheduler launch key -> search.
    owner: HashMap<usize, usize>,
    /// Per bucket: successes and members of each group's first attempt.
    first_attempts: BTreeMap<Bucket, (u64, u64)>,
    /// Per bucket: attempts that formed no group.
    no_group: BTreeMap<Bucket, u64>,
    rerollouts: usize,
    reroll_wins: usize,
    /// A digest of every wave launched (search, cut, members), the same on
    /// every rank while they agree.
    trace: u64,
}

/// The environment, context and masked prefix a re-rollout starts from.
struct Prefix {
    env: Box<dyn TokenEpisode>,
    context: Vec<u32>,
    replayed: Vec<Replayed>,
    head: Vec<u32>,
    /// The kind of the first segment after the prefix.
    next: arbor_rl::TokenKind,
}

/// A prefix whose environment is a fresh episode still to be driven
/// through the replayed actions (`execute`), or already rebuilt.
struct PrefixJob {
    prefix: Prefix,
    execute: bool,
}

impl PrefixJob {
    /// Replay through execution: each replayed action goes through the
    /// environment's parser and executor, in order, and must produce the
    /// recorded observation (as the environment judges it:
    /// [`TokenEpisode::same_observation`]) without ending the episode.
    fn run(self) -> Result<Prefix, ReplayMiss> {
        let mut p = self.prefix;
        if self.execute {
            for r in &p.replayed {
                let out = p.env.step(&r.action).map_err(|_| ReplayMiss::Failed)?;
                if out.reward.is_some()
                    || out.restart != r.restart
                    || !p.env.same_observation(&r.observation, &out.observation)
                {
                    return Err(ReplayMiss::Diverged);
                }
            }
        }
        Ok(p)
    }
}

/// Why a replay was dropped.
#[derive(Debug)]
enum ReplayMiss {
    /// The environment refused an action of the prefix.
    Failed,
    /// An observation (or the episode's end) differed from the recording.
    Diverged,
}

impl ReplayMiss {
    /// A replay's outcome as one byte (0: it held), for the other ranks.
    fn code(r: &Result<Prefix, ReplayMiss>) -> u8 {
        match r {
            Ok(_) => 0,
            Err(ReplayMiss::Failed) => 1,
            Err(ReplayMiss::Diverged) => 2,
        }
    }

    /// The miss of a nonzero [`ReplayMiss::code`].
    fn of_code(code: u8) -> Option<ReplayMiss> {
        match code {
            0 => None,
            1 => Some(ReplayMiss::Failed),
            _ => Some(ReplayMiss::Diverged),
        }
    }
}

/// This rank's place in the group that shares the step's tasks.
struct Ranks<'a> {
    group: &'a mut dyn Collective,
    /// The tasks this rank runs.
    owned: std::ops::Range<usize>,
    /// The step's tasks.
    tasks: usize,
}

impl Ranks<'_> {
    fn owns(&self, task: usize) -> bool {
        self.owned.contains(&task)
    }

    /// Every rank's ended continuations `local` (launch index, continuation)
    /// in launch order; the others' arrive as records (their environments
    /// stay there). `check`: what the ranks must agree on so far (see
    /// [`exchange`]).
    fn gather(
        &mut self,
        check: u64,
        local: Vec<(usize, Cont)>,
    ) -> Result<Vec<(usize, Cont)>, TrainError> {
        if self.group.world() == 1 {
            let mut local = local;
            local.sort_by_key(|(k, _)| *k);
            return Ok(local);
        }
        let records = local.iter().map(|(k, c)| (*k, c.record())).collect();
        let mut mine: HashMap<usize, Cont> = local.into_iter().collect();
        Ok(exchange(&mut *self.group, check, records)?
            .into_iter()
            .map(|(k, r)| {
                let c = mine.remove(&k).unwrap_or_else(|| Cont::from_record(r));
                (k, c)
            })
            .collect())
    }

    /// `x` summed over the ranks.
    fn sum(&mut self, x: u64) -> Result<u64, TrainError> {
        if self.group.world() == 1 {
            return Ok(x);
        }
        let mut c = [x as f64];
        self.group.all_reduce_sum_f64(&mut c)?;
        Ok(c[0] as u64)
    }

    /// The outcome of a replay of task `task`'s prefix, as its owner found
    /// it (`here`, on the owner; `None` elsewhere), on every rank.
    fn replay_outcome(&mut self, task: usize, here: Option<u8>) -> Result<u8, TrainError> {
        if self.group.world() == 1 {
            return Ok(here.unwrap_or(0));
        }
        let root = owner(task, self.tasks, self.group.world());
        let mut b = here.map(|c| vec![c]).unwrap_or_default();
        self.group.broadcast(&mut b, root)?;
        b.first()
            .copied()
            .ok_or_else(|| TrainError::Rollout(format!("rank {root} sent no replay outcome")))
    }
}

impl PsReport {
    fn count_miss(&mut self, miss: &ReplayMiss) {
        match miss {
            ReplayMiss::Failed => self.replay_failed += 1,
            ReplayMiss::Diverged => self.replay_diverged += 1,
        }
    }
}

impl PsStep {
    /// Members of an attempt's first wave: the probe, or the whole group.
    fn first_wave(&self) -> usize {
        match self.settings.probe {
            0 => self.m,
            p => p.min(self.m),
        }
    }

    /// A wave of search `i` ended (every launched member is done). A probe
    /// with mixed outcomes is topped up to `m` members (or, out of budget,
    /// trained as it is); a full group with mixed outcomes is returned for
    /// training. An agreeing probe or a degenerate group is not trained: the
    /// cut is bisected toward the missing outcome and the next attempt's
    /// probe launched, while attempts and budget last.
    #[allow(clippy::too_many_arguments)]
    fn judge(
        &self,
        sched: &mut Scheduler<'_>,
        ranks: &mut Ranks<'_>,
        tasks: &[TaskInstance],
        groups: &[Vec<Cont>],
        searches: &mut [Search],
        i: usize,
        acct: &mut Accounts,
        report: &mut PsReport,
    ) -> Result<Option<Vec<Cont>>, TrainError> {
        let s = &mut searches[i];
        // Charge the wave (the last members to finish) what it really cost.
        let spent: u64 = s
            .done
            .iter()
            .rev()
            .take(s.launched - s.wave_start)
            .map(|c| c.generated() as u64)
            .sum();
        acct.committed = acct.committed - s.reserved + spent;
        s.reserved = 0;
        let rewards: Vec<f64> = s.done.iter().map(Cont::reward).collect();
        let mixed = rewards.iter().any(|&r| r != rewards[0]);
        if s.launched < self.m && mixed {
            // A mixed probe: top it up to a full group at the same cut.
            if self.launch_wave(sched, ranks, s, i, self.m - s.launched, groups, acct)? {
                return Ok(None);
            }
        }
        // The attempt is over.
        let members = std::mem::take(&mut s.done);
        let wins = members.iter().filter(|c| c.succeeded()).count();
        acct.rerollouts += members.len();
        acct.reroll_wins += wins;
        if s.attempt == 0 {
            let e = acct.first_attempts.entry(s.bucket).or_default();
            e.0 += wins as u64;
            e.1 += members.len() as u64;
        }
        s.prefix = None;
        if mixed {
            report.reroll_groups += 1;
            report.reroll_trained += 1;
            return Ok(Some(members));
        }
        *acct.no_group.entry(s.bucket).or_default() += 1;
        report.rerollouts_wasted += members.len();
        report.reroll_tokens_wasted += members.iter().map(|c| c.generated() as u64).sum::<u64>();
        if s.launched < self.m {
            report.probes_agreed += 1;
        } else {
            report.reroll_groups += 1;
            report.reroll_degenerate += 1;
        }
        let next = (s.attempt + 1 < self.settings.attempts)
            .then(|| s.cuts.refine(rewards[0] >= 1.0))
            .flatten();
        if next.is_none() {
            return Ok(None);
        }
        // No replay for an attempt the budget cannot hold.
        let cost = self.wave_cost(s, groups, self.first_wave());
        if acct.budget.is_some_and(|b| acct.committed + cost > b) {
            return Ok(None);
        }
        s.attempt += 1;
        let t0 = Instant::now();
        let (task, src, cut) = (&tasks[s.group], &groups[s.group][s.source], s.cuts.cut());
        // The task's rank replays the prefix and tells the others.
        let here = ranks.owns(s.group);
        let prefix = match here {
            true => self.prefix(task, src, cut, true).and_then(PrefixJob::run),
            false => Err(ReplayMiss::Failed),
        };
        let code = ranks.replay_outcome(s.group, here.then(|| ReplayMiss::code(&prefix)))?;
        let prefix = match ReplayMiss::of_code(code) {
            Some(miss) => Err(miss),
            None if here => prefix,
            None => self.prefix(task, src, cut, false).and_then(PrefixJob::run),
        };
        sched.add_env_time(t0.elapsed().as_secs_f64());
        match prefix {
            Ok(p) => {
                s.prefix = Some(p);
                s.launched = 0;
                if self.launch_wave(sched, ranks, s, i, self.first_wave(), groups, acct)? {
                    report.reroll_retries += 1;
                }
            }
            Err(miss) => report.count_miss(&miss),
        }
        Ok(None)
    }

    /// The allowed cuts of a finished trajectory, by this step's cut mode:
    /// segment ends (`boundaries`), after newline tokens (`lines`), or any
    /// token (`tokens`, handled by the sampler).
    fn source(&self, c: &Cont, line_ends: &[u32]) -> SourceTrajectory {
        let mut acc = 0;
        let mut boundaries = Vec::new();
        for s in &c.steps {
            match self.cut {
                PsCut::Lines => {
                    for (i, t) in s.action.iter().enumerate() {
                        if line_ends.binary_search(t).is_ok() {
                            boundaries.push(acc + i + 1);
                        }
                    }
                }
                _ => boundaries.push(acc + s.action.len()),
            }
            acc += s.action.len();
        }
        SourceTrajectory {
            success: c.succeeded(),
            len: acc,
            boundaries,
            shared: 0,
            pass_estimate: Vec::new(),
        }
    }

    /// The first pass, the plan per group, then the re-rollout groups, each
    /// launched when its prefix is ready and judged when its last member
    /// ends; see the module docs.
    ///
    /// On several ranks every rank is given every task and makes every
    /// decision (plans, cuts, budget, bisection) from the same data: the
    /// first pass's trajectories and each re-rollout are all-gathered
    /// (as [`ContRecord`]s), the owner of a task runs its trajectories and
    /// its replays and tells the others whether a replay held, and the
    /// re-rollout phase takes one turn of every rank's event loop between
    /// exchanges. The launches, and so the seeds, are one rank's.
    fn run(
        &self,
        ctx: StepContext<'_>,
        mut tasks: Vec<TaskInstance>,
        sampler: &mut PrefixSampler,
    ) -> Result<StepRollouts, TrainError> {
        let n = self.n;
        let snapshots = self.settings.replay == PsReplay::Snapshot;
        let mut ranks = Ranks {
            group: ctx.group,
            owned: ctx.owned.clone(),
            tasks: tasks.len(),
        };
        // A rank keeps the environments of its own tasks only.
        for (g, t) in tasks.iter_mut().enumerate() {
            if !ranks.owns(g) {
                t.episode = Box::new(Elsewhere);
            }
        }
        let mut sched = Scheduler::new(
            &mut *ctx.engine,
            ctx.rollout,
            &mut *ctx.seed,
            snapshots,
            ctx.env_workers,
        )?;
        for (g, t) in tasks.iter().enumerate() {
            for _ in 0..n {
                if ranks.owns(g) {
                    let c = Cont::new(None, NodeId(0), t.prompt.clone(), t.episode.fork()?);
                    sched.launch(c)?;
                } else {
                    sched.skip_launch();
                }
            }
        }
        let ran = sched.drain()?;
        let mut stats = sched.finish();
        stats.episodes = tasks.len() * n;
        let check = check_of(&[(tasks.len() * n) as u64]);
        let conts: Vec<Cont> = ranks
            .gather(check, ran)?
            .into_iter()
            .map(|(_, c)| c)
            .collect();
        let first_pass = ranks.sum(stats.generated_tokens)?;
        // The run's token budget, else the baseline's: `budget_prompts`
        // groups of `n` trajectories of the first pass's mean generated
        // length; the first pass is charged.
        let budget = ctx.budget_tokens.or(self
            .budget_prompts
            .map(|p| (first_pass as u128 * p as u128 / tasks.len().max(1) as u128) as u64));
        stats.budget_tokens = budget;

        let mut report = PsReport::default();
        let first_rewards: Vec<f64> = conts.iter().map(Cont::reward).collect();
        report.first_pass_pass_rate = first_rewards.iter().filter(|&&r| r >= 1.0).count() as f64
            / first_rewards.len().max(1) as f64;
        let mut groups: Vec<Vec<Cont>> = Vec::with_capacity(tasks.len());
        let mut it = conts.into_iter();
        for _ in 0..tasks.len() {
            groups.push(it.by_ref().take(n).collect());
        }
        let mut tree = RolloutTree::new();
        // The task of each of the tree's episodes.
        let mut episode_task = Vec::new();
        let mut searches = Vec::new();
        // Skewed groups left out for their re-rollouts (`keep_skewed =
        // false`), and which of all groups got a trained re-rollout group.
        let mut replaced = Vec::new();
        let mut served = vec![false; groups.len()];
        for (g, group) in groups.iter().enumerate() {
            let mut sources: Vec<SourceTrajectory> = group
                .iter()
                .map(|c| self.source(c, &ctx.rollout.line_ends))
                .collect();
            let shared = shared_prefixes(group);
            for (i, (a, src)) in group.iter().zip(&mut sources).enumerate() {
                src.shared = group
                    .iter()
                    .zip(&shared[i])
                    .filter(|(b, _)| b.succeeded() != a.succeeded())
                    .map(|(_, &s)| s)
                    .max()
                    .unwrap_or(0);
            }
            if self.settings.cut_rule == CutRule::Estimate {
                estimate_passes(group, &shared, &mut sources);
            }
            let train = match sampler.plan(&sources)? {
                GroupPlan::Drop => {
                    report.groups_degenerate += 1;
                    false
                }
                GroupPlan::Keep => {
                    let k = group.iter().filter(|c| c.succeeded()).count() as u32;
                    if matches!(
                        classify(k, n as u32, self.settings.band)?,
                        GroupClass::Skewed(_)
                    ) {
                        report.groups_skewed += 1;
                        report.skewed_unserved += 1;
                    } else {
                        report.groups_balanced += 1;
                    }
                    true
                }
                GroupPlan::Replay {
                    bucket,
                    source,
                    cut,
                    ..
                } => {
                    report.groups_skewed += 1;
                    // The drawn source, then further members with the
                    // needed outcome, up to `sources` re-rollout groups.
                    // With `cut_rule = "estimate"`, nearest the aim first.
                    let mut more = Vec::new();
                    for (k, src) in sources.iter().enumerate() {
                        if k != source {
                            if let Some(c) = sampler.cut_for(bucket, src)? {
                                more.push((k, c));
                            }
                        }
                    }
                    if self.settings.cut_rule == CutRule::Estimate {
                        more.sort_by(|&(a, ca), &(b, cb)| {
                            let gap_a = sampler.gap(bucket, &sources[a], ca);
                            gap_a.total_cmp(&sampler.gap(bucket, &sources[b], cb))
                        });
                    }
                    let mut picks = vec![(source, cut)];
                    picks.extend(more.into_iter().take(self.settings.sources - 1));
                    for (source, cut) in picks {
                        let src = &sources[source];
                        searches.push(Search {
                            group: g,
                            source,
                            bucket,
                            cuts: CutSearch::new(
                                sampler.allowed_cuts(src),
                                src.len,
                                cut,
                                bucket.direction(),
                            ),
                            attempt: 0,
                            prefix: None,
                            launched: 0,
                            wave_start: 0,
                            done: Vec::new(),
                            reserved: 0,
                        });
                    }
                    if !self.settings.keep_skewed {
                        replaced.push(g);
                    }
                    self.settings.keep_skewed
                }
            };
            if train {
                add_group(
                    &mut tree,
                    &mut episode_task,
                    g,
                    &tasks[g],
                    &tasks[g].id,
                    group,
                )?;
            }
        }

        // Re-rollouts: every skewed group's first probe is launched as soon
        // as its prefix is ready (in task order, while the budget lasts);
        // see [`PsStep::judge`] for what happens when a wave ends.
        let mut acct = Accounts {
            committed: first_pass,
            budget,
            ..Accounts::default()
        };
        let t0 = Instant::now();
        // Which first waves the budget holds, in task order (no replay is
        // executed for a search that could not launch).
        let mut planned = acct.committed;
        let admitted: Vec<usize> = (0..searches.len())
            .filter(|&i| {
                let cost = self.wave_cost(&searches[i], &groups, self.first_wave());
                let fits = budget.is_none_or(|b| planned + cost <= b);
                if fits {
                    planned += cost;
                }
                fits
            })
            .collect();
        report.skewed_unserved += searches.len() - admitted.len();
        let prefixes = self.prefixes(
            &tasks,
            &groups,
            &searches,
            &admitted,
            ctx.env_workers,
            &mut ranks,
        )?;
        let replay_s = t0.elapsed().as_secs_f64();
        let mut sched = Scheduler::new(ctx.engine, ctx.rollout, ctx.seed, false, ctx.env_workers)?;
        sched.add_env_time(replay_s);
        for (i, prefix) in admitted.into_iter().zip(prefixes) {
            let launched = match prefix {
                Ok(p) => {
                    searches[i].prefix = Some(p);
                    self.launch_wave(
                        &mut sched,
                        &ranks,
                        &mut searches[i],
                        i,
                        self.first_wave(),
                        &groups,
                        &mut acct,
                    )?
                }
                Err(miss) => {
                    report.count_miss(&miss);
                    false
                }
            };
            if !launched {
                report.skewed_unserved += 1;
            }
        }
        // One turn of every rank's event loop, then what ended anywhere.
        while !acct.owner.is_empty() {
            let done = sched.poll()?;
            let check = check_of(&[
                acct.owner.len() as u64,
                acct.committed,
                acct.rerollouts as u64,
                report.reroll_groups as u64,
                acct.trace,
            ]);
            for (key, c) in ranks.gather(check, done)? {
                let i = acct
                    .owner
                    .remove(&key)
                    .ok_or_else(|| TrainError::Rollout("a re-rollout without its group".into()))?;
                searches[i].done.push(c);
                if searches[i].done.len() < searches[i].launched {
                    continue;
                }
                if let Some(members) = self.judge(
                    &mut sched,
                    &mut ranks,
                    &tasks,
                    &groups,
                    &mut searches,
                    i,
                    &mut acct,
                    &mut report,
                )? {
                    let s = &searches[i];
                    served[s.group] = true;
                    let task = &tasks[s.group];
                    let key = format!("{}#prefix{}.{}", task.id, s.source, s.attempt);
                    add_group(&mut tree, &mut episode_task, s.group, task, &key, &members)?;
                }
            }
        }
        stats.add(&sched.finish());
        // A replaced group that got no trained re-rollout group trains as
        // it is.
        for g in replaced {
            if !served[g] {
                add_group(
                    &mut tree,
                    &mut episode_task,
                    g,
                    &tasks[g],
                    &tasks[g].id,
                    &groups[g],
                )?;
            }
        }
        report.reroll_tokens = ranks.sum(stats.generated_tokens)? - first_pass;
        report.rerollouts = acct.rerollouts;

        for (b, (s, t)) in &acct.first_attempts {
            sampler.record(*b, *s, *t)?;
        }
        sampler.end_step()?;
        report.reroll_pass_rate =
            (acct.rerollouts > 0).then(|| acct.reroll_wins as f64 / acct.rerollouts as f64);
        for (b, st) in sampler.controller().buckets() {
            let (s, t) = acct.first_attempts.get(b).copied().unwrap_or_default();
            report.buckets.insert(
                b.to_string(),
                PsBucketReport {
                    pass_rate: (t > 0).then(|| s as f64 / t as f64),
                    trials: t,
                    no_group: acct.no_group.get(b).copied().unwrap_or(0),
                    ema: st.ema,
                    ratio: st.ratio,
                },
            );
        }

        let tokens_per_task = first_pass as f64 / tasks.len().max(1) as f64;
        let rows = if tree.is_empty() {
            Vec::new()
        } else {
            let adv = Grpo::default().advantages(&tree)?;
            let mut rows = loss_rows(&tree, &adv, None, Sharing::Once)?;
            // Each rank trains the groups of its own tasks.
            rows.retain(|r| ranks.owns(episode_task[r.episode]));
            rows
        };
        let mut r = StepRollouts::new(tree, rows, stats, Vec::new());
        // Training rewards and the effective share are the first pass's
        // and every group generated, so they compare with GRPO's (every
        // group in the update has mixed outcomes).
        r.rewards = first_rewards;
        r.effective_group_fraction =
            r.effective_groups as f64 / (groups.len() + report.reroll_groups).max(1) as f64;
        r.tokens_per_task = Some(tokens_per_task);
        r.ps = Some(report);
        Ok(r)
    }

    /// The prefixes of the first attempts of searches `which`, built on up
    /// to `workers` threads (replay through execution runs tool calls). On
    /// several ranks each replays its own tasks' prefixes and the outcomes
    /// are all-gathered; a prefix another rank replayed is kept here
    /// without its environment.
    fn prefixes(
        &self,
        tasks: &[TaskInstance],
        groups: &[Vec<Cont>],
        searches: &[Search],
        which: &[usize],
        workers: usize,
        ranks: &mut Ranks<'_>,
    ) -> Result<Vec<Result<Prefix, ReplayMiss>>, TrainError> {
        let start = |i: usize, here: bool| {
            let s = &searches[i];
            self.prefix(
                &tasks[s.group],
                &groups[s.group][s.source],
                s.cuts.cut(),
                here,
            )
        };
        let mine: Vec<usize> = which
            .iter()
            .copied()
            .filter(|&i| ranks.owns(searches[i].group))
            .collect();
        let done = run_jobs(mine.iter().map(|&i| start(i, true)).collect(), workers);
        if ranks.group.world() == 1 {
            return Ok(done);
        }
        let codes = mine
            .iter()
            .zip(&done)
            .map(|(&i, r)| (i, ReplayMiss::code(r)))
            .collect();
        let check = check_of(&[which.len() as u64]);
        let codes: HashMap<usize, u8> = exchange(&mut *ranks.group, check, codes)?
            .into_iter()
            .collect();
        let mut done: HashMap<usize, Result<Prefix, ReplayMiss>> =
            mine.into_iter().zip(done).collect();
        which
            .iter()
            .map(|&i| {
                if let Some(r) = done.remove(&i) {
                    return Ok(r);
                }
                let code = codes.get(&i).copied().ok_or_else(|| {
                    TrainError::Rollout(format!("no rank replayed the prefix of search {i}"))
                })?;
                Ok(match ReplayMiss::of_code(code) {
                    Some(miss) => Err(miss),
                    None => start(i, false).and_then(PrefixJob::run),
                })
            })
            .collect()
    }

    /// The start of a re-rollout that replays the first `cut` action tokens
    /// of `src` (a trajectory of `task`): the whole segments inside the cut
    /// and, for a cut inside a segment, that segment's head; its
    /// environment still to rebuild ([`PrefixJob::run`]). Not `here`
    /// (another rank replays it): the context alone, no environment.
    fn prefix(
        &self,
        task: &TaskInstance,
        src: &Cont,
        cut: usize,
        here: bool,
    ) -> Result<PrefixJob, ReplayMiss> {
        let mut context = task.prompt.clone();
        let mut replayed = Vec::new();
        let mut acc = 0;
        let mut j = 0;
        let mut next = arbor_rl::TokenKind::Action;
        while j < src.steps.len() && acc + src.steps[j].action.len() <= cut {
            let s = &src.steps[j];
            advance(&mut context, &s.action, &s.observation, s.restart);
            replayed.push(Replayed::of(s));
            next = s.next;
            acc += s.action.len();
            j += 1;
        }
        let head = src
            .steps
            .get(j)
            .map(|s| s.action[..cut - acc].to_vec())
            .unwrap_or_default();
        context.extend(&head);
        let (env, execute) = match self.settings.replay {
            _ if !here => (Box::new(Elsewhere) as Box<dyn TokenEpisode>, false),
            PsReplay::Snapshot if j > 0 => (
                src.steps[j - 1]
                    .env_after
                    .as_ref()
                    .ok_or(ReplayMiss::Failed)?
                    .fork()
                    .map_err(|_| ReplayMiss::Failed)?,
                false,
            ),
            mode => (
                task.episode.fork().map_err(|_| ReplayMiss::Failed)?,
                mode == PsReplay::Execute,
            ),
        };
        Ok(PrefixJob {
            prefix: Prefix {
                env,
                context,
                replayed,
                head,
                next,
            },
            execute,
        })
    }

    /// The generated tokens `k` members of search `s` are expected to cost:
    /// the source's length after the cut, each.
    fn wave_cost(&self, s: &Search, groups: &[Vec<Cont>], k: usize) -> u64 {
        let len = groups[s.group][s.source].generated();
        (k * len.saturating_sub(s.cuts.cut())) as u64
    }

    /// Launch `k` more members of search `s` (key `index`) from its rebuilt
    /// prefix if the budget holds them (estimated at the source's tokens
    /// after the cut each); returns whether they were launched.
    #[allow(clippy::too_many_arguments)]
    fn launch_wave(
        &self,
        sched: &mut Scheduler<'_>,
        ranks: &Ranks<'_>,
        s: &mut Search,
        index: usize,
        k: usize,
        groups: &[Vec<Cont>],
        acct: &mut Accounts,
    ) -> Result<bool, TrainError> {
        let cost = self.wave_cost(s, groups, k);
        if acct.budget.is_some_and(|b| acct.committed + cost > b) {
            return Ok(false);
        }
        let prefix = s
            .prefix
            .as_ref()
            .ok_or_else(|| TrainError::Rollout("a re-rollout wave without its prefix".into()))?;
        if prefix.context.len() + 1 >= sched.max_context() {
            // No room left to generate after the prefix.
            return Ok(false);
        }
        acct.committed += cost;
        acct.trace = check_of(&[acct.trace, index as u64, s.cuts.cut() as u64, k as u64]);
        s.reserved = cost;
        s.wave_start = s.launched;
        let here = ranks.owns(s.group);
        for _ in 0..k {
            let key = if here {
                let mut cont =
                    Cont::new(None, NodeId(0), prefix.context.clone(), prefix.env.fork()?);
                cont.replayed = prefix.replayed.clone();
                cont.head = prefix.head.clone();
                cont.next = prefix.next;
                sched.launch(cont)?
            } else {
                sched.skip_launch()
            };
            acct.owner.insert(key, index);
            s.launched += 1;
        }
        if here {
            sched.add_replayed((k * s.cuts.cut()) as u64);
        }
        Ok(true)
    }
}

/// Run prefix `jobs` on up to `workers` threads; the results keep the
/// jobs' order.
fn run_jobs(
    jobs: Vec<Result<PrefixJob, ReplayMiss>>,
    workers: usize,
) -> Vec<Result<Prefix, ReplayMiss>> {
    if workers <= 1 || jobs.len() <= 1 {
        return jobs
            .into_iter()
            .map(|j| j.and_then(PrefixJob::run))
            .collect();
    }
    // Contiguous chunks, one per worker, so the results keep the order.
    let chunk = jobs.len().div_ceil(workers);
    let mut parts: Vec<Vec<Result<PrefixJob, ReplayMiss>>> = Vec::new();
    let mut it = jobs.into_iter().peekable();
    while it.peek().is_some() {
        parts.push(it.by_ref().take(chunk).collect());
    }
    std::thread::scope(|scope| {
        let handles: Vec<_> = parts
            .into_iter()
            .map(|part| {
                let k = part.len();
                let h = scope.spawn(move || {
                    part.into_iter()
                        .map(|j| j.and_then(PrefixJob::run))
                        .collect::<Vec<_>>()
                });
                (h, k)
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|(h, k)| {
                h.join()
                    .unwrap_or_else(|_| (0..k).map(|_| Err(ReplayMiss::Failed)).collect())
            })
            .collect()
    })
}

/// Each source's [`pass_estimate`] from the group's successes: the
/// behaviour logprobs of their generated tokens past each state they share
/// with the source (`shared`, from [`shared_prefixes`]; a member shares all
/// of itself).
fn estimate_passes(group: &[Cont], shared: &[Vec<usize>], sources: &mut [SourceTrajectory]) {
    let logprobs: Vec<Vec<f32>> = group
        .iter()
        .map(|c| {
            c.steps
                .iter()
                .flat_map(|s| s.logprobs.iter().copied())
                .collect()
        })
        .collect();
    for (src, shared) in sources.iter_mut().zip(shared) {
        let successes: Vec<(usize, &[f32])> = group
            .iter()
            .zip(shared)
            .zip(&logprobs)
            .filter(|((b, _), _)| b.succeeded())
            .map(|((_, &s), lp)| (s, lp.as_slice()))
            .collect();
        src.pass_estimate = pass_estimate(src.len, &successes);
    }
}

/// [`shared_prefix`] of every pair of a group's members, `[i][j]` (it is
/// symmetric, so each pair is compared once).
fn shared_prefixes(group: &[Cont]) -> Vec<Vec<usize>> {
    let n = group.len();
    let mut m = vec![vec![0; n]; n];
    for i in 0..n {
        for j in i..n {
            let s = shared_prefix(&group[i], &group[j]);
            m[i][j] = s;
            m[j][i] = s;
        }
    }
    m
}

/// Action tokens `a` and `b` share from the start: whole segments while
/// both their actions and observations agree, then the common start of the
/// first actions that differ.
fn shared_prefix(a: &Cont, b: &Cont) -> usize {
    let mut acc = 0;
    for (x, y) in a.steps.iter().zip(&b.steps) {
        if x.action != y.action {
            return acc
                + x.action
                    .iter()
                    .zip(&y.action)
                    .take_while(|(p, q)| p == q)
                    .count();
        }
        acc += x.action.len();
        if x.observation != y.observation {
            break;
        }
    }
    acc
}

/// Record a group's trajectories as episodes of `task` (task index `g`,
/// noted per episode in `episode_task`), grouped (for the GRPO baseline)
/// under `key`.
fn add_group(
    tree: &mut RolloutTree,
    episode_task: &mut Vec<usize>,
    g: usize,
    task: &TaskInstance,
    key: &str,
    members: &[Cont],
) -> Result<(), TrainError> {
    for c in members {
        let root = tree.add_episode(key.to_string(), task.prompt.clone(), None)?;
        tree.add_path(root, to_steps(c, None)?)?;
        episode_task.push(g);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rollout::conts::SegmentRecord;
    use crate::rollout::StepOut;
    use arbor_engine::{Completion, FinishReason};

    /// An episode that records the actions it gets and answers each with
    /// `[k]` (`k` = actions so far), or fails on the action `[99]`.
    #[derive(Clone, Default)]
    struct Echo {
        seen: Vec<Vec<u32>>,
        shift: u32,
    }

    impl TokenEpisode for Echo {
        fn step(&mut self, action: &[u32]) -> Result<StepOut, TrainError> {
            if action == [99] {
                return Err(TrainError::Rollout("the tool failed".into()));
            }
            self.seen.push(action.to_vec());
            Ok(StepOut::new(
                vec![self.seen.len() as u32 + self.shift],
                (self.seen.len() == 3).then_some(1.0),
            ))
        }
        fn fork(&self) -> Result<Box<dyn TokenEpisode>, TrainError> {
            Ok(Box::new(self.clone()))
        }
    }

    fn record(action: &[u32], obs: u32, reward: Option<f64>) -> SegmentRecord {
        SegmentRecord {
            head: Vec::new(),
            kind: arbor_rl::TokenKind::Action,
            action: action.to_vec(),
            logprobs: vec![-0.5; action.len()],
            observation: vec![obs],
            restart: false,
            next: arbor_rl::TokenKind::Action,
            env_after: None,
            reward,
        }
    }

    /// A finished three-segment trajectory of `Echo`: actions `[10, 11]`,
    /// `[12, 13, 14]`, `[15]`.
    fn source() -> Cont {
        let mut c = Cont::new(None, NodeId(0), vec![7, 7], Box::new(Echo::default()));
        c.steps = vec![
            record(&[10, 11], 1, None),
            record(&[12, 13, 14], 2, None),
            record(&[15], 3, Some(1.0)),
        ];
        c
    }

    fn step(replay: PsReplay) -> PsStep {
        PsStep {
            n: 2,
            m: 2,
            cut: PsCut::Tokens,
            settings: PsSettings {
                replay,
                ..PsSettings::default()
            },
            budget_prompts: None,
        }
    }

    fn task(shift: u32) -> TaskInstance {
        TaskInstance {
            id: "t".into(),
            prompt: vec![7, 7],
            episode: Box::new(Echo {
                seen: Vec::new(),
                shift,
            }),
        }
    }

    /// The prefix of `src` cut at `cut`, replayed through `Echo`.
    fn rebuilt(src: &Cont, cut: usize) -> Prefix {
        step(PsReplay::Execute)
            .prefix(&task(0), src, cut, true)
            .unwrap()
            .run()
            .unwrap()
    }

    /// A cut inside a segment replays the whole segments before it through
    /// the environment and keeps the rest of the cut segment as the head the
    /// engine continues; a boundary cut has no head.
    #[test]
    fn prefixes_replay_whole_segments_and_keep_the_head() {
        let src = source();
        let p = rebuilt(&src, 3);
        assert_eq!(p.replayed, vec![Replayed::of(&src.steps[0])]);
        assert_eq!(p.replayed[0].action, vec![10, 11]);
        assert_eq!(p.head, vec![12]);
        assert_eq!(p.context, vec![7, 7, 10, 11, 1, 12]);
        let p = rebuilt(&src, 5);
        assert_eq!(p.replayed.len(), 2);
        assert!(p.head.is_empty());
        assert_eq!(p.context, vec![7, 7, 10, 11, 1, 12, 13, 14, 2]);
    }

    /// Replay through execution: an observation that differs from the
    /// recording, or a failing action, drops the replay with its reason.
    #[test]
    fn replays_that_diverge_or_fail_are_dropped_with_their_reason() {
        let src = source();
        let s = step(PsReplay::Execute);
        let diverged = s.prefix(&task(5), &src, 5, true).unwrap().run();
        assert!(matches!(diverged, Err(ReplayMiss::Diverged)));
        let mut bad = source();
        bad.steps[0].action = vec![99];
        let failed = s.prefix(&task(0), &bad, 2, true).unwrap().run();
        assert!(matches!(failed, Err(ReplayMiss::Failed)));
        let mut report = PsReport::default();
        report.count_miss(&ReplayMiss::Diverged);
        report.count_miss(&ReplayMiss::Failed);
        assert_eq!((report.replay_diverged, report.replay_failed), (1, 1));
        // Snapshot replay never re-executes, so it cannot diverge (and needs
        // the snapshot the first pass kept).
        let snap = step(PsReplay::Snapshot).prefix(&task(5), &src, 5, true);
        assert!(matches!(snap, Err(ReplayMiss::Failed)), "no snapshot kept");
        let mut kept = source();
        kept.steps[1].env_after = Some(Box::new(Echo::default()));
        assert!(step(PsReplay::Snapshot)
            .prefix(&task(5), &kept, 5, true)
            .unwrap()
            .run()
            .is_ok());
    }

    /// The head goes to the environment with the generated rest of its
    /// segment, and into the tree as replayed (loss mask 0) while the
    /// generated tokens train (mask 1).
    #[test]
    fn a_replayed_head_reaches_the_environment_and_is_masked() {
        let src = source();
        let p = rebuilt(&src, 3);
        let mut c = Cont::new(None, NodeId(0), p.context, p.env);
        c.replayed = p.replayed;
        c.head = p.head;
        let cfg = RolloutConfig {
            temperature: 1.0,
            segment_stop: Vec::new(),
            max_segment_tokens: 4,
            max_segments: 3,
            line_ends: std::sync::Arc::new([]),
        };
        let seg = |tokens: Vec<u32>| Completion {
            id: 0,
            prompt: Vec::new(),
            logprobs: vec![-0.25; tokens.len()],
            tokens,
            finish_reason: FinishReason::Stop,
            stop_string: None,
            error: None,
        };
        super::super::sched::apply_segment(&mut c, seg(vec![30, 31]), &cfg, false).unwrap();
        super::super::sched::apply_segment(&mut c, seg(vec![32]), &cfg, false).unwrap();
        assert!(c.succeeded());
        assert_eq!(
            (&c.steps[0].head, &c.steps[0].action),
            (&vec![12], &vec![30, 31])
        );
        assert!(c.head.is_empty(), "the head is used once");
        let mut tree = RolloutTree::new();
        let t = task(0);
        add_group(
            &mut tree,
            &mut Vec::new(),
            0,
            &t,
            "t#prefix0",
            std::slice::from_ref(&c),
        )
        .unwrap();
        let adv = Grpo::default().advantages(&tree).unwrap();
        let rows = loss_rows(&tree, &adv, None, Sharing::Once).unwrap();
        let row = &rows[0];
        // prompt 7 7 | replayed 10 11, obs 1 | head 12, generated 30 31,
        // obs 2 | generated 32, obs 3
        assert_eq!(row.tokens, vec![7, 7, 10, 11, 1, 12, 30, 31, 2, 32, 3]);
        let trained: Vec<u32> = row
            .tokens
            .iter()
            .zip(&row.mask)
            .filter(|(_, &m)| m > 0.0)
            .map(|(&t, _)| t)
            .collect();
        assert_eq!(trained, vec![30, 31, 32]);
    }

    /// Allowed cuts by mode: segment ends, or after each newline token.
    #[test]
    fn sources_list_their_cuts_by_mode() {
        let src = source();
        let mut s = step(PsReplay::Execute);
        s.cut = PsCut::Boundaries;
        let t = s.source(&src, &[]);
        assert_eq!((t.len, t.boundaries, t.success), (6, vec![2, 5, 6], true));
        s.cut = PsCut::Lines;
        // Tokens 11 and 13 end lines: cuts after them (offsets 2 and 4).
        assert_eq!(s.source(&src, &[11, 13]).boundaries, vec![2, 4]);
        let auto = |segments| {
            let cfg = RolloutConfig {
                temperature: 1.0,
                segment_stop: Vec::new(),
                max_segment_tokens: 4,
                max_segments: segments,
                line_ends: std::sync::Arc::new([]),
            };
            cut_mode(PsCut::Auto, &cfg)
        };
        assert_eq!((auto(1), auto(5)), (PsCut::Tokens, PsCut::Boundaries));
    }

    /// Two members share the action tokens up to where they first differ,
    /// whole segments counting only while their observations agree too.
    #[test]
    fn shared_prefixes_stop_where_actions_or_observations_differ() {
        let a = source();
        let mut b = source();
        b.steps[1].action = vec![12, 13, 40];
        assert_eq!(shared_prefix(&a, &b), 4);
        b.steps[1] = record(&[12, 13, 14], 9, None);
        assert_eq!(shared_prefix(&a, &b), 5, "observation differs after");
        assert_eq!(shared_prefix(&a, &source()), 6);
    }

    /// Each source's pass estimate follows the group's successes through
    /// the states it shares with them, with their recorded logprobs.
    #[test]
    fn sources_estimate_their_pass_rate_from_the_groups_successes() {
        let ok = source();
        let mut fail = source();
        fail.steps[1] = record(&[12, 40, 41], 2, None);
        fail.steps[2] = record(&[15], 3, Some(0.0));
        let group = [ok, fail];
        let s = step(PsReplay::Execute);
        let mut sources: Vec<_> = group.iter().map(|c| s.source(c, &[])).collect();
        estimate_passes(&group, &shared_prefixes(&group), &mut sources);
        // Every token of the success has logprob -0.5: from the state after
        // c of its 6 tokens it is regenerated with probability e^{-(6-c)/2}.
        let want: Vec<f64> = (0..=6).map(|c| (-(6.0 - c as f64) / 2.0).exp()).collect();
        for (got, want) in sources[0].pass_estimate.iter().zip(&want) {
            assert!((got - want).abs() < 1e-12);
        }
        // The failure shares 3 tokens with it: the same estimates up to
        // there, none after.
        let q = &sources[1].pass_estimate;
        assert_eq!(q.len(), 7);
        for c in 0..=6 {
            let w = if c <= 3 { want[c] } else { 0.0 };
            assert!((q[c] - w).abs() < 1e-12, "state {c}: {} vs {w}", q[c]);
        }
    }
}
