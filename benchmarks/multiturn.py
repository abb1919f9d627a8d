"""Multi-turn benchmark: N conversations of R rounds each against a running server.

Round r of a conversation sends everything said so far (every earlier question and answer) plus a
new question of about `--question-length` tokens (round 0: `--request-length`), and asks for
`--output-length` tokens with `ignore_eos`, so that each later round can reuse the KV of the earlier
ones: the traffic a hierarchical KV cache exists for. Questions are drawn from `--seed` before the
run starts, so every run with the same arguments sends the same questions.

Requests leave a ready queue (a conversation's next round becomes ready when its previous one has
finished) at `--request-rate` per second (`--distribution poisson` or `uniform`; `inf`: no pause),
with at most `--max-parallel` in flight. `--round-barrier` holds round r+1 until every conversation
has finished round r.

Two client protocols, so that another engine can be measured the same way:
- `--api native`: SGLang's `POST /generate`, streamed, with `input_ids` (exact lengths; random
  token ids from `--vocab-range`) or `text` (`--native-input text`); reads `meta_info.cached_tokens`
  and `cached_tokens_details` {device, host, storage}.
- `--api openai`: `POST /v1/chat/completions`, streamed with `stream_options.include_usage`; the
  history is a list of messages; reads `usage.prompt_tokens_details.cached_tokens` (and
  `cached_tokens_details` where the server gives it). Text questions are random common words
  (about one token each); the server's `prompt_tokens` are what the report counts.

Reported: TTFT, inter-token latency and end-to-end latency (mean, p50, p90, p99), input and output
token throughput, request throughput, the cache hit rate (cached / prompt tokens) overall, per tier
and per round, and the working set (the sum over conversations of their final length). One JSON
line per run is appended to `--log-file`.

    .venv/bin/python benchmarks/multiturn.py --url http://127.0.0.1:30000 \\
        --num-clients 16 --num-rounds 6 --request-length 256 --output-length 16 --max-parallel 16
    .venv/bin/python benchmarks/multiturn.py --api openai --url http://other-engine:8000 --model NAME

`benchmarks/compare.py` runs this workload against the server in several cache configurations.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx

from bench_results import TIERS, Record, append_jsonl, report, summarize  # noqa: F401 (callers use them from here)

RESULTS = Path(__file__).resolve().parent / "results"
WORDS = """time year people way day man thing woman life child world school state family student group
country problem hand part place case week company system program question work government number
night point home water room mother area money story fact month lot right study book eye job word
business issue side kind head house service friend father power hour game line end member law car
city community name president team minute idea kid body information back parent face others level
office door health person art war history party result change morning reason research girl guy
moment air teacher force education foot boy age policy process music market sense nation plan
college interest death experience effect use class control care field development role effort rate
heart drug show leader light voice wife police mind price report decision son view relationship town
road arm difference value building action model season society tax director position player record
paper space ground form event official matter center couple site project activity star table need
court oil situation cost industry figure street image phone data picture practice piece land product
doctor wall patient worker news test movie north love support technology step baby computer type
attention film tree source organization hair window evidence population truth song""".split()


# ---- workload ---------------------------------------------------------------------------------


@dataclass
class Turn:
    """One request: `prompt` is input ids, text, or chat messages, as the API wants."""

    session: int
    round: int
    prompt: list


@dataclass
class Reply:
    events: list[tuple[float, int]]  # (arrival time, new tokens) per streamed chunk with tokens
    output: list | str  # output ids (native ids) or text
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cached_by_tier: dict[str, int]


def question(rng: random.Random, length: int, args) -> list | str:
    """A new question of `length` tokens: token ids in input_ids mode, otherwise words."""
    if uses_ids(args):
        return [rng.randrange(*args.vocab_range) for _ in range(length)]
    return " " + " ".join(rng.choice(WORDS) for _ in range(length))


def uses_ids(args) -> bool:
    return args.api == "native" and args.native_input == "ids"


def draw_length(rng: random.Random, length: int, ratio: float) -> int:
    return rng.randint(max(1, int(length * ratio)), length)


class MultiTurn:
    """N conversations; the next round of one becomes ready when its previous round's reply is in."""

    def __init__(self, args):
        rng = random.Random(args.seed)
        self.args = args
        self.questions = [[question(rng, draw_length(rng, args.request_length if r == 0 else args.question_length,
                                                     args.range_ratio), args)
                           for r in range(args.num_rounds)] for _ in range(args.num_clients)]
        self.history: list[list | str] = [[] if uses_ids(args) or args.api == "openai" else ""
                                          for _ in range(args.num_clients)]
        self.round_sizes = {r: args.num_clients for r in range(args.num_rounds)}

    def start(self) -> list[Turn]:
        return [self._turn(c, 0) for c in range(self.args.num_clients)]

    def complete(self, turn: Turn, reply: Reply) -> list[Turn]:
        if self.args.api == "openai":
            self.history[turn.session] = turn.prompt + [{"role": "assistant", "content": reply.output}]
        else:
            self.history[turn.session] = turn.prompt + reply.output
        nxt = turn.round + 1
        return [self._turn(turn.session, nxt)] if nxt < self.args.num_rounds else []

    def _turn(self, c: int, r: int) -> Turn:
        q = self.questions[c][r]
        if self.args.api == "openai":
            return Turn(c, r, self.history[c] + [{"role": "user", "content": q}])
        return Turn(c, r, self.history[c] + q)


