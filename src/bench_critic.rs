//! `arbor bench critic`: can the critic rank the task's states at all?
//! Trains a policy (the config's warm-up, then optionally RL steps of a
//! `bench algos` row), freezes it, samples states with Monte-Carlo values,
//! fits the critic by regression and scores it on held-out states against
//! the noise ceiling and a depth-only baseline
//! ([`arbor_train::probe`]). Prints a table, writes `probe.json`.

use std::path::PathBuf;

use anyhow::{Context, Result};
use arbor_model::CriticMode;
use arbor_train::probe::{ProbeOptions, ProbeReport, ProbeTarget};
use arbor_train::{TrainConfig, Trainer};
use clap::Args;
use serde::Serialize;

#[derive(Debug, Args)]
pub struct CriticBenchArgs {
    /// Base config (default: the embedded quickstart).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// RL steps before the probe (0: the warm-started policy).
    #[arg(long, default_value_t = 0)]
    pub rl_steps: u64,
    /// The method of those steps, a `bench algos` row (`focus`,
    /// `focus+lambda=1`, `grpo`, ...). A method without a critic (GRPO,
    /// PS, VinePPO) needs `--critic shared`.
    #[arg(long, default_value = "focus")]
    pub rl: String,
    /// The critic: a separate backbone or a head on the policy's trunk.
    #[arg(long, default_value = "separate", value_parser = ["separate", "shared"])]
    pub critic: String,
    /// Start the separate critic from the policy's weights (`policy`) or
    /// from its own random initialisation (`own`). After `--rl-steps` the
    /// critic is probed as the RL steps left it.
    #[arg(long, default_value = "policy", value_parser = ["policy", "own"])]
    pub critic_init: String,
    /// The critic also reads the policy's surprise along the episode's path
    /// (`[critic] surprise`; default: the config's, on in the quickstart).
    /// `--surprise` alone means `true`.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub surprise: Option<bool>,
    /// Training tasks, one trajectory each (every state on it is a sample).
    #[arg(long, default_value_t = 256)]
    pub train_tasks: usize,
    /// Held-out tasks, scored.
    #[arg(long, default_value_t = 64)]
    pub test_tasks: usize,
    /// Monte-Carlo continuations per state.
    #[arg(long, default_value_t = 16)]
    pub samples: usize,
    #[arg(long, default_value_t = 40)]
    pub epochs: usize,
    /// States per optimizer step.
    #[arg(long, default_value_t = 128)]
    pub batch: usize,
    /// Regression targets: each state's Monte-Carlo mean, or its
    /// trajectory's 0/1 outcome (what a lambda = 1 critic sees in RL).
    #[arg(long, default_value = "monte_carlo", value_parser = ["monte_carlo", "outcome"])]
    pub target: String,
    /// The critic's learning rate during the fit.
    #[arg(long, default_value_t = 3e-3)]
    pub lr: f64,
    #[arg(long, default_value_t = 5)]
    pub eval_every: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[arg(long, default_value = "runs/bench-critic")]
    pub out: PathBuf,
}

#[derive(Debug, Serialize)]
struct Output<'a> {
    config: String,
    rl: &'a str,
    rl_steps: u64,
    critic: &'a str,
    critic_init: &'a str,
    surprise: bool,
    /// Greedy held-out pass rate of the probed policy.
    policy_pass_rate: f64,
    options: &'a ProbeOptions,
    report: &'a ProbeReport,
}

fn opt(x: Option<f64>) -> String {
    x.map_or("-".into(), |v| format!("{v:.3}"))
}

