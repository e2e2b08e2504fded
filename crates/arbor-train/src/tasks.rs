//! The tasks of `arbor-env` as token-level episodes for the trainer: the
//! small-vocabulary running-sum and register tasks (no tokenizer), math
//! datasets (GSM8K, MATH, MATH-500, AIME, or a JSONL) and SWE repository
//! tasks through the model's tokenizer and the Qwen chat format.

use std::path::PathBuf;

use arbor_env::chat::ChatFormat;
use arbor_env::math::{load_problems, DatasetFormat, MathEnv, MathProblem};
use arbor_env::synthetic::{Register, RegisterConfig, RunningSum, RunningSumConfig};
use arbor_env::{Action, Env};
use arbor_model::Tokenizer;
use arbor_rl::credit::LossRow;
use serde::{Deserialize, Serialize};

use crate::config::HarnessSettings;
use crate::rollout::{RolloutConfig, StepOut, TaskInstance, TokenEpisode};
use crate::TrainError;

use arbor_env::context::{BoundedConfig, BoundedContext, Compaction};

/// The longest segment of a token task under a bounded context: room for a
/// four-section summary of a one-digit state, or a workspace call.
const BOUNDED_SEGMENT_TOKENS: usize = 6;

/// The tool harness's context mode for `[harness]`.
fn harness_mode(h: &HarnessSettings) -> arbor_env::harness::ContextMode {
    use arbor_env::harness::{CompactionPrompt, ContextMode};
    let Some(budget) = h.context_tokens else {
        return ContextMode::Unbounded;
    };
    let compaction = |prompt| ContextMode::Compaction {
        budget,
        prompt,
        max_compactions: h.max_compactions,
    };
    match h.compaction {
        Compaction::None => ContextMode::Bounded { budget },
        Compaction::FreeForm => compaction(CompactionPrompt::FreeForm),
        Compaction::Structured => compaction(CompactionPrompt::Structured),
        Compaction::Workspace => ContextMode::Workspace { budget },
    }
}

/// A token-level [`Env`] as a [`TokenEpisode`]; text environments go
/// through `tokenizer` (actions decoded, observations encoded).
pub struct EnvEpisode {
    pub env: Box<dyn Env>,
    pub tokenizer: Option<Tokenizer>,
    /// Decode actions with their special tokens (multi-turn chat tasks: the
    /// harness closes a turn the policy closed with `<|im_end|>` itself
    /// instead of adding a second one).
    pub keep_special: bool,
    /// What the latest observation asks the policy for next (a task
    /// action, or a compaction summary).
    pub next: arbor_rl::TokenKind,
}

impl EnvEpisode {
    fn observation_tokens(&self, obs: arbor_env::Observation) -> Result<Vec<u32>, TrainError> {
        match (obs.tokens, &self.tokenizer) {
            (Some(t), _) => Ok(t),
            (None, Some(_)) if obs.text.is_empty() => Ok(Vec::new()),
            (None, Some(tok)) => Ok(tok.encode(&obs.text, false)?),
            (None, None) => Err(TrainError::Config(format!(
                "task {} is a text task and needs the model's tokenizer",
                self.env.task_id()
            ))),
        }
    }
}

impl TokenEpisode for EnvEpisode {
    fn step(&mut self, action: &[u32]) -> Result<StepOut, TrainError> {
        let act = match &self.tokenizer {
            Some(tok) if self.env.vocab().is_none() => {
                Action::Text(tok.decode(action, !self.keep_special)?)
            }
            _ => Action::Tokens(action.to_vec()),
        };
        let out = self.env.step(&act)?;
        let reward = out.done.then_some(out.reward);
        let (restart, next) = (out.observation.restart, out.observation.next);
        self.next = next;
        Ok(StepOut {
            observation: self.observation_tokens(out.observation)?,
            reward,
            restart,
            next,
        })
    }

    fn tool_calls(&self) -> usize {
        self.env.tool_calls()
    }

    fn next_kind(&self) -> arbor_rl::TokenKind {
        self.next
    }

    fn context_stats(&self) -> Option<arbor_env::context::ContextStats> {
        self.env.context_stats()
    }

