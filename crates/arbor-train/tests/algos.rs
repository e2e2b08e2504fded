//! Every algorithm runs through the trainer on the synthetic task and
//! trains on policy tokens.

use arbor_train::run::{read_metrics, TrainConfig, Trainer};

fn config(algo: &str, critic: &str) -> String {
    format!(
        r#"
seed = 2
steps = 2
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
steps = 20
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
        t.run(|_| {}).unwrap();
        let ms = read_metrics(&dir.path().join("metrics.jsonl")).unwrap();
        assert_eq!(ms.len(), 2, "{algo}");
        assert!(ms.iter().all(|m| m.generated_tokens > 0), "{algo}: {ms:?}");
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
        let text = config(algo, if algo == "focus" { "separate" } else { "shared" }).replace(
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