pub fn run(a: CriticBenchArgs) -> Result<()> {
    let text = match &a.config {
        Some(p) => {
            std::fs::read_to_string(p).with_context(|| format!("{}: cannot read", p.display()))?
        }
        None => crate::train::QUICKSTART.to_string(),
    };
    let base = TrainConfig::from_toml(&text, "bench critic config")?;
    let mut parts = a.rl.split('+');
    let mut algo = crate::bench_algos::parse_algo(parts.next().unwrap_or_default())?;
    if a.rl_steps == 0 {
        // No RL step runs: the method only has to allow the critic probed.
        algo = arbor_train::Algo::Focus;
    }
    let settings: Vec<&str> = parts.collect();
    let mut cfg =
        crate::bench_algos::row_config(&base, algo, &settings, a.seed, Some(a.rl_steps.max(1)))
            .with_context(|| format!("bench critic row `{}`", a.rl))?;
    cfg.learner.critic = if a.critic == "shared" {
        CriticMode::Shared
    } else {
        CriticMode::Separate
    };
    if a.critic_init == "own" {
        cfg.critic.init = arbor_train::CriticInit::Own;
    }
    if let Some(on) = a.surprise {
        cfg.critic.surprise = on;
    }
    cfg.validate("bench critic")?;
    let surprise = cfg.learner_config().surprise;
    std::fs::create_dir_all(&a.out)?;
    let mut t = Trainer::new(cfg, &a.out.join("run"), false)?;
    eprintln!(
        "bench critic: warm-up, then {} RL steps of {}",
        a.rl_steps, a.rl
    );
    t.warmup(|_, _| {})?;
    if a.rl_steps > 0 {
        t.run(|_| {})?;
    }
    let pass = t.eval_pass_rate()?;
    let o = ProbeOptions {
        train_tasks: a.train_tasks,
        test_tasks: a.test_tasks,
        samples: a.samples,
        epochs: a.epochs,
        batch_states: a.batch,
        target: if a.target == "outcome" {
            ProbeTarget::Outcome
        } else {
            ProbeTarget::MonteCarlo
        },
        lr: a.lr,
        grad_clip: 1.0,
        eval_every: a.eval_every,
        // After RL steps the critic (backbone and head) is what they left.
        init_from_policy: a.critic_init == "policy" && a.rl_steps == 0,
        seed: a.seed,
    };
    eprintln!("bench critic: sampling and fitting (greedy pass rate {pass:.3})");
    let r = t.critic_probe(&o)?;
    println!(
        "critic probe: {} train / {} test states, {} continuations each, targets {}; test values {:.3} +- {:.3}",
        r.train_states, r.test_states, a.samples, a.target, r.test_value_mean, r.test_value_std
    );
    println!(
        "noise: split-half rank {} -> ceiling {}; depth-only baseline: rank {}, EV {}",
        opt(r.split_half_rank),
        opt(r.rank_ceiling),
        opt(r.depth_baseline_rank),
        opt(r.depth_baseline_ev)
    );
    println!(
        "surprise-only baselines (minus the path's tokens sampled below -c nats): rank {}",
        arbor_train::learner::SURPRISE_NATS
            .iter()
            .zip(&r.surprise_baseline_rank)
            .map(|(c, r)| format!("{} at c = {c}", opt(*r)))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!("\n| epoch | value loss | train EV | train rank | test EV | test rank |");
    println!("|---|---|---|---|---|---|");
    for e in &r.curve {
        println!(
            "| {} | {:.4} | {} | {} | {} | {} |",
            e.epoch,
            e.value_loss,
            opt(e.train_ev),
            opt(e.train_rank),
            opt(e.test_ev),
            opt(e.test_rank)
        );
    }
    if let Some(b) = r.best() {
        println!(
            "\nbest test rank {} at epoch {} (ceiling {}); sampling {:.1} s, fit {:.1} s",
            opt(b.test_rank),
            b.epoch,
            opt(r.rank_ceiling),
            r.sample_seconds,
            r.fit_seconds
        );
    }
    let out = Output {
        config: a
            .config
            .as_ref()
            .map_or("quickstart".into(), |p| p.display().to_string()),
        rl: &a.rl,
        rl_steps: a.rl_steps,
        critic: &a.critic,
        critic_init: &a.critic_init,
        surprise,
        policy_pass_rate: pass,
        options: &o,
        report: &r,
    };
    let path = a.out.join("probe.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&out)?)?;
    eprintln!("bench critic: wrote {}", path.display());
    Ok(())
}
