//! `arbor generate` end to end: the `--json` contract against HF
//! transformers' greedy generations on the committed fixtures, and one
//! clear error (exit 1, no panic) naming the file and line, flag or setting
//! for each bad input.

mod common;

use common::{arbor, fixtures};

fn reference(name: &str) -> serde_json::Value {
    serde_json::from_str(
        &std::fs::read_to_string(fixtures().join(name).join("reference.json")).unwrap(),
    )
    .unwrap()
}

/// A JSONL prompt file in a temp dir (kept alive by the returned guard).
fn prompts_file(lines: &[String]) -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("prompts.jsonl");
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    let p = path.to_str().unwrap().to_string();
    (dir, p)
}

#[test]
fn json_rows_match_hf_greedy_generations() {
    for name in ["qwen2", "qwen3", "llama"] {
        let r = reference(name);
        let gens = r["generate"].as_array().unwrap();
        let lines: Vec<String> = gens
            .iter()
            .map(|g| serde_json::json!({ "tokens": g["prompt"] }).to_string())
            .collect();
        let (_dir, file) = prompts_file(&lines);
        let out = generate(
            name,
            &file,
            &[
                "--n",
                "2",
                "--temperature",
                "0",
                "--max-tokens",
                "8",
                "--ignore-eos",
                "--json",
            ],
        );
        assert!(
            out.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let rows: Vec<serde_json::Value> = String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(
            rows.len(),
            2 * gens.len(),
            "{name}: one row per prompt and sample"
        );
        for (k, row) in rows.iter().enumerate() {
            let keys: Vec<&String> = row.as_object().unwrap().keys().collect();
            assert_eq!(
                keys,
                [
                    "prompt_index",
                    "sample",
                    "tokens",
                    "text",
                    "logprobs",
                    "finish_reason"
                ]
            );
            let (i, j) = (k / 2, k % 2);
            assert_eq!(row["prompt_index"], i);
            assert_eq!(row["sample"], j);
            // Greedy: both samples are HF's greedy continuation.
            assert_eq!(row["tokens"], gens[i]["greedy_tokens"], "{name} prompt {i}");
            let lps = row["logprobs"].as_array().unwrap();
            assert_eq!(lps.len(), 8);
            assert!(lps.iter().all(|x| x.as_f64().unwrap() <= 0.0));
            assert_eq!(row["finish_reason"], "length");
            // No tokenizer.json in the fixtures: no text.
            assert!(row["text"].is_null());
        }
    }
}

/// Runs `arbor generate` on fixture `name` with the prompts of `file`.
fn generate(name: &str, file: &str, flags: &[&str]) -> std::process::Output {
    let model = fixtures().join(name);
    let mut args = vec![
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompts",
        file,
    ];
    args.extend_from_slice(flags);
    arbor(&args)
}

/// Runs `arbor generate` on the qwen2 fixture (context 256) with `args`
/// and returns stderr, asserting a clean failure.
fn fails(args: &[&str]) -> String {
    let model = fixtures().join("qwen2");
    let mut all = vec!["generate", "--model", model.to_str().unwrap()];
    all.extend_from_slice(args);
    let out = arbor(&all);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "{args:?} succeeded");
    assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
    assert!(!err.contains("panicked"), "{args:?}: {err}");
    err
}

