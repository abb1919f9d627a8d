"""The shape of SGLang's `bench_serving --dataset-name generated-shared-prefix`, for a machine where
SGLang's own package cannot be installed: `--groups` system prompts of `--system-len` random token
ids, `--per-group` questions of `--question-len` tokens each, shuffled, `--output-len` tokens each
(ignore_eos), `--concurrency` in flight, streamed through native `/generate` with `input_ids`.

Prints the duration, TTFT p50 and output tokens/s, the prompt tokens each tier served and those
computed (against the fewest any cache must compute: every system prompt and question once), then
the server's L2 traffic from `/hicache/stats`: bytes over the copies' busy time (the wire's rate)
and the time the copies waited.

    python benchmarks/shared_prefix.py --url http://127.0.0.1:30000
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import httpx


def workload(groups: int, per_group: int, system_len: int, question_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(1000, 40000) for _ in range(system_len)] for _ in range(groups)]
    prompts = [s + [rng.randrange(1000, 40000) for _ in range(question_len)] for s in systems for _ in range(per_group)]
    rng.shuffle(prompts)
    return prompts


async def one(client: httpx.AsyncClient, ids: list[int], output_len: int) -> float:
    """Streams one request; its time to the first token."""
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}}
    start, first = time.perf_counter(), None
    async with client.stream("POST", "/generate", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: "):
                first = time.perf_counter() - start
    return first if first is not None else float("nan")


async def run(args) -> dict:
    prompts = workload(args.groups, args.per_group, args.system_len, args.question_len, args.seed)
    gate = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(base_url=args.url, timeout=None) as client:
        await one(client, prompts[0][:64], 1)  # warm-up

        async def guarded(ids):
            async with gate:
                return await one(client, ids, args.output_len)
        before = (await client.get("/hicache/stats")).json()
        start = time.perf_counter()
        ttfts = sorted(await asyncio.gather(*(guarded(p) for p in prompts)))
        duration = time.perf_counter() - start
        stats = (await client.get("/hicache/stats")).json()
    tiers = ("device", "host", "storage")
    hits = {t: _tier(stats, t, "hit_tokens") - _tier(before, t, "hit_tokens") for t in tiers}
    return {"requests": len(prompts), "duration_s": duration, "ttft_p50_ms": 1000 * ttfts[len(ttfts) // 2],
            "output_tok_s": len(prompts) * args.output_len / duration, "host": stats.get("tiers", {}).get("host", {}),
            "retractions": stats.get("retractions"), "prompt_tokens": sum(map(len, prompts)), "hit_tokens": hits,
            "least_computed": len(set(map(tuple, prompts))) * args.question_len + args.groups * args.system_len}


def _tier(stats: dict, tier: str, key: str) -> int:
    return (stats.get("tiers", {}).get(tier) or {}).get(key) or 0


def report(res: dict) -> None:
    print(f"{res['requests']} requests in {res['duration_s']:.1f} s; TTFT p50 {res['ttft_p50_ms']:.0f} ms; "
          f"output {res['output_tok_s']:.0f} tok/s; retractions {res['retractions']}")
    hits = res["hit_tokens"]
    computed = res["prompt_tokens"] - sum(hits.values())
    print(f"prompt tokens {res['prompt_tokens']}: cached on " + ", ".join(f"{t} {n}" for t, n in hits.items())
          + f"; computed {computed} ({computed / res['least_computed']:.2f}x the {res['least_computed']} no cache "
          "could avoid)")
    h = res["host"]
    for label, nbytes, busy, waited, count in (
            ("loaded back", "loaded_back_bytes", "load_back_seconds", "load_back_wait_seconds", "load_backs"),
            ("backed up", "backed_up_bytes", "backup_seconds", "backup_wait_seconds", "backups")):
        if h.get(busy):
            print(f"{label}: {h[nbytes] / 1e9:.1f} GB in {h[busy]:.2f} s busy = {h[nbytes] / h[busy] / 1e9:.1f} GB/s; "
                  f"{h.get(waited, 0):.1f} s queued over {h.get(count)} transfers")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--per-group", type=int, default=16)
    ap.add_argument("--system-len", type=int, default=4096)
    ap.add_argument("--question-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    res = asyncio.run(run(args))
    report(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
