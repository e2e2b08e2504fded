#!/usr/bin/env python3
"""Builds SWE tasks from real Python packages, offline after the downloads.

For each pinned package: download its source distribution from the package
index (sha256 checked), unpack it into a one-commit git repository, build a
Python environment with pytest and the package's test dependencies (the
sandbox mounts it read-only), run the suite twice and keep the tests that
pass both times, then inject bugs into the package source (never the tests)
with AST-level mutations spliced by line range:

  raise_body      a function's body becomes `raise NotImplementedError`
  flip_compare    `<` <-> `>=`, `==` <-> `!=`, `in` <-> `not in`, ...
  swap_operands   `a - b` -> `b - a` (non-commutative operators)
  change_constant an integer n -> n + 1, True <-> False
  remove_branch   an `if` without `else` removed
  remove_loop     a `for` / `while` loop removed
  drop_return     a `return value` statement removed

A mutant becomes a task when 1-20 of the stable tests fail (FAIL_TO_PASS)
and all others pass (PASS_TO_PASS, sampled). It is committed on its own ref
of the package's repository (`refs/tasks/<id>`); the task's tree is that
commit alone, so neither the original nor other mutants can be read from it.
The gold patch is the reverse diff; the problem statement is written from the
failing test's assertion and error, without test names or library frames.

Output in --out: candidates.jsonl (SWE-bench format), specs.json (one test
command, report format and environment per repository), repos/, envs/,
cache/ and manifest.json (package, version, sdist hash, base commit,
mutation, seed for every task). `arbor swe build` runs this script, then
checks every candidate through Arbor's own evaluation (the buggy tree scores
0, the gold patch 1) and writes instances.jsonl with those that pass.

Every test run happens in a bubblewrap sandbox (no network, read-only
system, the work copy the only writable tree) unless --unsandboxed.
"""

import argparse
import ast
import collections
import concurrent.futures as cf
import hashlib
import json
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.parse
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path

PYTEST = "pytest==9.2.0"
# How every run calls pytest: no cache written into the tree, the package's
# own addopts (coverage plugins, ...) off, node ids relative to the root.
PYTEST_ARGV = ["python", "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=", "--rootdir=."]

# name: (version, sdist sha256, extra test requirements, extra pytest args)
PACKAGES = {
    "boltons": ("26.2.0", "d39cfd15c1a1c3bd4d705c82252fa9edb8e4f5e8cc039f8e39afac7b1b47e92c", [], []),
    "cachetools": ("8.0.3", "79245d0d90464e29355f13658cd769e57d98ed06242d3c6fbd71796ca0938ef9", [], []),
    "click": ("8.5.1", "9bbfada76703fd1d784b83eea012e3e8c6a001a876543ef104fa56aaaeb072b4", [], ["-m", "not stress"]),
    "idna": ("3.21", "13c8b14853c5c336eaab526f3390817e9c8fcd8fa175abdd1a7480a5c94f99cb", ["hypothesis==6.151.5"], []),
    "inflection": ("0.5.1", "1a29730d366e996aaacffb2f1f1cb9593dc38e2ddd30c91250c6dde09ea9b417", [], []),
    "iniconfig": ("2.3.1", "67f4b9c50da0dedf52af349e7749a80a9057a5031199791b906c3bb3ae878960", [], []),
    "parse": ("1.22.4", "706d458feed5a81b02768d3156e8070baf6cee7d150a3a3c0cd43101a875c3b5", [], []),
    "pathspec": ("1.1.1", "17db5ecd524104a120e173814c90367a96a98d07c45b2e10c2f3919fff91bf5a", [], []),
    "semver": ("3.2.0", "adf2c822d2d8908a1dce0121da7da6511851fbd33080e61da8d2ba1e0677e8f3", [], []),
    "sqlparse": ("0.6.1", "ca722573f848ff2d30e40ea30f53a104b7dea7635ea9285891263eb2c58fb6e7", [], []),
    "tabulate": ("0.10.0", "e2cfde8f79420f6deeffdeda9aaec3b6bc5abce947655d17ac662b126e48a60d", [], []),
    "toolz": ("1.2.0", "9667a038e9d6ecba37995e26cb2f59ec6420b6ad8dd9677de59db9b956b08490", [], []),
    # Its suite takes ~18 s here (21k subtests): too slow for many mutants.
    "more-itertools": ("11.2.1", "cbf08fd0af284dc69718b9b76a8e6203df624d70209ea511e4219d350c856f63", [], []),
}
# iniconfig is a dependency of pytest, so its environment would show the
# original source; the builder skips it.
DEFAULT_PACKAGES = [p for p in PACKAGES if p not in ("more-itertools", "iniconfig")]

INDEX = os.environ.get("ARBOR_PYPI_JSON", "https://pypi.org/pypi")
WORKDIR = "/workspace"
REPORT = ".arbor-report.xml"
COVERAGE = ".arbor-coverage.json"

