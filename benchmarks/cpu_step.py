"""The CPU model step, A/B in one process: Engines with different options (by default the
compiled CPU kernels against `disable_cpu_kernels`) timed on the same workloads, interleaved,
medians of the repeats, and the ratio of each to the first. Prints a table; appends a JSON line.

    .venv/bin/python benchmarks/cpu_step.py [--repeats 3] [--variants "disable_cpu_kernels=1;"]

Workloads (fresh random prompts each repeat, greedy, EOS ignored, radix cache off):
- prefill: one prompt of `--prompt-tokens` tokens, one new token (the time of the request);
- decode at batch 1 and `--batch`: the inter-token latency of prompts of 100 tokens sent at once,
  streamed: (last token's arrival - first token's) / (N - 1), the median over the batch.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

import torch

from hicache import Engine

RESULTS = Path(__file__).resolve().parent / "results"


def parse_variant(text: str) -> dict:
    """"a=1,b=x" -> {"a": True-ish or the string}; "" -> {} (the defaults)."""
    options = {}
    for item in filter(None, text.split(",")):
        key, value = item.split("=")
        options[key] = {"1": True, "0": False}.get(value, value)
    return options


def timed(engine: Engine, prompts: list[list[int]], new_tokens: int) -> float:
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    t0 = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params=params)
    return time.perf_counter() - t0


async def inter_token_latency(engine: Engine, prompts: list[list[int]], new_tokens: int) -> float:
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}

    async def one(ids: list[int]) -> float:
        arrivals = [time.perf_counter() async for _ in engine.async_generate(input_ids=ids, sampling_params=params)]
        return (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1)

    return statistics.median(await asyncio.gather(*(one(p) for p in prompts)))


def workloads(args, rng: random.Random) -> dict:
    def prompts(n: int, length: int) -> list[list[int]]:
        return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]

    def decode(batch: int):
        def run(engine: Engine) -> float:
            return asyncio.run(inter_token_latency(engine, prompts(batch, 100), args.new_tokens))
        return run

    return {"prefill": lambda engine: timed(engine, prompts(1, args.prompt_tokens), 1),
            "decode_b1": decode(1), f"decode_b{args.batch}": decode(args.batch)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="disable_cpu_kernels=1;", help="';'-separated Engine options, first = base")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=500)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--commit", default="")
    args = ap.parse_args()
    variants = args.variants.split(";")
    engines = [Engine(None, disable_radix_cache=True, hierarchical_cache=False, max_total_tokens=16384,
                      **parse_variant(v)) for v in variants]
    rng = random.Random(0)
    work = workloads(args, rng)
    for engine in engines:
        timed(engine, [[5, 6, 7]], 3)  # warm-up
    times = {(w, v): [] for w in work for v in variants}
    for _ in range(args.repeats):
        for name, run in work.items():
            for variant, engine in zip(variants, engines):
                times[(name, variant)].append(run(engine))
    for engine in engines:
        engine.shutdown()
    print(f"threads={torch.get_num_threads()}  repeats={args.repeats}  (ms; ratio = first variant / this one)")
    print("| workload | " + " | ".join(v or "defaults" for v in variants) + " |")
    print("|---|" + "---:|" * len(variants))
    medians = {k: statistics.median(t) * 1e3 for k, t in times.items()}
    for name in work:
        base = medians[(name, variants[0])]
        cells = [f"{medians[(name, v)]:.1f} ({base / medians[(name, v)]:.2f}x)" for v in variants]
        print(f"| {name} | " + " | ".join(cells) + " |")
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "cpu_step.jsonl", "a") as f:
        f.write(json.dumps({"time": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": args.commit, "args": vars(args),
                            "threads": torch.get_num_threads(),
                            "ms": {f"{w}|{v}": t for (w, v), t in medians.items()}}) + "\n")


if __name__ == "__main__":
    main()
