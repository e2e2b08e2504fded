//! Rollouts: multi-turn episodes driven on the engine, recorded into an
//! [`arbor_rl::RolloutTree`], for GRPO groups and for FOCUS allocation.
//!
//! A continuation starts at a tree state (a root prompt or a forked
//! intermediate node) with its environment state, and alternates: the
//! engine generates one segment (until a stop token or the segment length
//! limit), the environment answers with an observation, until the episode
//! ends (terminal reward) or the segment limit truncates it (reward 0).
//! Each segment becomes one tree edge: the action tokens (trained, with
//! their sampling logprobs) followed by the observation tokens (masked).
//! Every state between segments is resumable: its environment snapshot is
//! kept so FOCUS can fork there, and the engine's prefix cache serves the
//! shared context.

use std::collections::HashMap;
use std::time::Instant;

use arbor_engine::{Engine, SamplingParams};
use arbor_rl::baselines::{AdvantageEstimator, Grpo};
use arbor_rl::credit::{focus_credit, loss_rows, CreditConfig, LossRow, Sharing};
use arbor_rl::focus::{Allocator, AllocatorConfig, AsyncGain, Budget, Focus};
use arbor_rl::{NodeId, RolloutTree, Segment, Step, TokenKind};

use crate::learner::Learner;
use crate::TrainError;

/// What the environment says after a segment.
#[derive(Debug, Clone, PartialEq)]
pub struct StepOut {
    /// Tokens appended to the context (masked in the loss).
    pub observation: Vec<u32>,
    /// `Some(reward)` when the episode is over.
    pub reward: Option<f64>,
}

/// One live episode of a token-level environment.
pub trait TokenEpisode: Send {
    /// Feed the policy's segment.
    fn step(&mut self, action: &[u32]) -> Result<StepOut, TrainError>;
    /// An independent copy of this state (a fork point).
    fn fork(&self) -> Result<Box<dyn TokenEpisode>, TrainError>;
    /// Tool calls executed so far in this episode (replayed ones included).
    fn tool_calls(&self) -> usize {
        0
    }
}

/// A task: its id (group key), prompt tokens and fresh episode.
pub struct TaskInstance {
    pub id: String,
    pub prompt: Vec<u32>,
    pub episode: Box<dyn TokenEpisode>,
}

/// How segments are sampled.
#[derive(Debug, Clone)]
pub struct RolloutConfig {
    pub temperature: f32,
    /// Tokens that end a segment.
    pub segment_stop: Vec<u32>,
    pub max_segment_tokens: usize,
    pub max_segments: usize,
}

/// Token and time accounting of a step's rollouts.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct RolloutStats {
    pub episodes: usize,
    pub continuations: usize,
    pub generated_tokens: u64,
    pub replayed_tokens: u64,
    pub prefill_computed: u64,
    pub prefill_cached: u64,
    pub generate_s: f64,
    pub env_s: f64,
    /// Episodes that ended in this step's continuations, and the tool calls
    /// they made in all (per episode, replayed prefixes included).
    pub finished_episodes: u64,
    pub tool_calls: u64,
    /// Generated-token budget of the step, where one is enforced.
    pub budget_tokens: Option<u64>,
}

/// One finished segment: action tokens, their logprobs, the observation,
/// the environment state after it, and the terminal reward if it ended.
struct SegmentRecord {
    action: Vec<u32>,
    logprobs: Vec<f32>,
    observation: Vec<u32>,
    /// The environment after this segment (kept only where later work
    /// starts from it: FOCUS, PS sources, VinePPO; a SWE snapshot is a
    /// workspace copy).
    env_after: Option<Box<dyn TokenEpisode>>,
    reward: Option<f64>,
}

struct Cont {
    ticket: Option<arbor_rl::Ticket>,
    from: NodeId,
    context: Vec<u32>,
    env: Box<dyn TokenEpisode>,
    /// Replayed prefix (Prefix Sampling): (action, observation) per segment,
    /// already executed in `env`; masked in the loss.
    replayed: Vec<(Vec<u32>, Vec<u32>)>,
    steps: Vec<SegmentRecord>,
    done: bool,
}

