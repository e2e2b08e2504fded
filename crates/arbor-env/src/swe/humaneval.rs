//! HumanEval-derived SWE tasks: each problem becomes a one-module repository
//! (`solution.py`) with a bug injected by a mutation operator, a one-paragraph
//! issue, the hidden test (`test_solution.py`, added by the `test_patch`
//! only at evaluation) and the gold patch restoring the canonical solution,
//! written in the SWE-bench instance format.
//!
//! A mutant is accepted only if the sandboxed test fails on it (not with a
//! syntax error or a timeout); the oracle check then runs the real episode
//! executor: the buggy workspace scores 0 and the gold patch scores 1.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::sandbox::Sandbox;
use super::task::{oracle, SweInstance};
use crate::data::read_jsonl;
use crate::error::{EnvError, Result};
use crate::synthetic::SplitMix64;

/// One HumanEval problem.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HumanEvalProblem {
    /// `HumanEval/N`.
    pub task_id: String,
    /// Signature and docstring.
    pub prompt: String,
    /// The reference body.
    pub canonical_solution: String,
    /// `def check(candidate): ...`.
    pub test: String,
    /// The function name.
    pub entry_point: String,
}

/// Reads `HumanEval.jsonl(.gz)`.
pub fn load_humaneval(path: &Path) -> Result<Vec<HumanEvalProblem>> {
    read_jsonl(path)?
        .iter()
        .map(|r| {
            Ok(HumanEvalProblem {
                task_id: r.str_field("task_id")?,
                prompt: r.str_field("prompt")?,
                canonical_solution: r.str_field("canonical_solution")?,
                test: r.str_field("test")?,
                entry_point: r.str_field("entry_point")?,
            })
        })
        .collect()
}

/// A single-line mutant of a solution.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mutant {
    /// The operator (`compare`, `arith`, `off_by_one`, `bool_op`,
    /// `bool_const`, `negate_cond`).
    pub op: String,
    /// 0-based line of the solution body.
    pub line: usize,
    /// The mutated line.
    pub new_line: String,
}

/// `line` with the contents of its string literals replaced by `_` (quotes
/// kept, same byte length).
fn mask_strings(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut quote: Option<char> = None;
    let mut escaped = false;
    for c in line.chars() {
        match quote {
            Some(q) => {
                if escaped {
                    escaped = false;
                    out.extend(std::iter::repeat_n('_', c.len_utf8()));
                } else if c == '\\' {
                    escaped = true;
                    out.push('_');
                } else if c == q {
                    quote = None;
                    out.push(c);
                } else {
                    out.extend(std::iter::repeat_n('_', c.len_utf8()));
                }
            }
            None => {
                if c == '"' || c == '\'' {
                    quote = Some(c);
                }
                out.push(c);
            }
        }
    }
    out
}

fn is_code(line: &str) -> bool {
    let t = line.trim();
    !t.is_empty() && !t.starts_with('#') && !t.starts_with("\"\"\"") && !t.starts_with("'''")
}

