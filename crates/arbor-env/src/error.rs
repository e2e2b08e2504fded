//! Errors of the environments crate. Every variant names the file and line,
//! the field, the task or the call at fault, so a failure is diagnosable from
//! the message alone.
//!
//! A *malformed action* is never an error: the environment answers it with an
//! error observation and the episode goes on. Errors are for protocol misuse
//! (stepping a finished episode), bad configuration, unreadable inputs and
//! infrastructure failures (the sandbox could not start).

use std::path::PathBuf;

/// Error type of `arbor-env`.
#[derive(Debug, thiserror::Error)]
pub enum EnvError {
    /// An invalid configuration value.
    #[error("config `{field}`: {msg}")]
    Config { field: &'static str, msg: String },
    /// A call the episode's state does not allow (step before reset, step
    /// after done, a token id outside the vocabulary of a token-level env).
    #[error("episode `{task}`: {msg}")]
    Protocol { task: String, msg: String },
    /// A bad line of an input file (JSONL dataset, instance file,
    /// trajectory).
    #[error("{}:{line}: {msg}", path.display())]
    Data {
        path: PathBuf,
        line: usize,
        msg: String,
    },
    /// A missing or mistyped field of one input row.
    #[error("{}:{line}: field `{key}`: {msg}", path.display())]
    Field {
        path: PathBuf,
        line: usize,
        key: String,
        msg: String,
    },
    /// A file or directory that could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The sandbox refused or failed to run (bubblewrap missing without the
    /// unsandboxed opt-in, spawn failure).
    #[error("sandbox: {0}")]
    Sandbox(String),
    /// A task specification that does not name a known task.
    #[error("task `{spec}`: {msg}")]
    Task { spec: String, msg: String },
    /// Async plumbing failed (a blocking step panicked or was cancelled).
    #[error("async runtime: {0}")]
    Runtime(String),
}

/// Result alias for `arbor-env`.
pub type Result<T> = std::result::Result<T, EnvError>;

impl EnvError {
    pub(crate) fn config(field: &'static str, msg: impl Into<String>) -> Self {
        EnvError::Config {
            field,
            msg: msg.into(),
        }
    }

    pub(crate) fn protocol(task: impl Into<String>, msg: impl Into<String>) -> Self {
        EnvError::Protocol {
            task: task.into(),
            msg: msg.into(),
        }
    }

    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        EnvError::Io {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn task(spec: impl Into<String>, msg: impl Into<String>) -> Self {
        EnvError::Task {
            spec: spec.into(),
            msg: msg.into(),
        }
    }
}
