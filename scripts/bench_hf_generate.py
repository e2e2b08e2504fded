#!/usr/bin/env python3
"""The HF transformers peer of `arbor bench generate` and `arbor bench fork`.

Builds a random-weight model of the same shape as Arbor's `--preset`
(SmolLM2-135M by default: Llama, 30 layers, hidden 576, 9/3 heads, vocab
49152, tied; or Qwen3-0.6B / Qwen3-4B) on the CPU or a GPU, feeds it the
same prompt tokens Arbor's bench uses, and times `model.generate` with the
KV cache: greedy with a fixed number of new tokens for `generate`; one prompt
with `num_return_sequences=N` sampled continuations for `fork`.

On a GPU (`--device cuda`) the default `--cache auto` tries transformers'
static cache with `torch.compile` (the fastest way transformers generates)
and falls back to the default dynamic cache when that fails; the JSON says
which ran (`cache`, `compiled`, and `fallback` with the reason). Each batch
size is warmed up once (compilation included) before it is timed, and
`ms_per_step` is the decode time per new token: (time of the job - time of
the same job with one new token) / (new tokens - 1).
`--dtype bf16` runs the model in torch's bf16 (the peer of `arbor bench
... --dtype bf16`, whose weights are bf16 too); `--dtype f32-bf16w` computes
in f32 on weights rounded to bf16 (the same model as `--dtype bf16`, at f32
cost). Prints JSON
with generated tokens/s and peak RSS, comparable field by field with
`arbor bench ... --json`.

    python scripts/bench_hf_generate.py generate --batch 32 --prompt-len 64 --max-tokens 128
    python scripts/bench_hf_generate.py fork --n 8 --prompt-len 512 --max-tokens 128
    python scripts/bench_hf_generate.py generate --device cuda --preset qwen3-0.6b \
        --dtype bf16 --batch 1,64 --prompt-len 128 --max-tokens 256 --json-lines
"""
import argparse
import json
import os
import resource
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM


def smollm2_135m():
    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                       num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                       head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                       max_position_embeddings=8192, tie_word_embeddings=True,
                       bos_token_id=0, eos_token_id=0)


def qwen3(hidden, inter, layers, heads):
    """A Qwen3 shape (Arbor's `ModelConfig::qwen3_0_6b` / `qwen3_4b`)."""
    return Qwen3Config(vocab_size=151936, hidden_size=hidden, intermediate_size=inter,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=8,
                       head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
                       max_position_embeddings=40960, tie_word_embeddings=True,
                       bos_token_id=151643, eos_token_id=151645)


PRESETS = {
    "smollm2-135m": (smollm2_135m, LlamaForCausalLM),
    "qwen3-0.6b": (lambda: qwen3(1024, 3072, 28, 16), Qwen3ForCausalLM),
    "qwen3-4b": (lambda: qwen3(2560, 9728, 36, 32), Qwen3ForCausalLM),
}


