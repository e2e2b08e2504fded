//! The training run: config, warm-up, RL steps, evaluation, metrics,
//! checkpoints and resume.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use arbor_engine::{Engine, EngineConfig};
use arbor_model::{Arch, Checkpoint, CriticMode, ModelConfig, RopeScaling};
use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};

use crate::learner::{Learner, LearnerConfig};
use crate::optim::AdamWConfig;
use crate::rollout::{
    evaluate, focus_step, grpo_step, ppo_step, ps_step, vineppo_step, FocusConfig, StepRollouts,
};
use crate::tasks::{TaskConfig, TaskSampler};
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
    /// PPO with a per-segment critic and GAE (`focus.gamma`, `focus.lambda`);
    /// `samples_per_prompt` full rollouts per task.
    Ppo,
    /// VinePPO: one main rollout per task and `samples_per_prompt`
    /// Monte-Carlo continuations from each of its states.
    Vineppo,
}

/// Prefix Sampling settings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PsSettings {
    /// Half-width of the balanced band around 1/2 (groups inside are kept).
    pub band: f64,
    /// The per-bucket ratio controller (`eta = 0`: fixed ratios).
    pub controller: arbor_rl::prefix::ControllerConfig,
    /// Hold each step's generated tokens to the GRPO baseline's budget: the
    /// first pass runs on `(1 - reserve) * prompts_per_step` prompts, the
    /// budget is `prompts_per_step * samples_per_prompt` times the first
    /// pass's mean trajectory length, and re-rollouts spend the rest
    /// (a skewed group whose re-rollouts would not fit keeps its members).
    pub match_budget: bool,
    /// Share of the budget kept for re-rollouts.
    pub reserve: f64,
}

