//! The command executor: every command runs in a bubblewrap sandbox.
//!
//! - No network (`--unshare-all` includes the network namespace), its own
//!   PID namespace (everything it started dies with it), and no
//!   controlling terminal (`setsid`).
//! - Read-only system: the root is an empty tmpfs remounted read-only, with
//!   `/usr`, `/etc` and the library directories bound read-only (home
//!   directories and the project are not visible); only the task's
//!   workspace (at [`WORKDIR`]) and a per-command scratch `/tmp` are
//!   writable.
//! - Limits: CPU seconds, address space, processes, file size (bash
//!   `ulimit`), wall time and output size (enforced here: the sandbox is
//!   killed when either runs over).
//! - When the caller is root, the sandbox runs as `nobody` (uid 65534), so
//!   the process limit applies (the kernel exempts root from it).
//!
//! Without bubblewrap the executor refuses to run unless the caller opted
//! into [`Sandbox::unsandboxed`] (commands then run on the host with the same
//! limits, in the workspace directory).

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::error::{EnvError, Result};

/// Where the workspace appears inside the sandbox.
pub const WORKDIR: &str = "/workspace";

/// The uid/gid the sandbox runs as when the caller is root.
pub const NOBODY: u32 = 65534;

/// Resource limits of one command.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Limits {
    /// CPU seconds (`ulimit -t`).
    pub cpu_secs: u64,
    /// Wall-clock limit.
    pub wall_secs: f64,
    /// Address-space bytes (`ulimit -v`).
    pub memory_bytes: u64,
    /// Processes of the sandbox user (`ulimit -u`, on top of those it
    /// already runs).
    pub processes: u64,
    /// Largest file the command may write, bytes (`ulimit -f`).
    pub file_bytes: u64,
    /// Output kept per stream, bytes; the command is killed once its output
    /// exceeds 16 times this.
    pub output_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            cpu_secs: 30,
            wall_secs: 60.0,
            memory_bytes: 2 << 30,
            processes: 128,
            file_bytes: 64 << 20,
            output_bytes: 64 << 10,
        }
    }
}

/// How commands are executed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Isolation {
    /// bubblewrap at this path.
    Bubblewrap(PathBuf),
    /// On the host, limits only (explicit opt-in).
    Unsandboxed,
}

/// The executor.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Sandbox {
    /// Isolation mode.
    pub isolation: Isolation,
    /// Limits per command.
    pub limits: Limits,
    /// Extra host paths bound read-only at the same path (e.g. a Python
    /// environment outside `/usr`).
    pub ro_paths: Vec<PathBuf>,
    /// Environment variables set for every command, after the defaults
    /// (so `PATH` may be replaced).
    #[serde(default)]
    pub env: Vec<(String, String)>,
}

/// The result of one command.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunOutput {
    /// Exit status (`None` when killed by a signal).
    pub exit_code: Option<i32>,
    /// Killed at the wall-clock limit.
    pub timed_out: bool,
    /// Killed for flooding output.
    pub output_flood: bool,
    /// Stdout (lossy UTF-8, cut at the output limit).
    pub stdout: String,
    /// Stderr (lossy UTF-8, cut at the output limit).
    pub stderr: String,
    /// Output was cut.
    pub truncated: bool,
}

impl RunOutput {
    /// Exit code 0 and no limit hit.
    pub fn success(&self) -> bool {
        self.exit_code == Some(0) && !self.timed_out && !self.output_flood
    }

    /// The output as a tool observation: streams, then the status line.
    pub fn render(&self) -> String {
        let mut s = String::new();
        s.push_str(&self.stdout);
        if !self.stderr.is_empty() {
            if !s.is_empty() && !s.ends_with('\n') {
                s.push('\n');
            }
            s.push_str(&self.stderr);
        }
        if !s.is_empty() && !s.ends_with('\n') {
            s.push('\n');
        }
        if self.truncated {
            s.push_str("[output truncated]\n");
        }
        if self.timed_out {
            s.push_str("[killed: wall-clock limit]\n");
        }
        if self.output_flood {
            s.push_str("[killed: output limit]\n");
        }
        match self.exit_code {
            Some(c) => s.push_str(&format!("[exit code {c}]")),
            None => s.push_str("[killed by a signal]"),
        }
        s
    }
}