# A pytest plugin (installed into each package's environment) that records,
# per test, the lines of the workspace it runs: a mutant is then run only
# against the tests that reach its lines (the others cannot see it).
COV_PLUGIN = r'''
import json, os, sys, threading
import pytest

_root = os.environ.get("ARBOR_COV_ROOT", "")
_cur = None
_seen = {}


def _local(frame, event, arg):
    if event == "line" and _cur is not None:
        _cur.add((frame.f_code.co_filename, frame.f_lineno))
    return _local


def _global(frame, event, arg):
    if _cur is not None and frame.f_code.co_filename.startswith(_root):
        _cur.add((frame.f_code.co_filename, frame.f_lineno))
        return _local
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _cur
    _cur = set()
    threading.settrace(_global)
    sys.settrace(_global)
    try:
        yield
    finally:
        sys.settrace(None)
        threading.settrace(None)
        _seen[item.nodeid] = _cur
        _cur = None


def pytest_sessionfinish(session):
    out = os.environ.get("ARBOR_COV_OUT")
    if not out:
        return
    tests = sorted(_seen)
    index = {t: i for i, t in enumerate(tests)}
    lines = {}
    for t, hits in _seen.items():
        for f, n in hits:
            rel = f[len(_root):]
            lines.setdefault(rel, {}).setdefault(str(n), []).append(index[t])
    with open(out, "w") as fh:
        json.dump({"tests": tests, "lines": lines}, fh)
'''
IDENT = {
    "GIT_AUTHOR_NAME": "arbor",
    "GIT_AUTHOR_EMAIL": "arbor@localhost",
    "GIT_COMMITTER_NAME": "arbor",
    "GIT_COMMITTER_EMAIL": "arbor@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z",
    "GIT_CONFIG_NOSYSTEM": "1",
}
NOBODY = 65534


def log(msg):
    print(msg, flush=True)


class Skip(Exception):
    """A package that cannot be used, with the reason."""


# ---------------------------------------------------------------- download


def fetch_sdist(name, version, sha256, cache):
    cache.mkdir(parents=True, exist_ok=True)
    for f in cache.glob("*.tar.gz"):
        if hashlib.sha256(f.read_bytes()).hexdigest() == sha256:
            return f, None
    url = f"{INDEX}/{name}/json"
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            meta = json.load(r)
            base = r.geturl()
    except Exception as e:  # noqa: BLE001 - any failure means offline
        raise Skip(f"package index unreachable ({url}: {e})")
    files = meta.get("releases", {}).get(version) or (
        meta.get("urls", []) if meta.get("info", {}).get("version") == version else [])
    sd = [u for u in files if u.get("packagetype") == "sdist"]
    if not sd:
        raise Skip(f"{name} {version} has no source distribution on the index")
    link = urllib.parse.urljoin(base, sd[0]["url"])
    dst = cache / sd[0]["filename"]
    tmp = dst.with_suffix(".part")
    with urllib.request.urlopen(link, timeout=120) as r, open(tmp, "wb") as f:
        shutil.copyfileobj(r, f)
    got = hashlib.sha256(tmp.read_bytes()).hexdigest()
    if got != sha256:
        tmp.unlink()
        raise Skip(f"sdist hash mismatch: pinned {sha256}, downloaded {got}")
    tmp.rename(dst)
    return dst, link


# ---------------------------------------------------------------- git


def git(repo, *args, check=True, raw=False):
    env = dict(os.environ, **IDENT)
    r = subprocess.run(
        ["git", "-c", "safe.directory=*", "-c", "commit.gpgsign=false", "-C", str(repo), *args],
        capture_output=True, text=True, env=env,
    )
    if check and r.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} in {repo}: {r.stderr.strip()}")
    return r.stdout if raw else r.stdout.strip()


def unpack(sdist, repo):
    if repo.exists():
        shutil.rmtree(repo)
    with tempfile.TemporaryDirectory() as td:
        with tarfile.open(sdist) as t:
            t.extractall(td, filter="data")
        tops = list(Path(td).iterdir())
        if len(tops) != 1 or not tops[0].is_dir():
            raise Skip(f"{sdist.name}: expected one top-level directory")
        shutil.move(str(tops[0]), repo)
    for egg in repo.glob("*.egg-info"):
        shutil.rmtree(egg)
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A", "-f")
    git(repo, "commit", "-q", "--no-verify", "-m", "base")
    return git(repo, "rev-parse", "HEAD")


# ---------------------------------------------------------------- environment


def layout(repo, name):
    """PYTHONPATH entry and test paths of an unpacked package."""
    pp = "src" if (repo / "src").is_dir() else "."
    tests = [d for d in ("tests", "test", "testing") if (repo / d).is_dir()]
    mod = repo / pp / name.replace("-", "_")
    for sub in ("tests", "test"):
        if (mod / sub).is_dir():
            tests.append(str((mod / sub).relative_to(repo)))
    tests += sorted(p.name for p in repo.glob("test_*.py"))
    if not tests:
        raise Skip("no tests found (tests/, test/, testing/, <pkg>/tests or test_*.py)")
    return pp, tests


