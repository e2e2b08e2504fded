//! How a repository's tests are run and read: the per-repository spec
//! (test command, report format, Python environment, files restored before
//! the run), the JUnit XML and pytest `-rA` log parsers, and the grading of
//! FAIL_TO_PASS / PASS_TO_PASS as SWE-bench grades them.
//!
//! One evaluation is one command: every selected test id goes on one
//! command line (`{tests}`), and the runner writes its report to `{report}`
//! (JUnit) or prints its `-rA` summary (pytest log). Statuses:
//!
//! | status | FAIL_TO_PASS / PASS_TO_PASS counts it as |
//! |---|---|
//! | passed, xfail, xpass | success |
//! | failed, error, absent from the report | failure |
//! | skipped | neither (left out of both rates) |
//!
//! A strict spec ([`RepoSpec::strict`]) counts only `passed` as success.
//! pytest's `-rA` summary names no skipped test, so in that format a
//! skipped test is absent (a failure); JUnit reports name them.
//!
//! The reward is 1 iff no selected test is a failure and at least one test
//! was selected (SWE-bench's "resolved": both success rates are 1, and a
//! rate over no counted test is 1).

use std::collections::{BTreeMap, HashMap};
use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{EnvError, Result};

/// The name of the report file `{report}` stands for, in the workspace
/// root of the evaluation copy.
pub const REPORT_FILE: &str = ".arbor-report.xml";

/// How the test runner reports per-test outcomes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    /// A JUnit XML file written to `{report}` (pytest `--junitxml`).
    #[default]
    Junit,
    /// pytest's short summary on stdout (`-rA`: `PASSED id`, `FAILED id -
    /// msg`, ...), the format SWE-bench parses for most repositories.
    Pytest,
}

/// How one repository's tests run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RepoSpec {
    /// The command, run once per evaluation in the workspace root.
    /// `{tests}` becomes the selected test ids, shell-quoted and separated
    /// by spaces; `{report}` the path of the JUnit report.
    pub test_cmd: String,
    /// The report format.
    #[serde(default)]
    pub log: LogFormat,
    /// A Python environment (a venv directory; relative paths are relative
    /// to the file the spec came from), mounted read-only at the same path;
    /// its `bin` comes first on `PATH` for the tests and for the agent's
    /// commands.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<PathBuf>,
    /// Extra environment variables for every command (`PYTHONPATH`, ...).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env_vars: BTreeMap<String, String>,
    /// Paths (files or directories, relative to the repository root)
    /// restored from the base commit before the tests run, so edits to the
    /// tests themselves cannot change the reward.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub restore: Vec<String>,
    /// When set, only these paths (the package source) carry the agent's
    /// changes into evaluation: the rest of the tree is the base's, so
    /// files beside the tests (a `pytest.py` or `conftest.py` at the root)
    /// cannot change the run. `restore` applies after.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub keep: Vec<String>,
    /// Only `passed` succeeds: a skipped or xfail test is a failure (for
    /// tasks whose selected tests all pass on the fixed tree, so the
    /// policy cannot pass by skipping). Off by default, as SWE-bench grades.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub strict: bool,
}

impl RepoSpec {
    /// Checks the spec and makes `env` absolute against `base_dir` (the
    /// directory of the file it came from); `what` names it in errors.
    pub fn resolve(mut self, base_dir: &Path, what: &str) -> Result<RepoSpec> {
        let bad = |msg: String| EnvError::Sandbox(format!("{what}: {msg}"));
        if !self.test_cmd.contains("{tests}") {
            return Err(bad("`test_cmd` must contain `{tests}`".into()));
        }
        if self.log == LogFormat::Junit && !self.test_cmd.contains("{report}") {
            return Err(bad(
                "`test_cmd` must write its JUnit report to `{report}` (or set `log = \"pytest\"`)"
                    .into(),
            ));
        }
        for (key, list) in [("restore", &self.restore), ("keep", &self.keep)] {
            for r in list {
                if !is_relative_inside(r) {
                    return Err(bad(format!(
                        "`{key}` entry `{r}` must be a relative path inside the repository"
                    )));
                }
            }
        }
        if let Some(env) = &self.env {
            let env = if env.is_absolute() {
                env.clone()
            } else {
                base_dir.join(env)
            };
            if !env.join("bin").is_dir() {
                return Err(bad(format!(
                    "environment {} has no `bin` directory",
                    env.display()
                )));
            }
            self.env = Some(std::fs::canonicalize(&env).map_err(|e| EnvError::io(&env, e))?);
        }
        Ok(self)
    }

