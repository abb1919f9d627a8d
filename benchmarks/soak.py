"""Soak: a real server under concurrent multi-turn traffic for `--minutes` (default 15), with a tiny
L1 (`--max-total-tokens`, default 2,048) so that L2 and L3 (LMDB under a temporary folder, capped at
`--l3-cap-gb`) churn all along.

`--clients` clients each hold a conversation: its first prompt is one of `--prefixes` shared
prefixes plus a question, every later turn adds the answer and a new question; a conversation that
reaches `--max-context` tokens is parked and another starts. With probability `--resume` a client
resumes a parked conversation instead, whose prefix has been evicted from L1 since, and often from
L2: it comes back from L2 or L3. Prompts are random token ids (exact lengths); outputs are greedy
with `ignore_eos`.

Every `--report-every` seconds (30) the clients pause, the server drains (nothing running, queued or
in flight between tiers), and one line is printed: the RSS of the API process and of the scheduler
process, their drift since the end of warm-up (the first report after `--warmup-s` with L2 full,
so that L2's pages are resident) with its anonymous and file-backed parts (file-backed: pages of
LMDB's map that were read; the backend drops a value's pages once it is copied out, so only the
B-trees' stay, and those are page cache the kernel reclaims), requests and request errors so far,
the leaked pages (L1 pages that neither the tree nor a request holds, and the same for L2, at that
idle point), and the tokens each tier served. Exits 1 on any request error, any leaked page, or a
server process that died.

    .venv/bin/python benchmarks/soak.py                 # starts its own server, 15 minutes
    .venv/bin/python benchmarks/soak.py --minutes 3     # a smoke run
    .venv/bin/python benchmarks/soak.py --url http://127.0.0.1:30000 --api-pid PID   # a running server

RSS is read from /proc (Linux).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

MIB = 1 << 20
TIERS = ("device", "host", "storage")


# ---- the server -------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(args, port: int, workdir: Path) -> list[str]:
    extra = {"path": str(workdir / "lmdb"), "size_cap_gb": args.l3_cap_gb, "prefetch_threshold": 64}
    return [sys.executable, "-m", "hicache.server.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--max-total-tokens", str(args.max_total_tokens), "--context-length", str(args.max_context),
            "--page-size", str(args.page_size), "--max-running-requests", str(args.clients),
            "--chunked-prefill-size", "512", "--hicache-ratio", str(args.hicache_ratio),
            "--hicache-storage-backend", "lmdb", "--hicache-storage-backend-extra-config", json.dumps(extra),
            *args.server_arg]


def start_server(args, workdir: Path) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    log = workdir / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(server_command(args, port, workdir), stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"soak: the server exited with {proc.returncode} at start-up; see {log}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, log
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"soak: the server did not become healthy in {args.startup_timeout} s; see {log}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def rss_mib(pid: int | None) -> float | None:
    """Resident memory of `pid` in MiB (None: unknown or gone)."""
    return memory(pid).get("VmRSS")


def memory(pid: int | None) -> dict[str, float]:
    """VmRSS and its parts RssAnon, RssFile (the LMDB map's pages read), RssShmem of `pid`, in MiB
    ({}: unknown or gone)."""
    if pid is None:
        return {}
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS", "Rss")))
    except OSError:
        return {}
    return {k: int(v.split()[0]) / 1024 for k, v in fields.items()}


# ---- the workload -----------------------------------------------------------------------------


@dataclass
class Conversation:
    ids: list[int]
    turns: int = 0


@dataclass
class Tally:
    requests: int = 0
    errors: int = 0
    first_errors: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    cached: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))

    def error(self, message: str) -> None:
        self.errors += 1
        if len(self.first_errors) < 5:
            self.first_errors.append(message[:300])


class Workload:
    """Conversations over shared prefixes; parked ones come back with probability `resume`."""

    def __init__(self, args):
        self.args, self.rng = args, random.Random(args.seed)
        self.prefixes = [self.tokens(args.prefix_length) for _ in range(args.prefixes)]
        self.parked: list[Conversation] = []

    def tokens(self, n: int) -> list[int]:
        lo, hi = self.args.vocab_range
        return [self.rng.randrange(lo, hi) for _ in range(n)]

    def room(self) -> int:
        """Longest history that leaves room for a question and its answer."""
        return self.args.max_context - self.args.question_length - self.args.output_length

    def next(self) -> Conversation:
        """A parked conversation, its whole history kept as far as it fits (with probability
        `resume`), else a new one over a shared prefix; plus a new question."""
        if self.parked and self.rng.random() < self.args.resume:
            conv = self.parked.pop(self.rng.randrange(len(self.parked)))
            conv.ids = conv.ids[:self.room()]
        else:
            conv = Conversation(list(self.rng.choice(self.prefixes)))
        conv.ids = conv.ids + self.tokens(self.args.question_length)
        return conv

    def done(self, conv: Conversation, output: list[int]) -> Conversation | None:
        """The conversation's next state, or None once it is parked (`--turns` done, or no room)."""
        conv.ids, conv.turns = conv.ids + output, conv.turns + 1
        if len(conv.ids) > self.room() or conv.turns >= self.args.turns:
            conv.turns = 0
            self.parked.append(conv)
            del self.parked[:-256]
            return None
        conv.ids = conv.ids + self.tokens(self.args.question_length)
        return conv


class Driver:
    def __init__(self, args, http: httpx.AsyncClient):
        self.args, self.http = args, http
        self.workload, self.tally = Workload(args), Tally()
        self.gate = asyncio.Event()
        self.gate.set()
        self.in_flight = 0
        self.stop = False

    async def client(self) -> None:
        conv = None
        while not self.stop:
            await self.gate.wait()
            if self.stop:
                return
            conv = conv or self.workload.next()
            self.in_flight += 1
            try:
                output = await self.request(conv.ids)
            finally:
                self.in_flight -= 1
            conv = self.workload.done(conv, output) if output is not None else None

    async def request(self, ids: list[int]) -> list[int] | None:
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": self.args.output_length,
                                                      "temperature": 0.0, "ignore_eos": True}}
        self.tally.requests += 1
        try:
            r = await self.http.post("/generate", json=body)
        except httpx.HTTPError as e:
            self.tally.error(f"{type(e).__name__}: {e}")
            return None
        if r.status_code != 200:
            self.tally.error(f"HTTP {r.status_code}: {r.text}")
            return None
        out = r.json()
        meta = out["meta_info"]
        if meta.get("completion_tokens") != self.args.output_length:
            self.tally.error(f"{meta.get('completion_tokens')} tokens instead of {self.args.output_length}")
        self.tally.prompt_tokens += meta.get("prompt_tokens", 0)
        for tier, n in (meta.get("cached_tokens_details") or {}).items():
            if tier in self.tally.cached:
                self.tally.cached[tier] += int(n)
        return out["output_ids"]

    async def pause(self, timeout: float) -> bool:
        """Stops the clients between requests; False if requests are still in flight after `timeout`."""
        self.gate.clear()
        end = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < end:
            await asyncio.sleep(0.05)
        return self.in_flight == 0

    def resume(self) -> None:
        self.gate.set()


