//! `arbor train --ranks N`: data-parallel training as N processes joined over
//! TCP gives the run one process gives (up to f32 round-off in the
//! gradient sums), and a rank killed mid-run stops the whole run with an
//! error naming it, within seconds.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn config(steps: u64) -> String {
    format!(
        r#"
seed = 5
steps = {steps}
algo = "grpo"
prompts_per_step = 6
samples_per_prompt = 4
eval_every = 2
eval_tasks = 8
checkpoint_every = 0

[task]
kind = "running_sum"
difficulty = 3

[warmup]
steps = 300
batch = 16
stop_at_eval = 0.4
check_every = 20

[learner]
critic = "shared"
"#
    )
}

fn arbor() -> Command {
    Command::new(env!("CARGO_BIN_EXE_arbor"))
}

fn metrics(dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn two_rank_processes_train_like_one() {
    let d = tempfile::tempdir().unwrap();
    let cfg = d.path().join("c.toml");
    std::fs::write(&cfg, config(4)).unwrap();
    for (ranks, out) in [(1, "one"), (2, "two")] {
        let st = arbor()
            .args(["train", cfg.to_str().unwrap(), "--out"])
            .arg(d.path().join(out))
            .args(["--ranks", &ranks.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .unwrap();
        assert!(st.success(), "--ranks {ranks}: {st}");
    }
    let (one, two) = (
        metrics(&d.path().join("one")),
        metrics(&d.path().join("two")),
    );
    assert_eq!(one.len(), 4);
    assert_eq!(one.len(), two.len());
    for (a, b) in one.iter().zip(&two) {
        for k in [
            "generated_tokens",
            "episodes",
            "trained_tokens",
            "reward",
            "eval_pass_rate",
        ] {
            assert_eq!(a[k], b[k], "{k} at step {}", a["step"]);
        }
        for k in ["policy_loss", "grad_norm", "kl"] {
            let (x, y) = (a[k].as_f64().unwrap(), b[k].as_f64().unwrap());
            assert!((x - y).abs() <= 1e-5 * x.abs().max(1.0), "{k}: {x} vs {y}");
        }
    }
    assert!(one.iter().any(|m| m["grad_norm"].as_f64().unwrap() > 0.0));
}

/// A checkpoint of a one-process run resumes on two processes and goes on
/// as the one-process run does (checkpoints do not depend on the ranks):
/// GRPO, FOCUS with its critic's replay of earlier steps' targets (the
/// whole group's, kept in the checkpoint), and Prefix Sampling.
#[test]
fn a_run_resumes_at_another_number_of_ranks() {
    resumes_at_two_ranks(&config(4));
    let focus = config(4)
        .replace("algo = \"grpo\"", "algo = \"focus\"")
        .replace("[learner]\ncritic = \"shared\"\n", "")
        + "\n[critic]\nepochs = 1\nminibatches = 2\nreplay_steps = 2\n";
    resumes_at_two_ranks(&focus);
    // Prefix Sampling: its controller's state is in the checkpoint.
    let ps = config(4).replace("algo = \"grpo\"", "algo = \"ps\"") + "\n[ps]\nprobe = 2\n";
    resumes_at_two_ranks(&ps);
}

fn resumes_at_two_ranks(config: &str) {
    let d = tempfile::tempdir().unwrap();
    let cfg = d.path().join("c.toml");
    std::fs::write(
        &cfg,
        config.replace(
            "checkpoint_every = 0",
            "checkpoint_every = 2\nkeep_last = 2",
        ),
    )
    .unwrap();
    let train = |out: &Path, extra: &[&str]| {
        let st = arbor()
            .args(["train", cfg.to_str().unwrap(), "--out"])
            .arg(out)
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .unwrap();
        assert!(st.success(), "{extra:?}: {st}");
    };
    let (straight, resumed) = (d.path().join("straight"), d.path().join("resumed"));
    train(&straight, &[]);
    // The one-process run as it was after step 2: its step-2 checkpoint.
    let ck = |dir: &Path| dir.join("checkpoints/step-00000002");
    std::fs::create_dir_all(resumed.join("checkpoints")).unwrap();
    let status = Command::new("cp")
        .arg("-r")
        .arg(ck(&straight))
        .arg(resumed.join("checkpoints"))
        .status()
        .unwrap();
    assert!(status.success());
    std::fs::copy(
        straight.join("metrics.jsonl"),
        resumed.join("metrics.jsonl"),
    )
    .unwrap();
    train(&resumed, &["--resume", "--ranks", "2"]);
    let (a, b) = (metrics(&straight), metrics(&resumed));
    assert_eq!(a.len(), 4);
    assert_eq!(b.len(), 4);
    for (x, y) in a.iter().zip(&b) {
        for k in [
            "generated_tokens",
            "trained_tokens",
            "reward",
            "eval_pass_rate",
            "continuations",
        ] {
            assert_eq!(x[k], y[k], "{k} at step {}", x["step"]);
        }
        for k in ["grad_norm", "critic_pass_loss", "critic_grad_norm"] {
            if let (Some(p), Some(q)) = (x[k].as_f64(), y[k].as_f64()) {
                assert!((p - q).abs() <= 1e-5 * p.max(1.0), "{k}: {p} vs {q}");
            } else {
                assert_eq!(x[k], y[k], "{k} at step {}", x["step"]);
            }
        }
    }
}

/// The children of `parent` whose environment has `RANK=rank` (Linux).
fn rank_pid(parent: u32, rank: usize) -> Option<u32> {
    for e in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // pid (comm) state ppid ...
        let after = &stat[stat.rfind(')')? + 2..];
        let ppid: u32 = after.split(' ').nth(1)?.parse().ok()?;
        if ppid != parent {
            continue;
        }
        let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        if env
            .split(|&b| b == 0)
            .any(|kv| kv == format!("RANK={rank}").as_bytes())
        {
            return Some(pid);
        }
    }
    None
}

#[test]
fn a_killed_rank_stops_the_run_with_its_name() {
    if !Path::new("/proc/self/environ").exists() {
        eprintln!("SKIP: needs /proc to find the rank processes");
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let cfg = d.path().join("c.toml");
    std::fs::write(&cfg, config(10_000)).unwrap();
    let launcher = arbor()
        .args(["train", cfg.to_str().unwrap(), "--out"])
        .arg(d.path().join("run"))
        .args(["--ranks", "2"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Let the ranks get into training, then kill rank 1.
    let start = Instant::now();
    let pid = loop {
        if let Some(p) = rank_pid(launcher.id(), 1) {
            if d.path().join("run/metrics.jsonl").exists() {
                break p;
            }
        }
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "ranks did not start"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .unwrap();
    let killed = Instant::now();
    let out = launcher.wait_with_output().unwrap();
    assert!(!out.status.success());
    assert!(
        killed.elapsed() < Duration::from_secs(30),
        "{:?}",
        killed.elapsed()
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("rank 1"), "{err}");
}

/// `--gpus` takes a count or a list of distinct ids and, in a build
/// without CUDA, says so before starting any rank.
#[test]
fn gpus_are_checked_before_any_rank_starts() {
    let tmp = tempfile::tempdir().unwrap();
    for (spec, says) in [
        ("0,0", "GPU 0 is listed twice"),
        ("two", "expected a count"),
    ] {
        let o = arbor()
            .args(["train", "--gpus", spec, "--out"])
            .arg(tmp.path())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{err}");
        assert!(err.contains(says), "{spec}: {err}");
    }
    if !cfg!(feature = "cuda") {
        let o = arbor()
            .args(["train", "--gpus", "2", "--out"])
            .arg(tmp.path())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{err}");
        assert!(err.contains("built without CUDA"), "{err}");
        assert!(!tmp.path().join("metrics.jsonl").exists());
    }
}
