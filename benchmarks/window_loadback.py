"""Sliding-window KV in the cache: the bytes an L2 -> L1 load-back moves for a long prefix of a
model with windowed layers, against every layer's KV of every token. (L1 itself keeps one slot
per context token in every layer: docs/tiers.md, "Sliding-window layers".)

    .venv/bin/python benchmarks/window_loadback.py [--config benchmarks/configs/gemma3-270m.json]
                                                   [--context 8192] [--page-size 64]

Random weights in the config's shape (`load_format=dummy`). A prompt of `--context` random tokens
runs once (its KV goes to L1 and, written through, to L2); a second prompt as long evicts it from
L1; the first prompt plus a few tokens then runs again and loads its prefix back from L2. Prints
the load-back's tokens, its bytes, the bytes of the same tokens in every layer and their ratio;
appends a JSON line to
results/window_loadback.jsonl.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from hicache import Engine

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(HERE / "configs" / "gemma3-270m.json"))
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--page-size", type=int, default=64)
    args = ap.parse_args()
    rng = random.Random(0)
    first, second = ([rng.randrange(3, 30000) for _ in range(args.context)] for _ in range(2))
    params = {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True}
    with Engine(args.config, load_format="dummy", max_total_tokens=args.context + 4 * args.page_size,
                page_size=args.page_size, hicache_ratio=4.0, hicache_storage_backend="none",
                chunked_prefill_size=2048) as engine:
        for ids in (first, second, first + [5, 6, 7]):
            meta = engine.generate(input_ids=ids, sampling_params=params)["meta_info"]
        host = engine.get_stats()["tiers"]["host"]
    tokens, moved = host["loaded_back_tokens"], host["loaded_back_bytes"]
    full = tokens * host["bytes_per_token"]
    row = {"config": Path(args.config).name, "context": args.context, "page_size": args.page_size,
           "loaded_back_tokens": tokens, "loaded_back_bytes": moved, "full_kv_bytes": full,
           "bytes_ratio": round(full / moved, 2) if moved else None,
           "cached_details": meta["cached_tokens_details"]}
    print(json.dumps(row, indent=1))
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "window_loadback.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