fn find_on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// The effective uid of this process (`0` for root), read from
/// `/proc/self/status` (no unsafe code).
pub fn effective_uid() -> Option<u32> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("Uid:"))?;
    line.split_whitespace().nth(2)?.parse().ok()
}

/// Processes currently owned by real uid `uid` (for the process limit).
fn processes_of(uid: u32) -> u64 {
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return 0;
    };
    rd.filter_map(std::result::Result::ok)
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .chars()
                .all(|c| c.is_ascii_digit())
        })
        .filter_map(|e| std::fs::read_to_string(e.path().join("status")).ok())
        .filter(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|u| u.parse::<u32>().ok())
                == Some(uid)
        })
        .count() as u64
}

/// Whether bubblewrap is installed and can run a command here (it may be
/// installed while user namespaces are blocked).
pub fn bubblewrap_works() -> bool {
    Sandbox::bubblewrap(Limits::default())
        .and_then(|s| s.probe("true"))
        .is_ok_and(|o| o.success())
}

/// Makes `path` (recursively) owned by the sandbox user when running as
/// root, so the sandbox can write it. A no-op otherwise. Symlinks are not
/// followed.
pub fn chown_for_sandbox(path: &Path) -> Result<()> {
    if effective_uid() != Some(0) {
        return Ok(());
    }
    fn walk(p: &Path) -> std::io::Result<()> {
        std::os::unix::fs::lchown(p, Some(NOBODY), Some(NOBODY))?;
        let md = std::fs::symlink_metadata(p)?;
        if md.is_dir() {
            for e in std::fs::read_dir(p)? {
                walk(&e?.path())?;
            }
        }
        Ok(())
    }
    walk(path).map_err(|e| EnvError::io(path, e))
}

impl Sandbox {
    /// The bubblewrap executor with `limits`; an error when `bwrap` is not
    /// installed (install bubblewrap, or opt into [`Sandbox::unsandboxed`]).
    pub fn bubblewrap(limits: Limits) -> Result<Sandbox> {
        let bwrap = find_on_path("bwrap").ok_or_else(|| {
            EnvError::Sandbox(
                "bubblewrap (`bwrap`) is not installed, so SWE tasks cannot be sandboxed; \
                 install it (apt-get install bubblewrap) or opt into unsandboxed execution \
                 explicitly (--unsandboxed)"
                    .into(),
            )
        })?;
        Ok(Sandbox {
            isolation: Isolation::Bubblewrap(bwrap),
            limits,
            ro_paths: Vec::new(),
            env: Vec::new(),
        })
    }

    /// Bubblewrap when installed; otherwise unsandboxed only if
    /// `allow_unsandboxed`, else the error of [`Sandbox::bubblewrap`].
    pub fn detect(limits: Limits, allow_unsandboxed: bool) -> Result<Sandbox> {
        match Sandbox::bubblewrap(limits.clone()) {
            Ok(s) => Ok(s),
            Err(_) if allow_unsandboxed => Ok(Sandbox::unsandboxed(limits)),
            Err(e) => Err(e),
        }
    }

    /// Commands run on the host (limits only). Only by explicit opt-in.
    pub fn unsandboxed(limits: Limits) -> Sandbox {
        Sandbox {
            isolation: Isolation::Unsandboxed,
            limits,
            ro_paths: Vec::new(),
            env: Vec::new(),
        }
    }

    /// This sandbox with a repository's environment: `ro` mounted
    /// read-only and `env` set for every command.
    pub fn with_env(&self, ro: Option<&Path>, env: Vec<(String, String)>) -> Sandbox {
        let mut s = self.clone();
        s.ro_paths.extend(ro.map(Path::to_path_buf));
        s.env.extend(env);
        s
    }

    /// Gives `path` (recursively, links not followed) to the user this
    /// sandbox runs commands as, so they can write it: the sandbox user
    /// when bubblewrap runs as root; a no-op otherwise (unsandboxed commands
    /// run as the caller, who owns the files already).
    pub fn own(&self, path: &Path) -> Result<()> {
        if self.is_sandboxed() {
            chown_for_sandbox(path)
        } else {
            Ok(())
        }
    }

