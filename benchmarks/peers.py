"""hicache side by side with vLLM's CPU build and llama.cpp's server, on the same weights, through
the same OpenAI API (see `peer_servers.py` for how each peer is installed and started).

Workloads (`--workloads`; `--quick` shrinks each):
- `multiturn`: `multiturn.py`'s chat workload, 8 conversations x 4 rounds, 128-token turns, 16 new
  tokens (every conversation in flight at once);
- `mixed`: 32 completions of 173 to 947 prompt tokens x 64 new tokens, sent at once;
- `shared`: 32 chat requests sharing a 1,500-token system prompt, each with its own 128-token
  question, x 64 new tokens, sent at once;
and, for every peer, the inter-token latency of one request alone (64 new tokens after a short
prompt), the peak RSS of the server's processes over its run, and a greedy-output check: a few
fixed prompts through /v1/completions at temperature 0, each peer's text against hicache's
(`--workloads` naming none: these alone).

Prompts are random common words (about a token each), new for every repeat and the same for every
peer within a repeat; every request asks for exactly its new tokens (`ignore_eos`, or the end
tokens banned where a server lacks it). One server runs at a time; each repeat starts every
peer's server afresh, in an order rotated by the repeat. The table gives medians over repeats,
the ratios hicache/peer the medians of the per-repeat ratios (throughput: above 1 means hicache
is faster; TTFT and ITL: below 1 means hicache is faster). A JSON line per run goes to `--log-file`.

    .venv/bin/python -u benchmarks/peers.py --quick
    .venv/bin/python -u benchmarks/peers.py --repeats 3 --peers hicache vllm llama.cpp
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import shlex
import statistics
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import httpx

import multiturn
import peer_servers
from proctree import RssSampler

WORKLOADS = ("multiturn", "mixed", "shared")
AGREEMENT_PROMPTS = ("The capital of France is", "Water boils at a temperature of", "Once upon a time, there was",
                     "The three primary colours are", "A list of the planets of the solar system:",
                     "def fibonacci(n):", "The most important invention of the twentieth century was",
                     "To make a cup of tea, first")


class Sizes(NamedTuple):
    clients: int  # multiturn conversations
    rounds: int
    turn: int  # tokens per multiturn question
    turn_out: int
    batch: int  # requests of the mixed and shared workloads
    out: int  # their new tokens
    mixed: tuple[int, int]  # prompt lengths of the mixed workload
    system: int  # the shared system prompt
    question: int  # each shared request's own question
    itl_out: int  # new tokens of the batch-1 decode
    agreement: int  # prompts of the greedy check
    agreement_out: int


FULL = Sizes(8, 4, 128, 16, 32, 64, (173, 947), 1500, 128, 64, 8, 24)
QUICK = Sizes(4, 2, 128, 16, 4, 16, (173, 947), 1500, 128, 32, 3, 16)


class Batch:
    """Requests all ready at once, one round (the shape `multiturn.Driver` drives)."""

    def __init__(self, prompts: list):
        self.prompts, self.round_sizes = prompts, {0: len(prompts)}

    def start(self) -> list[multiturn.Turn]:
        return [multiturn.Turn(i, 0, p) for i, p in enumerate(self.prompts)]

    def complete(self, turn: multiturn.Turn, reply: multiturn.Reply) -> list[multiturn.Turn]:
        return []


class Target(NamedTuple):
    url: str
    model: str
    flags: tuple[str, ...]  # multiturn.py flags this server's clients need


def client_args(t: Target, seed: int, out: int, parallel: int, *more: str) -> argparse.Namespace:
    return multiturn.parse_args(["--api", "openai", "--url", t.url, "--model", t.model, "--seed", str(seed),
                                 "--output-length", str(out), "--max-parallel", str(parallel), "--no-flush",
                                 "--log-file", "", *t.flags, *more])


def workload(name: str, t: Target, seed: int, s: Sizes) -> tuple:
    """(client arguments, workload) of one named workload; `seed` draws its prompts."""
    if name == "multiturn":
        args = client_args(t, seed, s.turn_out, s.clients, "--num-clients", str(s.clients),
                           "--num-rounds", str(s.rounds), "--request-length", str(s.turn))
        return args, multiturn.MultiTurn(args)
    args = client_args(t, seed, s.out, s.batch)
    rng = random.Random(seed)
    if name == "mixed":
        return args, Batch([multiturn.question(rng, rng.randint(*s.mixed), args) for _ in range(s.batch)])
    system = multiturn.question(rng, s.system, args)
    return args, Batch([[{"role": "system", "content": system},
                         {"role": "user", "content": multiturn.question(rng, s.question, args)}]
                        for _ in range(s.batch)])


def run_workload(name: str, t: Target, seed: int, s: Sizes) -> dict:
    args, wl = workload(name, t, seed, s)
    r = asyncio.run(multiturn.run(args, wl))
    counted = r["input_token_throughput"] > 0  # a server streaming no usage leaves the prompt tokens uncounted
    return {"seconds": r["duration_s"], "requests": r["requests"], "output_tokens": r["completion_tokens"],
            "output_tok_s": r["output_token_throughput"],
            "total_tok_s": r["input_token_throughput"] + r["output_token_throughput"] if counted else None,
            "ttft_p50_s": r["ttft_ms"]["p50"] / 1000, "ttft_p90_s": r["ttft_ms"]["p90"] / 1000,
            "cache_hit_rate": r["cache_hit_rate"]}


def decode_itl_ms(t: Target, seed: int, s: Sizes) -> float:
    """Milliseconds per generated token of one request alone, after its first token."""
    args = client_args(t, seed, s.itl_out, 1, "--no-warmup")
    prompt = [{"role": "user", "content": multiturn.question(random.Random(seed), 32, args)}]
    r = asyncio.run(multiturn.run(args, Batch([prompt])))
    return (r["e2e_ms"]["p50"] - r["ttft_ms"]["p50"]) / max(r["completion_tokens"] - 1, 1)


def greedy_texts(t: Target, s: Sizes) -> list[str]:
    texts = []
    for prompt in AGREEMENT_PROMPTS[:s.agreement]:
        body = {"model": t.model, "prompt": prompt, "max_tokens": s.agreement_out, "temperature": 0.0}
        r = httpx.post(t.url + "/v1/completions", json=body, timeout=600)
        r.raise_for_status()
        texts.append(r.json()["choices"][0]["text"])
    return texts


def run_peer(peer: peer_servers.Peer, python: Path, args, repeat: int, logs: Path) -> dict:
    """One repeat of one peer: its server started, every workload run, the server stopped."""
    extra = tuple(shlex.split(args.hicache_args)) if peer.name == "hicache" else ()
    server, flags = peer_servers.start(peer, python, peer_servers.peers_home(), args.threads,
                                       logs / f"{peer.name}-{repeat}.log", extra)
    sampler = RssSampler(server.proc.pid)
    out: dict = {"startup_s": round(server.startup_s, 1)}
    try:
        t = Target(server.url, httpx.get(server.url + "/v1/models", timeout=60).json()["data"][0]["id"], flags)
        for i, name in enumerate(args.workloads):
            t0 = time.monotonic()
            out[name] = run_workload(name, t, args.seed + 100 * repeat + i, args.sizes)
            print(f"  {peer.name} {name}: {out[name]['seconds']:.1f} s ({time.monotonic() - t0:.0f} s)", flush=True)
        out["itl_ms"] = decode_itl_ms(t, args.seed + 100 * repeat + 99, args.sizes)
        if repeat == 0:
            out["greedy"] = greedy_texts(t, args.sizes)
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"[:300]
        print(f"  {peer.name} failed: {out['error']}\n{server.log_tail(15)}", flush=True)
    finally:
        out["rss_mib"] = round(sampler.close() / 2**20)
        peer_servers.stop(server)
    return out


# ---- summary ----------------------------------------------------------------------------------


def median_of(runs: list[dict], *keys: str) -> float | None:
    vals = [v for v in (_get(r, keys) for r in runs) if v is not None]
    return statistics.median(vals) if vals else None


def _get(run: dict, keys: tuple[str, ...]):
    for k in keys:
        if not isinstance(run, dict) or k not in run:
            return None
        run = run[k]
    return run


def ratio(runs: dict[str, list[dict]], peer: str, keys: tuple[str, ...], invert: bool) -> float | None:
    """Median over repeats of hicache / peer (peer / hicache with `invert`: for times, so that above 1
    means hicache is faster), counting the repeats both ran."""
    pairs = [(_get(h, keys), _get(p, keys)) for h, p in zip(runs["hicache"], runs[peer])]
    vals = [(b / a if invert else a / b) for a, b in pairs if a and b]
    return statistics.median(vals) if vals else None


def _fmt(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def table(runs: dict[str, list[dict]], workloads: list[str]) -> str:
    lines = ["| workload | peer | seconds | output tok/s | total tok/s | TTFT p50 / p90 (s) |",
             "|---|---|---:|---:|---:|---|"]
    for w in workloads:
        for peer, rs in runs.items():
            seconds, out_tps, total_tps, p50, p90 = (median_of(rs, w, k) for k in (
                "seconds", "output_tok_s", "total_tok_s", "ttft_p50_s", "ttft_p90_s"))
            lines.append(f"| {w} | {peer} | {_fmt(seconds, '.1f')} | {_fmt(out_tps, '.1f')} | "
                         f"{_fmt(total_tps, '.0f')} | {_fmt(p50)} / {_fmt(p90)} |")
    lines += ["", "| peer | ITL at batch 1 (ms) | peak RSS (MiB) | startup (s) |", "|---|---:|---:|---:|"]
    for peer, rs in runs.items():
        lines.append(f"| {peer} | {_fmt(median_of(rs, 'itl_ms'), '.1f')} | {_fmt(median_of(rs, 'rss_mib'), '.0f')} | "
                     f"{_fmt(median_of(rs, 'startup_s'), '.0f')} |")
    others = [p for p in runs if p != "hicache"]
    if "hicache" not in runs or not others:
        return "\n".join(lines)
    lines += ["", "Ratios hicache / peer, medians of per-repeat ratios (throughput: > 1 hicache faster; "
              "TTFT, ITL, RSS: < 1 hicache lower).", "",
              "| peer | " + " | ".join(f"{w} throughput | {w} TTFT p50" for w in workloads) + " | ITL | RSS |",
              "|---|" + "---:|" * (2 * len(workloads) + 2)]
    for peer in others:
        cells = [f"{_fmt(ratio(runs, peer, (w, 'seconds'), True))} | "
                 f"{_fmt(ratio(runs, peer, (w, 'ttft_p50_s'), False))}" for w in workloads]
        lines.append(f"| {peer} | " + " | ".join(cells) + f" | {_fmt(ratio(runs, peer, ('itl_ms',), False))} | "
                     f"{_fmt(ratio(runs, peer, ('rss_mib',), False))} |")
    return "\n".join(lines)


def agreement(runs: dict[str, list[dict]]) -> list[str]:
    ref = _get(runs.get("hicache", [{}])[0], ("greedy",))
    out = []
    for peer, rs in runs.items():
        texts = _get(rs[0], ("greedy",))
        if peer == "hicache" or not ref or not texts:
            continue
        same = sum(a == b for a, b in zip(ref, texts))
        out.append(f"greedy outputs, {peer} vs hicache: {same} of {len(ref)} identical")
        out += [f"  {a!r} | {b!r}" for a, b in zip(ref, texts) if a != b]
    return out


# ---- running ----------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", nargs="+", choices=list(peer_servers.PEERS), default=list(peer_servers.PEERS))
    p.add_argument("--workloads", nargs="*", choices=WORKLOADS, default=list(WORKLOADS),
                   help="none (`--workloads` alone): the batch-1 ITL, RSS and greedy check only")
    p.add_argument("--repeats", type=int, default=None, help="default: 3, or 1 with --quick")
    p.add_argument("--quick", action="store_true", help="small workloads (a smoke run)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="CPU threads of llama.cpp's server")
    p.add_argument("--hicache-args", default="",
                   help="more flags of `hicache serve`, e.g. --hicache-args=--disable-cpu-kernels")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--log-file", default=str(multiturn.RESULTS / "peers.jsonl"), help="JSON line appended here")
    args = p.parse_args(argv)
    args.sizes = QUICK if args.quick else FULL
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    home = peer_servers.peers_home()
    pythons = {}
    for name in args.peers:
        installed = peer_servers.install(peer_servers.PEERS[name], home)
        print(f"{name}: {'skipped, ' if installed.python is None else ''}{installed.detail}", flush=True)
        if installed.python is not None:
            pythons[name] = installed.python
    runs: dict[str, list[dict]] = {name: [] for name in pythons}
    names = list(pythons)
    with tempfile.TemporaryDirectory(prefix="hicache-peers-") as tmp:
        try:
            for repeat in range(args.repeats):
                for name in names[repeat % len(names):] + names[:repeat % len(names)]:
                    print(f"repeat {repeat + 1}/{args.repeats}: {name}", flush=True)
                    runs[name].append(run_peer(peer_servers.PEERS[name], pythons[name], args, repeat, Path(tmp)))
        except KeyboardInterrupt:
            print("interrupted: the figures below are those of the runs that finished")
    print("\n" + table(runs, args.workloads))
    print("\n".join(agreement(runs)))
    multiturn.append_jsonl({"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "benchmark": "peers",
                            "args": {k: v for k, v in vars(args).items() if k != "sizes"},
                            "sizes": args.sizes._asdict(), "runs": runs}, args.log_file)


if __name__ == "__main__":
    main()
