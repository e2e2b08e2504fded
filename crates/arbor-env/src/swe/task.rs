//! SWE-style tasks: a repository, an issue, hidden tests; tools to run
//! commands, view, create and edit files, list, search and submit; rewards
//! from the hidden tests (SWE-bench style) or file localization (LocBench
//! Acc@k). Run them as an [`Env`](crate::Env) with [`swe_env`] (the tool
//! harness adds tool-call parsing and context management).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tempfile::TempDir;

use super::repo::LazyBase;
use super::sandbox::{Sandbox, WORKDIR};
use super::shell::Shell;
use super::spec::{
    last_lines, parse_junit, parse_pytest_log, Grade, LogFormat, RepoSpec, REPORT_FILE,
};
use crate::data::{read_jsonl, Row};
use crate::error::{EnvError, Result};
use crate::harness::{truncate_middle, Harness, HarnessConfig, ToolReply, ToolTask};
use crate::toolcall::ToolCall;

/// Default test command; `{test}` is replaced by the shell-quoted test id.
pub const DEFAULT_TEST_CMD: &str = "python3 -m pytest -q -p no:cacheprovider {test}";

/// A SWE-bench-style instance.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SweInstance {
    /// Unique id.
    pub instance_id: String,
    /// Repository name (`owner/name`); its clone is looked up in the repos
    /// directory as `owner/name`, `owner__name` or the instance id.
    pub repo: String,
    /// Commit to check out (empty: the directory as it is).
    #[serde(default)]
    pub base_commit: String,
    /// The issue text.
    pub problem_statement: String,
    /// The gold patch (unified diff).
    #[serde(default)]
    pub patch: String,
    /// The hidden tests (unified diff applied at evaluation only).
    #[serde(default)]
    pub test_patch: String,
    /// Tests that must go from failing to passing.
    #[serde(rename = "FAIL_TO_PASS", default)]
    pub fail_to_pass: Vec<String>,
    /// Tests that must keep passing.
    #[serde(rename = "PASS_TO_PASS", default)]
    pub pass_to_pass: Vec<String>,
    /// Test command with `{test}` (Arbor extension; default
    /// [`DEFAULT_TEST_CMD`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub test_cmd: Option<String>,
    /// How the repository's tests run (Arbor extension): one command per
    /// evaluation with a parsed report. Taken from the instance's `spec`
    /// field, else from `specs.json` beside the instance file (a map from
    /// `repo` to spec); without one, each test id runs on its own with
    /// `test_cmd` and passes on exit code 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec: Option<RepoSpec>,
}

impl SweInstance {
    fn from_row(row: &Row) -> Result<Self> {
        Ok(SweInstance {
            instance_id: row.str_field("instance_id")?,
            repo: row.str_field("repo")?,
            base_commit: row.opt_str_field("base_commit")?.unwrap_or_default(),
            problem_statement: row.str_field("problem_statement")?,
            patch: row.opt_str_field("patch")?.unwrap_or_default(),
            test_patch: row.opt_str_field("test_patch")?.unwrap_or_default(),
            fail_to_pass: row.str_list_field("FAIL_TO_PASS")?,
            pass_to_pass: match row.fields.get("PASS_TO_PASS") {
                None => Vec::new(),
                Some(_) => row.str_list_field("PASS_TO_PASS")?,
            },
            test_cmd: row.opt_str_field("test_cmd")?,
            spec: match row.fields.get("spec") {
                None | Some(Value::Null) => None,
                Some(v) => {
                    let spec: RepoSpec = serde_json::from_value(v.clone())
                        .map_err(|e| row.field_error("spec", e.to_string()))?;
                    let dir = row.path.parent().unwrap_or(Path::new("."));
                    Some(spec.resolve(
                        dir,
                        &format!("{}:{}: key `spec`", row.path.display(), row.line),
                    )?)
                }
            },
        })
    }

    /// The files the gold patch touches, in order of appearance.
    pub fn gold_files(&self) -> Vec<String> {
        patch_files(&self.patch)
    }
}

/// The files a unified diff touches (`+++ b/...` or `diff --git` lines).
pub fn patch_files(patch: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for line in patch.lines() {
        let f = if let Some(rest) = line.strip_prefix("diff --git a/") {
            rest.split(" b/").next().map(str::to_string)
        } else {
            line.strip_prefix("+++ b/").map(|r| r.trim().to_string())
        };
        if let Some(f) = f {
            if !out.contains(&f) {
                out.push(f);
            }
        }
    }
    out
}

/// The file of per-repository specs read beside an instance file.
pub const SPECS_FILE: &str = "specs.json";

/// Reads SWE-bench-style instances (JSONL, `.gz` accepted). Instances
/// without their own `spec` take their repository's from `specs.json` in
/// the same directory, when there is one.
pub fn load_instances(path: &Path) -> Result<Vec<SweInstance>> {
    let mut list: Vec<SweInstance> = read_jsonl(path)?
        .iter()
        .map(SweInstance::from_row)
        .collect::<Result<_>>()?;
    let dir = path.parent().unwrap_or(Path::new("."));
    let specs = load_specs(&dir.join(SPECS_FILE))?;
    for inst in &mut list {
        if inst.spec.is_none() {
            inst.spec = specs.get(&inst.repo).cloned();
        }
    }
    Ok(list)
}

/// Reads a specs file (`{"owner/name": {"test_cmd": ..., ...}, ...}`);
/// empty when the file does not exist.
pub fn load_specs(path: &Path) -> Result<BTreeMap<String, RepoSpec>> {
    if !path.exists() {
        return Ok(BTreeMap::new());
    }
    let text = std::fs::read_to_string(path).map_err(|e| EnvError::io(path, e))?;
    let raw: BTreeMap<String, Value> = serde_json::from_str(&text).map_err(|e| EnvError::Data {
        path: path.to_path_buf(),
        line: e.line(),
        msg: format!("not a JSON object of repository specs: {e}"),
    })?;
    let dir = path.parent().unwrap_or(Path::new("."));
    raw.into_iter()
        .map(|(repo, v)| {
            let what = format!("{}: repo `{repo}`", path.display());
            let spec: RepoSpec =
                serde_json::from_value(v).map_err(|e| EnvError::Sandbox(format!("{what}: {e}")))?;
            Ok((repo, spec.resolve(dir, &what)?))
        })
        .collect()
}

/// How an episode is rewarded.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SweReward {
    /// 1 iff every FAIL_TO_PASS and PASS_TO_PASS test passes after the
    /// hidden tests are applied.
    Tests,
    /// 1 iff every gold-patch file is among the first `k` submitted files
    /// (LocBench Acc@k).
    Localization { k: usize },
}

/// Configuration of SWE tasks.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SweConfig {
    /// The executor.
    pub sandbox: Sandbox,
    /// The reward.
    pub reward: SweReward,
    /// Longest file view / listing / search result shown, chars.
    pub max_view_chars: usize,
}

impl SweConfig {
    /// Test rewards with the given executor.
    pub fn tests(sandbox: Sandbox) -> Self {
        SweConfig {
            sandbox,
            reward: SweReward::Tests,
            max_view_chars: 20_000,
        }
    }
}

/// The outcome of running the hidden tests.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Evaluation {
    /// The reward (1 or 0).
    pub reward: f64,
    /// Tests that passed.
    pub passed: Vec<String>,
    /// Tests that failed, errored or did not run (with the last lines of
    /// their output).
    pub failed: Vec<(String, String)>,
    /// Tests that were skipped (counted neither way, as SWE-bench does).
    #[serde(default)]
    pub skipped: Vec<String>,
    /// Why evaluation could not run the tests (hidden tests did not apply,
    /// no report was written).
    pub error: Option<String>,
}

impl Evaluation {
    /// Reward 0 because the tests could not run (the workspace is in a
    /// state evaluation cannot use).
    pub fn error(msg: String) -> Evaluation {
        Evaluation {
            error: Some(msg),
            ..Evaluation::default()
        }
    }
}

/// The script file evaluation writes its test command to, in the
/// evaluation copy's root.
const RUN_SCRIPT: &str = ".arbor-run.sh";

