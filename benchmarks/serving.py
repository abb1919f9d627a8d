"""Serving benchmark: concurrent streaming clients over HTTP vs the same workload in-process.

For each concurrency level (default 1, 8, 32) every client streams requests back to back through
native `/generate` (SGLang's format: `input_ids`, `stream`, cumulative `output_ids`) of a real
`hicache serve` process until the level's requests are done, and the same requests go through the
in-process `Engine.async_generate` (both loaded at once, runs alternating between the two paths).
Prompts are distinct random token ids (no prefix sharing: this measures the serving path, not the
cache) with `ignore_eos`, so every request produces exactly `--output-len` tokens.

Reported per path and level: TTFT, ITL and end-to-end latency percentiles, output tokens/s and
requests/s; and the HTTP path's throughput overhead at the highest level,
`engine_tok_s / http_tok_s` (goal: under 1.2x).

    .venv/bin/python benchmarks/serving.py                      # default model, CPU
    .venv/bin/python benchmarks/serving.py --levels 1 8 32 --requests-per-client 2 --json out.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from statistics import quantiles

import httpx

SERVER_READY_TIMEOUT_S = 900


@dataclass
class RequestRecord:
    ttft: float
    itls: list[float]
    e2e: float
    output_tokens: int


@dataclass
class LevelResult:
    path: str
    clients: int
    requests: int
    duration_s: float
    output_tokens: int
    records: list[RequestRecord] = field(default_factory=list, repr=False)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.duration_s

    def summary(self) -> dict:
        itls = [x for r in self.records for x in r.itls]
        return {"path": self.path, "clients": self.clients, "requests": self.requests,
                "duration_s": round(self.duration_s, 3), "output_tok_s": round(self.tok_s, 2),
                "req_s": round(self.requests / self.duration_s, 3),
                "ttft_ms": pct([r.ttft for r in self.records]), "itl_ms": pct(itls),
                "e2e_ms": pct([r.e2e for r in self.records])}


def pct(values: list[float]) -> dict:
    if not values:
        return {}
    ms = sorted(v * 1000 for v in values)
    if len(ms) == 1:
        return {"mean": round(ms[0], 2), "p50": round(ms[0], 2), "p90": round(ms[0], 2), "p99": round(ms[0], 2)}
    q = quantiles(ms, n=100, method="inclusive")
    return {"mean": round(sum(ms) / len(ms), 2), "p50": round(q[49], 2), "p90": round(q[89], 2), "p99": round(q[98], 2)}


def make_prompts(n: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


# ---- driving a workload ---------------------------------------------------------------------


async def run_level(path: str, clients: int, prompts: list[list[int]], one_request) -> LevelResult:
    """`clients` workers pull prompts from a shared queue until it is empty."""
    todo: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        todo.put_nowait(p)
    records: list[RequestRecord] = []

    async def worker():
        while not todo.empty():
            records.append(await one_request(todo.get_nowait()))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    duration = time.perf_counter() - t0
    return LevelResult(path, clients, len(prompts), duration, sum(r.output_tokens for r in records), records)


def timing(start: float, token_times: list[tuple[float, int]]) -> RequestRecord:
    """From (arrival time, new tokens) events: TTFT, per-token ITL, E2E."""
    ttft = token_times[0][0] - start
    itls = []
    for (a, _), (b, n) in zip(token_times, token_times[1:]):
        itls.extend([(b - a) / n] * n)
    return RequestRecord(ttft, itls, token_times[-1][0] - start, sum(n for _, n in token_times))


def http_requester(client: httpx.AsyncClient, output_len: int):
    async def one(ids: list[int]) -> RequestRecord:
        body = {"input_ids": ids, "stream": True,
                "sampling_params": {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}}
        start, seen, events = time.perf_counter(), 0, []
        async with client.stream("POST", "/generate", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                n = len(json.loads(line[6:])["output_ids"])  # cumulative
                if n > seen:
                    events.append((time.perf_counter(), n - seen))
                    seen = n
        return timing(start, events)

    return one


def engine_requester(engine, output_len: int):
    async def one(ids: list[int]) -> RequestRecord:
        params = {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}
        start, seen, events = time.perf_counter(), 0, []
        async for out in engine.async_generate(input_ids=ids, sampling_params=params):
            n = len(out["output_ids"])
            if n > seen:
                events.append((time.perf_counter(), n - seen))
                seen = n
        return timing(start, events)

    return one


# ---- the two paths --------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(flags: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "hicache.server.cli", "serve", "--port", str(port), "--log-level", "warning", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + SERVER_READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited during startup:\n{proc.stderr.read()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not become healthy")


async def bench(args, workloads: dict[int, list[list[int]]]) -> list[LevelResult]:
    """Both paths loaded at once (each idles at ~0% CPU while the other runs), levels run in turn,
    paths alternating within a level, so that drifting background load hits both alike."""
    runners, cleanups = {}, []
    try:
        if "http" in args.paths:
            runners["http"] = await _http_runner(args, cleanups)
        if "engine" in args.paths:
            runners["engine"] = _engine_runner(args, cleanups)
        for one, _ in runners.values():
            await one(workloads[min(workloads)][0])  # warm-up
        results = []
        for clients, prompts in workloads.items():
            for rep in range(args.repeats):
                order = list(runners) if rep % 2 == 0 else list(reversed(runners))
                for path in order:
                    one, reset = runners[path]
                    await reset()
                    results.append(await run_level(path, clients, prompts, one))
                    print_level(results[-1])
        return merge_repeats(results)
    finally:
        for fn in reversed(cleanups):
            fn()


async def _http_runner(args, cleanups: list):
    proc, url = start_server(server_flags(args))

    def stop():
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)

    cleanups.append(stop)
    width = max(args.levels) + 4
    client = httpx.AsyncClient(base_url=url, timeout=600,
                               limits=httpx.Limits(max_connections=width, max_keepalive_connections=width))

    async def reset():
        await client.post("/flush_cache")

    return http_requester(client, args.output_len), reset


def _engine_runner(args, cleanups: list):
    from hicache import Engine

    engine = Engine(args.model_path, **engine_options(args))
    cleanups.append(engine.shutdown)

    async def reset():
        engine.flush_cache()

    return engine_requester(engine, args.output_len), reset


def merge_repeats(results: list[LevelResult]) -> list[LevelResult]:
    merged: dict[tuple[str, int], LevelResult] = {}
    for r in results:
        m = merged.setdefault((r.path, r.clients), LevelResult(r.path, r.clients, 0, 0.0, 0))
        m.requests += r.requests
        m.duration_s += r.duration_s
        m.output_tokens += r.output_tokens
        m.records += r.records
    return list(merged.values())


def engine_options(args) -> dict:
    opts = {"max_total_tokens": args.max_total_tokens, "max_running_requests": max(args.levels),
            "page_size": args.page_size}
    return {k: v for k, v in opts.items() if v is not None}


def server_flags(args) -> list[str]:
    flags = [] if args.model_path is None else ["--model-path", args.model_path]
    for k, v in engine_options(args).items():
        flags += ["--" + k.replace("_", "-"), str(v)]
    return flags


# ---- reporting ------------------------------------------------------------------------------


def print_level(r: LevelResult) -> None:
    s = r.summary()
    print(f"  {r.path:6s} clients={r.clients:3d}  {s['output_tok_s']:8.1f} tok/s  {s['req_s']:6.2f} req/s  "
          f"TTFT p50 {s['ttft_ms']['p50']:8.1f} ms  ITL p50 {s['itl_ms'].get('p50', 0):7.1f} ms  "
          f"E2E p50 {s['e2e_ms']['p50']:8.1f} ms", flush=True)


def markdown(results: list[LevelResult]) -> str:
    rows = ["| path | clients | requests | output tok/s | req/s | TTFT p50 / p90 / p99 (ms) "
            "| ITL p50 / p90 / p99 (ms) | E2E p50 / p99 (ms) |",
            "|---|---:|---:|---:|---:|---|---|---|"]
    for r in sorted(results, key=lambda r: (r.clients, r.path)):
        s = r.summary()
        t, i, e = s["ttft_ms"], s["itl_ms"], s["e2e_ms"]
        rows.append(f"| {r.path} | {r.clients} | {r.requests} | {s['output_tok_s']:.1f} | {s['req_s']:.2f} | "
                    f"{t['p50']:.0f} / {t['p90']:.0f} / {t['p99']:.0f} | "
                    f"{i.get('p50', 0):.1f} / {i.get('p90', 0):.1f} / "
                    f"{i.get('p99', 0):.1f} | {e['p50']:.0f} / {e['p99']:.0f} |")
    return "\n".join(rows)


def overhead(results: list[LevelResult], clients: int) -> float | None:
    by = {(r.path, r.clients): r for r in results}
    if ("http", clients) not in by or ("engine", clients) not in by:
        return None
    return by[("engine", clients)].tok_s / by[("http", clients)].tok_s


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--levels", type=int, nargs="+", default=[1, 8, 32], help="concurrent clients per run")
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--min-requests", type=int, default=4, help="at least this many requests per level")
    p.add_argument("--input-len", type=int, nargs=2, default=[64, 256], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-total-tokens", type=int, default=32768)
    p.add_argument("--page-size", type=int, default=None)
    p.add_argument("--paths", nargs="+", default=["http", "engine"], choices=["http", "engine"])
    p.add_argument("--repeats", type=int, default=2, help="runs per path and level, alternating the path order")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the summaries here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    workloads = {c: make_prompts(max(c * args.requests_per_client, args.min_requests), *args.input_len, args.seed + c)
                 for c in sorted(args.levels)}
    print(f"workload: levels {list(workloads)}, prompts {args.input_len[0]}-{args.input_len[1]} tokens, "
          f"{args.output_len} output tokens, cpus {os.cpu_count()}", flush=True)
    results = asyncio.run(bench(args, workloads))
    print("\n" + markdown(results))
    top = max(args.levels)
    ratio = overhead(results, top)
    if ratio is not None:
        print(f"\nHTTP overhead at {top} clients: engine {overhead_tok(results, 'engine', top):.1f} tok/s / "
              f"http {overhead_tok(results, 'http', top):.1f} tok/s = {ratio:.3f}x (goal < 1.2x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": [r.summary() for r in results],
                       "http_overhead_ratio": ratio}, f, indent=2)
    return 0


def overhead_tok(results: list[LevelResult], path: str, clients: int) -> float:
    return next(r.tok_s for r in results if r.path == path and r.clients == clients)


if __name__ == "__main__":
    sys.exit(main())
