#!/usr/bin/env bash
# The one GPU check. Two halves, picked by where it runs:
#
#   scripts/gpu-check.sh build   (here, no GPU needed) installs the CUDA 13.0
#       toolchain from PyPI (scripts/cuda-toolchain.sh), builds
#       `cargo build --release --features cuda`, strips the binary and packs
#       it as dist/arbor-cuda.xz (the GPU machine needs no Rust); then the
#       same with `--features nccl` (in its own target folder, `nccl/`
#       under it) as dist/arbor-nccl.xz, for the data-parallel check.
#   scripts/gpu-check.sh run     (on the GPU machine) unpacks that binary,
#       finds the CUDA libraries there (pip's nvidia-* packages of the
#       machine's Python, or a CUDA toolkit, or the driver's folder), runs
#       `arbor check-device`, then the generation benchmarks (Qwen3-0.6B
#       and 4B shapes, the GPU overhead cuts one by one, the fork workload)
#       and their transformers peer (scripts/bench_hf_generate.py), then a
#       few RL steps of `arbor train configs/gpu-smoke.toml` on the GPU,
#       then the learner step against PyTorch (scripts/bench_hf_train.py),
#       then the smoke run data-parallel (two ranks sharing the GPU, NCCL)
#       against one rank (scripts/dp_compare.py), and writes everything
#       under $OUT (default ./gpu-check-out): check-device.json/.txt,
#       generate-*.jsonl, fork-*.json, generate-peer.jsonl,
#       generate-table.md, gpu-smoke.txt and the run directory gpu-smoke/,
#       bench-step.json, bench-train.jsonl, dp-compare.json with the runs
#       dp-1/ and dp-2/, nvidia-smi.txt.
#
# With no argument: `run` where nvidia-smi sees a GPU, else `build`.
# dist/ is git-ignored: copy it to the GPU machine along with the working
# tree.
# On your own GPU box with Rust installed, `scripts/gpu-check.sh build &&
# scripts/gpu-check.sh run` does both.
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-}"
if [ -z "$mode" ]; then
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then mode=run; else mode=build; fi
fi
shift || true

case "$mode" in
build)
  eval "$(scripts/cuda-toolchain.sh)"
  cargo build --release --features cuda
  mkdir -p dist
  strip -o dist/arbor-cuda "${CARGO_TARGET_DIR:-target}/release/arbor"
  # Only the .xz stays: the stripped binary alone is about 64 MiB, the
  # compressed one a fraction of that to copy.
  xz -T0 -6 -f dist/arbor-cuda
  ls -l dist/arbor-cuda.xz >&2
  # NCCL changes candle's features: its own target folder keeps both builds
  # incremental.
  nccl_target="${CARGO_TARGET_DIR:-target}/nccl"
  CARGO_TARGET_DIR="$nccl_target" cargo build --release --features nccl
  strip -o dist/arbor-nccl "$nccl_target/release/arbor"
  xz -T0 -6 -f dist/arbor-nccl
  ls -l dist/arbor-nccl.xz >&2
  echo "built dist/arbor-cuda.xz and dist/arbor-nccl.xz; on the GPU machine: scripts/gpu-check.sh run" >&2
  ;;
