//! HF `config.json` parsing for the Qwen2 / Qwen2.5 / Qwen3 / Llama families.
//!
//! Accepts the files written by transformers 4 (top-level `rope_theta`,
//! `rope_scaling`, `torch_dtype`) and transformers 5 (`rope_parameters`,
//! `dtype`, `layer_types`). Anything that would change the maths and that we
//! do not implement (YaRN / dynamic / LongRoPE scaling, sliding-window
//! attention, non-SiLU activations, MLP biases) is rejected with an error
//! naming the key, never silently ignored.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{ModelError, Result};

/// Model family. Decides the attention-bias and q/k-norm layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// Qwen2 / Qwen2.5: bias on q, k, v (not o); no q/k norm.
    Qwen2,
    /// Qwen3: optional bias on all four projections; RMSNorm on q and k per head.
    Qwen3,
    /// Llama / SmolLM / Llama-3: optional bias on all four projections.
    Llama,
}

impl Arch {
    /// The `model_type` string HF uses.
    pub fn model_type(self) -> &'static str {
        match self {
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Llama => "llama",
        }
    }

    /// The `architectures[0]` string HF uses.
    pub fn hf_class(self) -> &'static str {
        match self {
            Arch::Qwen2 => "Qwen2ForCausalLM",
            Arch::Qwen3 => "Qwen3ForCausalLM",
            Arch::Llama => "LlamaForCausalLM",
        }
    }
}

/// RoPE frequency scaling that we implement exactly.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum RopeScaling {
    /// `theta^(-2i/d)`.
    Default,
    /// Positions divided by `factor` (`rope_type = "linear"`).
    Linear { factor: f64 },
    /// Llama-3.1 piecewise frequency scaling (`rope_type = "llama3"`).
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
}

/// A validated model configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    /// Per-head dimension; may differ from `hidden_size / num_attention_heads` (Qwen3).
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Bias on q, k and v projections.
    pub qkv_bias: bool,
    /// Bias on the o projection.
    pub o_bias: bool,
    /// Per-head RMSNorm on q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    /// The checkpoint's stored dtype (`torch_dtype` / `dtype`), if given.
    pub torch_dtype: Option<String>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

