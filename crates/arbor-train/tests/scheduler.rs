//! The rollout scheduler and step budgets, through the trainer: environment
//! worker threads change when environments run, not what is sampled; a
//! token budget is held by every method over a run; FOCUS logs where its
//! budget went and how its critic ranks held-out states.

use arbor_train::{read_metrics, StepMetrics, TrainConfig, Trainer};

fn config(algo: &str, extra: &str) -> String {
    let critic = if algo == "focus" || algo == "ppo" {
        "separate"
    } else {
        "shared"
    };
    format!(
        r#"
seed = 4
steps = 4
algo = "{algo}"
prompts_per_step = 4
samples_per_prompt = 3
eval_every = 2
eval_tasks = 4
checkpoint_every = 0
{extra}

[task]
kind = "running_sum"
difficulty = 3

[warmup]
steps = 100
batch = 8

[learner]
critic = "{critic}"

[critic]
heldout_tasks = 3
heldout_samples = 2
"#
    )
}

fn train(toml: &str) -> Vec<StepMetrics> {
    let dir = tempfile::tempdir().unwrap();
    let cfg = TrainConfig::from_toml(toml, "test").unwrap();
    let mut t = Trainer::new(cfg, dir.path(), false).unwrap();
    t.warmup(|_, _| {}).unwrap();
    t.run(|_| {}).unwrap();
    read_metrics(&dir.path().join("metrics.jsonl")).unwrap()
}

/// Metrics without wall-clock fields.
fn untimed(ms: &[StepMetrics]) -> Vec<StepMetrics> {
    ms.iter()
        .map(|m| {
            let mut m = m.clone();
            m.time_generate_s = 0.0;
            m.time_env_s = 0.0;
            m.time_train_s = 0.0;
            m.time_rollout_s = 0.0;
            m.time_engine_idle_s = 0.0;
            m
        })
        .collect()
}

/// Sampling seeds come from (step, continuation, segment), not from the
/// order in which environments answer: with a fixed set of launches
/// (GRPO), a run with environment threads samples exactly what the inline
/// run samples (the engine's per-row results do not depend on which rows
/// share a batch on the CPU). Only the prefix cache's hits, which depend on
/// when each continuation comes back, may differ. (FOCUS and VinePPO decide
/// their next launches as continuations end, so with threads their
/// decisions follow the timing.)
#[test]
fn env_workers_change_timing_not_samples() {
    let inline = train(&config("grpo", ""));
    let threaded = train(&config("grpo", "env_workers = 3"));
    let strip = |ms: &[StepMetrics]| {
        untimed(ms)
            .into_iter()
            .map(|mut m| {
                m.prefill_computed = 0;
                m.prefill_cached = 0;
                m
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(strip(&inline), strip(&threaded));
    assert!(inline.iter().all(|m| m.time_rollout_s > 0.0));
    // FOCUS with threads still runs its whole budget.
    let focus = train(&config("focus", "env_workers = 3"));
    assert!(focus.iter().all(|m| m.continuations == 12), "{focus:?}");
}

/// With `budget = { tokens = N }`, FOCUS never spends more than a step's
/// budget (its leftover carries over), and every method's total over the
/// run stays within one budget of `steps * N`.
#[test]
fn token_budget_is_held_by_every_method() {
    let n = 150u64;
    for algo in ["focus", "grpo", "ps", "ppo", "vineppo"] {
        let ms = train(&config(algo, &format!("budget = {{ tokens = {n} }}")));
        let total: u64 = ms.iter().map(|m| m.generated_tokens).sum();
        let steps = ms.len() as u64;
        assert!(
            total.abs_diff(steps * n) <= n,
            "{algo}: {total} tokens over {steps} steps of {n}: {:?}",
            ms.iter().map(|m| m.generated_tokens).collect::<Vec<_>>()
        );
        if algo == "focus" {
            for m in &ms {
                let b = m.budget_tokens.expect("FOCUS reports its budget");
                assert!(m.generated_tokens <= b, "{m:?}");
            }
        }
    }
}

/// FOCUS's allocation diagnostics add up, and the held-out critic check
/// runs on evaluation steps only.
#[test]
fn focus_logs_allocation_and_heldout_critic() {
    let ms = train(&config("focus", ""));
    for m in &ms {
        let by_depth = m.alloc_by_depth.as_ref().unwrap();
        assert_eq!(by_depth.iter().sum::<u64>() as usize, m.continuations);
        assert_eq!(
            m.alloc_by_n_eff.as_ref().unwrap().iter().sum::<u64>() as usize,
            m.continuations
        );
        assert_eq!(
            m.alloc_by_score.as_ref().unwrap().iter().sum::<u64>() as usize,
            m.continuations
        );
        let f = m.alloc_settled_fraction.unwrap();
        assert!((0.0..=1.0).contains(&f));
        assert!(m.critic_grad_norm.is_some() && m.critic_lr.is_some());
        let scored = m.critic_heldout_states.is_some();
        assert_eq!(scored, m.eval_pass_rate.is_some(), "{m:?}");
        if scored {
            assert!(m.critic_heldout_states.unwrap() >= 3);
        } else {
            assert_eq!(m.critic_heldout_rank_ceiling, None);
        }
        if let Some(c) = m.critic_heldout_rank_ceiling {
            assert!((0.0..=1.0).contains(&c), "{c}");
        }
    }
}

/// An environment that panics on its first step.
struct Panics;

impl arbor_train::rollout::TokenEpisode for Panics {
    fn step(
        &mut self,
        _: &[u32],
    ) -> Result<arbor_train::rollout::StepOut, arbor_train::TrainError> {
        panic!("environment bug");
    }
    fn fork(&self) -> Result<Box<dyn arbor_train::rollout::TokenEpisode>, arbor_train::TrainError> {
        Ok(Box::new(Panics))
    }
}

/// A panic inside an environment on a worker thread fails the rollout with
/// a clear error instead of leaving it waiting for an answer forever.
#[test]
fn a_panicking_environment_fails_the_rollout_instead_of_hanging() {
    use arbor_train::config::ModelSpec;
    use arbor_train::learner::{Learner, LearnerConfig};
    use arbor_train::optim::AdamWConfig;
    use arbor_train::rollout::{run_episodes, TaskInstance};
    use arbor_train::tasks::{TaskConfig, TaskSampler};

    let sampler = TaskSampler::new(
        TaskConfig::RunningSum {
            difficulty: 3,
            one_turn: false,
            stop_at_error: false,
        },
        0,
        None,
        Vec::new(),
    )
    .unwrap();
    let mcfg = ModelSpec::default().config(sampler.vocab_size());
    let learner = Learner::new(
        &mcfg,
        None,
        None,
        0,
        &candle_core::Device::Cpu,
        LearnerConfig::default(),
        AdamWConfig::default(),
        None,
    )
    .unwrap();
    let mut engine = arbor_engine::Engine::new(
        &learner.model.policy,
        None,
        arbor_engine::EngineConfig::default(),
    )
    .unwrap();
    let t = sampler.train_task(0).unwrap();
    let tasks = (0..4)
        .map(|_| TaskInstance {
            id: t.id.clone(),
            prompt: t.prompt.clone(),
            episode: Box::new(Panics),
        })
        .collect();
    let cfg = sampler.rollout_config(1.0);
    let err = run_episodes(&mut engine, tasks, &cfg, 0, 2).unwrap_err();
    assert!(err.to_string().contains("panicked"), "{err}");
}
