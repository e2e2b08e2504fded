//! The critic probe: can this critic rank the task's states at all, given
//! the best targets it could get?
//!
//! FOCUS's allocation and its advantages are only as good as the critic.
//! During RL the critic sees each state's value through one or a few noisy
//! outcomes while the policy moves; the probe takes that away. It freezes
//! the policy, samples states on fixed trajectories with `k` Monte-Carlo
//! continuations each (a training set from training tasks, a test set from
//! held-out tasks), then fits the critic by plain regression, epoch after
//! epoch, and scores it on the test states:
//!
//! - explained variance and Spearman rank correlation of the critic's
//!   values against the test states' Monte-Carlo values;
//! - the noise ceiling of that rank correlation: a perfect critic cannot
//!   correlate with a `k`-sample estimate better than the estimate's
//!   reliability allows. The split-half rank correlation `r` (the first
//!   half of each state's continuations against the second) stepped up by
//!   Spearman-Brown to the full estimate's `n` samples gives the
//!   reliability `rel = f r / (1 + (f - 1) r)`, `f = n / (k / 2)`, and the
//!   ceiling `sqrt(rel)`;
//! - a depth-only baseline: each test state valued at the training states'
//!   mean Monte-Carlo value at its depth. A critic that does not beat it
//!   has learnt nothing about the state itself;
//! - surprise-only baselines: each test state ranked by minus the number
//!   of tokens on its path the policy sampled below each threshold of
//!   [`SURPRISE_NATS`] (what `[critic] surprise` feeds the value head). A
//!   critic with the features that does not beat them has learnt nothing
//!   from the tokens beyond the counts.
//!
//! Targets are either the Monte-Carlo means (`monte_carlo`: the best case)
//! or the trajectory's own 0/1 outcome (`outcome`: what a `lambda = 1`
//! critic sees during RL, one sample per state).
//!
//! The probe changes the learner's critic and its optimizer (moments, step
//! count, the critic group's learning rate and clip); with a shared critic
//! the fit moves the policy's trunk too. Run it on a trainer built for it.

use serde::{Deserialize, Serialize};

use arbor_rl::credit::LossRow;
use arbor_rl::diagnostics::{explained_variance, spearman};

use crate::learner::{surprise_features, ValueRow, SURPRISE_NATS};
use crate::optim::AdamWConfig;
use crate::rollout::heldout::{critic_vs_states, sample_states, split_half, StateSample};
use crate::rollout::sched::{mix64, shuffle};
use crate::trainer::Trainer;
use crate::TrainError;

/// What the probe's critic regresses onto.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProbeTarget {
    /// Each state's Monte-Carlo mean (trajectory and `k` continuations).
    MonteCarlo,
    /// The trajectory's own outcome, 0 or 1.
    Outcome,
}

/// Settings of [`Trainer::critic_probe`].
#[derive(Clone, Debug, Serialize)]
pub struct ProbeOptions {
    /// Training tasks (one trajectory each) and held-out test tasks.
    pub train_tasks: usize,
    pub test_tasks: usize,
    /// Monte-Carlo continuations per state, `k`.
    pub samples: usize,
    /// Passes over the training states.
    pub epochs: usize,
    /// States per optimizer step.
    pub batch_states: usize,
    pub target: ProbeTarget,
    /// The critic's learning rate (constant, AdamW) and gradient clip.
    pub lr: f64,
    pub grad_clip: f64,
    /// Score every this many epochs (and after the last).
    pub eval_every: usize,
    /// Copy the policy's backbone into a separate critic first.
    pub init_from_policy: bool,
    /// Seed of the sampling and of the batch order.
    pub seed: u64,
}

impl Default for ProbeOptions {
    fn default() -> Self {
        ProbeOptions {
            train_tasks: 256,
            test_tasks: 64,
            samples: 16,
            epochs: 40,
            batch_states: 128,
            target: ProbeTarget::MonteCarlo,
            lr: 3e-3,
            grad_clip: 1.0,
            eval_every: 5,
            init_from_policy: true,
            seed: 0,
        }
    }
}

/// The critic's scores after one epoch (`epoch = 0`: before fitting).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ProbeEpoch {
    pub epoch: usize,
    /// Mean value loss of the epoch's steps (0 before fitting).
    pub value_loss: f64,
    pub train_ev: Option<f64>,
    pub train_rank: Option<f64>,
    pub test_ev: Option<f64>,
    pub test_rank: Option<f64>,
}

/// [`Trainer::critic_probe`]'s result.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ProbeReport {
    pub train_states: usize,
    pub test_states: usize,
    /// Mean and standard deviation of the test states' Monte-Carlo values.
    pub test_value_mean: f64,
    pub test_value_std: f64,
    /// Split-half rank correlation of the test states' Monte-Carlo values
    /// and the ceiling it implies for any critic (module docs).
    pub split_half_rank: Option<f64>,
    pub rank_ceiling: Option<f64>,
    /// The depth-only baseline on the test states.
    pub depth_baseline_ev: Option<f64>,
    pub depth_baseline_rank: Option<f64>,
    /// The rank correlation of each surprise count alone with the test
    /// states' Monte-Carlo values, one per threshold of [`SURPRISE_NATS`]
    /// (module docs): how far the critic could rank from the features it
    /// reads, with no trunk at all.
    #[serde(default)]
    pub surprise_baseline_rank: Vec<Option<f64>>,
    /// Scores before fitting and every `eval_every` epochs.
    pub curve: Vec<ProbeEpoch>,
    pub sample_seconds: f64,
    pub fit_seconds: f64,
}

