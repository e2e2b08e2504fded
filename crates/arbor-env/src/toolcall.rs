//! Qwen-style tool calls: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
//! the format of the real Qwen3 chat template, parsed robustly.
//!
//! Everything inside a `<think>...</think>` block is ignored. Every
//! `<tool_call>` block yields either a [`ToolCall`] or a [`ToolCallError`]
//! saying what is wrong (malformed JSON, no `name`, arguments not an object),
//! so the harness can answer with an error observation and go on. An
//! unclosed final block is parsed to the end of the text. `arguments` given
//! as a JSON string holding an object (a common model habit) is accepted.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// Opening tag.
pub const OPEN: &str = "<tool_call>";
/// Closing tag.
pub const CLOSE: &str = "</tool_call>";

/// One parsed tool call.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    /// Tool name.
    pub name: String,
    /// Arguments object (empty when the call gave none).
    pub arguments: Map<String, Value>,
}

/// Why a `<tool_call>` block could not be read. `index` is the block's
/// position among the blocks of the response (0-based).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ToolCallError {
    /// The block is not valid JSON.
    #[error("tool call #{index}: invalid JSON ({msg}); expected {{\"name\": ..., \"arguments\": {{...}}}}")]
    Json { index: usize, msg: String },
    /// JSON that is not an object with a string `name`.
    #[error("tool call #{index}: missing string field `name`")]
    MissingName { index: usize },
    /// `arguments` is neither an object nor a string holding one.
    #[error("tool call #{index}: `arguments` must be a JSON object")]
    Arguments { index: usize },
}

impl ToolCall {
    /// A call with the given arguments.
    pub fn new(name: impl Into<String>, arguments: Value) -> Self {
        ToolCall {
            name: name.into(),
            arguments: match arguments {
                Value::Object(m) => m,
                _ => Map::new(),
            },
        }
    }

    /// The call as the Qwen3 template renders it.
    pub fn render(&self) -> String {
        format!(
            "{OPEN}\n{{\"name\": {}, \"arguments\": {}}}\n{CLOSE}",
            Value::String(self.name.clone()),
            crate::chat::qwen_tojson(&Value::Object(self.arguments.clone()))
        )
    }

    /// A required string argument; the error text is an observation for the
    /// policy.
    pub fn str_arg(&self, key: &str) -> Result<&str, String> {
        match self.arguments.get(key) {
            Some(Value::String(s)) => Ok(s),
            Some(other) => Err(format!(
                "tool `{}`: argument `{key}` must be a string, got {other}",
                self.name
            )),
            None => Err(format!(
                "tool `{}`: missing required argument `{key}`",
                self.name
            )),
        }
    }

    /// An optional string argument (`Err` only when present with another
    /// type).
    pub fn opt_str_arg(&self, key: &str) -> Result<Option<&str>, String> {
        match self.arguments.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(_) => self.str_arg(key).map(Some),
        }
    }

    /// A required integer argument (integers given as strings such as `"3"`
    /// are accepted).
    pub fn int_arg(&self, key: &str) -> Result<i64, String> {
        match self.arguments.get(key) {
            Some(Value::Number(n)) if n.is_i64() => Ok(n.as_i64().unwrap_or_default()),
            Some(Value::String(s)) if s.trim().parse::<i64>().is_ok() => {
                Ok(s.trim().parse().unwrap_or_default())
            }
            Some(other) => Err(format!(
                "tool `{}`: argument `{key}` must be an integer, got {other}",
                self.name
            )),
            None => Err(format!(
                "tool `{}`: missing required argument `{key}`",
                self.name
            )),
        }
    }

    /// An optional integer argument.
    pub fn opt_int_arg(&self, key: &str) -> Result<Option<i64>, String> {
        match self.arguments.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(_) => self.int_arg(key).map(Some),
        }
    }
}

/// The part of a response after its reasoning: the text after the last
/// `</think>` (the whole text when there is none).
pub fn strip_think(text: &str) -> &str {
    match text.rfind("</think>") {
        Some(i) => &text[i + "</think>".len()..],
        None => text,
    }
}

/// Every `<tool_call>` block of `text` (outside reasoning), in order.
pub fn parse_tool_calls(text: &str) -> Vec<Result<ToolCall, ToolCallError>> {
    let body = strip_think(text);
    let mut out = Vec::new();
    let mut rest = body;
    while let Some(i) = rest.find(OPEN) {
        let after = &rest[i + OPEN.len()..];
        let (inner, next) = match after.find(CLOSE) {
            Some(j) => (&after[..j], &after[j + CLOSE.len()..]),
            None => (after, ""),
        };
        out.push(parse_one(out.len(), inner));
        rest = next;
    }
    out
}

