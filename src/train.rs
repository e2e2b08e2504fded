//! `arbor train` and `arbor report`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use arbor_train::{read_metrics, StepMetrics, TrainConfig, Trainer};
use clap::Args;

/// The embedded quickstart config (`configs/quickstart.toml`).
pub const QUICKSTART: &str = include_str!("../configs/quickstart.toml");

#[derive(Debug, Args)]
pub struct TrainArgs {
    /// A TOML config (see configs/). Without one, the embedded quickstart runs.
    pub config: Option<PathBuf>,
    /// Continue from the latest checkpoint in the output directory.
    #[arg(long)]
    pub resume: bool,
    /// Output directory (metrics.jsonl, checkpoints/, plots).
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Override the config's `device` (cpu, cuda, cuda:N).
    #[arg(long)]
    pub device: Option<String>,
}

#[derive(Debug, Args)]
pub struct ReportArgs {
    /// A run directory written by `arbor train`.
    pub run_dir: PathBuf,
}

pub fn run(a: TrainArgs) -> Result<()> {
    let (text, origin) = match &a.config {
        Some(p) => (
            std::fs::read_to_string(p).with_context(|| format!("{}: cannot read", p.display()))?,
            p.display().to_string(),
        ),
        None => (
            QUICKSTART.to_string(),
            "configs/quickstart.toml (embedded)".to_string(),
        ),
    };
    let mut cfg = TrainConfig::from_toml(&text, &origin)?;
    if let Some(d) = &a.device {
        arbor_train::parse_device(d).map_err(|e| anyhow::anyhow!("--device: {e}"))?;
        cfg.device = d.clone();
    } else {
        arbor_train::parse_device(&cfg.device)
            .map_err(|e| anyhow::anyhow!("{origin}: key `device`: {e}"))?;
    }
    let out = a.out.clone().unwrap_or_else(|| {
        let stem = a
            .config
            .as_ref()
            .and_then(|p| p.file_stem())
            .map(|s| s.to_string_lossy().to_string())
            .unwrap_or_else(|| "quickstart".into());
        PathBuf::from("runs").join(stem)
    });
    eprintln!("arbor train: {origin} -> {}", out.display());
    let mut trainer = Trainer::new(cfg.clone(), &out, a.resume)?;
    if trainer.step() > 0 {
        eprintln!("resuming after step {}", trainer.step());
    }
    if cfg.warmup.steps > 0 && trainer.step() == 0 {
        let bar = indicatif::ProgressBar::new(cfg.warmup.steps);
        bar.set_style(indicatif::ProgressStyle::with_template(
            "warm-up {bar:30} {pos}/{len} nll {msg}",
        )?);
        trainer.warmup(|_, nll| {
            bar.set_message(format!("{nll:.3}"));
            bar.inc(1);
        })?;
        bar.finish();
    }
    let bar = indicatif::ProgressBar::new(cfg.steps);
    bar.set_position(trainer.step());
    bar.set_style(indicatif::ProgressStyle::with_template(
        "RL {bar:30} {pos}/{len} [{elapsed_precise}] {msg}",
    )?);
    let summary = trainer.run(|m| {
        let eval = m
            .eval_pass_rate
            .map(|e| format!(" eval {e:.2}"))
            .unwrap_or_default();
        bar.set_message(format!("reward {:.2}{eval}", m.reward));
        bar.inc(1);
    })?;
    bar.finish();
    let png = plot_run(&out)?;
    println!();
    println!("| metric | value |");
    println!("|---|---|");
    println!("| algorithm | {:?} |", summary.algo);
    println!("| RL steps | {} |", summary.steps);
    if let Some(nll) = summary.warmup_final_nll {
        println!("| warm-up final NLL | {nll:.3} |");
    }
    println!(
        "| eval pass rate (greedy, held-out) before RL | {:.3} |",
        summary.initial_eval_pass_rate
    );
    println!(
        "| eval pass rate after RL | {:.3} |",
        summary.final_eval_pass_rate
    );
    println!(
        "| training reward, first 3 steps | {:.3} |",
        summary.first_reward
    );
    println!(
        "| training reward, last 3 steps | {:.3} |",
        summary.last_reward
    );
    println!("| generated tokens | {} |", summary.generated_tokens);
    println!("| RL wall time | {:.1} s |", summary.seconds);
    let ms = read_metrics(&out.join("metrics.jsonl"))?;
    let total = |f: fn(&StepMetrics) -> f64| ms.iter().map(f).sum::<f64>();
    println!(
        "| of which rollouts (engine / environments / engine idle) | {:.1} s ({:.1} / {:.1} / {:.1}) |",
        total(|m| m.time_rollout_s),
        total(|m| m.time_generate_s),
        total(|m| m.time_env_s),
        total(|m| m.time_engine_idle_s)
    );
    println!("| of which updates | {:.1} s |", total(|m| m.time_train_s));
    let ps: Vec<&arbor_train::rollout::ps::PsReport> =
        ms.iter().filter_map(|m| m.ps.as_ref()).collect();
    if !ps.is_empty() {
        let sum = |f: fn(&arbor_train::rollout::ps::PsReport) -> usize| {
            ps.iter().map(|p| f(p)).sum::<usize>()
        };
        let (groups, trained) = (sum(|p| p.reroll_groups), sum(|p| p.reroll_trained));
        println!(
            "| Prefix Sampling: skewed groups / re-rollout groups trained of generated / replays dropped | {} / {trained} of {groups} / {} |",
            sum(|p| p.groups_skewed),
            sum(|p| p.replay_failed + p.replay_diverged)
        );
    }
    println!(
        "\nmetrics: {}\nplot:    {}",
        out.join("metrics.jsonl").display(),
        png.display()
    );
    Ok(())
}

