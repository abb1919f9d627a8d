"""The frontend language's overhead: `run_batch` of N two-turn chat programs against the same
requests sent directly (the chat API, each conversation's two turns in order on one thread), with
the same concurrency, greedy and `ignore_eos` so that both do the same work.

Each repetition flushes the cache before each mode, so neither inherits the other's prefixes.
Prints both throughputs (output tokens per second) and their ratio (lang / direct), and appends a
JSON line to `--log-file`.

    .venv/bin/python benchmarks/lang.py                                  # an in-process Engine
    .venv/bin/python benchmarks/lang.py --url http://127.0.0.1:30000     # a running hicache serve
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import hicache.lang as sgl

RESULTS = Path(__file__).resolve().parent / "results"
SYSTEM = "You are a helpful assistant. Answer in plain words."
TOPICS = ("rivers", "bridges", "clocks", "bees", "maps", "salt", "glass", "paper", "trains", "tea", "wind", "ink",
          "bread", "iron", "snow", "silk")
FOLLOW_UP = "Now say it again in fewer words."


@sgl.function
def two_turns(s, question, max_tokens):
    s += sgl.system(SYSTEM)
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=max_tokens))
    s += sgl.user(FOLLOW_UP)
    s += sgl.assistant(sgl.gen("short", max_tokens=max_tokens))


def questions(n: int) -> list[str]:
    return [f"Question {i}: what should I know about {TOPICS[i % len(TOPICS)]}?" for i in range(n)]


class Direct:
    """The same conversations as plain chat calls on the backend's own API."""

    def __init__(self, backend: sgl.Backend, max_tokens: int):
        self.backend, self.max_tokens = backend, max_tokens

    def chat(self, messages: list[dict]) -> tuple[str, int]:
        params = {"max_new_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True}
        if isinstance(self.backend, sgl.RuntimeEndpoint):
            body = {"messages": messages, "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True}
            res = self.backend.client.post("/v1/chat/completions", json=body)
            res.raise_for_status()
            out = res.json()
            return out["choices"][0]["message"]["content"], out["usage"]["completion_tokens"]
        out = self.backend.engine.chat(messages, params)
        return out["text"], out["meta_info"]["completion_tokens"]

    def conversation(self, question: str) -> int:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        answer, first = self.chat(messages)
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": FOLLOW_UP}]
        return first + self.chat(messages)[1]


def run_direct(backend: sgl.Backend, qs: list[str], max_tokens: int, threads: int) -> int:
    direct = Direct(backend, max_tokens)
    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(direct.conversation, qs))


def run_lang(backend: sgl.Backend, qs: list[str], max_tokens: int, threads: int, progress: bool) -> int:
    states = two_turns.run_batch([{"question": q, "max_tokens": max_tokens} for q in qs], temperature=0,
                                 ignore_eos=True, num_threads=threads, progress_bar=progress, backend=backend)
    failed = [s.error() for s in states if s.error() is not None]
    if failed:
        raise failed[0]
    return sum(s.get_meta_info(n)["completion_tokens"] for s in states for n in ("answer", "short"))


def timed(fn, *args) -> float:
    """Output tokens per second of fn(*args) (which returns its output token count)."""
    start = time.perf_counter()
    tokens = fn(*args)
    return tokens / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running hicache serve (default: an in-process Engine on the default model)")
    p.add_argument("--api-key")
    p.add_argument("--num-programs", type=int, default=64)
    p.add_argument("--num-threads", type=int, default=64, help="concurrency of both modes")
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens of each turn")
    p.add_argument("--repeats", type=int, default=2, help="runs of each mode (alternating); the median is reported")
    p.add_argument("--log-file", default=str(RESULTS / "lang.jsonl"))
    args = p.parse_args()
    backend = sgl.RuntimeEndpoint(args.url, api_key=args.api_key) if args.url else sgl.EngineBackend(sgl.Engine())
    qs = questions(args.num_programs)
    flush = backend.flush_cache
    flush()
    run_lang(backend, qs[:4], args.max_tokens, 4, False)  # warm-up: first calls, template framing
    rates: dict[str, list[float]] = {"direct": [], "lang": []}
    for _ in range(args.repeats):
        flush()
        rates["direct"].append(timed(run_direct, backend, qs, args.max_tokens, args.num_threads))
        flush()
        rates["lang"].append(timed(run_lang, backend, qs, args.max_tokens, args.num_threads, True))
    direct, lang = statistics.median(rates["direct"]), statistics.median(rates["lang"])
    print(f"backend {'endpoint ' + args.url if args.url else 'engine'}: {args.num_programs} programs, "
          f"{args.num_threads} threads, 2 turns x {args.max_tokens} tokens")
    print(f"direct: {direct:.1f} output tok/s   lang run_batch: {lang:.1f} output tok/s   ratio {lang / direct:.3f}")
    record = {"backend": "endpoint" if args.url else "engine", "num_programs": args.num_programs,
              "num_threads": args.num_threads, "max_tokens": args.max_tokens, "direct_tok_s": rates["direct"],
              "lang_tok_s": rates["lang"], "ratio": lang / direct, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    Path(args.log_file).parent.mkdir(parents=True, exist_ok=True)
    with open(args.log_file, "a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
