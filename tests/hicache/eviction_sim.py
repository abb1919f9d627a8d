"""Multi-session workloads played through the real `CacheManager` on fake tiers, to compare eviction
policies by their L1 + L2 hit rate (cached / prompt tokens) per round.

A workload is a list of rounds; a round is a list of requests (token stream, prompt length,
answer length). Up to `in_flight` requests hold their leases at once (admitted in order, the
oldest released first), as a scheduler running a batch would. Caches are sized from the final
working set (every stream's longest prefix): L1 `l1` of it, L2 `l2` of it.

Imported by tests/hicache/test_eviction_cycles.py and by benchmarks/eviction.py (which puts this
folder on sys.path).
"""
from __future__ import annotations

import random
from typing import NamedTuple

from hicache.manager import CacheManager, Lease
from hicache.tree import RadixTree
import cache_fakes as fakes

PS = 4


class Request(NamedTuple):
    stream: list[int]
    prompt: int
    answer: int


class Workload(NamedTuple):
    name: str
    rounds: list[list[Request]]
    l1: float  # L1 size as a fraction of the final working set
    l2: float  # L2 size, the same way (once full, L2 gives up its copies of what L1 holds)
    in_flight: int = 8
    retokenized: bool = False  # the next turn's prompt differs from the generated answer in its last token
    warmup: tuple[Request, ...] = ()  # played first, not measured (a benchmark's priming run)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 1 << 30) for _ in range(n)]


def _six_rounds(reqs: list[Request]) -> list[list[Request]]:
    per = len(reqs) // 6
    return [reqs[i:i + per] for i in range(0, 6 * per, per)]


def sessions(name: str, conversations: int, rounds: int, first: int, question: int, answer: int,
             l1: float, l2: float, in_flight: int = 8, seed: int = 0, shared: int = 0,
             retokenized: bool = False, primed: int = 0) -> Workload:
    """Conversations that come back in turn: round r asks each one, in the same order, its r-th
    question after its previous answers. `shared` tokens of system prompt open every stream.
    `primed` conversations of other tokens play every round first, unmeasured (they come back
    after a few requests, where the measured ones take a whole round)."""
    rng = random.Random(seed)
    system = _tokens(rng, shared)
    final = first + rounds * (answer + question)
    streams = [system + _tokens(rng, final) for _ in range(conversations)]
    primes = [system + _tokens(rng, final) for _ in range(primed)]
    out, warmup = [], []
    for r in range(rounds):
        length = shared + first + r * (answer + question)
        out.append([Request(s, length, answer) for s in streams])
        warmup.extend(Request(s, length, answer) for s in primes)
    return Workload(name, out, l1, l2, in_flight, retokenized, tuple(warmup))


def agent(name: str, turns: int, first: int, step: int, noise: int, noise_len: int, l1: float, l2: float,
          seed: int = 0) -> Workload:
    """One conversation extended turn after turn (a tool-calling agent), `noise` one-off prompts
    of `noise_len` tokens between its turns; a round is 8 turns."""
    rng = random.Random(seed)
    stream = _tokens(rng, first + turns * step)
    reqs = []
    for t in range(turns):
        reqs.append(Request(stream, first + t * step, 4))
        reqs.extend(Request(_tokens(rng, noise_len + 4), noise_len, 4) for _ in range(noise))
    return Workload(name, _six_rounds(reqs), l1, l2, in_flight=2)


def rolling(name: str, users: int, live: int, turns: int, first: int, question: int, answer: int,
            l1: float, l2: float, shared: int = 0, seed: int = 0) -> Workload:
    """Sessions that come and go: `live` at a time, each asks `turns` questions in turn with the
    others, then leaves and a new one takes its place (staggered); `shared` tokens of system prompt
    open every stream. Six rounds of equal length."""
    rng = random.Random(seed)
    system = _tokens(rng, shared)
    streams = [system + _tokens(rng, first + turns * (question + answer)) for _ in range(users)]
    asked = [0] * users
    active, nxt, reqs = [], 0, []
    for u in range(live):
        active.append(u)
        asked[u] = -u * turns // live  # staggered: sessions do not all end together
        nxt = u + 1
    while active:
        for u in list(active):
            if asked[u] >= 0:
                reqs.append(Request(streams[u], shared + first + asked[u] * (question + answer), answer))
            asked[u] += 1
            if asked[u] == turns:
                active.remove(u)
                if nxt < users:
                    active.append(nxt)
                    nxt += 1
    return Workload(name, _six_rounds(reqs), l1, l2)


def zipf(name: str, conversations: int, requests: int, first: int, question: int, answer: int, l1: float,
         l2: float, s: float = 1.0, seed: int = 0) -> Workload:
    """Conversations picked at random with Zipf(s) popularity, each pick asks the next question."""
    rng = random.Random(seed)
    weights = [1 / (k + 1) ** s for k in range(conversations)]
    picks = rng.choices(range(conversations), weights, k=requests)
    turns = [0] * conversations
    streams = [_tokens(rng, first + (picks.count(c) + 1) * (question + answer)) for c in range(conversations)]
    reqs = []
    for c in picks:
        reqs.append(Request(streams[c], first + turns[c] * (question + answer), answer))
        turns[c] += 1
    return Workload(name, _six_rounds(reqs), l1, l2, in_flight=2)


