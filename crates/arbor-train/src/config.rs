//! The run's configuration: one struct tree read from TOML, every section
//! with a `Default`, unknown keys refused, and [`TrainConfig::validate`]
//! naming the key of any value out of range.
//!
//! ```toml
//! seed = 0
//! steps = 100
//! algo = "focus"            # focus | grpo | ps | ppo | vineppo
//! prompts_per_step = 16
//! samples_per_prompt = 8
//! [model]      # ModelSpec
//! [task]       # TaskConfig (tasks.rs)
//! [warmup]     # WarmupConfig
//! [optimizer]  # AdamWConfig (optim.rs)
//! [learner]    # LearnerConfig (learner.rs)
//! [focus]      # FocusConfig
//! [ps]         # PsSettings
//! [ppo]        # PpoSettings
//! ```

use arbor_model::{Arch, CriticMode, ModelConfig, RopeScaling};
use candle_core::Device;
use serde::{Deserialize, Serialize};

use crate::learner::LearnerConfig;
use crate::optim::AdamWConfig;
pub use crate::tasks::TaskConfig;
use crate::TrainError;

/// Rollout allocation / credit method.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Algo {
    /// FOCUS tree allocation, Eq. 1 backups, TD advantages, critic targets.
    Focus,
    /// GRPO groups of `samples_per_prompt` full rollouts.
    Grpo,
    /// Prefix Sampling on GRPO groups: skewed groups are replaced by
    /// re-rollouts from replayed prefixes of their own trajectories.
    Ps,
    /// PPO with a per-segment critic and GAE (`ppo.gamma`, `ppo.lambda`);
    /// `samples_per_prompt` full rollouts per task.
    Ppo,
    /// VinePPO: one main rollout per task and `samples_per_prompt`
    /// Monte-Carlo continuations from each of its states (`ppo.gamma`).
    Vineppo,
}

impl Algo {
    /// Whether the method trains a critic (FOCUS, PPO).
    pub fn has_critic(self) -> bool {
        matches!(self, Algo::Focus | Algo::Ppo)
    }
}

/// The policy model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelSpec {
    /// An HF checkpoint to train (directory or `org/name`); when set, the
    /// size fields below are ignored. Without it, a tiny Qwen3-architecture
    /// model sized for the built-in vocabulary is randomly initialised from
    /// the run seed.
    pub path: Option<String>,
    /// Width of the residual stream of the tiny model (>= 1).
    pub hidden_size: usize,
    /// Decoder layers of the tiny model (>= 1).
    pub layers: usize,
    /// Query heads of the tiny model (a multiple of `kv_heads`).
    pub heads: usize,
    /// Key/value heads of the tiny model (grouped-query attention, >= 1).
    pub kv_heads: usize,
    /// Width of one attention head of the tiny model (even, for RoPE).
    pub head_dim: usize,
    /// Hidden width of the tiny model's SwiGLU MLP (>= 1).
    pub intermediate_size: usize,
    /// LoRA on the policy (`[model.lora]`: rank, alpha, targets): the base
    /// weights stay frozen, adapters train; checkpoints keep the adapters
    /// (`policy_lora.safetensors`) and export the merged model under `policy/`.
    pub lora: Option<arbor_model::LoraConfig>,
}

impl Default for ModelSpec {
    fn default() -> Self {
        ModelSpec {
            path: None,
            hidden_size: 64,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            intermediate_size: 128,
            lora: None,
        }
    }
}

impl ModelSpec {
    /// The tiny model's architecture for a vocabulary of `vocab` tokens.
    pub fn config(&self, vocab: usize) -> ModelConfig {
        ModelConfig {
            arch: Arch::Qwen3,
            vocab_size: vocab,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_hidden_layers: self.layers,
            num_attention_heads: self.heads,
            num_key_value_heads: self.kv_heads,
            head_dim: self.head_dim,
            rms_norm_eps: 1e-6,
            rope_theta: 10000.0,
            rope_scaling: RopeScaling::Default,
            max_position_embeddings: 1024,
            tie_word_embeddings: true,
            qkv_bias: false,
            o_bias: false,
            qk_norm: true,
            torch_dtype: Some("float32".into()),
            bos_token_id: None,
            eos_token_ids: vec![],
        }
    }
}

/// Supervised warm-up on the task's demonstrations (synthetic tasks only).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WarmupConfig {
    /// Most supervised steps (0: no warm-up).
    pub steps: u64,
    /// Demonstrations per supervised step (>= 1).
    pub batch: usize,
    /// Learning rate of the warm-up (constant; the RL optimizer starts
    /// fresh after it).
    pub lr: f64,
    /// Stop early once the greedy pass rate on the held-out eval tasks
    /// reaches this, in `[0, 1]` (checked every `check_every` steps), so RL
    /// starts from a comparable policy whatever the seed or machine.
    pub stop_at_eval: Option<f64>,
    /// Supervised steps between two checks of `stop_at_eval`.
    pub check_every: u64,
}