/// The response text outside tool-call blocks and reasoning, trimmed.
pub fn text_outside_calls(text: &str) -> String {
    let body = strip_think(text);
    let mut s = String::new();
    let mut rest = body;
    while let Some(i) = rest.find(OPEN) {
        s.push_str(&rest[..i]);
        rest = match rest[i..].find(CLOSE) {
            Some(j) => &rest[i + j + CLOSE.len()..],
            None => "",
        };
    }
    s.push_str(rest);
    s.trim().to_string()
}

fn parse_one(index: usize, inner: &str) -> Result<ToolCall, ToolCallError> {
    let inner = inner.trim();
    let inner = inner
        .strip_prefix("```json")
        .or_else(|| inner.strip_prefix("```"))
        .map(|s| s.trim_end().trim_end_matches("```").trim())
        .unwrap_or(inner);
    let v: Value = serde_json::from_str(inner).map_err(|e| ToolCallError::Json {
        index,
        msg: e.to_string(),
    })?;
    let Value::Object(mut m) = v else {
        return Err(ToolCallError::MissingName { index });
    };
    let name = match m.remove("name") {
        Some(Value::String(s)) if !s.trim().is_empty() => s.trim().to_string(),
        _ => return Err(ToolCallError::MissingName { index }),
    };
    let arguments = match m.remove("arguments").or_else(|| m.remove("parameters")) {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(a)) => a,
        Some(Value::String(s)) => match serde_json::from_str::<Value>(&s) {
            Ok(Value::Object(a)) => a,
            _ => return Err(ToolCallError::Arguments { index }),
        },
        Some(_) => return Err(ToolCallError::Arguments { index }),
    };
    Ok(ToolCall { name, arguments })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn parses_template_format_and_variants() {
        let t = "<think>maybe <tool_call>{\"name\":\"no\"}</tool_call></think>\n\nI'll look.\n\
                 <tool_call>\n{\"name\": \"view\", \"arguments\": {\"path\": \"a.py\"}}\n</tool_call>\n\
                 <tool_call>{\"name\": \"run\", \"arguments\": \"{\\\"cmd\\\": \\\"ls\\\"}\"}</tool_call>";
        let calls = parse_tool_calls(t);
        assert_eq!(calls.len(), 2);
        let a = calls[0].as_ref().unwrap();
        assert_eq!(a.name, "view");
        assert_eq!(a.str_arg("path").unwrap(), "a.py");
        assert_eq!(calls[1].as_ref().unwrap().str_arg("cmd").unwrap(), "ls");
        assert_eq!(text_outside_calls(t), "I'll look.");
    }

    #[test]
    fn malformed_blocks_are_errors_not_panics() {
        let calls = parse_tool_calls(
            "<tool_call>{name: x}</tool_call><tool_call>[1]</tool_call>\
             <tool_call>{\"name\": \"f\", \"arguments\": 3}</tool_call><tool_call>{\"name\": \"g\"",
        );
        assert!(matches!(
            calls[0],
            Err(ToolCallError::Json { index: 0, .. })
        ));
        assert_eq!(calls[1], Err(ToolCallError::MissingName { index: 1 }));
        assert_eq!(calls[2], Err(ToolCallError::Arguments { index: 2 }));
        assert!(matches!(
            calls[3],
            Err(ToolCallError::Json { index: 3, .. })
        ));
        assert!(parse_tool_calls("no calls here").is_empty());
        // Unclosed but complete JSON is accepted.
        let c = parse_tool_calls("<tool_call>{\"name\": \"g\"}");
        assert_eq!(c[0].as_ref().unwrap().name, "g");
    }

    #[test]
    fn args_and_render() {
        let c = ToolCall::new("add", json!({"value": "3", "x": 2, "s": 1}));
        assert_eq!(c.int_arg("value").unwrap(), 3);
        assert_eq!(c.int_arg("x").unwrap(), 2);
        assert!(c
            .int_arg("missing")
            .unwrap_err()
            .contains("missing required"));
        assert!(c.str_arg("s").unwrap_err().contains("must be a string"));
        assert_eq!(c.opt_int_arg("nope").unwrap(), None);
        let r = c.render();
        assert_eq!(
            r,
            "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"value\": \"3\", \"x\": 2, \"s\": 1}}\n</tool_call>"
        );
        assert_eq!(parse_tool_calls(&r)[0].as_ref().unwrap(), &c);
    }
}