/// Every single-line mutant of `body` the operators produce, in a fixed
/// order (operator, then line).
pub fn mutants(body: &str) -> Vec<Mutant> {
    let lines: Vec<&str> = body.lines().collect();
    let mut out = Vec::new();
    let mut push = |op: &str, i: usize, s: String| {
        if s != lines[i] {
            out.push(Mutant {
                op: op.to_string(),
                line: i,
                new_line: s,
            });
        }
    };
    let cmp = regex::Regex::new(r"(?:<=|>=|==|!=|<|>)").ok();
    let int = regex::Regex::new(r"\b\d+\b").ok();
    for (i, l) in lines.iter().enumerate().filter(|(_, l)| is_code(l)) {
        // Operators are searched in `code` (string contents blanked out, same
        // byte offsets) and spliced into the original line.
        let code = mask_strings(l);
        let splice =
            |start: usize, end: usize, rep: &str| format!("{}{rep}{}", &l[..start], &l[end..]);
        if let Some(m) = cmp.as_ref().and_then(|r| {
            r.find_iter(&code).find(|m| {
                let b = code.as_bytes();
                let prev = m.start().checked_sub(1).map(|j| b[j]);
                let next = b.get(m.end()).copied();
                !matches!(prev, Some(b'<' | b'>' | b'-' | b'=' | b'!'))
                    && !matches!(next, Some(b'<' | b'>' | b'='))
            })
        }) {
            let rep = match m.as_str() {
                "<=" => "<",
                ">=" => ">",
                "<" => "<=",
                ">" => ">=",
                "==" => "!=",
                _ => "==",
            };
            push("compare", i, splice(m.start(), m.end(), rep));
        }
        if let Some(j) = code.find(" + ") {
            push("arith", i, splice(j, j + 3, " - "));
        } else if let Some(j) = code.find(" - ") {
            push("arith", i, splice(j, j + 3, " + "));
        }
        if let Some(m) = int.as_ref().and_then(|r| r.find(&code)) {
            let prev = m.start().checked_sub(1).map(|j| code.as_bytes()[j]);
            if !prev.is_some_and(|c| c.is_ascii_alphabetic() || c == b'_' || c == b'.') {
                if let Ok(n) = m.as_str().parse::<u64>() {
                    push(
                        "off_by_one",
                        i,
                        splice(m.start(), m.end(), &(n + 1).to_string()),
                    );
                }
            }
        }
        if let Some(j) = code.find(" and ") {
            push("bool_op", i, splice(j, j + 5, " or "));
        } else if let Some(j) = code.find(" or ") {
            push("bool_op", i, splice(j, j + 4, " and "));
        }
        if let Some(j) = code.find("True") {
            push("bool_const", i, splice(j, j + 4, "False"));
        } else if let Some(j) = code.find("False") {
            push("bool_const", i, splice(j, j + 5, "True"));
        }
        for (a, b) in [
            ("min(", "max("),
            ("max(", "min("),
            (".lower()", ".upper()"),
            (".upper()", ".lower()"),
            (".startswith(", ".endswith("),
            (".endswith(", ".startswith("),
        ] {
            if let Some(j) = code.find(a) {
                if !code[..j].ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_') {
                    push("swap_call", i, splice(j, j + a.len(), b));
                    break;
                }
            }
        }
        if code.trim_start().starts_with("return") || code.contains(" for ") {
            if let Some(j) = code.find(" if ").filter(|_| code.contains(" for ")) {
                push("negate_cond", i, splice(j, j + 4, " if not "));
            }
        }
        let t = l.trim_start();
        let indent = &l[..l.len() - t.len()];
        for kw in ["if ", "elif ", "while "] {
            if let Some(cond) = t
                .strip_prefix(kw)
                .and_then(|c| c.trim_end().strip_suffix(':'))
            {
                if !cond.contains(':') {
                    push("negate_cond", i, format!("{indent}{kw}not ({cond}):"));
                }
                break;
            }
        }
    }
    out
}

/// A unified diff (`git apply` format) turning `old` into `new` for file
/// `path`, as one hunk with 3 lines of context. Both texts end with `\n`.
pub fn unified_diff(path: &str, old: &str, new: &str) -> String {
    let a: Vec<&str> = old.lines().collect();
    let b: Vec<&str> = new.lines().collect();
    let mut pre = 0;
    while pre < a.len() && pre < b.len() && a[pre] == b[pre] {
        pre += 1;
    }
    let mut suf = 0;
    while suf < a.len() - pre && suf < b.len() - pre && a[a.len() - 1 - suf] == b[b.len() - 1 - suf]
    {
        suf += 1;
    }
    let start = pre.saturating_sub(3);
    let end_a = (a.len() - suf + 3).min(a.len());
    let end_b = (b.len() - suf + 3).min(b.len());
    let mut s = format!("diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n");
    s.push_str(&format!(
        "@@ -{},{} +{},{} @@\n",
        start + 1,
        end_a - start,
        start + 1,
        end_b - start
    ));
    for l in &a[start..pre] {
        s.push_str(&format!(" {l}\n"));
    }
    for l in &a[pre..a.len() - suf] {
        s.push_str(&format!("-{l}\n"));
    }
    for l in &b[pre..b.len() - suf] {
        s.push_str(&format!("+{l}\n"));
    }
    for l in &a[a.len() - suf..end_a] {
        s.push_str(&format!(" {l}\n"));
    }
    s
}

