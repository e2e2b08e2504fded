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
    /// Train data-parallel on this many ranks, one process each on this
    /// machine, joined over TCP through rank 0 (every method). A cluster
    /// launcher can start the ranks itself instead: each `arbor train`
    /// with `RANK`, `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT` set joins
    /// that group. Rank 0 writes the run; every rank resumes from its
    /// checkpoints (at any number of ranks).
    #[arg(long, default_value_t = 1)]
    pub ranks: usize,
    /// Train data-parallel with one rank per GPU: a count (`--gpus 8`: GPUs
    /// 0-7) or a list (`--gpus 0,2,5`). Each rank is a process with `RANK`,
    /// `LOCAL_RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` and
    /// `CUDA_VISIBLE_DEVICES` set as torchrun sets them, and trains on
    /// `cuda:$LOCAL_RANK`; the ranks join over TCP as with `--ranks`, and
    /// with a `--features nccl` build sum their gradients over NCCL on the
    /// GPUs (`ARBOR_DIST=tcp` keeps them on TCP). Needs a `--features cuda`
    /// build.
    #[arg(long, value_name = "N|LIST", conflicts_with_all = ["ranks", "device"])]
    pub gpus: Option<String>,
}

/// The GPUs of `--gpus`: `N` (GPUs `0..N`) or a comma-separated list of
/// distinct ids.
pub fn parse_gpus(spec: &str) -> Result<Vec<usize>> {
    let spec = spec.trim();
    let ids: Vec<usize> = if spec.contains(',') {
        spec.split(',')
            .map(|x| {
                x.trim()
                    .parse::<usize>()
                    .with_context(|| format!("--gpus `{spec}`: `{}` is not a GPU id", x.trim()))
            })
            .collect::<Result<_>>()?
    } else {
        let n: usize = spec
            .parse()
            .with_context(|| format!("--gpus `{spec}`: expected a count or a list like 0,2,5"))?;
        (0..n).collect()
    };
    if ids.is_empty() {
        anyhow::bail!("--gpus `{spec}`: no GPU");
    }
    let mut sorted = ids.clone();
    sorted.sort_unstable();
    if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
        anyhow::bail!("--gpus `{spec}`: GPU {} is listed twice", w[0]);
    }
    Ok(ids)
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
    let gpus = a.gpus.as_deref().map(parse_gpus).transpose()?;
    let in_rank = std::env::var_os("WORLD_SIZE").is_some();
    if gpus.is_some() && !in_rank {
        // The launcher opens no device (it would hold memory on GPU 0).
        if !candle_core::utils::cuda_is_available() {
            anyhow::bail!("--gpus: this arbor was built without CUDA (`--features cuda`)");
        }
    } else if gpus.is_some() {
        // Inside a rank: the launcher (or a cluster's) set LOCAL_RANK, and
        // CUDA_VISIBLE_DEVICES to the chosen GPUs.
        let local: usize = match std::env::var("LOCAL_RANK") {
            Ok(v) => v
                .parse()
                .with_context(|| format!("LOCAL_RANK `{v}` is not a number"))?,
            Err(_) => 0,
        };
        let d = format!("cuda:{local}");
        arbor_train::parse_device(&d).map_err(|e| anyhow::anyhow!("--gpus: {e}"))?;
        cfg.device = d;
    } else if let Some(d) = &a.device {
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
    if !in_rank {
        if let Some(ids) = &gpus {
            return launch(ids.len(), Some(ids));
        }
        if a.ranks > 1 {
            return launch(a.ranks, None);
        }
    }
    let timeout = std::time::Duration::from_secs(
        std::env::var("ARBOR_DIST_TIMEOUT_S")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1800),
    );
    let group: Box<dyn arbor_train::dist::Collective> =
        match arbor_train::dist::TcpGroup::from_env(timeout) {
            Some(g) => rank_group(g.context("joining the data-parallel group")?, &cfg.device),
            None => Box::new(arbor_train::dist::Single),
        };
    let rank = group.rank();
    if rank == 0 {
        eprintln!("arbor train: {origin} -> {}", out.display());
    }
    // Every rank reads `out` (to resume), only rank 0 writes there.
    let mut trainer = Trainer::open(cfg.clone(), &out, a.resume, group)?;
    if trainer.step() > 0 {
        eprintln!("resuming after step {}", trainer.step());
    }
    // Only rank 0 shows progress.
    let new_bar = |len: u64| {
        if rank == 0 {
            indicatif::ProgressBar::new(len)
        } else {
            indicatif::ProgressBar::hidden()
        }
    };
    if cfg.warmup.steps > 0 && trainer.step() == 0 {
        let bar = new_bar(cfg.warmup.steps);
        bar.set_style(indicatif::ProgressStyle::with_template(
            "warm-up {bar:30} {pos}/{len} nll {msg}",
        )?);
        trainer.warmup(|_, nll| {
            bar.set_message(format!("{nll:.3}"));
            bar.inc(1);
        })?;
        bar.finish();
    }
    let bar = new_bar(cfg.steps);
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
    if rank > 0 {
        return Ok(());
    }
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
    let ctx: Vec<&arbor_train::metrics::ContextMetrics> =
        ms.iter().filter_map(|m| m.context.as_ref()).collect();
    if !ctx.is_empty() {
        let kept = |x: Option<&arbor_train::metrics::ContextMetrics>| {
            x.and_then(|x| x.summaries_kept_state)
                .map_or("-".to_string(), |k| format!("{k:.2}"))
        };
        let last = ms.iter().rev().find_map(|m| m.eval_context.as_ref());
        let n = ctx.len() as f64;
        let failed: u64 = ctx
            .iter()
            .map(|c| c.malformed_summaries + c.missing_keys + c.overflows + c.compaction_limit)
            .sum();
        println!(
            "| context: compactions per episode / held-out summaries carrying the state before and after RL / episodes ended by the context | {:.2} / {} and {} / {failed} |",
            ctx.iter().map(|c| c.compactions_per_episode).sum::<f64>() / n,
            kept(summary.initial_eval_context.as_ref()),
            kept(last),
        );
    }
    println!(
        "\nmetrics: {}\nplot:    {}",
        out.join("metrics.jsonl").display(),
        png.display()
    );
    Ok(())
}