/// Run every continuation to the end of its episode, batching all live
/// continuations' next segments through the engine together.
fn run_conts(
    engine: &mut Engine,
    conts: &mut [Cont],
    cfg: &RolloutConfig,
    seed: &mut u64,
    stats: &mut RolloutStats,
    keep_snapshots: bool,
) -> Result<(), TrainError> {
    loop {
        // A context that has no room for another token ends truncated
        // (reward 0) instead of failing the step (long multi-turn episodes).
        let room = engine.max_context();
        for c in conts
            .iter_mut()
            .filter(|c| !c.done && c.context.len() + 1 >= room)
        {
            end_episode(c, stats);
            match c.steps.last_mut() {
                Some(last) => last.reward = Some(0.0),
                None => {
                    return Err(TrainError::Rollout(format!(
                        "a prompt of {} tokens leaves no room in the engine's context ({room})",
                        c.context.len()
                    )))
                }
            }
        }
        let live: Vec<usize> = (0..conts.len()).filter(|&i| !conts[i].done).collect();
        if live.is_empty() {
            return Ok(());
        }
        let t0 = Instant::now();
        let mut ids = HashMap::new();
        let before = engine.stats().clone();
        for &i in &live {
            *seed += 1;
            let p = SamplingParams {
                temperature: cfg.temperature,
                max_tokens: cfg.max_segment_tokens,
                stop_tokens: cfg.segment_stop.clone(),
                seed: *seed,
                ..Default::default()
            };
            let id = engine.submit(conts[i].context.clone(), vec![p])?[0];
            ids.insert(id, i);
        }
        let done = engine.run(|_| {})?;
        let after = engine.stats();
        stats.generated_tokens += after.generated - before.generated;
        stats.prefill_computed += after.prefill_computed - before.prefill_computed;
        stats.prefill_cached += after.prefill_cached - before.prefill_cached;
        stats.generate_s += t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        for c in done {
            let i = ids[&c.id];
            if let Some(e) = c.error {
                return Err(TrainError::Rollout(format!("generation failed: {e}")));
            }
            let cont = &mut conts[i];
            let out = cont.env.step(&c.tokens)?;
            cont.context.extend(&c.tokens);
            cont.context.extend(&out.observation);
            let segments = cont.replayed.len() + cont.steps.len() + 1;
            let truncated = out.reward.is_none() && segments >= cfg.max_segments;
            let reward = if truncated { Some(0.0) } else { out.reward };
            let snapshot = if keep_snapshots && reward.is_none() {
                Some(cont.env.fork()?)
            } else {
                None
            };
            cont.steps.push(SegmentRecord {
                action: c.tokens,
                logprobs: c.logprobs,
                observation: out.observation,
                env_after: snapshot,
                reward,
            });
            if reward.is_some() {
                end_episode(cont, stats);
            }
        }
        stats.env_s += t1.elapsed().as_secs_f64();
    }
}

/// Mark a continuation's episode over and count it (and its tool calls).
fn end_episode(c: &mut Cont, stats: &mut RolloutStats) {
    c.done = true;
    stats.finished_episodes += 1;
    stats.tool_calls += c.env.tool_calls() as u64;
}

/// Turn a finished continuation into tree steps, with critic values at each
/// new intermediate state.
fn to_steps(c: &Cont, values: &[f64]) -> Result<Vec<Step>, TrainError> {
    let mut out = Vec::with_capacity(c.replayed.len() + c.steps.len());
    for (action, obs) in &c.replayed {
        let mut seg = Segment::new();
        seg.push(TokenKind::Replayed, action, None)?;
        if !obs.is_empty() {
            seg.push(TokenKind::Observation, obs, None)?;
        }
        out.push(Step::new(seg).value(0.5));
    }
    for (k, r) in c.steps.iter().enumerate() {
        let mut seg = Segment::new();
        seg.push(TokenKind::Action, &r.action, Some(&r.logprobs))?;
        if !r.observation.is_empty() {
            seg.push(TokenKind::Observation, &r.observation, None)?;
        }
        let step = Step::new(seg);
        out.push(match r.reward {
            Some(r) => step.terminal(r),
            None => step.value(values[k]),
        });
    }
    Ok(out)
}

