//! Built-in tasks of `arbor-env` as token-level episodes for the trainer:
//! the small-vocabulary running-sum task (no tokenizer), and math datasets
//! (GSM8K, MATH, or a JSONL) through the model's tokenizer and the Qwen chat
//! format.

use std::path::PathBuf;

use arbor_env::chat::ChatFormat;
use arbor_env::math::{load_problems, DatasetFormat, MathEnv, MathProblem};
use arbor_env::synthetic::{RunningSum, RunningSumConfig};
use arbor_env::{Action, Env};
use arbor_model::Tokenizer;
use arbor_rl::credit::LossRow;
use serde::{Deserialize, Serialize};

use crate::rollout::{RolloutConfig, StepOut, TaskInstance, TokenEpisode};
use crate::TrainError;

/// A token-level [`Env`] as a [`TokenEpisode`]; text environments go
/// through `tokenizer` (actions decoded, observations encoded).
pub struct EnvEpisode {
    pub env: Box<dyn Env>,
    pub tokenizer: Option<Tokenizer>,
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
            Some(tok) if self.env.vocab().is_none() => Action::Text(tok.decode(action, true)?),
            _ => Action::Tokens(action.to_vec()),
        };
        let out = self
            .env
            .step(&act)
            .map_err(|e| TrainError::Rollout(e.to_string()))?;
        let reward = out.done.then_some(out.reward);
        Ok(StepOut {
            observation: self.observation_tokens(out.observation)?,
            reward,
        })
    }

    fn fork(&self) -> Result<Box<dyn TokenEpisode>, TrainError> {
        let env = self.env.fork().ok_or_else(|| {
            TrainError::Rollout(format!("task {} cannot be forked", self.env.task_id()))
        })?;
        Ok(Box::new(EnvEpisode {
            env,
            tokenizer: self.tokenizer.clone(),
        }))
    }
}

/// Which built-in task to train on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, tag = "kind", rename_all = "snake_case")]
pub enum TaskConfig {
    /// `k` digits revealed one per turn; answer the running sum mod 10
    /// after each; reward 1 iff all `k` answers are right.
    RunningSum { difficulty: usize },
    /// Single-turn math: reward 1 iff the `\boxed{}` (or final) answer is
    /// equivalent to the reference. `train` / `eval`: `gsm8k`, `math`
    /// (Hendrycks), `math500`, `aime` (from `$ARBOR_SHARED_DATA` or
    /// `../shared/data`) or a JSONL path.
    Math {
        train: String,
        eval: String,
        /// Longest response.
        max_tokens: usize,
    },
}