impl Default for PsSettings {
    fn default() -> Self {
        PsSettings {
            band: 0.125,
            controller: arbor_rl::prefix::ControllerConfig::default(),
            match_budget: true,
            reserve: 0.25,
        }
    }
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
    #[serde(default)]
    pub path: Option<String>,
    pub hidden_size: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
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
    fn config(&self, vocab: usize) -> ModelConfig {
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

/// Supervised warm-up on the task's demonstrations.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WarmupConfig {
    /// Most supervised steps.
    pub steps: u64,
    pub batch: usize,
    pub lr: f64,
    /// Stop early once the greedy pass rate on the held-out eval tasks
    /// reaches this (checked every `check_every` steps), so RL starts from a
    /// comparable policy whatever the seed or machine.
    pub stop_at_eval: Option<f64>,
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

/// A whole training run. Unknown keys are errors.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    pub seed: u64,
    /// RL steps.
    pub steps: u64,
    pub algo: Algo,
    /// Tasks per step.
    pub prompts_per_step: usize,
    /// GRPO group size; FOCUS spends `prompts_per_step * samples_per_prompt`
    /// continuations, so both use the same budget of continuations.
    pub samples_per_prompt: usize,
    #[serde(default = "one")]
    pub temperature: f32,
    #[serde(default)]
    pub model: ModelSpec,
    #[serde(default)]
    pub task: TaskConfig,
    #[serde(default)]
    pub warmup: WarmupConfig,
    #[serde(default)]
    pub optimizer: AdamWConfig,
    #[serde(default)]
    pub learner: LearnerConfig,
    #[serde(default)]
    pub focus: FocusConfig,
    #[serde(default)]
    pub ps: PsSettings,
    /// First RL steps that train only the critic (FOCUS).
    #[serde(default)]
    pub critic_warmup_steps: u64,
    /// Evaluate (greedy pass rate on held-out tasks) every N steps.
    #[serde(default = "ten")]
    pub eval_every: u64,
    #[serde(default = "sixty_four")]
    pub eval_tasks: usize,
    /// Write a checkpoint every N steps (0: only at the end).
    #[serde(default = "ten")]
    pub checkpoint_every: u64,
    #[serde(default = "two")]
    pub keep_last: usize,
    /// KV-cache memory of the rollout engine.
    #[serde(default = "kv_mib")]
    pub kv_memory_mib: usize,
    /// Where the policy, critic, optimizer state and rollout KV live:
    /// `cpu` (default), `cuda` or `cuda:N` (needs a `--features cuda`
    /// build). Resume is bit-exact on the CPU.
    #[serde(default = "cpu")]
    pub device: String,
}

fn cpu() -> String {
    "cpu".into()
}

/// The first line of an error (candle's carry a backtrace).
fn first_line(e: &dyn std::fmt::Display) -> String {
    e.to_string().lines().next().unwrap_or_default().to_string()
}

/// `cpu`, `cuda` or `cuda:N` as a candle device.
pub fn parse_device(spec: &str) -> Result<Device, String> {
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

fn one() -> f32 {
    1.0
}
fn ten() -> u64 {
    10
}
fn two() -> usize {
    2
}
fn sixty_four() -> usize {
    64
}
fn kv_mib() -> usize {
    256
}

impl TrainConfig {
    /// Prompts of a budget-matched PS step's first pass:
    /// `floor((1 - reserve) * prompts_per_step)`.
    pub fn ps_first_pass_prompts(&self) -> usize {
        (self.prompts_per_step as f64 * (1.0 - self.ps.reserve)).floor() as usize
    }

    /// Parse TOML; errors name the key (and line).
    pub fn from_toml(text: &str, origin: &str) -> Result<Self, TrainError> {
        let cfg: TrainConfig =
            toml::from_str(text).map_err(|e| TrainError::Config(format!("{origin}: {e}")))?;
        cfg.validate(origin)?;
        Ok(cfg)
    }

    fn validate(&self, origin: &str) -> Result<(), TrainError> {
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
                "must be >= 1 (>= 2 for GRPO and PS groups)",
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
        if let Err(e) = self.ps.controller.validate() {
            return bad("ps.controller", &e.to_string());
        }
        if let Some(l) = &self.model.lora {
            if let Err(e) = l.validate() {
                return bad("model.lora", &e);
            }
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
        match &self.task {
            TaskConfig::RunningSum { difficulty } | TaskConfig::Register { difficulty, .. } => {
                if *difficulty == 0 || *difficulty > 64 {
                    return bad("task.difficulty", "must be in 1..=64");
                }
            }
            TaskConfig::Math { max_tokens, .. } => {
                if self.model.path.is_none() {
                    return bad(
                        "model.path",
                        "math tasks need an HF model (with its tokenizer)",
                    );
                }
                if *max_tokens == 0 {
                    return bad("task.max_tokens", "must be >= 1");
                }
                if self.warmup.steps > 0 {
                    return bad(
                        "warmup.steps",
                        "the supervised warm-up only exists for synthetic tasks; set 0",
                    );
                }
            }
            TaskConfig::Swe {
                max_tokens,
                max_turns,
                holdout_every,
                ..
            } => {
                if self.model.path.is_none() {
                    return bad(
                        "model.path",
                        "SWE tasks need an HF model (with its tokenizer)",
                    );
                }
                if *max_tokens == 0 {
                    return bad("task.max_tokens", "must be >= 1");
                }
                if *max_turns == 0 {
                    return bad("task.max_turns", "must be >= 1");
                }
                if *holdout_every < 2 {
                    return bad("task.holdout_every", "must be >= 2");
                }
                if self.warmup.steps > 0 {
                    return bad(
                        "warmup.steps",
                        "the supervised warm-up only exists for synthetic tasks; set 0",
                    );
                }
            }
        }
        Ok(())
    }
}

/// One line of `metrics.jsonl`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    pub step: u64,
    pub reward: f64,
    pub pass_rate: f64,
    pub effective_group_fraction: f64,
    pub episodes: usize,
    pub continuations: usize,
    pub generated_tokens: u64,
    pub replayed_tokens: u64,
    pub prefill_computed: u64,
    pub prefill_cached: u64,
    pub trained_tokens: usize,
    pub kl: f64,
    pub clip_fraction: f64,
    pub entropy: f64,
    pub policy_loss: f64,
    pub value_loss: f64,
    /// Spearman correlation of critic values and backed-up targets.
    pub critic_rank_corr: Option<f64>,
    pub grad_norm: f64,
    pub lr: f64,
    pub eval_pass_rate: Option<f64>,
    pub time_generate_s: f64,
    pub time_env_s: f64,
    pub time_train_s: f64,
    /// Mean tool calls executed per trajectory that ended this step (a FOCUS
    /// tree has one trajectory per leaf; replayed prefixes' calls included;
    /// 0 for tasks without tools).
    #[serde(default)]
    pub tool_calls_per_episode: f64,
    /// The step's generated-token budget where one is enforced (PS with
    /// `ps.match_budget`: the GRPO baseline's).
    #[serde(default)]
    pub budget_tokens: Option<u64>,
}

/// Resumable state besides the weights.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct TrainerState {
    /// RL steps done.
    step: u64,
    /// Next training task index.
    cursor: u64,
    /// Sampling seed counter.
    seed_counter: u64,
    optimizer_step: u64,
    warmup_nll: Vec<f64>,
    initial_eval: Option<f64>,
    /// Prefix Sampling controller state per bucket.
    #[serde(default)]
    ps_buckets: Vec<(arbor_rl::prefix::Bucket, arbor_rl::prefix::BucketState)>,
}

/// What a finished run reports.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Summary {
    pub algo: Algo,
    pub steps: u64,
    pub warmup_final_nll: Option<f64>,
    pub initial_eval_pass_rate: f64,
    pub final_eval_pass_rate: f64,
    pub first_reward: f64,
    pub last_reward: f64,
    pub generated_tokens: u64,
    pub seconds: f64,
    pub out_dir: PathBuf,
}

