//! Helpers shared by the CLI tests.
#![allow(dead_code)]

use std::path::PathBuf;

pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("crates/arbor-model/tests/fixtures")
}

pub fn arbor(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_arbor"))
        .args(args)
        .output()
        .unwrap()
}

/// A random full-vocabulary Qwen3-architecture model (1 layer, hidden 8)
/// with the real Qwen3 tokenizer and chat template, in a temp dir. `None`
/// (and a SKIP line; a failure under `CI=true`) without the shared data.
pub fn tiny_qwen3_with_tokenizer() -> Option<tempfile::TempDir> {
    let shared = arbor_env::data::shared_data("tokenizers/qwen3", "the real Qwen3 tokenizer")?;
    use arbor_model::{ModelConfig, ParamLoader, ParamSource, Transformer};
    let mut cfg = ModelConfig::qwen3_0_6b();
    cfg.hidden_size = 8;
    cfg.intermediate_size = 16;
    cfg.num_hidden_layers = 1;
    cfg.num_attention_heads = 2;
    cfg.num_key_value_heads = 1;
    cfg.head_dim = 4;
    let dev = candle_core::Device::Cpu;
    let loader = ParamLoader::frozen(
        ParamSource::Random { seed: 1 },
        candle_core::DType::F32,
        &dev,
    );
    let model = Transformer::load(&cfg, &loader).unwrap();
    let dir = tempfile::tempdir().unwrap();
    model
        .save_pretrained(dir.path(), candle_core::DType::BF16)
        .unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(shared.join(f), dir.path().join(f)).unwrap();
    }
    Some(dir)
}