impl Default for WarmupConfig {
    fn default() -> Self {
        WarmupConfig {
            steps: 0,
            batch: 32,
            lr: 3e-3,
            stop_at_eval: None,
            check_every: 10,
        }
    }
}

/// FOCUS settings (`[focus]`; docs/focus.md: the allocator and Eq. 1).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FocusConfig {
    /// Prior strength `kappa > 0` of the critic: the Beta prior's weight in
    /// the allocator's posterior, and in the Eq. 1 backup
    /// `Vtilde(s) = (kappa V(s) + |C(s)| Gbar(s)) / (kappa + |C(s)|)`.
    pub kappa: f64,
    /// Discount `gamma` in `[0, 1]` of the backups and TD advantages.
    pub gamma: f64,
    /// TD(lambda) mixing in `[0, 1]` of the advantages (0: one-step TD
    /// residuals; 1: Monte-Carlo-like returns through the backups).
    pub lambda: f64,
    /// Continuations in flight at once (the engine batch, >= 1).
    pub worker_capacity: u32,
    /// The allocation score: the spec's `g` (default) or a variant
    /// (`bias`: plus the critic-bias term; `propagated`: weighted by the
    /// Eq. 1 weights to the ancestors). See `arbor_rl::focus::Score`.
    pub score: arbor_rl::focus::Score,
    /// Which outcomes count as a state's evidence `n`: `on_policy`
    /// (default) or `subtree` (every outcome below it).
    pub evidence: arbor_rl::focus::Evidence,
    /// Skip states whose subtree already ended with at least this many
    /// outcomes, all equal (0: off, the spec).
    pub prune_settled: u32,
    /// The critic's regression targets: `gbar` (the spec: Eq. 1's `Gbar`,
    /// which mixes the critic's own values into every level) or
    /// `monte_carlo` (the same backup with `kappa = 0`: the mean outcome
    /// below each state, recursively, with no critic in it). Allocation
    /// and advantages are unchanged.
    pub critic_targets: CriticTargets,
    /// Subtract the step's mean advantage (over every trained token of the
    /// forest, weighted as the loss weighs them) from each trained token's
    /// advantage, so a critic that over- or underestimates every state
    /// does not push all sampled tokens down or up (default false: the
    /// spec's residuals as they are).
    pub center_advantages: bool,
    /// Continuations every root gets before any other state
    /// ([`arbor_rl::focus::Focus::with_root_samples`]; 0: the spec).
    pub root_samples: u32,
    /// States whose path holds a policy token sampled at a logprob below
    /// `-slip_nats` go last ([`arbor_rl::focus::Focus::with_slip_nats`];
    /// 0: off, the spec).
    pub slip_nats: f64,
}

/// What FOCUS's critic regresses onto (`[focus] critic_targets`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CriticTargets {
    #[default]
    Gbar,
    MonteCarlo,
}

impl Default for FocusConfig {
    fn default() -> Self {
        FocusConfig {
            kappa: 1.0,
            gamma: 1.0,
            lambda: 0.0,
            worker_capacity: 64,
            score: arbor_rl::focus::Score::Spec,
            evidence: arbor_rl::focus::Evidence::OnPolicy,
            prune_settled: 0,
            critic_targets: CriticTargets::Gbar,
            center_advantages: false,
            root_samples: 0,
            slip_nats: 0.0,
        }
    }
}

/// How a separate critic starts (`[critic] init`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CriticInit {
    /// The policy's weights (after the supervised warm-up, where one runs)
    /// with a fresh value head: the critic starts with the policy's
    /// features instead of noise.
    #[default]
    Policy,
    /// Its own initialisation: the critic checkpoint's or a random one.
    Own,
}

/// The critic's own settings (`[critic]`): its initialisation, and an
/// optimizer of its own (learning rate and gradient clip; the schedule's
/// shape and AdamW's moments follow `[optimizer]`). With a shared trunk
/// (`learner.critic = "shared"`) these apply to the value head.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CriticSettings {
    /// Where a separate critic's backbone starts.
    pub init: CriticInit,
    /// Peak learning rate (default: `optimizer.lr`).
    pub lr: Option<f64>,
    /// Global gradient-norm clip of the critic's parameters, apart from the
    /// policy's (default: `optimizer.grad_clip`; 0: none).
    pub grad_clip: Option<f64>,
    /// Held-out diagnostic on evaluation steps: this many held-out tasks
    /// get one trajectory each, and every state on it is scored by the
    /// critic and by `heldout_samples` Monte-Carlo continuations (not
    /// trained on, not counted in the budget). 0: off.
    pub heldout_tasks: usize,
    /// Monte-Carlo continuations per held-out state (>= 1).
    pub heldout_samples: usize,
    /// Extra passes of the critic alone over each step's value targets,
    /// after the joint update (0: none). The critic sees each state's
    /// value through few noisy outcomes; more optimizer steps on the same
    /// targets let it fit them (`arbor bench critic` measures how many it
    /// needs). They move the critic's parameters only.
    pub epochs: usize,
    /// Optimizer steps per extra pass: the step's rows shuffled and split
    /// this many ways (>= 1).
    pub minibatches: usize,
    /// The extra passes also go over the value targets of this many
    /// earlier steps (a replay of recent trees, their targets as computed
    /// then; kept in checkpoints). Needs `epochs >= 1`.
    pub replay_steps: usize,
    /// The critic also reads the policy's surprise along the episode's
    /// path to the state (through compactions): per threshold of 0.5, 1
    /// and 2 nats, `ln(1 + n)` with `n` the policy tokens so far whose
    /// sampled logprob fell below minus the threshold, each weighted by a learnt coefficient (starting at 0)
    /// added to the value head's output. A state's value often hinges on
    /// an earlier mistake, and a token the policy rarely picks is more
    /// often one (`arbor bench critic --surprise` measures it). Chosen on
    /// contexts of tens of tokens: over long responses the counts grow
    /// large.
    pub surprise: bool,
}