fn spearman(pairs: &[(f64, f64)]) -> Option<f64> {
    if pairs.len() < 3 {
        return None;
    }
    let rank = |xs: Vec<f64>| -> Vec<f64> {
        let mut idx: Vec<usize> = (0..xs.len()).collect();
        idx.sort_by(|&a, &b| xs[a].total_cmp(&xs[b]));
        let mut r = vec![0.0; xs.len()];
        let mut i = 0;
        while i < idx.len() {
            let mut j = i;
            while j + 1 < idx.len() && xs[idx[j + 1]] == xs[idx[i]] {
                j += 1;
            }
            for k in i..=j {
                r[idx[k]] = (i + j) as f64 / 2.0;
            }
            i = j + 1;
        }
        r
    };
    let a = rank(pairs.iter().map(|p| p.0).collect());
    let b = rank(pairs.iter().map(|p| p.1).collect());
    let n = a.len() as f64;
    let (ma, mb) = (a.iter().sum::<f64>() / n, b.iter().sum::<f64>() / n);
    let cov: f64 = a.iter().zip(&b).map(|(x, y)| (x - ma) * (y - mb)).sum();
    let va: f64 = a.iter().map(|x| (x - ma).powi(2)).sum();
    let vb: f64 = b.iter().map(|y| (y - mb).powi(2)).sum();
    (va > 0.0 && vb > 0.0).then(|| cov / (va * vb).sqrt())
}

const CKPT_PREFIX: &str = "step-";

fn latest_checkpoint(dir: &Path) -> Option<(u64, PathBuf)> {
    let rd = std::fs::read_dir(dir.join("checkpoints")).ok()?;
    rd.filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().to_string();
            let n = name.strip_prefix(CKPT_PREFIX)?.parse::<u64>().ok()?;
            e.path()
                .join("trainer_state.json")
                .is_file()
                .then_some((n, e.path()))
        })
        .max_by_key(|(n, _)| *n)
}

fn save_tensors(map: HashMap<String, Tensor>, path: &Path) -> Result<(), TrainError> {
    candle_core::safetensors::save(&map, path)?;
    std::fs::File::open(path)?.sync_all()?;
    Ok(())
}

/// The trainer.
pub struct Trainer {
    pub cfg: TrainConfig,
    pub out_dir: PathBuf,
    pub learner: Learner,
    sampler: TaskSampler,
    state: TrainerState,
    engine_cfg: EngineConfig,
    tb: Option<crate::tensorboard::EventWriter>,
}

impl std::fmt::Debug for Trainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer")
            .field("out_dir", &self.out_dir)
            .field("step", &self.state.step)
            .finish()
    }
}

