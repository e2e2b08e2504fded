//! `arbor swe build` and `arbor swe check`: SWE tasks from real Python
//! packages, and the oracle check of any SWE-bench-style instance file.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use arbor_env::data::read_jsonl;
use arbor_env::swe::{load_instances, oracle, Limits, Sandbox, SweInstance, SweTask};
use clap::{Args, Subcommand};
use serde::Serialize;

/// The task factory (run with the host's Python 3; see its docstring).
const BUILDER: &str = include_str!("../scripts/swe_build.py");

#[derive(Debug, Subcommand)]
pub enum SweCommand {
    /// Build SWE tasks from pinned Python packages of the package index:
    /// one-commit repositories, one read-only Python environment per
    /// package, bugs injected by AST mutations of the package source,
    /// FAIL_TO_PASS / PASS_TO_PASS from two stable runs of the suite, every
    /// task oracle-checked through Arbor's evaluation. Writes
    /// OUT/instances.jsonl, specs.json, repos/, envs/, manifest.json and
    /// oracle.jsonl.
    Build(BuildArgs),
    /// Oracle-check SWE instances: the buggy tree must score 0 and the gold
    /// patch 1, through the same evaluation episodes use. Prints a summary;
    /// writes the passing rows and per-task results when asked.
    Check(CheckArgs),
}

#[derive(Debug, Args)]
pub struct BuildArgs {
    /// Output directory.
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Packages (comma-separated; default: the eleven with fast suites).
    #[arg(long)]
    pub packages: Option<String>,
    /// Tasks kept per package at most.
    #[arg(long, default_value_t = 70)]
    pub tasks_per_package: usize,
    /// Mutants tried per package at most.
    #[arg(long, default_value_t = 200)]
    pub max_candidates: usize,
    /// PASS_TO_PASS tests sampled per task.
    #[arg(long, default_value_t = 30)]
    pub p2p: usize,
    /// Seconds of mutant runs per package, after which no new run starts
    /// (keeps a build's time bounded when a suite is slow).
    #[arg(long, default_value_t = 100.0)]
    pub package_seconds: f64,
    /// Seed of the mutant order and the PASS_TO_PASS sample.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Parallel test runs (default: the number of CPUs).
    #[arg(long)]
    pub jobs: Option<usize>,
    /// The Python that runs the factory.
    #[arg(long, default_value = "python3")]
    pub python: String,
    /// Run tests without bubblewrap (only for trusted packages).
    #[arg(long)]
    pub unsandboxed: bool,
}

#[derive(Debug, Args)]
pub struct CheckArgs {
    /// SWE-bench-style instances (JSONL; `specs.json` beside it applies).
    pub instances: PathBuf,
    /// Directory of repositories (default: `repos/` beside the instances).
    #[arg(long, value_name = "DIR")]
    pub repos: Option<PathBuf>,
    /// Write the rows that pass, unchanged, to this JSONL file.
    #[arg(long, value_name = "FILE")]
    pub passed: Option<PathBuf>,
    /// Write one JSON result per instance to this JSONL file.
    #[arg(long, value_name = "FILE")]
    pub results: Option<PathBuf>,
    /// Parallel checks (default: the number of CPUs).
    #[arg(long)]
    pub jobs: Option<usize>,
    /// Run tests without bubblewrap (only for trusted repositories).
    #[arg(long)]
    pub unsandboxed: bool,
}

pub fn run(c: SweCommand) -> Result<()> {
    match c {
        SweCommand::Build(a) => build(a),
        SweCommand::Check(a) => {
            let s = check(&CheckJob {
                instances: &a.instances,
                repos: a.repos.as_deref(),
                passed: a.passed.as_deref(),
                results: a.results.as_deref(),
                jobs: jobs(a.jobs),
                unsandboxed: a.unsandboxed,
            })?;
            s.print();
            Ok(())
        }
    }
}

fn jobs(j: Option<usize>) -> usize {
    j.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from))
        .max(1)
}

fn build(a: BuildArgs) -> Result<()> {
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let t0 = Instant::now();
    let script = a.out.join(".swe_build.py");
    std::fs::write(&script, BUILDER).with_context(|| format!("writing {}", script.display()))?;
    let jobs = jobs(a.jobs);
    let mut cmd = std::process::Command::new(&a.python);
    cmd.arg(&script)
        .arg("--out")
        .arg(&a.out)
        .args(["--tasks-per-package", &a.tasks_per_package.to_string()])
        .args(["--max-candidates", &a.max_candidates.to_string()])
        .args(["--p2p", &a.p2p.to_string()])
        .args(["--package-seconds", &a.package_seconds.to_string()])
        .args(["--seed", &a.seed.to_string()])
        .args(["--jobs", &jobs.to_string()]);
    if let Some(p) = &a.packages {
        cmd.args(["--packages", p]);
    }
    if a.unsandboxed {
        cmd.arg("--unsandboxed");
    }
    let status = cmd
        .status()
        .with_context(|| format!("running the task factory with `{}`", a.python))?;
    let _ = std::fs::remove_file(&script);
    if !status.success() {
        bail!("the task factory failed ({status}); see its output above");
    }
    let factory_s = t0.elapsed().as_secs_f64();
    println!("checking every candidate through Arbor's evaluation ...");
    let s = check(&CheckJob {
        instances: &a.out.join("candidates.jsonl"),
        repos: None,
        passed: Some(&a.out.join("instances.jsonl")),
        results: Some(&a.out.join("oracle.jsonl")),
        jobs,
        unsandboxed: a.unsandboxed,
    })?;
    s.print();
    println!(
        "built {} tasks from {} packages in {:.0} s (factory {:.0} s, oracle check {:.0} s): {}",
        s.passed,
        s.passed_repos.len(),
        t0.elapsed().as_secs_f64(),
        factory_s,
        s.seconds,
        a.out.join("instances.jsonl").display()
    );
    Ok(())
}

