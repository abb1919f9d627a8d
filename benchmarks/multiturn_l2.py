"""Multi-turn with a tiny L1: the radix cache on L1 only vs L1 + L2 (HiCache), in one run.

    .venv/bin/python benchmarks/multiturn_l2.py [--conversations 20] [--turns 6] [--system 256]
                                                 [--turn 256] [--new 16] [--ratio 10]

The workload of tests/runtime/test_hicache_l2.py with longer turns (the test keeps them short to
bound CI time): C conversations share a system prompt; each turn appends a user message (a slice
of source code, `--turn` tokens) and the answer (`--new` greedy tokens, EOS ignored). Turn t of
every conversation is submitted at once (streamed, for TTFT). L1 holds about two final-length
conversations; L2 is `--ratio` times larger; L3 is off in both. The two configurations live side
by side and play turn t one after the other, so that the machine's load drifts hit both alike. Prints throughput
(prompt + generated tokens per second of wall time), TTFT p50, the ratios and the host-served
fraction of prompt tokens by turn; appends a JSON line to results/multiturn_l2.jsonl.
"""
from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import statistics
import threading
import time
from pathlib import Path

import torch

from hicache import Engine

RESULTS = Path(__file__).resolve().parent / "results"


def workload(tokenizer, args) -> tuple[list[int], list[list[list[int]]]]:
    text = "\n\n".join(inspect.getsource(m) for m in (json.decoder, threading, inspect, argparse, asyncio.tasks))
    ids = tokenizer(text)["input_ids"]
    need = args.system + args.conversations * args.turns * args.turn
    assert len(ids) >= need, f"corpus of {len(ids)} tokens < {need}"
    pos = iter(range(args.system, need, args.turn))
    turns = [[ids[p:p + args.turn] for p in (next(pos) for _ in range(args.turns))] for _ in range(args.conversations)]
    return ids[:args.system], turns


async def one(engine: Engine, ids: list[int], params: dict) -> tuple[float, dict]:
    t0 = time.perf_counter()
    ttft, last = None, None
    async for chunk in engine.async_generate(input_ids=ids, sampling_params=params):
        if ttft is None and chunk["output_ids"]:
            ttft = time.perf_counter() - t0
        last = chunk
    return ttft, last


class Runner:
    """One configuration's engine and conversations, played a turn at a time."""

    def __init__(self, engine: Engine, system, turns, args):
        self.engine, self.system, self.turns, self.args = engine, system, turns, args
        self.params = {"temperature": 0, "max_new_tokens": args.new, "ignore_eos": True}
        self.answers = [[] for _ in turns]
        self.ttfts, self.prompt_tokens, self.host = [], [0] * args.turns, [0] * args.turns
        self.tokens, self.seconds = 0, 0.0

    def turn(self, t: int) -> None:
        prompts = []
        for c, conv in enumerate(self.turns):
            ids = list(self.system)
            for j in range(t):
                ids += conv[j] + self.answers[c][j]
            prompts.append(ids + conv[t])

        async def submit():
            return await asyncio.gather(*(one(self.engine, p, self.params) for p in prompts))

        t0 = time.perf_counter()
        outs = asyncio.run(submit())
        self.seconds += time.perf_counter() - t0
        for c, (ttft, out) in enumerate(outs):
            self.answers[c].append(out["output_ids"])
            self.ttfts.append(ttft)
            meta = out["meta_info"]
            self.prompt_tokens[t] += meta["prompt_tokens"]
            self.host[t] += meta["cached_tokens_details"]["host"]
            self.tokens += meta["prompt_tokens"] + meta["completion_tokens"]

    def result(self) -> dict:
        stats = self.engine.get_stats()
        return {"seconds": self.seconds, "tokens_per_s": self.tokens / self.seconds,
                "ttft_p50": statistics.median(self.ttfts),
                "host_fraction_by_turn": [h / p for h, p in zip(self.host, self.prompt_tokens)],
                "computed_prompt_tokens": stats["tokens"]["prompt"], "cached": stats["tokens"]["cached"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=20)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system", type=int, default=256)
    ap.add_argument("--turn", type=int, default=256)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--ratio", type=float, default=10.0)
    ap.add_argument("--policy", default="write_through")
    args = ap.parse_args()
    from hicache.runtime.default_model import default_model_path

    path = str(default_model_path())
    l1 = args.system + 2 * args.turns * (args.turn + args.new) + 64
    configs = {"L1 only": {"hierarchical_cache": False},
               "L1 + L2": {"hicache_ratio": args.ratio, "hicache_write_policy": args.policy}}
    runners = {}
    for name, options in configs.items():
        engine = Engine(path, max_total_tokens=l1, hicache_storage_backend="none", **options)
        system, turns = workload(engine.tokenizer, args)
        engine.generate(input_ids=[system + [1]], sampling_params={"max_new_tokens": 1})  # warm-up
        engine.flush_cache()
        runners[name] = Runner(engine, system, turns, args)
    for t in range(args.turns):
        for r in runners.values():
            r.turn(t)
    answers = [r.answers for r in runners.values()]
    rows = {name: r.result() for name, r in runners.items()}
    for r in runners.values():
        r.engine.shutdown()
    same = answers[0] == answers[1]
    print(f"threads={torch.get_num_threads()}  L1={l1} tokens  {args}")
    print("\n| run | seconds | tokens/s | TTFT p50 (s) | prompt tokens computed | host-served fraction by turn |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        frac = ", ".join(f"{f:.2f}" for f in r["host_fraction_by_turn"])
        print(f"| {name} | {r['seconds']:.1f} | {r['tokens_per_s']:.1f} | {r['ttft_p50']:.2f} | "
              f"{r['computed_prompt_tokens']} | {frac} |")
    a, b = rows["L1 only"], rows["L1 + L2"]
    result = {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "l1_tokens": l1, "runs": rows,
              "throughput_ratio": b["tokens_per_s"] / a["tokens_per_s"],
              "ttft_p50_ratio": a["ttft_p50"] / b["ttft_p50"],
              "same_outputs": same, "threads": torch.get_num_threads()}
    print(f"\nL1+L2 vs L1 only: throughput {result['throughput_ratio']:.2f}x (goal >= 3x), "
          f"TTFT p50 {result['ttft_p50_ratio']:.2f}x lower; identical outputs: {same}")
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "multiturn_l2.jsonl", "a") as f:
        f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