impl Trainer {
    /// A fresh run in `out_dir`, or (with `resume`) the continuation of the
    /// latest checkpoint there.
    pub fn new(cfg: TrainConfig, out_dir: &Path, resume: bool) -> Result<Self, TrainError> {
        std::fs::create_dir_all(out_dir)?;
        // The policy: an HF checkpoint, or the tiny random model.
        let hf = match &cfg.model.path {
            Some(spec) => {
                let files = arbor_model::ModelFiles::resolve(spec)?;
                let mcfg = ModelConfig::from_file(&files.config)?;
                let tokenizer = files
                    .tokenizer
                    .as_ref()
                    .map(arbor_model::Tokenizer::from_file)
                    .transpose()?;
                let eos = files.eos_token_ids(&mcfg.eos_token_ids)?;
                Some((files, mcfg, tokenizer, eos))
            }
            None => None,
        };
        let (tokenizer, eos) = match &hf {
            Some((_, _, t, e)) => (t.clone(), e.clone()),
            None => (None, Vec::new()),
        };
        let sampler = TaskSampler::new(
            cfg.task.clone(),
            cfg.seed.wrapping_mul(1_000_003),
            tokenizer,
            eos,
        )?;
        let mcfg = match &hf {
            Some((_, c, _, _)) => c.clone(),
            None => cfg.model.config(sampler.vocab_size()),
        };
        let hf_ckpt = match &hf {
            Some((files, _, _, _)) => Some(Checkpoint::open(&files.weights)?),
            None => None,
        };
        let dev = parse_device(&cfg.device)
            .map_err(|e| TrainError::Config(format!("key `device`: {e}")))?;
        let mut ocfg = cfg.optimizer;
        ocfg.total_steps = cfg.steps * cfg.learner.epochs.max(1) as u64;
        let latest = if resume {
            latest_checkpoint(out_dir)
        } else {
            None
        };
        if resume && latest.is_none() {
            tracing::warn!(
                "--resume: no checkpoint in {}, starting fresh",
                out_dir.display()
            );
        }
        let (learner, state) = match latest {
            Some((_, dir)) => {
                let policy = Checkpoint::open(&[dir.join("policy/model.safetensors")])?;
                let critic = Checkpoint::open(&[dir.join("critic.safetensors")])?;
                // With LoRA the base is the original (frozen) model and the
                // adapters come from the checkpoint; `policy/` is the merged export.
                let lora = cfg.model.lora.as_ref();
                let adapters = dir.join("policy_lora.safetensors");
                match (lora.is_some(), adapters.is_file()) {
                    (true, false) => {
                        return Err(TrainError::Checkpoint(format!(
                            "{}: missing; the checkpoint was written without [model.lora]",
                            adapters.display()
                        )))
                    }
                    (false, true) => {
                        return Err(TrainError::Checkpoint(format!(
                        "{}: the checkpoint has LoRA adapters but the config has no [model.lora]",
                        adapters.display()
                    )))
                    }
                    _ => {}
                }
                let base = if lora.is_some() {
                    hf_ckpt.as_ref()
                } else {
                    Some(&policy)
                };
                let mut learner = Learner::new(
                    &mcfg,
                    base,
                    Some(&critic),
                    cfg.seed,
                    &dev,
                    cfg.learner,
                    ocfg,
                    lora,
                )?;
                if lora.is_some() {
                    let t = candle_core::safetensors::load(&adapters, &dev).map_err(|e| {
                        TrainError::Checkpoint(format!("{}: {e}", adapters.display()))
                    })?;
                    learner.load_policy_trainable(&t, &adapters.display().to_string())?;
                }
                let text = std::fs::read_to_string(dir.join("trainer_state.json"))?;
                let state: TrainerState = serde_json::from_str(&text).map_err(|e| {
                    TrainError::Checkpoint(format!(
                        "{}: {e}",
                        dir.join("trainer_state.json").display()
                    ))
                })?;
                let opt = candle_core::safetensors::load(dir.join("optimizer.safetensors"), &dev)?;
                learner.opt.load_state(&opt, state.optimizer_step)?;
                // Metrics after the checkpoint were not kept in the weights: drop them.
                truncate_metrics(&out_dir.join("metrics.jsonl"), state.step)?;
                (learner, state)
            }
            None => {
                let learner = Learner::new(
                    &mcfg,
                    hf_ckpt.as_ref(),
                    None,
                    cfg.seed,
                    &dev,
                    cfg.learner,
                    ocfg,
                    cfg.model.lora.as_ref(),
                )?;
                let _ = std::fs::remove_file(out_dir.join("metrics.jsonl"));
                let state = TrainerState {
                    step: 0,
                    cursor: 0,
                    seed_counter: cfg.seed.wrapping_mul(7919),
                    optimizer_step: 0,
                    warmup_nll: Vec::new(),
                    initial_eval: None,
                    ps_buckets: Vec::new(),
                };
                (learner, state)
            }
        };
        let engine_cfg = EngineConfig {
            kv_memory_mib: cfg.kv_memory_mib,
            max_seqs: 1024,
            max_batch_tokens: 8192,
            ..Default::default()
        };
        std::fs::write(
            out_dir.join("config.json"),
            serde_json::to_vec_pretty(&cfg).map_err(|e| TrainError::Config(e.to_string()))?,
        )?;
        Ok(Trainer {
            cfg,
            out_dir: out_dir.to_path_buf(),
            learner,
            sampler,
            state,
            engine_cfg,
            tb: None,
        })
    }