impl ProbeReport {
    /// The epoch with the best test rank correlation.
    pub fn best(&self) -> Option<&ProbeEpoch> {
        self.curve
            .iter()
            .filter(|e| e.test_rank.is_some())
            .max_by(|a, b| a.test_rank.partial_cmp(&b.test_rank).expect("finite"))
    }
}

/// Each test state valued at the training states' mean Monte-Carlo value
/// at its depth (the overall mean for a depth never seen): `(value, MC)`.
fn depth_baseline(train: &[StateSample], test: &[StateSample]) -> Vec<(f64, f64)> {
    let mut by_depth: Vec<(f64, usize)> = Vec::new();
    for s in train {
        if by_depth.len() <= s.depth {
            by_depth.resize(s.depth + 1, (0.0, 0));
        }
        by_depth[s.depth].0 += s.monte_carlo();
        by_depth[s.depth].1 += 1;
    }
    let all = train.iter().map(StateSample::monte_carlo).sum::<f64>() / train.len().max(1) as f64;
    test.iter()
        .map(|s| {
            let v = match by_depth.get(s.depth) {
                Some(&(sum, n)) if n > 0 => sum / n as f64,
                _ => all,
            };
            (v, s.monte_carlo())
        })
        .collect()
}

/// Per threshold `c` of [`SURPRISE_NATS`], the rank correlation of minus
/// the state's [`surprise_features`] at its last token (a monotone
/// function of `#{tokens on the path sampled at a logprob below -c}`)
/// with the states' Monte-Carlo values: the features alone as a critic.
fn surprise_baseline(states: &[StateSample]) -> Vec<Option<f64>> {
    let feats: Vec<Vec<f32>> = states
        .iter()
        .map(|s| surprise_features(&s.logprobs, 1))
        .collect();
    (0..SURPRISE_NATS.len())
        .map(|k| {
            let pairs: Vec<(f64, f64)> = states
                .iter()
                .zip(&feats)
                .map(|(s, f)| (-f64::from(f[k]), s.monte_carlo()))
                .collect();
            spearman(&pairs)
        })
        .collect()
}

/// One value-only loss row per state: the state's context, its target at
/// the last token, nothing else trained.
fn value_rows(states: &[StateSample], target: ProbeTarget) -> Vec<LossRow> {
    states
        .iter()
        .filter(|s| !s.context.is_empty())
        .map(|s| {
            let t = match target {
                ProbeTarget::MonteCarlo => s.monte_carlo(),
                ProbeTarget::Outcome => s.outcomes[0],
            };
            ValueRow {
                tokens: s.context.clone(),
                value_targets: vec![(s.context.len() - 1, t as f32)],
                logprobs: s.logprobs.clone(),
            }
            .to_loss_row()
        })
        .collect()
}