    /// [`Sandbox::own`] for one entry, best effort (a file a tool just
    /// wrote and its new parent directories).
    pub fn own_entry(&self, path: &Path) {
        if self.is_sandboxed() && effective_uid() == Some(0) {
            let _ = std::os::unix::fs::lchown(path, Some(NOBODY), Some(NOBODY));
        }
    }

    /// True for bubblewrap isolation.
    pub fn is_sandboxed(&self) -> bool {
        matches!(self.isolation, Isolation::Bubblewrap(_))
    }

    /// The path commands see for the workspace root.
    pub fn workdir<'a>(&self, workspace: &'a Path) -> std::borrow::Cow<'a, str> {
        match self.isolation {
            Isolation::Bubblewrap(_) => WORKDIR.into(),
            Isolation::Unsandboxed => workspace.to_string_lossy(),
        }
    }

    fn limit_prefix(&self, extra_procs: u64) -> String {
        let l = &self.limits;
        format!(
            "ulimit -c 0 -t {} -v {} -u {} -f {} || exit 126; ",
            l.cpu_secs.max(1),
            (l.memory_bytes / 1024).max(1024),
            l.processes.max(1) + extra_procs,
            (l.file_bytes / 1024).max(1),
        )
    }

    fn bwrap_command(
        &self,
        bwrap: &Path,
        workspace: &Path,
        scratch: &Path,
        state: Option<&Path>,
    ) -> Command {
        let mut c = Command::new(bwrap);
        // Every namespace unshared; killed with its parent; setsid, so the
        // command cannot inject input into the caller's terminal.
        c.args(["--unshare-all", "--die-with-parent", "--new-session"]);
        for top in ["bin", "sbin", "lib", "lib32", "lib64", "libx32"] {
            let host = Path::new("/").join(top);
            match std::fs::read_link(&host) {
                Ok(target) => {
                    c.arg("--symlink").arg(target).arg(&host);
                }
                Err(_) if host.is_dir() => {
                    c.arg("--ro-bind").arg(&host).arg(&host);
                }
                Err(_) => {}
            }
        }
        for dir in ["/usr", "/etc", "/opt"] {
            if Path::new(dir).is_dir() {
                c.args(["--ro-bind", dir, dir]);
            }
        }
        c.args(["--proc", "/proc", "--dev", "/dev"]);
        c.arg("--bind").arg(scratch).arg("/tmp");
        // After /tmp, which would hide a path below it.
        for p in &self.ro_paths {
            c.arg("--ro-bind").arg(p).arg(p);
        }
        c.arg("--bind").arg(workspace).arg(WORKDIR);
        if let Some(st) = state {
            c.arg("--bind").arg(st).arg(super::shell::STATE_DIR);
        }
        c.args(["--chdir", WORKDIR, "--clearenv"]);
        for (k, v) in [
            ("PATH", "/usr/local/bin:/usr/bin:/bin"),
            ("HOME", "/tmp"),
            ("TMPDIR", "/tmp"),
            ("LANG", "C.UTF-8"),
            ("PYTHONDONTWRITEBYTECODE", "1"),
            ("PYTHONHASHSEED", "0"),
        ] {
            c.args(["--setenv", k, v]);
        }
        for (k, v) in &self.env {
            c.arg("--setenv").arg(k).arg(v);
        }
        c.args(["--remount-ro", "/"]);
        c
    }

    /// Runs `command` in a fresh empty workspace: whether this sandbox can
    /// run anything here (bubblewrap may be installed while user namespaces
    /// are blocked).
    pub fn probe(&self, command: &str) -> Result<RunOutput> {
        let dir = tempfile::tempdir().map_err(|e| EnvError::Sandbox(format!("probe dir: {e}")))?;
        self.own(dir.path())?;
        self.run(dir.path(), command)
    }

    /// Runs `command` with bash in `workspace` (mounted at [`WORKDIR`]).
    /// Limit hits are reported in the output, not as errors; `Err` means the
    /// sandbox itself could not start.
    pub fn run(&self, workspace: &Path, command: &str) -> Result<RunOutput> {
        self.run_inner(workspace, command, None)
    }

    /// [`Sandbox::run`] with the writable directory `state` mounted at
    /// [`super::shell::STATE_DIR`] (a persistent shell's state).
    pub fn run_with_state(
        &self,
        workspace: &Path,
        command: &str,
        state: &Path,
    ) -> Result<RunOutput> {
        self.run_inner(workspace, command, Some(state))
    }

    fn run_inner(
        &self,
        workspace: &Path,
        command: &str,
        state: Option<&Path>,
    ) -> Result<RunOutput> {
        let root = effective_uid() == Some(0);
        let scratch = tempfile::Builder::new()
            .prefix("arbor-sbx-tmp")
            .tempdir()
            .map_err(|e| EnvError::Sandbox(format!("scratch dir: {e}")))?;
        let mut cmd = match &self.isolation {
            Isolation::Bubblewrap(bwrap) => {
                if root {
                    chown_for_sandbox(scratch.path())?;
                }
                let mut c = self.bwrap_command(bwrap, workspace, scratch.path(), state);
                c.arg("--");
                c
            }
            Isolation::Unsandboxed => {
                let mut c = Command::new("env");
                c.current_dir(workspace);
                c.envs(self.env.iter().map(|(k, v)| (k, v)));
                c
            }
        };
        let uid = if root && self.is_sandboxed() {
            NOBODY
        } else {
            effective_uid().unwrap_or(0)
        };
        // The process limit counts every process of the uid: add those it
        // already runs (none for `nobody`, usually).
        let existing = if uid == 0 { 0 } else { processes_of(uid) };
        let script = format!("{}exec /bin/bash -c \"$1\"", self.limit_prefix(existing));
        cmd.args(["/bin/bash", "-c", &script, "arbor-sandbox", command]);
        if root && self.is_sandboxed() {
            cmd.uid(NOBODY).gid(NOBODY);
        }
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd
            .spawn()
            .map_err(|e| EnvError::Sandbox(format!("cannot start `{command}`: {e}")))?;
        let keep = self.limits.output_bytes;
        let flood_at = keep.saturating_mul(16).max(1 << 20);
        let total = Arc::new(AtomicUsize::new(0));
        let flood = Arc::new(AtomicBool::new(false));
        let reader = |stream: Option<Box<dyn Read + Send>>| {
            let total = Arc::clone(&total);
            let flood = Arc::clone(&flood);
            std::thread::spawn(move || {
                let mut kept = Vec::new();
                let mut cut = false;
                let Some(mut s) = stream else {
                    return (kept, cut);
                };
                let mut buf = [0u8; 8192];
                loop {
                    match s.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => {
                            let room = keep.saturating_sub(kept.len());
                            kept.extend_from_slice(&buf[..n.min(room)]);
                            cut |= n > room;
                            if total.fetch_add(n, Ordering::Relaxed) + n > flood_at {
                                flood.store(true, Ordering::Relaxed);
                            }
                        }
                    }
                }
                (kept, cut)
            })
        };
        let out_t = reader(
            child
                .stdout
                .take()
                .map(|s| Box::new(s) as Box<dyn Read + Send>),
        );
        let err_t = reader(
            child
                .stderr
                .take()
                .map(|s| Box::new(s) as Box<dyn Read + Send>),
        );
        let deadline = Instant::now() + Duration::from_secs_f64(self.limits.wall_secs.max(0.01));
        let mut timed_out = false;
        let mut output_flood = false;
        let status = loop {
            match child.try_wait() {
                Ok(Some(s)) => break Some(s),
                Ok(None) => {}
                Err(e) => return Err(EnvError::Sandbox(format!("waiting for `{command}`: {e}"))),
            }
            if flood.load(Ordering::Relaxed) {
                output_flood = true;
            } else if Instant::now() >= deadline {
                timed_out = true;
            }
            if timed_out || output_flood {
                // Killing bwrap kills the sandbox's PID namespace with it.
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let (so, c1) = out_t.join().unwrap_or_default();
        let (se, c2) = err_t.join().unwrap_or_default();
        Ok(RunOutput {
            exit_code: status.and_then(|s| s.code()),
            timed_out,
            output_flood,
            stdout: String::from_utf8_lossy(&so).into_owned(),
            stderr: String::from_utf8_lossy(&se).into_owned(),
            truncated: c1 || c2,
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Tight limits for the tests' commands.
    fn test_limits() -> Limits {
        Limits {
            cpu_secs: 2,
            wall_secs: 5.0,
            memory_bytes: 512 << 20,
            processes: 32,
            file_bytes: 8 << 20,
            output_bytes: 16 << 10,
        }
    }

    /// The sandboxes a test of task logic (not of isolation) runs on: the
    /// host, always (the test's own commands stay in its temporary
    /// workspace), then bubblewrap where it runs (see [`sandbox_or_skip`]).
    pub(crate) fn logic_sandboxes(what: &str) -> Vec<Sandbox> {
        let mut v = vec![Sandbox::unsandboxed(test_limits())];
        v.extend(sandbox_or_skip(what));
        v
    }

    /// The bubblewrap sandbox with tight limits, or `None` with a SKIP line
    /// (a panic under `CI=true`, which installs bubblewrap).
    pub(crate) fn sandbox_or_skip(what: &str) -> Option<Sandbox> {
        match Sandbox::bubblewrap(test_limits()) {
            Ok(s) => {
                // bwrap may be installed but unusable (no user namespaces);
                // the tests also need python3 inside the sandbox.
                match s.probe("python3 -c pass") {
                    Ok(o) if o.success() => Some(s),
                    other => {
                        crate::data::skip_or_fail(
                            what,
                            &format!("bubblewrap (with python3) cannot run here: {other:?}"),
                        );
                        None
                    }
                }
            }
            Err(e) => {
                crate::data::skip_or_fail(what, &e.to_string());
                None
            }
        }
    }

    fn report(what: &str, o: &RunOutput) {
        let r = o.render();
        let tail: Vec<&str> = r.lines().rev().take(2).collect();
        println!(
            "{what}: timed_out={} flood={} truncated={} | {}",
            o.timed_out,
            o.output_flood,
            o.truncated,
            tail.join(" | ")
        );
    }

    fn workspace() -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("keep.txt"), "keep\n").unwrap();
        chown_for_sandbox(d.path()).unwrap();
        d
    }

    #[test]
    fn runs_in_the_workspace_and_reports_status() {
        let Some(sb) = sandbox_or_skip("sandbox basics") else {
            return;
        };
        let ws = workspace();
        let o = sb
            .run(ws.path(), "pwd; cat keep.txt; echo err >&2; exit 3")
            .unwrap();
        assert_eq!(o.exit_code, Some(3));
        assert_eq!(o.stdout, "/workspace\nkeep\n");
        assert_eq!(o.stderr, "err\n");
        assert!(o.render().ends_with("[exit code 3]"));
        let o = sb.run(ws.path(), "echo hi > new.txt && ls /").unwrap();
        assert!(o.success(), "{o:?}");
        assert!(
            !o.stdout.contains("root") && !o.stdout.contains("work\n"),
            "{}",
            o.stdout
        );
        assert_eq!(
            std::fs::read_to_string(ws.path().join("new.txt")).unwrap(),
            "hi\n"
        );
    }

    #[test]
    fn hostile_rm_rf_and_writes_outside() {
        let Some(sb) = sandbox_or_skip("hostile writes") else {
            return;
        };
        let sentinel = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(sentinel.path(), "host").unwrap();
        let ws = workspace();
        // `rm -rf /` walks the read-only system (slowly) until the wall
        // limit; nothing outside the workspace can be deleted.
        let mut quick = sb.clone();
        quick.limits.wall_secs = 1.5;
        quick
            .run(
                ws.path(),
                "rm -rf --no-preserve-root / 2>/dev/null; rm -rf /workspace/* /tmp/*",
            )
            .unwrap();
        assert!(Path::new("/usr/bin/env").exists() && Path::new("/etc/passwd").exists());
        let cmd = format!(
            "rm -rf /workspace/*; echo pwned > {p}; echo x > /etc/arbor-pwned; \
             echo x > /usr/arbor-pwned; echo x > /arbor-pwned; ls /workspace | wc -l",
            p = sentinel.path().display()
        );
        let o = sb.run(ws.path(), &cmd).unwrap();
        assert_eq!(
            o.stdout.trim(),
            "0",
            "the workspace itself is writable: {o:?}"
        );
        assert!(o.stderr.contains("Read-only file system"), "{o:?}");
        assert_eq!(std::fs::read_to_string(sentinel.path()).unwrap(), "host");
        assert!(!Path::new("/etc/arbor-pwned").exists());
        assert!(!Path::new("/usr/arbor-pwned").exists());
        assert!(!Path::new("/arbor-pwned").exists());
        // The next command in a fresh workspace is fine.
        let ws2 = workspace();
        assert!(sb.run(ws2.path(), "cat keep.txt").unwrap().success());
    }

    #[test]
    fn hostile_fork_bomb_loop_network_output() {
        let Some(sb) = sandbox_or_skip("hostile processes") else {
            return;
        };
        let ws = workspace();
        // Fork bomb: the process limit stops it; the PID namespace dies with
        // the command.
        let o = sb
            .run(ws.path(), "b() { b | b & }; b; sleep 1; echo done")
            .unwrap();
        report("fork bomb", &o);
        assert!(
            o.stderr.contains("fork") || o.stderr.contains("Resource") || !o.success(),
            "{o:?}"
        );
        // Infinite loop: CPU limit (2 s) or wall limit (5 s) kills it.
        let o = sb.run(ws.path(), "while :; do :; done").unwrap();
        report("infinite loop", &o);
        assert!(!o.success());
        assert!(o.timed_out || o.exit_code != Some(0));
        // Sleeping forever (no CPU): the wall limit.
        let mut short = sb.clone();
        short.limits.wall_secs = 0.5;
        let o = short.run(ws.path(), "sleep 100").unwrap();
        assert!(o.timed_out && o.render().contains("wall-clock limit"));
        // Network: unreachable.
        let o = sb
            .run(
                ws.path(),
                "python3 -c \"import socket; socket.create_connection(('1.1.1.1', 80), timeout=2)\" \
                 || (exec 3<>/dev/tcp/1.1.1.1/80) 2>&1",
            )
            .unwrap();
        report("network", &o);
        assert!(!o.success(), "{o:?}");
        // 100 MB of output: cut, and the command killed.
        let o = sb
            .run(ws.path(), "head -c 100000000 /dev/zero | tr '\\0' x")
            .unwrap();
        report("100 MB output", &o);
        assert!(o.truncated);
        assert!(o.stdout.len() <= 16 << 10);
        assert!(o.output_flood || o.exit_code.is_some());
        // A 100 MB file: the file-size limit.
        let o = sb
            .run(ws.path(), "head -c 100000000 /dev/zero > big")
            .unwrap();
        report("100 MB file", &o);
        assert!(!o.success());
        let size = std::fs::metadata(ws.path().join("big"))
            .map(|m| m.len())
            .unwrap_or(0);
        assert!(size <= 8 << 20, "{size}");
        // Memory: a 1 GB allocation fails under the 512 MB limit.
        let o = sb
            .run(ws.path(), "python3 -c \"x = bytearray(1 << 30)\"")
            .unwrap();
        report("1 GB allocation", &o);
        assert!(!o.success() && o.stderr.contains("MemoryError"), "{o:?}");
        // And the sandbox still works afterwards.
        assert!(sb.run(ws.path(), "echo ok").unwrap().success());
    }

    #[test]
    fn unsandboxed_is_explicit() {
        let sb = Sandbox::unsandboxed(Limits::default());
        assert!(!sb.is_sandboxed());
        let ws = tempfile::tempdir().unwrap();
        let o = sb.run(ws.path(), "echo $((1+2))").unwrap();
        assert_eq!(o.stdout, "3\n");
        assert_eq!(sb.workdir(ws.path()), ws.path().to_string_lossy());
    }
}
