#!/usr/bin/env bash
# Arbor's engine vs HF transformers, side by side: `arbor bench generate|fork`
# and scripts/bench_hf_generate.py alternate (Arbor, then HF, per scenario and
# dtype) for ROUNDS rounds, since a shared VM's speed drifts within minutes.
# Prints one line per run and a markdown table of ratios.
#
#   scripts/bench_engine_vs_hf.sh [ROUNDS=2] [DTYPES="f32 bf16"]
#
# Needs a release build (cargo build --release) and a Python with torch and
# transformers (set PYTHON, or PYTHONPATH for a `pip install --target` dir).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-2}
DTYPES=${2:-"f32 bf16"}
PYTHON=${PYTHON:-python3}
ARBOR=${ARBOR:-target/release/arbor}
[ -x "$ARBOR" ] || { echo "no $ARBOR: run cargo build --release" >&2; exit 1; }
out=$(mktemp)
field='import json,sys; j=json.load(sys.stdin); print(round(j["generated_tokens_per_s"],1), round(j["peak_rss_mib"]), j["threads"])'
for r in $(seq "$ROUNDS"); do
  for b in generate fork; do
    for d in $DTYPES; do
      a=$("$ARBOR" bench "$b" --dtype "$d" --json | "$PYTHON" -c "$field")
      # HF gets Arbor's thread count, and must report it back.
      t=${a##* }
      a=${a% *}
      h=$("$PYTHON" scripts/bench_hf_generate.py "$b" --dtype "$d" --threads "$t" | "$PYTHON" -c "$field")
      [ "${h##* }" = "$t" ] || { echo "thread counts differ: Arbor $t, HF ${h##* }" >&2; exit 1; }
      h=${h% *}
      echo "round $r $b $d arbor $a hf $h" | tee -a "$out"
    done
  done
done
"$PYTHON" - "$out" <<'PY'
import sys, collections
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    f = line.split()
    runs[(f[2], f[3])].append((float(f[5]), float(f[8])))
print("\n| scenario | dtype | Arbor tokens/s | HF tokens/s | ratio |\n|---|---|---|---|---|")
for (b, d), v in runs.items():
    a = " / ".join(f"{x:.1f}" for x, _ in v)
    h = " / ".join(f"{y:.1f}" for _, y in v)
    q = " / ".join(f"{x / y:.2f}x" for x, y in v)
    print(f"| {b} | {d} | {a} | {h} | {q} |")
PY
rm -f "$out"
