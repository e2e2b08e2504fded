#!/usr/bin/env python3
"""Agreement of Arbor's math grader with PyPI `math-verify` on MATH-500.

Builds cases from the MATH-500 reference answers: each reference against
re-formatted variants that mean the same (dollar wrappers, spacing, \\dfrac,
a/b, decimals, thousands commas, \\left/\\right, `x =`, units in \\text{},
degrees, reordered tuples/sets) and against perturbed variants that do not
(a changed digit, a flipped sign). Both graders judge every (reference,
variant) pair; the script prints the agreement and lists every disagreement.

    python3 -m venv /work/venv/mathverify && /work/venv/mathverify/bin/pip install math-verify
    /work/venv/mathverify/bin/python scripts/math_verify_agreement.py \
        [--data ../shared/data/math/math500/test.jsonl] [--out target/math-verify]

Arbor's side runs `cargo run --release -p arbor-env --example math_grade`
(the same code as `arbor grade --json`).
"""
import argparse
import json
import os
import re
import subprocess
import sys
from collections import Counter, defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def top_level_split(s, sep=","):
    parts, depth, cur = [], 0, ""
    i = 0
    while i < len(s):
        c = s[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if depth == 0 and s.startswith(sep, i):
            parts.append(cur)
            cur = ""
            i += len(sep)
            continue
        cur += c
        i += 1
    parts.append(cur)
    return parts


INT = re.compile(r"^-?\d+$")
FRAC = re.compile(r"^(-?)\\d?frac\{(\d+)\}\{(\d+)\}$")


def terminating(p, q):
    while q % 2 == 0:
        q //= 2
    while q % 5 == 0:
        q //= 5
    return q == 1


THOUSANDS = re.compile(r"^-?\d{1,3}(,\d{3})+$")


def is_thousands(a):
    """`10,\\!080`, `\\$32,\\!348`, `58,500`: one number, not a list."""
    return bool(THOUSANDS.match(re.sub(r"\\!|\\\$|\s", "", a)))


def positives(a):
    """(variant kind, text) pairs equivalent to reference `a`."""
    spaced = a.replace("+", " + ") if is_thousands(a) else a.replace(",", ", ").replace("+", " + ")
    out = [("same", a), ("dollars", f"${a}$"), ("spaces", spaced)]
    if "\\frac" in a and "\\dfrac" not in a:
        out.append(("dfrac", a.replace("\\frac", "\\dfrac")))
    m = FRAC.match(a.strip())
    if m:
        sign, p, q = m.group(1), int(m.group(2)), int(m.group(3))
        out.append(("slash", f"{sign}{p}/{q}"))
        if terminating(p, q):
            out.append(("decimal", f"{sign}{p / q:.10g}"))
    if INT.match(a.strip()):
        n = int(a)
        out.append(("decimal", f"{n}.0"))
        if abs(n) >= 1000:
            out.append(("commas", f"{n:,}"))
        out.append(("x_eq", f"x = {n}"))
        out.append(("text_unit", f"{n} \\text{{ units}}"))
    if re.match(r"^\d+\^\\circ$", a.strip()):
        out.append(("degrees", a.replace("^\\circ", "")))
    s = a.strip()
    if s.startswith("(") and s.endswith(")") and "\\left" not in s:
        out.append(("left_right", "\\left" + s[:-1] + "\\right)"))
    if s.startswith("\\{") and s.endswith("\\}"):
        items = top_level_split(s[2:-2])
        if len(items) > 1:
            out.append(("set_order", "\\{" + ",".join(reversed(items)) + "\\}"))
    if "," in s and not is_thousands(s) and not s.startswith(("(", "[", "\\{", "\\left")) and len(top_level_split(s)) > 1:
        out.append(("list_order", ",".join(reversed(top_level_split(s)))))
    return out


def negatives(a):
    """(variant kind, text) pairs not equivalent to `a`."""
    out = []
    digits = [i for i, c in enumerate(a) if c.isdigit()]
    if digits:
        i = digits[-1]
        out.append(("neg_digit", a[:i] + str((int(a[i]) + 1) % 10) + a[i + 1:]))
    s = a.strip()
    if INT.match(s) and int(s) != 0 or FRAC.match(s):
        out.append(("neg_sign", s[1:] if s.startswith("-") else "-" + s))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=os.path.join(ROOT, "..", "shared", "data", "math", "math500", "test.jsonl"))
    ap.add_argument("--out", default=os.path.join(ROOT, "target", "math-verify"))
    args = ap.parse_args()
    try:
        from math_verify import parse, verify
    except ImportError:
        sys.exit("math-verify is not installed: pip install math-verify")

    refs = [json.loads(l)["answer"] for l in open(args.data) if l.strip()]
    cases = []
    for a in refs:
        for kind, v in positives(a):
            cases.append({"gold": a, "pred": v, "kind": kind, "expected": True})
        for kind, v in negatives(a):
            cases.append({"gold": a, "pred": v, "kind": kind, "expected": False})
    os.makedirs(args.out, exist_ok=True)
    cases_path = os.path.join(args.out, "cases.jsonl")
    with open(cases_path, "w") as f:
        for c in cases:
            f.write(json.dumps({"response": f"The final answer is $\\boxed{{{c['pred']}}}$.", "answer": c["gold"]}) + "\n")

    cmd = ["cargo", "run", "--release", "-q", "-p", "arbor-env", "--example", "math_grade", "--", cases_path]
    ours = [json.loads(l) for l in subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout.splitlines()]
    assert len(ours) == len(cases), (len(ours), len(cases))

    agree = 0
    per_kind = defaultdict(Counter)
    disagreements = []
    for c, o in zip(cases, ours):
        try:
            mv = bool(verify(parse(f"$\\boxed{{{c['gold']}}}$"), parse(f"$\\boxed{{{c['pred']}}}$")))
        except Exception as e:  # math-verify raising counts as "not equivalent"
            mv = False
        c["math_verify"] = mv
        c["arbor"] = o["correct"]
        per_kind[c["kind"]]["n"] += 1
        per_kind[c["kind"]]["arbor_right"] += c["arbor"] == c["expected"]
        per_kind[c["kind"]]["mv_right"] += mv == c["expected"]
        if mv == c["arbor"]:
            agree += 1
        else:
            per_kind[c["kind"]]["disagree"] += 1
            disagreements.append(c)

    n = len(cases)
    print(f"{len(refs)} reference answers, {n} cases ({sum(c['expected'] for c in cases)} equivalent, {sum(not c['expected'] for c in cases)} not)")
    print(f"agreement with math-verify: {agree}/{n} = {100 * agree / n:.2f}%")
    print(f"vs expected labels: arbor {sum(c['arbor'] == c['expected'] for c in cases)}/{n}, math-verify {sum(c['math_verify'] == c['expected'] for c in cases)}/{n}")
    print("per variant kind: n, disagreements, arbor right, math-verify right")
    for k, v in sorted(per_kind.items()):
        print(f"  {k:12s} {v['n']:5d} {v['disagree']:4d} {v['arbor_right']:5d} {v['mv_right']:5d}")
    print(f"disagreements ({len(disagreements)}):")
    for c in disagreements:
        print(f"  [{c['kind']}] gold={c['gold']!r} pred={c['pred']!r} expected={c['expected']} arbor={c['arbor']} math-verify={c['math_verify']}")
    with open(os.path.join(args.out, "disagreements.jsonl"), "w") as f:
        for c in disagreements:
            f.write(json.dumps(c) + "\n")


if __name__ == "__main__":
    main()