# ---- protocols --------------------------------------------------------------------------------


async def sse_data(response: httpx.Response):
    """The JSON payloads of an SSE stream, up to `data: [DONE]`; an error event raises."""
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return
        data = json.loads(line[6:])
        if "error" in data:
            raise RuntimeError(f"server error in stream: {data['error']}")
        yield data


def tier_counts(details: dict | None) -> dict[str, int]:
    return {t: int(details[t]) for t in TIERS if t in details} if details else {}


async def native_request(http: httpx.AsyncClient, turn: Turn, args) -> Reply:
    body = {"input_ids" if uses_ids(args) else "text": turn.prompt, "stream": True,
            "sampling_params": {"max_new_tokens": args.output_length, "temperature": 0.0, "ignore_eos": True}}
    events, seen, last = [], 0, None
    async with http.stream("POST", "/generate", json=body) as r:
        await _check(r)
        async for last in sse_data(r):
            n = len(last["output_ids"])  # cumulative
            if n > seen:
                events.append((time.perf_counter(), n - seen))
                seen = n
    if last is None:
        raise RuntimeError("empty /generate stream")
    meta = last["meta_info"]
    return Reply(events, last["output_ids"] if uses_ids(args) else last["text"], meta["prompt_tokens"],
                 meta["completion_tokens"], meta.get("cached_tokens", 0),
                 tier_counts(meta.get("cached_tokens_details")))


async def openai_request(http: httpx.AsyncClient, turn: Turn, args) -> Reply:
    """A chat turn (a list of messages) through /v1/chat/completions, a text prompt through /v1/completions."""
    chat = not isinstance(turn.prompt, str)
    body = {"model": args.model, "messages" if chat else "prompt": turn.prompt, "max_tokens": args.output_length,
            "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            **args.extra_body}
    events, parts, usage = [], [], None
    async with http.stream("POST", "/v1/chat/completions" if chat else "/v1/completions", json=body) as r:
        await _check(r)
        async for chunk in sse_data(r):
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                if text:
                    events.append((time.perf_counter(), 1))
                    parts.append(text)
    if usage is None and not args.allow_missing_usage:
        raise RuntimeError("no usage in the stream (the server ignored stream_options.include_usage)")
    usage = usage or {"prompt_tokens": 0, "completion_tokens": len(events)}
    details = usage.get("prompt_tokens_details") or {}
    return Reply(events, "".join(parts), usage["prompt_tokens"], usage["completion_tokens"],
                 details.get("cached_tokens") or 0, tier_counts(details.get("cached_tokens_details")))


async def _check(r: httpx.Response) -> None:
    if r.status_code != 200:
        await r.aread()
        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:500]}")


