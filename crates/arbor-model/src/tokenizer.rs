//! `tokenizer.json` through HF `tokenizers`, and the chat template from
//! `tokenizer_config.json` rendered by minijinja the way transformers renders
//! it (`trim_blocks`, `lstrip_blocks`, Python string methods, transformers'
//! `tojson`, `raise_exception`, `strftime_now`).

use std::path::{Path, PathBuf};

use minijinja::{Environment, Error as JinjaError, ErrorKind, Value as JValue};
use serde::Serialize;
use serde_json::Value;

use crate::error::{ModelError, Result};

/// A text tokenizer.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("path", &self.path)
            .field("vocab_size", &self.vocab_size())
            .finish()
    }
}

impl Tokenizer {
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        if !path.is_file() {
            return Err(ModelError::io(
                path,
                std::io::Error::new(std::io::ErrorKind::NotFound, "tokenizer.json not found"),
            ));
        }
        let inner = tokenizers::Tokenizer::from_file(path).map_err(|e| ModelError::Tokenizer {
            path: path.to_path_buf(),
            msg: e.to_string(),
        })?;
        Ok(Tokenizer {
            inner,
            path: path.to_path_buf(),
        })
    }

    fn err(&self, e: impl std::fmt::Display) -> ModelError {
        ModelError::Tokenizer {
            path: self.path.clone(),
            msg: e.to_string(),
        }
    }

    /// Token ids of `text`. Special-token strings in the text (e.g.
    /// `<|im_start|>`) map to their ids. `add_special_tokens` applies the
    /// tokenizer's post-processor (BOS for Llama-style tokenizers).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| self.err(e))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids` (special tokens kept unless `skip_special`).
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| self.err(e))
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Ids whose text holds a newline (a cut after one starts a new line),
    /// ascending.
    pub fn line_end_ids(&self) -> Vec<u32> {
        (0..self.vocab_size() as u32)
            .filter(|&id| {
                self.inner
                    .decode(&[id], false)
                    .is_ok_and(|t| t.contains('\n'))
            })
            .collect()
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}

/// A chat template plus the special tokens it may refer to.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    specials: serde_json::Map<String, Value>,
}

/// Options of one render, as in transformers' `apply_chat_template`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ChatOptions {
    pub add_generation_prompt: bool,
    /// Qwen3: `Some(false)` adds an empty think block to the generation prompt.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub enable_thinking: Option<bool>,
}

impl ChatTemplate {
    /// Read `chat_template` and the special tokens from `tokenizer_config.json`.
    pub fn from_tokenizer_config(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        Self::from_model_files(Some(path), None)?.ok_or_else(|| ModelError::ConfigKey {
            path: path.to_path_buf(),
            key: "chat_template".into(),
            msg: "missing; this tokenizer has no chat template".into(),
        })
    }