def bench_prompt(length, salt, vocab):
    """Same tokens as Arbor's `bench_prompt` (src/bench.rs)."""
    m = 2 ** 64
    return [(((i + salt * 7919) % m) * 2654435761 % m) % (vocab - 10) + 10 for i in range(length)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bench", choices=["generate", "fork"])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="smollm2-135m")
    ap.add_argument("--batch", default="32",
                    help="prompts in the batch; a comma-separated list runs each size in turn")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=None,
                    help="tokens per prompt (default: Arbor's, 64 for generate, 512 for fork)")
    ap.add_argument("--max-tokens", type=int, default=128)
    # The CPUs this process may run on (taskset, cgroups' cpusets). Rust's
    # available_parallelism, Arbor's default, also heeds a cgroup CPU quota
    # (docker --cpus): scripts/bench_engine_vs_hf.sh passes Arbor's count.
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    ap.add_argument("--threads", type=int, default=cpus)
    ap.add_argument("--dtype", choices=["f32", "bf16", "f32-bf16w"], default="f32")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--cache", choices=["auto", "dynamic", "static"], default="auto",
                    help="auto: static + torch.compile on a GPU (dynamic if that fails), "
                         "dynamic on the CPU")
    ap.add_argument("--json-lines", action="store_true", help="one compact JSON line per run")
    a = ap.parse_args()
    if a.prompt_len is None:
        a.prompt_len = 64 if a.bench == "generate" else 512
    batches = [int(b) for b in a.batch.split(",") if b.strip()]
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    dev = torch.device(a.device)
    make_cfg, cls = PRESETS[a.preset]
    cfg = make_cfg()
    with dev:
        if a.dtype == "bf16":
            # Built in bf16, so the peak RSS never holds f32 weights (Arbor's
            # random weights are made in the target dtype, a matrix at a time).
            torch.set_default_dtype(torch.bfloat16)
            model = cls(cfg).eval()
            torch.set_default_dtype(torch.float32)
        else:
            model = cls(cfg).float().eval()
    if a.dtype == "f32-bf16w":
        model = model.to(torch.bfloat16).float()
    cuda = dev.type == "cuda"
    state = {"static": a.cache == "static" or (a.cache == "auto" and cuda), "compiled": False,
             "fallback": None, "eager": model.forward}
    if state["static"] and cuda:
        # Compiled once; each batch size's warm-up compiles its shapes.
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        state["compiled"] = True
    for batch in batches:
        run(a, model, cfg, dev, batch, state)


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def run(a, model, cfg, dev, batch, state):
    if a.bench == "generate":
        ids = torch.tensor([bench_prompt(a.prompt_len, i, cfg.vocab_size) for i in range(batch)])
        kw = dict(do_sample=False)
        seqs = batch
    else:
        ids = torch.tensor([bench_prompt(a.prompt_len, 1, cfg.vocab_size)])
        kw = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, num_return_sequences=a.n)
        seqs = a.n
    ids = ids.to(dev)
    attn = torch.ones_like(ids)

    def generate(new, static):
        extra = dict(cache_implementation="static") if static else {}
        with torch.inference_mode():
            sync(dev)
            start = time.time()
            out = model.generate(ids, attention_mask=attn, max_new_tokens=new,
                                 min_new_tokens=new, pad_token_id=0, **kw, **extra)
            sync(dev)
            return out, time.time() - start

    if state["static"]:
        try:
            generate(a.max_tokens, True)  # warm-up (compiles on a GPU)
        except Exception as e:  # noqa: BLE001 - any failure means the dynamic cache
            msg = str(e).splitlines()[0] if str(e) else ""
            state["fallback"] = f"{type(e).__name__}: {msg}"[:300]
            state["static"], state["compiled"] = False, False
            model.forward = state["eager"]
    static, compiled, fallback = state["static"], state["compiled"], state["fallback"]
    if not static and dev.type == "cuda":
        generate(min(a.max_tokens, 8), False)  # warm-up
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    out, secs = generate(a.max_tokens, static)
    _, first = generate(1, static) if a.max_tokens > 1 else (None, secs)
    gen = (out.shape[1] - ids.shape[1]) * out.shape[0]
    r = {
        "bench": a.bench, "peer": "transformers", "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "model": a.preset, "weights": "random", "dtype": a.dtype, "device": a.device,
        "cache": "static" if static else "dynamic", "compiled": compiled,
        "threads": torch.get_num_threads(), "sequences": seqs, "prompt_len": a.prompt_len,
        "new_tokens": a.max_tokens, "seconds": secs, "generated_tokens": gen,
        "generated_tokens_per_s": gen / secs,
        "ms_per_step": (secs - first) * 1e3 / max(a.max_tokens - 1, 1),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    if fallback:
        r["fallback"] = fallback
    if dev.type == "cuda":
        r["peak_device_mib"] = torch.cuda.max_memory_allocated() / 2**20
    print(json.dumps(r) if a.json_lines else json.dumps(r, indent=1), flush=True)


if __name__ == "__main__":
    main()