pub fn report(a: ReportArgs) -> Result<()> {
    let metrics = read_metrics(&a.run_dir.join("metrics.jsonl"))?;
    if metrics.is_empty() {
        anyhow::bail!("{}: no metrics.jsonl lines", a.run_dir.display());
    }
    let png = plot_run(&a.run_dir)?;
    let md = a.run_dir.join("summary.md");
    let mut s = String::from("| step | reward | pass rate | eval | effective groups | generated | KL | clip | value loss | critic rank corr | held-out critic rank corr | rollout s | env s | engine idle s | update s |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    let opt = |x: Option<f64>| x.map(|c| format!("{c:.2}")).unwrap_or_default();
    for m in &metrics {
        s += &format!(
            "| {} | {:.3} | {:.3} | {} | {:.2} | {} | {:.4} | {:.3} | {:.4} | {} | {} | {:.2} | {:.2} | {:.2} | {:.2} |\n",
            m.step,
            m.reward,
            m.pass_rate,
            m.eval_pass_rate
                .map(|e| format!("{e:.3}"))
                .unwrap_or_default(),
            m.effective_group_fraction,
            m.generated_tokens,
            m.kl,
            m.clip_fraction,
            m.value_loss,
            opt(m.critic_rank_corr),
            opt(m.critic_heldout_rank_corr),
            m.time_rollout_s,
            m.time_env_s,
            m.time_engine_idle_s,
            m.time_train_s
        );
    }
    if metrics.iter().any(|m| m.ps.is_some()) {
        s += "\n| step | first-pass pass rate | skewed groups | re-rollout groups | trained | all alike | agreeing probes | re-rollout pass rate | replays dropped |\n|---|---|---|---|---|---|---|---|---|\n";
        for m in &metrics {
            if let Some(p) = &m.ps {
                s += &format!(
                    "| {} | {:.3} | {} | {} | {} | {} | {} | {} | {} |\n",
                    m.step,
                    p.first_pass_pass_rate,
                    p.groups_skewed,
                    p.reroll_groups,
                    p.reroll_trained,
                    p.reroll_degenerate,
                    p.probes_agreed,
                    opt(p.reroll_pass_rate),
                    p.replay_failed + p.replay_diverged
                );
            }
        }
    }
    std::fs::write(&md, &s)?;
    println!("{s}\nwrote {} and {}", md.display(), png.display());
    Ok(())
}

/// `curves.png`: training reward (raw and 10-step mean), effective-group
/// fraction and eval pass rate per step.
pub fn plot_run(dir: &Path) -> Result<PathBuf> {
    use crate::plot::{line_chart, Series};
    use plotters::style::{RGBColor, BLACK, GREEN, RED};
    let metrics: Vec<StepMetrics> = read_metrics(&dir.join("metrics.jsonl"))?;
    let path = dir.join("curves.png");
    let smooth: Vec<(f64, f64)> = (0..metrics.len())
        .map(|i| {
            let lo = i.saturating_sub(9);
            let mean = metrics[lo..=i].iter().map(|m| m.reward).sum::<f64>() / (i - lo + 1) as f64;
            (metrics[i].step as f64, mean)
        })
        .collect();
    let pick = |f: &dyn Fn(&StepMetrics) -> Option<f64>| -> Vec<(f64, f64)> {
        metrics
            .iter()
            .filter_map(|m| f(m).map(|v| (m.step as f64, v)))
            .collect()
    };
    let series = [
        Series {
            name: "training reward (10-step mean)".into(),
            color: BLACK,
            width: 3,
            points: smooth,
        },
        Series {
            name: "training reward".into(),
            color: RGBColor(120, 150, 230),
            width: 2,
            points: pick(&|m| Some(m.reward)),
        },
        Series {
            name: "effective groups".into(),
            color: GREEN,
            width: 2,
            points: pick(&|m| Some(m.effective_group_fraction)),
        },
        Series {
            name: "eval pass rate (greedy)".into(),
            color: RED,
            width: 2,
            points: pick(&|m| m.eval_pass_rate),
        },
    ];
    line_chart(&path, "arbor train", "RL step", "rate", &series)?;
    Ok(path)
}
