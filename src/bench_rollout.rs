//! `arbor bench rollout`: the rollout scheduler with slow environments.
//!
//! Episodes of the built-in running-sum task on the quickstart's tiny
//! model (random weights), each environment step held for `--env-ms`
//! milliseconds as a sandboxed tool call or test run would be, run once per
//! `--env-workers` setting. With environment steps inline the engine waits
//! for every one of them in turn, so the wall time is about generation plus
//! the sum of all tool times; with worker threads the steps overlap each
//! other and the decoding of the other episodes, and the wall time
//! approaches max(generation, the slowest episode's tool time) as the
//! workers cover the episodes in flight. Prints one row per setting
//! (`--json`: one JSON object per line).

use std::time::Duration;

use anyhow::Result;
use arbor_engine::{Engine, EngineConfig};
use arbor_train::config::ModelSpec;
use arbor_train::learner::{Learner, LearnerConfig};
use arbor_train::optim::AdamWConfig;
use arbor_train::rollout::{run_episodes, StepOut, TaskInstance, TokenEpisode};
use arbor_train::tasks::{TaskConfig, TaskSampler};
use arbor_train::TrainError;
use candle_core::Device;
use clap::Args;

#[derive(Debug, Args)]
pub struct RolloutBenchArgs {
    /// Tasks (each episode is one running-sum task).
    #[arg(long, default_value_t = 8)]
    pub tasks: usize,
    /// Episodes per task.
    #[arg(long, default_value_t = 8)]
    pub samples: usize,
    /// Digits per task (= environment steps per episode).
    #[arg(long, default_value_t = 5)]
    pub difficulty: usize,
    /// Milliseconds each environment step takes.
    #[arg(long, default_value_t = 20)]
    pub env_ms: u64,
    /// Comma-separated environment worker counts to compare (0: inline).
    #[arg(long, default_value = "0,8,64", value_delimiter = ',')]
    pub env_workers: Vec<usize>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// One JSON object per setting instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// An episode whose every step takes `delay` first.
struct Slow {
    inner: Box<dyn TokenEpisode>,
    delay: Duration,
}

impl TokenEpisode for Slow {
    fn step(&mut self, action: &[u32]) -> Result<StepOut, TrainError> {
        std::thread::sleep(self.delay);
        self.inner.step(action)
    }
    fn fork(&self) -> Result<Box<dyn TokenEpisode>, TrainError> {
        Ok(Box::new(Slow {
            inner: self.inner.fork()?,
            delay: self.delay,
        }))
    }
}

pub fn run(a: RolloutBenchArgs) -> Result<()> {
    let sampler = TaskSampler::new(
        TaskConfig::RunningSum {
            difficulty: a.difficulty,
            one_turn: false,
            stop_at_error: false,
        },
        a.seed,
        None,
        Vec::new(),
    )?;
    let mcfg = ModelSpec::default().config(sampler.vocab_size());
    let learner = Learner::new(
        &mcfg,
        None,
        None,
        a.seed,
        &Device::Cpu,
        LearnerConfig::default(),
        AdamWConfig::default(),
        None,
    )?;
    let cfg = sampler.rollout_config(1.0);
    let delay = Duration::from_millis(a.env_ms);
    if !a.json {
        println!(
            "{} episodes x {} environment steps of {} ms (serial tool time {:.2} s)",
            a.tasks * a.samples,
            a.difficulty,
            a.env_ms,
            (a.tasks * a.samples * a.difficulty) as f64 * a.env_ms as f64 / 1000.0
        );
        println!("| env_workers | wall s | engine s | environment s (summed) | engine idle s | generated tokens |");
        println!("|---|---|---|---|---|---|");
    }
    for &workers in &a.env_workers {
        let mut engine = Engine::new(&learner.model.policy, None, EngineConfig::default())?;
        let mut tasks = Vec::with_capacity(a.tasks * a.samples);
        for i in 0..a.tasks as u64 {
            let t = sampler.train_task(i)?;
            for _ in 0..a.samples {
                tasks.push(TaskInstance {
                    id: t.id.clone(),
                    prompt: t.prompt.clone(),
                    episode: Box::new(Slow {
                        inner: t.episode.fork()?,
                        delay,
                    }),
                });
            }
        }
        let (_, s) = run_episodes(&mut engine, tasks, &cfg, a.seed, workers)?;
        if a.json {
            println!(
                "{}",
                serde_json::json!({
                    "env_workers": workers,
                    "episodes": s.episodes,
                    "env_ms": a.env_ms,
                    "wall_s": s.rollout_s,
                    "generate_s": s.generate_s,
                    "env_s": s.env_s,
                    "engine_idle_s": s.engine_idle_s,
                    "generated_tokens": s.generated_tokens,
                })
            );
        } else {
            println!(
                "| {workers} | {:.2} | {:.2} | {:.2} | {:.2} | {} |",
                s.rollout_s, s.generate_s, s.env_s, s.engine_idle_s, s.generated_tokens
            );
        }
    }
    Ok(())
}