    /// RL steps already done (after a resume, where it continues from).
    pub fn step(&self) -> u64 {
        self.state.step
    }

    fn eval(&self, engine: &mut Engine) -> Result<f64, TrainError> {
        let n = self
            .sampler
            .eval_len()
            .map_or(self.cfg.eval_tasks, |l| l.min(self.cfg.eval_tasks));
        let tasks = (0..n as u64)
            .map(|i| self.sampler.eval_task(i))
            .collect::<Result<Vec<_>, _>>()?;
        evaluate(engine, tasks, &self.sampler.rollout_config(0.0))
    }

    /// Supervised warm-up (skipped when resuming after it). Calls
    /// `progress(step, nll)`.
    pub fn warmup(&mut self, mut progress: impl FnMut(u64, f64)) -> Result<(), TrainError> {
        if self.state.step > 0 || !self.state.warmup_nll.is_empty() {
            return Ok(());
        }
        let w = self.cfg.warmup;
        let main_lr = self.learner.opt.cfg;
        self.learner.opt.cfg.lr = w.lr;
        self.learner.opt.cfg.warmup_steps = 0;
        self.learner.opt.cfg.total_steps = 0;
        for s in 0..w.steps {
            let rows = (0..w.batch as u64)
                .map(|i| {
                    self.sampler
                        .demonstration(1_000_000_000 + s * w.batch as u64 + i)
                })
                .collect::<Result<Vec<_>, _>>()?;
            let (nll, _) = self.learner.sft_step(&rows)?;
            self.state.warmup_nll.push(nll);
            progress(s + 1, nll);
            if let Some(target) = w.stop_at_eval {
                if (s + 1).is_multiple_of(w.check_every.max(1)) {
                    let mut engine =
                        Engine::new(&self.learner.model.policy, None, self.engine_cfg.clone())?;
                    if self.eval(&mut engine)? >= target {
                        break;
                    }
                }
            }
        }
        // The RL optimizer starts fresh after the warm-up.
        let vars = self.learner.opt.vars().to_vec();
        self.learner.opt = crate::optim::AdamW::new(vars, main_lr)?;
        Ok(())
    }