struct CheckJob<'a> {
    instances: &'a Path,
    repos: Option<&'a Path>,
    passed: Option<&'a Path>,
    results: Option<&'a Path>,
    jobs: usize,
    unsandboxed: bool,
}

/// One instance's check.
#[derive(Debug, Serialize)]
struct CheckResult {
    instance_id: String,
    passed: bool,
    buggy: Option<f64>,
    gold: Option<f64>,
    buggy_s: Option<f64>,
    gold_s: Option<f64>,
    error: Option<String>,
}

struct CheckSummary {
    total: usize,
    passed: usize,
    /// The repositories with at least one passing instance.
    passed_repos: std::collections::BTreeSet<String>,
    failures: Vec<(String, String)>,
    eval_s: Vec<f64>,
    seconds: f64,
}

impl CheckSummary {
    fn print(&self) {
        let mut t = self.eval_s.clone();
        t.sort_by(f64::total_cmp);
        let q = |f: f64| t.get(((t.len() as f64 - 1.0) * f).round() as usize);
        println!(
            "oracle check: {} of {} instances pass (buggy tree 0, gold patch 1) in {:.1} s",
            self.passed, self.total, self.seconds
        );
        if let (Some(m), Some(p90), Some(mx)) = (q(0.5), q(0.9), t.last()) {
            println!(
                "one evaluation (copy, restore tests, run the selected tests, parse): median {m:.2} s, p90 {p90:.2} s, max {mx:.2} s over {} runs",
                t.len()
            );
        }
        for (id, why) in self.failures.iter().take(10) {
            println!("  FAILED {id}: {why}");
        }
        if self.failures.len() > 10 {
            println!("  ... and {} more", self.failures.len() - 10);
        }
    }
}

fn check(j: &CheckJob<'_>) -> Result<CheckSummary> {
    let t0 = Instant::now();
    let insts = load_instances(j.instances)
        .with_context(|| format!("reading {}", j.instances.display()))?;
    let rows = read_jsonl(j.instances)?;
    let repos = match j.repos {
        Some(r) => r.to_path_buf(),
        None => j.instances.parent().unwrap_or(Path::new(".")).join("repos"),
    };
    let sandbox = Sandbox::detect(Limits::default(), j.unsandboxed)?;
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<CheckResult>>> =
        Mutex::new((0..insts.len()).map(|_| None).collect());
    let bar = indicatif::ProgressBar::new(insts.len() as u64);
    std::thread::scope(|s| {
        for _ in 0..j.jobs.min(insts.len()).max(1) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(inst) = insts.get(i) else { break };
                let r = check_one(inst, &repos, &sandbox);
                results.lock().expect("results")[i] = Some(r);
                bar.inc(1);
            });
        }
    });
    bar.finish_and_clear();
    let results: Vec<CheckResult> = results
        .into_inner()
        .expect("results")
        .into_iter()
        .flatten()
        .collect();
    let mut s = CheckSummary {
        total: results.len(),
        passed: 0,
        passed_repos: Default::default(),
        failures: Vec::new(),
        eval_s: Vec::new(),
        seconds: t0.elapsed().as_secs_f64(),
    };
    let mut passed_out = match j.passed {
        Some(p) => Some(std::io::BufWriter::new(
            std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?,
        )),
        None => None,
    };
    let mut results_out = match j.results {
        Some(p) => Some(std::io::BufWriter::new(
            std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?,
        )),
        None => None,
    };
    for ((r, row), inst) in results.iter().zip(&rows).zip(&insts) {
        s.eval_s.extend(r.buggy_s.iter().chain(&r.gold_s));
        if r.passed {
            s.passed += 1;
            s.passed_repos.insert(inst.repo.clone());
            if let Some(w) = &mut passed_out {
                writeln!(w, "{}", serde_json::Value::Object(row.fields.clone()))?;
            }
        } else {
            s.failures.push((
                r.instance_id.clone(),
                r.error.clone().unwrap_or_else(|| {
                    format!(
                        "buggy {:?}, gold {:?}",
                        r.buggy.unwrap_or(f64::NAN),
                        r.gold.unwrap_or(f64::NAN)
                    )
                }),
            ));
        }
        if let Some(w) = &mut results_out {
            writeln!(w, "{}", serde_json::to_string(r)?)?;
        }
    }
    for w in [passed_out.as_mut(), results_out.as_mut()]
        .into_iter()
        .flatten()
    {
        w.flush()?;
    }
    Ok(s)
}

fn check_one(inst: &SweInstance, repos: &Path, sandbox: &Sandbox) -> CheckResult {
    let res = SweTask::locate(inst, repos).and_then(|src| oracle(inst, &src, sandbox));
    match res {
        Ok(o) => CheckResult {
            instance_id: inst.instance_id.clone(),
            passed: o.passed(),
            buggy: Some(o.buggy),
            gold: Some(o.gold),
            buggy_s: Some(o.buggy_s),
            gold_s: Some(o.gold_s),
            error: (!o.passed() && o.gold != 1.0).then(|| {
                o.gold_failures
                    .iter()
                    .take(3)
                    .map(|(t, why)| format!("{t}: {}", why.lines().last().unwrap_or("")))
                    .collect::<Vec<_>>()
                    .join("; ")
            }),
        },
        Err(e) => CheckResult {
            instance_id: inst.instance_id.clone(),
            passed: false,
            buggy: None,
            gold: None,
            buggy_s: None,
            gold_s: None,
            error: Some(e.to_string()),
        },
    }
}
