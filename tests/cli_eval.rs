//! `arbor eval` end to end on a custom JSONL (pass@k, tokens per problem,
//! per-sample output), and its errors.

mod common;

use common::{arbor, fixtures, tiny_qwen3_with_tokenizer};

#[test]
fn eval_reports_accuracy_pass_at_k_and_samples() {
    let Some(model) = tiny_qwen3_with_tokenizer() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("probs.jsonl");
    std::fs::write(
        &data,
        "{\"question\": \"What is 2+2?\", \"answer\": \"#### 4\"}\n{\"question\": \"What is 3*3?\", \"answer\": \"#### 9\"}\n",
    )
    .unwrap();
    let out = dir.path().join("samples.jsonl");
    let o = arbor(&[
        "eval",
        "--model",
        model.path().to_str().unwrap(),
        "--dataset",
        data.to_str().unwrap(),
        "--n",
        "4",
        "--max-tokens",
        "6",
        "--json",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let s: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(s["problems"], 2);
    assert_eq!(s["samples_per_problem"], 4);
    let ks: Vec<u64> = s["pass_at_k"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p[0].as_u64().unwrap())
        .collect();
    assert_eq!(ks, vec![1, 2, 4]);
    let acc = s["accuracy"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&acc));
    // pass@1 is the accuracy.
    assert!((s["pass_at_k"][0][1].as_f64().unwrap() - acc).abs() < 1e-12);
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&out)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 8);
    assert!(lines
        .iter()
        .all(|l| l["tokens"].as_u64().unwrap() <= 6 && l["reference"].is_string()));
}

#[test]
fn eval_errors_are_clear() {
    let model = fixtures().join("qwen2");
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("p.jsonl");
    std::fs::write(&data, "{\"question\": \"q\", \"answer\": \"#### 1\"}\n").unwrap();
    let o = arbor(&[
        "eval",
        "--model",
        model.to_str().unwrap(),
        "--dataset",
        data.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1));
    assert!(err.contains("tokenizer.json"), "{err}");
    let o = arbor(&[
        "eval",
        "--model",
        model.to_str().unwrap(),
        "--dataset",
        "/no/such.jsonl",
    ]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("/no/such.jsonl"));
    let o = arbor(&[
        "eval",
        "--model",
        model.to_str().unwrap(),
        "--dataset",
        data.to_str().unwrap(),
        "--n",
        "3",
        "--temperature",
        "0",
    ]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("greedy"));
}

/// `arbor eval --swe` on toy SWE instances (a random model makes no valid
/// tool call, so every episode scores 0): one row per task with samples,
/// turns and tokens, and the summary.
#[test]
fn eval_swe_reports_pass_rate_turns_and_tokens() {
    let Some(model) = tiny_qwen3_with_tokenizer() else {
        return;
    };
    let sandboxed = arbor_env::swe::bubblewrap_works();
    if !sandboxed && arbor_env::data::ci() {
        panic!("bubblewrap cannot run here (CI=true requires it)");
    }
    let dir = tempfile::tempdir().unwrap();
    let mut rows = String::new();
    for id in ["calc-a", "calc-b"] {
        rows.push_str(
            &serde_json::json!({
                "instance_id": id,
                "repo": format!("toy/{id}"),
                "problem_statement": "add(2, 3) returns -1 instead of 5.",
                "FAIL_TO_PASS": ["test_calc.py"],
                "test_patch": "diff --git a/test_calc.py b/test_calc.py\nnew file mode 100644\n--- /dev/null\n+++ b/test_calc.py\n@@ -0,0 +1,2 @@\n+from calc import add\n+assert add(2, 3) == 5\n",
                "test_cmd": "python3 {test}",
            })
            .to_string(),
        );
        rows.push('\n');
        let repo = dir.path().join("repos").join(id);
        std::fs::create_dir_all(&repo).unwrap();
        std::fs::write(repo.join("calc.py"), "def add(a, b):\n    return a - b\n").unwrap();
    }
    let inst = dir.path().join("instances.jsonl");
    std::fs::write(&inst, rows).unwrap();
    let out = dir.path().join("per-task.jsonl");
    let mut args = vec![
        "eval",
        "--model",
        model.path().to_str().unwrap(),
        "--swe",
        inst.to_str().unwrap(),
        "--n",
        "2",
        "--temperature",
        "1.0",
        "--max-turns",
        "2",
        "--max-tokens",
        "8",
        "--json",
        "--out",
        out.to_str().unwrap(),
    ];
    if !sandboxed {
        args.push("--unsandboxed");
    }
    let o = arbor(&args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let s: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(s["tasks"], 2);
    assert_eq!(s["samples_per_task"], 2);
    assert_eq!(s["pass_rate"], 0.0);
    let per = s["per_task"].as_array().unwrap();
    assert_eq!(per[0]["id"], "calc-a");
    for t in per {
        assert_eq!(t["samples"], 2);
        let turns = t["turns"].as_f64().unwrap();
        assert!((1.0..=2.0).contains(&turns), "{t}");
        let toks = t["generated_tokens"].as_f64().unwrap();
        assert!((1.0..=16.0).contains(&toks), "{t}");
    }
    assert_eq!(std::fs::read_to_string(&out).unwrap().lines().count(), 2);
    // --swe and --dataset exclude each other; one of them is required.
    let o = arbor(&["eval", "--model", "m"]);
    assert!(!o.status.success());
}
