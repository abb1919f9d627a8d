"""First requests to a fresh `hicache serve`, with and without its warm-up request.

    python benchmarks/warmup.py [--requests 3] [--prompt-len 1000] [--new 8] [--json out.json] -- SERVER FLAGS...

For each mode (`--skip-server-warmup`, then the default) it starts the server with an empty
Triton kernel cache (a fresh TRITON_CACHE_DIR; FlashInfer's JIT cache is left as it is), times
start to ready (/health answers), then sends `--requests` /generate requests of random prompts one
after the other (lengths prompt-len, prompt-len + 37, ...: different shapes) and prints a
Markdown table of their latencies.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import time

import httpx

from serving import start_server


def run_mode(skip: bool, args) -> dict:
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="hicache-triton-")
    t0 = time.perf_counter()
    proc, url = start_server([*args.server_flags, *(["--skip-server-warmup"] if skip else [])])
    ready = time.perf_counter() - t0
    rng, latencies = random.Random(0), []
    try:
        for i in range(args.requests):
            ids = [rng.randrange(1000, args.vocab) for _ in range(args.prompt_len + 37 * i)]
            t = time.perf_counter()
            r = httpx.post(url + "/generate", timeout=900, json={
                "input_ids": ids, "sampling_params": {"max_new_tokens": args.new, "temperature": 0}})
            r.raise_for_status()
            latencies.append(time.perf_counter() - t)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    return {"warm_up": not skip, "ready_s": ready, "request_s": latencies}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--new", type=int, default=8, help="new tokens per request")
    ap.add_argument("--vocab", type=int, default=30000, help="prompt token ids are drawn from [1000, vocab)")
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("server_flags", nargs=argparse.REMAINDER, help="after --: flags for hicache serve")
    args = ap.parse_args(argv)
    args.server_flags = [f for f in args.server_flags if f != "--"]
    rows = [run_mode(skip, args) for skip in (True, False)]
    print("| warm-up | start to ready | " + " | ".join(f"request {i + 1}" for i in range(args.requests)) + " |")
    print("|---|---:|" + "---:|" * args.requests)
    for r in rows:
        print(f"| {'on (default)' if r['warm_up'] else 'skipped'} | {r['ready_s']:.1f} s | "
              + " | ".join(f"{t * 1e3:.0f} ms" for t in r["request_s"]) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
