//! `arbor train` end to end: kill -9 in the middle of a run (including
//! while a checkpoint may be being written), `--resume`, and the metrics of
//! the following steps equal an uninterrupted run bit for bit; bad configs
//! give one clear error naming the key.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const CONFIG: &str = r#"
seed = 3
steps = 6
algo = "focus"
prompts_per_step = 4
samples_per_prompt = 4
eval_every = 3
eval_tasks = 8
checkpoint_every = 2
keep_last = 2
critic_warmup_steps = 1

[task]
kind = "running_sum"
difficulty = 3

[warmup]
steps = 10
batch = 8

[learner]
critic = "separate"
"#;

fn arbor() -> Command {
    Command::new(env!("CARGO_BIN_EXE_arbor"))
}

/// metrics.jsonl without the wall-clock fields.
fn metrics(dir: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    text.lines()
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
            let o = v.as_object_mut().unwrap();
            o.retain(|k, _| !k.starts_with("time_"));
            v
        })
        .collect()
}

fn run_to_end(cfg: &Path, out: &Path, resume: bool) {
    let mut c = arbor();
    c.arg("train").arg(cfg).arg("--out").arg(out);
    if resume {
        c.arg("--resume");
    }
    let o = c.output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// When the run is killed.
#[derive(Clone, Copy, Debug)]
enum KillAt {
    /// As soon as checkpoint `step-N` is complete.
    Checkpoint(u64),
    /// As soon as `metrics.jsonl` has N lines (step N is logged; its
    /// checkpoint, if it has one, is being written).
    Line(usize),
}

fn metrics_lines(out: &Path) -> usize {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .count()
}

fn kill_and_resume(config: &str, points: &[KillAt]) {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("cfg.toml");
    std::fs::write(&cfg, config).unwrap();
    let clean = tmp.path().join("clean");
    run_to_end(&cfg, &clean, false);
    let want = metrics(&clean);
    assert_eq!(want.len(), 6);

    // Kill at several moments: right when the first checkpoint appears,
    // between checkpoints, and while the next checkpoint is being written.
    for &at in points {
        let out = tmp.path().join(format!("killed-{at:?}"));
        let mut child = arbor()
            .arg("train")
            .arg(&cfg)
            .arg("--out")
            .arg(&out)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let t0 = Instant::now();
        let reached = || match at {
            KillAt::Checkpoint(n) => out
                .join(format!("checkpoints/step-{n:08}/trainer_state.json"))
                .exists(),
            KillAt::Line(n) => metrics_lines(&out) >= n,
        };
        while !reached() {
            assert!(
                child.try_wait().unwrap().is_none(),
                "{at:?}: the run ended before the kill point"
            );
            assert!(
                t0.elapsed() < Duration::from_secs(120),
                "{at:?}: not reached in 120 s"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
        let _ = child.kill(); // SIGKILL
        let _ = child.wait();
        let before = metrics_lines(&out);
        assert!(
            before < 6,
            "{at:?}: the run finished before it could be killed"
        );
        let resumable = std::fs::read_dir(out.join("checkpoints"))
            .unwrap()
            .filter_map(std::result::Result::ok)
            .any(|e| e.path().join("trainer_state.json").is_file());
        assert!(resumable, "{at:?}: no complete checkpoint to resume from");
        run_to_end(&cfg, &out, true);
        let got = metrics(&out);
        assert_eq!(got, want, "after a kill -9 at {at:?}");
        // Only complete checkpoints remain under their final names.
        for e in std::fs::read_dir(out.join("checkpoints")).unwrap() {
            let p = e.unwrap().path();
            let name = p.file_name().unwrap().to_string_lossy().to_string();
            if name.starts_with("step-") {
                assert!(
                    p.join("trainer_state.json").is_file(),
                    "{name} is incomplete"
                );
            }
        }
    }
}

#[test]
fn kill_9_then_resume_is_bit_exact() {
    kill_and_resume(
        CONFIG,
        &[KillAt::Checkpoint(2), KillAt::Line(3), KillAt::Line(4)],
    );
}

#[test]
fn kill_9_then_resume_is_bit_exact_with_prefix_sampling() {
    // The PS controller state (per-bucket ratios and EMAs) is checkpointed too.
    let ps = CONFIG
        .replace("algo = \"focus\"", "algo = \"ps\"")
        .replace("critic = \"separate\"", "critic = \"shared\"");
    kill_and_resume(&ps, &[KillAt::Checkpoint(2)]);
}

#[test]
fn kill_9_then_resume_is_bit_exact_with_critic_passes_and_replay() {
    // The replayed value targets (with the logprobs the surprise features
    // read), the critic's own optimizer step count and its surprise
    // weights are checkpointed too.
    let passes = CONFIG.replace(
        "[learner]",
        "[critic]\nepochs = 2\nminibatches = 2\nreplay_steps = 2\nsurprise = true\n\n[learner]",
    );
    kill_and_resume(&passes, &[KillAt::Checkpoint(2), KillAt::Line(3)]);
}

#[test]
fn kill_9_then_resume_is_bit_exact_in_mixed_precision() {
    // bf16 activations over f32 master weights: the checkpoint holds the
    // f32 weights and AdamW state, and the bf16 forward replays exactly.
    let mixed = CONFIG.replace("[learner]", "[learner]\nprecision = \"bf16\"");
    kill_and_resume(&mixed, &[KillAt::Checkpoint(2), KillAt::Line(3)]);
}

/// A run checkpointed without the critic's surprise features resumes with
/// them switched on: the new weights start at zero with zero optimizer
/// moments, and the next checkpoint holds them.
#[test]
fn a_resume_can_switch_the_critics_surprise_features_on() {
    let tmp = tempfile::tempdir().unwrap();
    let (cfg, out) = (tmp.path().join("cfg.toml"), tmp.path().join("out"));
    std::fs::write(&cfg, CONFIG.replace("steps = 6", "steps = 2")).unwrap();
    run_to_end(&cfg, &out, false);
    let critic = |step: u64| {
        std::fs::read(out.join(format!("checkpoints/step-{step:08}/critic.safetensors"))).unwrap()
    };
    let has = |bytes: &[u8]| bytes.windows(19).any(|w| w == b"value_head.surprise");
    assert!(!has(&critic(2)));
    std::fs::write(
        &cfg,
        CONFIG
            .replace("steps = 6", "steps = 4")
            .replace("[learner]", "[critic]\nsurprise = true\n\n[learner]"),
    )
    .unwrap();
    run_to_end(&cfg, &out, true);
    assert_eq!(metrics(&out).len(), 4);
    assert!(
        has(&critic(4)),
        "the resumed run checkpoints the new weights"
    );
}

#[test]
fn bad_configs_name_the_key() {
    let tmp = tempfile::tempdir().unwrap();
    let check = |text: &str, needle: &str| {
        let p = tmp.path().join("bad.toml");
        std::fs::write(&p, text).unwrap();
        let o = arbor()
            .arg("train")
            .arg(&p)
            .arg("--out")
            .arg(tmp.path().join("o"))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{err}");
        assert!(
            err.contains(needle) && err.contains("bad.toml"),
            "expected `{needle}` in: {err}"
        );
        assert!(!err.contains("panicked"), "{err}");
    };
    check(&CONFIG.replace("seed = 3", "seed = 3\nsede = 4"), "sede");
    check(&CONFIG.replace("steps = 6", "steps = \"six\""), "steps");
    check(
        &CONFIG.replace("prompts_per_step = 4", "prompts_per_step = 0"),
        "prompts_per_step",
    );
    check(
        &CONFIG.replace("difficulty = 3", "difficulty = 0"),
        "task.difficulty",
    );
    check(
        &CONFIG.replace("[learner]", "[critic]\nreplay_steps = 2\n\n[learner]"),
        "critic.replay_steps",
    );
    check(
        &CONFIG.replace("[learner]", "[critic]\nminibatches = 0\n\n[learner]"),
        "critic.minibatches",
    );
    check(
        &CONFIG
            .replace("algo = \"focus\"", "algo = \"grpo\"")
            .replace("critic = \"separate\"", "critic = \"shared\"")
            .replace("[learner]", "[critic]\nepochs = 1\n\n[learner]"),
        "critic.epochs",
    );
    check(
        &CONFIG.replace(
            "[learner]",
            "[critic]\nepochs = 1\n\n[learner]\nvalue_coef = 0.0",
        ),
        "critic.epochs",
    );
    check(
        &CONFIG.replace("[warmup]", "[warmup]\nlearning = 1"),
        "learning",
    );
    check(
        &CONFIG.replace("seed = 3", "seed = 3\ndevice = \"gpu\""),
        "device",
    );
    if !cfg!(feature = "cuda") {
        // A CUDA device in a CPU build: one clear error naming the key.
        check(
            &CONFIG.replace("seed = 3", "seed = 3\ndevice = \"cuda\""),
            "device",
        );
    }
    let o = arbor().arg("train").arg("/no/such.toml").output().unwrap();
    assert!(String::from_utf8_lossy(&o.stderr).contains("/no/such.toml"));
}