# ---- driving a workload -----------------------------------------------------------------------


def make_record(turn: Turn, start: float, reply: Reply) -> Record:
    if not reply.events:
        raise RuntimeError(f"no tokens streamed for session {turn.session} round {turn.round}")
    times = [start] + [t for t, _ in reply.events]
    itls = []
    for (a, b), (_, n) in zip(zip(times[1:], times[2:]), reply.events[1:]):
        itls.extend([(b - a) / n] * n)
    return Record(turn.session, turn.round, start, times[1] - start, itls, times[-1] - start, reply.prompt_tokens,
                  reply.completion_tokens, reply.cached_tokens, reply.cached_by_tier)


class Driver:
    """Sends a workload's turns at the arrival rate, within the in-flight cap and round barrier."""

    def __init__(self, workload, send: Callable, args, on_done: Callable[[Record], None] | None = None):
        self.workload, self.send, self.args, self.on_done = workload, send, args, on_done
        self.rng = random.Random(args.seed + 1)
        self.ready: deque[Turn] = deque()
        self.held: dict[int, list[Turn]] = {}
        self.open_round = 0
        self.finished_in_round: dict[int, int] = {}
        self.records: list[Record] = []
        self.wake = asyncio.Event()
        self.slots = asyncio.Semaphore(args.max_parallel)
        self.tasks: set[asyncio.Task] = set()
        self.error: BaseException | None = None

    async def run(self) -> float:
        """Returns the duration from the first send to the last reply; a failed request fails the run."""
        for turn in self.workload.start():
            self._admit(turn)
        t0 = time.perf_counter()
        try:
            while (self.ready or self.held or self.tasks) and self.error is None:
                if not self.ready:
                    self.wake.clear()
                    await self.wake.wait()
                    continue
                await self.slots.acquire()
                task = asyncio.create_task(self._one(self._pop()))
                self.tasks.add(task)
                task.add_done_callback(self._done)
                await asyncio.sleep(self._gap())
        finally:
            for task in self.tasks:
                task.cancel()
        if self.error is not None:
            raise self.error
        return max(r.start + r.e2e for r in self.records) - t0 if self.records else 0.0

    def _pop(self) -> Turn:
        if self.args.ready_queue_policy == "random":
            self.ready.rotate(-self.rng.randrange(len(self.ready)))
        return self.ready.popleft()

    def _gap(self) -> float:
        rate = self.args.request_rate
        if rate == float("inf"):
            return 0.0
        return self.rng.expovariate(rate) if self.args.distribution == "poisson" else self.rng.uniform(0, 2 / rate)

    def _admit(self, turn: Turn) -> None:
        if self.args.round_barrier and turn.round > self.open_round:
            self.held.setdefault(turn.round, []).append(turn)
        else:
            self.ready.append(turn)

    async def _one(self, turn: Turn) -> None:
        start = time.perf_counter()
        try:
            reply = await self.send(turn)
        finally:
            self.slots.release()
        record = make_record(turn, start, reply)
        self.records.append(record)
        if self.on_done:
            self.on_done(record)
        for nxt in self.workload.complete(turn, reply):
            self._admit(nxt)
        self._close_round(turn.round)

    def _close_round(self, r: int) -> None:
        self.finished_in_round[r] = self.finished_in_round.get(r, 0) + 1
        sizes = self.workload.round_sizes
        while self.open_round in sizes and self.finished_in_round.get(self.open_round, 0) == sizes[self.open_round]:
            self.open_round += 1
            self.ready.extend(self.held.pop(self.open_round, []))

    def _done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        self.wake.set()
        if not task.cancelled() and task.exception() is not None:
            for other in self.tasks:
                other.cancel()
            self.error = task.exception()


# ---- running ----------------------------------------------------------------------------------


def client(args) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    width = args.max_parallel + 4
    return httpx.AsyncClient(base_url=args.url, headers=headers, timeout=args.timeout,
                             limits=httpx.Limits(max_connections=width, max_keepalive_connections=width))


