//! The pristine tree of a task: its repository at the base commit, as a
//! fresh one-commit git repository.
//!
//! The source may be a plain directory, a clone, or a bare mirror. Whatever
//! it holds, the task's tree has exactly one commit, no other refs, no
//! reflog and no objects but the base tree's, so `git log --all` or a search
//! of `.git` cannot show the fix (the leak SWE-bench tasks have when the
//! whole clone is copied). It is made on first use, once per instance, and
//! shared by the instance's episodes, which copy it (copy-on-write where
//! the filesystem allows).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};

use tempfile::TempDir;

use super::sandbox::Sandbox;
use crate::error::{EnvError, Result};

/// The commit message, author and date of a task's one commit (fixed, so
/// its hash depends on the tree alone).
const BASE_MESSAGE: &str = "base";
const BASE_IDENT: (&str, &str) = ("arbor", "arbor@localhost");
const BASE_DATE: &str = "2000-01-01T00:00:00Z";

/// Where a repository's objects live: `<dir>/.git` (a clone) or `<dir>`
/// itself (a bare mirror); `None` for a plain directory.
pub fn git_dir(dir: &Path) -> Option<PathBuf> {
    let dot = dir.join(".git");
    if dot.exists() {
        Some(dot)
    } else if dir.join("HEAD").is_file() && dir.join("objects").is_dir() {
        Some(dir.to_path_buf())
    } else {
        None
    }
}

fn git(dir: &Path) -> Command {
    let mut c = Command::new("git");
    no_user_config(&mut c);
    c.args(["-c", "safe.directory=*", "-C"]).arg(dir);
    c
}

/// Git without the system's or the user's configuration (templates,
/// hooks, excludes, line-ending conversion).
fn no_user_config(c: &mut Command) {
    c.env("GIT_TERMINAL_PROMPT", "0")
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_CONFIG_GLOBAL", "/dev/null");
}

