"""Replicas behind a router: cache-aware routing against round robin on one workload.

Two set-ups. By default: `--replicas` hicache servers (`--server-flags`) and, for each `--policies`
entry in turn, `sglang-router` in front of them, every replica's cache emptied first. With
`--dp-size N`: one `hicache serve --dp-size N --load-balance-method P` per policy P (the replicas
behind the server's own router; a fresh server per policy, so every cache starts empty; `{policy}`
in `--server-flags` becomes the policy's name, so that each can have an L3 path of its own). Either
way multiturn.py's workload runs through the router: `--num-clients` tenants, each with its own conversation (round 0: a
`--request-length`-token system prompt and question), `--num-rounds` rounds, every round carrying
the whole history. Reports per policy the cache hit rate, throughput and how the requests spread
over the replicas, then the hit-rate and throughput ratios of the first policy over the second.
One JSON line per policy is appended to `--log-file`.

    .venv/bin/python benchmarks/router.py --num-clients 16 --num-rounds 6 --request-length 1024
    .venv/bin/python benchmarks/router.py --dp-size 2 --num-clients 16 --num-rounds 6 --request-length 1024

`start_router` is also what the tests use to put the router in front of their servers.
"""
from __future__ import annotations

import argparse
import asyncio
import shlex
import subprocess
import sys
import time

import httpx

import multiturn
from serving import free_port, start_server

ROUTER_READY_TIMEOUT_S = 120
LOG = multiturn.RESULTS / "router.jsonl"
SERVER_FLAGS = "--page-size 16 --max-total-tokens 65536 --chunked-prefill-size 1024 --hicache-storage-backend none"


def start_router(worker_urls: list[str], policy: str = "cache_aware", *extra: str) -> tuple[subprocess.Popen, str]:
    """`sglang-router` on 127.0.0.1 and a free port in front of `worker_urls`, once it reports
    every worker healthy; (process, url)."""
    return _launch(["--worker-urls", *worker_urls, "--policy", policy, *extra], len(worker_urls))


def start_pd_router(prefill_url: str, bootstrap_port: int, decode_url: str,
                    *extra: str) -> tuple[subprocess.Popen, str]:
    """`sglang-router` in its PD mode in front of a prefill server (with its bootstrap port) and a
    decode server, once it reports both healthy; (process, url)."""
    return _launch(["--pd-disaggregation", "--prefill", prefill_url, str(bootstrap_port), "--decode", decode_url,
                    *extra], 2)


def _launch(args: list[str], workers: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warn", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ROUTER_READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"router exited during startup:\n{proc.stderr.read()[-3000:]}")
        try:
            ready = httpx.get(url + "/readiness", timeout=2).json()
            if ready.get("healthy_workers") == workers:
                return proc, url
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("router did not report its workers healthy")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def finished(urls: list[str]) -> list[int]:
    return [httpx.get(u + "/hicache/stats", timeout=30).json()["requests_finished"] for u in urls]


def run_policy(args, replicas: list[str], policy: str) -> dict:
    for u in replicas:
        httpx.post(u + "/flush_cache", timeout=60).raise_for_status()
    router, args.url = start_router(replicas, policy)
    try:
        before = finished(replicas)
        result = asyncio.run(multiturn.run(args, multiturn.MultiTurn(args)))
        result["per_replica_requests"] = [a - b for a, b in zip(finished(replicas), before)]
    finally:
        stop(router)
    result["policy"] = policy
    return result


def run_dp(args, ours, policy: str) -> dict:
    """One `hicache serve --dp-size N` with `policy` as its load-balance method, fresh for the policy."""
    flags = shlex.split(ours.server_flags.replace("{policy}", policy))  # e.g. an L3 path of its own
    proc, args.url = start_server([*flags, "--dp-size", str(ours.dp_size), "--load-balance-method", policy])
    try:
        result = asyncio.run(multiturn.run(args, multiturn.MultiTurn(args)))
        stats = httpx.get(args.url + "/hicache/stats", timeout=30).json()
    finally:
        stop(proc)
    result["per_replica_requests"] = [r.get("requests_finished", 0) for r in stats["replicas"]]
    result["router"] = stats["router"]
    result["policy"], result["dp_size"] = policy, ours.dp_size
    return result


def run_servers(args, ours) -> list[dict]:
    """`--replicas` servers behind sglang-router, one policy after the other."""
    servers = []
    try:
        for _ in range(ours.replicas):
            servers.append(start_server(shlex.split(ours.server_flags)))
        replicas = [url for _, url in servers]
        return [run_policy(args, replicas, policy) for policy in ours.policies]
    finally:
        for proc, _ in servers:
            stop(proc)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--dp-size", type=int, default=0,
                   help="replicas inside one server (--dp-size) instead of servers behind sglang-router")
    p.add_argument("--server-flags", default=SERVER_FLAGS, help="flags of every replica's `hicache serve`")
    p.add_argument("--policies", nargs=2, default=["cache_aware", "round_robin"], help="the policy and its baseline")
    ours, rest = p.parse_known_args(argv)
    args = multiturn.parse_args(rest if "--log-file" in rest else [*rest, "--log-file", str(LOG)])
    args.benchmark, args.flush, args.api = "router", False, "native"
    if ours.dp_size:
        args.benchmark = "dp"
        results = [run_dp(args, ours, policy) for policy in ours.policies]
    else:
        results = run_servers(args, ours)
    for r in results:
        print(f"== {r['policy']}: requests per replica {r['per_replica_requests']}")
        print(multiturn.report(r))
        multiturn.append_jsonl(r, args.log_file)
    a, b = results
    print(f"{a['policy']} / {b['policy']}: cache hit rate x{a['cache_hit_rate'] / max(b['cache_hit_rate'], 1e-9):.2f}, "
          f"input throughput x{a['input_token_throughput'] / b['input_token_throughput']:.2f}, "
          f"request throughput x{a['request_throughput'] / b['request_throughput']:.2f}")


if __name__ == "__main__":
    main()