/// A unified diff creating the new file `path` with `text`.
pub fn new_file_diff(path: &str, text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let mut s = format!(
        "diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n+++ b/{path}\n@@ -0,0 +1,{} @@\n",
        lines.len()
    );
    for l in lines {
        s.push_str(&format!("+{l}\n"));
    }
    s
}

fn with_newline(s: String) -> String {
    if s.ends_with('\n') {
        s
    } else {
        s + "\n"
    }
}

/// The module file of a problem with `body` as the solution.
pub fn module_text(p: &HumanEvalProblem, body: &str) -> String {
    with_newline(format!("{}{}", p.prompt, body))
}

/// The hidden test file.
pub fn test_text(p: &HumanEvalProblem) -> String {
    with_newline(format!(
        "from solution import *  # noqa: F401,F403\nfrom solution import {ep}\n{}\n\ncheck({ep})\n",
        p.test,
        ep = p.entry_point
    ))
}

/// The one-paragraph issue text.
pub fn issue_text(p: &HumanEvalProblem) -> String {
    let doc = p
        .prompt
        .split("\"\"\"")
        .nth(1)
        .or_else(|| p.prompt.split("'''").nth(1))
        .unwrap_or("");
    let summary: String = doc
        .split(">>>")
        .next()
        .unwrap_or("")
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    let summary = match summary.char_indices().nth(300) {
        Some((i, _)) => format!("{}...", &summary[..i]),
        None => summary,
    };
    format!(
        "`{ep}` in `solution.py` does not behave as its docstring describes. The docstring \
         says: \"{summary}\" For some inputs the function returns a wrong result (or fails). \
         Please fix the implementation of `{ep}` so that it matches the documented behaviour, \
         including the examples in its docstring, without changing its signature.",
        ep = p.entry_point
    )
}

/// The number of a `HumanEval/N` id.
fn task_number(id: &str) -> String {
    id.rsplit('/').next().unwrap_or(id).to_string()
}

/// One built task.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BuiltTask {
    /// The instance.
    pub instance: SweInstance,
    /// The mutation applied.
    pub mutant: Mutant,
    /// Oracle: reward of the buggy workspace (must be 0).
    pub buggy_reward: f64,
    /// Oracle: reward with the gold patch applied (must be 1).
    pub fixed_reward: f64,
}

/// What [`build_task`] decided for one problem.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum BuildOutcome {
    /// A task whose oracle check passed.
    Built(Box<BuiltTask>),
    /// No usable task (the reason).
    Skipped(String),
}

