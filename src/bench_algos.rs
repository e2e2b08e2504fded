//! `arbor bench algos`: FOCUS vs Prefix Sampling vs GRPO on a built-in task
//! from the same warm-started policy, several seeds: held-out greedy pass
//! rate vs generated tokens (training rewards are not comparable: Prefix
//! Sampling steers its re-rollouts toward 50% by design). Prints a table,
//! writes `algos.json` and `algos.png`.

use std::path::PathBuf;

use anyhow::{Context, Result};
use arbor_model::CriticMode;
use arbor_train::{read_metrics, Algo, TrainConfig, Trainer};
use clap::Args;
use serde::Serialize;

#[derive(Debug, Args)]
pub struct AlgosArgs {
    /// Base config (default: the embedded quickstart). `algo`, `seed` and
    /// the critic mode are set per run.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Comma-separated algorithms.
    #[arg(long, default_value = "focus,ps,grpo", value_delimiter = ',')]
    pub algos: Vec<String>,
    #[arg(long, default_value_t = 3)]
    pub seeds: u64,
    /// RL steps per run (default: the config's).
    #[arg(long)]
    pub steps: Option<u64>,
    #[arg(long, default_value = "runs/bench-algos")]
    pub out: PathBuf,
}

#[derive(Debug, Serialize)]
struct RunResult {
    algo: String,
    seed: u64,
    initial_eval: f64,
    final_eval: f64,
    final_reward: f64,
    generated_tokens: u64,
    replayed_tokens: u64,
    /// (cumulative generated tokens, greedy eval pass rate on held-out
    /// tasks) at every evaluation, starting with the warm-started policy.
    curve: Vec<(u64, f64)>,
}

#[derive(Debug, Serialize)]
struct AlgoSummary {
    algo: String,
    final_eval_mean: f64,
    final_reward_mean: f64,
    generated_tokens_mean: f64,
    /// Generated tokens at which the seed-mean eval pass rate first reaches
    /// GRPO's final one, and that as a fraction of GRPO's total.
    tokens_to_grpo_final: Option<f64>,
    ratio_to_grpo: Option<f64>,
}

fn parse_algo(s: &str) -> Result<Algo> {
    Ok(match s {
        "focus" => Algo::Focus,
        "ps" => Algo::Ps,
        "grpo" => Algo::Grpo,
        "ppo" => Algo::Ppo,
        "vineppo" => Algo::Vineppo,
        o => anyhow::bail!("unknown algorithm `{o}` (focus, ps, grpo, ppo, vineppo)"),
    })
}