    /// The environment variables commands get: `PATH` with the env's `bin`
    /// first and `VIRTUAL_ENV` when there is an env, then `env_vars`.
    pub fn command_env(&self) -> Vec<(String, String)> {
        let mut v = Vec::new();
        if let Some(env) = &self.env {
            v.push((
                "PATH".to_string(),
                format!("{}/bin:/usr/local/bin:/usr/bin:/bin", env.display()),
            ));
            v.push(("VIRTUAL_ENV".to_string(), env.display().to_string()));
        }
        v.extend(self.env_vars.iter().map(|(k, s)| (k.clone(), s.clone())));
        v
    }

    /// The command for `tests` writing its report to `report`.
    pub fn command(&self, tests: &[String], report: &str) -> String {
        let ids: Vec<String> = tests.iter().map(|t| super::task::shell_quote(t)).collect();
        self.test_cmd
            .replace("{tests}", &ids.join(" "))
            .replace("{report}", &super::task::shell_quote(report))
    }
}

/// Whether `p` is a non-empty relative path without `..`.
pub fn is_relative_inside(p: &str) -> bool {
    let path = Path::new(p);
    !p.is_empty()
        && path
            .components()
            .all(|c| matches!(c, Component::Normal(_) | Component::CurDir))
        && path.components().any(|c| matches!(c, Component::Normal(_)))
}

/// One test's outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TestStatus {
    /// Passed (an unexpected pass of an `xfail` test included).
    Passed,
    /// Expected failure (`xfail`): counts as a success.
    XFail,
    /// Skipped: counts neither way.
    Skipped,
    /// The test failed.
    Failed,
    /// Error in setup, teardown or collection.
    Error,
}

impl TestStatus {
    fn is_success(self) -> bool {
        matches!(self, TestStatus::Passed | TestStatus::XFail)
    }
}

/// Outcomes of one run, by test id, with failure text where the report has
/// it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TestReport {
    /// Status by id (pytest node id for the pytest log; `classname::name`
    /// keys for JUnit, see [`junit_key`]).
    pub status: HashMap<String, TestStatus>,
    /// The failure or error text of failed tests.
    pub text: HashMap<String, String>,
}

impl TestReport {
    fn record(&mut self, key: String, st: TestStatus, text: Option<String>) {
        // A test reported twice (a teardown error after a pass) keeps the
        // worse outcome.
        let e = self.status.entry(key.clone()).or_insert(st);
        if st > *e {
            *e = st;
        }
        if let Some(t) = text.filter(|t| !t.trim().is_empty()) {
            self.text.entry(key).or_insert(t);
        }
    }

    /// The status of pytest node id `id` (`None`: absent from the report).
    pub fn get(&self, id: &str, log: LogFormat) -> Option<TestStatus> {
        match log {
            LogFormat::Pytest => self.status.get(id).copied(),
            LogFormat::Junit => self.status.get(&junit_key(id)).copied(),
        }
    }

    /// The failure text of `id`, if any.
    pub fn failure_text(&self, id: &str, log: LogFormat) -> Option<&str> {
        let k = match log {
            LogFormat::Pytest => id.to_string(),
            LogFormat::Junit => junit_key(id),
        };
        self.text.get(&k).map(String::as_str)
    }
}

/// The key JUnit reports carry for pytest node id `id`:
/// `path/to/test_x.py::Cls::test_y[p]` -> `path.to.test_x.Cls::test_y[p]`
/// (pytest's `classname` is the module path with dots plus the classes;
/// `name` is the function with its parameters).
pub fn junit_key(id: &str) -> String {
    // Parameters may hold `::` or `/`: split only the part before `[`.
    let (head, params) = match id.find('[') {
        Some(i) => id.split_at(i),
        None => (id, ""),
    };
    let parts: Vec<&str> = head.split("::").collect();
    if parts.len() < 2 {
        return id.to_string();
    }
    let module = parts[0].strip_suffix(".py").unwrap_or(parts[0]);
    let mut class = module.replace('/', ".");
    for c in &parts[1..parts.len() - 1] {
        class.push('.');
        class.push_str(c);
    }
    format!("{class}::{}{params}", parts[parts.len() - 1])
}

