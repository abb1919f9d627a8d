"""Offline throughput on one CPU (or GPU): our Engine vs HF transformers `generate`, and the radix
cache on vs off for prompts sharing a long prefix. Prints a table and ratios; appends a JSON line.

    .venv/bin/python benchmarks/offline_throughput.py [--num-prompts 32] [--new-tokens 64]
        [--skip-prefix] [--base disable_cpu_kernels=1]

Part 1: N prompts of mixed length (100 to 1,000 tokens), `new_tokens` each, greedy, EOS ignored:
our Engine (all submitted together) vs HF `generate` (one padded batch). Goal: >= 4x HF. With
`--base`, a second Engine with those options runs part 1 too (the ratio of the two is printed).
Part 2: the same prompts behind one shared 1,000-token prefix, radix cache on vs off. Goal: >= 3x.
"""
from __future__ import annotations

import argparse
import inspect
import json
import random
import threading
import time
from pathlib import Path

import torch

from hicache import Engine

RESULTS = Path(__file__).resolve().parent / "results"


def corpus_ids(tokenizer) -> list[int]:
    text = "\n\n".join(inspect.getsource(m) for m in (argparse, json.decoder, threading))
    return tokenizer(text)["input_ids"]


def make_prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    ids = corpus_ids(tokenizer)
    out = []
    for _ in range(n):
        length = rng.randint(100, 1000)
        start = rng.randrange(0, len(ids) - length)
        out.append(ids[start:start + length])
    return out


def run_engine(engine: Engine, prompts: list[list[int]], new_tokens: int) -> float:
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    dt = time.perf_counter() - t0
    assert all(len(o["output_ids"]) == new_tokens for o in outs)
    return dt


def run_hf(model_path: Path, prompts: list[list[int]], new_tokens: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path.parent), gguf_file=model_path.name,
                                                 dtype=torch.float32).eval()
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as decoder-only generation needs
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    dt = time.perf_counter() - t0
    assert out.shape[1] == width + new_tokens
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prefix-tokens", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-prefix", action="store_true", help="part 1 only, with no L2 (less memory)")
    ap.add_argument("--max-total-tokens", type=int, default=80_000)
    ap.add_argument("--base", default="", help="Engine options of a second run of part 1, e.g. disable_cpu_kernels=1")
    args = ap.parse_args()
    from hicache.runtime.default_model import default_model_path

    path = default_model_path()
    l2 = {"hierarchical_cache": False} if args.skip_prefix else {}
    engine = Engine(str(path), max_total_tokens=args.max_total_tokens, **l2)
    prompts = make_prompts(engine.tokenizer, args.num_prompts, args.seed)
    corpus = corpus_ids(engine.tokenizer)
    prefix = corpus[-args.prefix_tokens:]
    shared = [prefix + p for p in prompts]
    n_prompt, n_out = sum(map(len, prompts)), args.num_prompts * args.new_tokens
    print(f"threads={torch.get_num_threads()}  prompts={args.num_prompts}  prompt tokens={n_prompt}  "
          f"new tokens each={args.new_tokens}")

    run_engine(engine, prompts[:2], 4)  # warm-up
    engine.flush_cache()
    ours = run_engine(engine, prompts, args.new_tokens)
    engine.flush_cache()
    rows = {"ours": ours}
    if args.base:
        base = Engine(str(path), max_total_tokens=args.max_total_tokens, **l2, **dict(
            (k, {"1": True, "0": False}.get(v, v)) for k, v in (o.split("=") for o in args.base.split(","))))
        run_engine(base, prompts[:2], 4)
        base.flush_cache()
        rows[f"ours ({args.base})"] = run_engine(base, prompts, args.new_tokens)
        base.shutdown()
        del base
    if not args.skip_prefix:
        prefix_parts(rows, path, engine, prefix, shared, args)
    engine.shutdown()
    del engine  # free its KV pool before HF loads
    if not args.skip_hf:
        rows["hf"] = run_hf(path, prompts, args.new_tokens)

    tok = {name: n_prompt + n_out for name in rows}
    if "prefix_cache_on" in rows:
        tok["prefix_cache_on"] = tok["prefix_cache_off"] = n_prompt + len(prefix) * args.num_prompts + n_out
    print("\n| run | seconds | output tok/s | total tok/s |\n|---|---|---|---|")
    for name, sec in rows.items():
        print(f"| {name} | {sec:.2f} | {n_out / sec:.1f} | {tok[name] / sec:.1f} |")
    result = {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "seconds": rows,
              "threads": torch.get_num_threads()}
    if "hf" in rows:
        result["ours_vs_hf"] = rows["hf"] / rows["ours"]
        print(f"\nours vs HF generate (batched, padded): {result['ours_vs_hf']:.2f}x  (goal >= 4x)")
    if f"ours ({args.base})" in rows:
        result["ours_vs_base"] = rows[f"ours ({args.base})"] / rows["ours"]
        print(f"ours vs ours with {args.base}: {result['ours_vs_base']:.2f}x")
    if "prefix_cache_on" in rows:
        result["prefix_on_vs_off"] = rows["prefix_cache_off"] / rows["prefix_cache_on"]
        print(f"radix cache on vs off, shared {len(prefix)}-token prefix: {result['prefix_on_vs_off']:.2f}x  "
              "(goal >= 3x)")
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "offline_throughput.jsonl", "a") as f:
        f.write(json.dumps(result) + "\n")


def prefix_parts(rows: dict, path: Path, engine: Engine, prefix: list[int], shared: list[list[int]], args) -> None:
    """Part 2: the shared-prefix prompts with the radix cache on (`engine`), then off."""
    run_engine(engine, [prefix + [1]], 1)  # the shared prefix is computed once, as a server would have
    rows["prefix_cache_on"] = run_engine(engine, shared, args.new_tokens)
    engine.flush_cache()
    off = Engine(str(path), max_total_tokens=args.max_total_tokens, disable_radix_cache=True)
    rows["prefix_cache_off"] = run_engine(off, shared, args.new_tokens)
    off.shutdown()


if __name__ == "__main__":
    main()