/// Runs `tests` once with `spec` in `dir` and grades the report.
fn run_spec(spec: &RepoSpec, sb: &Sandbox, dir: &Path, tests: &[String]) -> Result<Evaluation> {
    // A report planted by the agent must not count.
    let report = dir.join(REPORT_FILE);
    let _ = std::fs::remove_file(&report);
    let report_arg = format!("{}/{REPORT_FILE}", sb.workdir(dir));
    let mut cmd = spec.command(tests, &report_arg);
    if spec.log == LogFormat::Pytest {
        // The summary is at the end of a long log: keep all of it in a file.
        cmd = format!("{{ {cmd}\n}} > {} 2>&1", shell_quote(&report_arg));
    }
    // The command goes in a script file: a long selection of test ids
    // would pass Linux's limit on one argument (128 KiB) as `bash -c`.
    let script = dir.join(RUN_SCRIPT);
    let _ = std::fs::remove_file(&script);
    std::fs::write(&script, format!("{cmd}\n")).map_err(|e| EnvError::io(&script, e))?;
    sb.own_entry(&script);
    let o = sb.run(dir, &format!("exec bash {RUN_SCRIPT}"))?;
    // Read only a regular file: the code under test could leave a link to
    // a host file in its place.
    let text = match std::fs::symlink_metadata(&report) {
        Ok(m) if m.file_type().is_file() => std::fs::read_to_string(&report),
        _ => Err(std::io::Error::other("no regular report file")),
    };
    let (rep, error) = match (spec.log, text) {
        (LogFormat::Junit, Ok(xml)) => match parse_junit(&xml) {
            Ok(r) => (r, None),
            Err(e) => (Default::default(), Some(e.to_string())),
        },
        (LogFormat::Pytest, Ok(log)) => (parse_pytest_log(&log), None),
        (_, Err(_)) => (
            Default::default(),
            Some(format!(
                "the test command wrote no report: {}",
                last_lines(&o.render(), 8)
            )),
        ),
    };
    let g = Grade::of(tests, &rep, spec.log, spec.strict);
    Ok(Evaluation {
        reward: if g.resolved() { 1.0 } else { 0.0 },
        passed: g.passed,
        failed: g.failed,
        skipped: g.skipped,
        error,
    })
}

/// Makes every parent of `rel` in `dst` a real directory: a link or a file
/// the agent left on the way is removed (the link itself, never what it
/// points to), so nothing below follows it out of `dst`.
fn real_parents(dst: &Path, rel: &str) -> Result<PathBuf> {
    let mut p = dst.to_path_buf();
    let comps: Vec<_> = Path::new(rel).components().collect();
    for c in comps.iter().take(comps.len().saturating_sub(1)) {
        p.push(c);
        match std::fs::symlink_metadata(&p) {
            Ok(m) if m.is_dir() => continue,
            Ok(_) => std::fs::remove_file(&p).map_err(|e| EnvError::io(&p, e))?,
            Err(_) => {}
        }
        std::fs::create_dir(&p).map_err(|e| EnvError::io(&p, e))?;
    }
    Ok(dst.join(rel))
}

/// Replaces `rel` in `dst` by its copy from `from_root` (removed when
/// `from_root` has none). Links on the way are not followed.
fn replace_path(from_root: &Path, dst: &Path, rel: &str, sb: &Sandbox) -> Result<()> {
    let to = real_parents(dst, rel)?;
    match std::fs::symlink_metadata(&to) {
        // `remove_dir_all` removes links inside without following them.
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(&to).map_err(|e| EnvError::io(&to, e))?,
        Ok(_) => std::fs::remove_file(&to).map_err(|e| EnvError::io(&to, e))?,
        Err(_) => {}
    }
    let from = from_root.join(rel);
    let Ok(md) = std::fs::symlink_metadata(&from) else {
        return Ok(());
    };
    if md.is_dir() {
        copy_tree(&from, &to)?;
    } else {
        run_host(
            Command::new("cp")
                .arg("-a")
                .arg("--reflink=auto")
                .arg(&from)
                .arg(&to),
            &format!("copying {rel}"),
        )?;
    }
    sb.own(&to)
}

/// Single-quotes `s` for bash.
pub fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