/// Critic values at the end of each non-final segment of each continuation.
fn segment_values(
    learner: &Learner,
    conts: &[Cont],
    tree: &RolloutTree,
) -> Result<Vec<Vec<f64>>, TrainError> {
    let mut seqs = Vec::new();
    let mut pos = Vec::new();
    for c in conts {
        let mut ctx = tree.context_tokens(c.from)?;
        let mut p = Vec::new();
        for (k, r) in c.steps.iter().enumerate() {
            ctx.extend(&r.action);
            ctx.extend(&r.observation);
            if k + 1 < c.steps.len() {
                p.push(ctx.len() - 1);
            }
        }
        seqs.push(ctx);
        pos.push(p);
    }
    learner.values_at(&seqs, &pos)
}

/// The rollouts of one step, ready for the update.
pub struct StepRollouts {
    pub tree: RolloutTree,
    pub rows: Vec<LossRow>,
    pub stats: RolloutStats,
    /// Terminal rewards of every finished trajectory.
    pub rewards: Vec<f64>,
    /// Fraction of task groups whose rewards are not all equal.
    pub effective_group_fraction: f64,
    /// `(V_phi(s), Gbar(s))` at nodes with children (FOCUS health).
    pub critic_vs_target: Vec<(f64, f64)>,
}

impl StepRollouts {
    fn new(
        tree: RolloutTree,
        rows: Vec<LossRow>,
        stats: RolloutStats,
        critic_vs_target: Vec<(f64, f64)>,
    ) -> Self {
        let (rewards, effective_group_fraction) = group_stats(&tree);
        StepRollouts {
            tree,
            rows,
            stats,
            rewards,
            effective_group_fraction,
            critic_vs_target,
        }
    }
}

fn group_stats(tree: &RolloutTree) -> (Vec<f64>, f64) {
    let mut by_task: HashMap<&str, Vec<f64>> = HashMap::new();
    for leaf in tree.leaves() {
        let node = tree.node(leaf).expect("leaf exists");
        if let Some(r) = node.terminal_reward() {
            let task = tree.episodes()[node.episode()].task.as_str();
            by_task.entry(task).or_default().push(r);
        }
    }
    let rewards: Vec<f64> = by_task.values().flatten().copied().collect();
    let mixed = by_task
        .values()
        .filter(|g| g.iter().any(|&r| r != g[0]))
        .count();
    (rewards, mixed as f64 / by_task.len().max(1) as f64)
}

/// GRPO: `n` full rollouts per task, group-relative advantages.
pub fn grpo_step(
    engine: &mut Engine,
    tasks: Vec<TaskInstance>,
    n: usize,
    cfg: &RolloutConfig,
    seed: &mut u64,
) -> Result<StepRollouts, TrainError> {
    let mut tree = RolloutTree::new();
    let mut conts = Vec::new();
    for t in tasks {
        for _ in 0..n {
            let root = tree.add_episode(t.id.clone(), t.prompt.clone(), None)?;
            conts.push(Cont {
                ticket: None,
                from: root,
                context: t.prompt.clone(),
                env: t.episode.fork()?,
                replayed: Vec::new(),
                steps: Vec::new(),
                done: false,
            });
        }
    }
    let mut stats = RolloutStats {
        episodes: conts.len(),
        continuations: conts.len(),
        ..Default::default()
    };
    run_conts(engine, &mut conts, cfg, seed, &mut stats, false)?;
    for c in &conts {
        let values = vec![0.5; c.steps.len()];
        tree.add_path(c.from, to_steps(c, &values)?)?;
    }
    let adv = Grpo::default().advantages(&tree)?;
    let rows = loss_rows(&tree, &adv, None, Sharing::Once)?;
    Ok(StepRollouts::new(tree, rows, stats, Vec::new()))
}