impl ModelConfig {
    /// Read and validate a `config.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
        Self::from_json_str(&text, path)
    }

    /// Parse from JSON text; `path` is only used in error messages.
    pub fn from_json_str(text: &str, path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let v: Value = serde_json::from_str(text).map_err(|e| ModelError::json(path, &e))?;
        parse(&v, path)
    }

    /// Number of query heads sharing one KV head.
    pub fn gqa_groups(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }

    /// Parameter count (excluding a tied lm_head).
    pub fn num_parameters(&self) -> usize {
        let h = self.hidden_size;
        let d = self.head_dim;
        let q = self.num_attention_heads * d;
        let kv = self.num_key_value_heads * d;
        let mut attn = h * q + 2 * h * kv + q * h;
        if self.qkv_bias {
            attn += q + 2 * kv;
        }
        if self.o_bias {
            attn += h;
        }
        if self.qk_norm {
            attn += 2 * d;
        }
        let mlp = 3 * h * self.intermediate_size;
        let layer = attn + mlp + 2 * h;
        let emb = self.vocab_size * h;
        let head = if self.tie_word_embeddings { 0 } else { emb };
        emb + head + h + self.num_hidden_layers * layer
    }

    /// A config with the shape of SmolLM2-135M (Llama architecture), for benchmarks.
    pub fn smollm2_135m() -> Self {
        ModelConfig {
            arch: Arch::Llama,
            vocab_size: 49152,
            hidden_size: 576,
            intermediate_size: 1536,
            num_hidden_layers: 30,
            num_attention_heads: 9,
            num_key_value_heads: 3,
            head_dim: 64,
            rms_norm_eps: 1e-5,
            rope_theta: 100000.0,
            rope_scaling: RopeScaling::Default,
            max_position_embeddings: 8192,
            tie_word_embeddings: true,
            qkv_bias: false,
            o_bias: false,
            qk_norm: false,
            torch_dtype: Some("bfloat16".into()),
            bos_token_id: Some(0),
            eos_token_ids: vec![0],
        }
    }

    /// A config with the shape of Qwen3-0.6B.
    pub fn qwen3_0_6b() -> Self {
        ModelConfig {
            arch: Arch::Qwen3,
            vocab_size: 151936,
            hidden_size: 1024,
            intermediate_size: 3072,
            num_hidden_layers: 28,
            num_attention_heads: 16,
            num_key_value_heads: 8,
            head_dim: 128,
            rms_norm_eps: 1e-6,
            rope_theta: 1_000_000.0,
            rope_scaling: RopeScaling::Default,
            max_position_embeddings: 40960,
            tie_word_embeddings: true,
            qkv_bias: false,
            o_bias: false,
            qk_norm: true,
            torch_dtype: Some("bfloat16".into()),
            bos_token_id: Some(151643),
            eos_token_ids: vec![151645],
        }
    }

    /// Qwen3-4B's `config.json` (36 layers, hidden 2560, 32/8 heads of
    /// 128, intermediate 9728, tied embeddings).
    pub fn qwen3_4b() -> Self {
        ModelConfig {
            hidden_size: 2560,
            intermediate_size: 9728,
            num_hidden_layers: 36,
            num_attention_heads: 32,
            ..Self::qwen3_0_6b()
        }
    }

    /// Serialise as an HF `config.json` (transformers-4 style keys), so that a
    /// checkpoint Arbor writes loads in transformers.
    pub fn to_hf_json(&self) -> Value {
        let mut m = serde_json::Map::new();
        m.insert(
            "architectures".into(),
            Value::from(vec![self.arch.hf_class()]),
        );
        m.insert("model_type".into(), Value::from(self.arch.model_type()));
        m.insert("vocab_size".into(), Value::from(self.vocab_size));
        m.insert("hidden_size".into(), Value::from(self.hidden_size));
        m.insert(
            "intermediate_size".into(),
            Value::from(self.intermediate_size),
        );
        m.insert(
            "num_hidden_layers".into(),
            Value::from(self.num_hidden_layers),
        );
        m.insert(
            "num_attention_heads".into(),
            Value::from(self.num_attention_heads),
        );
        m.insert(
            "num_key_value_heads".into(),
            Value::from(self.num_key_value_heads),
        );
        m.insert("head_dim".into(), Value::from(self.head_dim));
        m.insert("rms_norm_eps".into(), Value::from(self.rms_norm_eps));
        m.insert("rope_theta".into(), Value::from(self.rope_theta));
        let scaling = match &self.rope_scaling {
            RopeScaling::Default => Value::Null,
            RopeScaling::Linear { factor } => {
                serde_json::json!({"rope_type": "linear", "factor": factor})
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => serde_json::json!({
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low_freq_factor,
                "high_freq_factor": high_freq_factor,
                "original_max_position_embeddings": original_max_position_embeddings,
            }),
        };
        m.insert("rope_scaling".into(), scaling);
        m.insert(
            "max_position_embeddings".into(),
            Value::from(self.max_position_embeddings),
        );
        m.insert(
            "tie_word_embeddings".into(),
            Value::from(self.tie_word_embeddings),
        );
        m.insert("hidden_act".into(), Value::from("silu"));
        if self.arch != Arch::Qwen2 {
            m.insert("attention_bias".into(), Value::from(self.qkv_bias));
        }
        if let Some(d) = &self.torch_dtype {
            m.insert("torch_dtype".into(), Value::from(d.as_str()));
        }
        if let Some(b) = self.bos_token_id {
            m.insert("bos_token_id".into(), Value::from(b));
        }
        match self.eos_token_ids.as_slice() {
            [] => {}
            [one] => {
                m.insert("eos_token_id".into(), Value::from(*one));
            }
            many => {
                m.insert("eos_token_id".into(), Value::from(many.to_vec()));
            }
        }
        Value::Object(m)
    }
}