/// This rank's group over `tcp`: on GPUs, where NCCL is built in, the
/// gradients are summed by NCCL (`ARBOR_DIST=tcp` keeps them on TCP).
#[cfg(feature = "nccl")]
fn rank_group(
    tcp: arbor_train::dist::TcpGroup,
    device: &str,
) -> Box<dyn arbor_train::dist::Collective> {
    if device.starts_with("cuda") && std::env::var("ARBOR_DIST").as_deref() != Ok("tcp") {
        Box::new(arbor_train::dist::NcclGroup::new(tcp))
    } else {
        Box::new(tcp)
    }
}

/// This rank's group over `tcp` (a build without NCCL).
#[cfg(not(feature = "nccl"))]
fn rank_group(
    tcp: arbor_train::dist::TcpGroup,
    _device: &str,
) -> Box<dyn arbor_train::dist::Collective> {
    Box::new(tcp)
}

/// `arbor train --ranks N`: this command again as `N` processes, rank `r`
/// with `RANK=r`, `LOCAL_RANK=r`, `WORLD_SIZE=N`, `MASTER_ADDR=127.0.0.1`
/// and a free `MASTER_PORT` (with `gpus`, `CUDA_VISIBLE_DEVICES` lists them,
/// so rank `r` sees its GPU as `cuda:r`). A rank that exits with an error
/// stops the others; the error names it.
fn launch(ranks: usize, gpus: Option<&[usize]>) -> Result<()> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let exe = std::env::current_exe().context("finding the arbor executable")?;
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    let visible = gpus
        .map(|ids| visible_devices(ids, std::env::var("CUDA_VISIBLE_DEVICES").ok().as_deref()))
        .transpose()?;
    let mut children = Ranks(Vec::with_capacity(ranks));
    for r in 0..ranks {
        let mut cmd = std::process::Command::new(&exe);
        cmd.args(&args)
            .env("RANK", r.to_string())
            .env("LOCAL_RANK", r.to_string())
            .env("WORLD_SIZE", ranks.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string());
        if let Some(list) = &visible {
            cmd.env("CUDA_VISIBLE_DEVICES", list);
        } else if std::env::var_os("NCCL_HOSTID").is_none() {
            // `--ranks N` on one GPU: NCCL refuses two ranks of a
            // communicator on one device of one host, so each rank names
            // its own host.
            cmd.env("NCCL_HOSTID", format!("arbor-rank-{r}"));
        }
        let child = cmd.spawn().with_context(|| format!("starting rank {r}"))?;
        children.0.push(Some(child));
    }
    loop {
        let mut running = 0;
        let mut failed = Vec::new();
        for (r, slot) in children.0.iter_mut().enumerate() {
            let Some(c) = slot.as_mut() else {
                continue;
            };
            match c.try_wait()? {
                None => running += 1,
                Some(st) if st.success() => *slot = None,
                Some(st) => {
                    failed.push(format!("rank {r} of {ranks} failed ({st})"));
                    *slot = None;
                }
            }
        }
        if !failed.is_empty() {
            // The guard stops the other ranks.
            anyhow::bail!("{}; the other ranks were stopped", failed.join(", "));
        }
        if running == 0 {
            return Ok(());
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// `CUDA_VISIBLE_DEVICES` for the ranks of `--gpus ids`: the ids
/// themselves, or, where the launcher already sees a restricted list
/// (`inherited`, a scheduler's or a container's), its entries at those
/// positions, so `--gpus 0,1` under `CUDA_VISIBLE_DEVICES=4,5,6,7` means GPUs
/// 4 and 5.
fn visible_devices(ids: &[usize], inherited: Option<&str>) -> Result<String> {
    let Some(inherited) = inherited.map(str::trim).filter(|v| !v.is_empty()) else {
        let list: Vec<String> = ids.iter().map(usize::to_string).collect();
        return Ok(list.join(","));
    };
    let seen: Vec<&str> = inherited.split(',').map(str::trim).collect();
    let list = ids
        .iter()
        .map(|&i| {
            seen.get(i).copied().with_context(|| {
                format!(
                    "--gpus: GPU {i} is not among the {} visible (CUDA_VISIBLE_DEVICES={inherited})",
                    seen.len()
                )
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(list.join(","))
}

/// The launched ranks still running; dropping the guard (an error, or the
/// end of the launch) kills and reaps them, so no rank outlives the run.
struct Ranks(Vec<Option<std::process::Child>>);

impl Drop for Ranks {
    fn drop(&mut self) {
        for c in self.0.iter_mut().flatten() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
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

#[cfg(test)]
mod tests {
    use super::{parse_gpus, visible_devices};

    #[test]
    fn gpus_are_a_count_or_a_list_of_distinct_ids() {
        assert_eq!(parse_gpus("4").unwrap(), vec![0, 1, 2, 3]);
        assert_eq!(parse_gpus("0,2,5").unwrap(), vec![0, 2, 5]);
        assert_eq!(parse_gpus(" 3 , 1 ").unwrap(), vec![3, 1]);
        assert_eq!(visible_devices(&[0, 2], None).unwrap(), "0,2");
        assert_eq!(visible_devices(&[0, 1], Some("4,5,6,7")).unwrap(), "4,5");
        assert_eq!(
            visible_devices(&[1], Some(" GPU-a , GPU-b ")).unwrap(),
            "GPU-b"
        );
        assert_eq!(visible_devices(&[3], Some("")).unwrap(), "3");
        let e = format!("{:#}", visible_devices(&[0, 4], Some("4,5")).unwrap_err());
        assert!(e.contains("GPU 4 is not among the 2 visible"), "{e}");
        for (bad, says) in [
            ("0", "no GPU"),
            ("x", "expected a count"),
            ("1,,2", "is not a GPU id"),
            ("1,2,1", "GPU 1 is listed twice"),
        ] {
            let e = format!("{:#}", parse_gpus(bad).unwrap_err());
            assert!(e.contains(says) && e.contains("--gpus"), "{bad}: {e}");
        }
    }
}
