#!/usr/bin/env python3
"""The HF transformers peer of `arbor bench generate` and `arbor bench fork`.

Builds a random-weight model of the same shape (SmolLM2-135M: Llama, 30
layers, hidden 576, 9/3 heads, vocab 49152, tied) in f32 on CPU, feeds it the
same prompt tokens Arbor's bench uses, and times `model.generate` with the
KV cache: greedy with a fixed number of new tokens for `generate`; one prompt
with `num_return_sequences=N` sampled continuations for `fork`.
`--dtype bf16` runs the model in torch's bf16 (the peer of `arbor bench
... --dtype bf16`, whose weights are bf16 too); `--dtype f32-bf16w` computes
in f32 on weights rounded to bf16 (the same model as `--dtype bf16`, at f32
cost). Prints JSON
with generated tokens/s and peak RSS, comparable field by field with
`arbor bench ... --json`.

    python scripts/bench_hf_generate.py generate --batch 32 --prompt-len 64 --max-tokens 128
    python scripts/bench_hf_generate.py fork --n 8 --prompt-len 512 --max-tokens 128
"""
import argparse
import json
import os
import resource
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def smollm2_135m():
    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                       num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                       head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                       max_position_embeddings=8192, tie_word_embeddings=True,
                       bos_token_id=0, eos_token_id=0)


def bench_prompt(length, salt, vocab):
    """Same tokens as Arbor's `bench_prompt` (src/bench.rs)."""
    m = 2 ** 64
    return [(((i + salt * 7919) % m) * 2654435761 % m) % (vocab - 10) + 10 for i in range(length)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bench", choices=["generate", "fork"])
    ap.add_argument("--batch", type=int, default=32)
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
    a = ap.parse_args()
    if a.prompt_len is None:
        a.prompt_len = 64 if a.bench == "generate" else 512
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    cfg = smollm2_135m()
    if a.dtype == "bf16":
        # Built in bf16, so the peak RSS never holds f32 weights (Arbor's
        # random weights are made in the target dtype, a matrix at a time).
        torch.set_default_dtype(torch.bfloat16)
        model = LlamaForCausalLM(cfg).eval()
        torch.set_default_dtype(torch.float32)
    else:
        model = LlamaForCausalLM(cfg).float().eval()
    if a.dtype == "f32-bf16w":
        model = model.to(torch.bfloat16).float()
    if a.bench == "generate":
        ids = torch.tensor([bench_prompt(a.prompt_len, i, cfg.vocab_size) for i in range(a.batch)])
        kw = dict(do_sample=False)
        seqs = a.batch
    else:
        ids = torch.tensor([bench_prompt(a.prompt_len, 1, cfg.vocab_size)])
        kw = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, num_return_sequences=a.n)
        seqs = a.n
    attn = torch.ones_like(ids)
    with torch.inference_mode():
        start = time.time()
        out = model.generate(ids, attention_mask=attn, max_new_tokens=a.max_tokens,
                             min_new_tokens=a.max_tokens, pad_token_id=0, **kw)
        secs = time.time() - start
    gen = (out.shape[1] - ids.shape[1]) * out.shape[0]
    print(json.dumps({
        "bench": a.bench, "peer": "transformers", "torch": torch.__version__,
        "dtype": a.dtype,
        "threads": torch.get_num_threads(), "sequences": seqs, "prompt_len": a.prompt_len,
        "new_tokens": a.max_tokens, "seconds": secs, "generated_tokens": gen,
        "generated_tokens_per_s": gen / secs,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }, indent=1))


if __name__ == "__main__":
    main()
