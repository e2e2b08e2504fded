#!/usr/bin/env python3
"""Build the HF-transformers parity fixtures for arbor-model.

Creates tiny random Qwen2 (QKV biases, tied), Qwen3 (untied, head_dim !=
hidden/heads, q/k norms, sharded checkpoint) and Llama (GQA, tied, llama3
RoPE scaling) models with a deliberately non-trivial init (norm weights far
from 1, large weight scale so logits are not flat), saves them with
`save_pretrained(safe_serialization=True)`, and records transformers'
reference outputs:

  <name>/reference.json = {
    "sequences": [{"tokens", "logprobs" (f32), "greedy" (f32),
                   "logprobs_bf16", "greedy_bf16"}],
    "generate": [{"prompt", "greedy_tokens"}]   # HF greedy generate, 8 new tokens
  }

plus `chat/` with the real Qwen3 tokenizer_config.json and HF's renderings of
several conversations (and their token ids).

Usage (needs torch + transformers; CPU is fine):
    python scripts/make_fixtures.py [--out crates/arbor-model/tests/fixtures]
        [--tokenizer ../shared/data/tokenizers/qwen3]
"""
import argparse
import json
import os
import shutil

import torch
import transformers
from transformers import (AutoModelForCausalLM, AutoTokenizer, LlamaConfig,
                          Qwen2Config, Qwen3Config)

VOCAB = 320


def nontrivial_init(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=g) * (1.5 / fan_in ** 0.5))


def configs():
    common = dict(vocab_size=VOCAB, max_position_embeddings=256, bos_token_id=1,
                  eos_token_id=2, rms_norm_eps=1e-6)
    qwen2 = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2,
                        tie_word_embeddings=True, rope_theta=10000.0,
                        use_sliding_window=False, **common)
    qwen3 = Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                        tie_word_embeddings=False, rope_theta=1000000.0,
                        attention_bias=False, use_sliding_window=False, **common)
    llama = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=1,
                        tie_word_embeddings=True, rope_theta=10000.0,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 64},
                        **common)
    return {"qwen2": (qwen2, None), "qwen3": (qwen3, "60KB"), "llama": (llama, None)}


def reference(model, seqs, prompts):
    out = {"sequences": [], "generate": []}
    m32 = model.float().eval()
    m16 = AutoModelForCausalLM.from_config(model.config, attn_implementation="eager")
    m16.load_state_dict(m32.state_dict())
    m16 = m16.to(torch.bfloat16).eval()
    with torch.no_grad():
        for toks in seqs:
            ids = torch.tensor([toks])
            row = {"tokens": toks}
            for tag, m in (("", m32), ("_bf16", m16)):
                logits = m(ids).logits[0].float()
                lp = torch.log_softmax(logits, dim=-1)
                row["logprobs" + tag] = [float(lp[t, toks[t + 1]]) for t in range(len(toks) - 1)]
                row["greedy" + tag] = [int(x) for x in logits.argmax(-1)]
            out["sequences"].append(row)
        for p in prompts:
            ids = torch.tensor([p])
            gen = m32.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0,
                               eos_token_id=None)
            out["generate"].append({"prompt": p, "greedy_tokens": [int(x) for x in gen[0, len(p):]]})
    return out