/// Builds the task of one problem under `repos/<instance_id>/`: tries up to
/// `max_tries` mutants in a seeded order, keeps the first one the hidden
/// test rejects, and runs the oracle check through [`SweTask`].
pub fn build_task(
    p: &HumanEvalProblem,
    repos: &Path,
    sandbox: &Sandbox,
    max_tries: usize,
) -> Result<BuildOutcome> {
    let n = task_number(&p.task_id);
    let id = format!("humaneval-{n}");
    let dir = repos.join(&id);
    let canonical = module_text(p, &p.canonical_solution);
    let test = test_text(p);
    // The canonical solution must pass.
    let probe = tempfile::tempdir().map_err(|e| EnvError::io(repos, e))?;
    let write = |name: &str, text: &str| -> Result<()> {
        let f = probe.path().join(name);
        std::fs::write(&f, text).map_err(|e| EnvError::io(&f, e))
    };
    write("solution.py", &canonical)?;
    write("test_solution.py", &test)?;
    sandbox.own(probe.path())?;
    let o = sandbox.run(probe.path(), "python3 -B test_solution.py")?;
    if !o.success() {
        return Ok(BuildOutcome::Skipped(format!(
            "{}: the canonical solution fails its own test: {}",
            p.task_id,
            o.render()
        )));
    }
    let mut cands = mutants(&p.canonical_solution);
    let mut rng = SplitMix64::new(n.parse::<u64>().unwrap_or(0) ^ 0x4855_4d41_4e45); // "HUMANE"
    for i in (1..cands.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        cands.swap(i, j);
    }
    let body_lines: Vec<&str> = p.canonical_solution.lines().collect();
    for m in cands.into_iter().take(max_tries) {
        let mut lines = body_lines.clone();
        lines[m.line] = &m.new_line;
        let body = lines.join("\n") + "\n";
        let buggy = module_text(p, &body);
        write("solution.py", &buggy)?;
        let o = sandbox.run(probe.path(), "python3 -B test_solution.py")?;
        let bad = o.stderr.contains("SyntaxError")
            || o.stderr.contains("IndentationError")
            || o.timed_out
            || o.output_flood;
        if o.success() || bad {
            continue;
        }
        // Write the repository and the instance, then run the oracle.
        if dir.exists() {
            std::fs::remove_dir_all(&dir).map_err(|e| EnvError::io(&dir, e))?;
        }
        std::fs::create_dir_all(&dir).map_err(|e| EnvError::io(&dir, e))?;
        let f = dir.join("solution.py");
        std::fs::write(&f, &buggy).map_err(|e| EnvError::io(&f, e))?;
        let instance = SweInstance {
            instance_id: id.clone(),
            repo: id.clone(),
            base_commit: String::new(),
            problem_statement: issue_text(p),
            patch: unified_diff("solution.py", &buggy, &canonical),
            test_patch: new_file_diff("test_solution.py", &test),
            fail_to_pass: vec!["test_solution.py".into()],
            pass_to_pass: Vec::new(),
            test_cmd: Some("python3 -B {test}".into()),
            spec: None,
        };
        let o = oracle(&instance, &dir, sandbox)?;
        let (buggy_reward, fixed_reward) = (o.buggy, o.gold);
        let built = BuiltTask {
            instance,
            mutant: m,
            buggy_reward,
            fixed_reward,
        };
        if buggy_reward != 0.0 || fixed_reward != 1.0 {
            return Ok(BuildOutcome::Skipped(format!(
                "{}: oracle failed (buggy {buggy_reward}, fixed {fixed_reward})",
                p.task_id
            )));
        }
        return Ok(BuildOutcome::Built(Box::new(built)));
    }
    Ok(BuildOutcome::Skipped(format!(
        "{}: no mutant among the first {max_tries} makes the test fail",
        p.task_id
    )))
}

/// Summary of a build.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct BuildReport {
    /// Tasks built (oracle passed), in problem order.
    pub built: Vec<BuiltTask>,
    /// Problems without a task, with the reason.
    pub skipped: Vec<String>,
}