# ---- measurements -----------------------------------------------------------------------------


async def idle_stats(http: httpx.AsyncClient, timeout: float) -> tuple[dict, bool]:
    """/hicache/stats once the server is idle: nothing running or queued, no copy between tiers in
    flight (False: not idle after `timeout`, the last stats)."""
    end = time.monotonic() + timeout
    while True:
        stats = (await http.get("/hicache/stats")).json()
        tiers = stats.get("tiers", {})
        host, storage = tiers.get("host", {}), tiers.get("storage", {})
        idle = (not stats.get("running") and not stats.get("queued") and not host.get("in_flight")
                and not storage.get("backups_in_flight") and not storage.get("prefetching"))
        if idle or time.monotonic() > end:
            return stats, idle
        await asyncio.sleep(0.1)


def host_full(stats: dict) -> bool:
    """Whether L2 has filled (its pages are resident since): warm-up ends no earlier."""
    host = stats.get("tiers", {}).get("host", {})
    return not host.get("enabled") or host.get("used_tokens", 0) >= 0.9 * host.get("capacity_tokens", 0)


def leaked_pages(stats: dict) -> dict[str, int]:
    """At an idle point: pages in use that neither the tree nor a request holds, per tier."""
    page = stats.get("page_size") or 1
    tiers = stats.get("tiers", {})
    device, host = tiers.get("device", {}), tiers.get("host", {})
    out = {"device": (device.get("used_tokens", 0) - device.get("cached_tokens", 0)) // page
           + stats.get("pages_held", 0)}
    if host.get("enabled"):
        out["host"] = (host.get("used_tokens", 0) - host.get("cached_tokens", 0)) // page
    return out


