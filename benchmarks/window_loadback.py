"""Sliding-window KV in the cache: the L1 KV a request of a model with windowed layers holds, and
the bytes an L2 -> L1 load-back of its prefix moves, against every layer's KV of every token
(docs/tiers.md, "Sliding-window layers").

    .venv/bin/python benchmarks/window_loadback.py [--config benchmarks/configs/gemma3-270m.json]
                                                   [--context 8192] [--page-size 64]

Random weights in the config's shape (`load_format=dummy`). L1: without an L2, one prompt of
`--context` random tokens streams its output; the L1 pools' occupancy is read while it decodes
(a running request) and once it has finished (what the radix tree keeps), as layer-tokens (slots
of the global layers' pool times their number, plus those of the windowed layers' pool).
Load-back: with an L2 (write-through), the prompt runs (what L1 keeps of it once finished is
read), a second one as long evicts it from L1, and the first plus a few tokens runs again and
loads its prefix back. Prints JSON and appends it
to results/window_loadback.jsonl.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
from pathlib import Path

from hicache import Engine

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def layer_counts(config: str) -> tuple[int, int]:
    """(global, windowed) layers of an HF config.json with `layer_types` or a sliding window."""
    cfg = json.loads(Path(config).read_text())
    types = cfg.get("layer_types") or ["sliding_attention" if cfg.get("sliding_window") else "full_attention"] * \
        cfg["num_hidden_layers"]
    windowed = sum(t == "sliding_attention" for t in types)
    return len(types) - windowed, windowed


def held(stats: dict, layers: tuple[int, int]) -> int:
    device = stats["tiers"]["device"]
    return layers[0] * device["used_tokens"] + layers[1] * device.get("window_used_tokens", device["used_tokens"])


def l1_held(args, prompt: list[int], layers: tuple[int, int]) -> dict:
    """Layer-tokens L1 holds for one request without an L2: while it decodes, and after."""
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    with Engine(args.config, load_format="dummy", max_total_tokens=args.context + 8 * args.page_size,
                page_size=args.page_size, hierarchical_cache=False, chunked_prefill_size=2048) as engine:
        async def stream() -> int:
            running = 0
            async for out in engine.async_generate(input_ids=prompt, sampling_params=params):
                if len(out["output_ids"]) == 2:  # decoding
                    running = held(engine.get_stats(), layers)
            return running

        running = asyncio.run(stream())
        cached = held(engine.get_stats(), layers)
    full = (len(prompt) + params["max_new_tokens"]) * sum(layers)
    return {"running_layer_tokens": running, "cached_layer_tokens": cached, "full_layer_tokens": full,
            "running_ratio": round(full / running, 2), "cached_ratio": round(full / cached, 2)}


def load_back(args, first: list[int], second: list[int], layers: tuple[int, int]) -> dict:
    """With an L2: what L1 keeps of the first prompt once it finished (its pages written
    through), and the bytes of its load-back once a second prompt evicted it."""
    params = {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True}
    with Engine(args.config, load_format="dummy", max_total_tokens=args.context + 4 * args.page_size,
                swa_full_tokens_ratio=1.0, page_size=args.page_size, hicache_ratio=4.0,
                hicache_storage_backend="none", chunked_prefill_size=2048) as engine:
        cached = 0
        for ids in (first, second, first + [5, 6, 7]):
            meta = engine.generate(input_ids=ids, sampling_params=params)["meta_info"]
            cached = cached or held(engine.get_stats(), layers)
        host = engine.get_stats()["tiers"]["host"]
    tokens, moved = host["loaded_back_tokens"], host["loaded_back_bytes"]
    full = tokens * host["bytes_per_token"]
    return {"cached_layer_tokens_with_l2": cached, "loaded_back_tokens": tokens, "loaded_back_bytes": moved,
            "full_kv_bytes": full,
            "bytes_ratio": round(full / moved, 2) if moved else None, "cached_details": meta["cached_tokens_details"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(HERE / "configs" / "gemma3-270m.json"))
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--page-size", type=int, default=64)
    args = ap.parse_args()
    rng = random.Random(0)
    first, second = ([rng.randrange(3, 30000) for _ in range(args.context)] for _ in range(2))
    layers = layer_counts(args.config)
    row = {"config": Path(args.config).name, "context": args.context, "page_size": args.page_size,
           "layers_global_windowed": layers, **l1_held(args, first, layers), **load_back(args, first, second, layers)}
    print(json.dumps(row, indent=1))
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "window_loadback.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