/// Builds tasks for `problems` into `out` (`out/instances.jsonl`,
/// `out/repos/<id>/solution.py`) on `threads` threads.
pub fn build_all(
    problems: &[HumanEvalProblem],
    out: &Path,
    sandbox: &Sandbox,
    max_tries: usize,
    threads: usize,
) -> Result<BuildReport> {
    let repos = out.join("repos");
    std::fs::create_dir_all(&repos).map_err(|e| EnvError::io(&repos, e))?;
    let threads = threads.clamp(1, problems.len().max(1));
    let chunk = problems.len().div_ceil(threads).max(1);
    let results: Vec<Result<Vec<BuildOutcome>>> = std::thread::scope(|s| {
        let handles: Vec<_> = problems
            .chunks(chunk)
            .map(|ps| {
                let repos = repos.clone();
                s.spawn(move || {
                    ps.iter()
                        .map(|p| build_task(p, &repos, sandbox, max_tries))
                        .collect::<Result<Vec<_>>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(EnvError::Runtime("a build thread panicked".into())))
            })
            .collect()
    });
    let mut report = BuildReport::default();
    for r in results {
        for o in r? {
            match o {
                BuildOutcome::Built(b) => report.built.push(*b),
                BuildOutcome::Skipped(s) => report.skipped.push(s),
            }
        }
    }
    let path: PathBuf = out.join("instances.jsonl");
    let mut text = String::new();
    for b in &report.built {
        text.push_str(
            &serde_json::to_string(&b.instance)
                .map_err(|e| EnvError::task(&b.instance.instance_id, e.to_string()))?,
        );
        text.push('\n');
    }
    std::fs::write(&path, text).map_err(|e| EnvError::io(&path, e))?;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::swe::sandbox::tests::sandbox_or_skip;

    #[test]
    fn mutation_operators() {
        let body = "    if a < b and c:\n        return x + 1\n    return False\n    s = \"a < b\"\n    f = lambda: x >> 2\n    return [min(x) for x in y if x.lower() == 'a < b']\n";
        let m = mutants(body);
        let ops: Vec<(&str, &str)> = m
            .iter()
            .map(|m| (m.op.as_str(), m.new_line.as_str()))
            .collect();
        assert!(ops.contains(&("compare", "    if a <= b and c:")));
        assert!(ops.contains(&("bool_op", "    if a < b or c:")));
        assert!(ops.contains(&("negate_cond", "    if not (a < b and c):")));
        assert!(ops.contains(&("arith", "        return x - 1")));
        assert!(ops.contains(&("off_by_one", "        return x + 2")));
        assert!(ops.contains(&("bool_const", "    return True")));
        assert!(
            !m.iter().any(|m| m.line == 3),
            "string literals are left alone"
        );
        assert!(
            !m.iter().any(|m| m.line == 4 && m.op == "compare"),
            ">> is not a comparison"
        );
    }

    #[test]
    fn diffs_apply_with_git() {
        let Some(sb) = sandbox_or_skip("humaneval diffs") else {
            return;
        };
        let old = "a\nb\nc\nd\ne\nf\ng\nh\n";
        let new = "a\nb\nc\nd\nE\nf\ng\nh\n";
        let d = unified_diff("m.py", old, new);
        assert!(
            d.contains("@@ -2,7 +2,7 @@\n b\n c\n d\n-e\n+E\n f\n g\n h\n"),
            "{d}"
        );
        let ws = tempfile::tempdir().unwrap();
        std::fs::write(ws.path().join("m.py"), old).unwrap();
        std::fs::write(ws.path().join("p1"), &d).unwrap();
        std::fs::write(
            ws.path().join("p2"),
            new_file_diff("t.py", "x = 1\n\ny = 2\n"),
        )
        .unwrap();
        crate::swe::sandbox::chown_for_sandbox(ws.path()).unwrap();
        let o = sb
            .run(ws.path(), "git apply p1 && git apply p2 && cat m.py t.py")
            .unwrap();
        assert!(o.success(), "{o:?}");
        assert_eq!(o.stdout, format!("{new}x = 1\n\ny = 2\n"));
    }

    #[test]
    fn humaneval_sample_builds_and_passes_the_oracle() {
        let Some(sb) = sandbox_or_skip("humaneval tasks") else {
            return;
        };
        let Some(path) =
            crate::data::shared_data("code/humaneval/HumanEval.jsonl.gz", "humaneval tasks")
        else {
            return;
        };
        let all = load_humaneval(&path).unwrap();
        assert_eq!(all.len(), 164);
        let out = tempfile::tempdir().unwrap();
        // A sample here (the full build is `scripts/build_humaneval_tasks.sh`).
        let sample: Vec<HumanEvalProblem> = all.iter().step_by(41).cloned().collect();
        let report = build_all(&sample, out.path(), &sb, 8, 2).unwrap();
        assert_eq!(report.built.len() + report.skipped.len(), sample.len());
        assert!(report.built.len() >= 3, "{:?}", report.skipped);
        for b in &report.built {
            assert_eq!((b.buggy_reward, b.fixed_reward), (0.0, 1.0));
            assert!(b
                .instance
                .problem_statement
                .contains("in `solution.py` does not behave"));
        }
        let inst = crate::swe::task::load_instances(&out.path().join("instances.jsonl")).unwrap();
        assert_eq!(inst.len(), report.built.len());
        assert!(out
            .path()
            .join("repos")
            .join(&inst[0].instance_id)
            .join("solution.py")
            .exists());
    }
}