def build_env(env, repo, name, version, reqs):
    if env.exists():
        shutil.rmtree(env)
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(env)], check=True)
    py = env / "bin" / "python"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "-q",
         "--disable-pip-version-check", PYTEST, *reqs],
        capture_output=True, text=True,
    )
    if r.returncode != 0:
        raise Skip(f"environment: pip failed: {r.stderr.strip()[-400:]}")
    # Package metadata, so `importlib.metadata.version(name)` works while
    # the code itself is imported from the workspace.
    site = next((env / "lib").glob("python3*/site-packages"))
    norm = name.replace("-", "_").lower()
    have = [d for d in site.glob("*.dist-info") if d.name.split("-")[0].lower() == norm]
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    if have:
        # pytest depends on it (iniconfig): the environment, which the agent
        # can read, would hold the original source of every task.
        raise Skip(f"{name} is installed in the environment as a dependency of pytest, "
                   "so the original source would be visible to the agent")
    info.mkdir()
    pkg_info = repo / "PKG-INFO"
    (info / "METADATA").write_text(
        pkg_info.read_text() if pkg_info.exists() else f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    )
    (info / "INSTALLER").write_text("arbor\n")
    (info / "RECORD").write_text("")
    (site / "arbor_cov.py").write_text(COV_PLUGIN)
    r = subprocess.run(
        [str(py), "-c",
         "import importlib.metadata as m, json; print(json.dumps(sorted("
         "f'{d.metadata[\"Name\"]}=={d.version}' for d in m.distributions())))"],
        capture_output=True, text=True, check=True,
    )
    return json.loads(r.stdout)


# ---------------------------------------------------------------- sandboxed runs


def bwrap_path():
    return shutil.which("bwrap")


def sandbox_cmd(bwrap, work, env, pythonpath, argv, wall, extra_env=None):
    """The command running `argv` in `work` (at /workspace), sandboxed."""
    setenv = {**(extra_env or {}),
        "PATH": f"{env}/bin:/usr/local/bin:/usr/bin:/bin",
        "VIRTUAL_ENV": str(env),
        "PYTHONPATH": pythonpath,
        "HOME": "/tmp",
        "TMPDIR": "/tmp",
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONHASHSEED": "0",
    }
    limits = f"ulimit -c 0 -t {int(wall) + 5} -v {4 << 20} -f {256 << 10}; exec \"$@\""
    if bwrap is None:
        return ["env", *[f"{k}={v}" for k, v in setenv.items()], "bash", "-c", limits, "sh", *argv], work
    c = [bwrap, "--unshare-all", "--die-with-parent", "--new-session"]
    for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host = Path("/") / top
        if host.is_symlink():
            c += ["--symlink", os.readlink(host), str(host)]
        elif host.is_dir():
            c += ["--ro-bind", str(host), str(host)]
    for d in ("/usr", "/etc", "/opt"):
        if Path(d).is_dir():
            c += ["--ro-bind", d, d]
    # The environment after /tmp, which would hide it when it lives there.
    c += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--ro-bind", str(env), str(env),
          "--bind", str(work), WORKDIR, "--chdir", WORKDIR, "--clearenv"]
    for k, v in setenv.items():
        c += ["--setenv", k, v]
    c += ["--remount-ro", "/", "--", "bash", "-c", limits, "sh", *argv]
    return c, None


def sandbox_user(ctx):
    """Run as `nobody` when bubblewrap runs as root (so `ulimit -u` applies)."""
    if ctx["bwrap"] and os.geteuid() == 0:
        return {"user": NOBODY, "group": NOBODY, "extra_groups": []}
    return {}


def own(path):
    if os.geteuid() == 0:
        for root, dirs, files in os.walk(path):
            os.lchown(root, NOBODY, NOBODY)
            for f in dirs + files:
                os.lchown(os.path.join(root, f), NOBODY, NOBODY)


