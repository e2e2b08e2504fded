//! `arbor bench audit`: the FOCUS audit-tree diagnostic.
//!
//! Runs [`arbor_rl::audit::run_audit`] (a seeded synthetic audit tree with
//! known true values; MSE of the value estimates vs budget for FOCUS,
//! random, uniform and raw-residual selection, with a constant and a random
//! critic, over several seeds), prints a table, and writes `audit.json` and
//! `audit.png` under `--out`. The simulation lives in `arbor-rl`; this file
//! only parses, prints, plots and writes.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, Context, Result};
use arbor_rl::audit::{run_audit, AuditConfig, AuditReport, CriticKind, Metric, WorldKind};
use arbor_rl::focus::SelectorKind;
use clap::Args;
use plotters::prelude::*;

#[derive(Debug, Args)]
pub struct AuditArgs {
    /// Number of seeds (seeds 0..N; every seed is a fresh audit world).
    #[arg(long, default_value_t = 8)]
    pub seeds: u64,
    /// Tasks (episode roots) per audit world.
    #[arg(long, default_value_t = 8)]
    pub tasks: usize,
    /// On-policy trajectories per task forming the audit tree.
    #[arg(long, default_value_t = 2)]
    pub trajectories: usize,
    /// Segments per successful episode.
    #[arg(long, default_value_t = 6)]
    pub depth: u32,
    /// Next states per state.
    #[arg(long, default_value_t = 3)]
    pub branching: u32,
    /// Lower end of a task's per-step survival floor.
    #[arg(long, default_value_t = 0.7)]
    pub floor_lo: f64,
    /// Upper end of a task's per-step survival floor.
    #[arg(long, default_value_t = 0.95)]
    pub floor_hi: f64,
    /// Prior strength kappa.
    #[arg(long, default_value_t = 1.0)]
    pub kappa: f64,
    /// Continuations spent per run.
    #[arg(long, default_value_t = 512)]
    pub budget: u64,
    /// Continuations of the large-budget run that gives each selector's
    /// limit (0: none).
    #[arg(long, default_value_t = 2048)]
    pub limit_budget: u64,
    /// Continuations' new states cannot be forked (only the audit tree's).
    #[arg(long)]
    pub no_resumable: bool,
    /// Share of states the `accurate` critic gets wrong.
    #[arg(long, default_value_t = 0.1)]
    pub wrong: f64,
    /// Continuations in flight (rollout workers).
    #[arg(long, default_value_t = 8)]
    pub workers: u32,
    /// Record the MSE every this many continuations.
    #[arg(long, default_value_t = 16)]
    pub record_every: u64,
    /// Value of the constant critic.
    #[arg(long, default_value_t = 0.5)]
    pub constant: f64,
    /// Skip the oracle yardstick.
    #[arg(long)]
    pub no_oracle: bool,
    /// Output directory for audit.json and audit.png.
    #[arg(long, default_value = "runs/bench-audit")]
    pub out: PathBuf,
}

impl AuditArgs {
    fn config(&self) -> AuditConfig {
        AuditConfig {
            tasks: self.tasks,
            trajectories_per_task: self.trajectories,
            depth: self.depth,
            branching: self.branching,
            floor_lo: self.floor_lo,
            floor_hi: self.floor_hi,
            kappa: self.kappa,
            budget: self.budget,
            limit_budget: self.limit_budget,
            workers: self.workers,
            record_every: self.record_every,
            resumable_continuations: !self.no_resumable,
            seeds: (0..self.seeds).collect(),
            worlds: vec![WorldKind::Even, WorldKind::Uneven],
            critics: vec![
                CriticKind::Constant(self.constant),
                CriticKind::Random,
                CriticKind::Accurate(self.wrong),
            ],
            selectors: SelectorKind::ALL.to_vec(),
            oracle: !self.no_oracle,
        }
    }
}

