//! Prefix Sampling through the trainer: skewed groups get re-rollouts that
//! replay prefixes of their own trajectories (masked), the controller state
//! is updated and checkpointed.

use arbor_train::{read_metrics, TrainConfig, Trainer};

const CONFIG: &str = r#"
seed = 1
steps = 4
algo = "ps"
prompts_per_step = 8
samples_per_prompt = 8
eval_every = 4
eval_tasks = 8
checkpoint_every = 4

[task]
kind = "running_sum"
difficulty = 4

[warmup]
steps = 240
batch = 16

[ps.controller]
eta = 0.2
"#;

#[test]
fn ps_replays_prefixes_and_updates_the_controller() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = TrainConfig::from_toml(CONFIG, "test").unwrap();
    let mut t = Trainer::new(cfg, dir.path(), false).unwrap();
    t.warmup(|_, _| {}).unwrap();
    t.run(|_| {}).unwrap();
    let ms = read_metrics(&dir.path().join("metrics.jsonl")).unwrap();
    // The generated tokens are held to the GRPO baseline's budget (8 prompts
    // x 8 samples at the first pass's mean length; the first pass runs on 6
    // prompts). Re-rollout costs are estimated when planned, so allow 5%.
    for m in &ms {
        let b = m.budget_tokens.expect("budget reported");
        assert!(m.generated_tokens as f64 <= 1.05 * b as f64, "{m:?}");
        assert_eq!(m.episodes, 48, "first pass on (1 - reserve) of the prompts");
    }
    let replayed: u64 = ms.iter().map(|m| m.replayed_tokens).sum();
    assert!(replayed > 0, "no prefix was replayed: {ms:?}");
    // Re-rollouts are extra continuations beyond the first-pass groups.
    assert!(ms.iter().any(|m| m.continuations > 48));
    let state = std::fs::read_to_string(
        dir.path()
            .join("checkpoints/step-00000004/trainer_state.json"),
    )
    .unwrap();
    let v: serde_json::Value = serde_json::from_str(&state).unwrap();
    let buckets = v["ps_buckets"].as_array().unwrap();
    assert!(!buckets.is_empty(), "controller state not checkpointed");
    for b in buckets {
        assert!(b[1]["updates"].as_u64().unwrap() >= 1);
    }
}

#[test]
fn bad_ps_settings_name_the_key() {
    let e = TrainConfig::from_toml(
        &CONFIG.replace("eta = 0.2", "eta = 0.2\nspeed = 3"),
        "cfg.toml",
    )
    .unwrap_err();
    assert!(e.to_string().contains("speed"), "{e}");
    let e = TrainConfig::from_toml(
        &CONFIG.replace("samples_per_prompt = 8", "samples_per_prompt = 1"),
        "cfg.toml",
    )
    .unwrap_err();
    assert!(e.to_string().contains("samples_per_prompt"), "{e}");
}

/// Every shipped config parses and validates.
#[test]
fn shipped_configs_parse() {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../configs");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "toml") {
            let text = std::fs::read_to_string(&p).unwrap();
            TrainConfig::from_toml(&text, &p.display().to_string())
                .unwrap_or_else(|e| panic!("{e}"));
            n += 1;
        }
    }
    assert!(n >= 7, "{n} configs");
}

