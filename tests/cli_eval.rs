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
