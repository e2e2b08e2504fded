//! The step loop: warm-up, then for each RL step draw tasks, generate and
//! credit rollouts with the configured [`RolloutPolicy`], update, evaluate,
//! log and checkpoint.

use std::path::{Path, PathBuf};
use std::time::Instant;

use arbor_engine::{Engine, EngineConfig};
use arbor_model::{Checkpoint, ModelConfig};

use crate::checkpoint::{self, TrainerState};
use crate::config::{parse_device, TrainConfig};
use crate::learner::Learner;
use crate::metrics::{spearman, MetricsLog, StepMetrics, Summary};
use crate::rollout::{evaluate, policy_for, RolloutPolicy, StepContext};
use crate::tasks::TaskSampler;
use crate::TrainError;

/// The trainer.
pub struct Trainer {
    pub cfg: TrainConfig,
    pub out_dir: PathBuf,
    pub learner: Learner,
    sampler: TaskSampler,
    state: TrainerState,
    policy: Box<dyn RolloutPolicy>,
    engine_cfg: EngineConfig,
    metrics: MetricsLog,
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
            checkpoint::latest(out_dir)
        } else {
            None
        };
        if resume && latest.is_none() {
            tracing::warn!(
                "--resume: no checkpoint in {}, starting fresh",
                out_dir.display()
            );
        }
        let metrics = MetricsLog::new(out_dir);
        let mut policy = policy_for(&cfg);
        let (learner, state) = match latest {
            Some((_, dir)) => {
                let (learner, state, policy_state) =
                    checkpoint::restore(&dir, &cfg, &mcfg, hf_ckpt.as_ref(), &dev, ocfg)?;
                policy.restore(&policy_state)?;
                // Metrics after the checkpoint were not kept in the weights: drop them.
                metrics.truncate(state.step)?;
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
                metrics.clear()?;
                (learner, TrainerState::fresh(cfg.seed))
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
            policy,
            engine_cfg,
            metrics,
        })
    }

    /// RL steps already done (after a resume, where it continues from).
    pub fn step(&self) -> u64 {
        self.state.step
    }

    /// Greedy pass rate on the held-out tasks.
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
        let mut all = self.metrics.read()?;
        while self.state.step < self.cfg.steps {
            let m = self.rl_step(&mut engine)?;
            self.metrics.append(&m)?;
            on_step(&m);
            all.push(m);
            let every = self.cfg.checkpoint_every;
            let step = self.state.step;
            if (every > 0 && step.is_multiple_of(every)) || step == self.cfg.steps {
                self.checkpoint()?;
            }
        }
        Ok(Summary::of(
            &all,
            self.cfg.algo,
            self.state.step,
            self.state.warmup_nll.last().copied(),
            self.state.initial_eval.unwrap_or(0.0),
            start.elapsed().as_secs_f64(),
            &self.out_dir,
        ))
    }

    /// One RL step: tasks, rollouts and credit, the update, evaluation.
    fn rl_step(&mut self, engine: &mut Engine) -> Result<StepMetrics, TrainError> {
        let step = self.state.step + 1;
        // Every step starts from an empty cache: a resumed run (fresh
        // engine) then computes exactly what an uninterrupted one does.
        // The weights are those of the last `invalidate` (or of the
        // engine's start), so they need no repack.
        engine.forget_cached_kv();
        let n_tasks = self.policy.tasks_per_step();
        let tasks = (0..n_tasks as u64)
            .map(|i| self.sampler.train_task(self.state.cursor + i))
            .collect::<Result<Vec<_>, _>>()?;
        self.state.cursor += n_tasks as u64;
        let rollout = self.sampler.rollout_config(self.cfg.temperature);
        let mut seed = self.state.seed_counter;
        let ctx = StepContext {
            engine: &mut *engine,
            learner: &self.learner,
            rollout: &rollout,
            seed: &mut seed,
            step,
        };
        let r = self.policy.rollouts(ctx, tasks)?;
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
            Some(self.eval(engine)?)
        } else {
            None
        };
        let n = r.rewards.len().max(1) as f64;
        Ok(StepMetrics {
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
        })
    }

    /// Write `checkpoints/step-N` atomically: everything goes into a
    /// temporary directory, each file fsynced, then one rename. Keeps the
    /// last `keep_last`.
    pub fn checkpoint(&self) -> Result<PathBuf, TrainError> {
        checkpoint::write(
            &self.out_dir,
            &self.learner,
            &self.state,
            &self.policy.state(),
            self.cfg.model.lora.is_some(),
            self.cfg.keep_last,
        )
    }
}