struct Keys<'a> {
    v: &'a serde_json::Map<String, Value>,
    path: PathBuf,
}

impl Keys<'_> {
    fn err(&self, key: &str, msg: impl Into<String>) -> ModelError {
        ModelError::ConfigKey {
            path: self.path.clone(),
            key: key.into(),
            msg: msg.into(),
        }
    }

    fn unsupported(&self, key: &str, msg: impl Into<String>) -> ModelError {
        ModelError::Unsupported {
            path: self.path.clone(),
            key: key.into(),
            msg: msg.into(),
        }
    }

    fn get(&self, key: &str) -> Option<&Value> {
        self.v.get(key).filter(|v| !v.is_null())
    }

    fn usize_req(&self, key: &str) -> Result<usize> {
        match self.get(key) {
            None => Err(self.err(key, "missing")),
            Some(v) => self.as_usize(key, v),
        }
    }

    fn usize_opt(&self, key: &str) -> Result<Option<usize>> {
        self.get(key).map(|v| self.as_usize(key, v)).transpose()
    }

    fn as_usize(&self, key: &str, v: &Value) -> Result<usize> {
        match v.as_u64() {
            Some(n) if n > 0 => Ok(n as usize),
            _ => Err(self.err(key, format!("expected a positive integer, found {v}"))),
        }
    }

    fn f64_opt(&self, key: &str) -> Result<Option<f64>> {
        self.get(key)
            .map(|v| {
                v.as_f64()
                    .ok_or_else(|| self.err(key, format!("expected a number, found {v}")))
            })
            .transpose()
    }

    fn bool_opt(&self, key: &str) -> Result<Option<bool>> {
        self.get(key)
            .map(|v| {
                v.as_bool()
                    .ok_or_else(|| self.err(key, format!("expected true or false, found {v}")))
            })
            .transpose()
    }

    fn str_opt(&self, key: &str) -> Result<Option<&str>> {
        self.get(key)
            .map(|v| {
                v.as_str()
                    .ok_or_else(|| self.err(key, format!("expected a string, found {v}")))
            })
            .transpose()
    }
}