/// FOCUS settings.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FocusConfig {
    pub kappa: f64,
    pub gamma: f64,
    pub lambda: f64,
    /// Continuations in flight at once (the engine batch).
    pub worker_capacity: u32,
}

impl Default for FocusConfig {
    fn default() -> Self {
        FocusConfig {
            kappa: 1.0,
            gamma: 1.0,
            lambda: 0.0,
            worker_capacity: 64,
        }
    }
}

/// FOCUS: one root per task, `budget` continuations placed by expected
/// critic-MSE reduction, Eq. 1 backups, TD advantages, critic targets.
pub fn focus_step(
    engine: &mut Engine,
    learner: &Learner,
    tasks: Vec<TaskInstance>,
    budget: u64,
    fcfg: &FocusConfig,
    cfg: &RolloutConfig,
    seed: &mut u64,
) -> Result<StepRollouts, TrainError> {
    let mut tree = RolloutTree::new();
    let mut snapshots: HashMap<NodeId, Box<dyn TokenEpisode>> = HashMap::new();
    let prompts: Vec<Vec<u32>> = tasks.iter().map(|t| t.prompt.clone()).collect();
    let root_pos: Vec<Vec<usize>> = prompts.iter().map(|p| vec![p.len() - 1]).collect();
    let root_values = learner.values_at(&prompts, &root_pos)?;
    for (t, v) in tasks.into_iter().zip(root_values) {
        let root = tree.add_episode(t.id, t.prompt, Some(v[0]))?;
        snapshots.insert(root, t.episode);
    }
    let acfg = AllocatorConfig::new(fcfg.worker_capacity, Budget::Continuations(budget), *seed);
    let mut alloc = Allocator::new(acfg, Focus::new(fcfg.kappa, AsyncGain::EffectiveCount)?)?;
    let mut stats = RolloutStats {
        episodes: tree.episodes().len(),
        ..Default::default()
    };
    while !alloc.is_done() {
        let tickets = alloc.fill(&mut tree)?;
        if tickets.is_empty() {
            if stats.continuations == 0 {
                return Err(TrainError::Rollout(
                    "FOCUS launched no continuation: no candidate state has a positive gain".into(),
                ));
            }
            break;
        }
        let mut conts = Vec::with_capacity(tickets.len());
        for t in tickets {
            let from = t.node();
            let env = snapshots
                .get(&from)
                .ok_or_else(|| {
                    TrainError::Rollout(format!("no environment state kept for node {from:?}"))
                })?
                .fork()?;
            conts.push(Cont {
                ticket: Some(t),
                from,
                context: tree.context_tokens(from)?,
                env,
                replayed: Vec::new(),
                steps: Vec::new(),
                done: false,
            });
        }
        stats.continuations += conts.len();
        run_conts(engine, &mut conts, cfg, seed, &mut stats, true)?;
        let values = segment_values(learner, &conts, &tree)?;
        for (c, v) in conts.into_iter().zip(values) {
            let steps = to_steps(&c, &v)?;
            let ticket = c.ticket.expect("FOCUS continuations have tickets");
            let new = alloc.complete(&mut tree, ticket, steps)?;
            for (id, s) in new.into_iter().zip(c.steps) {
                if let Some(env) = s.env_after {
                    snapshots.insert(id, env);
                }
            }
        }
    }
    let ccfg = CreditConfig {
        kappa: fcfg.kappa,
        gamma: fcfg.gamma,
        lambda: fcfg.lambda,
    };
    let credit = focus_credit(&tree, &ccfg)?;
    let rows = loss_rows(
        &tree,
        &credit.tokens,
        Some(&credit.backup.gbar),
        Sharing::Once,
    )?;
    let mut critic_vs_target = Vec::new();
    for (id, node) in tree.nodes() {
        if let (Some(v), Some(g)) = (node.value(), credit.backup.gbar[id.index()]) {
            if !node.children().is_empty() {
                critic_vs_target.push((v, g));
            }
        }
    }
    Ok(StepRollouts::new(tree, rows, stats, critic_vs_target))
}

