//! JSONL reading with file:line errors (plain or gzip-compressed).

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::error::{EnvError, Result};

/// One JSON object of a JSONL file with its 1-based line number.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// The file it came from.
    pub path: PathBuf,
    /// 1-based line number.
    pub line: usize,
    /// The object.
    pub fields: Map<String, Value>,
}

impl Row {
    /// A required string field (numbers are accepted and written as text).
    pub fn str_field(&self, key: &str) -> Result<String> {
        match self.fields.get(key) {
            Some(Value::String(s)) => Ok(s.clone()),
            Some(Value::Number(n)) => Ok(n.to_string()),
            Some(other) => Err(self.field_error(key, format!("expected a string, got {other}"))),
            None => Err(self.field_error(
                key,
                format!(
                    "missing (the row has: {})",
                    self.fields.keys().cloned().collect::<Vec<_>>().join(", ")
                ),
            )),
        }
    }

    /// An optional string field (`null` and absent are `None`).
    pub fn opt_str_field(&self, key: &str) -> Result<Option<String>> {
        match self.fields.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(_) => self.str_field(key).map(Some),
        }
    }

    /// A required list-of-strings field; a JSON string holding such a list
    /// (as SWE-bench stores `FAIL_TO_PASS`) is accepted.
    pub fn str_list_field(&self, key: &str) -> Result<Vec<String>> {
        let v = self
            .fields
            .get(key)
            .ok_or_else(|| self.field_error(key, "missing".to_string()))?;
        let v = match v {
            Value::String(s) => serde_json::from_str::<Value>(s)
                .map_err(|e| self.field_error(key, format!("not a JSON list: {e}")))?,
            other => other.clone(),
        };
        match v {
            Value::Array(items) => items
                .into_iter()
                .map(|i| match i {
                    Value::String(s) => Ok(s),
                    other => {
                        Err(self.field_error(key, format!("list item {other} is not a string")))
                    }
                })
                .collect(),
            other => Err(self.field_error(key, format!("expected a list of strings, got {other}"))),
        }
    }

    /// An error about `key` of this row.
    pub fn field_error(&self, key: &str, msg: String) -> EnvError {
        EnvError::Field {
            path: self.path.clone(),
            line: self.line,
            key: key.to_string(),
            msg,
        }
    }
}

/// The one place data paths are resolved: `$ARBOR_SHARED_DATA` when set,
/// else `shared/data` beside the repository checkout (`<repo>/../shared/data`,
/// fixed when Arbor is built). Holds the Qwen3 tokenizer, the math
/// datasets and HumanEval. `None` when that directory is absent.
pub fn shared_data_dir() -> Option<PathBuf> {
    let p = match std::env::var_os("ARBOR_SHARED_DATA") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data"),
    };
    p.is_dir().then_some(p)
}

/// Whether this is a CI run (`CI=true`), where a test's missing
/// prerequisite (shared data, bubblewrap, python3) is a failure, not a skip.
pub fn ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// For tests: report a missing prerequisite `what` (`why` it is missing).
/// Under `CI=true` this panics, failing the test; elsewhere it prints a
/// `SKIP` line and the caller returns early.
pub fn skip_or_fail(what: &str, why: &str) {
    if ci() {
        panic!("{what}: {why} (CI=true: a missing prerequisite fails instead of skipping)");
    }
    println!("SKIP {what}: {why}");
}

/// For tests: `shared_data_dir()/rel` if it exists; else `None` after
/// [`skip_or_fail`] (a panic under `CI=true`).
pub fn shared_data(rel: &str, what: &str) -> Option<PathBuf> {
    match shared_data_dir()
        .map(|d| d.join(rel))
        .filter(|p| p.exists())
    {
        Some(p) => Some(p),
        None => {
            skip_or_fail(
                what,
                &format!(
                    "shared data `{rel}` is not present ($ARBOR_SHARED_DATA or ../shared/data)"
                ),
            );
            None
        }
    }
}

/// Reads every non-blank line of a JSONL file (`.gz`: gzip) as an object.
/// A line that is not a JSON object is an error naming `file:line`.
pub fn read_jsonl(path: &Path) -> Result<Vec<Row>> {
    let f = std::fs::File::open(path).map_err(|e| EnvError::Io {
        path: path.to_path_buf(),
        source: e,
    })?;
    let reader: Box<dyn Read> = if path.extension().is_some_and(|e| e == "gz") {
        Box::new(flate2::read::GzDecoder::new(f))
    } else {
        Box::new(f)
    };
    let mut rows = Vec::new();
    for (i, line) in BufReader::new(reader).lines().enumerate() {
        let line_no = i + 1;
        let line = line.map_err(|e| EnvError::Data {
            path: path.to_path_buf(),
            line: line_no,
            msg: format!("unreadable: {e}"),
        })?;
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<Value>(&line) {
            Ok(Value::Object(fields)) => rows.push(Row {
                path: path.to_path_buf(),
                line: line_no,
                fields,
            }),
            Ok(other) => {
                return Err(EnvError::Data {
                    path: path.to_path_buf(),
                    line: line_no,
                    msg: format!("expected a JSON object, got {}", kind(&other)),
                })
            }
            Err(e) => {
                return Err(EnvError::Data {
                    path: path.to_path_buf(),
                    line: line_no,
                    msg: format!("invalid JSON: {e}"),
                })
            }
        }
    }
    Ok(rows)
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn errors_name_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("d.jsonl");
        std::fs::write(&p, "{\"a\": 1}\n\n[1]\n").unwrap();
        let e = read_jsonl(&p).unwrap_err().to_string();
        assert!(
            e.ends_with("d.jsonl:3: expected a JSON object, got an array"),
            "{e}"
        );
        std::fs::write(&p, "{\"a\": 1}\n{oops\n").unwrap();
        let e = read_jsonl(&p).unwrap_err().to_string();
        assert!(e.contains("d.jsonl:2: invalid JSON"), "{e}");
        std::fs::write(&p, "{\"a\": 1, \"l\": \"[\\\"x\\\"]\"}\n").unwrap();
        let rows = read_jsonl(&p).unwrap();
        assert_eq!(rows[0].str_field("a").unwrap(), "1");
        assert_eq!(rows[0].str_list_field("l").unwrap(), vec!["x"]);
        let e = rows[0].str_field("b").unwrap_err().to_string();
        assert!(
            e.contains("d.jsonl:1: field `b`: missing (the row has: a, l)"),
            "{e}"
        );
        assert!(read_jsonl(&dir.path().join("none.jsonl")).is_err());
    }

    #[test]
    fn gzip() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("d.jsonl.gz");
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        enc.write_all(b"{\"k\": \"v\"}\n").unwrap();
        std::fs::write(&p, enc.finish().unwrap()).unwrap();
        assert_eq!(read_jsonl(&p).unwrap()[0].str_field("k").unwrap(), "v");
    }
}