def working_set(w: Workload) -> int:
    """Distinct tokens, in whole pages, of every stream's longest cached prefix (prompt + answer)
    over the whole workload (a shared prefix counts once)."""
    longest: dict[int, tuple[list[int], int]] = {}
    for rnd in w.rounds:
        for q in rnd:
            longest[id(q.stream)] = (q.stream, max(longest.get(id(q.stream), (q.stream, 0))[1], q.prompt + q.answer))
    pages = set()
    for stream, n in longest.values():
        h = 0
        for i in range(0, n - PS + 1, PS):
            h = hash((h, tuple(stream[i:i + PS])))
            pages.add(h)
    return len(pages) * PS


def play(policy: str, w: Workload) -> list[float]:
    """The hit rate (L1 + L2 cached / prompt tokens) of each round of `w` under `policy`."""
    ws = working_set(w)
    device_pages, host_pages = max(8, int(ws * w.l1) // PS), max(8, int(ws * w.l2) // PS)
    alloc = fakes.FakeAllocator(device_pages, PS)
    host_pool = fakes.FakeHostPool(host_pages, PS)
    tree = RadixTree(alloc, PS, policy, host_allocator=host_pool.allocator)
    cache = CacheManager.build(tree, fakes.FakeTable(w.in_flight + 1), host_pool, fakes.FakeTransfer({}, {}),
                               load_back_min_tokens=1)
    held: list[tuple[Lease, Request]] = []
    rates = []
    for rnd in (list(w.warmup), *w.rounds):
        hit = prompt = 0
        for q in rnd:
            if len(held) == w.in_flight:
                _release(cache, *held.pop(0), w.retokenized)
            got, lease = _admit(cache, q)
            if got is None:  # no L1 room while others run: wait for them, as the scheduler would
                while held:
                    _release(cache, *held.pop(0), w.retokenized)
                got, lease = _admit(cache, q)
            assert got is not None, "the simulated cache is too small"
            hit, prompt = hit + got.prefix, prompt + q.prompt
            held.append((lease, q))
        rates.append(hit / prompt if prompt else 0.0)
    while held:
        _release(cache, *held.pop(0), w.retokenized)
    return rates[1:]


def _admit(cache: CacheManager, q: Request):
    """Admits `q` and grows it to its answer's end: (Admission, lease), or (None, lease) holding
    nothing when L1 has no room."""
    tokens = q.stream[:q.prompt]
    lease = Lease("", owner=tokens)
    got = cache.admit(lease, cache.match(tokens[:-1], ""), PS)
    if got is not None and not cache.grow(lease, q.prompt + q.answer):
        _release(cache, lease, q, keep=False)
        got = None
    cache.poll([])
    return got, lease


def _release(cache: CacheManager, lease: Lease, q: Request, retokenized: bool = False, keep: bool = True) -> None:
    """Caches what `q` computed: its prompt and answer (whose last token, `retokenized`, is not
    the one its stream's next prompt has)."""
    end = q.prompt + q.answer
    computed = q.stream[:end - 1] + [-q.stream[end - 1]] if retokenized else q.stream[:end]
    cache.release(lease, computed, q.prompt, keep)


def workloads() -> list[Workload]:
    """The workloads the policies are compared on. cyclic-64: the page-64 serving shape (2k-token
    first turns, 256-token questions, 64-token answers) scaled down 16x to page 4, 64
    conversations, 8 in flight, round 0 alone larger than L1 + L2; -long-first: 4k-shaped first turns; -primed: the same after two conversations
    that came back quickly (a benchmark's unmeasured priming run);
    -retokenized: each next prompt differs from the cached answer in its last token (a chat
    template's end of turn); cyclic-24: fewer, faster-growing conversations played one at a time;
    cyclic-shared-prompt: every conversation opens with one system prompt. Where recency matters:
    few-fit (the working set fits L2), agent (one conversation extended among one-off prompts),
    rolling-sessions (sessions come and go), shared-prompt-users (short sessions of many users
    under one system prompt), zipf-64 (popular conversations come back more often)."""
    return [
        sessions("cyclic-64", 64, 6, 128, 16, 4, 0.1, 0.4),
        sessions("cyclic-64-long-first", 64, 6, 256, 16, 4, 0.1, 0.4),
        sessions("cyclic-64-long-first-primed", 64, 6, 256, 16, 4, 0.1, 0.4, primed=2),
        sessions("cyclic-64-retokenized", 64, 6, 128, 16, 4, 0.1, 0.4, retokenized=True),
        sessions("cyclic-24", 24, 6, 64, 16, 8, 0.1, 0.5, in_flight=1, seed=7),
        sessions("few-fit", 8, 6, 128, 16, 4, 0.4, 1.2, in_flight=2),
        agent("agent", 48, 64, 24, 3, 96, 0.1, 0.4),
        rolling("rolling-sessions", 96, 8, 6, 96, 16, 4, 0.1, 0.3),
        rolling("shared-prompt-users", 160, 16, 3, 16, 16, 4, 0.25, 0.4, shared=128),
        zipf("zipf-64", 64, 384, 64, 8, 2, 0.2, 0.4),
        sessions("cyclic-shared-prompt", 64, 6, 96, 16, 4, 0.2, 0.5, shared=32),
    ]