impl Default for CriticSettings {
    fn default() -> Self {
        CriticSettings {
            init: CriticInit::Policy,
            lr: None,
            grad_clip: None,
            heldout_tasks: 8,
            heldout_samples: 4,
            epochs: 0,
            minibatches: 4,
            replay_steps: 0,
            surprise: false,
        }
    }
}

/// Discounting of the critic-based baselines (`[ppo]`): PPO's GAE and
/// VinePPO's Monte-Carlo advantages.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PpoSettings {
    /// Discount `gamma` in `[0, 1]` per segment.
    pub gamma: f64,
    /// GAE `lambda` in `[0, 1]` (PPO only; 0: one-step TD residuals).
    pub lambda: f64,
}

impl Default for PpoSettings {
    fn default() -> Self {
        PpoSettings {
            gamma: 1.0,
            lambda: 0.0,
        }
    }
}

/// The context the policy works in (`[harness]`).
///
/// With `context_tokens` set, an episode's context never exceeds it. What
/// happens when it is full is `compaction`: `none` ends the episode
/// (reward 0); `free_form` and `structured` ask the policy for a summary
/// (its own segment, [`arbor_rl::TokenKind::ContextManagement`], trained
/// with the episode's credit) and restart the context from the task and
/// the summary; `workspace` gives the policy memory tools and restarts
/// from the task alone. Every restart is a tree state FOCUS can fork from.
/// The built-in token tasks run under [`arbor_env::context::BoundedContext`];
/// SWE tasks under the tool harness's context modes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HarnessSettings {
    /// Largest context, tokens (unset: only the engine's context limit).
    pub context_tokens: Option<usize>,
    /// What the policy does when the context is full.
    pub compaction: arbor_env::context::Compaction,
    /// Compactions per episode; one more ends it (reward 0).
    pub max_compactions: usize,
}

impl Default for HarnessSettings {
    fn default() -> Self {
        HarnessSettings {
            context_tokens: None,
            compaction: arbor_env::context::Compaction::None,
            max_compactions: 16,
        }
    }
}

/// Prefix Sampling settings (`[ps]`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PsSettings {
    /// Half-width in `[0, 0.5]` of the balanced band around 1/2: groups whose
    /// pass rate is inside are kept as they are.
    pub band: f64,
    /// The per-bucket ratio controller (`eta = 0`: fixed ratios).
    pub controller: arbor_rl::prefix::ControllerConfig,
    /// Hold each step's generated tokens to the GRPO baseline's budget: the
    /// first pass runs on `(1 - reserve) * prompts_per_step` prompts, the
    /// budget is `prompts_per_step * samples_per_prompt` times the first
    /// pass's mean trajectory length, and re-rollouts spend the rest
    /// (a skewed group whose re-rollouts would not fit keeps its members).
    pub match_budget: bool,
    /// Share of the budget kept for re-rollouts, in `(0, 1)`.
    pub reserve: f64,
    /// Where a prefix may be cut.
    pub cut: PsCut,
    /// How a replayed prefix rebuilds the environment.
    pub replay: PsReplay,
    /// Members of a re-rollout group (0: `samples_per_prompt`).
    pub rerollouts: usize,
    /// Re-rollout groups per skewed group, each from a different source
    /// member with the outcome the bucket needs (as many as it has); `>= 1`.
    pub sources: usize,
    /// Re-rollout groups tried per skewed group: an attempt whose members
    /// all end alike is not trained, and the next one bisects the cut
    /// ([`arbor_rl::prefix::CutSearch`]); `>= 1`.
    pub attempts: u32,
    /// Members of an attempt launched first (0: all `rerollouts` at once).
    /// When they all end alike the attempt stops there (the cut is
    /// bisected); when their outcomes differ the rest are launched at the
    /// same cut, so every group formed has mixed outcomes.
    pub probe: usize,
    /// Easy groups: cut the failed source no later than where it leaves
    /// the longest prefix it shares with a success of its group (the
    /// decision where it went wrong), unless the bucket ratio cuts earlier
    /// ([`arbor_rl::prefix::PsConfig::anchor`]).
    pub anchor: bool,
    /// How a source's cut is chosen: `ratio` (the method: the bucket's
    /// replayed fraction) or `estimate` (where the group's own successes
    /// put the pass probability nearest the bucket's aim;
    /// [`arbor_rl::prefix::CutRule`]).
    pub cut_rule: arbor_rl::prefix::CutRule,
    /// Train the skewed first-pass group itself beside its re-rollouts
    /// (`false`: its re-rollouts replace it, the method's project choice;
    /// a group that gets no trained re-rollout group then trains as it
    /// is).
    pub keep_skewed: bool,
}

