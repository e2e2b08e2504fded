#!/usr/bin/env python3
"""Compare two `arbor train` runs of one config step by step: a one-rank run
and a data-parallel one (scripts/gpu-check.sh runs the GPU smoke config on
one rank and on two ranks sharing the GPU over NCCL).

    python3 scripts/dp_compare.py ONE_RANK_DIR N_RANK_DIR > dp-compare.json

Prints one JSON object: each step's metrics from both runs, the largest
absolute and relative difference of each metric over the steps, whether the
two runs generated the same number of tokens at every step (the rollouts
followed the same samples), and the N-rank run's gradient all-reduce time
per step.
"""

import json
import sys
from pathlib import Path

KEYS = [
    "generated_tokens",
    "trained_tokens",
    "continuations",
    "reward",
    "pass_rate",
    "policy_loss",
    "value_loss",
    "grad_norm",
    "critic_grad_norm",
    "eval_pass_rate",
]


def metrics(run: Path) -> list:
    path = run / "metrics.jsonl"
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    one, many = (Path(a) for a in sys.argv[1:])
    try:
        a, b = metrics(one), metrics(many)
    except (OSError, json.JSONDecodeError) as e:
        print(json.dumps({"error": str(e)}))
        return 1
    steps = []
    worst = {k: {"abs": 0.0, "rel": 0.0} for k in KEYS}
    for x, y in zip(a, b):
        row = {"step": x.get("step")}
        for k in KEYS:
            p, q = x.get(k), y.get(k)
            row[k] = [p, q]
            if isinstance(p, (int, float)) and isinstance(q, (int, float)):
                d = abs(p - q)
                worst[k]["abs"] = max(worst[k]["abs"], d)
                worst[k]["rel"] = max(worst[k]["rel"], d / max(abs(p), 1e-12))
        row["time_all_reduce_s"] = y.get("time_all_reduce_s")
        steps.append(row)
    out = {
        "one_rank": str(one),
        "ranks": str(many),
        "steps_compared": len(steps),
        "same_generated_tokens": all(
            r["generated_tokens"][0] == r["generated_tokens"][1] for r in steps
        ),
        "largest_difference": worst,
        "all_reduce_s_per_step": [r["time_all_reduce_s"] for r in steps],
        "steps": steps,
    }
    print(json.dumps(out, indent=1))
    return 0 if len(a) == len(b) and steps else 1


if __name__ == "__main__":
    sys.exit(main())