/// Greedy (temperature 0) pass rate over `tasks`: the fraction of episodes
/// ending with reward 1.
pub fn evaluate(
    engine: &mut Engine,
    tasks: Vec<TaskInstance>,
    cfg: &RolloutConfig,
) -> Result<f64, TrainError> {
    let n = tasks.len();
    if n == 0 {
        return Ok(0.0);
    }
    let mut conts: Vec<Cont> = tasks
        .into_iter()
        .map(|t| Cont {
            ticket: None,
            from: NodeId(0),
            context: t.prompt,
            env: t.episode,
            replayed: Vec::new(),
            steps: Vec::new(),
            done: false,
        })
        .collect();
    let greedy = RolloutConfig {
        temperature: 0.0,
        ..cfg.clone()
    };
    let mut stats = RolloutStats::default();
    let mut seed = 0;
    run_conts(engine, &mut conts, &greedy, &mut seed, &mut stats, false)?;
    let solved = conts
        .iter()
        .filter(|c| c.steps.last().and_then(|s| s.reward).unwrap_or(0.0) >= 1.0)
        .count();
    Ok(solved as f64 / n as f64)
}

/// Prefix Sampling: GRPO groups of `n`; all-fail / all-pass groups are
/// dropped, balanced ones kept, and skewed ones replaced one for one by `n`
/// re-rollouts that replay a prefix of one of the group's own trajectories
/// (successful for hard groups, failed for easy ones) through the
/// environment, then continue with the current policy. The prefix length is
/// the bucket's controller ratio of the source's generated tokens, snapped to
/// a segment boundary; replayed tokens are masked. Re-rollout outcomes feed
/// the per-bucket controller (one update per step).
pub fn ps_step(
    engine: &mut Engine,
    tasks: Vec<TaskInstance>,
    n: usize,
    budget_prompts: Option<usize>,
    sampler: &mut arbor_rl::prefix::PrefixSampler,
    cfg: &RolloutConfig,
    seed: &mut u64,
) -> Result<StepRollouts, TrainError> {
    use arbor_rl::prefix::{GroupPlan, SourceTrajectory};
    let mut conts = Vec::new();
    let mut meta = Vec::new(); // (task id, prompt) per group
    for t in &tasks {
        for _ in 0..n {
            conts.push(Cont {
                ticket: None,
                from: NodeId(0),
                context: t.prompt.clone(),
                env: t.episode.fork()?,
                replayed: Vec::new(),
                steps: Vec::new(),
                done: false,
            });
        }
        meta.push((t.id.clone(), t.prompt.clone()));
    }
    let mut stats = RolloutStats {
        episodes: conts.len(),
        continuations: conts.len(),
        ..Default::default()
    };
    run_conts(engine, &mut conts, cfg, seed, &mut stats, true)?;
    let success = |c: &Cont| c.steps.last().and_then(|s| s.reward).unwrap_or(0.0) >= 1.0;
    // The baseline's budget: `budget_prompts` groups of `n` trajectories of
    // the first pass's mean generated length; the first pass is charged.
    let first_pass = stats.generated_tokens;
    let budget = budget_prompts
        .map(|p| (first_pass as u128 * p as u128 / tasks.len().max(1) as u128) as u64);
    stats.budget_tokens = budget;
    let mut planned = first_pass;

    let mut tree = RolloutTree::new();
    let mut keep: Vec<Cont> = Vec::new();
    let mut keep_task: Vec<usize> = Vec::new();
    let mut reroll: Vec<Cont> = Vec::new();
    let mut reroll_meta: Vec<(usize, arbor_rl::prefix::Bucket)> = Vec::new();
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
                    success: success(c),
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
                    reroll.push(Cont {
                        ticket: None,
                        from: NodeId(0),
                        context,
                        env: src.steps[j - 1]
                            .env_after
                            .as_ref()
                            .ok_or_else(|| {
                                TrainError::Rollout(
                                    "no environment snapshot kept for a PS source".into(),
                                )
                            })?
                            .fork()?,
                        replayed,
                        steps: Vec::new(),
                        done: false,
                    });
                    reroll_meta.push((g, bucket));
                }
            }
        }
    }
    stats.continuations += reroll.len();
    run_conts(engine, &mut reroll, cfg, seed, &mut stats, false)?;
    let mut outcomes: std::collections::BTreeMap<arbor_rl::prefix::Bucket, (u64, u64)> =
        Default::default();
    for (c, (_, b)) in reroll.iter().zip(&reroll_meta) {
        let e = outcomes.entry(*b).or_default();
        e.0 += u64::from(success(c));
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
        let values = vec![0.5; c.steps.len()];
        tree.add_path(root, to_steps(c, &values)?)?;
    }
    let rows = if tree.is_empty() {
        Vec::new()
    } else {
        let adv = Grpo::default().advantages(&tree)?;
        loss_rows(&tree, &adv, None, Sharing::Once)?
    };
    Ok(StepRollouts::new(tree, rows, stats, Vec::new()))
}