run)
  OUT="${OUT:-$PWD/gpu-check-out}"
  mkdir -p "$OUT"
  # dist/NAME from dist/NAME.xz, if packed.
  unpack() {
    if [ ! -x "dist/$1" ] && [ -f "dist/$1.xz" ]; then
      if command -v xz >/dev/null; then
        xz -d -k -c "dist/$1.xz" > "dist/$1"
      else
        python3 -c 'import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
          "dist/$1.xz" "dist/$1"
      fi
      chmod +x "dist/$1"
    fi
  }
  bin=dist/arbor-cuda
  unpack arbor-cuda
  unpack arbor-nccl
  if [ ! -x "$bin" ]; then
    if [ -x target/release/arbor ]; then
      bin=target/release/arbor
    else
      echo "gpu-check: no dist/arbor-cuda(.xz); run 'scripts/gpu-check.sh build' first" >&2
      exit 1
    fi
  fi
  # CUDA runtime libraries: cuBLAS, cuBLASLt, cuRAND, NVRTC, cudart (13.x).
  libs=""
  for py in python3 /opt/torch/.venv/bin/python3; do
    command -v "$py" >/dev/null 2>&1 || continue
    site="$("$py" -c 'import site,sys; print("\n".join(site.getsitepackages()))' 2>/dev/null || true)"
    for s in $site; do
      for d in "$s"/nvidia/cu13/lib "$s"/nvidia/*/lib; do
        [ -d "$d" ] && libs="$libs:$d"
      done
    done
  done
  for d in ${CUDA_HOME:+"$CUDA_HOME/lib64"} /usr/local/cuda/lib64 /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu; do
    [ -d "$d" ] && libs="$libs:$d"
  done
  export LD_LIBRARY_PATH="${libs#:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
  missing="$(ldd "$bin" | grep "not found" || true)"
  if [ -n "$missing" ]; then
    echo "gpu-check: libraries not found (LD_LIBRARY_PATH=$LD_LIBRARY_PATH):" >&2
    echo "$missing" >&2
    exit 1
  fi
  set +e
  # The kernel, model, training-step and benchmark checks (table last; the
  # JSON is rewritten after every section, so a run cut short keeps what it
  # measured).
  "$bin" check-device --json "$OUT/check-device.json" "$@" 2>&1 | tee "$OUT/check-device.txt"
  rc=${PIPESTATUS[0]}
  # Generation, Qwen3 shapes with random weights in bf16, 128-token prompts:
  # the batch sweep (its first run is the fresh process's), each GPU
  # overhead cut measured one by one at B=64 (all off, then each turned on
  # in turn; ARBOR_GPU_OFF), the 4B shape, the fork workload (1 prompt of
  # 1,024 tokens x 16 samples); then the transformers peer on the same GPU
  # and shapes; then one table (generate-table.md).
  gen="$bin bench generate --device cuda --dtype bf16 --prompt-len 128"
  timeout 150 $gen --preset qwen3-0.6b --max-tokens 256 --batch 1,64,256 --json \
    > "$OUT/generate-qwen3-0.6b.jsonl" 2> "$OUT/generate.err"
  echo "gpu-check: generate sweep exit $?"
  off="events,pool,detach,sync,upload,sampling,fused,graphs"
  : > "$OUT/generate-cuts.jsonl"
  for cut in none events pool detach sync upload sampling fused graphs; do
    if [ "$cut" != none ]; then
      off="$(printf '%s' "$off" | tr ',' '\n' | grep -vx "$cut" | paste -sd, -)"
    fi
    ARBOR_GPU_OFF="$off" timeout 45 $gen --preset qwen3-0.6b --max-tokens 32 --batch 64,64 --json \
      2>> "$OUT/generate.err" | tail -1 >> "$OUT/generate-cuts.jsonl"
  done
  timeout 120 $gen --preset qwen3-4b --max-tokens 128 --batch 64,64 --json 2>> "$OUT/generate.err" \
    | tail -1 > "$OUT/generate-qwen3-4b.jsonl"
  # An f32 policy rolled out through the bf16 step, as training does with
  # bf16_rollouts: its weight copy's refresh is weight_refresh_ms.
  timeout 60 "$bin" bench generate --device cuda --dtype f32 --bf16-rollouts --preset qwen3-0.6b \
    --prompt-len 128 --max-tokens 64 --batch 64 --json > "$OUT/generate-f32-bf16-rollouts.json" \
    2>> "$OUT/generate.err"
  timeout 60 "$bin" bench fork --device cuda --dtype bf16 --preset qwen3-0.6b --n 16 \
    --prompt-len 1024 --max-tokens 256 --json > "$OUT/fork-qwen3-0.6b.json" 2>> "$OUT/generate.err"
  peer=""
  for py in /opt/torch/.venv/bin/python3 python3; do
    if command -v "$py" >/dev/null 2>&1 && "$py" -c 'import torch, transformers' 2>/dev/null; then peer="$py"; break; fi
  done
  if [ -n "$peer" ]; then
    timeout 180 "$peer" scripts/bench_hf_generate.py generate --device cuda --preset qwen3-0.6b \
      --dtype bf16 --batch 64,1 --prompt-len 128 --max-tokens 256 --json-lines \
      > "$OUT/generate-peer.jsonl" 2> "$OUT/generate-peer.err"
    echo "gpu-check: transformers generate peer exit $?"
  fi
  python3 scripts/gpu_generate_table.py "$OUT" || true
  # A few RL steps of the real trainer with everything on the GPU.
  "$bin" train configs/gpu-smoke.toml --out "$OUT/gpu-smoke" > "$OUT/gpu-smoke.txt" 2>&1
  rc_train=$?
  echo "gpu-check: arbor train configs/gpu-smoke.toml exit $rc_train (log: $OUT/gpu-smoke.txt)"
  tail -12 "$OUT/gpu-smoke.txt"
  # The whole RL step on one GPU (Qwen3-0.6B shape, random weights, 8
  # prompts x 8 samples, 128 + 256 tokens): generation (bf16 rollouts of the
  # f32 policy), value pass, update in mixed precision and weight sync,
  # generated and trained tokens/s.
  timeout 120 "$bin" bench step --device cuda --preset qwen3-0.6b --bf16-rollouts --precision bf16 --prompts 8 \
    --samples 8 --prompt-len 128 --response-len 256 --steps 1 --json > "$OUT/bench-step.json" \
    2> "$OUT/bench-step.err"
  echo "gpu-check: bench step exit $? (bench-step.json)"
  # The learner step (forward, backward, AdamW) against PyTorch eager, HF
  # model + torch AdamW, Qwen3-0.6B shape, 8 x 1,024 tokens: arbor in mixed
  # precision (bf16 over f32 master weights) against torch autocast (the
  # same), then arbor and torch in f32, then torch all-bf16. One JSON line
  # per engine.
  if [ -n "$peer" ]; then
    timeout 150 "$peer" scripts/bench_hf_train.py --device cuda --preset qwen3-0.6b --batch 8 --seq 1024 \
      --dtype amp --peak-tflops 989 --arbor "$bin" --json > "$OUT/bench-train.jsonl" 2> "$OUT/bench-train.err"
    timeout 150 "$peer" scripts/bench_hf_train.py --device cuda --preset qwen3-0.6b --batch 8 --seq 1024 \
      --dtype f32 --peak-tflops 989 --arbor "$bin" --json >> "$OUT/bench-train.jsonl" 2>> "$OUT/bench-train.err"
    timeout 90 "$peer" scripts/bench_hf_train.py --device cuda --preset qwen3-0.6b --batch 8 --seq 1024 \
      --dtype bf16 --peak-tflops 989 --arbor '' --json >> "$OUT/bench-train.jsonl" 2>> "$OUT/bench-train.err"
    echo "gpu-check: learner step vs PyTorch (bench-train.jsonl):"
    cat "$OUT/bench-train.jsonl"
  else
    echo "gpu-check: no python with torch and transformers; learner-step peer skipped"
  fi
  # Data parallelism over NCCL: the smoke run on two ranks sharing this GPU
  # (`--ranks 2`: each rank names its own NCCL host) against one rank, the
  # same config and seeds; dp-compare.json has both runs' metrics per step,
  # their largest differences and the all-reduce time per step.
  nbin=dist/arbor-nccl
  nmissing="$( [ -x "$nbin" ] && ldd "$nbin" | grep "not found" || true)"
  if [ -x "$nbin" ] && [ -z "$nmissing" ]; then
    timeout 150 "$nbin" train configs/gpu-smoke.toml --out "$OUT/dp-1" > "$OUT/dp-1.txt" 2>&1
    echo "gpu-check: one-rank smoke run exit $?"
    ARBOR_DIST_TIMEOUT_S=120 timeout 200 "$nbin" train configs/gpu-smoke.toml --out "$OUT/dp-2" \
      --ranks 2 > "$OUT/dp-2.txt" 2>&1
    echo "gpu-check: two-rank (NCCL) smoke run exit $? (log: $OUT/dp-2.txt)"
    tail -5 "$OUT/dp-2.txt"
    python3 scripts/dp_compare.py "$OUT/dp-1" "$OUT/dp-2" > "$OUT/dp-compare.json"
    echo "gpu-check: dp compare exit $? (dp-compare.json)"
  else
    echo "gpu-check: no runnable dist/arbor-nccl ($nmissing); data-parallel check skipped"
  fi
  set -e
  [ "$rc" = 0 ] && rc=$rc_train
  echo "gpu-check: exit $rc; results in $OUT" >&2
  exit "$rc"
  ;;
*)
  echo "usage: scripts/gpu-check.sh [build|run] [check-device flags]" >&2
  exit 2
  ;;
esac
