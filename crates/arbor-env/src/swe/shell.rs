//! A persistent shell for an episode: the working directory, shell
//! variables (exported or not), functions and aliases carry over from one
//! `bash` call to the next, as in the interactive shells agents are trained
//! for.
//!
//! Each call still runs in a fresh sandbox with the same limits (so a
//! runaway command, a fork bomb or a flood of output is contained exactly as
//! before, and nothing the command started outlives it). Around the
//! command, the shell loads the state the last call left and, when the
//! command ends (normally or by `exit`), writes its state back with
//! `declare -p`, `declare -f` and `alias -p` to a per-episode directory
//! outside the workspace (so it neither shows in listings nor reaches the
//! evaluation). A command killed at a limit leaves the previous state.
//! Background processes do not carry over.

use std::path::Path;

use tempfile::TempDir;

use super::sandbox::{RunOutput, Sandbox};
use crate::error::{EnvError, Result};

/// Where the state directory appears inside the sandbox.
pub const STATE_DIR: &str = "/run/arbor-shell";

/// The state file in the state directory (bash source).
const STATE_FILE: &str = "state";

/// The largest state a shell keeps (bytes); a larger one is dropped.
pub const MAX_STATE_BYTES: u64 = 1 << 20;

/// Bash's own variables, which a new shell sets itself (or which are
/// read-only): never saved.
const SPECIALS: &str = "BASH*|COMP*|DIRSTACK|EUID|FUNCNAME|GROUPS|HISTCMD|HOSTNAME|HOSTTYPE|IFS\
|LINENO|MACHTYPE|OLDPWD|OPTERR|OPTIND|OSTYPE|PIPESTATUS|PPID|PS4|PWD|RANDOM|SECONDS|SHELLOPTS\
|SHLVL|SRANDOM|EPOCHREALTIME|EPOCHSECONDS|UID|_|__arbor*";

/// One episode's shell state.
#[derive(Debug)]
pub struct Shell {
    dir: TempDir,
}

impl Shell {
    /// A new shell (starts in the workspace root with the default
    /// environment).
    pub fn new(sb: &Sandbox) -> Result<Shell> {
        let dir = tempfile::Builder::new()
            .prefix("arbor-shell")
            .tempdir()
            .map_err(|e| EnvError::Sandbox(format!("shell state dir: {e}")))?;
        sb.own(dir.path())?;
        Ok(Shell { dir })
    }

    /// An independent copy (for forks).
    pub fn fork(&self, sb: &Sandbox) -> Result<Shell> {
        let s = Shell::new(sb)?;
        let state = self.state();
        if !state.is_empty() {
            let to = s.dir.path().join(STATE_FILE);
            std::fs::write(&to, state).map_err(|e| EnvError::io(&to, e))?;
            sb.own_entry(&to);
        }
        Ok(s)
    }

    /// The saved state (empty before the first call). The sandbox can
    /// write the state directory, so only a regular file of at most
    /// [`MAX_STATE_BYTES`] counts: a link, a FIFO or a device is never
    /// opened on the host.
    pub fn state(&self) -> Vec<u8> {
        let p = self.dir.path().join(STATE_FILE);
        match std::fs::symlink_metadata(&p) {
            Ok(m) if m.file_type().is_file() && m.len() <= MAX_STATE_BYTES => {
                std::fs::read(&p).unwrap_or_default()
            }
            _ => Vec::new(),
        }
    }