MEMORY = ("VmRSS", "RssAnon", "RssFile")


@dataclass
class Sample:
    t: float
    mem: dict[str, dict[str, float]]  # process -> VmRSS, RssAnon, RssFile (MiB)
    drift: dict[str, dict[str, float]]  # the same, less the baseline's ({}: still warming up)
    requests: int
    errors: int
    leaked: dict[str, int]
    idle: bool
    storage: dict


def fmt(v: float | None, signed: bool = False) -> str:
    if v is None:
        return "-"
    return f"{v:+.1f}" if signed else f"{v:.1f}"


def process_part(s: Sample, name: str) -> str:
    mem, drift = s.mem.get(name, {}), s.drift.get(name, {})
    return (f"{name} {fmt(mem.get('VmRSS'))} MiB ({fmt(drift.get('VmRSS'), True)}; "
            f"anon {fmt(drift.get('RssAnon'), True)}, file {fmt(drift.get('RssFile'), True)})")


def line(s: Sample, tally: Tally) -> str:
    served = " ".join(f"{t} {tally.cached[t]}" for t in TIERS)
    l3 = s.storage
    return (f"{s.t:6.0f}s  rss {process_part(s, 'api')}  {process_part(s, 'scheduler')}  "
            f"requests {s.requests}  errors {s.errors}  leaked pages {s.leaked}{'' if s.idle else ' (not idle)'}  "
            f"L3 {l3.get('status', '-')}, evicted {l3.get('evicted_tokens', 0)} tok  "
            f"cached tokens {served} of {tally.prompt_tokens}")


def drift_of(mem: dict, baseline: dict | None) -> dict:
    if baseline is None:
        return {}
    return {name: {k: m[k] - baseline[name][k] for k in MEMORY if k in m and k in baseline.get(name, {})}
            for name, m in mem.items()}


async def soak(args, url: str, pids: dict[str, int | None], alive) -> int:
    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=args.clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout, limits=limits) as http:
        driver = Driver(args, http)
        clients = [asyncio.create_task(driver.client()) for _ in range(args.clients)]
        start, baseline, samples, failed = time.monotonic(), None, [], False
        end = start + args.minutes * 60
        while time.monotonic() < end and not failed:
            await asyncio.sleep(min(args.report_every, max(end - time.monotonic(), 0)))
            drained = await driver.pause(args.request_timeout)
            stats, idle = await idle_stats(http, 30.0)
            mem = {name: memory(pid) for name, pid in pids.items()}
            elapsed = time.monotonic() - start
            if baseline is None and elapsed >= args.warmup_s and host_full(stats):
                baseline = mem
            leaked = leaked_pages(stats) if idle and drained else {}
            s = Sample(elapsed, mem, drift_of(mem, baseline), driver.tally.requests, driver.tally.errors, leaked,
                       idle and drained, stats.get("tiers", {}).get("storage", {}) or {})
            samples.append(s)
            print(line(s, driver.tally), flush=True)
            failed = driver.tally.errors > 0 or any(leaked.values()) or not alive()
            driver.resume()
        driver.stop = True
        driver.resume()
        await asyncio.gather(*clients, return_exceptions=True)
    return summary(samples, driver.tally, alive(), args)


