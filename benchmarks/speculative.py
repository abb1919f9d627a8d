"""Decode throughput with and without speculative decoding (NGRAM), measured in one run on the
same prompts: two Engines on the default model (or `--model-path`), greedy, the radix cache
flushed before each measurement so that no run drafts from an answer measured before it.

    .venv/bin/python benchmarks/speculative.py [--new-tokens 128] [--batches 1,8,16] [--repeats 3]

Workloads:
- copy: edit-this-code prompts (rename a function in code given in the prompt, keep the rest);
- chat: plain questions (short explanations);
- again: a chat prompt answered a second time, the first answer left in the cache (a regenerated
  answer): the drafts come from the index over the tree's tokens.
Decode tokens/s of a batch = (tokens generated - one a request) / (time of the batch - time of
the same batch with one new token), i.e. the prefill is measured apart and taken off; the two
engines alternate, and each figure is the median of the repeats. Prints a table with the ratio
of NGRAM to plain decoding (of the medians, and of each repeat's pair of runs: the spread says how
noisy the machine was); appends a JSON line to results/speculative.jsonl.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from hicache import Engine

RESULTS = Path(__file__).resolve().parent / "results"
CODE = """def {name}(a, b):
    out = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    out.extend(a[i:])
    out.extend(b[j:])
    return out
"""
NAMES = ["merge_sorted", "combine", "merge_runs", "join_sorted", "zip_merge", "interleave", "merge_two", "union"]
TOPICS = ["why the sky is blue", "how a bicycle stays upright", "what a compiler does", "why bread rises",
          "how vaccines work", "what causes tides", "how a refrigerator cools", "why leaves change color"]


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def prompts(workload: str, n: int) -> list[str]:
    if workload == "copy":
        return [chat(f"Rewrite this Python function, renaming {NAMES[i % 8]} to {NAMES[i % 8]}_v2, and keep "
                     f"everything else the same:\n\n{CODE.format(name=NAMES[i % 8])}") for i in range(n)]
    return [chat(f"Explain {TOPICS[i % 8]} in a few sentences.") for i in range(n)]


def generate(engine: Engine, texts: list[str], new_tokens: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    outs = engine.generate(texts, sampling_params={"temperature": 0, "max_new_tokens": new_tokens})
    return time.perf_counter() - t0, sum(o["meta_info"]["completion_tokens"] for o in outs)


def decode_rate(engine: Engine, workload: str, batch: int, new_tokens: int) -> float:
    texts = prompts(workload, batch)
    engine.flush_cache()
    if workload == "again":
        generate(engine, texts, new_tokens)  # the first answers, left in the tree
    prefill, _ = generate(engine, texts, 1)  # (prompts now cached as the timed run will find them)
    total, tokens = generate(engine, texts, new_tokens)
    return (tokens - batch) / (total - prefill)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--workloads", default="copy,chat,again")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-total-tokens", type=int, default=16384, help="L1 of each engine (L2: twice that)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    engines = {name: Engine(args.model_path, hicache_storage_backend="none", speculative_algorithm=algo,
                            max_total_tokens=args.max_total_tokens)
               for name, algo in (("plain", None), ("ngram", "NGRAM"))}
    rows = []
    try:
        for workload in args.workloads.split(","):
            for batch in batches:
                runs = [{name: decode_rate(e, workload, batch, args.new_tokens) for name, e in engines.items()}
                        for _ in range(args.repeats)]
                rates = {name: statistics.median(r[name] for r in runs) for name in engines}
                rows.append({"workload": workload, "batch": batch, **rates, "ratio": rates["ngram"] / rates["plain"],
                             "repeats": runs})
        spec = engines["ngram"].get_stats()["speculative"]
    finally:
        for e in engines.values():
            e.shutdown()
    print("| workload | batch | plain tok/s | NGRAM tok/s | ratio | ratios of the repeats |\n|---|---|---|---|---|---|")
    for r in rows:
        each = " / ".join(f"{run['ngram'] / run['plain']:.2f}" for run in r["repeats"])
        print(f"| {r['workload']} | {r['batch']} | {r['plain']:.1f} | {r['ngram']:.1f} | **{r['ratio']:.2f}x** "
              f"| {each} |")
    accept = 1 + spec["accepted_tokens"] / max(spec["drafts"], 1)
    print(f"drafts {spec['drafts']}, accepted {spec['accepted_tokens']} of {spec['draft_tokens']} draft tokens, "
          f"{accept:.2f} tokens a verified draft")
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "speculative.jsonl", "a") as f:
        f.write(json.dumps({"time": time.time(), "args": vars(args), "rows": rows, "speculative": spec}) + "\n")


if __name__ == "__main__":
    main()
