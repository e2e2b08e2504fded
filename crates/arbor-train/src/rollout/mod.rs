//! Rollouts: multi-turn episodes driven on the engine, recorded into an
//! [`arbor_rl::RolloutTree`], and the credit each method assigns them.
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
//! shared context. [`conts`] runs continuations; each method is one
//! [`RolloutPolicy`] in its own module:
//!
//! | `algo` | policy | where continuations start | credit |
//! |---|---|---|---|
//! | `focus` | [`focus::FocusPolicy`] | any tree state, by expected critic-MSE reduction | Eq. 1 backups, TD(lambda) advantages, critic targets |
//! | `grpo` | [`grpo::GrpoPolicy`] | the roots, `n` each | group-normalised rewards |
//! | `ps` | [`ps::PsPolicy`] | roots, then replayed prefixes of skewed groups | group-normalised rewards |
//! | `ppo` | [`ppo::PpoPolicy`] | the roots, `n` each | GAE over segments, Monte-Carlo critic targets |
//! | `vineppo` | [`vineppo::VinePpoPolicy`] | a main path, then `k` from each of its states | Monte-Carlo values |

use std::collections::HashMap;

use arbor_engine::Engine;
use arbor_rl::credit::LossRow;
use arbor_rl::{RolloutTree, TokenKind};
use serde::{Deserialize, Serialize};

use crate::config::{Algo, StepBudget, TrainConfig};
use crate::learner::Learner;
use crate::TrainError;

pub mod conts;
pub mod eval;
pub mod focus;
pub mod grpo;
pub mod heldout;
pub mod ppo;
pub mod ps;
pub mod sched;
pub(crate) mod span;
pub mod vineppo;

pub use crate::config::FocusConfig;
pub use eval::evaluate;

/// What the environment says after a segment.
#[derive(Debug, Clone, PartialEq)]
pub struct StepOut {
    /// Tokens appended to the context (masked in the loss), or the whole
    /// new context when `restart` is set.
    pub observation: Vec<u32>,
    /// `Some(reward)` when the episode is over.
    pub reward: Option<f64>,
    /// The observation replaces the context (a compaction): a segment
    /// boundary whose state sees only the observation.
    pub restart: bool,
    /// The kind of the policy's next segment: a task action, or context
    /// management (a compaction summary). Both are trained.
    pub next: TokenKind,
}