    /// Equal tokens, else (text tasks) the environment's judgement of the
    /// two texts.
    fn same_observation(&self, recorded: &[u32], replayed: &[u32]) -> bool {
        if recorded == replayed {
            return true;
        }
        match &self.tokenizer {
            Some(tok) if self.env.vocab().is_none() => {
                match (tok.decode(recorded, false), tok.decode(replayed, false)) {
                    (Ok(a), Ok(b)) => self.env.same_observation(&a, &b),
                    _ => false,
                }
            }
            _ => false,
        }
    }

    fn fork(&self) -> Result<Box<dyn TokenEpisode>, TrainError> {
        let env = self.env.fork().ok_or_else(|| {
            TrainError::Rollout(format!("task {} cannot be forked", self.env.task_id()))
        })?;
        Ok(Box::new(EnvEpisode {
            env,
            tokenizer: self.tokenizer.clone(),
            keep_special: self.keep_special,
            next: self.next,
        }))
    }
}

/// Which built-in task to train on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, tag = "kind", rename_all = "snake_case")]
pub enum TaskConfig {
    /// `k` digits revealed one per turn; answer the running sum mod 10
    /// after each; reward 1 iff all `k` answers are right. `one_turn`: all
    /// digits in the prompt and all `k` sums in one response (a single-turn
    /// task: Prefix Sampling cuts it at tokens).
    RunningSum {
        difficulty: usize,
        #[serde(default)]
        one_turn: bool,
        /// Fail fast: the first wrong answer ends the episode with reward
        /// 0 (multi-turn only).
        #[serde(default)]
        stop_at_error: bool,
    },
    /// A stateful tool: `k` signed digits revealed one at a time; the policy
    /// calls `<add> x` (and may call `<get>` to read the register); reward 1
    /// iff the register ends at the signed sum mod 10. Every action is a
    /// tool call. `subtract`: draw `-d` instructions too.
    Register {
        difficulty: usize,
        #[serde(default)]
        subtract: bool,
    },
    /// Single-turn math: reward 1 iff the `\boxed{}` (or final) answer is
    /// equivalent to the reference. `train` / `eval`: `gsm8k`, `math`
    /// (Hendrycks), `math500`, `aime` (from
    /// [`arbor_env::data::shared_data_dir`]: `$ARBOR_SHARED_DATA`, else
    /// `../shared/data` beside the checkout) or a JSONL path.
    Math {
        train: String,
        eval: String,
        /// Longest response.
        max_tokens: usize,
    },
    /// Multi-turn repository tasks in SWE-bench format (the HumanEval-derived
    /// tasks of `scripts/build_humaneval_tasks.sh`, or SWE-bench instances
    /// with clones under `repos`) through the tool harness: the policy reads,
    /// searches, edits and runs commands in a bubblewrap sandbox with Qwen
    /// `<tool_call>`s and submits; reward 1 iff the hidden tests pass. Every
    /// `holdout_every`-th instance (by position) is held out for evaluation.
    Swe {
        instances: String,
        /// Repository clones (default: `repos/` beside the instances file).
        #[serde(default)]
        repos: Option<String>,
        #[serde(default = "five")]
        holdout_every: usize,
        /// Longest policy turn, tokens.
        max_tokens: usize,
        /// Policy turns per episode (then the episode is cut off and scored).
        max_turns: usize,
        /// Run commands without bubblewrap when it is missing (explicit
        /// opt-in; only for trusted models and tasks).
        #[serde(default)]
        allow_unsandboxed: bool,
    },
}

/// Seeded Fisher-Yates shuffle (SplitMix64), the training order of dataset tasks.
fn shuffle<T>(v: &mut [T], seed: u64) {
    let mut s = seed;
    for i in (1..v.len()).rev() {
        s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        v.swap(i, (z % (i as u64 + 1)) as usize);
    }
}

