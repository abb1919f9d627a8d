"""Disaggregation's KV transfer: bandwidth of the tcp backend against this machine's copy floor.

Two `hicache serve` processes on the default model, `--disaggregation-mode prefill` (its bootstrap
server on loopback) and `--disaggregation-mode decode`, each request's halves posted to /generate
with the bootstrap fields sglang-router's PD mode would add. For each prompt length, `--repeats`
fresh prompts: the prefill half runs first (so the transfer does not wait for its compute), then
the decode half asks for the whole prompt's KV. Reported from the decode server's counters: bytes
moved, the seconds the bytes were on the wire (`transfer_seconds`) and from the prefill done to
the pages in L1 (`handoff_seconds`), hence bandwidth and the hand-off per token; the copy floor
is one torch copy of as many bytes between two host buffers, measured in the same run; the ratio
is floor / wire bandwidth.

    .venv/bin/python benchmarks/disagg.py
    .venv/bin/python benchmarks/disagg.py --lengths 256 1024 1900 --repeats 3
"""
from __future__ import annotations

import argparse
import random
import time

import httpx
import torch

from serving import free_port, start_server

FLAGS = ["--max-total-tokens", "8192", "--context-length", "2048", "--page-size", "16",
         "--hicache-storage-backend", "none"]


def copy_floor(nbytes: int, repeats: int = 5) -> float:
    """Bytes per second of the best of `repeats` copies of `nbytes` between two host buffers."""
    src, dst = torch.randint(0, 255, (nbytes,), dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 1900])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    port = free_port()
    greedy = {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}
    rng = random.Random(0)
    procs = [start_server([*FLAGS, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(port)]),
             start_server([*FLAGS, "--disaggregation-mode", "decode"])]
    (_, p), (_, d) = procs

    def stats() -> dict:
        return httpx.get(d + "/hicache/stats", timeout=30).json()["disaggregation"]

    try:
        print(f"{'tokens':>7} {'MiB':>8} {'wire MiB/s':>11} {'handoff ms':>11} {'us/token':>9} "
              f"{'floor MiB/s':>12} {'floor/wire':>10}")
        for n in args.lengths:
            before = stats()
            for _ in range(args.repeats):
                body = {"input_ids": [rng.randrange(100, 40000) for _ in range(n)], "sampling_params": greedy,
                        "bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": rng.getrandbits(63)}
                for url in (p, d):
                    r = httpx.post(url + "/generate", json=body, timeout=300)
                    r.raise_for_status()
            after = stats()
            moved = after["bytes"] - before["bytes"]
            wire = moved / (after["transfer_seconds"] - before["transfer_seconds"])
            handoff = (after["handoff_seconds"] - before["handoff_seconds"]) / args.repeats
            floor = copy_floor(moved // args.repeats)
            print(f"{n:>7} {moved / args.repeats / 2**20:>8.1f} {wire / 2**20:>11.0f} {handoff * 1e3:>11.1f} "
                  f"{handoff / n * 1e6:>9.1f} {floor / 2**20:>12.0f} {floor / wire:>10.1f}")
    finally:
        for proc, _ in procs:
            proc.terminate()
            proc.wait(60)


if __name__ == "__main__":
    main()
