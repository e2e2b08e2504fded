//! `arbor train` and `arbor report`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use arbor_train::run::{read_metrics, StepMetrics, TrainConfig, Trainer};
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
    let cfg = TrainConfig::from_toml(&text, &origin)?;
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
    let mut s = String::from("| step | reward | pass rate | eval | effective groups | generated | KL | clip | value loss | critic rank corr |\n|---|---|---|---|---|---|---|---|---|---|\n");
    for m in &metrics {
        s += &format!(
            "| {} | {:.3} | {:.3} | {} | {:.2} | {} | {:.4} | {:.3} | {:.4} | {} |\n",
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
            m.critic_rank_corr
                .map(|c| format!("{c:.2}"))
                .unwrap_or_default()
        );
    }
    std::fs::write(&md, &s)?;
    println!("{s}\nwrote {} and {}", md.display(), png.display());
    Ok(())
}

/// `curves.png`: training reward, pass rate and eval pass rate per step.
pub fn plot_run(dir: &Path) -> Result<PathBuf> {
    use plotters::prelude::*;
    crate::plot::register_font()?;
    let metrics: Vec<StepMetrics> = read_metrics(&dir.join("metrics.jsonl"))?;
    let path = dir.join("curves.png");
    let root = BitMapBackend::new(&path, (900, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let max_step = metrics.last().map(|m| m.step).unwrap_or(1).max(1);
    let mut chart = ChartBuilder::on(&root)
        .caption("arbor train", ("sans-serif", 24))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(48)
        .build_cartesian_2d(0u64..max_step, 0f64..1.0)?;
    chart
        .configure_mesh()
        .x_desc("RL step")
        .y_desc("rate")
        .draw()?;
    // 10-step moving average of the training reward.
    let smooth: Vec<f64> = (0..metrics.len())
        .map(|i| {
            let lo = i.saturating_sub(9);
            metrics[lo..=i].iter().map(|m| m.reward).sum::<f64>() / (i - lo + 1) as f64
        })
        .collect();
    let pts: Vec<(u64, f64)> = metrics
        .iter()
        .zip(&smooth)
        .map(|(m, &v)| (m.step, v))
        .collect();
    chart
        .draw_series(LineSeries::new(pts, BLACK.stroke_width(3)))?
        .label("training reward (10-step mean)")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], BLACK.stroke_width(3)));
    type Pick = Box<dyn Fn(&StepMetrics) -> Option<f64>>;
    let series: [(&str, RGBColor, Pick); 3] = [
        (
            "training reward",
            RGBColor(120, 150, 230),
            Box::new(|m| Some(m.reward)),
        ),
        (
            "effective groups",
            GREEN,
            Box::new(|m| Some(m.effective_group_fraction)),
        ),
        (
            "eval pass rate (greedy)",
            RED,
            Box::new(|m| m.eval_pass_rate),
        ),
    ];
    for (name, color, f) in series {
        let pts: Vec<(u64, f64)> = metrics
            .iter()
            .filter_map(|m| f(m).map(|v| (m.step, v)))
            .collect();
        chart
            .draw_series(LineSeries::new(pts, color.stroke_width(2)))?
            .label(name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    drop(chart);
    drop(root);
    Ok(path)
}