def run_tests(ctx, work, tests, wall, coverage=False):
    """Runs pytest on `tests` (paths or ids) in `work`; returns
    ({junit key: status}, {junit key: failure text}, seconds), or None when the
    run produced no report (timeout, crash). With `coverage`, the lines of the
    workspace each test runs go to COVERAGE in `work` (see COV_PLUGIN)."""
    report = Path(work) / REPORT
    if report.exists():
        report.unlink()
    root = WORKDIR if ctx["bwrap"] else str(work)
    extra, env = [], None
    if coverage:
        extra = ["-p", "arbor_cov"]
        env = {"ARBOR_COV_ROOT": root + "/", "ARBOR_COV_OUT": f"{root}/{COVERAGE}"}
    argv = [*PYTEST_ARGV, "-q", "--tb=short", "-rN", f"--junitxml={root}/{REPORT}",
            *extra, *ctx["args"], *tests]
    cmd, cwd = sandbox_cmd(ctx["bwrap"], work, ctx["env"], ctx["pythonpath"], argv, wall, env)
    t0 = time.time()
    p = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True, **sandbox_user(ctx))
    try:
        p.wait(timeout=wall)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        p.wait()
        return None
    dt = time.time() - t0
    if not report.exists():
        return None
    try:
        root = ET.parse(report).getroot()
    except ET.ParseError:
        return None
    status, text = {}, {}
    rank = {"passed": 0, "xfail": 1, "skipped": 2, "failed": 3, "error": 4}
    for tc in root.iter("testcase"):
        key = f"{tc.get('classname', '')}::{tc.get('name', '')}"
        st, tx = "passed", None
        for ch in tc:
            if ch.tag == "failure":
                s = "failed"
            elif ch.tag == "error":
                s = "error"
            elif ch.tag == "skipped":
                s = "xfail" if ch.get("type") == "pytest.xfail" else "skipped"
            else:
                continue
            if rank[s] > rank[st]:
                st = s
            if s in ("failed", "error") and tx is None:
                tx = (ch.text or "").strip() or ch.get("message", "")
        if key not in status or rank[st] > rank[status[key]]:
            status[key] = st
        if tx:
            text.setdefault(key, tx)
    return status, text, dt


def junit_key(node_id):
    """The JUnit `classname::name` of a pytest node id (as Arbor maps it)."""
    head, params = node_id, ""
    if "[" in node_id:
        i = node_id.index("[")
        head, params = node_id[:i], node_id[i:]
    parts = head.split("::")
    if len(parts) < 2:
        return node_id
    cls = parts[0][:-3] if parts[0].endswith(".py") else parts[0]
    cls = cls.replace("/", ".")
    for c in parts[1:-1]:
        cls += "." + c
    return f"{cls}::{parts[-1]}{params}"


def collect(ctx, repo):
    argv = [*PYTEST_ARGV, "--collect-only", "-q", *ctx["args"], *ctx["tests"]]
    work = Path(tempfile.mkdtemp(prefix="arbor-swe-collect"))
    try:
        shutil.copytree(repo, work, dirs_exist_ok=True, symlinks=True)
        own(work)
        cmd, cwd = sandbox_cmd(ctx["bwrap"], work, ctx["env"], ctx["pythonpath"], argv, 300)
        r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300, **sandbox_user(ctx))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ids = [l.strip() for l in r.stdout.splitlines() if "::" in l and not l.startswith(" ")]
    if not ids:
        raise Skip(f"pytest collected no tests: {(r.stdout + r.stderr).strip()[-400:]}")
    return ids


# ---------------------------------------------------------------- mutations

FLIP = {ast.Lt: ast.GtE, ast.GtE: ast.Lt, ast.Gt: ast.LtE, ast.LtE: ast.Gt,
        ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In,
        ast.Is: ast.IsNot, ast.IsNot: ast.Is}
OP_TEXT = {ast.Lt: "<", ast.GtE: ">=", ast.Gt: ">", ast.LtE: "<=", ast.Eq: "==", ast.NotEq: "!=",
           ast.In: "in", ast.NotIn: "not in", ast.Is: "is", ast.IsNot: "is not"}
NONCOMMUTATIVE = (ast.Sub, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.LShift, ast.RShift)


def is_test_path(rel):
    parts = Path(rel).parts
    name = parts[-1]
    return (any(p in ("tests", "test", "testing", "docs", "doc", "examples", "benchmarks") for p in parts[:-1])
            or name.startswith("test_") or name.endswith("_test.py")
            or name in ("conftest.py", "setup.py", "noxfile.py"))


def source_files(repo, pythonpath):
    root = repo / pythonpath
    out = []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(repo).as_posix()
        if is_test_path(rel) or any(p.startswith(".") for p in Path(rel).parts):
            continue
        out.append(rel)
    return out


