#!/usr/bin/env python3
"""One table of the generation benchmarks the GPU check wrote.

Reads, from the directory given (the GPU check's $OUT): the Arbor sweep
(`generate-*.jsonl`, one JSON object per line, from `arbor bench generate
--json`), the overhead cuts measured one by one (`generate-cuts.jsonl`),
the fork workload (`fork-*.json`) and the transformers peer
(`generate-peer.jsonl`, from scripts/bench_hf_generate.py). Prints a
Markdown table per part and writes them to `generate-table.md` there.
Files that are missing (a step that failed or timed out) are skipped.

    python3 scripts/gpu_generate_table.py gpu-check-out
"""
import json
import pathlib
import sys


def objects(path):
    """Every JSON object in a file: one per line, or pretty-printed ones
    one after another."""
    text = path.read_text()
    dec, at, out = json.JSONDecoder(), 0, []
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at >= len(text):
            return out
        try:
            obj, at = dec.raw_decode(text, at)
        except json.JSONDecodeError:
            return out
        if isinstance(obj, dict):
            out.append(obj)


def fmt(x, spec):
    return "" if x is None else format(x, spec)


def main():
    out = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "gpu-check-out")
    lines = []
    runs = [r for p in sorted(out.glob("generate-qwen3-*.json*")) for r in objects(p)]
    peers = {(r.get("model"), r["sequences"]): r
             for p in out.glob("generate-peer.jsonl") for r in objects(p)}
    if runs:
        lines += ["| model | batch | prompt + new | ms/step | decode tok/s | all tok/s | "
                  "% roofline (GB/s) | first decode step ms | weight refresh ms | "
                  "HF ms/step (cache) | Arbor / HF |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in runs:
            peer = peers.get((r["model"], r["sequences"]))
            ratio = (peer["ms_per_step"] / r["ms_per_step"]
                     if peer and r.get("ms_per_step") else None)
            roof = r.get("roofline_fraction")
            lines.append("| {} | {} | {} + {} | {} | {} | {} | {} | {}{} | {} | {} | {} |".format(
                r["model"], r["sequences"], r["prompt_len"], r["new_tokens"],
                fmt(r.get("ms_per_step"), ".2f"), fmt(r.get("decode_tokens_per_s"), ",.0f"),
                fmt(r.get("generated_tokens_per_s"), ",.0f"),
                "" if roof is None else f"{100 * roof:.1f}% ({r.get('bandwidth_gb_s', 0):.0f})",
                fmt(r.get("first_decode_step_ms"), ".2f"),
                " (fresh)" if r.get("fresh_process") else "",
                fmt(r.get("weight_refresh_ms"), ".2f"),
                "" if not peer else f"{peer['ms_per_step']:.2f} ({peer['cache']}"
                + (", compiled" if peer.get("compiled") else "") + ")",
                fmt(ratio, ".2f") + ("x" if ratio else "")))
        lines.append("")
    cuts = [r for p in out.glob("generate-cuts.jsonl") for r in objects(p)]
    if cuts:
        lines += ["| GPU cuts off | fused step | ms/step | decode tok/s | % roofline |",
                  "|---|---|---|---|---|"]
        for r in cuts:
            roof = r.get("roofline_fraction")
            lines.append("| {} | {} | {} | {} | {} |".format(
                ", ".join(r.get("gpu_cuts_off") or []) or "none",
                "yes" if r.get("fused_decode") else "no",
                fmt(r.get("ms_per_step"), ".2f"), fmt(r.get("decode_tokens_per_s"), ",.0f"),
                "" if roof is None else f"{100 * roof:.1f}%"))
        lines.append("")
    forks = [r for p in sorted(out.glob("fork-*.json")) for r in objects(p)]
    if forks:
        lines += ["| fork workload | prompt + new | ms/step | all tok/s | prefill shared |",
                  "|---|---|---|---|---|"]
        for r in forks:
            lines.append("| {} x {} | {} + {} | {} | {} | {} |".format(
                r["model"], r["sequences"], r["prompt_len"], r["new_tokens"],
                fmt(r.get("ms_per_step"), ".2f"), fmt(r.get("generated_tokens_per_s"), ",.0f"),
                r.get("prefill_forked")))
        lines.append("")
    for p in out.glob("generate-f32-bf16-rollouts.json"):
        for r in objects(p):
            lines += ["| f32 model, bf16 rollouts | fused step | ms/step | weight refresh ms |",
                      "|---|---|---|---|",
                      "| {} x {} | {} | {} | {} |".format(
                          r["model"], r["sequences"], "yes" if r.get("fused_decode") else "no",
                          fmt(r.get("ms_per_step"), ".2f"), fmt(r.get("weight_refresh_ms"), ".2f")),
                      ""]
    for r in peers.values():
        if r.get("fallback"):
            lines.append(f"HF peer fell back to the dynamic cache: {r['fallback']}")
    text = "\n".join(lines)
    print(text)
    (out / "generate-table.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