/// Parses a JUnit XML report into statuses keyed `classname::name`.
pub fn parse_junit(xml: &str) -> Result<TestReport> {
    let doc = roxmltree::Document::parse(xml)
        .map_err(|e| EnvError::Sandbox(format!("the JUnit report is not valid XML: {e}")))?;
    let mut rep = TestReport::default();
    for tc in doc.descendants().filter(|n| n.has_tag_name("testcase")) {
        let key = format!(
            "{}::{}",
            tc.attribute("classname").unwrap_or(""),
            tc.attribute("name").unwrap_or("")
        );
        let mut st = TestStatus::Passed;
        let mut text = None;
        for ch in tc.children().filter(roxmltree::Node::is_element) {
            let (s, t) = match ch.tag_name().name() {
                "failure" => (TestStatus::Failed, true),
                "error" => (TestStatus::Error, true),
                "skipped" if ch.attribute("type") == Some("pytest.xfail") => {
                    (TestStatus::XFail, false)
                }
                "skipped" => (TestStatus::Skipped, false),
                _ => continue,
            };
            if s > st {
                st = s;
            }
            if t && text.is_none() {
                let body = ch.text().unwrap_or("").trim();
                let msg = ch.attribute("message").unwrap_or("").trim();
                text = Some(if body.is_empty() { msg } else { body }.to_string());
            }
        }
        rep.record(key, st, text);
    }
    Ok(rep)
}

/// Parses pytest's `-rA` short summary: lines `PASSED id`, `FAILED id - msg`,
/// `ERROR id - msg`, `XFAIL id - reason`, `XPASS id`, `SKIPPED id`.
pub fn parse_pytest_log(log: &str) -> TestReport {
    let mut rep = TestReport::default();
    for line in log.lines() {
        let mut it = line.split_whitespace();
        let st = match it.next() {
            Some("PASSED" | "XPASS") => TestStatus::Passed,
            Some("XFAIL") => TestStatus::XFail,
            Some("SKIPPED") => TestStatus::Skipped,
            Some("FAILED") => TestStatus::Failed,
            Some("ERROR") => TestStatus::Error,
            _ => continue,
        };
        // `SKIPPED [1] file:line: reason` names no test.
        let Some(id) = it.next().filter(|id| !id.starts_with('[')) else {
            continue;
        };
        let msg = line.split_once(" - ").map(|(_, m)| m.to_string());
        rep.record(id.to_string(), st, msg);
    }
    rep
}

/// FAIL_TO_PASS / PASS_TO_PASS graded against a report.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Grade {
    /// Selected tests that succeeded.
    pub passed: Vec<String>,
    /// Selected tests that failed, errored or are missing, with the end of
    /// their failure text.
    pub failed: Vec<(String, String)>,
    /// Selected tests that were skipped (counted neither way).
    pub skipped: Vec<String>,
}

impl Grade {
    /// Grades `tests` (the instance's FAIL_TO_PASS then PASS_TO_PASS);
    /// `strict`: only `passed` succeeds (see [`RepoSpec::strict`]).
    pub fn of<'a>(
        tests: impl IntoIterator<Item = &'a String>,
        rep: &TestReport,
        log: LogFormat,
        strict: bool,
    ) -> Grade {
        let mut g = Grade::default();
        for t in tests {
            match rep.get(t, log) {
                Some(TestStatus::Passed) => g.passed.push(t.clone()),
                Some(s) if s.is_success() && !strict => g.passed.push(t.clone()),
                Some(TestStatus::Skipped) if !strict => g.skipped.push(t.clone()),
                Some(s) => {
                    let text = rep.failure_text(t, log).unwrap_or(match s {
                        TestStatus::Error => "error",
                        TestStatus::Skipped => "skipped (a failure under a strict spec)",
                        TestStatus::XFail => "xfail (a failure under a strict spec)",
                        _ => "failed",
                    });
                    g.failed.push((t.clone(), last_lines(text, 5)));
                }
                None => g
                    .failed
                    .push((t.clone(), "not in the test report (not run)".into())),
            }
        }
        g
    }

    /// SWE-bench's "resolved": no failure among at least one selected test.
    pub fn resolved(&self) -> bool {
        self.failed.is_empty() && (self.passed.len() + self.skipped.len()) > 0
    }
}