def mutants_of(rel, text):
    """Candidate mutations of one file: dicts with the line range to replace
    (1-based, inclusive), the new lines, the kind and the function."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines(keepends=True)
    blines = [l.encode() for l in lines]
    out = []
    parents = {}
    for node in ast.walk(tree):
        for ch in ast.iter_child_nodes(node):
            parents[ch] = node

    def func_of(node):
        n = node
        while n is not None and not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = parents.get(n)
        return n

    def indent(lineno):
        l = lines[lineno - 1]
        return l[: len(l) - len(l.lstrip())]

    def alone(node):
        """The statement occupies its lines alone."""
        first, last = blines[node.lineno - 1], blines[node.end_lineno - 1]
        return (not first[: node.col_offset].strip()
                and (not last[node.end_col_offset:].strip() or last[node.end_col_offset:].strip().startswith(b"#")))

    def splice(node, new_text):
        if node.lineno != node.end_lineno:
            return None
        b = blines[node.lineno - 1]
        nl = b[: node.col_offset] + new_text.encode() + b[node.end_col_offset:]
        return nl.decode()

    def add(kind, node, start, end, new_lines):
        f = func_of(node)
        if f is None:
            return
        out.append({"file": rel, "kind": kind, "func": f.name, "start": start, "end": end,
                    "lines": new_lines})

    def remove_stmt(kind, node):
        parent = parents.get(node)
        body = None
        for field in ("body", "orelse", "finalbody"):
            seq = getattr(parent, field, None)
            if isinstance(seq, list) and node in seq:
                body = seq
        if body is None or not alone(node):
            return
        new = [] if len(body) > 1 else [indent(node.lineno) + "pass\n"]
        add(kind, node, node.lineno, node.end_lineno, new)

    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                    and isinstance(body[0].value.value, str):
                body = body[1:]
            if not body or body[0].lineno == node.lineno:
                continue
            if len(body) == 1 and isinstance(body[0], ast.Raise):
                continue
            # Keep decorators and comments above the first statement.
            start = body[0].lineno
            add("raise_body", node, start, node.end_lineno, [indent(start) + "raise NotImplementedError\n"])
        elif isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in FLIP:
            left, right = node.left, node.comparators[0]
            if left.end_lineno != node.lineno or right.lineno != node.lineno or node.lineno != node.end_lineno:
                continue
            b = blines[node.lineno - 1]
            between = b[left.end_col_offset: right.col_offset].decode()
            if " ".join(between.split()) != OP_TEXT[type(node.ops[0])]:
                continue
            new_op = OP_TEXT[FLIP[type(node.ops[0])]]
            nb = b[: left.end_col_offset] + f" {new_op} ".encode() + b[right.col_offset:]
            add("flip_compare", node, node.lineno, node.lineno, [nb.decode()])
        elif isinstance(node, ast.BinOp) and isinstance(node.op, NONCOMMUTATIVE):
            l, r = node.left, node.right
            if node.lineno != node.end_lineno or l.lineno != node.lineno or r.end_lineno != node.lineno:
                continue
            b = blines[node.lineno - 1]
            ls, rs = b[l.col_offset: l.end_col_offset], b[r.col_offset: r.end_col_offset]
            mid = b[l.end_col_offset: r.col_offset]
            if ls == rs or b"(" in mid or b")" in mid:
                continue
            nb = b[: l.col_offset] + rs + mid + ls + b[r.end_col_offset:]
            add("swap_operands", node, node.lineno, node.lineno, [nb.decode()])
        elif isinstance(node, ast.Constant) and not isinstance(parents.get(node), (ast.JoinedStr, ast.FormattedValue)):
            v = node.value
            if isinstance(v, bool):
                new = "False" if v else "True"
            elif isinstance(v, int):
                new = str(v + 1)
            else:
                continue
            b = blines[node.lineno - 1] if node.lineno == node.end_lineno else None
            if b is None or b[node.col_offset: node.end_col_offset].decode() != repr(v):
                continue
            add("change_constant", node, node.lineno, node.lineno, [splice(node, new)])
        elif isinstance(node, ast.If) and not node.orelse:
            if lines[node.lineno - 1].lstrip().startswith("if"):
                remove_stmt("remove_branch", node)
        elif isinstance(node, (ast.For, ast.While)) and not node.orelse:
            remove_stmt("remove_loop", node)
        elif isinstance(node, ast.Return) and node.value is not None:
            remove_stmt("drop_return", node)
    return out


def apply_mutation(text, m):
    lines = text.splitlines(keepends=True)
    new = lines[: m["start"] - 1] + m["lines"] + lines[m["end"]:]
    out = "".join(new)
    try:
        ast.parse(out)
    except SyntaxError:
        return None
    return out if out != text else None


# ---------------------------------------------------------------- statements

FRAME = re.compile(r"^(\S+\.py):(\d+): in (\S+)\s*$")
FRAME_END = re.compile(r"^(\S+\.py):(\d+): \S")


def statement(pkg, n_fail, files, failure):
    """The issue text for a failing mutant: the failing test's own code lines
    and the error lines, without test names and without frames from the
    library (which would show the bug)."""
    keep, in_test = [], False
    for line in failure.splitlines():
        m = FRAME.match(line)
        if m:
            in_test = is_test_path(m.group(1))
            continue
        if FRAME_END.match(line):
            continue
        if line.startswith("E "):
            keep.append(line.rstrip())
        elif in_test and line.strip():
            keep.append(line.rstrip())
    keep = [re.sub(r" at 0x[0-9a-f]+", "", l) for l in keep]
    code = [l for l in keep if not l.startswith("E ")][-8:]
    err = [l for l in keep if l.startswith("E ")][:12]
    excerpt = "\n".join(code + err) or "(the test fails without a message)"
    where = f"{n_fail} of its tests now fail" + (f", in {files} test files" if files > 1 else "")
    return (f"Something is broken in `{pkg}`: {where}. One failure looks like this:\n\n"
            f"```\n{excerpt}\n```\n\n"
            f"Find the cause in the library's source and fix it. The tests are correct.")


# ---------------------------------------------------------------- build


def on_copies(repo, jobs, prefix, take, work, done):
    """Runs `work(item, dir)` on `jobs` private copies of `repo`: `take(n)`
    gives the next item while a copy is free (`n`: items in flight; None:
    nothing more now), `done(result)` gets each result as it ends."""
    dirs = [Path(tempfile.mkdtemp(prefix=prefix)) for _ in range(jobs)]
    try:
        for d in dirs:
            shutil.copytree(repo, d, dirs_exist_ok=True, symlinks=True)
            own(d)
        free = list(dirs)
        with cf.ThreadPoolExecutor(jobs) as ex:
            pending = {}
            while True:
                while free:
                    item = take(len(pending))
                    if item is None:
                        break
                    d = free.pop()
                    pending[ex.submit(work, item, d)] = d
                if not pending:
                    break
                fut = next(cf.as_completed(pending))
                free.append(pending.pop(fut))
                done(fut.result())
    finally:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


def build_package(name, args, out, rng_seed):
    version, sha, reqs, extra = PACKAGES[name]
    t0 = time.time()
    sdist, link = fetch_sdist(name, version, sha, out / "cache" / "sdists")
    repo = out / "repos" / "pypi" / name
    repo.parent.mkdir(parents=True, exist_ok=True)
    base = unpack(sdist, repo)
    pythonpath, tests = layout(repo, name)
    env = out / "envs" / name
    dists = build_env(env, repo, name, version, reqs)
    ctx = {"bwrap": None if args.unsandboxed else bwrap_path(), "env": env.resolve(),
           "pythonpath": pythonpath, "args": extra, "tests": tests}
    ids = collect(ctx, repo)
    by_key = {}
    for i in ids:
        by_key.setdefault(junit_key(i), []).append(i)
    # Two full runs: keep what passes both times.
    runs = []
    work = Path(tempfile.mkdtemp(prefix=f"arbor-swe-{name}"))
    try:
        shutil.copytree(repo, work, dirs_exist_ok=True, symlinks=True)
        own(work)
        for _ in range(2):
            r = run_tests(ctx, work, tests, args.suite_timeout)
            if r is None:
                raise Skip(f"the test suite wrote no report within {args.suite_timeout} s")
            runs.append(r)
        # A third run records which tests reach which lines.
        cov = None
        if run_tests(ctx, work, tests, 10 * args.suite_timeout, coverage=True) is not None:
            try:
                cov = json.loads((work / COVERAGE).read_text())
            except (OSError, ValueError):
                cov = None
        if cov is None:
            log(f"{name}: no coverage recorded; every mutant runs the whole suite")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    suite_s = max(r[2] for r in runs)
    stable = sorted(ids_[0] for k, ids_ in by_key.items()
                    if len(ids_) == 1 and all(r[0].get(k) == "passed" for r in runs))
    flaky = sum(1 for k in by_key if len({r[0].get(k) for r in runs}) > 1)
    if len(stable) < 5:
        raise Skip(f"only {len(stable)} stable passing tests")
    log(f"{name} {version}: {len(ids)} tests collected, {len(stable)} pass twice ({flaky} flaky), "
        f"suite {suite_s:.1f} s, env {len(dists)} dists")

    # Candidate mutants, balanced over kinds, at most 2 per function.
    rng = random.Random(f"{rng_seed}:{name}")
    sources = source_files(repo, pythonpath)
    cands = []
    for rel in sources:
        cands += mutants_of(rel, (repo / rel).read_text())
    by_kind = {}
    for c in cands:
        by_kind.setdefault(c["kind"], []).append(c)
    for v in by_kind.values():
        rng.shuffle(v)
    order = []
    kinds = sorted(by_kind)
    while any(by_kind[k] for k in kinds):
        for k in kinds:
            if by_kind[k]:
                order.append(by_kind[k].pop())

    wall = max(10.0, 2 * suite_s + 5)
    stable_keys = {junit_key(t): t for t in stable}
    tasks, per_func, tried = [], {}, 0
    texts = {}

    stable_set = set(stable)

    def reaching(m):
        """The stable tests that run a line of the mutant (None: unknown)."""
        if cov is None:
            return None
        per_line = cov["lines"].get(m["file"], {})
        hit = set()
        for n in range(m["start"], m["end"] + 1):
            hit.update(per_line.get(str(n), ()))
        return sorted(t for t in (cov["tests"][i] for i in hit) if t in stable_set)

    def try_one(m, wdir, run):
        text = texts.setdefault(m["file"], (repo / m["file"]).read_text())
        mutated = apply_mutation(text, m)
        if mutated is None:
            return m, None, "no change or not valid Python"
        f = wdir / m["file"]
        f.write_text(mutated)
        # pytest resolves each node id on its own: past a hundred ids, the
        # files holding them are faster to run whole.
        if run is None:
            args_ = tests
        elif len(run) <= 100:
            args_ = run
        else:
            args_ = sorted({t.split("::")[0] for t in run})
        try:
            r = run_tests(ctx, wdir, args_, wall)
        finally:
            f.write_text(text)
            own(f)
        if r is None:
            return m, None, "timed out or crashed"
        status, ftext, _ = r
        # Tests that do not reach the mutant's lines run as before.
        checked = stable_keys if run is None else {junit_key(t): t for t in run}
        fails = [t for k, t in checked.items() if status.get(k) != "passed"]
        if not fails:
            return m, None, "no test fails"
        if len(fails) > 20:
            return m, None, "over 20 tests fail"
        if any(status.get(k) not in ("failed", "error") for k in (junit_key(t) for t in fails)):
            return m, None, "a stable test was skipped or not run"
        return m, (mutated, fails, ftext), None

    t_mut = time.time()
    reasons = collections.Counter()
    order_it = iter(order)
    exhausted = False

    def take(in_flight):
        nonlocal tried, exhausted
        while not exhausted and len(tasks) + in_flight < args.tasks_per_package:
            m = next(order_it, None)
            if m is None:
                exhausted = True
                break
            if per_func.get((m["file"], m["func"]), 0) >= 2:
                continue
            run = reaching(m)
            if run is not None and not run:
                reasons["no test reaches it"] += 1
                continue
            if tried >= args.max_candidates or time.time() - t_mut > args.package_seconds:
                exhausted = True
                break
            tried += 1
            return m, run
        return None

    def done(result):
        m, ok, why = result
        if ok is None:
            reasons[why] += 1
        elif len(tasks) < args.tasks_per_package and per_func.get((m["file"], m["func"]), 0) < 2:
            per_func[(m["file"], m["func"])] = per_func.get((m["file"], m["func"]), 0) + 1
            tasks.append((m, ok))

    on_copies(repo, args.jobs, f"arbor-swe-{name}-w", take,
              lambda item, d: try_one(item[0], d, item[1]), done)

    # PASS_TO_PASS samples: half from the failing tests' files, half from
    # the rest.
    chosen = []
    for m, (mutated, fails, ftext) in sorted(tasks, key=lambda t: (t[0]["file"], t[0]["start"], t[0]["kind"])):
        fail_set = set(fails)
        rest = [t for t in stable if t not in fail_set]
        fail_files = {t.split("::")[0] for t in fails}
        near = [t for t in rest if t.split("::")[0] in fail_files]
        far = [t for t in rest if t.split("::")[0] not in fail_files]
        rng.shuffle(near)
        rng.shuffle(far)
        half = args.p2p // 2
        p2p = near[:half] + far[: args.p2p - min(half, len(near))]
        chosen.append((m, mutated, sorted(fails), sorted(p2p[: args.p2p]), ftext))

    # The selection alone on the original tree, as evaluation runs it: a
    # test that passed in the full suite may need an earlier test's side
    # effects. Such PASS_TO_PASS tests are dropped; a task whose
    # FAIL_TO_PASS test fails there is dropped.
    def alone(item, wdir):
        m, mutated, fails, p2p, ftext = item
        r = run_tests(ctx, wdir, fails + p2p, wall)
        if r is None:
            return item, None
        status = r[0]
        if any(status.get(junit_key(t)) != "passed" for t in fails):
            return item, None
        return (m, mutated, fails, [t for t in p2p if status.get(junit_key(t)) == "passed"], ftext), True

    checked = []
    chosen_it = iter(chosen)

    def kept(result):
        item, ok = result
        if ok:
            checked.append(item)
        else:
            reasons["FAIL_TO_PASS fails alone on the original"] += 1

    on_copies(repo, args.jobs, f"arbor-swe-{name}-c", lambda _: next(chosen_it, None), alone, kept)
    dropped_p2p = sum(len(c[3]) for c in chosen) - sum(len(c[3]) for c in checked)

    # Commit each mutant on its own ref; write instances.
    instances = []
    checked.sort(key=lambda t: (t[0]["file"], t[0]["start"], t[0]["kind"]))
    for k, (m, mutated, fails, p2p, ftext) in enumerate(checked):
        iid = f"{name}-{version}-{k:03d}-{m['kind']}"
        git(repo, "checkout", "-q", "--detach", base)
        (repo / m["file"]).write_text(mutated)
        git(repo, "commit", "-q", "--no-verify", "-am", "task")
        commit = git(repo, "rev-parse", "HEAD")
        git(repo, "update-ref", f"refs/tasks/{iid}", commit)
        patch = git(repo, "diff", commit, base, raw=True)
        git(repo, "checkout", "-q", "-f", "main")
        fail_files = {t.split("::")[0] for t in fails}
        first = ftext.get(junit_key(fails[0]), "")
        instances.append({
            "instance_id": iid,
            "repo": f"pypi/{name}",
            "base_commit": commit,
            "problem_statement": statement(name, len(fails), len(fail_files), first),
            "patch": patch,
            "test_patch": "",
            "FAIL_TO_PASS": fails,
            "PASS_TO_PASS": p2p,
            "mutation": {"kind": m["kind"], "file": m["file"], "function": m["func"],
                         "lines": [m["start"], m["end"]]},
        })
    git(repo, "gc", "-q", "--prune=now", check=False)
    spec = {
        "test_cmd": " ".join(shlex.quote(a) for a in [*PYTEST_ARGV, "-q", "--tb=short", "-rN", *extra])
                    + " --junitxml={report} {tests}",
        "log": "junit",
        "env": f"envs/{name}",
        "env_vars": {"PYTHONPATH": pythonpath},
        "restore": tests,
        # Only the package source carries the agent's changes into the run
        # (a root `pytest.py` or `conftest.py` cannot change it), and a
        # skipped or xfail test is a failure: every selected test passes on
        # the fixed tree.
        "keep": sorted({Path(f).parts[0] for f in sources}),
        "strict": True,
    }
    info = {
        "package": name, "version": version, "sdist": sdist.name, "sdist_sha256": sha,
        "url": link, "base_commit": base, "tests_collected": len(ids), "tests_stable": len(stable),
        "tests_flaky": flaky, "suite_seconds": round(suite_s, 2), "environment": dists,
        "coverage": cov is not None, "mutants_found": len(cands), "mutants_tried": tried, "tasks": len(instances),
        "rejected": dict(reasons), "pass_to_pass_dropped": dropped_p2p, "seconds": round(time.time() - t0, 1),
    }
    log(f"{name}: {len(instances)} tasks from {tried} mutants tried ({len(cands)} found) in "
        f"{info['seconds']} s; rejected: {dict(reasons)}")
    return instances, spec, info


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--packages", default=",".join(DEFAULT_PACKAGES),
                    help=f"comma-separated, from: {', '.join(PACKAGES)}")
    ap.add_argument("--tasks-per-package", type=int, default=70)
    ap.add_argument("--max-candidates", type=int, default=200, help="mutants tried per package at most")
    ap.add_argument("--p2p", type=int, default=30, help="PASS_TO_PASS tests sampled per task")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--suite-timeout", type=float, default=300.0)
    ap.add_argument("--package-seconds", type=float, default=100.0,
                    help="no new mutant run starts after this long in one package's mutant phase")
    ap.add_argument("--unsandboxed", action="store_true", help="run the tests without bubblewrap")
    a = ap.parse_args()
    names = [p.strip() for p in a.packages.split(",") if p.strip()]
    unknown = [p for p in names if p not in PACKAGES]
    if unknown:
        sys.exit(f"unknown package(s) {', '.join(unknown)}; known: {', '.join(PACKAGES)}")
    if not a.unsandboxed and bwrap_path() is None:
        sys.exit("bubblewrap (bwrap) is not installed; install it or pass --unsandboxed")
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    all_inst, specs, infos, skipped = [], {}, [], {}
    for name in names:
        try:
            inst, spec, info = build_package(name, a, a.out, a.seed)
        except Skip as e:
            log(f"{name}: skipped: {e}")
            skipped[name] = str(e)
            continue
        except Exception as e:  # noqa: BLE001 - one package never stops the build
            why = f"unexpected {type(e).__name__}: {e}"
            log(f"{name}: skipped: {why}")
            skipped[name] = why
            continue
        all_inst += inst
        specs[f"pypi/{name}"] = spec
        infos.append(info)
    with open(a.out / "candidates.jsonl", "w") as f:
        for i in all_inst:
            f.write(json.dumps(i) + "\n")
    (a.out / "specs.json").write_text(json.dumps(specs, indent=1) + "\n")
    manifest = {
        "builder": "scripts/swe_build.py", "seed": a.seed, "pytest": PYTEST,
        "python": subprocess.run(["/usr/bin/python3", "--version"], capture_output=True, text=True).stdout.strip(),
        "sandboxed": not a.unsandboxed, "packages": infos, "skipped": skipped,
        "candidates": len(all_inst), "seconds": round(time.time() - t0, 1),
        "tasks": [{"instance_id": i["instance_id"], **i["mutation"]} for i in all_inst],
    }
    (a.out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    log(f"{len(all_inst)} candidate tasks from {len(infos)} packages in {manifest['seconds']} s"
        + (f"; skipped: {', '.join(skipped)}" if skipped else ""))
    if not all_inst:
        sys.exit(1 if skipped else 0)


if __name__ == "__main__":
    main()