fn run_host(cmd: &mut Command, what: &str) -> Result<()> {
    let out = cmd
        .output()
        .map_err(|e| EnvError::Sandbox(format!("{what}: {e}")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(EnvError::Sandbox(format!(
            "{what}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

/// Copies the contents of directory `src` into the new directory `dst`
/// (copy-on-write where the filesystem supports it), preserving modes and
/// ownership.
pub fn copy_tree(src: &Path, dst: &Path) -> Result<()> {
    std::fs::create_dir_all(dst).map_err(|e| EnvError::io(dst, e))?;
    let mut from = src.as_os_str().to_owned();
    from.push("/.");
    run_host(
        Command::new("cp")
            .arg("-a")
            .arg("--reflink=auto")
            .arg(from)
            .arg(dst),
        &format!("copying {} to {}", src.display(), dst.display()),
    )
}

/// Canonical bytes of a directory tree (sorted paths, kinds, executable
/// bits, contents, symlink targets), skipping `.git`.
pub fn tree_bytes(root: &Path) -> Result<Vec<u8>> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<u8>) -> Result<()> {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| EnvError::io(dir, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .collect();
        entries.sort();
        for p in entries {
            let rel = p
                .strip_prefix(root)
                .unwrap_or(&p)
                .to_string_lossy()
                .into_owned();
            if rel == ".git" {
                continue;
            }
            let md = std::fs::symlink_metadata(&p).map_err(|e| EnvError::io(&p, e))?;
            out.extend_from_slice(rel.as_bytes());
            out.push(0);
            if md.file_type().is_symlink() {
                out.extend_from_slice(b"L");
                let t = std::fs::read_link(&p).map_err(|e| EnvError::io(&p, e))?;
                out.extend_from_slice(t.to_string_lossy().as_bytes());
            } else if md.is_dir() {
                out.extend_from_slice(b"D");
                walk(root, &p, out)?;
            } else {
                use std::os::unix::fs::PermissionsExt;
                let exec = md.permissions().mode() & 0o111 != 0;
                out.extend_from_slice(if exec { b"X" } else { b"F" });
                let c = std::fs::read(&p).map_err(|e| EnvError::io(&p, e))?;
                out.extend_from_slice(&(c.len() as u64).to_le_bytes());
                out.extend_from_slice(&c);
            }
            out.push(0);
        }
        Ok(())
    }
    let mut out = Vec::new();
    walk(root, root, &mut out)?;
    Ok(out)
}

/// A workspace directory (a copy of the base).
#[derive(Debug)]
struct Workspace {
    _dir: TempDir,
    path: PathBuf,
}

impl Workspace {
    fn copy_of(src: &Path) -> Result<Workspace> {
        let dir = tempfile::Builder::new()
            .prefix("arbor-swe-ws")
            .tempdir()
            .map_err(|e| EnvError::Sandbox(format!("temp dir: {e}")))?;
        let path = dir.path().join("ws");
        copy_tree(src, &path)?;
        Ok(Workspace { _dir: dir, path })
    }
}

/// One SWE task instance with its workspace.
#[derive(Debug)]
pub struct SweTask {
    inst: Arc<SweInstance>,
    cfg: Arc<SweConfig>,
    /// The sandbox with the repository's environment.
    sb: Arc<Sandbox>,
    base: Arc<LazyBase>,
    ws: Option<Workspace>,
    submitted: Option<Value>,
    evaluation: Option<Evaluation>,
    calls: Vec<String>,
    /// The episode's persistent shell (made at reset).
    shell: Option<Shell>,
    /// The editor tools' undo history: a file's earlier contents, last
    /// first out (`None`: the file did not exist).
    undo: BTreeMap<String, Vec<Option<Vec<u8>>>>,
}

impl SweTask {
    /// The task for `inst` with its repository at `source`: a directory, a
    /// clone or a bare mirror holding `base_commit`. The task's tree (the
    /// base commit alone, see [`super::repo`]) is made on the first reset.
    pub fn new(inst: SweInstance, source: &Path, cfg: SweConfig) -> Result<SweTask> {
        if !source.is_dir() {
            return Err(EnvError::task(
                &inst.instance_id,
                format!("repository directory {} does not exist", source.display()),
            ));
        }
        if !inst.base_commit.is_empty() {
            super::repo::check_commit(source, &inst.base_commit)
                .map_err(|e| EnvError::task(&inst.instance_id, e.to_string()))?;
        }
        let base = LazyBase::new(source, &inst.base_commit, &cfg.sandbox);
        let sb = match &inst.spec {
            Some(spec) => cfg
                .sandbox
                .with_env(spec.env.as_deref(), spec.command_env()),
            None => cfg.sandbox.clone(),
        };
        Ok(SweTask {
            inst: Arc::new(inst),
            cfg: Arc::new(cfg),
            sb: Arc::new(sb),
            base: Arc::new(base),
            ws: None,
            submitted: None,
            evaluation: None,
            calls: Vec::new(),
            shell: None,
            undo: BTreeMap::new(),
        })
    }

    /// Finds the clone of `inst.repo` under `repos`: `repos/owner/name`,
    /// `repos/owner__name`, or `repos/<instance_id>`.
    pub fn locate(inst: &SweInstance, repos: &Path) -> Result<PathBuf> {
        let tries = [
            repos.join(&inst.repo),
            repos.join(inst.repo.replace('/', "__")),
            repos.join(&inst.instance_id),
        ];
        tries.iter().find(|p| p.is_dir()).cloned().ok_or_else(|| {
            EnvError::task(
                &inst.instance_id,
                format!(
                    "no clone of `{}` found (tried {})",
                    inst.repo,
                    tries
                        .iter()
                        .map(|p| p.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            )
        })
    }

    /// The instance.
    pub fn instance(&self) -> &SweInstance {
        &self.inst
    }

    /// The current workspace directory on the host (`None` before reset).
    pub fn workspace(&self) -> Option<&Path> {
        self.ws.as_ref().map(|w| w.path.as_path())
    }

    /// The last evaluation (after `submit`).
    pub fn evaluation(&self) -> Option<&Evaluation> {
        self.evaluation.as_ref()
    }

    fn ws(&self) -> Result<&Path> {
        self.workspace()
            .ok_or_else(|| EnvError::protocol(&self.inst.instance_id, "no workspace before reset"))
    }

    /// Applies a unified diff to the workspace with `git apply` in the
    /// sandbox (used by oracle checks; the policy edits with tools).
    pub fn apply_patch(&self, patch: &str) -> Result<super::sandbox::RunOutput> {
        apply_in(&self.sb, self.ws()?, patch)
    }

    /// Runs the hidden tests on a copy of the workspace: the spec's
    /// `restore` paths come back from the base, the hidden test patch is
    /// applied, then the tests run (one command with a spec, one per test
    /// without).
    pub fn evaluate(&self) -> Result<Evaluation> {
        let ws = self.ws()?;
        let sb = &*self.sb;
        let copy = match &self.inst.spec {
            // Only the `keep` paths carry the agent's changes; everything
            // else is the base's.
            Some(spec) if !spec.keep.is_empty() => {
                let copy = Workspace::copy_of(self.base.path()?)?;
                for k in &spec.keep {
                    if let Err(e) = replace_path(ws, &copy.path, k, sb) {
                        return Ok(Evaluation::error(format!("cannot take `{k}`: {e}")));
                    }
                }
                copy
            }
            _ => Workspace::copy_of(ws)?,
        };
        if let Some(spec) = &self.inst.spec {
            for r in &spec.restore {
                if let Err(e) = replace_path(self.base.path()?, &copy.path, r, sb) {
                    return Ok(Evaluation::error(format!("cannot restore `{r}`: {e}")));
                }
            }
        }
        if !self.inst.test_patch.is_empty() {
            let o = apply_in(sb, &copy.path, &self.inst.test_patch)?;
            if !o.success() {
                return Ok(Evaluation::error(format!(
                    "the hidden tests do not apply: {}",
                    o.render()
                )));
            }
        }
        let tests: Vec<String> = self
            .inst
            .fail_to_pass
            .iter()
            .chain(&self.inst.pass_to_pass)
            .cloned()
            .collect();
        if tests.is_empty() {
            return Ok(Evaluation::error("the instance lists no tests".into()));
        }
        match &self.inst.spec {
            Some(spec) => run_spec(spec, sb, &copy.path, &tests),
            None => {
                let cmd = self.inst.test_cmd.as_deref().unwrap_or(DEFAULT_TEST_CMD);
                let mut e = Evaluation::default();
                for t in &tests {
                    let o = sb.run(&copy.path, &cmd.replace("{test}", &shell_quote(t)))?;
                    if o.success() {
                        e.passed.push(t.clone());
                    } else {
                        e.failed.push((t.clone(), last_lines(&o.render(), 5)));
                    }
                }
                e.reward = if e.failed.is_empty() { 1.0 } else { 0.0 };
                Ok(e)
            }
        }
    }

    /// A workspace path from a tool argument: relative to the workspace
    /// root (or absolute under [`WORKDIR`]); no `..`, no symlinks on the way.
    fn resolve(&self, p: &str) -> std::result::Result<PathBuf, String> {
        let ws = self.ws().map_err(|e| e.to_string())?;
        let rel = p
            .strip_prefix(WORKDIR)
            .map(|r| r.trim_start_matches('/'))
            .unwrap_or(p);
        let rel = Path::new(rel);
        let mut full = ws.to_path_buf();
        for c in rel.components() {
            match c {
                Component::Normal(n) => {
                    full.push(n);
                    if std::fs::symlink_metadata(&full).is_ok_and(|m| m.file_type().is_symlink()) {
                        return Err(format!("`{p}`: refusing to follow a symbolic link"));
                    }
                }
                Component::CurDir => {}
                _ => {
                    return Err(format!(
                        "`{p}`: paths must stay inside {WORKDIR} (relative, no `..`)"
                    ))
                }
            }
        }
        Ok(full)
    }

    fn rel(&self, p: &Path) -> String {
        let ws = self.workspace().unwrap_or(Path::new(""));
        p.strip_prefix(ws)
            .unwrap_or(p)
            .to_string_lossy()
            .into_owned()
    }

    fn view(&self, c: &ToolCall) -> std::result::Result<String, String> {
        let path = self.resolve(c.str_arg("path")?)?;
        let md = std::fs::metadata(&path).map_err(|e| format!("`{}`: {e}", self.rel(&path)))?;
        if md.is_dir() {
            return self.listing(&path, 2);
        }
        let bytes = std::fs::read(&path).map_err(|e| format!("`{}`: {e}", self.rel(&path)))?;
        let text = String::from_utf8_lossy(&bytes);
        let lines: Vec<&str> = text.lines().collect();
        let (start, end) = match (c.opt_int_arg("start_line")?, c.opt_int_arg("end_line")?) {
            (None, None) => (1, lines.len()),
            (s, e) => {
                let s = s.unwrap_or(1).max(1) as usize;
                let e = match e {
                    Some(e) if e < 0 => lines.len(),
                    Some(e) => (e as usize).min(lines.len()),
                    None => lines.len(),
                };
                if s > e.max(1) || s > lines.len().max(1) {
                    return Err(format!(
                        "line range {s}..{e} is outside the file ({} lines)",
                        lines.len()
                    ));
                }
                (s, e)
            }
        };
        let body: String = lines
            .iter()
            .enumerate()
            .skip(start - 1)
            .take(end + 1 - start)
            .map(|(i, l)| format!("{:>6}\t{l}\n", i + 1))
            .collect();
        Ok(truncate_middle(&body, self.cfg.max_view_chars))
    }

    fn listing(&self, dir: &Path, depth: usize) -> std::result::Result<String, String> {
        fn walk(dir: &Path, depth: usize, root: &Path, out: &mut Vec<String>) {
            let Ok(rd) = std::fs::read_dir(dir) else {
                return;
            };
            let mut es: Vec<PathBuf> = rd.filter_map(|e| e.ok().map(|e| e.path())).collect();
            es.sort();
            for p in es {
                let name = p
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                if name.starts_with('.') || out.len() >= 1000 {
                    continue;
                }
                let rel = p
                    .strip_prefix(root)
                    .unwrap_or(&p)
                    .to_string_lossy()
                    .into_owned();
                let is_dir = std::fs::symlink_metadata(&p).is_ok_and(|m| m.is_dir());
                out.push(if is_dir { format!("{rel}/") } else { rel });
                if is_dir && depth > 1 {
                    walk(&p, depth - 1, root, out);
                }
            }
        }
        let ws = self.ws().map_err(|e| e.to_string())?;
        let mut out = Vec::new();
        walk(dir, depth, ws, &mut out);
        Ok(truncate_middle(&out.join("\n"), self.cfg.max_view_chars))
    }

    /// Writes `bytes` to `path` through the editor, remembering what was
    /// there for `undo_edit`; the new file and directories go to the
    /// sandbox user.
    fn edit_write(&mut self, path: &Path, bytes: &[u8]) -> std::result::Result<(), String> {
        let before = std::fs::read(path).ok();
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|e| e.to_string())?;
        }
        std::fs::write(path, bytes).map_err(|e| format!("`{}`: {e}", self.rel(path)))?;
        let ws = self.ws().map_err(|e| e.to_string())?.to_path_buf();
        let mut p = path.to_path_buf();
        while p != ws {
            self.sb.own_entry(&p);
            if !p.pop() {
                break;
            }
        }
        self.undo.entry(self.rel(path)).or_default().push(before);
        Ok(())
    }

    fn create(&mut self, c: &ToolCall) -> std::result::Result<String, String> {
        let path = self.resolve(c.str_arg("path")?)?;
        let text = c.str_arg("file_text")?;
        if path.is_dir() {
            return Err(format!("`{}` is a directory", self.rel(&path)));
        }
        let existed = path.exists();
        self.edit_write(&path, text.as_bytes())?;
        Ok(format!(
            "{} {}",
            if existed { "overwrote" } else { "created" },
            self.rel(&path)
        ))
    }

    fn str_replace(&mut self, c: &ToolCall) -> std::result::Result<String, String> {
        let path = self.resolve(c.str_arg("path")?)?;
        let old = c.str_arg("old_str")?;
        let new = c.opt_str_arg("new_str")?.unwrap_or("");
        if old.is_empty() {
            return Err("`old_str` must not be empty".into());
        }
        let text =
            std::fs::read_to_string(&path).map_err(|e| format!("`{}`: {e}", self.rel(&path)))?;
        match text.matches(old).count() {
            1 => {
                let at = text.find(old).unwrap_or(0);
                let updated = text.replacen(old, new, 1);
                self.edit_write(&path, updated.as_bytes())?;
                let line = text[..at].matches('\n').count() + 1;
                Ok(format!("edited {} at line {line}", self.rel(&path)))
            }
            0 => Err(format!("`old_str` does not occur in {}", self.rel(&path))),
            n => Err(format!(
                "`old_str` occurs {n} times in {}; include more context to make it unique",
                self.rel(&path)
            )),
        }
    }

    /// Inserts `new_str` after line `insert_line` (0: before the first).
    fn insert(&mut self, c: &ToolCall) -> std::result::Result<String, String> {
        let path = self.resolve(c.str_arg("path")?)?;
        let after = c
            .opt_int_arg("insert_line")?
            .ok_or("`insert` needs `insert_line` (0 inserts before the first line)")?;
        let new = c.str_arg("new_str")?;
        let text =
            std::fs::read_to_string(&path).map_err(|e| format!("`{}`: {e}", self.rel(&path)))?;
        let mut lines: Vec<&str> = text.split_inclusive('\n').collect();
        if after < 0 || after as usize > lines.len() {
            return Err(format!(
                "`insert_line` {after} is outside the file (0..={} lines)",
                lines.len()
            ));
        }
        let mut block = new.to_string();
        if !block.ends_with('\n') {
            block.push('\n');
        }
        let fixed_last: String;
        if after as usize == lines.len() && !text.is_empty() && !text.ends_with('\n') {
            // Appending after a last line without its newline.
            fixed_last = format!("{}\n", lines.pop().unwrap_or(""));
            lines.push(&fixed_last);
        }
        let n_new = block.lines().count();
        lines.insert(after as usize, &block);
        let updated: String = lines.concat();
        self.edit_write(&path, updated.as_bytes())?;
        Ok(format!(
            "inserted {n_new} line{} into {} after line {after}",
            if n_new == 1 { "" } else { "s" },
            self.rel(&path)
        ))
    }

    /// Reverts the last editor change to a file.
    fn undo_edit(&mut self, c: &ToolCall) -> std::result::Result<String, String> {
        let path = self.resolve(c.str_arg("path")?)?;
        let rel = self.rel(&path);
        let Some(before) = self.undo.get_mut(&rel).and_then(Vec::pop) else {
            return Err(format!("no edit of {rel} to undo"));
        };
        match before {
            Some(bytes) => {
                std::fs::write(&path, bytes).map_err(|e| format!("`{rel}`: {e}"))?;
                self.sb.own_entry(&path);
                Ok(format!("undid the last edit of {rel}"))
            }
            None => {
                std::fs::remove_file(&path).map_err(|e| format!("`{rel}`: {e}"))?;
                Ok(format!("undid the creation of {rel} (removed)"))
            }
        }
    }

    fn search(&self, c: &ToolCall) -> std::result::Result<String, String> {
        let pat = c.str_arg("pattern")?;
        let re = regex::Regex::new(pat)
            .or_else(|_| regex::Regex::new(&regex::escape(pat)))
            .map_err(|e| e.to_string())?;
        let root = match c.opt_str_arg("path")? {
            Some(p) => self.resolve(p)?,
            None => self.ws().map_err(|e| e.to_string())?.to_path_buf(),
        };
        let mut hits = Vec::new();
        let mut stack = vec![root];
        while let Some(p) = stack.pop() {
            let Ok(md) = std::fs::symlink_metadata(&p) else {
                continue;
            };
            if md.is_dir() {
                if p.file_name().is_some_and(|n| n == ".git") {
                    continue;
                }
                if let Ok(rd) = std::fs::read_dir(&p) {
                    let mut es: Vec<PathBuf> =
                        rd.filter_map(|e| e.ok().map(|e| e.path())).collect();
                    es.sort();
                    stack.extend(es.into_iter().rev());
                }
            } else if md.is_file() && md.len() < 2 << 20 {
                let Ok(text) = std::fs::read_to_string(&p) else {
                    continue;
                };
                for (i, l) in text.lines().enumerate() {
                    if re.is_match(l) {
                        hits.push(format!("{}:{}:{}", self.rel(&p), i + 1, l));
                    }
                }
            }
            if hits.len() >= 200 {
                break;
            }
        }
        Ok(if hits.is_empty() {
            "no matches".into()
        } else {
            truncate_middle(&hits.join("\n"), self.cfg.max_view_chars)
        })
    }

    fn submit(&mut self, c: &ToolCall) -> Result<ToolReply> {
        match self.cfg.reward {
            SweReward::Tests => {
                let e = self.evaluate()?;
                let msg = format!(
                    "submitted: {} tests passed, {} failed{}",
                    e.passed.len(),
                    e.failed.len(),
                    e.error
                        .as_deref()
                        .map(|x| format!(" ({x})"))
                        .unwrap_or_default()
                );
                let r = e.reward;
                self.submitted = Some(json!({}));
                self.evaluation = Some(e);
                Ok(ToolReply::finish(msg, r))
            }
            SweReward::Localization { k } => {
                let files: Vec<String> = match c.arguments.get("files") {
                    Some(Value::Array(a)) => a
                        .iter()
                        .filter_map(Value::as_str)
                        .map(|s| {
                            s.trim_start_matches("/workspace/")
                                .trim_start_matches("./")
                                .to_string()
                        })
                        .collect(),
                    _ => {
                        return Ok(ToolReply::error(
                            "`submit` needs `files`: a ranked list of file paths",
                        ))
                    }
                };
                let gold: BTreeSet<String> = self.inst.gold_files().into_iter().collect();
                let top: BTreeSet<String> = files.iter().take(k).cloned().collect();
                let hit = !gold.is_empty() && gold.is_subset(&top);
                self.submitted = Some(json!({ "files": files }));
                Ok(ToolReply::finish(
                    format!("submitted {} files", files.len()),
                    if hit { 1.0 } else { 0.0 },
                ))
            }
        }
    }

    fn changed_files(&self) -> Vec<String> {
        let (Some(ws), Some(base)) = (self.workspace(), self.base.made()) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        let mut stack = vec![PathBuf::new()];
        while let Some(rel) = stack.pop() {
            let (a, b) = (ws.join(&rel), base.join(&rel));
            if rel.as_os_str() == ".git" {
                continue;
            }
            let md = std::fs::symlink_metadata(&a);
            if md.as_ref().is_ok_and(|m| m.file_type().is_symlink()) {
                // Never follow links the sandbox may have planted.
                if std::fs::read_link(&a).ok() != std::fs::read_link(&b).ok() {
                    out.push(rel.display().to_string());
                }
            } else if md.is_ok_and(|m| m.is_dir()) {
                if let Ok(rd) = std::fs::read_dir(&a) {
                    for e in rd.flatten() {
                        stack.push(rel.join(e.file_name()));
                    }
                }
                if let Ok(rd) = std::fs::read_dir(&b) {
                    for e in rd.flatten() {
                        if !a.join(e.file_name()).exists() {
                            out.push(format!("-{}", rel.join(e.file_name()).display()));
                        }
                    }
                }
            } else if std::fs::read(&a).ok() != std::fs::read(&b).ok() {
                out.push(rel.display().to_string());
            }
        }
        out.sort();
        out
    }
}

fn apply_in(sb: &Sandbox, dir: &Path, patch: &str) -> Result<super::sandbox::RunOutput> {
    let name = ".arbor.patch";
    let pf = dir.join(name);
    std::fs::write(&pf, patch).map_err(|e| EnvError::io(&pf, e))?;
    sb.own_entry(&pf);
    let o = sb.run(
        dir,
        &format!("git apply --whitespace=nowarn {name}; s=$?; rm -f {name}; exit $s"),
    )?;
    let _ = std::fs::remove_file(&pf);
    Ok(o)
}

fn tool(name: &str, desc: &str, props: Value, required: &[&str]) -> Value {
    json!({"type": "function", "function": {"name": name, "description": desc,
        "parameters": {"type": "object", "properties": props, "required": required}}})
}

impl ToolTask for SweTask {
    fn id(&self) -> &str {
        &self.inst.instance_id
    }

    fn prompt(&self) -> String {
        let what = match self.cfg.reward {
            SweReward::Tests if self.inst.test_patch.is_empty() => {
                "Resolve the issue below: edit the code so the issue is fixed. \
                The tests are run when you call `submit`."
            }
            SweReward::Tests => {
                "Resolve the issue below: edit the code so the issue is fixed. \
                Hidden tests are run when you call `submit`."
            }
            SweReward::Localization { .. } => {
                "Find the files that must change to resolve the \
                issue below, then call `submit` with `files`, ranked from most to least likely."
            }
        };
        format!(
            "You are working in the repository at {WORKDIR} ({}). {what} Use the tools to \
             inspect files, run commands and edit.\n\n<issue>\n{}\n</issue>",
            self.inst.repo,
            self.inst.problem_statement.trim()
        )
    }

    fn tools(&self) -> Vec<Value> {
        let submit = match self.cfg.reward {
            SweReward::Tests => tool(
                "submit",
                "Submit your changes for evaluation (ends the episode).",
                json!({}),
                &[],
            ),
            SweReward::Localization { .. } => tool(
                "submit",
                "Submit the ranked list of files to change (ends the episode).",
                json!({"files": {"type": "array", "items": {"type": "string"}}}),
                &["files"],
            ),
        };
        vec![
            tool(
                "bash",
                "Run a bash command in the repository (sandboxed, no network). The working \
                 directory, variables and functions carry over between calls; processes do not.",
                json!({"command": {"type": "string"}}),
                &["command"],
            ),
            tool(
                "view",
                "Show a file with line numbers (optionally a line range), or list a directory.",
                json!({"path": {"type": "string"}, "start_line": {"type": "integer"}, "end_line": {"type": "integer"}}),
                &["path"],
            ),
            tool(
                "create",
                "Create or overwrite a file.",
                json!({"path": {"type": "string"}, "file_text": {"type": "string"}}),
                &["path", "file_text"],
            ),
            tool(
                "str_replace",
                "Replace the single occurrence of old_str in a file by new_str.",
                json!({"path": {"type": "string"}, "old_str": {"type": "string"}, "new_str": {"type": "string"}}),
                &["path", "old_str"],
            ),
            tool(
                "insert",
                "Insert new_str after line insert_line of a file (0: before the first line).",
                json!({"path": {"type": "string"}, "insert_line": {"type": "integer"}, "new_str": {"type": "string"}}),
                &["path", "insert_line", "new_str"],
            ),
            tool(
                "undo_edit",
                "Revert the last create, str_replace or insert on a file.",
                json!({"path": {"type": "string"}}),
                &["path"],
            ),
            tool(
                "list",
                "List files under a directory (two levels).",
                json!({"path": {"type": "string"}}),
                &[],
            ),
            tool(
                "search",
                "Search file contents for a regular expression; prints path:line:text.",
                json!({"pattern": {"type": "string"}, "path": {"type": "string"}}),
                &["pattern"],
            ),
            submit,
        ]
    }

    fn reset(&mut self) -> Result<()> {
        self.ws = None;
        self.ws = Some(Workspace::copy_of(self.base.path()?)?);
        self.shell = Some(Shell::new(&self.sb)?);
        self.submitted = None;
        self.evaluation = None;
        self.calls.clear();
        self.undo.clear();
        Ok(())
    }

    fn call(&mut self, c: &ToolCall) -> Result<ToolReply> {
        self.calls.push(c.name.clone());
        let r = match c.name.as_str() {
            "bash" => {
                let cmd = match c.str_arg("command") {
                    Ok(s) => s.to_string(),
                    Err(e) => return Ok(ToolReply::error(e)),
                };
                let ws = self.ws()?;
                let o = match &self.shell {
                    Some(sh) => sh.run(&self.sb, ws, &cmd)?,
                    None => self.sb.run(ws, &cmd)?,
                };
                return Ok(if o.success() {
                    ToolReply::ok(o.render())
                } else {
                    ToolReply::error(o.render())
                });
            }
            "view" => self.view(c),
            "create" => self.create(c),
            "str_replace" => self.str_replace(c),
            "insert" => self.insert(c),
            "undo_edit" => self.undo_edit(c),
            "list" => match c.opt_str_arg("path") {
                Ok(p) => self
                    .resolve(p.unwrap_or("."))
                    .and_then(|d| self.listing(&d, 2)),
                Err(e) => Err(e),
            },
            "search" => self.search(c),
            "submit" => return self.submit(c),
            other => Err(format!("unknown tool `{other}`")),
        };
        Ok(match r {
            Ok(s) => ToolReply::ok(s),
            Err(e) => ToolReply::error(e),
        })
    }

    fn fork(&self) -> Option<Box<dyn ToolTask>> {
        let ws = match &self.ws {
            Some(w) => Some(Workspace::copy_of(&w.path).ok()?),
            None => None,
        };
        let shell = match &self.shell {
            Some(s) => Some(s.fork(&self.sb).ok()?),
            None => None,
        };
        Some(Box::new(SweTask {
            inst: Arc::clone(&self.inst),
            cfg: Arc::clone(&self.cfg),
            sb: Arc::clone(&self.sb),
            base: Arc::clone(&self.base),
            ws,
            submitted: self.submitted.clone(),
            evaluation: self.evaluation.clone(),
            calls: self.calls.clone(),
            shell,
            undo: self.undo.clone(),
        }))
    }

    fn fresh(&self) -> Result<Box<dyn ToolTask>> {
        Ok(Box::new(SweTask {
            inst: Arc::clone(&self.inst),
            cfg: Arc::clone(&self.cfg),
            sb: Arc::clone(&self.sb),
            base: Arc::clone(&self.base),
            ws: None,
            submitted: None,
            evaluation: None,
            calls: Vec::new(),
            shell: None,
            undo: BTreeMap::new(),
        }))
    }

    fn summary(&self) -> String {
        let changed = self.changed_files();
        let eval = match &self.evaluation {
            Some(e) => format!(
                "; hidden tests: {} passed, {} failed{}",
                e.passed.len(),
                e.failed.len(),
                e.failed
                    .iter()
                    .map(|(t, out)| format!("\n  FAILED {t}: {out}"))
                    .collect::<String>()
            ),
            None => String::new(),
        };
        format!(
            "{}: {} files changed [{}]; tools used [{}]; {}{eval}",
            self.inst.instance_id,
            changed.len(),
            changed.join(", "),
            self.calls.join(", "),
            match &self.submitted {
                Some(v) => format!("submitted {v}"),
                None => "not submitted".into(),
            }
        )
    }

    fn state_bytes(&self) -> Result<Vec<u8>> {
        let mut b = match self.workspace() {
            Some(ws) => tree_bytes(ws)?,
            None => Vec::new(),
        };
        b.push(0);
        b.extend(
            serde_json::to_vec(&(&self.submitted, &self.calls, &self.undo)).unwrap_or_default(),
        );
        b.push(0);
        b.extend(self.shell.as_ref().map(Shell::state).unwrap_or_default());
        Ok(b)
    }
}

/// The outcome of an instance's oracle check.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Oracle {
    /// Reward of the buggy tree (should be 0).
    pub buggy: f64,
    /// Reward after the gold patch (should be 1).
    pub gold: f64,
    /// Seconds of the buggy tree's evaluation.
    pub buggy_s: f64,
    /// Seconds of the gold tree's evaluation.
    pub gold_s: f64,
    /// What went wrong on the gold tree when it did not score 1.
    pub gold_failures: Vec<(String, String)>,
}

impl Oracle {
    /// The buggy tree scores 0 and the gold patch 1.
    pub fn passed(&self) -> bool {
        self.buggy == 0.0 && self.gold == 1.0
    }
}

/// The oracle check through the episode executor: the reward of the buggy
/// tree, then of the tree with the gold patch applied.
pub fn oracle(inst: &SweInstance, repo: &Path, sandbox: &Sandbox) -> Result<Oracle> {
    let mut t = SweTask::new(inst.clone(), repo, SweConfig::tests(sandbox.clone()))?;
    t.reset()?;
    let t0 = std::time::Instant::now();
    let buggy = t.evaluate()?.reward;
    let buggy_s = t0.elapsed().as_secs_f64();
    let applied = t.apply_patch(&inst.patch)?;
    if !applied.success() {
        return Err(EnvError::task(
            &inst.instance_id,
            format!("the gold patch does not apply: {}", applied.render()),
        ));
    }
    let t1 = std::time::Instant::now();
    let e = t.evaluate()?;
    Ok(Oracle {
        buggy,
        gold: e.reward,
        buggy_s,
        gold_s: t1.elapsed().as_secs_f64(),
        gold_failures: e.failed,
    })
}

/// A SWE task as an [`Env`](crate::Env) through the tool harness.
pub fn swe_env(task: SweTask, harness: HarnessConfig) -> Harness {
    Harness::new(Box::new(task), harness)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::env::{Action, Episode};
    use crate::swe::sandbox::tests::{logic_sandboxes, sandbox_or_skip};

    const BUGGY: &str = "def add(a, b):\n    return a - b\n";
    const FIXED: &str = "def add(a, b):\n    return a + b\n";

    fn instance() -> SweInstance {
        SweInstance {
            instance_id: "toy-1".into(),
            repo: "toy/calc".into(),
            base_commit: String::new(),
            problem_statement: "add(2, 3) returns -1 instead of 5.".into(),
            patch: "diff --git a/calc.py b/calc.py\n--- a/calc.py\n+++ b/calc.py\n@@ -1,2 +1,2 @@\n def add(a, b):\n-    return a - b\n+    return a + b\n".into(),
            test_patch: "diff --git a/test_calc.py b/test_calc.py\nnew file mode 100644\n--- /dev/null\n+++ b/test_calc.py\n@@ -0,0 +1,2 @@\n+from calc import add\n+assert add(2, 3) == 5\n".into(),
            fail_to_pass: vec!["test_calc.py".into()],
            pass_to_pass: vec![],
            test_cmd: Some("python3 {test}".into()),
            spec: None,
        }
    }

    fn repo() -> TempDir {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("calc.py"), BUGGY).unwrap();
        std::fs::create_dir(d.path().join("docs")).unwrap();
        std::fs::write(d.path().join("docs/README"), "calc\n").unwrap();
        d
    }

    fn call(name: &str, args: Value) -> Action {
        Action::Text(ToolCall::new(name, args).render())
    }

    fn env(sb: Sandbox, reward: SweReward, src: &Path) -> Harness {
        let mut cfg = SweConfig::tests(sb);
        cfg.reward = reward;
        swe_env(
            SweTask::new(instance(), src, cfg).unwrap(),
            HarnessConfig::default(),
        )
    }

    #[test]
    fn oracle_buggy_zero_fixed_one() {
        for sb in logic_sandboxes("swe oracle") {
            let src = repo();
            let mut t = SweTask::new(instance(), src.path(), SweConfig::tests(sb)).unwrap();
            t.reset().unwrap();
            let e = t.evaluate().unwrap();
            assert_eq!(e.reward, 0.0, "{e:?}");
            assert!(
                !t.workspace().unwrap().join("test_calc.py").exists(),
                "tests stay hidden"
            );
            assert!(t
                .apply_patch(&t.instance().patch.clone())
                .unwrap()
                .success());
            assert_eq!(t.evaluate().unwrap().reward, 1.0);
            assert_eq!(t.instance().gold_files(), vec!["calc.py"]);
        }
    }

    #[test]
    fn tools_and_path_safety() {
        let Some(sb) = sandbox_or_skip("swe tools") else {
            return;
        };
        let src = repo();
        let mut ep = Episode::new(Box::new(env(sb, SweReward::Tests, src.path())));
        let o = ep.reset().unwrap();
        assert!(
            o.text.contains("add(2, 3) returns -1") && o.text.contains("\"name\": \"str_replace\"")
        );
        let obs = |ep: &mut Episode, a: Action| {
            let out = ep.step(a).unwrap();
            (out.observation.text, out.error)
        };
        let (t, e) = obs(
            &mut ep,
            call(
                "view",
                json!({"path": "calc.py", "start_line": 2, "end_line": 2}),
            ),
        );
        assert!(e.is_none() && t.contains("     2\t    return a - b"), "{t}");
        let (t, _) = obs(&mut ep, call("view", json!({"path": "/workspace"})));
        assert!(t.contains("calc.py\ndocs/\ndocs/README"), "{t}");
        let (t, _) = obs(&mut ep, call("search", json!({"pattern": "return a [-+]"})));
        assert!(t.contains("calc.py:2:    return a - b"), "{t}");
        for bad in ["../x", "/etc/passwd", "docs/../../x"] {
            let (_, e) = obs(&mut ep, call("view", json!({"path": bad})));
            assert!(e.unwrap().contains("must stay inside"), "{bad}");
        }
        let (_, e) = obs(
            &mut ep,
            call("bash", json!({"command": "ln -s /etc/passwd leak"})),
        );
        assert!(e.is_none());
        let (_, e) = obs(&mut ep, call("view", json!({"path": "leak"})));
        assert!(e.unwrap().contains("symbolic link"));
        let (_, e) = obs(
            &mut ep,
            call("create", json!({"path": "leak", "file_text": "x"})),
        );
        assert!(e.unwrap().contains("symbolic link"));
        let (_, e) = obs(
            &mut ep,
            call(
                "str_replace",
                json!({"path": "calc.py", "old_str": "a", "new_str": "b"}),
            ),
        );
        assert!(e.unwrap().contains("occurs"));
        let (_, e) = obs(
            &mut ep,
            call("str_replace", json!({"path": "calc.py", "old_str": "nope"})),
        );
        assert!(e.unwrap().contains("does not occur"));
        let (t, e) = obs(
            &mut ep,
            call(
                "str_replace",
                json!({"path": "calc.py", "old_str": "a - b", "new_str": "a + b"}),
            ),
        );
        assert!(e.is_none() && t.contains("edited calc.py at line 2"), "{t}");
        let (t, e) = obs(
            &mut ep,
            call(
                "create",
                json!({"path": "new/mod.py", "file_text": "X = 1\n"}),
            ),
        );
        assert!(e.is_none() && t.contains("created new/mod.py"));
        let (t, e) = obs(
            &mut ep,
            call(
                "bash",
                json!({"command": "python3 -c 'import calc, new.mod; print(calc.add(2, 3))'"}),
            ),
        );
        assert!(e.is_none() && t.contains("5\n[exit code 0]"), "{t}");
        let (t, e) = obs(&mut ep, call("bash", json!({"command": "exit 4"})));
        assert!(e.is_some() && t.contains("[exit code 4]"));
        let out = ep.step(call("submit", json!({}))).unwrap();
        assert!(out.done);
        assert_eq!(out.reward, 1.0);
        let s = ep.env().summary();
        assert!(
            s.contains("3 files changed [calc.py, leak, new/mod.py]") && s.contains("1 passed"),
            "{s}"
        );
    }

    #[test]
    fn replay_is_byte_equal_and_forks_are_independent() {
        let Some(sb) = sandbox_or_skip("swe replay") else {
            return;
        };
        let src = repo();
        let mut ep = Episode::new(Box::new(env(sb, SweReward::Tests, src.path())));
        ep.reset().unwrap();
        for a in [
            call(
                "create",
                json!({"path": "notes.txt", "file_text": "plan\n"}),
            ),
            call(
                "bash",
                json!({"command": "echo step >> notes.txt; sed -i 's/a - b/a + b/' calc.py; chmod +x notes.txt; cat notes.txt"}),
            ),
            call("view", json!({"path": "calc.py"})),
        ] {
            ep.step(a).unwrap();
        }
        let mut fork = ep.fork().unwrap();
        let re = ep.replay_prefix(ep.actions().len()).unwrap();
        assert_eq!(re.turns(), ep.turns(), "history is byte-equal");
        let a = ep.env().state_bytes().unwrap();
        assert_eq!(
            re.env().state_bytes().unwrap(),
            a,
            "workspace is byte-equal"
        );
        fork.step(call("bash", json!({"command": "rm -rf /workspace/*"})))
            .unwrap();
        assert_eq!(
            ep.env().state_bytes().unwrap(),
            a,
            "the fork did not touch its sibling"
        );
        let out = fork.step(call("submit", json!({}))).unwrap();
        assert_eq!(out.reward, 0.0);
        let out = ep.step(call("submit", json!({}))).unwrap();
        assert_eq!(out.reward, 1.0);
        // The next episode starts from the pristine repository.
        ep.reset().unwrap();
        let out = ep.step(call("submit", json!({}))).unwrap();
        assert_eq!(out.reward, 0.0);
    }

    #[test]
    fn localization_reward() {
        let Some(sb) = sandbox_or_skip("swe localization") else {
            return;
        };
        let src = repo();
        let mut ep = Episode::new(Box::new(env(
            sb.clone(),
            SweReward::Localization { k: 1 },
            src.path(),
        )));
        ep.reset().unwrap();
        let out = ep
            .step(call("submit", json!({"files": ["docs/README", "calc.py"]})))
            .unwrap();
        assert_eq!(out.reward, 0.0);
        let mut ep = Episode::new(Box::new(env(
            sb,
            SweReward::Localization { k: 5 },
            src.path(),
        )));
        ep.reset().unwrap();
        let out = ep
            .step(call(
                "submit",
                json!({"files": ["docs/README", "/workspace/calc.py"]}),
            ))
            .unwrap();
        assert_eq!(out.reward, 1.0);
    }

    #[test]
    fn git_repo_at_base_commit_and_instance_files() {
        for sb in logic_sandboxes("swe git") {
            git_repo_case(sb);
        }
    }

    fn git_repo_case(sb: Sandbox) {
        let src = repo();
        let git = |args: &[&str]| {
            let o = Command::new("git")
                .arg("-C")
                .arg(src.path())
                .args(["-c", "user.name=t", "-c", "user.email=t@t"])
                .args(args)
                .output()
                .unwrap();
            assert!(o.status.success(), "{o:?}");
            String::from_utf8(o.stdout).unwrap()
        };
        git(&["init", "-q"]);
        git(&["add", "."]);
        git(&["commit", "-q", "-m", "one"]);
        let first = git(&["rev-parse", "HEAD"]).trim().to_string();
        std::fs::write(src.path().join("calc.py"), FIXED).unwrap();
        git(&["commit", "-q", "-am", "two"]);
        let mut inst = instance();
        inst.base_commit = first;
        let mut t = SweTask::new(inst.clone(), src.path(), SweConfig::tests(sb)).unwrap();
        t.reset().unwrap();
        assert_eq!(
            std::fs::read_to_string(t.workspace().unwrap().join("calc.py")).unwrap(),
            BUGGY
        );
        let o = t
            .call(&ToolCall::new(
                "bash",
                json!({"command": "git log --oneline | wc -l"}),
            ))
            .unwrap();
        assert!(o.content.starts_with("1\n"), "{o:?}");
        // Instance JSONL with list fields as JSON strings (SWE-bench style).
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("inst.jsonl");
        let mut row = serde_json::to_value(&inst).unwrap();
        row["FAIL_TO_PASS"] = json!("[\"test_calc.py\"]");
        std::fs::write(&p, format!("{row}\n{{\"instance_id\": \"x\"}}\n")).unwrap();
        let e = load_instances(&p).unwrap_err().to_string();
        assert!(e.contains("inst.jsonl:2: field `repo`: missing"), "{e}");
        std::fs::write(&p, format!("{row}\n")).unwrap();
        let v = load_instances(&p).unwrap();
        assert_eq!(v[0].fail_to_pass, vec!["test_calc.py"]);
        let repos = tempfile::tempdir().unwrap();
        std::fs::create_dir(repos.path().join("toy__calc")).unwrap();
        assert!(SweTask::locate(&v[0], repos.path())
            .unwrap()
            .ends_with("toy__calc"));
        assert!(SweTask::locate(&v[0], dir.path()).is_err());
    }

    /// A test runner in plain Python (no pytest in the sandbox here) that
    /// runs node ids `file.py::func` and writes a pytest-style JUnit report
    /// (`junit`) or prints pytest's `-rA` lines (`log`).
    const RUNNER: &str = r#"import sys, importlib.util, traceback
from xml.sax.saxutils import quoteattr
mode, report, ids = sys.argv[1], sys.argv[2], sys.argv[3:]
cases = []
for tid in ids:
    path, func = tid.split("::")
    spec = importlib.util.spec_from_file_location("m", path)
    m = importlib.util.module_from_spec(spec)
    sys.path.insert(0, ".")
    try:
        spec.loader.exec_module(m)
        getattr(m, func)()
        cases.append((tid, path, func, None))
    except Exception:
        cases.append((tid, path, func, traceback.format_exc()))
if mode == "junit":
    with open(report, "w") as f:
        f.write("<testsuites><testsuite>")
        for tid, path, func, err in cases:
            cls = path[:-3].replace("/", ".")
            f.write("<testcase classname=%s name=%s>" % (quoteattr(cls), quoteattr(func)))
            if err:
                f.write("<failure message=%s/>" % quoteattr(err))
            f.write("</testcase>")
        f.write("</testsuite></testsuites>")
else:
    for tid, path, func, err in cases:
        print(("FAILED %s - %s" % (tid, err.splitlines()[-1])) if err else "PASSED " + tid)
"#;

    fn spec_instance(log: LogFormat) -> SweInstance {
        let mode = match log {
            LogFormat::Junit => "junit",
            LogFormat::Pytest => "log",
        };
        SweInstance {
            instance_id: "toy-spec".into(),
            repo: "toy/calc".into(),
            fail_to_pass: vec!["tests/test_calc.py::test_add".into()],
            pass_to_pass: vec![
                "tests/test_calc.py::test_zero".into(),
                "tests/test_other.py::test_ok".into(),
            ],
            test_patch: String::new(),
            spec: Some(RepoSpec {
                test_cmd: format!("python3 -B .runner.py {mode} {{report}} {{tests}}"),
                log,
                env: None,
                env_vars: [("ARBOR_TOY".to_string(), "1".to_string())].into(),
                restore: vec!["tests".into(), ".runner.py".into()],
                keep: Vec::new(),
                strict: false,
            }),
            ..instance()
        }
    }

    fn spec_repo() -> TempDir {
        let d = repo();
        std::fs::create_dir(d.path().join("tests")).unwrap();
        std::fs::write(
            d.path().join("tests/test_calc.py"),
            "import os\nfrom calc import add\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\
             def test_zero():\n    assert add(0, 0) == 0 and os.environ['ARBOR_TOY'] == '1'\n",
        )
        .unwrap();
        std::fs::write(
            d.path().join("tests/test_other.py"),
            "def test_ok():\n    pass\n",
        )
        .unwrap();
        std::fs::write(d.path().join(".runner.py"), RUNNER).unwrap();
        d
    }

    #[test]
    fn one_run_with_a_report_grades_every_test() {
        for log in [LogFormat::Junit, LogFormat::Pytest] {
            for sb in logic_sandboxes("swe spec evaluation") {
                let src = spec_repo();
                let mut t =
                    SweTask::new(spec_instance(log), src.path(), SweConfig::tests(sb)).unwrap();
                t.reset().unwrap();
                let e = t.evaluate().unwrap();
                assert_eq!(e.reward, 0.0, "{e:?}");
                assert_eq!(e.failed.len(), 1, "{e:?}");
                assert_eq!(e.failed[0].0, "tests/test_calc.py::test_add");
                assert!(e.failed[0].1.contains("AssertionError"), "{e:?}");
                assert_eq!(e.passed.len(), 2, "{e:?}");

                // Editing the tests, or planting a report, changes nothing:
                // the tests come back from the base and the report is the
                // run's own.
                let ws = t.workspace().unwrap().to_path_buf();
                std::fs::write(
                    ws.join("tests/test_calc.py"),
                    "def test_add(): pass\ndef test_zero(): pass\n",
                )
                .unwrap();
                std::fs::remove_file(ws.join("tests/test_other.py")).unwrap();
                std::fs::write(ws.join(REPORT_FILE), "<testsuite/>").unwrap();
                let e = t.evaluate().unwrap();
                assert_eq!(e.reward, 0.0, "{e:?}");
                assert_eq!(e.passed.len(), 2, "{e:?}");

                std::fs::write(ws.join("calc.py"), FIXED).unwrap();
                let e = t.evaluate().unwrap();
                assert_eq!(e.reward, 1.0, "{e:?}");
                assert_eq!(e.passed.len(), 3);

                // A runner that writes no report: every test failed, and
                // the error says why.
                std::fs::write(ws.join(".runner.py"), "import sys; sys.exit(3)\n").unwrap();
                let mut inst = spec_instance(log);
                inst.spec.as_mut().unwrap().restore.clear();
                let mut t2 = SweTask::new(inst, &ws, t.cfg.as_ref().clone()).unwrap();
                t2.reset().unwrap();
                let e = t2.evaluate().unwrap();
                assert_eq!(e.reward, 0.0);
                assert_eq!(e.failed.len(), 3, "{e:?}");
                if log == LogFormat::Junit {
                    assert!(e.error.unwrap().contains("wrote no report"));
                }

                // A runner that leaves a link to a host file in the
                // report's place: the link is not followed.
                let host = tempfile::tempdir().unwrap();
                let fake = host.path().join("all-pass.xml");
                std::fs::write(
                    &fake,
                    "<testsuite><testcase classname=\"tests.test_calc\" name=\"test_add\"/>\
                     <testcase classname=\"tests.test_calc\" name=\"test_zero\"/>\
                     <testcase classname=\"tests.test_other\" name=\"test_ok\"/></testsuite>",
                )
                .unwrap();
                std::fs::write(
                    t2.workspace().unwrap().join(".runner.py"),
                    format!(
                        "import os, sys; os.symlink({:?}, sys.argv[2])\n",
                        fake.display().to_string()
                    ),
                )
                .unwrap();
                let e = t2.evaluate().unwrap();
                assert_eq!(e.reward, 0.0, "{e:?}");
            }
        }
    }

    #[test]
    fn only_the_kept_paths_reach_evaluation() {
        for sb in logic_sandboxes("swe spec keep") {
            let src = spec_repo();
            let mut inst = spec_instance(LogFormat::Junit);
            let spec = inst.spec.as_mut().unwrap();
            spec.restore.clear();
            spec.keep = vec!["calc.py".into()];
            let mut t = SweTask::new(inst, src.path(), SweConfig::tests(sb)).unwrap();
            t.reset().unwrap();
            let ws = t.workspace().unwrap().to_path_buf();
            // A runner rewritten to report every test passed stays outside
            // the run; a link planted where a kept path's parent would be
            // is not followed.
            std::fs::write(
                ws.join(".runner.py"),
                "import sys\nopen(sys.argv[2], 'w').write('<testsuite/>')\n",
            )
            .unwrap();
            let e = t.evaluate().unwrap();
            assert_eq!(e.reward, 0.0, "{e:?}");
            assert_eq!(e.failed.len(), 1, "{e:?}");
            std::fs::write(ws.join("calc.py"), FIXED).unwrap();
            assert_eq!(t.evaluate().unwrap().reward, 1.0);
        }
    }

    #[test]
    fn a_selection_longer_than_one_argument_runs() {
        let src = spec_repo();
        // A runner that reports every id it is given as passed.
        std::fs::write(
            src.path().join(".runner.py"),
            "import sys\nfrom xml.sax.saxutils import quoteattr\n\
             out = open(sys.argv[2], 'w')\nout.write('<testsuite>')\n\
             for t in sys.argv[3:]:\n    p, f = t.split('::')\n    \
             out.write('<testcase classname=%s name=%s/>' % (quoteattr(p[:-3].replace('/', '.')), quoteattr(f)))\n\
             out.write('</testsuite>')\n",
        )
        .unwrap();
        let mut inst = spec_instance(LogFormat::Junit);
        inst.pass_to_pass = (0..3000)
            .map(|i| {
                format!("tests/test_many.py::test_a_long_name_to_fill_the_command_line_{i:05}")
            })
            .collect();
        let sb = Sandbox::unsandboxed(Default::default());
        let mut t = SweTask::new(inst, src.path(), SweConfig::tests(sb)).unwrap();
        t.reset().unwrap();
        let e = t.evaluate().unwrap();
        assert_eq!(e.reward, 1.0, "{:?}", e.error);
        assert_eq!(e.passed.len(), 3001);
    }

    #[test]
    fn restoring_never_follows_a_planted_link() {
        let src = spec_repo();
        let mut inst = spec_instance(LogFormat::Junit);
        inst.spec.as_mut().unwrap().restore = vec!["docs/README".into()];
        let sb = Sandbox::unsandboxed(Default::default());
        let mut t = SweTask::new(inst, src.path(), SweConfig::tests(sb)).unwrap();
        t.reset().unwrap();
        let ws = t.workspace().unwrap().to_path_buf();
        let host = tempfile::tempdir().unwrap();
        std::fs::write(host.path().join("README"), "host file\n").unwrap();
        std::fs::remove_dir_all(ws.join("docs")).unwrap();
        std::os::unix::fs::symlink(host.path(), ws.join("docs")).unwrap();
        t.evaluate().unwrap();
        assert_eq!(
            std::fs::read_to_string(host.path().join("README")).unwrap(),
            "host file\n"
        );
        assert_eq!(std::fs::read_dir(host.path()).unwrap().count(), 1);
    }

    #[test]
    fn specs_json_beside_the_instances_applies_by_repo() {
        let dir = tempfile::tempdir().unwrap();
        let mut inst = spec_instance(LogFormat::Junit);
        let spec = inst.spec.take().unwrap();
        let p = dir.path().join("instances.jsonl");
        std::fs::write(&p, format!("{}\n", serde_json::to_string(&inst).unwrap())).unwrap();
        assert_eq!(load_instances(&p).unwrap()[0].spec, None);
        std::fs::write(
            dir.path().join(SPECS_FILE),
            serde_json::to_string(&json!({"toy/calc": spec})).unwrap(),
        )
        .unwrap();
        assert_eq!(load_instances(&p).unwrap()[0].spec.as_ref(), Some(&spec));
        std::fs::write(
            dir.path().join(SPECS_FILE),
            r#"{"toy/calc": {"test_cmd": "pytest {tests}", "restore": ["../up"]}}"#,
        )
        .unwrap();
        let e = load_instances(&p).unwrap_err().to_string();
        assert!(e.contains("specs.json") && e.contains("toy/calc"), "{e}");
        std::fs::write(dir.path().join(SPECS_FILE), "[1,").unwrap();
        let e = load_instances(&p).unwrap_err().to_string();
        assert!(e.contains("specs.json:1"), "{e}");
    }

    #[test]
    fn insert_undo_and_a_shell_that_remembers() {
        for sb in logic_sandboxes("swe editor and shell") {
            let src = repo();
            let mut t = SweTask::new(instance(), src.path(), SweConfig::tests(sb)).unwrap();
            t.reset().unwrap();
            let ws = t.workspace().unwrap().to_path_buf();
            let read = |f: &str| std::fs::read_to_string(ws.join(f)).unwrap();
            let mut call = |name: &str, args: Value| t.call(&ToolCall::new(name, args)).unwrap();
            let r = call(
                "insert",
                json!({"path": "calc.py", "insert_line": 0, "new_str": "# calc"}),
            );
            assert!(!r.is_error, "{r:?}");
            let r = call(
                "insert",
                json!({"path": "calc.py", "insert_line": 3, "new_str": "\ndef sub(a, b):\n    return a - b"}),
            );
            assert!(r.content.contains("inserted 3 lines"), "{r:?}");
            assert_eq!(
                read("calc.py"),
                format!("# calc\n{BUGGY}\ndef sub(a, b):\n    return a - b\n")
            );
            let r = call(
                "insert",
                json!({"path": "calc.py", "insert_line": 99, "new_str": "x"}),
            );
            assert!(
                r.is_error && r.content.contains("outside the file"),
                "{r:?}"
            );
            let r = call(
                "create",
                json!({"path": "new/n.py", "file_text": "n = 1\n"}),
            );
            assert!(!r.is_error);
            call(
                "str_replace",
                json!({"path": "new/n.py", "old_str": "1", "new_str": "2"}),
            );
            // Undo walks back one edit at a time, per file.
            call("undo_edit", json!({"path": "new/n.py"}));
            assert_eq!(read("new/n.py"), "n = 1\n");
            let r = call("undo_edit", json!({"path": "new/n.py"}));
            assert!(r.content.contains("removed"), "{r:?}");
            assert!(!ws.join("new/n.py").exists());
            let r = call("undo_edit", json!({"path": "new/n.py"}));
            assert!(r.is_error, "{r:?}");
            call("undo_edit", json!({"path": "calc.py"}));
            call("undo_edit", json!({"path": "calc.py"}));
            assert_eq!(read("calc.py"), BUGGY);
            // The shell keeps its directory and variables between calls.
            let r = call("bash", json!({"command": "cd docs && export K=v && N=3"}));
            assert!(!r.is_error, "{r:?}");
            let r = call("bash", json!({"command": "cat README; echo $K$N"}));
            assert!(r.content.starts_with("calc\nv3\n"), "{r:?}");
            // A fork has the same shell state, then its own.
            let mut f = t.fork().unwrap();
            let r = f
                .call(&ToolCall::new("bash", json!({"command": "N=4; echo $N$K"})))
                .unwrap();
            assert!(r.content.starts_with("4v"), "{r:?}");
            let r = t
                .call(&ToolCall::new("bash", json!({"command": "echo $N"})))
                .unwrap();
            assert!(r.content.starts_with("3\n"), "{r:?}");
            // A new episode starts at the root with a clean shell.
            t.reset().unwrap();
            let r = t
                .call(&ToolCall::new(
                    "bash",
                    json!({"command": "ls; echo \"[$N]\""}),
                ))
                .unwrap();
            assert!(
                r.content.contains("calc.py") && r.content.contains("[]"),
                "{r:?}"
            );
        }
    }
}