fn parse(v: &Value, path: &Path) -> Result<ModelConfig> {
    let obj = v.as_object().ok_or_else(|| ModelError::ConfigKey {
        path: path.to_path_buf(),
        key: "<root>".into(),
        msg: "expected a JSON object".into(),
    })?;
    let k = Keys {
        v: obj,
        path: path.to_path_buf(),
    };

    let model_type = k.str_opt("model_type")?;
    let arch_name = match model_type {
        Some(t) => t.to_string(),
        None => k
            .get("architectures")
            .and_then(|a| a.get(0))
            .and_then(|a| a.as_str())
            .map(str::to_string)
            .ok_or_else(|| k.err("model_type", "missing (and no `architectures` either)"))?,
    };
    let arch = match arch_name.as_str() {
        "qwen2" | "Qwen2ForCausalLM" => Arch::Qwen2,
        "qwen3" | "Qwen3ForCausalLM" => Arch::Qwen3,
        "llama" | "LlamaForCausalLM" => Arch::Llama,
        other => {
            return Err(ModelError::UnknownArchitecture {
                path: path.to_path_buf(),
                found: other.to_string(),
            })
        }
    };

    let hidden_size = k.usize_req("hidden_size")?;
    let num_attention_heads = k.usize_req("num_attention_heads")?;
    let num_key_value_heads = k
        .usize_opt("num_key_value_heads")?
        .unwrap_or(num_attention_heads);
    if num_attention_heads % num_key_value_heads != 0 {
        return Err(k.err(
            "num_key_value_heads",
            format!(
                "{num_key_value_heads} does not divide num_attention_heads = {num_attention_heads}"
            ),
        ));
    }
    let head_dim = match k.usize_opt("head_dim")? {
        Some(d) => d,
        None => {
            if hidden_size % num_attention_heads != 0 {
                return Err(k.err(
                    "head_dim",
                    "missing, and hidden_size is not a multiple of num_attention_heads",
                ));
            }
            hidden_size / num_attention_heads
        }
    };
    if head_dim % 2 != 0 {
        return Err(k.err(
            "head_dim",
            format!("{head_dim} is odd; RoPE needs an even head_dim"),
        ));
    }

    if let Some(act) = k.str_opt("hidden_act")? {
        if act != "silu" {
            return Err(k.unsupported("hidden_act", format!("`{act}` (only `silu`)")));
        }
    }
    if k.bool_opt("mlp_bias")?.unwrap_or(false) {
        return Err(k.unsupported("mlp_bias", "MLP biases are not implemented"));
    }
    if k.bool_opt("use_sliding_window")?.unwrap_or(false) {
        return Err(k.unsupported(
            "use_sliding_window",
            "sliding-window attention is not implemented; set it to false to use full attention",
        ));
    }
    if let Some(types) = k.get("layer_types") {
        let arr = types
            .as_array()
            .ok_or_else(|| k.err("layer_types", "expected a list of strings"))?;
        for (i, t) in arr.iter().enumerate() {
            match t.as_str() {
                Some("full_attention") => {}
                Some(other) => {
                    return Err(k.unsupported(
                        "layer_types",
                        format!("layer {i} is `{other}`; only `full_attention` is implemented"),
                    ))
                }
                None => return Err(k.err("layer_types", format!("entry {i} is not a string"))),
            }
        }
    }

    // RoPE: transformers 5 nests everything under `rope_parameters`;
    // transformers 4 has top-level `rope_theta` and optional `rope_scaling`.
    let (rope_theta, rope_scaling) = parse_rope(&k)?;

    let attention_bias = k.bool_opt("attention_bias")?.unwrap_or(false);
    let (qkv_bias, o_bias, qk_norm) = match arch {
        Arch::Qwen2 => (true, false, false),
        Arch::Qwen3 => (attention_bias, attention_bias, true),
        Arch::Llama => (attention_bias, attention_bias, false),
    };

    let torch_dtype = match k.str_opt("dtype")? {
        Some(d) => Some(d.to_string()),
        None => k.str_opt("torch_dtype")?.map(str::to_string),
    };
    let eos_token_ids = match k.get("eos_token_id") {
        None => vec![],
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| {
                x.as_u64()
                    .map(|n| n as u32)
                    .ok_or_else(|| k.err("eos_token_id", format!("expected integers, found {x}")))
            })
            .collect::<Result<_>>()?,
        Some(x) => vec![x
            .as_u64()
            .ok_or_else(|| k.err("eos_token_id", format!("expected an integer, found {x}")))?
            as u32],
    };

    Ok(ModelConfig {
        arch,
        vocab_size: k.usize_req("vocab_size")?,
        hidden_size,
        intermediate_size: k.usize_req("intermediate_size")?,
        num_hidden_layers: k.usize_req("num_hidden_layers")?,
        num_attention_heads,
        num_key_value_heads,
        head_dim,
        rms_norm_eps: k.f64_opt("rms_norm_eps")?.unwrap_or(1e-6),
        rope_theta,
        rope_scaling,
        max_position_embeddings: k.usize_opt("max_position_embeddings")?.unwrap_or(32768),
        // transformers' Qwen2Config, Qwen3Config and LlamaConfig all default to untied.
        tie_word_embeddings: k.bool_opt("tie_word_embeddings")?.unwrap_or(false),
        qkv_bias,
        o_bias,
        qk_norm,
        torch_dtype,
        bos_token_id: match k.get("bos_token_id") {
            None => None,
            Some(x) => Some(
                x.as_u64()
                    .filter(|&n| n <= u32::MAX as u64)
                    .ok_or_else(|| {
                        k.err("bos_token_id", format!("expected a token id, found {x}"))
                    })? as u32,
            ),
        },
        eos_token_ids,
    })
}

