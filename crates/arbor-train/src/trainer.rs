//! The step loop: warm-up, then for each RL step draw tasks, generate and
//! credit rollouts with the configured [`RolloutPolicy`], update, evaluate,
//! log and checkpoint.

use std::path::{Path, PathBuf};
use std::time::Instant;

use arbor_engine::{Engine, EngineConfig};
use arbor_model::{Checkpoint, ModelConfig};

use crate::checkpoint::{self, TrainerState};
use crate::config::{parse_device, CriticInit, StepBudget, TrainConfig};
use crate::learner::Learner;
use crate::metrics::{MetricsLog, StepMetrics, Summary};
use crate::rollout::heldout::{critic_vs_monte_carlo, HeldoutCheck};
use crate::rollout::{policy_for, RolloutPolicy, StepContext};
use crate::tasks::TaskSampler;
use crate::TrainError;
use arbor_rl::diagnostics::{explained_variance, spearman};

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
    /// This rank's handle on its data-parallel group (a group of one by
    /// default).
    group: Box<dyn crate::dist::Collective>,
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
        Self::open(cfg, out_dir, resume, Box::new(crate::dist::Single))
    }

    /// [`Trainer::new`] as one rank of a data-parallel `group`: each step's
    /// tasks are split between the ranks by index, each rank generates its
    /// share on its own engine, and the update sums the ranks' gradients
    /// ([`Learner::update_in_group`]), so every rank holds the same weights
    /// and the run matches one rank doing all the work up to f32 round-off.
    /// Sampling seeds follow the global launch order, never the rank. Rank
    /// 0 writes the metrics and checkpoints; the other ranks write nothing
    /// in `out_dir` and read the checkpoint they resume from there. Every
    /// rank must be built from the same config and run the same warm-up.
    /// FOCUS, VinePPO and Prefix Sampling make their step-wide decisions
    /// over the whole group's tasks (see
    /// [`crate::rollout::RolloutPolicy::spans_ranks`]).
    pub fn open(
        cfg: TrainConfig,
        out_dir: &Path,
        resume: bool,
        group: Box<dyn crate::dist::Collective>,
    ) -> Result<Self, TrainError> {
        let writer = group.rank() == 0;
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
        let sampler = TaskSampler::with_harness(
            cfg.task.clone(),
            cfg.seed.wrapping_mul(1_000_003),
            tokenizer,
            eos,
            cfg.harness,
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
        // A group that sums device buffers (NCCL) sets up on this device.
        let mut group = group;
        group.bind_device(&dev)?;
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
        let (mut learner, state) = match latest {
            Some((_, dir)) => {
                let (learner, state, policy_state) =
                    checkpoint::restore(&dir, &cfg, &mcfg, hf_ckpt.as_ref(), &dev, ocfg)?;
                policy.restore(&policy_state)?;
                // Metrics after the checkpoint were not kept in the weights: drop them.
                if writer {
                    metrics.truncate(state.step)?;
                }
                (learner, state)
            }
            None => {
                let learner = Learner::new(
                    &mcfg,
                    hf_ckpt.as_ref(),
                    None,
                    cfg.seed,
                    &dev,
                    cfg.learner_config(),
                    ocfg,
                    cfg.model.lora.as_ref(),
                )?;
                if writer {
                    metrics.clear()?;
                }
                (learner, TrainerState::fresh(cfg.seed))
            }
        };
        if cfg.algo.has_critic() {
            learner.set_critic_optimizer(
                cfg.critic.lr.unwrap_or(ocfg.lr),
                cfg.critic.grad_clip.unwrap_or(ocfg.grad_clip),
            );
        }
        let engine_cfg = EngineConfig {
            kv_memory_mib: cfg.kv_memory_mib,
            max_seqs: 1024,
            max_batch_tokens: 8192,
            bf16_rollouts: cfg.bf16_rollouts,
            ..Default::default()
        };
        if writer {
            std::fs::write(
                out_dir.join("config.json"),
                serde_json::to_vec_pretty(&cfg).map_err(|e| TrainError::Config(e.to_string()))?,
            )?;
        }
        Ok(Trainer {
            cfg,
            out_dir: out_dir.to_path_buf(),
            learner,
            sampler,
            state,
            policy,
            engine_cfg,
            metrics,
            group,
        })
    }

    /// RL steps already done (after a resume, where it continues from).
    pub fn step(&self) -> u64 {
        self.state.step
    }

    /// The run's tasks.
    pub fn sampler(&self) -> &TaskSampler {
        &self.sampler
    }

    /// Greedy pass rate of the current policy on the held-out tasks.
    pub fn eval_pass_rate(&self) -> Result<f64, TrainError> {
        self.eval(&mut self.engine()?)
    }

    /// A generation engine over the learner's current policy.
    pub fn engine(&self) -> Result<Engine, TrainError> {
        Ok(Engine::new(
            &self.learner.model.policy,
            None,
            self.engine_cfg.clone(),
        )?)
    }

    /// Greedy pass rate on the held-out tasks.
    fn eval(&self, engine: &mut Engine) -> Result<f64, TrainError> {
        Ok(self.eval_with_context(engine)?.0)
    }

    /// [`Trainer::eval`] with the greedy episodes' context management
    /// (bounded contexts).
    fn eval_with_context(
        &self,
        engine: &mut Engine,
    ) -> Result<(f64, Option<crate::metrics::ContextMetrics>), TrainError> {
        let tasks = self.eval_tasks(self.cfg.eval_tasks)?;
        crate::rollout::eval::evaluate_with_context(
            engine,
            tasks,
            &self.sampler.rollout_config(0.0),
            self.cfg.env_workers,
        )
    }

    /// The first `n` held-out tasks (capped by a dataset's size).
    fn eval_tasks(&self, n: usize) -> Result<Vec<crate::rollout::TaskInstance>, TrainError> {
        let n = self.sampler.eval_len().map_or(n, |l| l.min(n));
        (0..n as u64).map(|i| self.sampler.eval_task(i)).collect()
    }

    /// The critic against Monte-Carlo values on held-out states
    /// (`[critic] heldout_tasks`).
    fn critic_heldout(&self, engine: &mut Engine, step: u64) -> Result<HeldoutCheck, TrainError> {
        let c = self.cfg.critic;
        let tasks = self.eval_tasks(c.heldout_tasks)?;
        let seed = crate::rollout::sched::mix64(self.cfg.seed ^ 0xC817_D1A6 ^ step.rotate_left(32));
        critic_vs_monte_carlo(
            engine,
            &self.learner,
            tasks,
            &self.sampler.rollout_config(self.cfg.temperature),
            c.heldout_samples,
            seed,
            self.cfg.env_workers,
        )
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
                .collect::<Result<Vec<_>, _>>()?
                .concat();
            let (nll, _) = self.learner.sft_step(&rows)?;
            self.state.warmup_nll.push(nll);
            progress(s + 1, nll);
            if let Some(target) = w.stop_at_eval {
                if (s + 1).is_multiple_of(w.check_every.max(1)) {
                    let mut engine = self.engine()?;
                    if self.eval(&mut engine)? >= target {
                        break;
                    }
                }
            }
        }
        // The RL optimizer starts fresh after the warm-up.
        self.learner.opt.reset(main_lr)?;
        Ok(())
    }

    /// Run the remaining RL steps; `on_step` sees each step's metrics.
    pub fn run(&mut self, mut on_step: impl FnMut(&StepMetrics)) -> Result<Summary, TrainError> {
        let start = Instant::now();
        if self.cfg.optimizer.shard_state && !self.learner.opt.is_sharded() {
            // ZeRO-1 after the warm-up (which every rank runs whole).
            let (rank, world) = (self.group.rank(), self.group.world());
            self.learner.opt.shard(rank, world)?;
        }
        if self.state.step == 0 && self.cfg.critic.init == CriticInit::Policy {
            // After the warm-up: the critic starts from the policy it judges.
            let n = self.learner.init_critic_from_policy()?;
            if n > 0 {
                tracing::info!("critic initialised from the policy ({n} tensors)");
            }
        }
        let mut engine = self.engine()?;
        if self.state.initial_eval.is_none() {
            let (e, c) = self.eval_with_context(&mut engine)?;
            self.state.initial_eval = Some(e);
            self.state.initial_eval_context = c;
        }
        let mut all = self.metrics.read()?;
        while self.state.step < self.cfg.steps {
            let m = self.rl_step(&mut engine)?;
            // Rank 0 writes; every rank holds the same weights and state.
            let writer = self.group.rank() == 0;
            if writer {
                self.metrics.append(&m)?;
            }
            on_step(&m);
            all.push(m);
            let every = self.cfg.checkpoint_every;
            let step = self.state.step;
            if (every > 0 && step.is_multiple_of(every)) || step == self.cfg.steps {
                // Every rank takes part (a sharded optimizer's state is
                // gathered); rank 0 writes.
                let (opt, _) = self.learner.opt.gathered_state(self.group.as_mut())?;
                if writer {
                    self.write_checkpoint(opt)?;
                }
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
        )
        .with_initial_context(self.state.initial_eval_context.clone()))
    }

    /// Checks that every rank of the group holds the same trainable weights
    /// (a hash of their bytes, gathered): an error naming the first rank
    /// that differs from rank 0. The trainer runs it on every evaluation
    /// step of a data-parallel run; drift would mean the ranks applied
    /// different updates.
    pub fn check_weights_agree(&mut self) -> Result<(), TrainError> {
        use std::hash::Hasher;
        // `DefaultHasher::new` has fixed keys: the same hash in every
        // process of this build.
        let mut h = std::hash::DefaultHasher::new();
        for (name, v) in self.learner.opt.vars() {
            h.write(name.as_bytes());
            let x = v
                .as_tensor()
                .to_dtype(candle_core::DType::F32)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            for f in x {
                h.write_u32(f.to_bits());
            }
        }
        let hashes = self.group.all_gather(&h.finish().to_le_bytes())?;
        if let Some(r) = hashes.iter().position(|x| x != &hashes[0]) {
            return Err(crate::dist::DistError::Mismatch {
                rank: self.group.rank(),
                msg: format!(
                    "rank {r}'s weights differ from rank 0's after step {}",
                    self.state.step
                ),
            }
            .into());
        }
        Ok(())
    }

    /// The whole step's rollout statistics on every rank: counts summed,
    /// rewards gathered in rank order, the effective-group share over all
    /// `groups` (this rank's task groups). A policy that spans the ranks
    /// (`replicated`) already holds the whole step's tree, rewards and
    /// groups on every rank: only what each rank's engine and environments
    /// counted is summed.
    fn reduce_rollouts(
        &mut self,
        r: &mut crate::rollout::StepRollouts,
        groups: usize,
        replicated: bool,
    ) -> Result<(), TrainError> {
        let s = &mut r.stats;
        let mut c = [
            s.continuations as f64,
            s.generated_tokens as f64,
            s.replayed_tokens as f64,
            s.prefill_computed as f64,
            s.prefill_cached as f64,
            s.finished_episodes as f64,
            s.tool_calls as f64,
            s.episodes as f64,
            r.effective_groups as f64,
            groups as f64,
        ];
        // The first seven are what each rank's own engine and environments
        // counted; the rest are whole-step values where `replicated`.
        let summed = if replicated { 7 } else { c.len() };
        self.group.all_reduce_sum_f64(&mut c[..summed])?;
        (s.continuations, s.generated_tokens) = (c[0] as usize, c[1] as u64);
        (s.replayed_tokens, s.prefill_computed) = (c[2] as u64, c[3] as u64);
        (s.prefill_cached, s.finished_episodes) = (c[4] as u64, c[5] as u64);
        s.tool_calls = c[6] as u64;
        let mut ctx = s.context.counts().map(|x| x as f64);
        self.group.all_reduce_sum_f64(&mut ctx)?;
        s.context = arbor_env::context::ContextStats::from_counts(ctx.map(|x| x as u64));
        if replicated {
            return Ok(());
        }
        s.episodes = c[7] as usize;
        r.effective_groups = c[8] as usize;
        r.effective_group_fraction = c[8] / c[9].max(1.0);
        r.rewards = self.group.all_gather_f64(&r.rewards)?;
        // The critic's (value, target) pairs of every rank (PPO).
        let flat: Vec<f64> = r
            .critic_vs_target
            .iter()
            .flat_map(|&(v, g)| [v, g])
            .collect();
        r.critic_vs_target = self
            .group
            .all_gather_f64(&flat)?
            .chunks_exact(2)
            .map(|p| (p[0], p[1]))
            .collect();
        Ok(())
    }

    /// The value targets of the step's loss `rows`, the whole group's on
    /// every rank, in one rank's order: rank after rank (each holds a
    /// slice of the step's tasks), or by leaf when a policy that spans the
    /// ranks grew one tree on all of them (there one rank lists its rows
    /// by leaf).
    fn step_value_rows(
        &mut self,
        rows: &[arbor_rl::credit::LossRow],
        spans: bool,
    ) -> Result<Vec<crate::learner::ValueRow>, TrainError> {
        use crate::learner::ValueRow;
        // The logprobs only where the critic reads them (they are kept in
        // the replay and its checkpoints).
        let surprise = self.learner.surprise.is_some();
        let mine: Vec<(u32, ValueRow)> = rows
            .iter()
            .filter_map(|r| ValueRow::of(r, surprise).map(|v| (r.leaf.0, v)))
            .collect();
        if self.group.world() == 1 {
            return Ok(mine.into_iter().map(|(_, v)| v).collect());
        }
        let mut all: Vec<(u32, ValueRow)> =
            crate::dist::all_gather_items(self.group.as_mut(), &mine)?
                .into_iter()
                .flatten()
                .collect();
        if spans {
            all.sort_by_key(|(leaf, _)| *leaf);
        }
        Ok(all.into_iter().map(|(_, v)| v).collect())
    }

    /// One RL step: tasks, rollouts and credit, the update, evaluation.
    fn rl_step(&mut self, engine: &mut Engine) -> Result<StepMetrics, TrainError> {
        let step = self.state.step + 1;
        // Every step starts from an empty cache: a resumed run (fresh
        // engine) then computes exactly what an uninterrupted one does.
        // The weights are those of the last `invalidate` (or of the
        // engine's start), so they need no repack.
        engine.forget_cached_kv();
        let budget_tokens = match self.cfg.budget {
            Some(StepBudget::Tokens(n)) => Some((n as i64 + self.state.budget_carry).max(1) as u64),
            _ => None,
        };
        let n_tasks = match (budget_tokens, self.state.tokens_per_task) {
            (Some(b), Some(per)) => self.policy.tasks_for_budget(b, per),
            _ => self.policy.tasks_per_step(),
        };
        // This rank's share of the tasks, by index; a policy that spans the
        // ranks gets every task and runs this share.
        let (rank, world) = (self.group.rank(), self.group.world());
        let mine = crate::rollout::span::share(n_tasks, rank, world);
        let (lo, hi) = (mine.start, mine.end);
        let spans = self.policy.spans_ranks();
        let (drawn, owned) = match spans {
            true => (0..n_tasks, lo..hi),
            false => (lo..hi, 0..hi - lo),
        };
        let tasks = drawn
            .map(|i| self.sampler.train_task(self.state.cursor + i as u64))
            .collect::<Result<Vec<_>, _>>()?;
        self.state.cursor += n_tasks as u64;
        let mut rollout = self.sampler.rollout_config(self.cfg.temperature);
        if self.cfg.algo == crate::config::Algo::Ps
            && self.cfg.ps.cut == crate::config::PsCut::Lines
        {
            rollout.line_ends = self.sampler.line_ends();
        }
        // GRPO and PPO launch `samples_per_prompt` continuations per task in
        // task order: this rank's first launch is number `lo * n` of the
        // step. (The counter wraps, as the scheduler's seeds do.) A policy
        // that spans the ranks numbers the group's launches itself.
        let offset = match spans {
            true => 0,
            false => (lo * self.cfg.samples_per_prompt) as u64,
        };
        let first = self.state.seed_counter.wrapping_add(offset);
        let mut seed = first;
        let ctx = StepContext {
            engine: &mut *engine,
            learner: &self.learner,
            rollout: &rollout,
            seed: &mut seed,
            step,
            env_workers: self.cfg.env_workers,
            budget_tokens,
            group: self.group.as_mut(),
            owned,
        };
        let mut r = self.policy.rollouts(ctx, tasks)?;
        self.state.seed_counter = seed;
        if world > 1 && spans {
            self.reduce_rollouts(&mut r, hi - lo, true)?;
        } else if world > 1 {
            // The counter moves past every rank's launches, as one rank's
            // would (each scheduler adds its launches plus one).
            // A scheduler moves the counter by its launches plus one (a rank
            // with no task still ran one).
            let mut launches = [seed.wrapping_sub(first).wrapping_sub(1) as f64];
            self.group.all_reduce_sum_f64(&mut launches)?;
            let base = first.wrapping_sub(offset);
            self.state.seed_counter = base.wrapping_add(launches[0] as u64).wrapping_add(1);
            self.reduce_rollouts(&mut r, hi - lo, false)?;
        }
        if let (Some(StepBudget::Tokens(n)), Some(b)) = (self.cfg.budget, budget_tokens) {
            // What this step left or overspent, at most one budget either way.
            let carry = b as i64 - r.stats.generated_tokens as i64;
            self.state.budget_carry = carry.clamp(-(n as i64), n as i64);
            self.state.tokens_per_task = Some(
                r.tokens_per_task
                    .unwrap_or(r.stats.generated_tokens as f64 / n_tasks.max(1) as f64),
            );
        }
        let t0 = Instant::now();
        let policy_on = !self.cfg.algo.has_critic() || step > self.cfg.critic_warmup_steps;
        let u = self
            .learner
            .update_in_group(&r.rows, policy_on, self.group.as_mut())?;
        let critic_passes = self.cfg.critic.epochs;
        let critic_pass_loss = if self.cfg.algo.has_critic() && critic_passes > 0 {
            let seed =
                crate::rollout::sched::mix64(self.cfg.seed ^ 0xC817_0E90 ^ step.rotate_left(17));
            // The replayed steps' value targets, then this step's (the
            // whole group's, in the order one rank would hold them).
            let fresh = self.step_value_rows(&r.rows, spans)?;
            let rows: Vec<crate::learner::ValueRow> = self
                .state
                .critic_replay
                .iter()
                .flatten()
                .chain(&fresh)
                .cloned()
                .collect();
            let (loss, _) = self.learner.update_critic_in_group(
                &rows,
                critic_passes,
                self.cfg.critic.minibatches,
                seed,
                self.group.as_mut(),
            )?;
            let keep = self.cfg.critic.replay_steps;
            if keep > 0 {
                self.state.critic_replay.push_back(fresh);
                while self.state.critic_replay.len() > keep {
                    self.state.critic_replay.pop_front();
                }
            }
            Some(loss)
        } else {
            None
        };
        let train_s = t0.elapsed().as_secs_f64();
        // The weights changed: no KV computed before may be reused.
        engine.invalidate();
        self.state.step = step;
        self.state.optimizer_step = self.learner.opt.steps_done();
        let group_steps = self.learner.opt.group_steps_done();
        self.state.critic_optimizer_step =
            (group_steps != self.state.optimizer_step).then_some(group_steps);
        let eval_step = step.is_multiple_of(self.cfg.eval_every) || step == self.cfg.steps;
        if eval_step && self.group.world() > 1 {
            self.check_weights_agree()?;
        }
        let (eval, eval_context) = if eval_step {
            let (e, c) = self.eval_with_context(engine)?;
            (Some(e), c)
        } else {
            (None, None)
        };
        let heldout =
            if eval_step && self.cfg.algo.has_critic() && self.cfg.critic.heldout_tasks > 0 {
                Some(self.critic_heldout(engine, step)?)
            } else {
                None
            };
        let alloc = r.allocation.as_ref();
        let n = r.rewards.len().max(1) as f64;
        Ok(StepMetrics {
            step,
            reward: r.rewards.iter().sum::<f64>() / n,
            pass_rate: r.rewards.iter().filter(|&&x| x >= 1.0).count() as f64 / n,
            effective_group_fraction: r.effective_group_fraction,
            effective_groups: r.effective_groups,
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
            eval_context,
            time_generate_s: r.stats.generate_s,
            time_env_s: r.stats.env_s,
            time_train_s: train_s,
            time_all_reduce_s: u.time_all_reduce_s,
            tool_calls_per_episode: r.stats.tool_calls as f64
                / r.stats.finished_episodes.max(1) as f64,
            context: self.cfg.harness.context_tokens.map(|_| {
                crate::metrics::ContextMetrics::new(&r.stats.context, r.stats.finished_episodes)
            }),
            budget_tokens: r.stats.budget_tokens,
            time_rollout_s: r.stats.rollout_s,
            time_engine_idle_s: r.stats.engine_idle_s,
            critic_grad_norm: u.critic_grad_norm,
            critic_lr: u.critic_lr,
            critic_pass_loss,
            critic_heldout_ev: heldout.as_ref().and_then(|h| explained_variance(&h.pairs)),
            critic_heldout_rank_corr: heldout.as_ref().and_then(|h| spearman(&h.pairs)),
            critic_heldout_states: heldout.as_ref().map(|h| h.pairs.len()),
            critic_heldout_rank_ceiling: heldout.as_ref().and_then(|h| h.rank_ceiling),
            alloc_mean_depth: alloc.map(|a| a.mean_depth),
            alloc_mean_n_eff: alloc.map(|a| a.mean_n_eff),
            alloc_settled_fraction: alloc.map(|a| a.settled_token_fraction),
            alloc_by_depth: alloc.map(|a| a.by_depth.clone()),
            alloc_by_score: alloc.map(|a| a.by_score.clone()),
            alloc_by_n_eff: alloc.map(|a| a.by_n_eff.clone()),
            ps: r.ps.clone(),
        })
    }

    /// Write `checkpoints/step-N` atomically: everything goes into a
    /// temporary directory, each file fsynced, then one rename. Keeps the
    /// last `keep_last`.
    pub fn checkpoint(&self) -> Result<PathBuf, TrainError> {
        if self.learner.opt.is_sharded() {
            return Err(TrainError::Checkpoint(
                "the optimizer is sharded across ranks: checkpoints are written by `run`, \
                 which gathers its state from every rank"
                    .into(),
            ));
        }
        self.write_checkpoint(self.learner.opt.state().0)
    }

    /// [`Trainer::checkpoint`] with the whole optimizer state `opt`.
    fn write_checkpoint(
        &self,
        opt: std::collections::HashMap<String, candle_core::Tensor>,
    ) -> Result<PathBuf, TrainError> {
        checkpoint::write(
            &self.out_dir,
            &self.learner,
            opt,
            &self.state,
            &self.policy.state(),
            self.cfg.model.lora.is_some(),
            self.cfg.keep_last,
        )
    }
}