impl StepOut {
    /// An observation appended to the context; the next segment is a task
    /// action.
    pub fn new(observation: Vec<u32>, reward: Option<f64>) -> Self {
        StepOut {
            observation,
            reward,
            restart: false,
            next: TokenKind::Action,
        }
    }
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
    /// The kind of the policy's next segment in this state: a task action,
    /// or context management where the environment asked for a compaction
    /// summary (a continuation forked here trains it as such).
    fn next_kind(&self) -> TokenKind {
        TokenKind::Action
    }
    /// Context-management counts of this episode (environments with a
    /// bounded context).
    fn context_stats(&self) -> Option<arbor_env::context::ContextStats> {
        None
    }
    /// Whether `replayed`, the observation an action gives when executed
    /// again, counts as `recorded` (Prefix Sampling's replay through
    /// execution). Exact by default.
    fn same_observation(&self, recorded: &[u32], replayed: &[u32]) -> bool {
        recorded == replayed
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
    /// Sampling temperature (0: greedy).
    pub temperature: f32,
    /// Tokens that end a segment.
    pub segment_stop: Vec<u32>,
    /// Longest segment, tokens.
    pub max_segment_tokens: usize,
    /// Segments per episode before it is truncated (reward 0).
    pub max_segments: usize,
    /// Token ids whose text holds a newline, ascending (Prefix Sampling's
    /// `cut = "lines"`; empty without a tokenizer).
    pub line_ends: std::sync::Arc<[u32]>,
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
    /// Seconds in engine steps.
    pub generate_s: f64,
    /// Seconds of environment steps, summed over env workers.
    pub env_s: f64,
    /// Seconds the engine had nothing to decode while episodes waited for
    /// their environments (env workers only; inline steps are in `env_s`).
    pub engine_idle_s: f64,
    /// Wall seconds of the step's rollouts.
    pub rollout_s: f64,
    /// Episodes that ended in this step's continuations, and the tool calls
    /// they made in all (per episode, replayed prefixes included).
    pub finished_episodes: u64,
    pub tool_calls: u64,
    /// Context management of the finished episodes, summed (bounded
    /// contexts: compactions, summary tokens, resets, malformed summaries).
    pub context: arbor_env::context::ContextStats,
    /// Generated-token budget of the step, where one is enforced.
    pub budget_tokens: Option<u64>,
}

impl RolloutStats {
    /// Add `o`'s counts and times to these (`budget_tokens` is kept).
    pub(crate) fn add(&mut self, o: &RolloutStats) {
        self.episodes += o.episodes;
        self.continuations += o.continuations;
        self.generated_tokens += o.generated_tokens;
        self.replayed_tokens += o.replayed_tokens;
        self.prefill_computed += o.prefill_computed;
        self.prefill_cached += o.prefill_cached;
        self.generate_s += o.generate_s;
        self.env_s += o.env_s;
        self.engine_idle_s += o.engine_idle_s;
        self.rollout_s += o.rollout_s;
        self.finished_episodes += o.finished_episodes;
        self.tool_calls += o.tool_calls;
        self.context.add(&o.context);
    }
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
    /// Groups in the update whose rewards are not all equal (the groups
    /// that carry a GRPO signal).
    pub effective_groups: usize,
    /// `(V_phi(s), Gbar(s))` at nodes with children (FOCUS health).
    pub critic_vs_target: Vec<(f64, f64)>,
    /// Where the allocator spent the budget (FOCUS).
    pub allocation: Option<arbor_rl::diagnostics::AllocationSummary>,
    /// Generated tokens per task drawn, as the method's
    /// [`RolloutPolicy::tasks_for_budget`] reads it (default: all of the
    /// step's generated tokens over its tasks).
    pub tokens_per_task: Option<f64>,
    /// What Prefix Sampling did (PS only).
    pub ps: Option<ps::PsReport>,
}

impl StepRollouts {
    pub(crate) fn new(
        tree: RolloutTree,
        rows: Vec<LossRow>,
        stats: RolloutStats,
        critic_vs_target: Vec<(f64, f64)>,
    ) -> Self {
        let (rewards, effective_group_fraction, effective_groups) = group_stats(&tree);
        StepRollouts {
            tree,
            rows,
            stats,
            rewards,
            effective_group_fraction,
            effective_groups,
            critic_vs_target,
            allocation: None,
            tokens_per_task: None,
            ps: None,
        }
    }
}

/// Terminal rewards of the tree's finished trajectories, the share of
/// groups (episodes' task keys) whose rewards are not all equal, and their
/// number.
fn group_stats(tree: &RolloutTree) -> (Vec<f64>, f64, usize) {
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
    (rewards, mixed as f64 / by_task.len().max(1) as f64, mixed)
}

/// Run one episode per task to its end on the rollout scheduler, sampling
/// with `cfg` from the seed counter `seed` ([`sched`] derives each
/// segment's seed from it), environment steps inline (`env_workers = 0`) or
/// on that many threads. Returns each episode's final reward, in task
/// order, and the accounting (wall, engine, environment and engine-idle
/// time).
pub fn run_episodes(
    engine: &mut Engine,
    tasks: Vec<TaskInstance>,
    cfg: &RolloutConfig,
    seed: u64,
    env_workers: usize,
) -> Result<(Vec<f64>, RolloutStats), TrainError> {
    let (eps, stats) = run_episodes_detailed(engine, tasks, cfg, seed, env_workers)?;
    Ok((eps.iter().map(|e| e.reward).collect(), stats))
}

/// One finished episode of [`run_episodes_detailed`].
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct EpisodeResult {
    /// The final reward.
    pub reward: f64,
    /// Policy turns (segments) taken.
    pub turns: usize,
    /// Tokens the policy generated.
    pub generated_tokens: usize,
    /// Tokens in the final context (prompt, actions, observations).
    pub context_tokens: usize,
}

/// [`run_episodes`] with each episode's turns and tokens.
pub fn run_episodes_detailed(
    engine: &mut Engine,
    tasks: Vec<TaskInstance>,
    cfg: &RolloutConfig,
    mut seed: u64,
    env_workers: usize,
) -> Result<(Vec<EpisodeResult>, RolloutStats), TrainError> {
    let conts: Vec<conts::Cont> = tasks
        .into_iter()
        .map(|t| conts::Cont::new(None, arbor_rl::NodeId(0), t.prompt, t.episode))
        .collect();
    let mut sched = sched::Scheduler::new(engine, cfg, &mut seed, false, env_workers)?;
    let done = sched.run_all(conts)?;
    let mut stats = sched.finish();
    stats.episodes = done.len();
    let eps = done
        .iter()
        .map(|c| EpisodeResult {
            reward: c.reward(),
            turns: c.steps.len(),
            generated_tokens: c.generated(),
            context_tokens: c.context.len(),
        })
        .collect();
    Ok((eps, stats))
}

/// How many tasks `tokens` generated tokens buy at `per_task` each
/// (rounded, at least one).
pub(crate) fn tasks_buying(tokens: f64, per_task: f64) -> usize {
    ((tokens / per_task.max(1.0)).round() as usize).max(1)
}

/// What a rollout policy gets from the trainer for one step.
pub struct StepContext<'a> {
    /// The rollout engine over the learner's current weights.
    pub engine: &'a mut Engine,
    /// The learner (critic values for FOCUS and PPO).
    pub learner: &'a Learner,
    /// How segments are sampled.
    pub rollout: &'a RolloutConfig,
    /// The run's sampling-seed counter, advanced once per segment request.
    pub seed: &'a mut u64,
    /// The RL step, from 1.
    pub step: u64,
    /// Environment worker threads (0: environment steps run inline).
    pub env_workers: usize,
    /// The step's generated-token budget, when the run has one
    /// (`budget = { tokens = N }`, plus what earlier steps left unspent).
    pub budget_tokens: Option<u64>,
    /// This rank's data-parallel group (a group of one by default).
    pub group: &'a mut dyn crate::dist::Collective,
    /// The tasks this rank runs, as indices into the step's task list: all
    /// of them on one rank; on several, a policy that
    /// [spans the ranks](RolloutPolicy::spans_ranks) is given every task
    /// and runs these, the others are given only these.
    pub owned: std::ops::Range<usize>,
}

