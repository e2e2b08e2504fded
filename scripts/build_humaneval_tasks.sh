#!/usr/bin/env bash
# Builds the HumanEval-derived SWE tasks (../shared/data/code/humaneval) and
# checks every one in the sandbox: the buggy repository scores 0 and the
# canonical fix (the gold patch) scores 1.
#   scripts/build_humaneval_tasks.sh [OUT_DIR] [extra args, e.g. --unsandboxed]
# Output: OUT_DIR/instances.jsonl (SWE-bench format + test_cmd) and
# OUT_DIR/repos/<instance_id>/solution.py. Use them with
#   arbor replay --task swe:OUT_DIR/instances.jsonl#humaneval-0 --trajectory T
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-target/humaneval-tasks}"
shift || true
cargo run --release -q -p arbor-env --example humaneval_tasks -- --out "$out" "$@"