/// The SWE sandbox: bubblewrap, checked to actually run a command here
/// (installed but blocked user namespaces would otherwise zero every
/// reward), or unsandboxed only by `task.allow_unsandboxed`.
fn sandbox(allow_unsandboxed: bool) -> Result<arbor_env::swe::Sandbox, TrainError> {
    use arbor_env::swe::{Limits, Sandbox};
    let hint = "install bubblewrap (apt-get install bubblewrap) or set `allow_unsandboxed = true` \
                under [task] (trusted models and tasks only)";
    match Sandbox::bubblewrap(Limits::default()) {
        Ok(sb) => {
            match sb.probe("true") {
                Ok(o) if o.success() => Ok(sb),
                Ok(o) if allow_unsandboxed => {
                    tracing::warn!("bubblewrap cannot run here ({}); running SWE commands unsandboxed", o.render());
                    Ok(Sandbox::unsandboxed(Limits::default()))
                }
                Ok(o) => Err(TrainError::Config(format!(
                    "key `task.allow_unsandboxed`: bubblewrap is installed but cannot run a command here ({}); {hint}",
                    o.render()
                ))),
                Err(e) => Err(TrainError::Config(format!("key `task.allow_unsandboxed`: {e}; {hint}"))),
            }
        }
        Err(_) if allow_unsandboxed => {
            tracing::warn!("bubblewrap not found; running SWE commands unsandboxed (task.allow_unsandboxed)");
            Ok(Sandbox::unsandboxed(Limits::default()))
        }
        Err(e) => Err(TrainError::Config(format!("key `task.allow_unsandboxed`: {e}; {hint}"))),
    }
}

fn five() -> usize {
    5
}

/// Prepared SWE environments (repositories materialised once); episodes
/// start from `fresh()` copies.
#[derive(Debug, Default)]
struct SwePool {
    train: std::sync::Mutex<Vec<Box<dyn Env>>>,
    eval: std::sync::Mutex<Vec<Box<dyn Env>>>,
}

impl SwePool {
    fn load(
        cfg: &TaskConfig,
        seed: u64,
        context: arbor_env::harness::ContextMode,
        tokenizer: Option<&Tokenizer>,
    ) -> Result<Option<Self>, TrainError> {
        let TaskConfig::Swe {
            instances,
            repos,
            holdout_every,
            max_turns,
            allow_unsandboxed,
            ..
        } = cfg
        else {
            return Ok(None);
        };
        let bad = |e: arbor_env::EnvError| TrainError::Config(format!("key `task.instances`: {e}"));
        let file = std::path::Path::new(instances);
        let mut list = arbor_env::swe::load_instances(file).map_err(bad)?;
        if list.len() < 2 && *holdout_every != 1 {
            return Err(TrainError::Config(format!(
                "key `task.instances`: {instances} has {} instances; need >= 2 (train and held-out)",
                list.len()
            )));
        }
        let repos = match repos {
            Some(r) => PathBuf::from(r),
            None => file
                .parent()
                .unwrap_or(std::path::Path::new("."))
                .join("repos"),
        };
        let bad_repo = |e: arbor_env::EnvError| {
            TrainError::Config(format!(
                "key `task.repos` ({}): {e} (instance from {instances})",
                repos.display()
            ))
        };
        let sandbox = sandbox(*allow_unsandboxed)?;
        // The same seeded order for every run (held-out split first, so it
        // does not depend on the seed).
        let mut eval_list = Vec::new();
        let mut train_list = Vec::new();
        for (k, inst) in list.drain(..).enumerate() {
            // `holdout_every = 1` holds out every instance (`arbor eval
            // --swe`; training configs are validated to >= 2).
            if (k + 1) % (*holdout_every).max(1) == 0 {
                eval_list.push(inst);
            } else {
                train_list.push(inst);
            }
        }
        if eval_list.is_empty() || (train_list.is_empty() && *holdout_every != 1) {
            return Err(TrainError::Config(format!(
                "key `task.holdout_every`: {} instances in {instances} with holdout_every = {holdout_every} \
                 leave no held-out or no training task",
                eval_list.len() + train_list.len()
            )));
        }
        shuffle(&mut train_list, seed);
        let mut harness = arbor_env::harness::HarnessConfig {
            chat: ChatFormat::Qwen,
            max_steps: *max_turns,
            context,
            ..Default::default()
        };
        if let Some(tok) = tokenizer {
            // Count the budget in the model's tokens.
            let tok = tok.clone();
            harness.counter =
                arbor_env::harness::TokenCounter::Custom(std::sync::Arc::new(move |s: &str| {
                    tok.encode(s, false).map_or(s.len() / 4, |t| t.len())
                }));
        }
        let pool = SwePool::default();
        for (list, dst) in [(train_list, &pool.train), (eval_list, &pool.eval)] {
            for inst in list {
                let source = arbor_env::swe::SweTask::locate(&inst, &repos).map_err(bad_repo)?;
                let task = arbor_env::swe::SweTask::new(
                    inst,
                    &source,
                    arbor_env::swe::SweConfig::tests(sandbox.clone()),
                )
                .map_err(bad_repo)?;
                let env: Box<dyn Env> = Box::new(arbor_env::swe::swe_env(task, harness.clone()));
                dst.lock().expect("fresh mutex").push(env);
            }
        }
        Ok(Some(pool))
    }