impl Trainer {
    /// Freeze the policy, sample states with Monte-Carlo values, fit the
    /// critic on the training states and score it on the held-out ones
    /// (module docs). Changes the critic.
    pub fn critic_probe(&mut self, o: &ProbeOptions) -> Result<ProbeReport, TrainError> {
        if o.train_tasks == 0 || o.test_tasks == 0 || o.samples == 0 {
            return Err(TrainError::Config(
                "critic probe: train tasks, test tasks and samples must be >= 1".into(),
            ));
        }
        let t0 = std::time::Instant::now();
        let rollout = self.sampler().rollout_config(self.cfg.temperature);
        let train_tasks = (0..o.train_tasks as u64)
            .map(|i| self.sampler().train_task(3_000_000_000 + i))
            .collect::<Result<Vec<_>, _>>()?;
        let n_test = self
            .sampler()
            .eval_len()
            .map_or(o.test_tasks, |l| l.min(o.test_tasks));
        let test_tasks = (0..n_test as u64)
            .map(|i| self.sampler().eval_task(i))
            .collect::<Result<Vec<_>, _>>()?;
        let mut engine = self.engine()?;
        let workers = self.cfg.env_workers;
        let train = sample_states(
            &mut engine,
            train_tasks,
            &rollout,
            o.samples,
            mix64(o.seed ^ 0x7072_6F62_6531),
            workers,
        )?;
        let test = sample_states(
            &mut engine,
            test_tasks,
            &rollout,
            o.samples,
            mix64(o.seed ^ 0x7072_6F62_6532),
            workers,
        )?;
        drop(engine);
        let sample_seconds = t0.elapsed().as_secs_f64();

        let mc: Vec<f64> = test.iter().map(StateSample::monte_carlo).collect();
        let mean = mc.iter().sum::<f64>() / mc.len().max(1) as f64;
        let std =
            (mc.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / mc.len().max(1) as f64).sqrt();
        let (split_half_rank, rank_ceiling) = split_half(&test, o.samples);
        let base = depth_baseline(&train, &test);

        let t1 = std::time::Instant::now();
        if o.init_from_policy {
            self.learner.init_critic_from_policy()?;
        }
        let saved = (self.learner.opt.cfg, self.learner.cfg.epochs);
        self.learner.opt.reset(AdamWConfig {
            lr: o.lr,
            warmup_steps: 0,
            total_steps: 0,
            grad_clip: o.grad_clip,
            ..saved.0
        })?;
        self.learner.set_critic_optimizer(o.lr, o.grad_clip);
        self.learner.cfg.epochs = 1;
        let rows = value_rows(&train, o.target);
        let score = |l: &crate::learner::Learner, epoch, value_loss| -> Result<_, TrainError> {
            let (tr, te) = (critic_vs_states(l, &train)?, critic_vs_states(l, &test)?);
            Ok(ProbeEpoch {
                epoch,
                value_loss,
                train_ev: explained_variance(&tr),
                train_rank: spearman(&tr),
                test_ev: explained_variance(&te),
                test_rank: spearman(&te),
            })
        };
        let mut curve = vec![score(&self.learner, 0, 0.0)?];
        let mut order: Vec<usize> = (0..rows.len()).collect();
        let mut rng = mix64(o.seed ^ 0x5348_5546);
        for epoch in 1..=o.epochs {
            shuffle(&mut order, &mut rng);
            let (mut loss, mut steps) = (0.0, 0);
            for chunk in order.chunks(o.batch_states.max(1)) {
                let batch: Vec<LossRow> = chunk.iter().map(|&i| rows[i].clone()).collect();
                let stats = self.learner.update_with(&batch, false)?;
                loss += stats.value_loss;
                steps += 1;
            }
            if epoch % o.eval_every.max(1) == 0 || epoch == o.epochs {
                curve.push(score(&self.learner, epoch, loss / steps.max(1) as f64)?);
            }
        }
        self.learner.opt.reset(saved.0)?;
        self.learner.cfg.epochs = saved.1;
        Ok(ProbeReport {
            train_states: train.len(),
            test_states: test.len(),
            test_value_mean: mean,
            test_value_std: std,
            split_half_rank,
            rank_ceiling,
            depth_baseline_ev: explained_variance(&base),
            depth_baseline_rank: spearman(&base),
            surprise_baseline_rank: surprise_baseline(&test),
            curve,
            sample_seconds,
            fit_seconds: t1.elapsed().as_secs_f64(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(depth: usize, outcomes: &[f64]) -> StateSample {
        StateSample {
            task: 0,
            depth,
            context: vec![1, 2, 3],
            outcomes: outcomes.to_vec(),
            logprobs: Vec::new(),
        }
    }

    #[test]
    fn the_depth_baseline_is_the_training_mean_per_depth() {
        let train = vec![
            state(0, &[1.0, 0.0]),
            state(0, &[1.0, 1.0]),
            state(1, &[0.0, 0.0]),
        ];
        let test = vec![state(0, &[1.0]), state(1, &[0.0]), state(2, &[1.0])];
        let b = depth_baseline(&train, &test);
        assert_eq!(b[0], (0.75, 1.0));
        assert_eq!(b[1], (0.0, 0.0));
        // Depth 2 was never seen: the overall mean, (0.5 + 1 + 0) / 3.
        assert!((b[2].0 - 0.5).abs() < 1e-12);
    }

    #[test]
    fn the_surprise_baseline_ranks_by_minus_the_unlikely_tokens() {
        let with = |logprobs: &[f32], outcomes: &[f64]| StateSample {
            logprobs: logprobs.to_vec(),
            ..state(1, outcomes)
        };
        // Values fall as the tokens below -0.5 nats rise: rank +1 at 0.5.
        let s = vec![
            with(&[0.0, -0.1], &[1.0]),
            with(&[-0.7, -0.1], &[0.5]),
            with(&[-0.7, -1.5], &[0.0]),
        ];
        let b = surprise_baseline(&s);
        assert_eq!(b.len(), SURPRISE_NATS.len());
        assert!((b[0].unwrap() - 1.0).abs() < 1e-12);
        // At 2 nats no state has a count: no ranking.
        assert_eq!(b[2], spearman(&[(0.0, 1.0), (0.0, 0.5), (0.0, 0.0)]));
    }

    #[test]
    fn value_rows_train_only_the_last_tokens_value() {
        let s = vec![state(1, &[0.0, 1.0, 1.0, 1.0])];
        let r = value_rows(&s, ProbeTarget::MonteCarlo);
        assert_eq!(r[0].tokens, vec![1, 2, 3]);
        assert!(r[0].mask.iter().all(|&m| m == 0.0));
        assert_eq!(r[0].value_targets, vec![(2, 0.75)]);
        let r = value_rows(&s, ProbeTarget::Outcome);
        assert_eq!(r[0].value_targets, vec![(2, 0.0)]);
    }
}