fn parse_rope(k: &Keys<'_>) -> Result<(f64, RopeScaling)> {
    let (scaling_key, scaling, theta) = match k.get("rope_parameters") {
        Some(p) => {
            let obj = p
                .as_object()
                .ok_or_else(|| k.err("rope_parameters", "expected an object"))?;
            let theta = match obj.get("rope_theta").filter(|v| !v.is_null()) {
                Some(t) => t
                    .as_f64()
                    .ok_or_else(|| k.err("rope_parameters.rope_theta", "expected a number"))?,
                None => k.f64_opt("rope_theta")?.unwrap_or(10000.0),
            };
            ("rope_parameters", Some(obj), theta)
        }
        None => {
            let theta = k.f64_opt("rope_theta")?.unwrap_or(10000.0);
            let s = match k.get("rope_scaling") {
                Some(s) => Some(
                    s.as_object()
                        .ok_or_else(|| k.err("rope_scaling", "expected an object or null"))?,
                ),
                None => None,
            };
            ("rope_scaling", s, theta)
        }
    };
    if theta.is_nan() || theta <= 0.0 {
        return Err(k.err("rope_theta", format!("must be positive, found {theta}")));
    }
    let Some(s) = scaling else {
        return Ok((theta, RopeScaling::Default));
    };
    let ty = s
        .get("rope_type")
        .or_else(|| s.get("type"))
        .and_then(|t| t.as_str())
        .unwrap_or("default");
    let num = |name: &str| -> Result<f64> {
        s.get(name)
            .and_then(serde_json::Value::as_f64)
            .ok_or_else(|| k.err(&format!("{scaling_key}.{name}"), "missing or not a number"))
    };
    let scaling = match ty {
        "default" => RopeScaling::Default,
        "linear" => RopeScaling::Linear {
            factor: num("factor")?,
        },
        "llama3" => RopeScaling::Llama3 {
            factor: num("factor")?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_max_position_embeddings: num("original_max_position_embeddings")?,
        },
        other => {
            return Err(k.unsupported(
                &format!("{scaling_key}.rope_type"),
                format!(
                "RoPE scaling `{other}` is not implemented (supported: default, linear, llama3)"
            ),
            ))
        }
    };
    Ok((theta, scaling))
}

#[cfg(test)]
mod tests {
    use super::*;

