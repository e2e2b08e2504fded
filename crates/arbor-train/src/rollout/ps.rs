//! Prefix Sampling: GRPO groups whose skewed members are replaced by
//! re-rollouts from replayed prefixes of the group's own trajectories, with
//! a per-bucket controller steering the replay ratio toward a 50% pass rate.

use std::collections::BTreeMap;

use arbor_rl::baselines::{AdvantageEstimator, Grpo};
use arbor_rl::credit::{loss_rows, Sharing};
use arbor_rl::prefix::{
    Bucket, CutGranularity, GroupPlan, PrefixController, PrefixSampler, PsConfig, SourceTrajectory,
};
use arbor_rl::{NodeId, RolloutTree};

use super::conts::{to_steps, Cont};
use super::{PolicyState, RolloutPolicy, StepContext, StepRollouts, TaskInstance};
use crate::config::{PsSettings, TrainConfig};
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
    /// The run seed (each step's replay choices derive from it and the step).
    seed: u64,
    /// Controller state per bucket, carried across steps.
    buckets: Vec<(Bucket, arbor_rl::prefix::BucketState)>,
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

    fn rollouts(
        &mut self,
        ctx: StepContext<'_>,
        tasks: Vec<TaskInstance>,
    ) -> Result<StepRollouts, TrainError> {
        let pcfg = PsConfig {
            group_size: self.n as u32,
            band: self.settings.band,
            granularity: CutGranularity::Boundaries,
            controller: self.settings.controller,
            seed: self.seed ^ ctx.step.wrapping_mul(0x9E37_79B9),
        };
        let ctl = PrefixController::restore(self.settings.controller, self.buckets.clone())?;
        let mut sampler = PrefixSampler::with_controller(pcfg, ctl)?;
        let r = ps_step(ctx, tasks, self.n, self.budget_prompts, &mut sampler)?;
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

/// Prefix Sampling: GRPO groups of `n`; all-fail / all-pass groups are
/// dropped, balanced ones kept, and skewed ones replaced one for one by `n`
/// re-rollouts that replay a prefix of one of the group's own trajectories
/// (successful for hard groups, failed for easy ones) through the
/// environment, then continue with the current policy. The prefix length is
/// the bucket's controller ratio of the source's generated tokens, snapped to
/// a segment boundary; replayed tokens are masked. Re-rollout outcomes feed
/// the per-bucket controller (one update per step).
fn ps_step(
    mut ctx: StepContext<'_>,
    tasks: Vec<TaskInstance>,
    n: usize,
    budget_prompts: Option<usize>,
    sampler: &mut PrefixSampler,
) -> Result<StepRollouts, TrainError> {
    let mut conts = Vec::new();
    let mut meta = Vec::new(); // (task id, prompt) per group
    for t in &tasks {
        for _ in 0..n {
            conts.push(Cont::new(
                None,
                NodeId(0),
                t.prompt.clone(),
                t.episode.fork()?,
            ));
        }
        meta.push((t.id.clone(), t.prompt.clone()));
    }
    let mut sched = ctx.scheduler(true)?;
    let conts = sched.run_all(conts)?;
    let mut stats = sched.finish();
    stats.episodes = conts.len();
    // The run's token budget, else the baseline's: `budget_prompts` groups
    // of `n` trajectories of the first pass's mean generated length; the
    // first pass is charged.
    let first_pass = stats.generated_tokens;
    let budget = ctx.budget_tokens.or(budget_prompts
        .map(|p| (first_pass as u128 * p as u128 / tasks.len().max(1) as u128) as u64));
    stats.budget_tokens = budget;
    let mut planned = first_pass;

    let mut tree = RolloutTree::new();
    let mut keep: Vec<Cont> = Vec::new();
    let mut keep_task: Vec<usize> = Vec::new();
    let mut reroll: Vec<Cont> = Vec::new();
    let mut reroll_meta: Vec<(usize, Bucket)> = Vec::new();
    let mut groups: Vec<Vec<Cont>> = Vec::new();
    let mut it = conts.into_iter();
    for _ in 0..tasks.len() {
        groups.push(it.by_ref().take(n).collect());
    }
    for (g, group) in groups.into_iter().enumerate() {
        let sources: Vec<SourceTrajectory> = group
            .iter()
            .map(|c| {
                let mut acc = 0;
                let boundaries = c
                    .steps
                    .iter()
                    .map(|s| {
                        acc += s.action.len();
                        acc
                    })
                    .collect();
                SourceTrajectory {
                    success: c.succeeded(),
                    len: acc,
                    boundaries,
                }
            })
            .collect();
        match sampler.plan(&sources)? {
            GroupPlan::Drop => {}
            GroupPlan::Keep => {
                keep_task.extend(std::iter::repeat_n(g, group.len()));
                keep.extend(group);
            }
            GroupPlan::Replay { bucket, rerollouts } => {
                // Expected cost: each source's generated tokens after the cut.
                let cost: u64 = rerollouts
                    .iter()
                    .map(|r| {
                        let src = &group[r.source];
                        let len: usize = src.steps.iter().map(|s| s.action.len()).sum();
                        len.saturating_sub(r.cut) as u64
                    })
                    .sum();
                if budget.is_some_and(|b| planned + cost > b) {
                    // Out of budget: the group trains as it is.
                    keep_task.extend(std::iter::repeat_n(g, group.len()));
                    keep.extend(group);
                    continue;
                }
                planned += cost;
                for r in rerollouts {
                    let src = &group[r.source];
                    // Number of whole segments inside the cut.
                    let mut acc = 0;
                    let mut j = 0;
                    while j < src.steps.len() && acc + src.steps[j].action.len() <= r.cut {
                        acc += src.steps[j].action.len();
                        j += 1;
                    }
                    if j == 0 {
                        continue;
                    }
                    let mut context = meta[g].1.clone();
                    let mut replayed = Vec::with_capacity(j);
                    for s in &src.steps[..j] {
                        context.extend(&s.action);
                        context.extend(&s.observation);
                        replayed.push((s.action.clone(), s.observation.clone()));
                        stats.replayed_tokens += s.action.len() as u64;
                    }
                    let env = src.steps[j - 1]
                        .env_after
                        .as_ref()
                        .ok_or_else(|| {
                            TrainError::Rollout(
                                "no environment snapshot kept for a PS source".into(),
                            )
                        })?
                        .fork()?;
                    let mut cont = Cont::new(None, NodeId(0), context, env);
                    cont.replayed = replayed;
                    reroll.push(cont);
                    reroll_meta.push((g, bucket));
                }
            }
        }
    }
    let mut sched = ctx.scheduler(false)?;
    let reroll = sched.run_all(reroll)?;
    stats.add(&sched.finish());
    let mut outcomes: BTreeMap<Bucket, (u64, u64)> = Default::default();
    for (c, (_, b)) in reroll.iter().zip(&reroll_meta) {
        let e = outcomes.entry(*b).or_default();
        e.0 += u64::from(c.succeeded());
        e.1 += 1;
    }
    for (b, (s, t)) in outcomes {
        sampler.record(b, s, t)?;
    }
    sampler.end_step()?;
    let all = keep
        .iter()
        .zip(keep_task.iter().copied())
        .chain(reroll.iter().zip(reroll_meta.iter().map(|m| m.0)));
    for (c, g) in all {
        let root = tree.add_episode(meta[g].0.clone(), meta[g].1.clone(), None)?;
        tree.add_path(root, to_steps(c, None)?)?;
    }
    let tokens_per_task = first_pass as f64 / tasks.len().max(1) as f64;
    let rows = if tree.is_empty() {
        Vec::new()
    } else {
        let adv = Grpo::default().advantages(&tree)?;
        loss_rows(&tree, &adv, None, Sharing::Once)?
    };
    let mut r = StepRollouts::new(tree, rows, stats, Vec::new());
    r.tokens_per_task = Some(tokens_per_task);
    Ok(r)
}