impl Default for TaskConfig {
    fn default() -> Self {
        TaskConfig::RunningSum { difficulty: 4 }
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
    let roots: Vec<PathBuf> = std::env::var_os("ARBOR_SHARED_DATA")
        .map(PathBuf::from)
        .into_iter()
        .chain([
            PathBuf::from("../shared/data"),
            PathBuf::from("shared/data"),
        ])
        .collect();
    roots
        .iter()
        .map(|r| r.join(&rel))
        .find(|p| p.is_file())
        .map(|p| (p, Some(fmt)))
        .ok_or_else(|| {
            TrainError::Config(format!(
                "dataset `{name}`: {rel} not found under $ARBOR_SHARED_DATA, ../shared/data or shared/data"
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
    train: Vec<MathProblem>,
    eval: Vec<MathProblem>,
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
                load_problems(&p, fmt.as_ref()).map_err(|e| TrainError::Config(e.to_string()))
            };
            train = load(tr, "train")?;
            eval = load(ev, "test")?;
            if train.is_empty() || eval.is_empty() {
                return Err(TrainError::Config(
                    "key `task`: a dataset has no problems".into(),
                ));
            }
            // Seeded order of the training problems (Fisher-Yates, SplitMix64).
            let mut s = base_seed;
            for i in (1..train.len()).rev() {
                s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let mut z = s;
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                z ^= z >> 31;
                train.swap(i, (z % (i as u64 + 1)) as usize);
            }
        }
        Ok(TaskSampler {
            cfg,
            base_seed,
            tokenizer,
            eos,
            train,
            eval,
        })
    }

    /// Vocabulary of the built-in small-vocabulary tasks.
    pub fn vocab_size(&self) -> usize {
        arbor_env::vocab::VOCAB_SIZE as usize
    }

    /// Whether the task is text (needs a tokenizer and an HF model).
    pub fn is_text(&self) -> bool {
        matches!(self.cfg, TaskConfig::Math { .. })
    }

    /// How segments are generated for this task.
    pub fn rollout_config(&self, temperature: f32) -> RolloutConfig {
        match &self.cfg {
            TaskConfig::RunningSum { difficulty } => RolloutConfig {
                temperature,
                segment_stop: vec![arbor_env::vocab::EOS],
                max_segment_tokens: 2,
                max_segments: *difficulty,
            },
            TaskConfig::Math { max_tokens, .. } => RolloutConfig {
                temperature,
                segment_stop: self.eos.clone(),
                max_segment_tokens: *max_tokens,
                max_segments: 1,
            },
        }
    }

    fn running_sum(&self, seed: u64) -> Result<RunningSum, TrainError> {
        match &self.cfg {
            TaskConfig::RunningSum { difficulty } => {
                RunningSum::new(RunningSumConfig::tokens(*difficulty), seed)
                    .map_err(|e| TrainError::Config(format!("task: {e}")))
            }
            TaskConfig::Math { .. } => Err(TrainError::Config("not a synthetic task".into())),
        }
    }

    fn instance(&self, mut env: Box<dyn Env>) -> Result<TaskInstance, TrainError> {
        let first = env
            .reset()
            .map_err(|e| TrainError::Rollout(e.to_string()))?;
        let ep = EnvEpisode {
            env,
            tokenizer: self.tokenizer.clone(),
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
            TaskConfig::RunningSum { .. } => self.instance(Box::new(
                self.running_sum(self.base_seed.wrapping_add(2 * i))?,
            )),
            TaskConfig::Math { .. } => {
                let p = self.train[(i % self.train.len() as u64) as usize].clone();
                self.instance(Box::new(MathEnv::new(p, ChatFormat::Qwen)))
            }
        }
    }

    /// Held-out evaluation task number `i`.
    pub fn eval_task(&self, i: u64) -> Result<TaskInstance, TrainError> {
        match &self.cfg {
            TaskConfig::RunningSum { .. } => self.instance(Box::new(
                self.running_sum(self.base_seed.wrapping_add(2 * i + 1))?,
            )),
            TaskConfig::Math { .. } => {
                let p = self.eval[(i % self.eval.len() as u64) as usize].clone();
                self.instance(Box::new(MathEnv::new(p, ChatFormat::Qwen)))
            }
        }
    }

    /// Number of distinct evaluation tasks (`None`: unbounded).
    pub fn eval_len(&self) -> Option<usize> {
        self.is_text().then_some(self.eval.len())
    }

    /// A demonstration of training task `i` (the oracle's actions) as a loss
    /// row: action tokens trained, prompt and observations masked.
    pub fn demonstration(&self, i: u64) -> Result<LossRow, TrainError> {
        let mut env = self.running_sum(self.base_seed.wrapping_add(2 * i))?;
        let actions = env.oracle_actions();
        let first = env
            .reset()
            .map_err(|e| TrainError::Rollout(e.to_string()))?;
        let mut tokens = first.tokens.unwrap_or_default();
        let mut mask = vec![0.0f32; tokens.len()];
        for a in &actions {
            let Action::Tokens(t) = a else {
                return Err(TrainError::Config(
                    "token task produced a text action".into(),
                ));
            };
            tokens.extend(t);
            mask.extend(std::iter::repeat_n(1.0, t.len()));
            let out = env
                .step(a)
                .map_err(|e| TrainError::Rollout(e.to_string()))?;
            let obs = out.observation.tokens.unwrap_or_default();
            mask.extend(std::iter::repeat_n(0.0, obs.len()));
            tokens.extend(obs);
        }
        let n = tokens.len();
        Ok(LossRow {
            episode: 0,
            leaf: arbor_rl::NodeId(0),
            tokens,
            mask,
            advantages: vec![0.0; n],
            behaviour_logprobs: vec![0.0; n],
            value_targets: Vec::new(),
        })
    }
}