def build_models(out_dir):
    g = torch.Generator().manual_seed(1234)
    seqs = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (23, 9, 40)]
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 12)]
    for i, (name, (cfg, shard)) in enumerate(configs().items()):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float()
        nontrivial_init(model, seed=100 + i)
        d = os.path.join(out_dir, name)
        shutil.rmtree(d, ignore_errors=True)
        kw = {"max_shard_size": shard} if shard else {}
        model.save_pretrained(d, safe_serialization=True, **kw)
        ref = reference(model, seqs, prompts)
        ref["transformers"] = transformers.__version__
        ref["torch"] = torch.__version__
        with open(os.path.join(d, "reference.json"), "w") as f:
            json.dump(ref, f)
        print(name, sorted(os.listdir(d)))
    # One checkpoint stored in bf16, to test bf16 weight loading.
    torch.manual_seed(7)
    cfg = configs()["qwen2"][0]
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float()
    nontrivial_init(model, seed=107)
    d = os.path.join(out_dir, "qwen2-bf16")
    shutil.rmtree(d, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(d, safe_serialization=True)
    # Reference: the saved bf16 checkpoint reloaded and run in f32 (reloading
    # matters: `.to(bfloat16)` also rounds the RoPE inv_freq buffer).
    reloaded = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
    ref = reference(reloaded, [seqs[0]], [])
    with open(os.path.join(d, "reference.json"), "w") as f:
        json.dump(ref, f)


def chat_fixtures(out_dir, tok_dir):
    tok = AutoTokenizer.from_pretrained(tok_dir)
    tools = [
        {"type": "function", "function": {
            "name": "get_weather", "description": "Get the weather for a city (°C).",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string", "description": "City name"},
                "days": {"type": "integer", "minimum": 1}}, "required": ["city"]}}},
        {"type": "function", "function": {
            "name": "run_shell", "description": "Run a command",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                           "required": ["cmd"]}}},
    ]
    convs = [
        {"name": "tools_full",
         "messages": [
             {"role": "system", "content": "You are a helpful agent."},
             {"role": "user", "content": "What's the weather in Zürich and Paris?"},
             {"role": "assistant", "content": "<think>\nI should call the tool.\n</think>\n\nLet me check.",
              "tool_calls": [
                  {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}},
                  {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
             {"role": "tool", "content": "{\"temp\": 3.5}"},
             {"role": "tool", "content": "{\"temp\": 7}"},
         ],
         "tools": tools, "add_generation_prompt": True},
        {"name": "tools_done",
         "messages": [
             {"role": "user", "content": "List files"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"type": "function", "function": {"name": "run_shell", "arguments": {"cmd": "ls -la"}}}]},
             {"role": "tool", "content": "a.txt\nb.txt"},
             {"role": "assistant", "content": "<think>\nTwo files.\n</think>\n\nThere are two files."},
         ],
         "tools": tools, "add_generation_prompt": False},
        {"name": "system_no_thinking",
         "messages": [
             {"role": "system", "content": "Answer briefly."},
             {"role": "user", "content": "2+2?"},
             {"role": "assistant", "content": "4", "reasoning_content": "easy"},
             {"role": "user", "content": "And 3+3?"},
         ],
         "tools": None, "add_generation_prompt": True, "enable_thinking": False},
        {"name": "thinking_default",
         "messages": [{"role": "user", "content": "Solve x^2 = 4. Put the answer in \\boxed{}."}],
         "tools": None, "add_generation_prompt": True},
    ]
    chat_dir = os.path.join(out_dir, "chat")
    os.makedirs(chat_dir, exist_ok=True)
    shutil.copy(os.path.join(tok_dir, "tokenizer_config.json"), os.path.join(chat_dir, "tokenizer_config.json"))
    cases = []
    for c in convs:
        kw = {}
        if "enable_thinking" in c:
            kw["enable_thinking"] = c["enable_thinking"]
        text = tok.apply_chat_template(c["messages"], tools=c["tools"], tokenize=False,
                                       add_generation_prompt=c["add_generation_prompt"], **kw)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        cases.append(dict(c, rendered=text, token_ids=ids))
    plain = ["Hello, world! 1,234.5 + 6 = ?", "  leading spaces\n\ttabs and ünïcödé 数学 🙂",
             "<|im_start|>user\nhi<|im_end|>"]
    enc = [{"text": t, "ids": tok(t, add_special_tokens=True)["input_ids"]} for t in plain]
    with open(os.path.join(chat_dir, "qwen3_chat.json"), "w") as f:
        json.dump({"cases": cases, "encode": enc, "transformers": transformers.__version__},
                  f, ensure_ascii=False, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="crates/arbor-model/tests/fixtures")
    ap.add_argument("--tokenizer", default="../shared/data/tokenizers/qwen3")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    build_models(a.out)
    chat_fixtures(a.out, a.tokenizer)


if __name__ == "__main__":
    main()