    fn fresh(&self, eval: bool, i: u64) -> Result<Box<dyn Env>, TrainError> {
        let list = if eval { &self.eval } else { &self.train };
        let list = list
            .lock()
            .map_err(|_| TrainError::Rollout("SWE pool poisoned".into()))?;
        if list.is_empty() {
            return Err(TrainError::Config(
                "key `task.holdout_every`: leaves no tasks".into(),
            ));
        }
        Ok(list[(i % list.len() as u64) as usize].fresh()?)
    }
}

impl Default for TaskConfig {
    fn default() -> Self {
        TaskConfig::RunningSum {
            difficulty: 4,
            one_turn: false,
            stop_at_error: false,
        }
    }
}

/// Resolve a dataset name (`gsm8k`, `math`, `math500`, `aime`; `split` is
/// `train` or `test`) or a JSONL path.
pub fn dataset_file(
    name: &str,
    split: &str,
) -> Result<(PathBuf, Option<DatasetFormat>), TrainError> {
    let named = match name {
        "gsm8k" => Some((format!("math/gsm8k/{split}.jsonl"), DatasetFormat::Gsm8k)),
        "math" => Some((
            format!("math/hendrycks-math/{split}.jsonl"),
            DatasetFormat::Math,
        )),
        "math500" => Some((
            "math/math500/test.jsonl".to_string(),
            DatasetFormat::Math500,
        )),
        "aime" => Some(("math/aime/test.jsonl".to_string(), DatasetFormat::Aime)),
        _ => None,
    };
    let Some((rel, fmt)) = named else {
        let p = PathBuf::from(name);
        return if p.is_file() {
            Ok((p, None))
        } else {
            Err(TrainError::Config(format!(
                "dataset `{name}`: no such file (and not one of gsm8k, math, math500, aime)"
            )))
        };
    };
    let root = arbor_env::data::shared_data_dir();
    root.as_ref()
        .map(|r| r.join(&rel))
        .filter(|p| p.is_file())
        .map(|p| (p, Some(fmt)))
        .ok_or_else(|| {
            TrainError::Config(format!(
                "dataset `{name}`: {rel} not found under the shared data directory ({}; set \
                 $ARBOR_SHARED_DATA to where it is)",
                root.map_or("absent".to_string(), |r| r.display().to_string())
            ))
        })
}

/// Seeded task instances. Synthetic tasks: training draws seeds `base + 2i`,
/// evaluation `base + 2i + 1`, so the two never overlap. Math: training
/// problems in a seeded order (cycling), evaluation problems in file order.
#[derive(Debug, Clone)]
pub struct TaskSampler {
    pub cfg: TaskConfig,
    pub base_seed: u64,
    tokenizer: Option<Tokenizer>,
    eos: Vec<u32>,
    /// The tokenizer's newline-holding ids (see [`RolloutConfig::line_ends`]),
    /// found on first use.
    line_ends: std::sync::Arc<std::sync::OnceLock<std::sync::Arc<[u32]>>>,
    train: Vec<MathProblem>,
    eval: Vec<MathProblem>,
    swe: Option<std::sync::Arc<SwePool>>,
    harness: HarnessSettings,
}

