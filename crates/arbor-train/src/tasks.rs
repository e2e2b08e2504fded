//! Built-in tasks of `arbor-env` as token-level episodes for the trainer.

use arbor_env::synthetic::{RunningSum, RunningSumConfig};
use arbor_env::{Action, Env};
use arbor_rl::credit::LossRow;
use serde::{Deserialize, Serialize};

use crate::rollout::{RolloutConfig, StepOut, TaskInstance, TokenEpisode};
use crate::TrainError;

/// A token-level [`Env`] as a [`TokenEpisode`].
pub struct EnvEpisode(pub Box<dyn Env>);

impl TokenEpisode for EnvEpisode {
    fn step(&mut self, action: &[u32]) -> Result<StepOut, TrainError> {
        let out = self
            .0
            .step(&Action::Tokens(action.to_vec()))
            .map_err(|e| TrainError::Rollout(e.to_string()))?;
        Ok(StepOut {
            observation: out.observation.tokens.unwrap_or_default(),
            reward: out.done.then_some(out.reward),
        })
    }

    fn fork(&self) -> Result<Box<dyn TokenEpisode>, TrainError> {
        let env = self.0.fork().ok_or_else(|| {
            TrainError::Rollout(format!("task {} cannot be forked", self.0.task_id()))
        })?;
        Ok(Box::new(EnvEpisode(env)))
    }
}

/// Which built-in task to train on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, tag = "kind", rename_all = "snake_case")]
pub enum TaskConfig {
    /// `k` digits revealed one per turn; answer the running sum mod 10
    /// after each; reward 1 iff all `k` answers are right.
    RunningSum { difficulty: usize },
}

impl Default for TaskConfig {
    fn default() -> Self {
        TaskConfig::RunningSum { difficulty: 4 }
    }
}

/// Seeded task instances. Training draws seeds `base + 2i`, evaluation
/// `base + 2i + 1`, so the two never overlap.
#[derive(Debug, Clone)]
pub struct TaskSampler {
    pub cfg: TaskConfig,
    pub base_seed: u64,
}

impl TaskSampler {
    pub fn vocab_size(&self) -> usize {
        arbor_env::vocab::VOCAB_SIZE as usize
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
        }
    }

    fn env(&self, seed: u64) -> Result<RunningSum, TrainError> {
        match &self.cfg {
            TaskConfig::RunningSum { difficulty } => {
                RunningSum::new(RunningSumConfig::tokens(*difficulty), seed)
                    .map_err(|e| TrainError::Config(format!("task: {e}")))
            }
        }
    }

    fn instance(&self, seed: u64) -> Result<TaskInstance, TrainError> {
        let mut env = self.env(seed)?;
        let first = env
            .reset()
            .map_err(|e| TrainError::Rollout(e.to_string()))?;
        Ok(TaskInstance {
            id: env.task_id().to_string(),
            prompt: first.tokens.unwrap_or_default(),
            episode: Box::new(EnvEpisode(Box::new(env))),
        })
    }

    /// Training task number `i`.
    pub fn train_task(&self, i: u64) -> Result<TaskInstance, TrainError> {
        self.instance(self.base_seed.wrapping_add(2 * i))
    }

    /// Held-out evaluation task number `i`.
    pub fn eval_task(&self, i: u64) -> Result<TaskInstance, TrainError> {
        self.instance(self.base_seed.wrapping_add(2 * i + 1))
    }

    /// A demonstration of training task `i` (the oracle's actions) as a loss
    /// row: action tokens trained, prompt and observations masked.
    pub fn demonstration(&self, i: u64) -> Result<LossRow, TrainError> {
        let mut env = self.env(self.base_seed.wrapping_add(2 * i))?;
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