/// A single-turn task: Prefix Sampling cuts inside the one response
/// (`cut = "auto"` resolves to tokens), replays the head, and reports the
/// first pass apart from the re-rollouts.
#[test]
fn single_turn_tasks_replay_token_prefixes() {
    let text = r#"
seed = 2
steps = 3
algo = "ps"
prompts_per_step = 8
samples_per_prompt = 8
eval_every = 3
eval_tasks = 8
checkpoint_every = 0

[task]
kind = "running_sum"
difficulty = 3
one_turn = true

[warmup]
steps = 600
batch = 16
stop_at_eval = 0.4
check_every = 20

[ps]
sources = 2
"#;
    let dir = tempfile::tempdir().unwrap();
    let cfg = TrainConfig::from_toml(text, "test").unwrap();
    let mut t = Trainer::new(cfg, dir.path(), false).unwrap();
    t.warmup(|_, _| {}).unwrap();
    t.run(|_| {}).unwrap();
    let ms = read_metrics(&dir.path().join("metrics.jsonl")).unwrap();
    let mut groups = 0;
    for m in &ms {
        let ps = m.ps.as_ref().expect("PS reports its step");
        // Training reward and pass rate are the first pass's (6 tasks x 8).
        assert_eq!(m.episodes, 48);
        assert!(
            (m.pass_rate - ps.first_pass_pass_rate).abs() < 1e-12,
            "{m:?}"
        );
        assert_eq!(
            ps.groups_degenerate + ps.groups_balanced + ps.groups_skewed,
            6,
            "{ps:?}"
        );
        // Every re-rollout group is either trained (mixed outcomes) or not,
        // and each trained one is a group of its own in the update (two
        // sources of one task are two groups), beside the kept first-pass
        // groups.
        assert_eq!(ps.reroll_groups, ps.reroll_trained + ps.reroll_degenerate);
        assert_eq!(
            m.effective_groups,
            ps.groups_balanced + ps.groups_skewed + ps.reroll_trained,
            "{ps:?}"
        );
        assert_eq!(ps.replay_failed + ps.replay_diverged, 0);
        groups += ps.reroll_groups;
        if ps.reroll_groups > 0 {
            // One-segment episodes: a replayed prefix is a head inside the
            // response, fewer tokens than the response (3 sums + <eos>).
            assert!(m.replayed_tokens > 0);
            assert!(
                m.replayed_tokens < 4 * (m.continuations - 48) as u64,
                "{m:?}"
            );
        }
    }
    assert!(
        groups > 0,
        "no re-rollout group in {} steps: {ms:?}",
        ms.len()
    );
}

/// With `keep_skewed = false` the re-rollouts replace a skewed group, and a
/// skewed group that got no trained re-rollout group trains as it is: every
/// group with contrast reaches the update.
#[test]
fn replaced_groups_without_a_trained_rerollout_group_train_as_they_are() {
    let dir = tempfile::tempdir().unwrap();
    let text = CONFIG.replace(
        "[ps.controller]",
        "[ps]\nkeep_skewed = false\n\n[ps.controller]",
    );
    let cfg = TrainConfig::from_toml(&text, "test").unwrap();
    assert!(!cfg.ps.keep_skewed);
    let mut t = Trainer::new(cfg, dir.path(), false).unwrap();
    t.warmup(|_, _| {}).unwrap();
    t.run(|_| {}).unwrap();
    for m in read_metrics(&dir.path().join("metrics.jsonl")).unwrap() {
        let ps = m.ps.expect("PS report");
        // Skewed groups served by a trained re-rollout group (one source
        // each) are replaced; the others train as they are.
        assert_eq!(
            m.effective_groups,
            ps.groups_balanced + ps.groups_skewed,
            "{ps:?}"
        );
    }
}

/// A stateful tool task (the register lives in the environment): replay
/// through execution re-runs the prefix's tool calls on a fresh episode,
/// and every replay reproduces the recorded observations.
#[test]
fn stateful_replays_rebuild_the_tool_state_through_execution() {
    let text = CONFIG
        .replace(
            "kind = \"running_sum\"\ndifficulty = 4",
            "kind = \"register\"\ndifficulty = 6",
        )
        .replace("steps = 4\n", "steps = 3\n")
        // Stop the warm-up early, so groups still disagree.
        .replace(
            "steps = 240\n",
            "steps = 240\nstop_at_eval = 0.3\ncheck_every = 10\n",
        );
    let dir = tempfile::tempdir().unwrap();
    let cfg = TrainConfig::from_toml(&text, "test").unwrap();
    let mut t = Trainer::new(cfg, dir.path(), false).unwrap();
    t.warmup(|_, _| {}).unwrap();
    t.run(|_| {}).unwrap();
    let ms = read_metrics(&dir.path().join("metrics.jsonl")).unwrap();
    let ps: Vec<_> = ms
        .iter()
        .map(|m| m.ps.clone().expect("PS report"))
        .collect();
    let groups: usize = ps.iter().map(|p| p.reroll_groups).sum();
    assert!(groups > 0, "no re-rollouts: {ps:?}");
    assert!(ms.iter().any(|m| m.replayed_tokens > 0));
    for p in &ps {
        assert_eq!((p.replay_failed, p.replay_diverged), (0, 0), "{p:?}");
    }
}