/// The last `n` lines of `s`.
pub fn last_lines(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn junit_keys_follow_pytest_classnames() {
        assert_eq!(junit_key("tests/test_a.py::test_x"), "tests.test_a::test_x");
        assert_eq!(
            junit_key("tests/sub/test_a.py::TestC::Inner::test_y[1-a/b::c]"),
            "tests.sub.test_a.TestC.Inner::test_y[1-a/b::c]"
        );
        assert_eq!(junit_key("test_calc.py"), "test_calc.py");
    }

    /// A report as pytest 9 writes it (xunit2): a pass, a failure, an error
    /// in setup, a skip, an xfail, and a test reported twice (pass, then a
    /// teardown error).
    const JUNIT: &str = r#"<?xml version="1.0" encoding="utf-8"?>
<testsuites name="pytest tests"><testsuite name="pytest" errors="1" failures="1" skipped="2" tests="6">
<testcase classname="tests.test_a" name="test_ok" time="0.001" />
<testcase classname="tests.test_a.TestC" name="test_bad[1-2]" time="0.001"><failure message="assert 3 == 4">def test_bad():
&gt;       assert f(1) == 4
E       assert 3 == 4</failure></testcase>
<testcase classname="tests.test_a" name="test_setup" time="0.0"><error message="failed on setup with &quot;KeyError&quot;">KeyError: 'x'</error></testcase>
<testcase classname="tests.test_a" name="test_skip" time="0.0"><skipped type="pytest.skip" message="no numpy">skip</skipped></testcase>
<testcase classname="tests.test_a" name="test_xf" time="0.0"><skipped type="pytest.xfail" message="known" /></testcase>
<testcase classname="tests.test_a" name="test_td" time="0.0" />
<testcase classname="tests.test_a" name="test_td" time="0.0"><error message="failed on teardown">boom</error></testcase>
</testsuite></testsuites>"#;

    #[test]
    fn junit_statuses_and_grading() {
        let rep = parse_junit(JUNIT).unwrap();
        let j = LogFormat::Junit;
        let st = |id: &str| rep.get(id, j);
        assert_eq!(st("tests/test_a.py::test_ok"), Some(TestStatus::Passed));
        assert_eq!(
            st("tests/test_a.py::TestC::test_bad[1-2]"),
            Some(TestStatus::Failed)
        );
        assert_eq!(st("tests/test_a.py::test_setup"), Some(TestStatus::Error));
        assert_eq!(st("tests/test_a.py::test_skip"), Some(TestStatus::Skipped));
        assert_eq!(st("tests/test_a.py::test_xf"), Some(TestStatus::XFail));
        assert_eq!(st("tests/test_a.py::test_td"), Some(TestStatus::Error));
        assert_eq!(st("tests/test_a.py::test_missing"), None);
        assert!(rep
            .failure_text("tests/test_a.py::TestC::test_bad[1-2]", j)
            .unwrap()
            .contains("E       assert 3 == 4"));

        let ids = |v: &[&str]| v.iter().map(ToString::to_string).collect::<Vec<_>>();
        let good = ids(&[
            "tests/test_a.py::test_ok",
            "tests/test_a.py::test_xf",
            "tests/test_a.py::test_skip",
        ]);
        let g = Grade::of(&good, &rep, j, false);
        assert!(g.resolved(), "{g:?}");
        assert_eq!(g.skipped, ids(&["tests/test_a.py::test_skip"]));
        for bad in [
            "tests/test_a.py::TestC::test_bad[1-2]",
            "tests/test_a.py::test_setup",
            "tests/test_a.py::test_td",
            "tests/test_a.py::test_missing",
        ] {
            let mut t = good.clone();
            t.push(bad.to_string());
            let g = Grade::of(&t, &rep, j, false);
            assert!(!g.resolved(), "{bad}");
            assert_eq!(g.failed.len(), 1);
        }
        assert!(
            !Grade::of(&[], &rep, j, false).resolved(),
            "no tests: not resolved"
        );
        assert!(parse_junit("<testsuite><testcase").is_err());
    }

    #[test]
    fn pytest_log_statuses() {
        let log = "\
============ short test summary info ============
PASSED tests/test_a.py::test_ok
PASSED tests/test_a.py::test_p[a b]
FAILED tests/test_a.py::TestC::test_bad - assert 3 == 4
ERROR tests/test_a.py::test_setup - KeyError: 'x'
SKIPPED [1] tests/test_a.py:12: no numpy
XFAIL tests/test_a.py::test_xf - known
XPASS tests/test_a.py::test_xp
==== 1 failed, 2 passed in 0.1s ====
";
        let rep = parse_pytest_log(log);
        let p = LogFormat::Pytest;
        assert_eq!(
            rep.get("tests/test_a.py::test_ok", p),
            Some(TestStatus::Passed)
        );
        assert_eq!(
            rep.get("tests/test_a.py::TestC::test_bad", p),
            Some(TestStatus::Failed)
        );
        assert_eq!(
            rep.failure_text("tests/test_a.py::TestC::test_bad", p),
            Some("assert 3 == 4")
        );
        assert_eq!(
            rep.get("tests/test_a.py::test_setup", p),
            Some(TestStatus::Error)
        );
        assert_eq!(
            rep.get("tests/test_a.py::test_xf", p),
            Some(TestStatus::XFail)
        );
        assert_eq!(
            rep.get("tests/test_a.py::test_xp", p),
            Some(TestStatus::Passed)
        );
        // Ids with spaces are cut at the first space, as SWE-bench does.
        assert_eq!(
            rep.get("tests/test_a.py::test_p[a", p),
            Some(TestStatus::Passed)
        );
        assert_eq!(rep.status.len(), 6);
    }

    #[test]
    fn specs_are_checked_on_load() {
        let d = tempfile::tempdir().unwrap();
        let spec = |cmd: &str, restore: &[&str]| RepoSpec {
            test_cmd: cmd.into(),
            log: LogFormat::Junit,
            env: None,
            env_vars: BTreeMap::new(),
            restore: restore.iter().map(ToString::to_string).collect(),
            keep: Vec::new(),
            strict: false,
        };
        let ok = spec("pytest --junitxml={report} {tests}", &["tests"]);
        assert!(ok.clone().resolve(d.path(), "s").is_ok());
        for (bad, want) in [
            (spec("pytest {report}", &[]), "{tests}"),
            (spec("pytest {tests}", &[]), "{report}"),
            (
                spec("pytest --junitxml={report} {tests}", &["../x"]),
                "restore",
            ),
            (
                spec("pytest --junitxml={report} {tests}", &["/etc"]),
                "restore",
            ),
        ] {
            let e = bad.resolve(d.path(), "specs.json: repo `a/b`").unwrap_err();
            assert!(e.to_string().contains(want), "{e}");
            assert!(e.to_string().contains("repo `a/b`"), "{e}");
        }
        let mut with_env = ok.clone();
        with_env.env = Some("venv".into());
        let e = with_env.clone().resolve(d.path(), "s").unwrap_err();
        assert!(e.to_string().contains("venv"), "{e}");
        std::fs::create_dir_all(d.path().join("venv/bin")).unwrap();
        let r = with_env.resolve(d.path(), "s").unwrap();
        assert!(r.env.as_ref().unwrap().is_absolute());
        let env = r.command_env();
        assert!(env[0]
            .1
            .starts_with(&format!("{}/bin:", r.env.unwrap().display())));
        assert_eq!(
            ok.command(&["a.py::t[x y]".into(), "b.py::u".into()], "/w/r.xml"),
            "pytest --junitxml='/w/r.xml' 'a.py::t[x y]' 'b.py::u'"
        );
    }
}
