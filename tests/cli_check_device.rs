//! `arbor check-device --device cpu`: the GPU check's whole pipeline run on
//! the CPU (the CPU ops against float64 brute force, the model's dense and
//! paged logits, a PPO step), so CI exercises the command without a GPU.

mod common;

use common::arbor;

#[test]
fn check_device_on_cpu_passes_and_writes_json() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("cd.json");
    let out = arbor(&[
        "check-device",
        "--device",
        "cpu",
        "--seed",
        "5",
        "--json",
        json.to_str().unwrap(),
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("ALL PASS"), "{text}");
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(r["all_pass"], true);
    assert_eq!(r["complete"], true);
    let names: Vec<&str> = r["checks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    for want in [
        "logprob fwd",
        "logprob bwd d hidden",
        "logprob bwd d weight",
        "ppo loss bwd",
        "value loss bwd",
        "segment broadcast",
        "segment sum",
        "paged attention",
        "kv cache write",
        "logits, paged decode",
        "ppo step grads",
    ] {
        assert!(
            names.iter().any(|n| n.starts_with(want)),
            "no check `{want}` in {names:?}"
        );
    }
    for c in r["checks"].as_array().unwrap() {
        assert!(
            c["rel_err"].as_f64().unwrap() <= c["tol"].as_f64().unwrap() || c["section"] == "train"
        );
    }
    assert!(r["benches"]
        .as_array()
        .unwrap()
        .iter()
        .any(|b| b["name"].as_str().unwrap().starts_with("decode B=")));
}

#[test]
fn check_device_refuses_cuda_without_the_feature() {
    if cfg!(feature = "cuda") {
        return;
    }
    let out = arbor(&["check-device", "--device", "cuda", "--no-bench"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("built without CUDA"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn benches_name_the_device_and_refuse_cuda_without_the_feature() {
    let out = arbor(&[
        "bench",
        "generate",
        "--batch",
        "2",
        "--prompt-len",
        "4",
        "--max-tokens",
        "2",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["device"], "cpu");
    assert!(r["peak_device_mib"].is_null());
    for args in [
        &["bench", "fork", "--device", "tpu"][..],
        &["bench", "logprob-memory", "--device", "tpu"][..],
    ] {
        let out = arbor(args);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("--device must be cpu, cuda or cuda:N"),
            "{err}"
        );
    }
    if !cfg!(feature = "cuda") {
        let out = arbor(&["bench", "generate", "--device", "cuda"]);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("built without CUDA"), "{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}