    /// Run the remaining RL steps; `on_step` sees each step's metrics.
    pub fn run(&mut self, mut on_step: impl FnMut(&StepMetrics)) -> Result<Summary, TrainError> {
        let start = Instant::now();
        let mut engine = Engine::new(&self.learner.model.policy, None, self.engine_cfg.clone())?;
        if self.state.initial_eval.is_none() {
            self.state.initial_eval = Some(self.eval(&mut engine)?);
        }
        let rcfg = self.sampler.rollout_config(self.cfg.temperature);
        let mut all: Vec<StepMetrics> = read_metrics(&self.out_dir.join("metrics.jsonl"))?;
        while self.state.step < self.cfg.steps {
            let step = self.state.step + 1;
            // Every step starts from an empty cache: a resumed run (fresh
            // engine) then computes exactly what an uninterrupted one does.
            // The weights are those of the last `invalidate` (or of the
            // engine's start), so they need no repack.
            engine.forget_cached_kv();
            // PS with a matched budget runs its first pass on fewer prompts
            // and spends the reserve on re-rollouts.
            let ps_budget = self.cfg.algo == Algo::Ps && self.cfg.ps.match_budget;
            let n_tasks = if ps_budget {
                self.cfg.ps_first_pass_prompts()
            } else {
                self.cfg.prompts_per_step
            };
            let tasks = (0..n_tasks as u64)
                .map(|i| self.sampler.train_task(self.state.cursor + i))
                .collect::<Result<Vec<_>, _>>()?;
            self.state.cursor += n_tasks as u64;
            let mut seed = self.state.seed_counter;
            let r: StepRollouts = match self.cfg.algo {
                Algo::Grpo => grpo_step(
                    &mut engine,
                    tasks,
                    self.cfg.samples_per_prompt,
                    &rcfg,
                    &mut seed,
                )?,
                Algo::Focus => {
                    let budget = (self.cfg.prompts_per_step * self.cfg.samples_per_prompt) as u64;
                    focus_step(
                        &mut engine,
                        &self.learner,
                        tasks,
                        budget,
                        &self.cfg.focus,
                        &rcfg,
                        &mut seed,
                    )?
                }
                Algo::Ppo => ppo_step(
                    &mut engine,
                    &self.learner,
                    tasks,
                    self.cfg.samples_per_prompt,
                    &self.cfg.focus,
                    &rcfg,
                    &mut seed,
                )?,
                Algo::Vineppo => vineppo_step(
                    &mut engine,
                    tasks,
                    self.cfg.samples_per_prompt as u32,
                    self.cfg.focus.gamma,
                    &rcfg,
                    &mut seed,
                )?,
                Algo::Ps => {
                    use arbor_rl::prefix::{
                        CutGranularity, PrefixController, PrefixSampler, PsConfig,
                    };
                    let pcfg = PsConfig {
                        group_size: self.cfg.samples_per_prompt as u32,
                        band: self.cfg.ps.band,
                        granularity: CutGranularity::Boundaries,
                        controller: self.cfg.ps.controller,
                        seed: self.cfg.seed ^ step.wrapping_mul(0x9E37_79B9),
                    };
                    let ctl = PrefixController::restore(
                        self.cfg.ps.controller,
                        self.state.ps_buckets.clone(),
                    )?;
                    let mut sampler = PrefixSampler::with_controller(pcfg, ctl)?;
                    let r = ps_step(
                        &mut engine,
                        tasks,
                        self.cfg.samples_per_prompt,
                        ps_budget.then_some(self.cfg.prompts_per_step),
                        &mut sampler,
                        &rcfg,
                        &mut seed,
                    )?;
                    self.state.ps_buckets = sampler
                        .controller()
                        .buckets()
                        .iter()
                        .map(|(b, s)| (*b, *s))
                        .collect();
                    r
                }
            };
            self.state.seed_counter = seed;
            let t0 = Instant::now();
            let policy_on = !self.cfg.algo.has_critic() || step > self.cfg.critic_warmup_steps;
            let u = self.learner.update_with(&r.rows, policy_on)?;
            let train_s = t0.elapsed().as_secs_f64();
            // The weights changed: no KV computed before may be reused.
            engine.invalidate();
            self.state.step = step;
            self.state.optimizer_step = self.learner.opt.steps_done();
            let eval = if step.is_multiple_of(self.cfg.eval_every) || step == self.cfg.steps {
                Some(self.eval(&mut engine)?)
            } else {
                None
            };
            let n = r.rewards.len().max(1) as f64;
            let m = StepMetrics {
                step,
                reward: r.rewards.iter().sum::<f64>() / n,
                pass_rate: r.rewards.iter().filter(|&&x| x >= 1.0).count() as f64 / n,
                effective_group_fraction: r.effective_group_fraction,
                episodes: r.stats.episodes,
                continuations: r.stats.continuations,
                generated_tokens: r.stats.generated_tokens,
                replayed_tokens: r.stats.replayed_tokens,
                prefill_computed: r.stats.prefill_computed,
                prefill_cached: r.stats.prefill_cached,
                trained_tokens: u.trained_tokens,
                kl: u.approx_kl,
                clip_fraction: u.clip_fraction,
                entropy: u.entropy,
                policy_loss: u.policy_loss,
                value_loss: u.value_loss,
                critic_rank_corr: spearman(&r.critic_vs_target),
                grad_norm: u.grad_norm,
                lr: u.lr,
                eval_pass_rate: eval,
                time_generate_s: r.stats.generate_s,
                time_env_s: r.stats.env_s,
                time_train_s: train_s,
                tool_calls_per_episode: r.stats.tool_calls as f64
                    / r.stats.finished_episodes.max(1) as f64,
                budget_tokens: r.stats.budget_tokens,
            };
            append_metrics(&self.out_dir.join("metrics.jsonl"), &m)?;
            self.tensorboard(&m)?;
            on_step(&m);
            all.push(m);
            let every = self.cfg.checkpoint_every;
            if (every > 0 && step.is_multiple_of(every)) || step == self.cfg.steps {
                self.checkpoint()?;
            }
        }
        let first =
            all.iter().take(3).map(|m| m.reward).sum::<f64>() / all.len().clamp(1, 3) as f64;
        let last =
            all.iter().rev().take(3).map(|m| m.reward).sum::<f64>() / all.len().clamp(1, 3) as f64;
        let final_eval = all
            .iter()
            .rev()
            .find_map(|m| m.eval_pass_rate)
            .unwrap_or(0.0);
        Ok(Summary {
            algo: self.cfg.algo,
            steps: self.state.step,
            warmup_final_nll: self.state.warmup_nll.last().copied(),
            initial_eval_pass_rate: self.state.initial_eval.unwrap_or(0.0),
            final_eval_pass_rate: final_eval,
            first_reward: first,
            last_reward: last,
            generated_tokens: all.iter().map(|m| m.generated_tokens).sum(),
            seconds: start.elapsed().as_secs_f64(),
            out_dir: self.out_dir.clone(),
        })
    }