impl StepContext<'_> {
    /// The rollout scheduler of this step, keeping environment snapshots
    /// after each segment if `keep_snapshots` (see [`sched::Scheduler`]).
    pub(crate) fn scheduler(
        &mut self,
        keep_snapshots: bool,
    ) -> Result<sched::Scheduler<'_>, TrainError> {
        sched::Scheduler::new(
            self.engine,
            self.rollout,
            self.seed,
            keep_snapshots,
            self.env_workers,
        )
    }
}

/// State a policy carries across steps, saved in checkpoints.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PolicyState {
    /// Prefix Sampling controller state per bucket.
    #[serde(default)]
    pub ps_buckets: Vec<(arbor_rl::prefix::Bucket, arbor_rl::prefix::BucketState)>,
}

/// One method's rollouts and credit: where continuations start, how many,
/// and the loss rows they become.
pub trait RolloutPolicy: Send {
    /// Tasks drawn for one step.
    fn tasks_per_step(&self) -> usize;
    /// Tasks drawn for a step with a budget of `tokens` generated tokens,
    /// when recent steps spent `per_task` per task: as many as the budget
    /// buys, at least one.
    fn tasks_for_budget(&self, tokens: u64, per_task: f64) -> usize {
        tasks_buying(tokens as f64, per_task)
    }
    /// Whether the method's step-wide decisions are made over the whole
    /// group's tasks (FOCUS allocates one budget among every tree). On
    /// several ranks such a policy is given every task of the step and
    /// coordinates the ranks itself through [`StepContext::group`]: it
    /// runs its [`owned`](StepContext::owned) tasks, keeps its launch
    /// indices (and so its seeds) global, returns the loss rows of its own
    /// tasks only, and the same rewards, tree and diagnostics on every
    /// rank. Other policies are given their share of the tasks and never
    /// see the rest.
    fn spans_ranks(&self) -> bool {
        false
    }
    /// Generate the step's rollouts on `tasks` and assign their credit.
    fn rollouts(
        &mut self,
        ctx: StepContext<'_>,
        tasks: Vec<TaskInstance>,
    ) -> Result<StepRollouts, TrainError>;
    /// The state to checkpoint (none by default).
    fn state(&self) -> PolicyState {
        PolicyState::default()
    }
    /// Continue from a checkpointed state.
    fn restore(&mut self, _state: &PolicyState) -> Result<(), TrainError> {
        Ok(())
    }
}

/// The rollout policy of `cfg.algo`, configured from `cfg`.
pub fn policy_for(cfg: &TrainConfig) -> Box<dyn RolloutPolicy> {
    let n = cfg.samples_per_prompt;
    let (tasks, conts) = match cfg.budget {
        Some(StepBudget::Continuations(k)) => ((k as usize / n).max(1), k),
        _ => (cfg.prompts_per_step, (cfg.prompts_per_step * n) as u64),
    };
    match cfg.algo {
        Algo::Grpo => Box::new(grpo::GrpoPolicy { tasks, n }),
        Algo::Focus => Box::new(focus::FocusPolicy {
            tasks: cfg.prompts_per_step,
            budget: conts,
            cfg: cfg.focus,
        }),
        Algo::Ppo => Box::new(ppo::PpoPolicy {
            tasks,
            n,
            gamma: cfg.ppo.gamma,
            lambda: cfg.ppo.lambda,
        }),
        Algo::Vineppo => Box::new(vineppo::VinePpoPolicy {
            tasks,
            k: n as u32,
            gamma: cfg.ppo.gamma,
        }),
        Algo::Ps => Box::new(ps::PsPolicy::new(cfg)),
    }
}
