//! Chat scaffolding of text observations: plain text, or the Qwen3 chat
//! template's turn markers (`<|im_start|>role ... <|im_end|>`), rendered
//! incrementally so the context stays `obs ++ act ++ obs ++ ...`.
//!
//! The strings match what the real Qwen3 template renders for the same
//! message list (system, tools block, user turns, tool responses wrapped in
//! `<tool_response>` inside a user turn, and the generation prompt).

use serde::{Deserialize, Serialize};

/// Qwen's end-of-turn marker (also the policy's stop string).
pub const IM_END: &str = "<|im_end|>";

/// How text observations are wrapped.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ChatFormat {
    /// Raw text, one observation per line.
    #[default]
    Plain,
    /// The Qwen3 chat template (thinking enabled: the generation prompt is
    /// `<|im_start|>assistant\n`).
    Qwen,
}

impl ChatFormat {
    /// The initial context: an optional system message, an optional tools
    /// block (JSON schemas, one per line, as the Qwen3 template renders
    /// them), the first user message and the generation prompt.
    pub fn first(&self, system: Option<&str>, tools: &[serde_json::Value], user: &str) -> String {
        match self {
            ChatFormat::Plain => {
                let mut s = String::new();
                if let Some(sys) = system {
                    s.push_str(sys);
                    s.push_str("\n\n");
                }
                if !tools.is_empty() {
                    s.push_str(&tools_block(tools));
                    s.push_str("\n\n");
                }
                s.push_str(user);
                s.push('\n');
                s
            }
            ChatFormat::Qwen => {
                let mut s = String::new();
                if !tools.is_empty() {
                    s.push_str("<|im_start|>system\n");
                    if let Some(sys) = system {
                        s.push_str(sys);
                        s.push_str("\n\n");
                    }
                    s.push_str(&tools_block(tools));
                    s.push_str("<|im_end|>\n");
                } else if let Some(sys) = system {
                    s.push_str(&format!("<|im_start|>system\n{sys}<|im_end|>\n"));
                }
                s.push_str(&format!(
                    "<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
                ));
                s
            }
        }
    }

    /// The observation after the policy's `prev_action`: a new user message.
    pub fn user(&self, prev_action: &str, user: &str) -> String {
        match self {
            ChatFormat::Plain => format!("{}{user}\n", plain_sep(prev_action)),
            ChatFormat::Qwen => format!(
                "{}<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n",
                close_turn(prev_action)
            ),
        }
    }

    /// The observation after the policy's `prev_action`: tool responses
    /// (one `<tool_response>` block each, in one user turn, as the Qwen3
    /// template groups consecutive tool messages).
    pub fn tool_responses(&self, prev_action: &str, contents: &[String]) -> String {
        self.tool_responses_with(prev_action, contents, None)
    }

    /// Tool responses followed, in the same user turn, by a harness `note`
    /// (e.g. the request to write a compaction summary).
    pub fn tool_responses_with(
        &self,
        prev_action: &str,
        contents: &[String],
        note: Option<&str>,
    ) -> String {
        let mut blocks = String::new();
        for c in contents {
            blocks.push_str(&format!("\n<tool_response>\n{c}\n</tool_response>"));
        }
        if let Some(n) = note {
            blocks.push_str(&format!("\n{n}"));
        }
        match self {
            ChatFormat::Plain => format!(
                "{}{}\n",
                plain_sep(prev_action),
                &blocks[1.min(blocks.len())..]
            ),
            ChatFormat::Qwen => format!(
                "{}<|im_start|>user{blocks}<|im_end|>\n<|im_start|>assistant\n",
                close_turn(prev_action)
            ),
        }
    }

    /// The closing text after the final action (so the transcript is a
    /// well-formed conversation).
    pub fn close(&self, prev_action: &str) -> String {
        match self {
            ChatFormat::Plain => String::new(),
            ChatFormat::Qwen => {
                let c = close_turn(prev_action);
                c.strip_suffix('\n').unwrap_or(&c).to_string() + "\n"
            }
        }
    }
}

fn plain_sep(prev: &str) -> &'static str {
    if prev.is_empty() || prev.ends_with('\n') {
        ""
    } else {
        "\n"
    }
}

/// What follows an assistant turn: `<|im_end|>\n`, minus the parts the
/// policy already produced.
fn close_turn(prev: &str) -> String {
    let t = prev.trim_end_matches(['\n', ' ']);
    if t.ends_with(IM_END) {
        if prev.ends_with('\n') {
            String::new()
        } else {
            "\n".to_string()
        }
    } else {
        format!("{IM_END}\n")
    }
}

/// The Qwen3 `# Tools` system block for JSON tool schemas.
pub fn tools_block(tools: &[serde_json::Value]) -> String {
    let mut s = String::from(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
         You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
    );
    for t in tools {
        s.push('\n');
        s.push_str(&qwen_tojson(t));
    }
    s.push_str(
        "\n</tools>\n\nFor each function call, return a json object with function name and \
         arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n\
         {\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>",
    );
    s
}

/// JSON as minijinja's `tojson` writes it in the template: `", "` and `": "`
/// separators (Python `json.dumps` style), keys in insertion order.
pub fn qwen_tojson(v: &serde_json::Value) -> String {
    use serde_json::Value;
    match v {
        Value::Object(m) => {
            let parts: Vec<String> = m
                .iter()
                .map(|(k, v)| format!("{}: {}", Value::String(k.clone()), qwen_tojson(v)))
                .collect();
            format!("{{{}}}", parts.join(", "))
        }
        Value::Array(a) => {
            let parts: Vec<String> = a.iter().map(qwen_tojson).collect();
            format!("[{}]", parts.join(", "))
        }
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qwen_turns() {
        let f = ChatFormat::Qwen;
        assert_eq!(
            f.first(Some("sys"), &[], "hi"),
            "<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
        let u = f.user("ok", "next");
        assert_eq!(
            u,
            "<|im_end|>\n<|im_start|>user\nnext<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(
            f.user("ok<|im_end|>", "n"),
            "\n<|im_start|>user\nn<|im_end|>\n<|im_start|>assistant\n"
        );
        let t = f.tool_responses("x", &["a".into(), "b".into()]);
        assert_eq!(
            t,
            "<|im_end|>\n<|im_start|>user\n<tool_response>\na\n</tool_response>\n<tool_response>\nb\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(f.close("x"), "<|im_end|>\n");
        assert_eq!(
            f.tool_responses_with("x<|im_end|>", &["a".into()], Some("note")),
            "\n<|im_start|>user\n<tool_response>\na\n</tool_response>\nnote<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(f.close("x<|im_end|>"), "\n");
    }

    #[test]
    fn tools_block_matches_template_layout() {
        let tool =
            serde_json::json!({"type": "function", "function": {"name": "f", "parameters": {}}});
        let s = ChatFormat::Qwen.first(None, &[tool], "u");
        assert!(s.starts_with("<|im_start|>system\n# Tools\n"));
        assert!(s.contains(
            "<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"f\", \"parameters\": {}}}\n</tools>"
        ));
        assert!(s.ends_with(
            "</tool_call><|im_end|>\n<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\n"
        ));
    }

    #[test]
    fn plain_turns() {
        let f = ChatFormat::Plain;
        assert_eq!(f.first(None, &[], "hi"), "hi\n");
        assert_eq!(f.user("3", "next"), "\nnext\n");
        assert_eq!(f.user("3\n", "next"), "next\n");
        assert_eq!(f.close("3"), "");
        assert_eq!(
            f.tool_responses("3", &["a".into()]),
            "\n<tool_response>\na\n</tool_response>\n"
        );
    }
}
