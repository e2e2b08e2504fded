//! `arbor train` on a math dataset with an HF-format checkpoint and the real
//! Qwen3 tokenizer / chat format (a random full-vocabulary model: the point
//! is the plumbing, not the learning). Skipped without ../shared/data.

mod common;

use common::{arbor, tiny_qwen3_with_tokenizer};

#[test]
fn math_training_runs_for_every_algorithm() {
    let Some(model) = tiny_qwen3_with_tokenizer() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("probs.jsonl");
    std::fs::write(
        &data,
        "{\"question\": \"What is 2+2?\", \"answer\": \"#### 4\"}\n{\"question\": \"What is 3*3?\", \"answer\": \"#### 9\"}\n{\"question\": \"What is 10-7?\", \"answer\": \"#### 3\"}\n",
    )
    .unwrap();
    for algo in ["grpo", "focus", "ps"] {
        let critic = if algo == "focus" {
            "separate"
        } else {
            "shared"
        };
        let cfg = format!(
            r#"
seed = 0
steps = 2
algo = "{algo}"
prompts_per_step = 2
samples_per_prompt = 4
eval_every = 2
eval_tasks = 3
checkpoint_every = 2

[model]
path = "{model}"

[task]
kind = "math"
train = "{data}"
eval = "{data}"
max_tokens = 6

[learner]
critic = "{critic}"
"#,
            model = model.path().display(),
            data = data.display()
        );
        let p = dir.path().join(format!("{algo}.toml"));
        std::fs::write(&p, cfg).unwrap();
        let out = dir.path().join(format!("run-{algo}"));
        let o = arbor(&["train", p.to_str().unwrap(), "--out", out.to_str().unwrap()]);
        assert!(
            o.status.success(),
            "{algo}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let lines = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
        assert_eq!(lines.lines().count(), 2, "{algo}");
        for l in lines.lines() {
            let m: serde_json::Value = serde_json::from_str(l).unwrap();
            assert!(m["generated_tokens"].as_u64().unwrap() > 0, "{algo}: {m}");
        }
        // The checkpoint's policy loads as an HF model.
        let ckpt = out.join("checkpoints/step-00000002/policy");
        let o = arbor(&[
            "score",
            "--model",
            ckpt.to_str().unwrap(),
            "--tokens",
            "1,2,3",
            "--json",
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
}