    const QWEN3_V4: &str = r#"{
      "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
      "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
      "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
      "head_dim": 128, "rms_norm_eps": 1e-06, "rope_theta": 1000000, "rope_scaling": null,
      "max_position_embeddings": 40960, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
      "attention_bias": false, "use_sliding_window": false, "sliding_window": null,
      "hidden_act": "silu", "bos_token_id": 151643, "eos_token_id": 151645
    }"#;

    #[test]
    fn qwen3_transformers4() {
        let c = ModelConfig::from_json_str(QWEN3_V4, "config.json").unwrap();
        assert_eq!(c, ModelConfig::qwen3_0_6b());
    }

    #[test]
    fn qwen3_transformers5_rope_parameters() {
        let text = QWEN3_V4
            .replace(
                r#""rope_theta": 1000000, "rope_scaling": null,"#,
                r#""rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},"#,
            )
            .replace("torch_dtype", "dtype")
            + "";
        let text = text.replace(
            r#""hidden_act": "silu","#,
            r#""hidden_act": "silu", "layer_types": ["full_attention", "full_attention"],"#,
        );
        let c = ModelConfig::from_json_str(&text, "config.json").unwrap();
        assert_eq!(c, ModelConfig::qwen3_0_6b());
    }

    #[test]
    fn qwen2_has_qkv_bias_and_defaults_kv_heads() {
        let text = r#"{"model_type": "qwen2", "vocab_size": 100, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "use_sliding_window": false, "sliding_window": 4096, "max_window_layers": 21}"#;
        let c = ModelConfig::from_json_str(text, "c.json").unwrap();
        assert!(c.qkv_bias && !c.o_bias && !c.qk_norm);
        assert_eq!(c.num_key_value_heads, 4);
        assert_eq!(c.head_dim, 16);
        assert!(!c.tie_word_embeddings);
        assert_eq!(c.rope_theta, 10000.0);
    }

    #[test]
    fn llama3_scaling_parsed() {
        let text = r#"{"model_type": "llama", "vocab_size": 100, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "rope_theta": 500000.0, "tie_word_embeddings": true,
            "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192, "rope_type": "llama3"}}"#;
        let c = ModelConfig::from_json_str(text, "c.json").unwrap();
        assert!(matches!(c.rope_scaling, RopeScaling::Llama3 { factor, .. } if factor == 32.0));
        assert!(c.tie_word_embeddings);
    }

    fn err_of(text: &str) -> String {
        ModelConfig::from_json_str(text, "dir/config.json")
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn unsupported_and_malformed_configs_are_named() {
        let base = r#""vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4"#;
        let e = err_of(&format!(r#"{{"model_type": "gpt2", {base}}}"#));
        assert!(
            e.contains("unknown architecture `gpt2`") && e.contains("dir/config.json"),
            "{e}"
        );
        let e = err_of(&format!(
            r#"{{"model_type": "qwen2", "use_sliding_window": true, {base}}}"#
        ));
        assert!(e.contains("use_sliding_window"), "{e}");
        let e = err_of(&format!(
            r#"{{"model_type": "llama", "rope_scaling": {{"type": "yarn", "factor": 4.0}}, {base}}}"#
        ));
        assert!(
            e.contains("rope_scaling.rope_type") && e.contains("yarn"),
            "{e}"
        );
        let e = err_of(&format!(
            r#"{{"model_type": "qwen3", "rope_parameters": {{"rope_type": "dynamic", "factor": 2.0}}, {base}}}"#
        ));
        assert!(e.contains("rope_parameters.rope_type"), "{e}");
        let e = err_of(&format!(
            r#"{{"model_type": "qwen3", "layer_types": ["sliding_attention"], {base}}}"#
        ));
        assert!(e.contains("layer_types"), "{e}");
        let e = err_of(r#"{"model_type": "qwen3", "vocab_size": 100}"#);
        assert!(e.contains("`hidden_size`: missing"), "{e}");
        let e = err_of(&format!(
            r#"{{"model_type": "llama", "hidden_act": "gelu", {base}}}"#
        ));
        assert!(e.contains("hidden_act"), "{e}");
        let e = err_of(&format!(
            r#"{{"model_type": "llama", "num_key_value_heads": 3, {base}}}"#
        ));
        assert!(e.contains("num_key_value_heads"), "{e}");
        let e = err_of("{\"model_type\": \"llama\",\n \"vocab_size\": 10,,}");
        assert!(e.contains("dir/config.json:2:"), "{e}");
        let e = err_of(&format!(
            r#"{{"model_type": "llama", "vocab_size": -3, {}}}"#,
            base.replace(r#""vocab_size": 100, "#, "")
        ));
        assert!(e.contains("`vocab_size`"), "{e}");
    }

    #[test]
    fn hf_json_roundtrip() {
        for c in [ModelConfig::qwen3_0_6b(), ModelConfig::smollm2_135m()] {
            let text = serde_json::to_string(&c.to_hf_json()).unwrap();
            assert_eq!(ModelConfig::from_json_str(&text, "x").unwrap(), c);
        }
    }
}