impl Default for PsSettings {
    fn default() -> Self {
        PsSettings {
            band: 0.125,
            controller: arbor_rl::prefix::ControllerConfig::default(),
            match_budget: true,
            reserve: 0.25,
            cut: PsCut::Auto,
            replay: PsReplay::Execute,
            rerollouts: 0,
            sources: 1,
            attempts: 3,
            probe: 0,
            anchor: false,
            cut_rule: arbor_rl::prefix::CutRule::Ratio,
            keep_skewed: true,
        }
    }
}

/// Where Prefix Sampling may cut a source (`[ps] cut`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PsCut {
    /// `boundaries` for multi-turn tasks (`max_segments > 1`), `tokens`
    /// for single-turn ones.
    #[default]
    Auto,
    /// After any response token.
    Tokens,
    /// After a response token whose text holds a newline (text tasks).
    Lines,
    /// Between segments only (after a tool call, turn or compaction).
    Boundaries,
}

/// How a re-rollout's environment reaches the end of its replayed prefix
/// (`[ps] replay`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PsReplay {
    /// A fresh episode; the prefix's actions go through the environment's
    /// parser and executor in order and each observation must equal the
    /// recorded one (a divergence or a failing call drops that replay,
    /// counted).
    #[default]
    Execute,
    /// Fork the environment state kept after the source's segment (the
    /// first pass keeps a snapshot after every segment; no re-execution).
    Snapshot,
}

/// A step's generation budget, the same for every method (`budget = {
/// tokens = N }` or `budget = { continuations = N }`).
///
/// - `tokens`: generated (policy) tokens per step, counted by the engine.
///   FOCUS allocates continuations until the next one could overrun it;
///   group methods (GRPO, PPO, PS, VinePPO) draw as many tasks as the
///   budget buys at their recent tokens per task. What a step leaves
///   unspent or overspends carries over to the next (at most one budget
///   either way), so over a run every method spends the same tokens.
///   Critic warm-up steps, VinePPO's Monte-Carlo samples and PS
///   re-rollouts all count.
/// - `continuations`: FOCUS's continuations per step; group methods run
///   `N / samples_per_prompt` groups.
///
/// Without one, FOCUS spends `prompts_per_step * samples_per_prompt`
/// continuations and the group methods `prompts_per_step` groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum StepBudget {
    Tokens(u64),
    Continuations(u64),
}

/// A whole training run. Unknown keys are errors; `seed`, `steps`, `algo`,
/// `prompts_per_step` and `samples_per_prompt` are required, every other key
/// takes its default (`TrainConfig::default()`, the embedded quickstart's
/// scale).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// Seed of the model's initialisation, the task order and sampling.
    pub seed: u64,
    /// RL steps (>= 1).
    pub steps: u64,
    /// Rollout allocation and credit method.
    pub algo: Algo,
    /// Tasks per step (>= 1).
    pub prompts_per_step: usize,
    /// GRPO group size (>= 2 for GRPO, PS, PPO and VinePPO's Monte-Carlo
    /// count); FOCUS spends `prompts_per_step * samples_per_prompt`
    /// continuations, so every method uses the same budget of continuations.
    pub samples_per_prompt: usize,
    /// Sampling temperature of the rollouts (> 0).
    pub temperature: f32,
    /// The policy model.
    pub model: ModelSpec,
    /// The task the policy trains on.
    pub task: TaskConfig,
    /// The policy's context: its size and compaction.
    pub harness: HarnessSettings,
    /// Supervised warm-up before RL.
    pub warmup: WarmupConfig,
    /// AdamW and its schedule (`total_steps` is set from `steps * epochs`).
    pub optimizer: AdamWConfig,
    /// The PPO / value update.
    pub learner: LearnerConfig,
    /// FOCUS allocation and credit.
    pub focus: FocusConfig,
    /// Prefix Sampling.
    pub ps: PsSettings,
    /// PPO's and VinePPO's discounting.
    pub ppo: PpoSettings,
    /// First RL steps that train only the critic (FOCUS, PPO).
    pub critic_warmup_steps: u64,
    /// The critic's initialisation and optimizer (FOCUS, PPO).
    pub critic: CriticSettings,
    /// Generation budget per step (see [`StepBudget`]).
    pub budget: Option<StepBudget>,
    /// Environment worker threads: environment steps (tool calls,
    /// sandboxes) run on them while the engine keeps decoding the other
    /// continuations. 0 runs them inline, deterministically (right for
    /// environments that answer in microseconds).
    pub env_workers: usize,
    /// Evaluate (greedy pass rate on held-out tasks) every N steps (>= 1),
    /// and after the last.
    pub eval_every: u64,
    /// Held-out tasks per evaluation (capped by a dataset's size).
    pub eval_tasks: usize,
    /// Write a checkpoint every N steps (0: only at the end).
    pub checkpoint_every: u64,
    /// Checkpoints kept on disk (the newest; at least 1).
    pub keep_last: usize,
    /// KV-cache memory of the rollout engine, MiB.
    pub kv_memory_mib: usize,
    /// On a GPU, roll out an f32 policy through the engine's dedicated
    /// bf16 step (a bf16 copy of the weights refreshed in place after each
    /// update, a bf16 KV cache): `arbor_engine::EngineConfig::bf16_rollouts`.
    /// The learner computes as `[learner] precision` says (f32 by default,
    /// or mixed bf16).
    #[serde(default)]
    pub bf16_rollouts: bool,
    /// Where the policy, critic, optimizer state and rollout KV live:
    /// `cpu` (default), `cuda` or `cuda:N` (needs a `--features cuda`
    /// build). Resume is bit-exact on the CPU.
    pub device: String,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            seed: 0,
            steps: 100,
            algo: Algo::Focus,
            prompts_per_step: 16,
            samples_per_prompt: 8,
            temperature: 1.0,
            model: ModelSpec::default(),
            task: TaskConfig::default(),
            harness: HarnessSettings::default(),
            warmup: WarmupConfig::default(),
            optimizer: AdamWConfig::default(),
            learner: LearnerConfig::default(),
            focus: FocusConfig::default(),
            ps: PsSettings::default(),
            ppo: PpoSettings::default(),
            critic_warmup_steps: 0,
            critic: CriticSettings::default(),
            budget: None,
            env_workers: 0,
            eval_every: 10,
            eval_tasks: 64,
            checkpoint_every: 10,
            keep_last: 2,
            kv_memory_mib: 256,
            bf16_rollouts: false,
            device: "cpu".into(),
        }
    }
}