#[test]
fn bad_prompt_files_name_the_file_and_line() {
    let ok = r#"{"tokens": [1, 2, 3]}"#.to_string();
    let cases = [
        // A token id past u32 is refused, not wrapped to a small id.
        (r#"{"tokens": [4294967296]}"#.to_string(), "token ids"),
        (r#"{"tokens": [1, -2]}"#.to_string(), "token ids"),
        (r#"{"tokens": [1, 999]}"#.to_string(), "999"),
        (r#"{"tokens": []}"#.to_string(), "empty prompt"),
        (
            serde_json::json!({ "tokens": vec![7; 300] }).to_string(),
            "300 tokens",
        ),
        (r#"{"tokens": [1, 2"#.to_string(), "malformed JSON"),
        (r#"{"text": "hi"}"#.to_string(), "expected a `prompt`"),
        (r#"[1, 2]"#.to_string(), "expected an object"),
        // One prompt a line: two keys are ambiguous, a mistyped one is named.
        (
            r#"{"prompt": "hi", "tokens": [1]}"#.to_string(),
            "not `prompt` and `tokens`",
        ),
        (r#"{"prompt": 5}"#.to_string(), "`prompt` must be a string"),
        (
            r#"{"messages": "hi"}"#.to_string(),
            "`messages` must be a list",
        ),
        // Text needs a tokenizer, which the fixtures lack.
        (r#"{"prompt": "hi"}"#.to_string(), "tokenizer.json"),
    ];
    for (bad, want) in cases {
        let (_dir, file) = prompts_file(&[ok.clone(), String::new(), bad.clone()]);
        let err = fails(&["--prompts", &file, "--max-tokens", "2"]);
        assert!(err.contains(&format!("{file}:3")), "{bad}: {err}");
        assert!(err.contains(want), "{bad}: {err}");
    }
}

/// A byte-order mark before the first line is skipped; a prompt file that
/// does not exist is reported before the model is loaded.
#[test]
fn bom_is_skipped_and_a_missing_file_is_named_first() {
    // Also with the mark alone on a blank first line.
    let tokens = r#"{"tokens": [1, 2, 3]}"#;
    for lines in [
        vec![format!("\u{feff}{tokens}")],
        vec!["\u{feff}".to_string(), tokens.to_string()],
    ] {
        let (_dir, file) = prompts_file(&lines);
        let out = generate("qwen2", &file, &["--max-tokens", "2", "--json"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{lines:?}: {err}");
        assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 1);
    }
    let out = arbor(&[
        "generate",
        "--model",
        "/nonexistent/model",
        "--prompts",
        "/nonexistent/prompts.jsonl",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("/nonexistent/prompts.jsonl: cannot open"),
        "{err}"
    );
}

#[test]
fn bad_settings_are_named() {
    let (_dir, file) = prompts_file(&[r#"{"tokens": [1, 2, 3]}"#.to_string()]);
    let f = file.as_str();
    let cases: [(&[&str], &str); 8] = [
        (&["--prompts", f, "--n", "0"], "--n"),
        // Stop strings are matched on text: the fixtures have no tokenizer.
        (&["--prompts", f, "--stop", "x"], "--stop needs"),
        (&["--prompts", f, "--n", "100000000000"], "--n"),
        // 1/T overflows f32: refused rather than sampling NaN.
        (
            &["--prompts", f, "--temperature", "1e-40"],
            "--temperature is invalid",
        ),
        (
            &["--prompts", f, "--top-p", "0"],
            "--top-p is invalid: top_p = 0",
        ),
        (&["--prompts", f, "--min-p", "1.5"], "--min-p is invalid"),
        (
            &["--prompts", f, "--kv-memory-mib", "17592186044417"],
            "kv_memory_mib",
        ),
        (
            &["--prompts", f, "--kv-memory-mib", "1000000000000"],
            "exceeds this machine's memory",
        ),
    ];
    for (args, want) in cases {
        let err = fails(args);
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

/// The benches refuse runs the model's context cannot hold (which would
/// stop early and report fewer tokens than asked), naming the flags; for a
/// preset before building the model.
#[test]
fn benches_refuse_lengths_beyond_the_context() {
    let model = fixtures().join("qwen2");
    let m = model.to_str().unwrap();
    for args in [
        &[
            "bench",
            "generate",
            "--model",
            m,
            "--batch",
            "2",
            "--prompt-len",
            "4",
            "--max-tokens",
            "1000",
        ][..],
        &[
            "bench",
            "fork",
            "--model",
            m,
            "--n",
            "2",
            "--prompt-len",
            "250",
            "--max-tokens",
            "7",
        ],
        &[
            "bench",
            "generate",
            "--prompt-len",
            "100000",
            "--max-tokens",
            "2",
        ],
        &["bench", "fork", "--max-tokens", "18446744073709551615"],
    ] {
        let out = arbor(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.contains("exceed the model's context"),
            "{args:?}: {err}"
        );
        assert!(
            err.contains("--prompt-len") && err.contains("--max-tokens"),
            "{err}"
        );
    }
}

/// `bench generate --shared-prefix`: prompts that share their leading
/// tokens compute the shared full blocks once (block size 16: a 40-token
/// prompt has two cacheable blocks); a prefix longer than the prompt is
/// refused.
#[test]
fn bench_generate_computes_a_shared_prefix_once() {
    let model = fixtures().join("qwen2");
    let m = model.to_str().unwrap();
    let args = [
        "bench",
        "generate",
        "--model",
        m,
        "--batch",
        "4",
        "--prompt-len",
        "40",
        "--max-tokens",
        "2",
        "--json",
    ];
    for (shared, computed, cached) in [("0", 160, 0), ("40", 40 + 3 * 8, 3 * 32)] {
        let mut all = args.to_vec();
        all.extend(["--shared-prefix", shared]);
        let out = arbor(&all);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(j["prefill_computed"], computed, "--shared-prefix {shared}");
        assert_eq!(j["prefill_cached"], cached, "--shared-prefix {shared}");
    }
    let mut all = args.to_vec();
    all.extend(["--shared-prefix", "41"]);
    let out = arbor(&all);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--shared-prefix 41"));
}

/// `bench step` runs whole RL steps and accounts for them: every response
/// has `--response-len` tokens and all of them are trained, and the phases
/// fit in the step; lengths beyond the context are refused.
#[test]
fn bench_step_times_a_whole_rl_step() {
    let out = arbor(&[
        "bench",
        "step",
        "--prompts",
        "2",
        "--samples",
        "2",
        "--prompt-len",
        "8",
        "--response-len",
        "6",
        "--steps",
        "1",
        "--json",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["generated_tokens_per_step"], 24, "{r}");
    assert_eq!(r["trained_tokens_per_step"], 24, "{r}");
    let f = |k: &str| r[k].as_f64().unwrap();
    let phases = f("generation_s") + f("value_pass_s") + f("update_s") + f("weight_sync_s");
    assert!(phases > 0.0 && phases <= f("step_s") * 1.001, "{r}");
    assert!(
        f("generation_share") > 0.0 && f("generation_share") < 1.0,
        "{r}"
    );
    let out = arbor(&["bench", "step", "--response-len", "100000"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("exceed the model's context"), "{err}");
}