    /// Runs `command` in this shell in `workspace`.
    pub fn run(&self, sb: &Sandbox, workspace: &Path, command: &str) -> Result<RunOutput> {
        let state_dir = if sb.is_sandboxed() {
            STATE_DIR.to_string()
        } else {
            self.dir.path().to_string_lossy().into_owned()
        };
        let q = super::task::shell_quote(&state_dir);
        // The saver runs on EXIT, keeps the command's status, and writes
        // the new state atomically (a command killed mid-save leaves the
        // old one).
        let prelude = format!(
            "if [ -f {q}/{STATE_FILE} ]; then . {q}/{STATE_FILE} 2>/dev/null; fi\n\
             __arbor_save() {{ __arbor_rc=$?; {{ printf 'cd %q 2>/dev/null\\n' \"$PWD\"; \
             for __arbor_n in $(compgen -v); do case $__arbor_n in {SPECIALS}) continue;; esac; \
             declare -p \"$__arbor_n\" 2>/dev/null; done; \
             for __arbor_n in $(compgen -A function); do case $__arbor_n in __arbor*) continue;; esac; \
             declare -f \"$__arbor_n\"; done; alias -p; }} \
             > {q}/{STATE_FILE}.tmp 2>/dev/null && mv -f {q}/{STATE_FILE}.tmp {q}/{STATE_FILE}; \
             exit $__arbor_rc; }}\n\
             trap __arbor_save EXIT\n"
        );
        let script = format!("{prelude}{command}");
        sb.run_with_state(workspace, &script, self.dir.path())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::swe::sandbox::tests::logic_sandboxes;

    #[test]
    fn directory_variables_functions_carry_over() {
        for sb in logic_sandboxes("persistent shell") {
            let ws = tempfile::tempdir().unwrap();
            std::fs::create_dir(ws.path().join("sub")).unwrap();
            sb.own(ws.path()).unwrap();
            let sh = Shell::new(&sb).unwrap();
            let run = |c: &str| sh.run(&sb, ws.path(), c).unwrap();
            let o = run(
                "cd sub && export A='x y' && B=2 && f() { echo \"f:$1\"; } && alias ll='echo ll'",
            );
            assert!(o.success(), "{o:?}");
            let o =
                run("pwd; echo \"$A|$B\"; f 7; env | grep -c '^A='; shopt -s expand_aliases; true");
            assert!(o.success(), "{o:?}");
            let lines: Vec<&str> = o.stdout.lines().collect();
            assert!(lines[0].ends_with("/sub"), "{o:?}");
            assert_eq!(&lines[1..], ["x y|2", "f:7", "1"], "{o:?}");
            // `exit` keeps its status and still saves; a failing command too.
            let o = run("cd .. ; C=3; exit 4");
            assert_eq!(o.exit_code, Some(4), "{o:?}");
            let o = run("pwd; echo $C; false");
            assert_eq!(o.exit_code, Some(1));
            assert!(!o.stdout.lines().next().unwrap().ends_with("/sub"), "{o:?}");
            assert_eq!(o.stdout.lines().nth(1), Some("3"));
            // A fork goes its own way.
            let f = sh.fork(&sb).unwrap();
            f.run(&sb, ws.path(), "C=forked").unwrap();
            assert_eq!(run("echo $C").stdout.trim(), "3");
            assert_eq!(
                f.run(&sb, ws.path(), "echo $C").unwrap().stdout.trim(),
                "forked"
            );
            // A directory that is gone: back at the root, no error.
            run("cd sub");
            std::fs::remove_dir(ws.path().join("sub")).unwrap();
            let o = run("pwd");
            assert!(o.success(), "{o:?}");
            assert_eq!(o.stderr, "");
            // A command killed at the wall-clock limit leaves the state it
            // found.
            let mut slow = sb.clone();
            slow.limits.wall_secs = 0.5;
            let o = sh.run(&slow, ws.path(), "D=1; sleep 5").unwrap();
            assert!(o.timed_out);
            assert_eq!(run("echo \"[$D]$C\"").stdout.trim(), "[]3");
            assert!(!String::from_utf8_lossy(&sh.state()).contains("__arbor"));
            // A state file replaced by a link (to a host file), as a
            // command could leave it, is not read.
            let st = sh.dir.path().join(STATE_FILE);
            std::fs::remove_file(&st).unwrap();
            std::os::unix::fs::symlink("/etc/hostname", &st).unwrap();
            assert!(sh.state().is_empty());
            assert!(sh.fork(&sb).unwrap().state().is_empty());
        }
    }

    #[test]
    fn hostile_commands_stay_contained_in_the_shell() {
        let Some(sb) = crate::swe::sandbox::tests::sandbox_or_skip("persistent shell, hostile")
        else {
            return;
        };
        let ws = tempfile::tempdir().unwrap();
        sb.own(ws.path()).unwrap();
        let sh = Shell::new(&sb).unwrap();
        assert!(sh.run(&sb, ws.path(), "export KEEP=1").unwrap().success());
        // A fork bomb, an output flood, an endless loop, writes outside the
        // workspace and to the state directory's neighbours: each ends at a
        // limit or fails, and the shell goes on with its state.
        let o = sh
            .run(&sb, ws.path(), "f() { f | f & }; f; sleep 1; echo done")
            .unwrap();
        assert!(!o.timed_out || o.exit_code.is_none(), "{o:?}");
        let o = sh.run(&sb, ws.path(), "yes | head -c 100000000").unwrap();
        assert!(o.output_flood || o.truncated, "{o:?}");
        let o = sh.run(&sb, ws.path(), "while :; do :; done").unwrap();
        assert!(o.timed_out || o.exit_code != Some(0), "{o:?}");
        let o = sh
            .run(
                &sb,
                ws.path(),
                "echo x > /etc/arbor-probe; echo y > /run/x; echo z > /usr/x",
            )
            .unwrap();
        assert!(!o.success(), "{o:?}");
        assert!(!std::path::Path::new("/etc/arbor-probe").exists());
        let o = sh.run(&sb, ws.path(), "echo $KEEP").unwrap();
        assert_eq!(o.stdout.trim(), "1", "{o:?}");
    }
}