pub fn run(a: AlgosArgs) -> Result<()> {
    let text = match &a.config {
        Some(p) => {
            std::fs::read_to_string(p).with_context(|| format!("{}: cannot read", p.display()))?
        }
        None => crate::train::QUICKSTART.to_string(),
    };
    let base = TrainConfig::from_toml(&text, "bench algos config")?;
    let mut results = Vec::new();
    for name in &a.algos {
        let algo = parse_algo(name)?;
        for seed in 0..a.seeds {
            let mut cfg = base.clone();
            cfg.algo = algo;
            cfg.seed = seed;
            cfg.checkpoint_every = 0;
            cfg.keep_last = 1;
            if let Some(s) = a.steps {
                cfg.steps = s;
            }
            cfg.learner.critic = if algo == Algo::Focus {
                CriticMode::Separate
            } else {
                CriticMode::Shared
            };
            let dir = a.out.join(format!("{name}-seed{seed}"));
            eprintln!("bench algos: {name} seed {seed} -> {}", dir.display());
            let mut t = Trainer::new(cfg, &dir, false)?;
            t.warmup(|_, _| {})?;
            let s = t.run(|_| {})?;
            let ms = read_metrics(&dir.join("metrics.jsonl"))?;
            let mut cum = 0;
            let mut curve = vec![(0u64, s.initial_eval_pass_rate)];
            for m in &ms {
                cum += m.generated_tokens;
                if let Some(e) = m.eval_pass_rate {
                    curve.push((cum, e));
                }
            }
            let n = ms.len().clamp(1, 10);
            let final_reward = ms.iter().rev().take(n).map(|m| m.reward).sum::<f64>() / n as f64;
            results.push(RunResult {
                algo: name.clone(),
                seed,
                initial_eval: s.initial_eval_pass_rate,
                final_eval: s.final_eval_pass_rate,
                final_reward,
                generated_tokens: cum,
                replayed_tokens: ms.iter().map(|m| m.replayed_tokens).sum(),
                curve,
            });
        }
    }
    // Seed-mean eval curves (same evaluation steps for every run).
    let mean_curve = |algo: &str| -> Vec<(f64, f64)> {
        let runs: Vec<&RunResult> = results.iter().filter(|r| r.algo == algo).collect();
        let n = runs.iter().map(|r| r.curve.len()).min().unwrap_or(0);
        (0..n)
            .map(|i| {
                let k = runs.len() as f64;
                (
                    runs.iter().map(|r| r.curve[i].0 as f64).sum::<f64>() / k,
                    runs.iter().map(|r| r.curve[i].1).sum::<f64>() / k,
                )
            })
            .collect()
    };
    let grpo_final = results
        .iter()
        .any(|r| r.algo == "grpo")
        .then(|| mean_curve("grpo").last().copied())
        .flatten();
    let mut summaries = Vec::new();
    for name in &a.algos {
        let runs: Vec<&RunResult> = results.iter().filter(|r| &r.algo == name).collect();
        let k = runs.len() as f64;
        let curve = mean_curve(name);
        let reach =
            grpo_final.and_then(|(_, target)| curve.iter().find(|c| c.1 >= target).map(|c| c.0));
        summaries.push(AlgoSummary {
            algo: name.clone(),
            final_eval_mean: runs.iter().map(|r| r.final_eval).sum::<f64>() / k,
            final_reward_mean: runs.iter().map(|r| r.final_reward).sum::<f64>() / k,
            generated_tokens_mean: runs.iter().map(|r| r.generated_tokens as f64).sum::<f64>() / k,
            tokens_to_grpo_final: reach,
            ratio_to_grpo: reach.zip(grpo_final).map(|(t, (g, _))| t / g),
        });
    }
    println!("| algo | seed | eval before | eval after | final training reward (last 10 steps) | generated tokens | replayed tokens |");
    println!("|---|---|---|---|---|---|---|");
    for r in &results {
        println!(
            "| {} | {} | {:.3} | {:.3} | {:.3} | {} | {} |",
            r.algo,
            r.seed,
            r.initial_eval,
            r.final_eval,
            r.final_reward,
            r.generated_tokens,
            r.replayed_tokens
        );
    }
    println!("\n| algo | mean eval after | mean final training reward | mean generated tokens | tokens to GRPO's final eval | ratio to GRPO |");
    println!("|---|---|---|---|---|---|");
    for s in &summaries {
        println!(
            "| {} | {:.3} | {:.3} | {:.0} | {} | {} |",
            s.algo,
            s.final_eval_mean,
            s.final_reward_mean,
            s.generated_tokens_mean,
            s.tokens_to_grpo_final
                .map(|t| format!("{t:.0}"))
                .unwrap_or_else(|| "not reached".into()),
            s.ratio_to_grpo
                .map(|r| format!("{r:.2}x"))
                .unwrap_or_else(|| "-".into())
        );
    }
    std::fs::create_dir_all(&a.out)?;
    std::fs::write(
        a.out.join("algos.json"),
        serde_json::to_vec_pretty(&serde_json::json!({"runs": results, "summary": summaries}))?,
    )?;
    plot(&a.out.join("algos.png"), &a.algos, &mean_curve)?;
    println!(
        "\nwrote {} and {}",
        a.out.join("algos.json").display(),
        a.out.join("algos.png").display()
    );
    Ok(())
}

fn plot(
    path: &std::path::Path,
    algos: &[String],
    curve: &dyn Fn(&str) -> Vec<(f64, f64)>,
) -> Result<()> {
    use plotters::style::{Color, Palette, Palette99};
    let series: Vec<crate::plot::Series> = algos
        .iter()
        .enumerate()
        .map(|(i, a)| {
            let c = Palette99::pick(i).to_rgba();
            crate::plot::Series {
                name: a.clone(),
                color: plotters::style::RGBColor(c.0, c.1, c.2),
                width: 2,
                points: curve(a),
            }
        })
        .collect();
    crate::plot::line_chart(
        path,
        "held-out greedy pass rate vs generated tokens (mean over seeds)",
        "generated tokens",
        "eval pass rate",
        &series,
    )
}
