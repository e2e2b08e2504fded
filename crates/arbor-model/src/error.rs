//! Errors of the model layer. Every variant names the file, key or tensor at fault.

use std::path::PathBuf;

/// Error type of `arbor-model`.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}:{line}:{column}: malformed JSON: {msg}")]
    Json {
        path: PathBuf,
        line: usize,
        column: usize,
        msg: String,
    },
    #[error("{path}: key `{key}`: {msg}")]
    ConfigKey {
        path: PathBuf,
        key: String,
        msg: String,
    },
    #[error("{path}: unknown architecture `{found}` (supported model_type: qwen2, qwen3, llama)")]
    UnknownArchitecture { path: PathBuf, found: String },
    #[error("{path}: key `{key}`: unsupported: {msg}")]
    Unsupported {
        path: PathBuf,
        key: String,
        msg: String,
    },
    #[error("{path}: invalid safetensors file: {msg}")]
    Safetensors { path: PathBuf, msg: String },
    #[error("tensor `{name}` is missing from the checkpoint ({files})")]
    MissingTensor { name: String, files: String },
    #[error("tensor `{name}`: shape mismatch: the config expects {expected:?}, the checkpoint has {found:?}")]
    ShapeMismatch {
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("tensor `{name}`: unsupported dtype {dtype}")]
    TensorDtype { name: String, dtype: String },
    #[error("model `{model}`: {msg}")]
    Resolve { model: String, msg: String },
    #[error("{path}: tokenizer: {msg}")]
    Tokenizer { path: PathBuf, msg: String },
    #[error("chat template: {msg}")]
    Template { msg: String },
    #[error("invalid input: {0}")]
    Input(String),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// Result alias for `arbor-model`.
pub type Result<T> = std::result::Result<T, ModelError>;

impl ModelError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ModelError::Io {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn json(path: impl Into<PathBuf>, e: &serde_json::Error) -> Self {
        ModelError::Json {
            path: path.into(),
            line: e.line(),
            column: e.column(),
            msg: e.to_string(),
        }
    }
}