/// Continuations from `from` nodes (one per entry), begun in `tree` and
/// resuming from the kept environment snapshots.
fn begin_conts(
    tree: &mut RolloutTree,
    snapshots: &HashMap<NodeId, Box<dyn TokenEpisode>>,
    from: &[NodeId],
) -> Result<Vec<Cont>, TrainError> {
    from.iter()
        .map(|&n| {
            let env = snapshots
                .get(&n)
                .ok_or_else(|| {
                    TrainError::Rollout(format!("no environment state kept for node {n:?}"))
                })?
                .fork()?;
            Ok(Cont {
                ticket: Some(tree.begin(n)?),
                from: n,
                context: tree.context_tokens(n)?,
                env,
                replayed: Vec::new(),
                steps: Vec::new(),
                done: false,
            })
        })
        .collect()
}

/// Complete finished continuations in `tree` (values per new state, or 0.5),
/// keeping the environment snapshots of the new non-terminal states.
fn complete_conts(
    tree: &mut RolloutTree,
    snapshots: &mut HashMap<NodeId, Box<dyn TokenEpisode>>,
    conts: Vec<Cont>,
    values: Option<Vec<Vec<f64>>>,
) -> Result<(), TrainError> {
    for (i, c) in conts.into_iter().enumerate() {
        let v = match &values {
            Some(v) => v[i].clone(),
            None => vec![0.5; c.steps.len()],
        };
        let steps = to_steps(&c, &v)?;
        let ticket = c
            .ticket
            .ok_or_else(|| TrainError::Rollout("continuation without a ticket".into()))?;
        let new = tree.complete(ticket, steps)?;
        for (id, s) in new.into_iter().zip(c.steps) {
            if let Some(env) = s.env_after {
                snapshots.insert(id, env);
            }
        }
    }
    Ok(())
}