/// The first line of an error (candle's carry a backtrace).
fn first_line(e: &dyn std::fmt::Display) -> String {
    e.to_string().lines().next().unwrap_or_default().to_string()
}

/// `cpu`, `cuda` or `cuda:N` as a candle device; a CUDA device is set up
/// by `arbor_ops::cuda::tune_device` (no event tracking, a pool that keeps
/// its memory) before anything is loaded on it.
pub fn parse_device(spec: &str) -> Result<Device, String> {
    let dev = open_device(spec)?;
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = &dev {
        arbor_ops::cuda::tune_device(d)
            .map_err(|e| format!("cannot set up {spec}: {}", first_line(&e)))?;
    }
    Ok(dev)
}

fn open_device(spec: &str) -> Result<Device, String> {
    match spec {
        "cpu" => Ok(Device::Cpu),
        "cuda" => Device::new_cuda(0)
            .map_err(|e| format!("cannot open CUDA device 0: {}", first_line(&e))),
        s => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(n)) => Device::new_cuda(n)
                .map_err(|e| format!("cannot open CUDA device {n}: {}", first_line(&e))),
            _ => Err(format!("`{s}` is not cpu, cuda or cuda:N")),
        },
    }
}

impl TrainConfig {
    /// The learner's settings: `[learner]` with what `[critic]` adds to it.
    pub fn learner_config(&self) -> crate::learner::LearnerConfig {
        crate::learner::LearnerConfig {
            surprise: self.critic.surprise && self.algo.has_critic(),
            ..self.learner
        }
    }

    /// Prompts of a budget-matched PS step's first pass:
    /// `floor((1 - reserve) * prompts_per_step)`.
    pub fn ps_first_pass_prompts(&self) -> usize {
        (self.prompts_per_step as f64 * (1.0 - self.ps.reserve)).floor() as usize
    }

    /// Keys a config file must set: what a run is (the rest has defaults).
    pub const REQUIRED: [&'static str; 5] = [
        "seed",
        "steps",
        "algo",
        "prompts_per_step",
        "samples_per_prompt",
    ];

    /// Parse TOML; errors name the key (and line).
    pub fn from_toml(text: &str, origin: &str) -> Result<Self, TrainError> {
        let syntax = |e: toml::de::Error| TrainError::Config(format!("{origin}: {e}"));
        let table: toml::Table = toml::from_str(text).map_err(syntax)?;
        if let Some(k) = Self::REQUIRED.iter().find(|k| !table.contains_key(**k)) {
            return Err(TrainError::Config(format!(
                "{origin}: missing key `{k}` (every config sets {})",
                Self::REQUIRED.join(", ")
            )));
        }
        let cfg: TrainConfig = toml::from_str(text).map_err(syntax)?;
        cfg.validate(origin)?;
        Ok(cfg)
    }

