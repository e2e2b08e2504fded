//! Every algorithm runs through the trainer on the synthetic task, trains
//! on policy tokens and moves the policy's weights.

use arbor_train::{read_metrics, TrainConfig, Trainer};

/// Three steps: GRPO and PS train only on groups with signal, and two
/// steps of 4 prompts can come out all-fail then all-pass.
fn config(algo: &str, critic: &str) -> String {
    format!(
        r#"
seed = 2
steps = 3
algo = "{algo}"
prompts_per_step = 4
samples_per_prompt = 3
eval_every = 2
eval_tasks = 4
checkpoint_every = 0

[task]
kind = "running_sum"
difficulty = 3

[warmup]
steps = 200
batch = 8

[learner]
critic = "{critic}"
"#
    )
}

#[test]
fn every_algorithm_trains() {
    for (algo, critic) in [
        ("focus", "separate"),
        ("ppo", "separate"),
        ("ppo", "shared"),
        ("grpo", "shared"),
        ("ps", "shared"),
        ("vineppo", "shared"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let cfg = TrainConfig::from_toml(&config(algo, critic), "test").unwrap();
        let mut t = Trainer::new(cfg, dir.path(), false).unwrap();
        t.warmup(|_, _| {}).unwrap();
        let before = policy_weights(&t);
        t.run(|_| {}).unwrap();
        let after = policy_weights(&t);
        let ms = read_metrics(&dir.path().join("metrics.jsonl")).unwrap();
        assert_eq!(ms.len(), 3, "{algo}");
        assert!(ms.iter().all(|m| m.generated_tokens > 0), "{algo}: {ms:?}");
        assert!(
            ms.iter().any(|m| m.trained_tokens > 0 && m.grad_norm > 0.0),
            "{algo}: no policy token was trained: {ms:?}"
        );
        let moved = before
            .iter()
            .zip(&after)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(
            moved > 0.0,
            "{algo}: the RL steps left the policy unchanged"
        );
        if algo == "vineppo" {
            // Main rollouts plus Monte-Carlo continuations at every state.
            assert!(
                ms[0].continuations > 4 * 3,
                "{algo}: {}",
                ms[0].continuations
            );
        }
        if algo == "ppo" || algo == "focus" {
            assert!(
                ms.iter().any(|m| m.value_loss > 0.0),
                "{algo}: critic not trained"
            );
        }
    }
}

#[test]
fn vineppo_and_grpo_refuse_a_separate_critic() {
    for algo in ["vineppo", "grpo", "ps"] {
        let e = TrainConfig::from_toml(&config(algo, "separate"), "cfg.toml").unwrap_err();
        assert!(e.to_string().contains("learner.critic"), "{e}");
    }
}

/// The register task trains through the stateful tool: every action is a
/// tool call, counted per finished episode (FOCUS forks included, PS replays
/// through execution). The running-sum task calls no tools.
#[test]
fn tool_task_reports_tool_calls_per_episode() {
    for algo in ["focus", "ps"] {
        let text = config(
            algo,
            if algo == "focus" {
                "separate"
            } else {
                "shared"
            },
        )
        .replace(
            "kind = \"running_sum\"\ndifficulty = 3",
            "kind = \"register\"\ndifficulty = 3\nsubtract = true",
        );
        let dir = tempfile::tempdir().unwrap();
        let cfg = TrainConfig::from_toml(&text, "test").unwrap();
        let mut t = Trainer::new(cfg, dir.path(), false).unwrap();
        t.warmup(|_, _| {}).unwrap();
        t.run(|_| {}).unwrap();
        let ms = read_metrics(&dir.path().join("metrics.jsonl")).unwrap();
        for m in &ms {
            // Malformed actions are no tool calls; an episode has at most
            // 3k = 9 steps, and a rewarded one made at least its 3 adds.
            assert!(
                m.tool_calls_per_episode > 0.0 && m.tool_calls_per_episode <= 9.0,
                "{algo}: {m:?}"
            );
            if m.pass_rate == 1.0 {
                assert!(m.tool_calls_per_episode >= 3.0, "{algo}: {m:?}");
            }
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let cfg = TrainConfig::from_toml(&config("grpo", "shared"), "test").unwrap();
    let mut t = Trainer::new(cfg, dir.path(), false).unwrap();
    t.run(|_| {}).unwrap();
    let ms = read_metrics(&dir.path().join("metrics.jsonl")).unwrap();
    assert!(ms.iter().all(|m| m.tool_calls_per_episode == 0.0));
}

/// LoRA on the policy: only adapters (and the value head) train, the run
/// learns through them, and resuming from a checkpoint (base rebuilt, adapters
/// loaded from `policy_lora.safetensors`) continues exactly like an
/// uninterrupted run. The exported `policy/` is the merged model.
#[test]
fn lora_policy_trains_and_resumes_exactly() {
    let text = config("grpo", "shared")
        .replace("steps = 2\n", "steps = 3\n")
        .replace("checkpoint_every = 0", "checkpoint_every = 1")
        .replace("[task]", "[model.lora]\nrank = 4\nalpha = 8.0\n\n[task]");
    let full = tempfile::tempdir().unwrap();
    let cfg = TrainConfig::from_toml(&text, "test").unwrap();
    let mut t = Trainer::new(cfg.clone(), full.path(), false).unwrap();
    let names: Vec<String> = t
        .learner
        .policy_trainable_tensors()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert!(!names.is_empty());
    assert!(
        names.iter().all(|n| n.contains(".lora_A.")
            || n.contains(".lora_B.")
            || n.starts_with("value_head.")),
        "{names:?}"
    );
    let mut nll = Vec::new();
    t.warmup(|_, l| nll.push(l)).unwrap();
    // The adapters alone learn the demonstrations.
    assert!(nll.last().unwrap() < &(0.9 * nll[0]), "warm-up NLL {nll:?}");
    t.run(|_| {}).unwrap();
    let want = read_metrics(&full.path().join("metrics.jsonl")).unwrap();
    assert!(full
        .path()
        .join("checkpoints/step-00000003/policy_lora.safetensors")
        .is_file());
    // Interrupted after step 2 (the step-3 checkpoint removed), then resumed.
    let part = tempfile::tempdir().unwrap();
    let mut t = Trainer::new(cfg.clone(), part.path(), false).unwrap();
    t.warmup(|_, _| {}).unwrap();
    t.run(|_| {}).unwrap();
    std::fs::remove_dir_all(part.path().join("checkpoints/step-00000003")).unwrap();
    let mut t = Trainer::new(cfg, part.path(), true).unwrap();
    assert_eq!(t.step(), 2);
    t.run(|_| {}).unwrap();
    let got = read_metrics(&part.path().join("metrics.jsonl")).unwrap();
    assert_eq!(got.len(), 3);
    let strip = |m: &arbor_train::StepMetrics| {
        let mut m = m.clone();
        m.time_generate_s = 0.0;
        m.time_env_s = 0.0;
        m.time_train_s = 0.0;
        m.time_rollout_s = 0.0;
        m.time_engine_idle_s = 0.0;
        m
    };
    assert_eq!(strip(&got[2]), strip(&want[2]), "step 3 after resume");
}

/// Every policy parameter, flattened in name order.
fn policy_weights(t: &Trainer) -> Vec<f32> {
    let data = t.learner.policy_vars.data().lock().unwrap();
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    names
        .into_iter()
        .flat_map(|n| {
            data[n]
                .as_tensor()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        })
        .collect()
}

/// The critic probe freezes the policy (its weights do not move), samples
/// every state of one trajectory per task with its continuations, and
/// fits the critic: the value loss falls and the training states' rank
/// correlation rises over the epochs.
#[test]
fn the_critic_probe_fits_the_critic_and_leaves_the_policy() {
    use arbor_train::probe::{ProbeOptions, ProbeTarget};
    let dir = tempfile::tempdir().unwrap();
    let cfg = TrainConfig::from_toml(&config("focus", "separate"), "test").unwrap();
    let mut t = Trainer::new(cfg, dir.path(), false).unwrap();
    t.warmup(|_, _| {}).unwrap();
    let before = policy_weights(&t);
    let o = ProbeOptions {
        train_tasks: 24,
        test_tasks: 8,
        samples: 4,
        epochs: 30,
        batch_states: 16,
        target: ProbeTarget::MonteCarlo,
        eval_every: 10,
        ..Default::default()
    };
    let r = t.critic_probe(&o).unwrap();
    assert_eq!(policy_weights(&t), before, "the probe moved the policy");
    // Difficulty 3: the prompt and the states after turns 1 and 2 (fewer
    // where an episode stops early), one trajectory per task.
    assert!(r.train_states > 24 && r.train_states <= 72, "{r:?}");
    assert!(r.test_states > 8 && r.test_states <= 24, "{r:?}");
    let epochs: Vec<usize> = r.curve.iter().map(|e| e.epoch).collect();
    assert_eq!(epochs, vec![0, 10, 20, 30]);
    let (first, last) = (&r.curve[1], &r.curve[3]);
    assert!(last.value_loss < first.value_loss, "{r:?}");
    assert!(
        last.train_rank.unwrap() > r.curve[0].train_rank.unwrap_or(-1.0),
        "{r:?}"
    );
    // The same options give the same report (the probe's own seeds).
    let dir2 = tempfile::tempdir().unwrap();
    let mut t2 = Trainer::new(
        TrainConfig::from_toml(&config("focus", "separate"), "test").unwrap(),
        dir2.path(),
        false,
    )
    .unwrap();
    t2.warmup(|_, _| {}).unwrap();
    let r2 = t2.critic_probe(&o).unwrap();
    assert_eq!(r2.curve, r.curve);
    assert_eq!(r2.split_half_rank, r.split_half_rank);
}
