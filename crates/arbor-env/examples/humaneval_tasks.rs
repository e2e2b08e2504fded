//! Builds the HumanEval-derived SWE tasks and runs the oracle check on every
//! one (canonical fix -> reward 1, buggy -> 0, in the sandbox).
//!
//! ```text
//! cargo run --release -p arbor-env --example humaneval_tasks -- \
//!     [--data ../shared/data/code/humaneval/HumanEval.jsonl.gz] [--out DIR] \
//!     [--threads 2] [--tries 16] [--unsandboxed]
//! ```
//!
//! Writes `DIR/instances.jsonl` (SWE-bench format plus `test_cmd`) and
//! `DIR/repos/<instance_id>/solution.py`, and prints the counts.

use std::path::PathBuf;

use arbor_env::swe::humaneval::{build_all, load_humaneval};
use arbor_env::swe::sandbox::{Limits, Sandbox};

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let mut data =
        arbor_env::data::shared_data_dir().map(|d| d.join("code/humaneval/HumanEval.jsonl.gz"));
    let mut out = PathBuf::from("target/humaneval-tasks");
    let (mut threads, mut tries, mut unsandboxed) = (2usize, 16usize, false);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "--data" => data = Some(PathBuf::from(val()?)),
            "--out" => out = PathBuf::from(val()?),
            "--threads" => threads = val()?.parse()?,
            "--tries" => tries = val()?.parse()?,
            "--unsandboxed" => unsandboxed = true,
            other => return Err(format!("unknown argument `{other}`").into()),
        }
    }
    let data = data.ok_or("no HumanEval data: pass --data HumanEval.jsonl.gz")?;
    let limits = Limits {
        cpu_secs: 10,
        wall_secs: 20.0,
        ..Limits::default()
    };
    let sandbox = Sandbox::detect(limits, unsandboxed)?;
    let problems = load_humaneval(&data)?;
    let report = build_all(&problems, &out, &sandbox, tries, threads)?;
    let mut ops = std::collections::BTreeMap::new();
    for b in &report.built {
        *ops.entry(b.mutant.op.clone()).or_insert(0usize) += 1;
    }
    for s in &report.skipped {
        println!("skipped: {s}");
    }
    println!("mutation operators: {ops:?}");
    println!(
        "{} problems -> {} tasks built, oracle passed on all of them (buggy reward 0, canonical fix 1); {} skipped; written to {}",
        problems.len(),
        report.built.len(),
        report.skipped.len(),
        out.join("instances.jsonl").display()
    );
    Ok(())
}