    /// Check every value's range; the error names `origin` and the key.
    pub fn validate(&self, origin: &str) -> Result<(), TrainError> {
        let bad = |k: &str, m: &str| Err(TrainError::Config(format!("{origin}: key `{k}`: {m}")));
        if self.steps == 0 {
            return bad("steps", "must be >= 1");
        }
        if self.prompts_per_step == 0 {
            return bad(
                "prompts_per_step",
                "must be >= 1 (a budget of 0 generates nothing)",
            );
        }
        if self.samples_per_prompt == 0 || (self.algo != Algo::Focus && self.samples_per_prompt < 2)
        {
            return bad(
                "samples_per_prompt",
                "must be >= 1 (>= 2 for every method but FOCUS)",
            );
        }
        if self.temperature.is_nan() || self.temperature <= 0.0 {
            return bad("temperature", "must be > 0 for RL sampling");
        }
        if self.eval_every == 0 {
            return bad("eval_every", "must be >= 1");
        }
        let dev_ok = self.device == "cpu"
            || self.device == "cuda"
            || self
                .device
                .strip_prefix("cuda:")
                .is_some_and(|n| n.parse::<usize>().is_ok());
        if !dev_ok {
            return bad("device", "must be cpu, cuda or cuda:N");
        }
        if self.learner.critic == CriticMode::Separate && !self.algo.has_critic() {
            return bad(
                "learner.critic",
                "GRPO, PS and VinePPO train no critic; use `shared`",
            );
        }
        if let Err(e) = self.learner.policy.validate() {
            return bad("learner.policy", &e.to_string());
        }
        if let Err(e) = self.ps.controller.validate() {
            return bad("ps.controller", &e.to_string());
        }
        let f = &self.focus;
        if !(f.kappa > 0.0 && f.kappa.is_finite()) {
            return bad("focus.kappa", "must be > 0 (finite)");
        }
        if !(0.0..=1.0).contains(&f.gamma) {
            return bad("focus.gamma", "must be in [0, 1]");
        }
        if !(0.0..=1.0).contains(&f.lambda) {
            return bad("focus.lambda", "must be in [0, 1]");
        }
        if !(f.slip_nats >= 0.0 && f.slip_nats.is_finite()) {
            return bad("focus.slip_nats", "must be >= 0 (finite; 0: off)");
        }
        if f.worker_capacity == 0 {
            return bad("focus.worker_capacity", "must be >= 1");
        }
        if let Some(lr) = self.critic.lr {
            if !(lr > 0.0 && lr.is_finite()) {
                return bad("critic.lr", "must be > 0 (finite)");
            }
        }
        if let Some(c) = self.critic.grad_clip {
            if !(c >= 0.0 && c.is_finite()) {
                return bad("critic.grad_clip", "must be >= 0 (finite)");
            }
        }
        if self.critic.minibatches == 0 {
            return bad("critic.minibatches", "must be >= 1");
        }
        if self.critic.epochs > 0 && !self.algo.has_critic() {
            return bad(
                "critic.epochs",
                "only methods with a critic (focus, ppo) train one; set 0",
            );
        }
        if self.critic.epochs > 0 && self.learner.value_coef <= 0.0 {
            return bad(
                "critic.epochs",
                "the passes fit the value loss: needs learner.value_coef > 0",
            );
        }
        if self.critic.replay_steps > 0 && self.critic.epochs == 0 {
            return bad(
                "critic.replay_steps",
                "replays feed the critic's extra passes: set critic.epochs >= 1",
            );
        }
        if self.critic.heldout_tasks > 0 && self.critic.heldout_samples == 0 {
            return bad("critic.heldout_samples", "must be >= 1");
        }
        if matches!(
            self.budget,
            Some(StepBudget::Tokens(0) | StepBudget::Continuations(0))
        ) {
            return bad("budget", "must be >= 1");
        }
        let h = &self.harness;
        if h.context_tokens.is_none() && h.compaction != arbor_env::context::Compaction::None {
            return bad(
                "harness.compaction",
                "needs `harness.context_tokens` (the size it keeps the context within)",
            );
        }
        if h.context_tokens == Some(0) {
            return bad("harness.context_tokens", "must be >= 1");
        }
        if h.context_tokens.is_some()
            && matches!(
                self.task,
                TaskConfig::Math { .. } | TaskConfig::RunningSum { one_turn: true, .. }
            )
        {
            return bad(
                "harness.context_tokens",
                "single-turn tasks have no history to compact; bound the response with                  `task.max_tokens`",
            );
        }
        if !(0.0..=0.5).contains(&self.ps.band) {
            return bad("ps.band", "must be in [0, 0.5]");
        }
        if matches!(self.algo, Algo::Ppo | Algo::Vineppo) {
            let d = FocusConfig::default();
            for (key, set, default) in [
                ("focus.gamma", f.gamma, d.gamma),
                ("focus.lambda", f.lambda, d.lambda),
            ] {
                if set != default {
                    return bad(
                        key,
                        "PPO and VinePPO take their discount from [ppo] (gamma, lambda); \
                         [focus] is FOCUS's own",
                    );
                }
            }
        }
        if !(0.0..=1.0).contains(&self.ppo.gamma) {
            return bad("ppo.gamma", "must be in [0, 1]");
        }
        if !(0.0..=1.0).contains(&self.ppo.lambda) {
            return bad("ppo.lambda", "must be in [0, 1]");
        }
        if let Some(l) = &self.model.lora {
            if let Err(e) = l.validate() {
                return bad("model.lora", &e);
            }
        }
        if self.ps.attempts == 0 {
            return bad("ps.attempts", "must be >= 1");
        }
        if self.ps.sources == 0 {
            return bad("ps.sources", "must be >= 1");
        }
        if self.ps.probe == 1 {
            return bad(
                "ps.probe",
                "a one-member probe never has mixed outcomes (0: no probe, or >= 2)",
            );
        }
        if self.ps.rerollouts == 1 {
            return bad(
                "ps.rerollouts",
                "a re-rollout group needs >= 2 members for a baseline (0: samples_per_prompt)",
            );
        }
        if self.algo == Algo::Ps
            && self.ps.cut == PsCut::Lines
            && !matches!(self.task, TaskConfig::Math { .. } | TaskConfig::Swe { .. })
        {
            return bad(
                "ps.cut",
                "`lines` needs a text task (math or SWE); the built-in tasks have no lines",
            );
        }
        if self.algo == Algo::Ps && self.ps.match_budget {
            if !(self.ps.reserve > 0.0 && self.ps.reserve < 1.0) {
                return bad("ps.reserve", "must be in (0, 1) with ps.match_budget");
            }
            let first = self.ps_first_pass_prompts();
            if first == 0 || first >= self.prompts_per_step {
                return bad(
                    "ps.reserve",
                    &format!(
                        "with prompts_per_step = {}, the first pass would run on {first} prompts \
                         and leave no budget for re-rollouts (need 1..{}); raise \
                         prompts_per_step or set ps.match_budget = false",
                        self.prompts_per_step,
                        self.prompts_per_step - 1
                    ),
                );
            }
        }
        let text_task = |what: &str, max_tokens: usize| {
            if self.model.path.is_none() {
                return bad(
                    "model.path",
                    &format!("{what} tasks need an HF model (with its tokenizer)"),
                );
            }
            if max_tokens == 0 {
                return bad("task.max_tokens", "must be >= 1");
            }
            if self.warmup.steps > 0 {
                return bad(
                    "warmup.steps",
                    "the supervised warm-up only exists for synthetic tasks; set 0",
                );
            }
            Ok(())
        };
        match &self.task {
            TaskConfig::RunningSum {
                one_turn: true,
                stop_at_error: true,
                ..
            } => {
                return bad(
                    "task.stop_at_error",
                    "needs the multi-turn task (one_turn = false)",
                )
            }
            TaskConfig::RunningSum { difficulty, .. } | TaskConfig::Register { difficulty, .. } => {
                if *difficulty == 0 || *difficulty > 64 {
                    return bad("task.difficulty", "must be in 1..=64");
                }
            }
            TaskConfig::Math { max_tokens, .. } => text_task("math", *max_tokens)?,
            TaskConfig::Swe {
                max_tokens,
                max_turns,
                holdout_every,
                ..
            } => {
                text_task("SWE", *max_tokens)?;
                if *max_turns == 0 {
                    return bad("task.max_turns", "must be >= 1");
                }
                if *holdout_every < 2 {
                    return bad("task.holdout_every", "must be >= 2");
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `[critic] surprise` reaches the learner for a method with a critic
    /// and not for one without.
    #[test]
    fn critic_surprise_reaches_the_learner_only_with_a_critic() {
        let text = "seed = 0\nsteps = 1\nalgo = \"focus\"\nprompts_per_step = 1\n\
                    samples_per_prompt = 1\n[critic]\nsurprise = true\n";
        let mut c = TrainConfig::from_toml(text, "s.toml").unwrap();
        assert!(c.critic.surprise && c.learner_config().surprise);
        assert!(!c.learner.surprise, "not a [learner] key");
        c.algo = Algo::Grpo;
        assert!(!c.learner_config().surprise);
        assert!(TrainConfig::from_toml(&text.replace("true", "1"), "s.toml").is_err());
    }

    /// `[learner] precision` reaches the learner; a value that is not a
    /// precision is refused naming the key's value and the file.
    #[test]
    fn learner_precision_is_read_and_checked() {
        let text = "seed = 0\nsteps = 1\nalgo = \"grpo\"\nprompts_per_step = 1\n\
                    samples_per_prompt = 2\n[learner]\nprecision = \"bf16\"\n";
        let c = TrainConfig::from_toml(text, "p.toml").unwrap();
        assert_eq!(
            c.learner_config().precision,
            crate::learner::Precision::Bf16
        );
        assert_eq!(
            TrainConfig::default().learner.precision,
            crate::learner::Precision::F32
        );
        let e = TrainConfig::from_toml(&text.replace("bf16", "fp8"), "p.toml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("p.toml") && e.contains("fp8"), "{e}");
    }

    /// The defaults are a valid run; a file with only the required keys
    /// is the defaults, and a file without one of them names it.
    #[test]
    fn defaults_are_valid_and_required_keys_are_named() {
        TrainConfig::default().validate("default").unwrap();
        let minimal = "seed = 0\nsteps = 100\nalgo = \"focus\"\nprompts_per_step = 16\n\
                       samples_per_prompt = 8\n";
        assert_eq!(
            TrainConfig::from_toml(minimal, "min.toml").unwrap(),
            TrainConfig::default()
        );
        for k in TrainConfig::REQUIRED {
            let text: String = minimal
                .lines()
                .filter(|l| !l.starts_with(k))
                .map(|l| format!("{l}\n"))
                .collect();
            let e = TrainConfig::from_toml(&text, "c.toml")
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("c.toml") && e.contains(&format!("missing key `{k}`")),
                "{e}"
            );
        }
    }

    /// Every shipped config parses and validates (the quickstart is FOCUS).
    #[test]
    fn shipped_configs_parse() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
        let mut n = 0;
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "toml") {
                let text = std::fs::read_to_string(&p).unwrap();
                let cfg = TrainConfig::from_toml(&text, &p.display().to_string()).unwrap();
                if p.ends_with("quickstart.toml") {
                    assert_eq!(cfg.algo, Algo::Focus);
                }
                n += 1;
            }
        }
        assert!(n >= 2, "no configs under {}", dir.display());
    }

    /// `[focus]` and `[ps]` values out of range are refused when the file
    /// is read, naming the key, not in the middle of the first step.
    #[test]
    fn focus_and_ps_ranges_are_checked_on_load() {
        for (text, key) in [
            ("[focus]\nkappa = 0\n", "focus.kappa"),
            ("[focus]\ngamma = 1.5\n", "focus.gamma"),
            ("[focus]\nlambda = -0.1\n", "focus.lambda"),
            ("[focus]\nslip_nats = -1\n", "focus.slip_nats"),
            ("[focus]\nworker_capacity = 0\n", "focus.worker_capacity"),
            ("[ps]\nband = 0.7\n", "ps.band"),
            ("[ps]\nattempts = 0\n", "ps.attempts"),
            ("[ps]\nsources = 0\n", "ps.sources"),
            ("[ps]\nrerollouts = 1\n", "ps.rerollouts"),
            ("[ps]\nprobe = 1\n", "ps.probe"),
            ("[ps]\ncut = \"words\"\n", "words"),
            ("[ps]\nreplay = \"fork\"\n", "fork"),
            (
                "[learner.policy]\neps_low = 1.2\neps_high = 0.2\naggregation = \"sequence_mean\"\n",
                "eps_low",
            ),
        ] {
            let head = "seed = 0\nsteps = 1\nalgo = \"grpo\"\nprompts_per_step = 2\n\
                        samples_per_prompt = 2\n";
            let e = TrainConfig::from_toml(&format!("{head}{text}"), "c.toml")
                .unwrap_err()
                .to_string();
            assert!(e.contains(key), "{text}: {e}");
        }
    }

    /// Line cuts need a text task's tokenizer; the built-in tasks are
    /// refused with the key named.
    #[test]
    fn ps_line_cuts_need_a_text_task() {
        let text = "seed = 0\nsteps = 1\nalgo = \"ps\"\nprompts_per_step = 4\n\
                    samples_per_prompt = 2\n[ps]\ncut = \"lines\"\n";
        let e = TrainConfig::from_toml(text, "c.toml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("ps.cut") && e.contains("text task"), "{e}");
        let ok = TrainConfig::from_toml(&text.replace("lines", "tokens"), "c.toml").unwrap();
        assert_eq!(ok.ps.cut, PsCut::Tokens);
    }

    /// PPO's discount lives in `[ppo]`, checked there; a PPO config that
    /// still sets it under `[focus]` is refused, not silently ignored.
    #[test]
    fn ppo_discount_is_its_own_section() {
        let head = "seed = 0\nsteps = 1\nprompts_per_step = 2\nsamples_per_prompt = 2\n";
        let parse = |rest: &str| TrainConfig::from_toml(&format!("{head}{rest}"), "c.toml");
        let e = parse("algo = \"ppo\"\n[ppo]\ngamma = 1.5\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("c.toml") && e.contains("ppo.gamma"), "{e}");
        let e = parse("algo = \"ppo\"\n[ppo]\nlambda = 1.5\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("ppo.lambda"), "{e}");
        for algo in ["ppo", "vineppo"] {
            let e = parse(&format!("algo = \"{algo}\"\n[focus]\ngamma = 0.99\n"))
                .unwrap_err()
                .to_string();
            assert!(e.contains("focus.gamma") && e.contains("[ppo]"), "{e}");
        }
        let cfg = parse("algo = \"ppo\"\n[ppo]\ngamma = 0.9\nlambda = 0.95\n").unwrap();
        assert_eq!((cfg.ppo.gamma, cfg.ppo.lambda), (0.9, 0.95));
        parse("algo = \"focus\"\n[focus]\ngamma = 0.99\n").unwrap();
    }
}