    /// Mirror a metrics line into TensorBoard event files under `tb/`.
    fn tensorboard(&mut self, m: &StepMetrics) -> Result<(), TrainError> {
        if self.tb.is_none() {
            self.tb = Some(crate::tensorboard::EventWriter::create(
                &self.out_dir.join("tb"),
            )?);
        }
        let v = serde_json::to_value(m).map_err(|e| TrainError::Config(e.to_string()))?;
        let scalars: Vec<(String, f64)> = v
            .as_object()
            .map(|o| {
                o.iter()
                    .filter(|(k, _)| k.as_str() != "step")
                    .filter_map(|(k, x)| x.as_f64().map(|f| (k.clone(), f)))
                    .collect()
            })
            .unwrap_or_default();
        if let Some(w) = self.tb.as_mut() {
            w.scalars(m.step, &scalars)?;
        }
        Ok(())
    }

    /// Write `checkpoints/step-N` atomically: everything goes into a
    /// temporary directory, each file fsynced, then one rename. Keeps the
    /// last `keep_last`.
    pub fn checkpoint(&self) -> Result<PathBuf, TrainError> {
        let root = self.out_dir.join("checkpoints");
        std::fs::create_dir_all(&root)?;
        let name = format!("{CKPT_PREFIX}{:08}", self.state.step);
        let tmp = root.join(format!(".{name}.tmp"));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp)?;
        self.learner
            .model
            .policy
            .save_pretrained(&tmp.join("policy"), DType::F32)?;
        save_tensors(
            self.learner.critic_tensors().into_iter().collect(),
            &tmp.join("critic.safetensors"),
        )?;
        if self.cfg.model.lora.is_some() {
            save_tensors(
                self.learner
                    .policy_trainable_tensors()
                    .into_iter()
                    .collect(),
                &tmp.join("policy_lora.safetensors"),
            )?;
        }
        let (opt, _) = self.learner.opt.state();
        save_tensors(opt, &tmp.join("optimizer.safetensors"))?;
        let state = serde_json::to_vec_pretty(&self.state)
            .map_err(|e| TrainError::Checkpoint(e.to_string()))?;
        let sp = tmp.join("trainer_state.json");
        std::fs::write(&sp, state)?;
        std::fs::File::open(&sp)?.sync_all()?;
        let fin = root.join(&name);
        let _ = std::fs::remove_dir_all(&fin);
        std::fs::rename(&tmp, &fin)?;
        std::fs::File::open(&root)?.sync_all()?;
        // Keep the newest `keep_last`.
        let mut kept: Vec<(u64, PathBuf)> = std::fs::read_dir(&root)?
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let n = e
                    .file_name()
                    .to_string_lossy()
                    .strip_prefix(CKPT_PREFIX)?
                    .parse::<u64>()
                    .ok()?;
                Some((n, e.path()))
            })
            .collect();
        kept.sort();
        let keep = self.cfg.keep_last.max(1);
        if kept.len() > keep {
            for (_, p) in &kept[..kept.len() - keep] {
                std::fs::remove_dir_all(p)?;
            }
        }
        Ok(fin)
    }
}

