//! Errors of the RL core. Every variant names the node, continuation, field
//! or input at fault, so a bad call is diagnosable from the message alone.

use crate::tree::NodeId;

/// Error type of `arbor-rl`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RlError {
    /// A node id that is not in the tree.
    #[error("node {node} does not exist (the tree has {len} nodes)")]
    UnknownNode { node: NodeId, len: usize },
    /// An operation that the node's state does not allow.
    #[error("node {node}: {msg}")]
    Node { node: NodeId, msg: String },
    /// A ticket that is not (or no longer) in flight.
    #[error("continuation #{ticket}: {msg}")]
    Continuation { ticket: u64, msg: String },
    /// A node the computation needs a critic value for has none.
    #[error("node {0} has no critic value (set it with RolloutTree::set_value)")]
    MissingValue(NodeId),
    /// A malformed segment or step of a continuation.
    #[error("segment {index}: {msg}")]
    Segment { index: usize, msg: String },
    /// An invalid configuration value.
    #[error("config `{field}`: {msg}")]
    Config { field: &'static str, msg: String },
    /// An invalid argument of a pure function (lengths, ranges, NaN).
    #[error("input `{what}`: {msg}")]
    Input { what: &'static str, msg: String },
    /// A deserialised tree whose fields contradict each other.
    #[error("inconsistent rollout tree: {0}")]
    Corrupt(String),
}

/// Result alias for `arbor-rl`.
pub type Result<T> = std::result::Result<T, RlError>;

impl RlError {
    pub(crate) fn config(field: &'static str, msg: impl Into<String>) -> Self {
        RlError::Config {
            field,
            msg: msg.into(),
        }
    }

    pub(crate) fn input(what: &'static str, msg: impl Into<String>) -> Self {
        RlError::Input {
            what,
            msg: msg.into(),
        }
    }

    pub(crate) fn node(node: NodeId, msg: impl Into<String>) -> Self {
        RlError::Node {
            node,
            msg: msg.into(),
        }
    }
}

/// `Ok(())` iff `x` is finite and `lo <= x <= hi`; otherwise a config error
/// naming `field`.
pub(crate) fn check_range(field: &'static str, x: f64, lo: f64, hi: f64) -> Result<()> {
    if x.is_finite() && x >= lo && x <= hi {
        Ok(())
    } else {
        Err(RlError::config(
            field,
            format!("{x} is outside [{lo}, {hi}]"),
        ))
    }
}

/// `Ok(())` iff `x` is finite and strictly positive.
pub(crate) fn check_positive(field: &'static str, x: f64) -> Result<()> {
    if x.is_finite() && x > 0.0 {
        Ok(())
    } else {
        Err(RlError::config(
            field,
            format!("{x} must be finite and > 0"),
        ))
    }
}
