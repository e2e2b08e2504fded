//! A SWE task's multi-turn token stream through the trainer's episode
//! adapter: the policy closes its turn with `<|im_end|>` (the engine keeps
//! the stop token), and the observation continues the chat without a second
//! `<|im_end|>`. Needs the Qwen3 tokenizer from the shared data (SKIP
//! otherwise; a failure under `CI=true`, where bubblewrap is required too).

use arbor_train::tasks::{TaskConfig, TaskSampler};

#[test]
fn swe_turn_is_closed_once() {
    let Some(tok) =
        arbor_env::data::shared_data("tokenizers/qwen3/tokenizer.json", "swe_turn_is_closed_once")
    else {
        return;
    };
    let tok = arbor_model::Tokenizer::from_file(&tok).unwrap();
    let im_end = tok.token_to_id("<|im_end|>").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut lines = String::new();
    for id in ["t-a", "t-b"] {
        lines.push_str(
            &serde_json::json!({
                "instance_id": id, "repo": format!("toy/{id}"),
                "problem_statement": "fix it", "FAIL_TO_PASS": ["test_x.py"],
                "test_cmd": "python3 {test}",
            })
            .to_string(),
        );
        lines.push('\n');
        let repo = dir.path().join("repos").join(id);
        std::fs::create_dir_all(&repo).unwrap();
        std::fs::write(repo.join("x.py"), "X = 1\n").unwrap();
    }
    let inst = dir.path().join("instances.jsonl");
    std::fs::write(&inst, lines).unwrap();
    let sandboxed = arbor_env::swe::bubblewrap_works();
    assert!(
        sandboxed || !arbor_env::data::ci(),
        "bubblewrap cannot run here (CI=true requires it)"
    );
    let cfg = TaskConfig::Swe {
        instances: inst.display().to_string(),
        repos: None,
        holdout_every: 2,
        max_tokens: 64,
        max_turns: 4,
        allow_unsandboxed: !sandboxed,
    };
    let sampler = TaskSampler::new(cfg, 0, Some(tok.clone()), vec![im_end]).unwrap();
    let mut task = sampler.train_task(0).unwrap();
    let mut action = tok
        .encode(
            "<tool_call>\n{\"name\": \"nope\", \"arguments\": {}}\n</tool_call>",
            false,
        )
        .unwrap();
    action.push(im_end);
    let out = task.episode.step(&action).unwrap();
    assert!(out.reward.is_none());
    let mut ctx = task.prompt.clone();
    ctx.extend(&action);
    ctx.extend(&out.observation);
    let text = tok.decode(&ctx, false).unwrap();
    assert!(
        text.contains("</tool_call><|im_end|>\n<|im_start|>user"),
        "the turn must be closed exactly once: {text}"
    );
    assert!(!text.contains("<|im_end|><|im_end|>"), "{text}");
}
