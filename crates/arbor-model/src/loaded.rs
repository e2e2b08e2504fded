//! A ready-to-use model: files resolved, config validated, weights loaded,
//! tokenizer and chat template attached when the checkpoint ships them.

use candle_core::{DType, Device, Tensor};
use serde::Serialize;

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::logprobs::{greedy_tokens, token_logprobs, DEFAULT_CHUNK_ROWS};
use crate::model::Transformer;
use crate::tokenizer::{ChatTemplate, Tokenizer};
use crate::weights::{Checkpoint, ModelFiles, ParamLoader, ParamSource};

/// How to load a model.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Compute dtype; weights are converted on load. On the CPU, bf16 keeps
    /// the matrices in bf16 and computes in f32 with bf16 matmul inputs
    /// ([`ParamLoader::bf16_matrices`]).
    pub dtype: DType,
    pub device: Device,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            dtype: DType::F32,
            device: Device::Cpu,
        }
    }
}

/// Parse `f32`, `bf16`, `f16`, `f64` (also HF's `float32`, `bfloat16`, ...).
pub fn parse_dtype(s: &str) -> Result<DType> {
    match s {
        "f32" | "float32" => Ok(DType::F32),
        "bf16" | "bfloat16" => Ok(DType::BF16),
        "f16" | "float16" => Ok(DType::F16),
        "f64" | "float64" => Ok(DType::F64),
        other => Err(ModelError::Input(format!(
            "unknown dtype `{other}` (use f32, bf16, f16 or f64)"
        ))),
    }
}

/// A loaded inference model.
#[derive(Debug)]
pub struct LoadedModel {
    pub files: ModelFiles,
    pub config: ModelConfig,
    pub model: Transformer,
    pub tokenizer: Option<Tokenizer>,
    /// See [`LoadedModel::chat_template`].
    chat_template: Option<ChatTemplate>,
    /// Why there is no chat template, for the error.
    chat_template_problem: String,
}

/// Output of [`LoadedModel::score`]: the `arbor score` JSON shape.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Scored {
    pub tokens: Vec<u32>,
    /// `logprobs[t] = log p(tokens[t+1] | tokens[..=t])`, length `len - 1`.
    pub logprobs: Vec<f32>,
    /// Argmax next token after every position, length `len`.
    pub greedy: Vec<u32>,
}

impl LoadedModel {
    /// Resolve `spec` (directory or HF id) and load it frozen for inference.
    pub fn load(spec: &str, opts: &LoadOptions) -> Result<Self> {
        let files = ModelFiles::resolve(spec)?;
        let config = ModelConfig::from_file(&files.config)?;
        let ckpt = Checkpoint::open(&files.weights)?;
        let loader = ParamLoader::frozen(ParamSource::Checkpoint(&ckpt), opts.dtype, &opts.device);
        let model = Transformer::load(&config, &loader)?;
        let tokenizer = files
            .tokenizer
            .as_ref()
            .map(Tokenizer::from_file)
            .transpose()?;
        // A template that does not compile fails only the commands that
        // use it (`chat_template()` says why), not the model's loading.
        let (chat_template, chat_template_problem) = match ChatTemplate::from_model_files(
            files.tokenizer_config.as_deref(),
            files.chat_template.as_deref(),
        ) {
            Ok(Some(t)) => (Some(t), String::new()),
            Ok(None) => (
                None,
                format!(
                    "`{spec}` has none (no `chat_template` in tokenizer_config.json and no \
                     chat_template.jinja)"
                ),
            ),
            Err(ModelError::Template { msg }) => (None, format!("`{spec}`'s is unusable: {msg}")),
            Err(e) => (None, format!("`{spec}`'s is unusable: {e}")),
        };
        Ok(LoadedModel {
            files,
            config,
            model,
            tokenizer,
            chat_template,
            chat_template_problem,
        })
    }

    /// The model's chat template ([`ChatTemplate::from_model_files`]), or
    /// an error saying there is none or why it cannot be used.
    pub fn chat_template(&self) -> Result<&ChatTemplate> {
        self.chat_template
            .as_ref()
            .ok_or_else(|| ModelError::Template {
                msg: self.chat_template_problem.clone(),
            })
    }

    /// Per-position next-token logprobs and greedy tokens of one sequence.
    pub fn score(&self, tokens: &[u32]) -> Result<Scored> {
        score(&self.model, tokens)
    }
}

/// Score one sequence with `model` (no gradients kept).
pub fn score(model: &Transformer, tokens: &[u32]) -> Result<Scored> {
    if tokens.is_empty() {
        return Err(ModelError::Input("no tokens to score".into()));
    }
    let n = tokens.len();
    let ids = Tensor::from_vec(tokens.to_vec(), (1, n), model.device())?;
    let hidden = model.forward_hidden(&ids)?.squeeze(0)?.detach();
    let greedy = greedy_tokens(&hidden, &model.lm_head, DEFAULT_CHUNK_ROWS)?;
    let logprobs = if n > 1 {
        let targets = Tensor::from_vec(tokens[1..].to_vec(), n - 1, model.device())?;
        token_logprobs(
            &hidden.narrow(0, 0, n - 1)?,
            &model.lm_head,
            &targets,
            DEFAULT_CHUNK_ROWS,
        )?
        .to_dtype(DType::F32)?
        .to_vec1::<f32>()?
    } else {
        Vec::new()
    };
    Ok(Scored {
        tokens: tokens.to_vec(),
        logprobs,
        greedy,
    })
}
