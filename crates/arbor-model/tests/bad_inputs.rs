//! Bad inputs give one clear error naming the file, key or tensor; never a panic.

mod common;

use std::path::Path;

use arbor_model::{LoadOptions, LoadedModel, ModelError};
use candle_core::{Device, Tensor};
use common::fixtures;

fn load_err(dir: &Path) -> String {
    match LoadedModel::load(dir.to_str().unwrap(), &LoadOptions::default()) {
        Ok(_) => panic!("{} loaded but should not", dir.display()),
        Err(e) => e.to_string(),
    }
}

/// A copy of the qwen2 fixture in a temp dir, for corrupting.
fn copy_fixture() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixtures().join("qwen2").join(f), d.path().join(f)).unwrap();
    }
    d
}

fn rewrite_weights(dir: &Path, edit: impl FnOnce(&mut std::collections::HashMap<String, Tensor>)) {
    let p = dir.join("model.safetensors");
    let mut t = candle_core::safetensors::load(&p, &Device::Cpu).unwrap();
    edit(&mut t);
    candle_core::safetensors::save(&t, &p).unwrap();
}

#[test]
fn missing_directory() {
    let e = load_err(Path::new("/nonexistent/arbor-model"));
    assert!(e.contains("/nonexistent/arbor-model"), "{e}");
}

#[test]
fn missing_config_and_weights() {
    let d = tempfile::tempdir().unwrap();
    let e = load_err(d.path());
    assert!(e.contains("config.json"), "{e}");
    std::fs::copy(
        fixtures().join("qwen2/config.json"),
        d.path().join("config.json"),
    )
    .unwrap();
    let e = load_err(d.path());
    assert!(e.contains("model.safetensors"), "{e}");
}

#[test]
fn corrupt_safetensors_header() {
    let d = copy_fixture();
    let p = d.path().join("model.safetensors");
    let mut bytes = std::fs::read(&p).unwrap();
    bytes[8..20].copy_from_slice(b"not json!!!!");
    std::fs::write(&p, &bytes).unwrap();
    let e = load_err(d.path());
    assert!(
        e.contains("model.safetensors") && e.contains("invalid safetensors"),
        "{e}"
    );

    // Truncated file: header length points past the end.
    std::fs::write(&p, &bytes[..100]).unwrap();
    let e = load_err(d.path());
    assert!(e.contains("model.safetensors"), "{e}");

    // Too short to even hold the header length.
    std::fs::write(&p, b"abc").unwrap();
    let e = load_err(d.path());
    assert!(e.contains("model.safetensors"), "{e}");
}

#[test]
fn missing_tensor_is_named() {
    let d = copy_fixture();
    rewrite_weights(d.path(), |t| {
        t.remove("model.layers.1.self_attn.k_proj.bias");
    });
    let e = load_err(d.path());
    assert!(
        e.contains("`model.layers.1.self_attn.k_proj.bias` is missing"),
        "{e}"
    );
}

#[test]
fn wrong_shape_names_tensor_and_both_shapes() {
    let d = copy_fixture();
    rewrite_weights(d.path(), |t| {
        t.insert(
            "model.layers.0.mlp.up_proj.weight".into(),
            Tensor::zeros((100, 64), candle_core::DType::F32, &Device::Cpu).unwrap(),
        );
    });
    let e = load_err(d.path());
    assert!(
        e.contains("model.layers.0.mlp.up_proj.weight")
            && e.contains("[128, 64]")
            && e.contains("[100, 64]"),
        "{e}"
    );
}

#[test]
fn unknown_architecture_and_malformed_config() {
    let d = copy_fixture();
    let cfg = d.path().join("config.json");
    let text = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(&cfg, text.replace("\"qwen2\"", "\"mamba\"")).unwrap();
    let e = load_err(d.path());
    assert!(
        e.contains("unknown architecture `mamba`") && e.contains("config.json"),
        "{e}"
    );

    std::fs::write(
        &cfg,
        "{\n  \"model_type\": \"qwen2\",\n  \"hidden_size\": 64,,\n}",
    )
    .unwrap();
    let e = load_err(d.path());
    assert!(e.contains("config.json:3:"), "{e}");

    std::fs::write(
        &cfg,
        text.replace("\"hidden_size\": 64", "\"hidden_size\": \"big\""),
    )
    .unwrap();
    let e = load_err(d.path());
    assert!(e.contains("`hidden_size`"), "{e}");
}

#[test]
fn broken_shard_index_is_named() {
    let d = tempfile::tempdir().unwrap();
    let src = fixtures().join("qwen3");
    for f in std::fs::read_dir(&src).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, d.path().join(f.file_name().unwrap())).unwrap();
    }
    std::fs::remove_file(d.path().join("model-00003-of-00008.safetensors")).unwrap();
    let e = load_err(d.path());
    assert!(e.contains("model-00003-of-00008.safetensors"), "{e}");
    std::fs::write(
        d.path().join("model.safetensors.index.json"),
        "{\"weight_map\": 3}",
    )
    .unwrap();
    let e = load_err(d.path());
    assert!(e.contains("weight_map"), "{e}");
}

#[test]
fn out_of_vocab_tokens_are_an_error() {
    let m = LoadedModel::load(
        fixtures().join("qwen2").to_str().unwrap(),
        &LoadOptions::default(),
    )
    .unwrap();
    match m.score(&[1, 2, 100000]) {
        Err(ModelError::Input(msg)) => assert!(msg.contains("100000"), "{msg}"),
        other => panic!("expected an input error, got {other:?}"),
    }
    assert!(m.score(&[]).is_err());
}