pub fn run(a: AuditArgs) -> Result<()> {
    let cfg = a.config();
    let report = run_audit(&cfg).context("audit")?;
    print!("{}", table(&report));
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let json = a.out.join("audit.json");
    std::fs::write(&json, serde_json::to_string_pretty(&report)?)
        .with_context(|| format!("writing {}", json.display()))?;
    let png = a.out.join("audit.png");
    plot(&report, &png).with_context(|| format!("writing {}", png.display()))?;
    println!("wrote {} and {}", json.display(), png.display());
    Ok(())
}

/// The mean MSE at 0, 1/4, 1/2, 3/4 and all of the budget, the limit, and
/// the budget at which each selector first reaches random selection's
/// final MSE; then one verdict line per panel.
fn table(r: &AuditReport) -> String {
    let g = &r.grid;
    let at = |f: f64| {
        let want = (f * r.config.budget as f64).round() as u64;
        g.iter().position(|&b| b >= want).unwrap_or(g.len() - 1)
    };
    let cols = [0.0, 0.25, 0.5, 0.75, 1.0].map(at);
    let mut s = String::new();
    let _ = writeln!(
        s,
        "audit tree: {} seeds, {:.1} audit nodes per world, budget {} continuations (limit run {}), {} workers, kappa {}, continuation states {}",
        r.config.seeds.len(),
        r.audit_nodes,
        r.config.budget,
        r.config.limit_budget,
        r.config.workers,
        r.config.kappa,
        if r.config.resumable_continuations { "resumable" } else { "not resumable" }
    );
    for &world in &r.config.worlds {
        for &critic in &r.config.critics {
            for metric in Metric::ALL {
                let random_final = r
                    .curve(world, critic, SelectorKind::Random.name(), metric)
                    .map_or(f64::NAN, arbor_rl::audit::AuditCurve::final_mse);
                let _ = writeln!(
                    s,
                    "\n{} world, critic {}, {} estimate (mean MSE over seeds)",
                    world.name(),
                    critic.name(),
                    metric.name()
                );
                let _ = write!(s, "{:<18}", "selector");
                for &i in &cols {
                    let _ = write!(s, "{:>10}", format!("@{}", g[i]));
                }
                let _ = write!(s, "{:>10}", format!("@{}", r.config.limit_budget));
                let _ = writeln!(s, "{:>18}", "reach random@end");
                for c in r
                    .curves
                    .iter()
                    .filter(|c| c.world == world && c.critic == critic && c.metric == metric)
                {
                    let _ = write!(s, "{:<18}", c.selector);
                    for &i in &cols {
                        let _ = write!(s, "{:>10.5}", c.mean[i]);
                    }
                    let _ = write!(
                        s,
                        "{:>10}",
                        c.limit.map_or("-".to_string(), |l| format!("{l:.5}"))
                    );
                    let reach = c
                        .budget_to_reach(g, random_final)
                        .map_or("never".to_string(), |b| b.to_string());
                    let _ = writeln!(s, "{reach:>18}");
                }
            }
        }
    }
    let _ = writeln!(s);
    let pct = |f: Option<f64>| f.map_or("never".to_string(), |f| format!("{:.0}%", 100.0 * f));
    for v in &r.verdicts {
        let variants: Vec<String> = v
            .variant_budget_fractions
            .iter()
            .map(|(n, f)| format!("{n} {}", pct(*f)))
            .collect();
        let _ = writeln!(
            s,
            "{} / {} / {}: to random's final MSE {:.5}: oracle {}, FOCUS {} ({}) -> half-budget claim {}; raw residual {:.5} vs FOCUS {:.5} -> worse: {}",
            v.world.name(),
            v.critic.name(),
            v.metric.name(),
            v.random_final,
            pct(v.oracle_budget_fraction),
            pct(v.focus_budget_fraction),
            variants.join(", "),
            match (v.claim_applies, v.focus_within_half_budget) {
                (false, _) => "not testable (the oracle misses it)",
                (true, true) => "MET",
                (true, false) => "MISSED",
            },
            v.residual_final,
            v.focus_final,
            v.residual_worse_than_focus
        );
    }
    let testable: Vec<_> = r.verdicts.iter().filter(|v| v.claim_applies).collect();
    let _ = writeln!(
        s,
        "\nhalf-budget claim: met in {} of the {} panels where the oracle meets it ({} panels in all)",
        testable.iter().filter(|v| v.focus_within_half_budget).count(),
        testable.len(),
        r.verdicts.len()
    );
    s
}