    /// A model's chat template, as transformers finds it: the text of
    /// `chat_template.jinja` when there is one, else `chat_template` of
    /// `tokenizer_config.json`, with the special tokens of the latter.
    /// `Ok(None)` when neither has a template (normal for base models); a
    /// template that does not compile is an error naming its file.
    pub fn from_model_files(
        tokenizer_config: Option<&Path>,
        jinja: Option<&Path>,
    ) -> Result<Option<Self>> {
        let config = match tokenizer_config {
            Some(p) => {
                let text = std::fs::read_to_string(p).map_err(|e| ModelError::io(p, e))?;
                let v: Value = serde_json::from_str(&text).map_err(|e| ModelError::json(p, &e))?;
                Some((p, v))
            }
            None => None,
        };
        let specials = config
            .as_ref()
            .map_or_else(serde_json::Map::new, |(_, v)| Self::specials(v));
        if let Some(jinja) = jinja {
            let template = std::fs::read_to_string(jinja).map_err(|e| ModelError::io(jinja, e))?;
            return Self::new(template, specials)
                .map(Some)
                .map_err(|e| match e {
                    ModelError::Template { msg } => ModelError::Template {
                        msg: format!("{}: {msg}", jinja.display()),
                    },
                    other => other,
                });
        }
        let Some((path, v)) = config else {
            return Ok(None);
        };
        let bad = |msg: String| ModelError::ConfigKey {
            path: path.to_path_buf(),
            key: "chat_template".into(),
            msg,
        };
        let template = match v.get("chat_template") {
            Some(Value::String(s)) => s.clone(),
            // Newer configs may hold a list of named templates.
            Some(Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(|t| t.get("template"))
                .and_then(Value::as_str)
                .map(str::to_string)
                .ok_or_else(|| bad("a list without a `default` template".into()))?,
            _ => return Ok(None),
        };
        Self::new(template, specials)
            .map(Some)
            .map_err(|e| match e {
                ModelError::Template { msg } => bad(msg),
                other => other,
            })
    }

    /// The special tokens of a `tokenizer_config.json` as template
    /// variables (`bos_token`, ...; a string or an `AddedToken` object).
    fn specials(v: &Value) -> serde_json::Map<String, Value> {
        let mut specials = serde_json::Map::new();
        for key in ["bos_token", "eos_token", "pad_token", "unk_token"] {
            let tok = match v.get(key) {
                Some(Value::String(s)) => Value::String(s.clone()),
                Some(Value::Object(o)) => o.get("content").cloned().unwrap_or(Value::Null),
                _ => Value::Null,
            };
            specials.insert(key.into(), tok);
        }
        specials
    }

    /// Compile `template`; `specials` become template variables (`bos_token`, ...).
    pub fn new(template: String, specials: serde_json::Map<String, Value>) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<JValue, JinjaError> {
                Err(JinjaError::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_function("strftime_now", |fmt: String| strftime_now(&fmt));
        env.add_template_owned("chat", template)
            .map_err(|e| ModelError::Template { msg: jinja_msg(&e) })?;
        Ok(ChatTemplate { env, specials })
    }

    /// Render `messages` (a JSON list of `{role, content, ...}`) with optional
    /// `tools` (a JSON list of function schemas).
    pub fn render(
        &self,
        messages: &Value,
        tools: Option<&Value>,
        opts: &ChatOptions,
    ) -> Result<String> {
        if !messages.is_array() {
            return Err(ModelError::Template {
                msg: "messages must be a JSON list".into(),
            });
        }
        let mut ctx = self.specials.clone();
        ctx.insert("messages".into(), messages.clone());
        if let Some(t) = tools {
            ctx.insert("tools".into(), t.clone());
        }
        ctx.insert(
            "add_generation_prompt".into(),
            Value::Bool(opts.add_generation_prompt),
        );
        if let Some(t) = opts.enable_thinking {
            ctx.insert("enable_thinking".into(), Value::Bool(t));
        }
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| ModelError::Template { msg: jinja_msg(&e) })?;
        tmpl.render(JValue::from_serialize(&ctx))
            .map_err(|e| ModelError::Template { msg: jinja_msg(&e) })
    }
}

fn jinja_msg(e: &JinjaError) -> String {
    let mut s = e.to_string();
    if let Some(line) = e.line() {
        s = format!("line {line}: {s}");
    }
    s
}

/// transformers' `tojson`: Python `json.dumps(x, ensure_ascii=False)`, i.e.
/// `", "` and `": "` separators, keys in insertion order, no HTML escaping.
/// With `indent`, Python's pretty layout.
fn tojson(value: JValue, indent: Option<usize>) -> std::result::Result<JValue, JinjaError> {
    let v: Value = serde_json::to_value(&value)
        .map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = String::new();
    write_py_json(&v, indent, 0, &mut out);
    Ok(JValue::from_safe_string(out))
}

fn write_py_json(v: &Value, indent: Option<usize>, depth: usize, out: &mut String) {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v {
        Value::Array(a) if !a.is_empty() => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                write_py_json(x, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        Value::Object(o) if !o.is_empty() => {
            out.push('{');
            for (i, (k, x)) in o.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                out.push_str(&serde_json::to_string(k).expect("string serialises"));
                out.push_str(": ");
                write_py_json(x, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        Value::Number(n) if n.is_f64() => {
            let f = n.as_f64().expect("f64");
            // Python prints floats with a fractional part or exponent.
            if f.is_finite() && f.fract() == 0.0 && f.abs() < 1e16 {
                out.push_str(&format!("{f:.1}"));
            } else {
                out.push_str(&n.to_string());
            }
        }
        other => out.push_str(&serde_json::to_string(other).expect("json serialises")),
    }
}

/// `strftime_now(fmt)` as transformers provides it (UTC), supporting the
/// directives chat templates use: `%Y %m %d %e %B %b %H %M %S %%`.
fn strftime_now(fmt: &str) -> std::result::Result<JValue, JinjaError> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    Ok(JValue::from(format_utc(secs, fmt)?))
}

fn format_utc(secs: i64, fmt: &str) -> std::result::Result<String, JinjaError> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let days = secs.div_euclid(86400);
    let tod = secs.rem_euclid(86400);
    // Civil-from-days (proleptic Gregorian), Howard Hinnant's algorithm.
    let z = days + 719468;
    let era = z.div_euclid(146097);
    let doe = z - era * 146097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('e') => out.push_str(&format!("{d:>2}")),
            Some('B') => out.push_str(MONTHS[(m - 1) as usize]),
            Some('b') => out.push_str(&MONTHS[(m - 1) as usize][..3]),
            Some('H') => out.push_str(&format!("{:02}", tod / 3600)),
            Some('M') => out.push_str(&format!("{:02}", tod / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", tod % 60)),
            Some('%') => out.push('%'),
            other => {
                return Err(JinjaError::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: unsupported directive %{}",
                        other.map(String::from).unwrap_or_default()
                    ),
                ))
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_json_layout() {
        let v: Value =
            serde_json::from_str(r#"{"b": 1, "a": [1.0, "x<y>", {"é": null}], "c": {}}"#).unwrap();
        let mut s = String::new();
        write_py_json(&v, None, 0, &mut s);
        assert_eq!(s, r#"{"b": 1, "a": [1.0, "x<y>", {"é": null}], "c": {}}"#);
    }

    #[test]
    fn utc_dates() {
        // 2024-02-29 13:05:09 UTC
        assert_eq!(
            format_utc(1709211909, "%d %b %Y %H:%M:%S").unwrap(),
            "29 Feb 2024 13:05:09"
        );
        assert_eq!(format_utc(0, "%B %e, %Y").unwrap(), "January  1, 1970");
        assert!(format_utc(0, "%Q").is_err());
    }

    #[test]
    fn raise_exception_is_an_error() {
        let t = ChatTemplate::new(
            "{% if messages|length == 0 %}{{ raise_exception('no messages') }}{% endif %}ok".into(),
            Default::default(),
        )
        .unwrap();
        let e = t
            .render(&serde_json::json!([]), None, &ChatOptions::default())
            .unwrap_err();
        assert!(e.to_string().contains("no messages"), "{e}");
        let e = ChatTemplate::new("{% if %}".into(), Default::default()).unwrap_err();
        assert!(e.to_string().contains("chat template"), "{e}");
    }
}