impl TaskSampler {
    /// A sampler; math tasks load their datasets and need `tokenizer` and the
    /// model's EOS ids.
    pub fn new(
        cfg: TaskConfig,
        base_seed: u64,
        tokenizer: Option<Tokenizer>,
        eos: Vec<u32>,
    ) -> Result<Self, TrainError> {
        Self::with_harness(cfg, base_seed, tokenizer, eos, HarnessSettings::default())
    }

    /// [`TaskSampler::new`] with the policy's context bounded by `harness`
    /// (`[harness]`): token tasks under [`BoundedContext`], SWE tasks under
    /// the tool harness's context modes.
    pub fn with_harness(
        cfg: TaskConfig,
        base_seed: u64,
        tokenizer: Option<Tokenizer>,
        eos: Vec<u32>,
        harness: HarnessSettings,
    ) -> Result<Self, TrainError> {
        let (mut train, mut eval) = (Vec::new(), Vec::new());
        if let TaskConfig::Math {
            train: tr,
            eval: ev,
            ..
        } = &cfg
        {
            if tokenizer.is_none() {
                return Err(TrainError::Config(
                    "key `task`: math tasks need a model with a tokenizer (`model.path`)".into(),
                ));
            }
            let load = |name: &str, split: &str| -> Result<Vec<MathProblem>, TrainError> {
                let (p, fmt) = dataset_file(name, split)?;
                Ok(load_problems(&p, fmt.as_ref())?)
            };
            train = load(tr, "train")?;
            eval = load(ev, "test")?;
            if train.is_empty() || eval.is_empty() {
                return Err(TrainError::Config(
                    "key `task`: a dataset has no problems".into(),
                ));
            }
            // Seeded order of the training problems (Fisher-Yates, SplitMix64).
            shuffle(&mut train, base_seed);
        }
        if matches!(cfg, TaskConfig::Swe { .. }) && tokenizer.is_none() {
            return Err(TrainError::Config(
                "key `task`: SWE tasks need a model with a tokenizer (`model.path`)".into(),
            ));
        }
        let swe = SwePool::load(&cfg, base_seed, harness_mode(&harness), tokenizer.as_ref())?
            .map(std::sync::Arc::new);
        Ok(TaskSampler {
            cfg,
            base_seed,
            tokenizer,
            eos,
            line_ends: Default::default(),
            train,
            eval,
            swe,
            harness,
        })
    }

    /// The policy's context settings.
    pub fn harness(&self) -> &HarnessSettings {
        &self.harness
    }

    /// Vocabulary of the built-in small-vocabulary tasks.
    pub fn vocab_size(&self) -> usize {
        arbor_env::vocab::VOCAB_SIZE as usize
    }

    /// Whether the task is text (needs a tokenizer and an HF model).
    pub fn is_text(&self) -> bool {
        matches!(self.cfg, TaskConfig::Math { .. } | TaskConfig::Swe { .. })
    }

    /// How segments are generated for this task.
    pub fn rollout_config(&self, temperature: f32) -> RolloutConfig {
        let mut r = self.rollout_config_unbounded(temperature);
        if self.harness.context_tokens.is_some() && !self.is_text() {
            // Room for a summary or a workspace call, and for the turns
            // they add.
            r.max_segment_tokens = r.max_segment_tokens.max(BOUNDED_SEGMENT_TOKENS);
            r.max_segments = 2 * r.max_segments + 2 * self.harness.max_compactions;
        }
        r
    }