def summary(samples: list[Sample], tally: Tally, alive: bool, args) -> int:
    print(f"\nsoak: {len(samples)} reports over {samples[-1].t if samples else 0:.0f} s, {tally.requests} requests, "
          f"{tally.errors} errors, prompt tokens {tally.prompt_tokens}, cached "
          + ", ".join(f"{t} {tally.cached[t]}" for t in TIERS))
    measured = [s for s in samples if s.drift]
    for name in ("api", "scheduler"):
        drifts = [s.drift[name] for s in measured if "VmRSS" in s.drift.get(name, {})]
        if drifts:
            base = measured[0].mem[name]["VmRSS"]
            parts = ", ".join(f"{label} last {d[-1]:+.1f} max {max(d):+.1f}" for label, d in
                              (("RSS", [x["VmRSS"] for x in drifts]), ("anon", [x.get("RssAnon", 0) for x in drifts]),
                               ("file", [x.get("RssFile", 0) for x in drifts])))
            worst = max(abs(x["VmRSS"]) for x in drifts)
            print(f"soak: {name} drift after warm-up ({measured[0].t:.0f} s, RSS {base:.1f} MiB then), MiB: {parts}; "
                  f"largest |RSS drift| {100 * worst / base:.1f}% of it")
    if not measured:
        print(f"soak: no RSS drift measured: warm-up ({args.warmup_s:.0f} s and L2 full) did not end")
    leaks = [s.leaked for s in samples if any(s.leaked.values())]
    print(f"soak: leaked pages at idle points: {leaks[-1] if leaks else 'none'}; "
          f"not idle at {sum(not s.idle for s in samples)} of {len(samples)} checks")
    for message in tally.first_errors:
        print(f"soak: error: {message}")
    if not alive:
        print("soak: a server process died")
    return 1 if tally.errors or leaks or not alive else 0


# ---- main -------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--minutes", type=float, default=15.0)
    p.add_argument("--url", default=None, help="a running server (default: start one)")
    p.add_argument("--api-pid", type=int, default=None, help="with --url: the API process, for its RSS")
    p.add_argument("--clients", type=int, default=8, help="concurrent conversations")
    p.add_argument("--turns", type=int, default=6, help="turns before a conversation is parked")
    p.add_argument("--prefixes", type=int, default=4, help="shared first-prompt prefixes")
    p.add_argument("--prefix-length", type=int, default=256)
    p.add_argument("--question-length", type=int, default=64)
    p.add_argument("--output-length", type=int, default=16)
    p.add_argument("--resume", type=float, default=0.3, help="chance that a client resumes a parked conversation")
    p.add_argument("--max-context", type=int, default=1024, help="longest conversation, and the server's context")
    p.add_argument("--vocab-range", type=int, nargs=2, default=(100, 20000))
    p.add_argument("--report-every", type=float, default=30.0, help="seconds between reports")
    p.add_argument("--warmup-s", type=float, default=60.0,
                   help="RSS drift is measured from the first report after this, once L2 has filled")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--max-total-tokens", type=int, default=2048, help="L1 tokens of the server started here")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--hicache-ratio", type=float, default=2.0, help="L2 size as a multiple of L1")
    p.add_argument("--l3-cap-gb", type=float, default=0.5, help="LMDB size cap (a few L2s: it serves and evicts)")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--server-arg", action="append", default=[], help="one more argument for `hicache serve`")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.url:
        info = httpx.get(args.url + "/get_server_info", timeout=30).json()
        pids = {"api": args.api_pid, "scheduler": info.get("scheduler_pid")}
        return asyncio.run(soak(args, args.url, pids, lambda: True))
    with tempfile.TemporaryDirectory(prefix="hicache-soak-") as tmp:
        proc, url, log = start_server(args, Path(tmp))
        try:
            info = httpx.get(url + "/get_server_info", timeout=30).json()
            pids = {"api": proc.pid, "scheduler": info["scheduler_pid"]}
            print(f"soak: server at {url} (api pid {proc.pid}, scheduler pid {pids['scheduler']}), "
                  f"L1 {args.max_total_tokens} tokens, L2 x{args.hicache_ratio}, L3 LMDB capped at "
                  f"{args.l3_cap_gb} GB; {args.clients} clients for {args.minutes} min", flush=True)
            code = asyncio.run(soak(args, url, pids, lambda: proc.poll() is None
                                    and rss_mib(pids["scheduler"]) is not None))
        finally:
            stop_server(proc)
        if code:
            print(f"soak: server log: {log.read_text(errors='replace')[-3000:]}")
        return code


if __name__ == "__main__":
    sys.exit(main())