/// PPO with a per-segment critic: `n` full rollouts per task, the critic's
/// value at every state, GAE advantages over segments, and Monte-Carlo
/// returns (`Gbar` with `kappa = 0`) as the critic's targets.
pub fn ppo_step(
    engine: &mut Engine,
    learner: &Learner,
    tasks: Vec<TaskInstance>,
    n: usize,
    fcfg: &FocusConfig,
    cfg: &RolloutConfig,
    seed: &mut u64,
) -> Result<StepRollouts, TrainError> {
    use arbor_rl::baselines::{Critic, PpoGae};
    use arbor_rl::credit::backup;
    let mut tree = RolloutTree::new();
    let mut snapshots = HashMap::new();
    let prompts: Vec<Vec<u32>> = tasks.iter().map(|t| t.prompt.clone()).collect();
    let pos: Vec<Vec<usize>> = prompts.iter().map(|p| vec![p.len() - 1]).collect();
    let root_values = learner.values_at(&prompts, &pos)?;
    let mut roots = Vec::new();
    for (t, v) in tasks.into_iter().zip(root_values) {
        for _ in 0..n {
            let root = tree.add_episode(t.id.clone(), t.prompt.clone(), Some(v[0]))?;
            snapshots.insert(root, t.episode.fork()?);
            roots.push(root);
        }
    }
    let mut conts = begin_conts(&mut tree, &snapshots, &roots)?;
    let mut stats = RolloutStats {
        episodes: conts.len(),
        continuations: conts.len(),
        ..Default::default()
    };
    run_conts(engine, &mut conts, cfg, seed, &mut stats, false)?;
    let values = segment_values(learner, &conts, &tree)?;
    complete_conts(&mut tree, &mut snapshots, conts, Some(values))?;
    let adv = PpoGae {
        gamma: fcfg.gamma,
        lambda: fcfg.lambda,
        critic: Critic::Segment,
    }
    .advantages(&tree)?;
    let targets = backup(
        &tree,
        &CreditConfig {
            gamma: fcfg.gamma,
            lambda: fcfg.lambda,
            kappa: 0.0,
        },
    )?;
    let rows = loss_rows(&tree, &adv, Some(&targets.gbar), Sharing::Once)?;
    let mut critic_vs_target = Vec::new();
    for (id, node) in tree.nodes() {
        if let (Some(v), Some(g)) = (node.value(), targets.gbar[id.index()]) {
            critic_vs_target.push((v, g));
        }
    }
    Ok(StepRollouts::new(tree, rows, stats, critic_vs_target))
}

/// VinePPO: one main trajectory per task, then `k` Monte-Carlo
/// continuations from every state of it (the root's `k` include the main
/// one); advantages `A(s->c) = r + gamma Vhat(c) - Vhat(s)` from the
/// Monte-Carlo values, on the main trajectories only.
pub fn vineppo_step(
    engine: &mut Engine,
    tasks: Vec<TaskInstance>,
    k: u32,
    gamma: f64,
    cfg: &RolloutConfig,
    seed: &mut u64,
) -> Result<StepRollouts, TrainError> {
    use arbor_rl::baselines::VinePpo;
    let vine = VinePpo { gamma };
    let mut tree = RolloutTree::new();
    let mut snapshots = HashMap::new();
    let mut roots = Vec::new();
    for t in tasks {
        let root = tree.add_episode(t.id, t.prompt, None)?;
        snapshots.insert(root, t.episode);
        roots.push(root);
    }
    let mut stats = RolloutStats {
        episodes: roots.len(),
        ..Default::default()
    };
    let mut main = begin_conts(&mut tree, &snapshots, &roots)?;
    stats.continuations += main.len();
    run_conts(engine, &mut main, cfg, seed, &mut stats, true)?;
    complete_conts(&mut tree, &mut snapshots, main, None)?;
    // Continuations launched at a root are main trajectories themselves, so
    // their states are planned in the next round; later rounds launch only
    // below the root and end the loop.
    loop {
        let plan = vine.plan(&tree, k)?;
        if plan.is_empty() {
            break;
        }
        let from: Vec<NodeId> = plan
            .iter()
            .flat_map(|&(n, c)| std::iter::repeat_n(n, c as usize))
            .collect();
        let mut mc = begin_conts(&mut tree, &snapshots, &from)?;
        stats.continuations += mc.len();
        run_conts(engine, &mut mc, cfg, seed, &mut stats, true)?;
        complete_conts(&mut tree, &mut snapshots, mc, None)?;
    }
    let adv = vine.advantages(&tree)?;
    let rows = loss_rows(&tree, &adv, None, Sharing::Once)?;
    Ok(StepRollouts::new(tree, rows, stats, Vec::new()))
}
