#!/usr/bin/env python3
"""The training-step peer of `arbor bench train`: the same update in PyTorch.

An HF transformers model of the preset's shape (random weights) plus a
linear value head, on `batch` sequences of `seq` random tokens: forward,
token log-probabilities of every next token from the full logits, the
clipped PPO surrogate (token mean) + 0.5 x the value loss at every 16th
position, backward, torch AdamW. Prints tokens/s, the time of each phase
and peak memory (whole-process peak RSS on the CPU, torch's allocator peak
on CUDA).

--dtype: f32; bf16 (every parameter and activation bf16, plain torch
AdamW on bf16 weights); or amp (f32 parameters and AdamW state, forward
under torch.autocast to bf16, the loss in f32: mixed precision, the peer of
`arbor bench train --precision bf16`).

With --arbor (default target/release/arbor, when present) it first runs
`arbor bench train` with the same shape (f32 for --dtype f32, mixed bf16
for bf16 and amp) and prints both side by side.

    python scripts/bench_hf_train.py --preset smollm2-135m --batch 4 --seq 256
    python scripts/bench_hf_train.py --device cuda --dtype amp --preset qwen3-0.6b \
        --batch 8 --seq 1024 --arbor dist/arbor

Needs torch and transformers.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time

PRESETS = {
    "smollm2-135m": dict(
        arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True),
    "qwen3-0.6b": dict(
        arch="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=40960, tie_word_embeddings=True),
}


def build(preset, dtype, device, attn):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    p = dict(PRESETS[preset])
    arch = p.pop("arch")
    cfg = (LlamaConfig if arch == "llama" else Qwen3Config)(**p)
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype).to(device)
    head = torch.nn.Linear(cfg.hidden_size, 1, dtype=dtype, device=device)
    return cfg, model, head


def run_torch(a):
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "amp": torch.float32}[a.dtype]
    dev = torch.device(a.device)
    cfg, model, head = build(a.preset, dtype, dev, a.attn)
    amp = a.dtype == "amp"
    params = list(model.parameters()) + list(head.parameters())
    n_params = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=1e-6)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), generator=g).to(dev)
    adv = (torch.rand(a.batch, a.seq - 1, generator=g) * 2 - 1).to(dev)
    old = torch.full((a.batch, a.seq - 1), -float(torch.log(torch.tensor(cfg.vocab_size))), device=dev)
    vpos = torch.arange(0, a.seq, 16, device=dev)
    vtarget = torch.rand(a.batch, len(vpos), generator=g).to(dev)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def step():
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
            h = model.model(input_ids=ids).last_hidden_state
            logits = model.lm_head(h[:, :-1])
            v = head(h[:, vpos]).squeeze(-1)
        logits, v = logits.float(), v.float()
        lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        ratio = torch.exp(lp - old)
        pl = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()
        loss = pl + 0.5 * (0.5 * (v - vtarget) ** 2).mean()
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        return t1 - t0, t2 - t1, time.perf_counter() - t2

    step()  # warm-up
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    phases = [0.0, 0.0, 0.0]
    t0 = time.perf_counter()
    for _ in range(a.steps):
        for i, x in enumerate(step()):
            phases[i] += x
    step_s = (time.perf_counter() - t0) / a.steps
    tokens = a.batch * a.seq
    attn = 6.0 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * a.batch * a.seq * a.seq
    flops = 6.0 * n_params * tokens + attn
    achieved = flops / step_s / 1e12
    return dict(
        engine=f"pytorch {torch.__version__} + transformers ({a.attn} attention)",
        model=f"{a.preset} (random weights)",
        parameters=n_params,
        dtype=a.dtype,
        device=a.device,
        batch=a.batch,
        seq=a.seq,
        steps=a.steps,
        threads=torch.get_num_threads(),
        tokens_per_s=tokens / step_s,
        step_s=step_s,
        forward_s=phases[0] / a.steps,
        backward_s=phases[1] / a.steps,
        optimizer_s=phases[2] / a.steps,
        model_flops_per_step=flops,
        achieved_tflops=achieved,
        mfu=achieved / a.peak_tflops if a.peak_tflops else None,
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        device_peak_mib=torch.cuda.max_memory_allocated() / 2**20 if dev.type == "cuda" else None,
    )


def run_arbor(a):
    cmd = [a.arbor, "bench", "train", "--preset", a.preset, "--batch", str(a.batch),
           "--seq", str(a.seq), "--steps", str(a.steps), "--device", a.device, "--json",
           "--precision", "f32" if a.dtype == "f32" else "bf16"]
    if a.peak_tflops:
        cmd += ["--peak-tflops", str(a.peak_tflops)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="smollm2-135m", choices=sorted(PRESETS))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16", "amp"])
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--arbor", default="target/release/arbor",
                    help="arbor binary to run first ('' to skip)")
    ap.add_argument("--json", action="store_true", help="print one JSON line per engine")
    a = ap.parse_args()

    rows = []
    if a.arbor and os.path.exists(a.arbor):
        rows.append(run_arbor(a))
    rows.append(run_torch(a))
    if a.json:
        for r in rows:
            print(json.dumps(r))
        return
    keys = [("tokens/s", "tokens_per_s", "{:.1f}"), ("s per update", "step_s", "{:.3f}"),
            ("forward s", "forward_s", "{:.3f}"), ("backward s", "backward_s", "{:.3f}"),
            ("optimizer s", "optimizer_s", "{:.3f}"), ("model TFLOP/s", "achieved_tflops", "{:.3f}"),
            ("MFU", "mfu", "{:.1%}"), ("peak RSS MiB", "peak_rss_mib", "{:.0f}"),
            ("device peak MiB", "device_peak_mib", "{:.0f}"), ("threads", "threads", "{}")]
    print(f"{a.preset}, {a.batch} x {a.seq} tokens, {a.device}")
    print(f"{'':16}" + "".join(f"{r['engine'][:40]:>42}" for r in rows))
    for label, k, fmt in keys:
        vals = [r.get(k) for r in rows]
        print(f"{label:16}" + "".join(f"{(fmt.format(v) if v is not None else '-'):>42}" for v in vals))
    if len(rows) == 2:
        print(f"arbor / pytorch tokens/s: {rows[0]['tokens_per_s'] / rows[1]['tokens_per_s']:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
