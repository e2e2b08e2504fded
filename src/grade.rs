//! `arbor grade`: grade a JSONL of model responses against reference
//! answers with the math grader of `arbor-env`.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

#[derive(Debug, Args)]
pub struct GradeArgs {
    /// JSONL file (optionally .gz), one object per line with a response and
    /// a reference answer.
    #[arg(long, value_name = "FILE.jsonl")]
    pub data: PathBuf,
    /// Field holding the model's response (null counts as no answer).
    #[arg(long, value_name = "F", default_value = "response")]
    pub response_field: String,
    /// Field holding the reference: a bare answer, or a GSM8K / MATH
    /// solution (its `#### N` or last `\boxed{}` is used).
    #[arg(long, value_name = "F", default_value = "answer")]
    pub answer_field: String,
    /// Print one JSON object per input row, in order, with `correct`,
    /// `extracted` (or null), `method`, `reference` and `line`; the accuracy
    /// goes to stderr.
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: GradeArgs) -> Result<()> {
    let rows = arbor_env::math::grade_jsonl(&a.data, &a.response_field, &a.answer_field)
        .with_context(|| format!("grading {}", a.data.display()))?;
    let n = rows.len();
    let correct = rows.iter().filter(|r| r.correct).count();
    let missing = rows.iter().filter(|r| r.extracted.is_none()).count();
    if a.json {
        let mut out = std::io::stdout().lock();
        for r in &rows {
            use std::io::Write;
            writeln!(out, "{}", serde_json::to_string(r)?)?;
        }
    }
    let acc = if n == 0 {
        0.0
    } else {
        correct as f64 / n as f64
    };
    let line =
        format!("accuracy {acc:.4} ({correct}/{n} correct; no answer extracted in {missing})");
    if a.json {
        eprintln!("{line}");
    } else {
        println!("{line}");
    }
    Ok(())
}
