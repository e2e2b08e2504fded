//! `arbor score` end to end: the JSON contract against the HF fixtures, and
//! clear errors (exit 1, no panic) on bad input.

mod common;

use common::{arbor, fixtures, tiny_qwen3_with_tokenizer};

fn reference(name: &str) -> serde_json::Value {
    serde_json::from_str(
        &std::fs::read_to_string(fixtures().join(name).join("reference.json")).unwrap(),
    )
    .unwrap()
}

#[test]
fn score_json_matches_hf_reference() {
    for name in ["qwen2", "qwen3", "llama"] {
        let r = reference(name);
        let seq = &r["sequences"][0];
        let toks: Vec<String> = seq["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(std::string::ToString::to_string)
            .collect();
        let model = fixtures().join(name);
        let out = arbor(&[
            "score",
            "--model",
            model.to_str().unwrap(),
            "--tokens",
            &toks.join(","),
            "--json",
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let got: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let keys: Vec<&String> = got.as_object().unwrap().keys().collect();
        assert_eq!(keys, ["tokens", "logprobs", "greedy"]);
        assert_eq!(got["tokens"], seq["tokens"]);
        assert_eq!(got["greedy"], seq["greedy"]);
        let (a, b) = (
            got["logprobs"].as_array().unwrap(),
            seq["logprobs"].as_array().unwrap(),
        );
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert!(
                (x.as_f64().unwrap() - y.as_f64().unwrap()).abs() <= 1e-4,
                "{name}: {x} vs {y}"
            );
        }
    }
}

#[test]
fn score_table_output_reads_well() {
    let model = fixtures().join("qwen2");
    let out = arbor(&[
        "score",
        "--model",
        model.to_str().unwrap(),
        "--tokens",
        "5,6,7,8",
    ]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("logp(next)") && text.contains("perplexity"),
        "{text}"
    );
    assert_eq!(
        text.lines()
            .filter(|l| l.trim_start().starts_with(char::is_numeric))
            .count(),
        4
    );
}

fn assert_clean_error(out: &std::process::Output, needle: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.contains(needle), "expected `{needle}` in: {err}");
}

#[test]
fn score_errors_are_clear() {
    let model = fixtures().join("qwen2");
    let m = model.to_str().unwrap();
    assert_clean_error(
        &arbor(&["score", "--model", "/no/such/model", "--tokens", "1,2"]),
        "/no/such/model",
    );
    assert_clean_error(
        &arbor(&["score", "--model", m, "--tokens", "1,99999"]),
        "99999",
    );
    assert_clean_error(
        &arbor(&["score", "--model", m, "--text", "hello"]),
        "tokenizer.json",
    );
    assert_clean_error(
        &arbor(&["score", "--model", m, "--tokens", "1", "--dtype", "f8"]),
        "f8",
    );
    // clap rejects a missing input with its usage error (exit 2).
    let out = arbor(&["score", "--model", m]);
    assert_eq!(out.status.code(), Some(2));
}

/// `--text --chat` through the real Qwen3 tokenizer and chat template on a
/// random full-vocabulary Qwen3-architecture model (needs ../shared/data for
/// the tokenizer; skipped without it).
#[test]
fn score_text_chat_uses_real_tokenizer_and_template() {
    let Some(dir) = tiny_qwen3_with_tokenizer() else {
        return;
    };
    let chat: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("chat/qwen3_chat.json")).unwrap(),
    )
    .unwrap();
    let case = chat["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "thinking_default")
        .unwrap();
    let text = case["messages"][0]["content"].as_str().unwrap();
    let out = arbor(&[
        "score",
        "--model",
        dir.path().to_str().unwrap(),
        "--text",
        text,
        "--chat",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(got["tokens"], case["token_ids"]);
    // Plain --text goes through the tokenizer too, and the table shows the pieces.
    let out = arbor(&[
        "score",
        "--model",
        dir.path().to_str().unwrap(),
        "--text",
        "1 + 1 =",
    ]);
    assert!(out.status.success());
    let table = String::from_utf8(out.stdout).unwrap();
    assert!(
        table.contains("greedy text") && table.contains("\" +\""),
        "{table}"
    );
}