fn append_metrics(path: &Path, m: &StepMetrics) -> Result<(), TrainError> {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    let line = serde_json::to_string(m).map_err(|e| TrainError::Config(e.to_string()))?;
    writeln!(f, "{line}")?;
    f.sync_data()?;
    Ok(())
}

/// Every complete line of a metrics file (a torn last line is ignored).
pub fn read_metrics(path: &Path) -> Result<Vec<StepMetrics>, TrainError> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(Vec::new());
    };
    Ok(text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect())
}

/// Keep the lines of a metrics file up to step `upto` byte for byte (a
/// line is never re-serialised, so what a run printed is what stays; torn or
/// unreadable lines are dropped), replacing the file atomically (a kill in
/// the middle leaves the old file whole).
fn truncate_metrics(path: &Path, upto: u64) -> Result<(), TrainError> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(());
    };
    let mut kept = String::new();
    for line in text.lines() {
        if serde_json::from_str::<StepMetrics>(line).is_ok_and(|m| m.step <= upto) {
            kept.push_str(line);
            kept.push('\n');
        }
    }
    if kept == text {
        return Ok(());
    }
    let tmp = path.with_extension("jsonl.tmp");
    {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(kept.as_bytes())?;
        f.sync_data()?;
    }
    std::fs::rename(&tmp, path)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A resumed run keeps the earlier metrics lines exactly as printed.
    /// 0.021660075508255654 is a value serde_json's default float parser
    /// reads one ulp off (0.021660075508255657): re-serialising the parsed
    /// metrics changed the file (seen on a Zen 2, whose numbers differ).
    #[test]
    fn truncate_keeps_lines_byte_for_byte() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        let line = |step: u64, loss: &str| {
            let mut m = serde_json::to_value(StepMetrics {
                step,
                ..Default::default()
            })
            .unwrap();
            m["policy_loss"] = serde_json::Value::Null;
            serde_json::to_string(&m)
                .unwrap()
                .replace("\"policy_loss\":null", &format!("\"policy_loss\":{loss}"))
        };
        let l1 = line(1, "0.021660075508255654");
        let l2 = line(2, "2.6391587328232322e-14");
        let l3 = line(3, "0.5");
        std::fs::write(&path, format!("{l1}\n{l2}\n{l3}\n{{\"step\": 4, \"tor")).unwrap();
        truncate_metrics(&path, 2).unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            format!("{l1}\n{l2}\n")
        );
        // The values themselves parse exactly (serde_json's float_roundtrip).
        let back = read_metrics(&path).unwrap();
        assert_eq!(back[0].policy_loss, 0.021660075508255654);
        assert_eq!(back[1].policy_loss, 2.6391587328232322e-14);
        // Nothing to drop: the file is left alone.
        truncate_metrics(&path, 9).unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            format!("{l1}\n{l2}\n")
        );
    }
}