/// One panel per (world, critic, metric): mean MSE vs continuations per
/// selector.
fn plot(r: &AuditReport, path: &Path) -> Result<()> {
    crate::plot::register_font()?;
    let e = |e: &dyn std::fmt::Display| anyhow!("plotting: {e}");
    let rows: Vec<(WorldKind, CriticKind)> = r
        .config
        .worlds
        .iter()
        .flat_map(|&w| r.config.critics.iter().map(move |&c| (w, c)))
        .collect();
    let root = BitMapBackend::new(path, (2400, 420 * rows.len() as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let panels = root.split_evenly((rows.len(), Metric::ALL.len()));
    let budget = r.config.budget as f64;
    let mut panel = panels.iter();
    for &(world, critic) in &rows {
        for metric in Metric::ALL {
            let Some(area) = panel.next() else { break };
            let curves: Vec<_> = r
                .curves
                .iter()
                .filter(|c| c.world == world && c.critic == critic && c.metric == metric)
                .collect();
            let ymax = curves
                .iter()
                .flat_map(|c| c.mean.iter().copied())
                .fold(0.0f64, f64::max)
                * 1.05;
            let mut chart = ChartBuilder::on(area)
                .caption(
                    format!(
                        "{} world, critic {}, {}",
                        world.name(),
                        critic.name(),
                        metric.name()
                    ),
                    ("sans-serif", 20),
                )
                .margin(12)
                .x_label_area_size(40)
                .y_label_area_size(70)
                .build_cartesian_2d(0.0..budget, 0.0..ymax.max(1e-9))
                .map_err(|x| e(&x))?;
            chart
                .configure_mesh()
                .label_style(("sans-serif", 15))
                .axis_desc_style(("sans-serif", 17))
                .x_desc("continuations spent")
                .y_desc("MSE of value estimates")
                .draw()
                .map_err(|x| e(&x))?;
            for (i, c) in curves.iter().enumerate() {
                let color = Palette99::pick(i).to_rgba();
                let pts: Vec<(f64, f64)> = r
                    .grid
                    .iter()
                    .map(|&b| b as f64)
                    .zip(c.mean.iter().copied())
                    .collect();
                chart
                    .draw_series(LineSeries::new(pts, color.stroke_width(3)))
                    .map_err(|x| e(&x))?
                    .label(c.selector.clone())
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(3))
                    });
            }
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperRight)
                .label_font(("sans-serif", 18))
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .draw()
                .map_err(|x| e(&x))?;
        }
    }
    root.present().map_err(|x| e(&x))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        a: AuditArgs,
    }

    #[test]
    fn defaults_match_the_library() {
        let a = Cli::parse_from(["audit"]).a;
        assert_eq!(a.config(), AuditConfig::default());
        assert_eq!(a.out, PathBuf::from("runs/bench-audit"));
    }

    #[test]
    fn writes_table_json_and_png() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("audit");
        let a = Cli::parse_from([
            "audit",
            "--seeds",
            "2",
            "--tasks",
            "3",
            "--depth",
            "3",
            "--budget",
            "32",
            "--record-every",
            "8",
            "--out",
            out.to_str().unwrap(),
        ])
        .a;
        run(a).unwrap();
        let json = std::fs::read_to_string(out.join("audit.json")).unwrap();
        let back: AuditReport = serde_json::from_str(&json).unwrap();
        assert_eq!(back.grid, vec![0, 8, 16, 24, 32]);
        let png = std::fs::read(out.join("audit.png")).unwrap();
        assert_eq!(&png[1..4], b"PNG");
    }
}