    fn rollout_config_unbounded(&self, temperature: f32) -> RolloutConfig {
        let line_ends: std::sync::Arc<[u32]> = std::sync::Arc::new([]);
        match &self.cfg {
            TaskConfig::RunningSum {
                difficulty,
                one_turn: false,
                ..
            } => RolloutConfig {
                temperature,
                segment_stop: vec![arbor_env::vocab::EOS],
                max_segment_tokens: 2,
                max_segments: *difficulty,
                line_ends,
            },
            TaskConfig::RunningSum {
                difficulty,
                one_turn: true,
                ..
            } => RolloutConfig {
                temperature,
                segment_stop: vec![arbor_env::vocab::EOS],
                max_segment_tokens: *difficulty + 1,
                max_segments: 1,
                line_ends,
            },
            TaskConfig::Register { difficulty, .. } => RolloutConfig {
                temperature,
                segment_stop: vec![arbor_env::vocab::EOS],
                max_segment_tokens: 3,
                // The env ends a stalled episode after 3k steps itself.
                max_segments: 3 * *difficulty,
                line_ends,
            },
            TaskConfig::Swe {
                max_tokens,
                max_turns,
                ..
            } => RolloutConfig {
                temperature,
                segment_stop: self.eos.clone(),
                max_segment_tokens: *max_tokens,
                max_segments: *max_turns,
                line_ends,
            },
            TaskConfig::Math { max_tokens, .. } => RolloutConfig {
                temperature,
                segment_stop: self.eos.clone(),
                max_segment_tokens: *max_tokens,
                max_segments: 1,
                line_ends,
            },
        }
    }

    /// Ids of the tokenizer whose text holds a newline (empty without a
    /// tokenizer): Prefix Sampling's line cuts. Decodes the vocabulary
    /// once, on first use.
    pub fn line_ends(&self) -> std::sync::Arc<[u32]> {
        self.line_ends
            .get_or_init(|| {
                self.tokenizer
                    .as_ref()
                    .map(Tokenizer::line_end_ids)
                    .unwrap_or_default()
                    .into()
            })
            .clone()
    }

    /// The synthetic task instance for `seed` and its oracle's actions,
    /// under the bounded context when `[harness]` sets one.
    fn synthetic(&self, seed: u64) -> Result<(Box<dyn Env>, Vec<Action>), TrainError> {
        let (env, oracle) = self.synthetic_unbounded(seed)?;
        let Some(cfg) = self.bounded_config() else {
            return Ok((env, oracle));
        };
        let env = BoundedContext::new(env, cfg)
            .map_err(|e| TrainError::Config(format!("key `harness.context_tokens`: {e}")))?;
        Ok((Box::new(env), oracle))
    }

    /// The bounded context of a token task, when `[harness]` sets one.
    fn bounded_config(&self) -> Option<BoundedConfig> {
        Some(BoundedConfig {
            context_tokens: self.harness.context_tokens?,
            compaction: self.harness.compaction,
            max_compactions: self.harness.max_compactions,
            reserve: self.rollout_config(1.0).max_segment_tokens,
        })
    }

    fn synthetic_unbounded(&self, seed: u64) -> Result<(Box<dyn Env>, Vec<Action>), TrainError> {
        let err = |e: arbor_env::EnvError| TrainError::Config(format!("task: {e}"));
        match &self.cfg {
            TaskConfig::RunningSum {
                difficulty,
                one_turn,
                stop_at_error,
            } => {
                let cfg = RunningSumConfig {
                    one_turn: *one_turn,
                    stop_at_error: *stop_at_error,
                    ..RunningSumConfig::tokens(*difficulty)
                };
                let env = RunningSum::new(cfg, seed).map_err(err)?;
                let oracle = env.oracle_actions();
                Ok((Box::new(env), oracle))
            }
            TaskConfig::Register {
                difficulty,
                subtract,
            } => {
                let env = Register::new(RegisterConfig::tokens(*difficulty, *subtract), seed)
                    .map_err(err)?;
                let oracle = env.oracle_actions();
                Ok((Box::new(env), oracle))
            }
            TaskConfig::Math { .. } | TaskConfig::Swe { .. } => {
                Err(TrainError::Config("not a synthetic task".into()))
            }
        }
    }

    fn instance(&self, mut env: Box<dyn Env>) -> Result<TaskInstance, TrainError> {
        let first = env.reset()?;
        let ep = EnvEpisode {
            env,
            tokenizer: self.tokenizer.clone(),
            keep_special: matches!(self.cfg, TaskConfig::Swe { .. }),
            next: first.next,
        };
        let prompt = ep.observation_tokens(first)?;
        Ok(TaskInstance {
            id: ep.env.task_id().to_string(),
            prompt,
            episode: Box::new(ep),
        })
    }