async def prepare(http: httpx.AsyncClient, args) -> None:
    """Names the model (openai), warms the server up with one short request, then empties its cache."""
    if args.api == "openai" and not args.model:
        args.model = (await http.get("/v1/models")).json()["data"][0]["id"]
    if args.warmup:
        send = native_request if args.api == "native" else openai_request
        if args.api == "openai":
            prompt = [{"role": "user", "content": "Hello"}]
        else:
            prompt = [args.vocab_range[0]] * 8 if uses_ids(args) else "Hello"
        await send(http, Turn(-1, -1, prompt), args)
    if args.flush:
        await http.post("/flush_cache")  # another engine may not have it: the status is not checked


async def run(args, workload, on_done: Callable[[Record], None] | None = None) -> dict:
    """Runs `workload` against `args.url` and returns the JSON line (not yet written)."""
    async with client(args) as http:
        await prepare(http, args)
        request = native_request if args.api == "native" else openai_request
        driver = Driver(workload, lambda turn: request(http, turn, args), args, on_done)
        duration = await driver.run()
    return {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "benchmark": args.benchmark, "tag": args.tag,
            "url": args.url, "api": args.api,
            "args": {k: "inf" if v == float("inf") else v for k, v in vars(args).items() if k != "api_key"},
            **summarize(driver.records, duration)}


def add_common_args(p: argparse.ArgumentParser) -> None:
    """Arguments every workload shares: the server, protocol, arrivals and logging."""
    p.add_argument("--url", default="http://127.0.0.1:30000")
    p.add_argument("--api", choices=["native", "openai"], default="native",
                   help="native: /generate (SGLang's format); openai: /v1/chat/completions")
    p.add_argument("--native-input", choices=["ids", "text"], default="ids", help="what native /generate is sent")
    p.add_argument("--model", default=None, help="model name for --api openai (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--extra-body", type=json.loads, default={},
                   help="JSON object merged into every --api openai request body (e.g. an engine's logit_bias)")
    p.add_argument("--allow-missing-usage", action="store_true",
                   help="--api openai: a stream without usage counts a token per content chunk and no prompt tokens")
    p.add_argument("--output-length", type=int, default=16, help="tokens generated per request (ignore_eos)")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests per second; inf: no pause")
    p.add_argument("--distribution", choices=["poisson", "uniform"], default="poisson")
    p.add_argument("--max-parallel", type=int, default=16, help="cap on requests in flight")
    p.add_argument("--round-barrier", action="store_true", help="release round r+1 once round r is done")
    p.add_argument("--ready-queue-policy", choices=["fifo", "random"], default="fifo")
    p.add_argument("--range-ratio", type=float, default=1.0, help="lengths drawn uniform in [len*ratio, len]")
    p.add_argument("--vocab-range", type=int, nargs=2, default=[1000, 30000], metavar=("LO", "HI"),
                   help="random token ids for --native-input ids")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the warm-up request")
    p.add_argument("--no-flush", dest="flush", action="store_false", help="keep the server's cache at the start")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per request")
    p.add_argument("--tag", default="", help="a label stored in the JSON line")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-clients", type=int, default=16, help="conversations")
    p.add_argument("--num-rounds", type=int, default=6, help="rounds per conversation")
    p.add_argument("--request-length", type=int, default=256, help="round 0's question, in tokens")
    p.add_argument("--question-length", type=int, default=None,
                   help="later rounds' questions (default: request length)")
    p.add_argument("--log-file", default=str(RESULTS / "multiturn.jsonl"), help="JSON line appended here ('': none)")
    add_common_args(p)
    args = p.parse_args(argv)
    args.benchmark = "multiturn"
    if args.question_length is None:
        args.question_length = args.request_length
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    result = asyncio.run(run(args, MultiTurn(args)))
    print(report(result))
    append_jsonl(result, args.log_file)


if __name__ == "__main__":
    main()