fn run(cmd: &mut Command, what: &str) -> Result<String> {
    let out = cmd
        .output()
        .map_err(|e| EnvError::Sandbox(format!("{what}: {e}")))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    } else {
        Err(EnvError::Sandbox(format!(
            "{what}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

/// Checks that `commit` exists in the repository at `source` (cheap; the
/// tree itself is made later).
pub fn check_commit(source: &Path, commit: &str) -> Result<()> {
    if git_dir(source).is_none() {
        return Err(EnvError::Sandbox(format!(
            "{} is not a git repository, but the instance names base commit {commit}",
            source.display()
        )));
    }
    // `-C` on the source itself also serves work trees whose `.git` is a
    // file.
    run(
        git(source)
            .args(["cat-file", "-e"])
            .arg(format!("{commit}^{{commit}}")),
        &format!("base commit {commit} in {}", source.display()),
    )
    .map(|_| ())
}

/// Writes the tree of `source` at `commit` (`""`: the directory as it is,
/// without its `.git`) to the new directory `dst`, as a one-commit
/// repository.
pub fn materialize(source: &Path, commit: &str, dst: &Path) -> Result<()> {
    let what = |s: &str| format!("{s} {} at `{commit}`", source.display());
    match git_dir(source).filter(|_| !commit.is_empty()) {
        Some(_) => {
            // A clone sharing the source's objects (cheap), checked out at
            // the commit, then stripped of its history.
            let mut clone = Command::new("git");
            no_user_config(&mut clone);
            run(
                clone
                    .args(["-c", "safe.directory=*", "clone", "-q", "--shared"])
                    .arg("--no-checkout")
                    .arg(source)
                    .arg(dst),
                &what("cloning"),
            )?;
            run(
                git(dst).args([
                    "-c",
                    "advice.detachedHead=false",
                    "checkout",
                    "-q",
                    "--detach",
                    commit,
                ]),
                &what("checking out"),
            )?;
            let gd = dst.join(".git");
            std::fs::remove_dir_all(&gd).map_err(|e| EnvError::io(&gd, e))?;
        }
        None => {
            super::task::copy_tree(source, dst)?;
            let gd = dst.join(".git");
            if std::fs::symlink_metadata(&gd).is_ok() {
                let _ = std::fs::remove_dir_all(&gd).or_else(|_| std::fs::remove_file(&gd));
            }
        }
    }
    let commit_env = |c: &mut Command| {
        c.env("GIT_AUTHOR_NAME", BASE_IDENT.0)
            .env("GIT_AUTHOR_EMAIL", BASE_IDENT.1)
            .env("GIT_COMMITTER_NAME", BASE_IDENT.0)
            .env("GIT_COMMITTER_EMAIL", BASE_IDENT.1)
            .env("GIT_AUTHOR_DATE", BASE_DATE)
            .env("GIT_COMMITTER_DATE", BASE_DATE);
    };
    run(
        git(dst).args(["init", "-q", "-b", "main"]),
        &what("initialising"),
    )?;
    // Ignored files too: the tree is what the commit holds.
    run(git(dst).args(["add", "-A", "-f"]), &what("staging"))?;
    let mut c = git(dst);
    commit_env(&mut c);
    run(
        c.args([
            "-c",
            "commit.gpgsign=false",
            "commit",
            "-q",
            "--no-verify",
            "--allow-empty",
            "-m",
            BASE_MESSAGE,
        ]),
        &what("committing"),
    )?;
    // `git init` and `commit` leave no reflog worth hiding, but drop it anyway.
    let logs = dst.join(".git/logs");
    if logs.exists() {
        std::fs::remove_dir_all(&logs).map_err(|e| EnvError::io(&logs, e))?;
    }
    Ok(())
}

/// An instance's pristine tree, made on first use and kept while any
/// episode of the instance lives.
#[derive(Debug)]
pub struct LazyBase {
    source: PathBuf,
    commit: String,
    sandbox: Sandbox,
    init: Mutex<()>,
    cell: OnceLock<(TempDir, PathBuf)>,
}

impl LazyBase {
    /// The tree of `source` at `commit`, made when first asked for.
    pub fn new(source: &Path, commit: &str, sandbox: &Sandbox) -> LazyBase {
        LazyBase {
            source: source.to_path_buf(),
            commit: commit.to_string(),
            sandbox: sandbox.clone(),
            init: Mutex::new(()),
            cell: OnceLock::new(),
        }
    }

    /// The tree's path, made now if it was not yet.
    pub fn path(&self) -> Result<&Path> {
        if let Some((_, p)) = self.cell.get() {
            return Ok(p);
        }
        let _g = self
            .init
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((_, p)) = self.cell.get() {
            return Ok(p);
        }
        let dir = tempfile::Builder::new()
            .prefix("arbor-swe-base")
            .tempdir()
            .map_err(|e| EnvError::Sandbox(format!("temp dir: {e}")))?;
        let path = dir.path().join("ws");
        materialize(&self.source, &self.commit, &path)?;
        self.sandbox.own(&path)?;
        Ok(&self.cell.get_or_init(|| (dir, path)).1)
    }

    /// The path if the tree was made already.
    pub fn made(&self) -> Option<&Path> {
        self.cell.get().map(|(_, p)| p.as_path())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(dir: &Path, script: &str) -> String {
        let o = Command::new("bash")
            .arg("-c")
            .arg(script)
            .current_dir(dir)
            .env("GIT_AUTHOR_NAME", "t")
            .env("GIT_AUTHOR_EMAIL", "t@t")
            .env("GIT_COMMITTER_NAME", "t")
            .env("GIT_COMMITTER_EMAIL", "t@t")
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "{script}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    /// A repository whose future holds the fix: a later commit, a branch, a
    /// tag, a stash-like ref and a reflog.
    fn repo_with_future() -> (TempDir, String) {
        let d = tempfile::tempdir().unwrap();
        sh(
            d.path(),
            "git init -q -b main . && echo 'def f(): return 1  # BUG' > m.py && git add m.py \
             && git commit -q -m 'buggy' && git tag v0",
        );
        let base = sh(d.path(), "git rev-parse HEAD").trim().to_string();
        sh(
            d.path(),
            "echo 'def f(): return 2  # FIXED-SECRET' > m.py && git commit -qam 'the fix: FIXED-SECRET' \
             && git tag v1 && git branch fix-branch && git update-ref refs/keep/x HEAD \
             && git checkout -q --detach v0",
        );
        (d, base)
    }

    fn check_no_future(tree: &Path) {
        let log = sh(tree, "git log --all --format=%s");
        assert_eq!(log.trim(), "base", "only the base commit: {log}");
        assert_eq!(sh(tree, "git rev-list --all | wc -l").trim(), "1");
        assert_eq!(
            sh(tree, "git for-each-ref --format='%(refname)'").trim(),
            "refs/heads/main"
        );
        assert_eq!(sh(tree, "git reflog 2>/dev/null | wc -l").trim(), "0");
        // Nothing in .git holds the fix, compressed or not.
        let hits = sh(
            tree,
            "grep -r -l FIXED-SECRET . ; git cat-file --batch-all-objects --batch | grep -c FIXED-SECRET; true",
        );
        assert_eq!(hits.trim(), "0", "future content found: {hits}");
        assert!(std::fs::read_to_string(tree.join("m.py"))
            .unwrap()
            .contains("BUG"));
    }

    #[test]
    fn clones_and_bare_mirrors_give_one_commit_trees() {
        let (src, base) = repo_with_future();
        let bare = tempfile::tempdir().unwrap();
        sh(
            bare.path(),
            &format!("git clone -q --mirror {} m.git", src.path().display()),
        );
        let mirror = bare.path().join("m.git");
        assert!(git_dir(&mirror).is_some());
        for source in [src.path(), mirror.as_path()] {
            check_commit(source, &base).unwrap();
            assert!(check_commit(source, "0123456789abcdef0123456789abcdef01234567").is_err());
            let out = tempfile::tempdir().unwrap();
            let tree = out.path().join("ws");
            materialize(source, &base, &tree).unwrap();
            check_no_future(&tree);
        }
        // Without a base commit, the directory as it is (a work tree's
        // uncommitted state, or a plain directory with a stray `.git` file)
        // becomes a one-commit repository too.
        let out = tempfile::tempdir().unwrap();
        let tree = out.path().join("ws");
        sh(
            src.path(),
            "git checkout -q main && echo 'def f(): return 1  # BUG' > m.py",
        );
        materialize(src.path(), "", &tree).unwrap();
        check_no_future(&tree);
        let plain = tempfile::tempdir().unwrap();
        std::fs::write(plain.path().join("m.py"), "def f(): return 1  # BUG\n").unwrap();
        std::fs::write(plain.path().join(".git"), "gitdir: /nowhere\n").unwrap();
        let out = tempfile::tempdir().unwrap();
        let tree = out.path().join("ws");
        materialize(plain.path(), "", &tree).unwrap();
        check_no_future(&tree);
        assert!(check_commit(plain.path(), &base).is_err());
    }

    #[test]
    fn the_base_is_made_once_on_first_use() {
        let (src, base) = repo_with_future();
        let lb = std::sync::Arc::new(LazyBase::new(
            src.path(),
            &base,
            &Sandbox::unsandboxed(Default::default()),
        ));
        assert!(lb.made().is_none());
        let paths: Vec<PathBuf> = (0..4)
            .map(|_| {
                let lb = std::sync::Arc::clone(&lb);
                std::thread::spawn(move || lb.path().unwrap().to_path_buf())
            })
            .map(|h| h.join().unwrap())
            .collect();
        assert!(paths.windows(2).all(|w| w[0] == w[1]));
        assert_eq!(lb.made(), Some(paths[0].as_path()));
    }
}