    /// Training task number `i`.
    pub fn train_task(&self, i: u64) -> Result<TaskInstance, TrainError> {
        match &self.cfg {
            TaskConfig::RunningSum { .. } | TaskConfig::Register { .. } => {
                self.instance(self.synthetic(self.base_seed.wrapping_add(2 * i))?.0)
            }
            TaskConfig::Math { .. } => {
                let p = self.train[(i % self.train.len() as u64) as usize].clone();
                self.instance(Box::new(MathEnv::new(p, ChatFormat::Qwen)))
            }
            TaskConfig::Swe { .. } => self.instance(self.swe_pool()?.fresh(false, i)?),
        }
    }

    /// Held-out evaluation task number `i`.
    pub fn eval_task(&self, i: u64) -> Result<TaskInstance, TrainError> {
        match &self.cfg {
            TaskConfig::RunningSum { .. } | TaskConfig::Register { .. } => {
                self.instance(self.synthetic(self.base_seed.wrapping_add(2 * i + 1))?.0)
            }
            TaskConfig::Math { .. } => {
                let p = self.eval[(i % self.eval.len() as u64) as usize].clone();
                self.instance(Box::new(MathEnv::new(p, ChatFormat::Qwen)))
            }
            TaskConfig::Swe { .. } => self.instance(self.swe_pool()?.fresh(true, i)?),
        }
    }

    /// Number of distinct evaluation tasks (`None`: unbounded).
    pub fn eval_len(&self) -> Option<usize> {
        match &self.swe {
            Some(p) => p.eval.lock().ok().map(|l| l.len()),
            None => self.is_text().then_some(self.eval.len()),
        }
    }

    fn swe_pool(&self) -> Result<&SwePool, TrainError> {
        self.swe
            .as_deref()
            .ok_or_else(|| TrainError::Config("SWE tasks were not loaded".into()))
    }

    /// A demonstration of training task `i` (the oracle's actions; under a
    /// bounded context also its summaries, which hold the task's state) as
    /// loss rows, one per context window: action tokens trained, prompt
    /// and observations masked.
    pub fn demonstration(&self, i: u64) -> Result<Vec<LossRow>, TrainError> {
        let (env, actions) = self.synthetic_unbounded(self.base_seed.wrapping_add(2 * i))?;
        let (first, turns) = match self.bounded_config() {
            Some(cfg) => BoundedContext::new(env, cfg)?.demonstrate(&actions)?,
            None => {
                let mut env = env;
                let first = env.reset()?;
                let mut turns = Vec::with_capacity(actions.len());
                for a in actions {
                    let out = env.step(&a)?;
                    turns.push((a, out));
                }
                (first, turns)
            }
        };
        let row = |tokens: Vec<u32>, mask: Vec<f32>| {
            let n = tokens.len();
            LossRow {
                episode: 0,
                leaf: arbor_rl::NodeId(0),
                tokens,
                mask,
                advantages: vec![0.0; n],
                behaviour_logprobs: vec![0.0; n],
                history_logprobs: Vec::new(),
                value_targets: Vec::new(),
            }
        };
        let mut rows = Vec::new();
        let mut tokens = first.tokens.unwrap_or_default();
        let mut mask = vec![0.0f32; tokens.len()];
        for (a, out) in turns {
            let Action::Tokens(t) = a else {
                return Err(TrainError::Config(
                    "token task produced a text action".into(),
                ));
            };
            tokens.extend(&t);
            mask.extend(std::iter::repeat_n(1.0, t.len()));
            let obs = out.observation.tokens.unwrap_or_default();
            if out.observation.restart {
                rows.push(row(std::mem::take(&mut tokens), std::mem::take(&mut mask)));
            }
            mask.extend(std::iter::repeat_n(0.0, obs.len()));
            tokens.extend(obs);
        }
        rows.push(row(tokens, mask));
        Ok(rows)
    }
}
