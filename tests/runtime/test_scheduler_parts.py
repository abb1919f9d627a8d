"""The scheduler's parts one by one, over a fake cache manager (and a fake policy where the
policy's own decisions are not what is tested): the queue state's changes, the prefill planner's
chunks and admissions, the decode planner's tokens, the output processor's finishes and outputs."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from hicache.prefetch import StorageRange
from hicache.runtime.batch import BatchPlan, StepOutput
from hicache.runtime.config import RuntimeConfig
from hicache.runtime.counters import Counters
from hicache.runtime.grammar import GrammarCompiler
from hicache.runtime.jump_forward import JumpForward
from hicache.runtime.policy import PREFILL_TOKENS_CPU, PREFILL_TOKENS_CPU_SHARED, BudgetPolicy
from hicache.runtime.request import Req, Status
from hicache.runtime.sampling import SamplingParams
from hicache.runtime.scheduler.decode import DecodePlanner
from hicache.runtime.scheduler.memory import Memory
from hicache.runtime.scheduler.output import OutputProcessor
from hicache.runtime.scheduler.prefill import PrefillPlanner
from hicache.runtime.scheduler.queue import QueueState
from hicache.runtime.stop import StopChecker

PAGE, EOS = 4, 2


class FakeMatch:
    def __init__(self, tokens: int):
        self.tokens = tokens


class FakeAdmission:
    def __init__(self, prefix: int):
        self.prefix, self.loaded = prefix, 0


class FakeCache:
    """The `CacheManager` calls the planners make, over a pool of `capacity` tokens in pages:
    `cached[namespace]` tokens of a prompt are matched; `prefetching` holds rids the L3 prefetch
    policy keeps waiting; `released` records (rid, token ids) of each release."""

    page_size = PAGE
    disabled = False

    def __init__(self, capacity: int = 1024, cached: dict | None = None, prefetching=()):
        self.capacity, self.cached, self.prefetching = capacity, dict(cached or {}), set(prefetching)
        self.held: dict[int, int] = {}  # id(lease) -> tokens held, whole pages
        self.released: list[tuple[str, list[int]]] = []
        self.backlog = self.grace = None
        self.rows = 0

    def used(self) -> int:
        return sum(self.held.values())

    def match(self, ids, namespace):
        return FakeMatch(min(self.cached.get(namespace, 0), len(ids)) // PAGE * PAGE)

    def admit(self, lease, match, room, load=True, resume_limit=0):
        if self.used() + -(-room // PAGE) * PAGE > self.capacity:
            return None
        self.rows += 1
        lease.row, self.held[id(lease)] = self.rows, match.tokens
        return FakeAdmission(match.tokens)

    def grow(self, lease, upto, headroom=0):
        need = -(-upto // PAGE) * PAGE - self.held[id(lease)]
        if need > 0 and self.used() + need + headroom > self.capacity:
            return False
        self.held[id(lease)] += max(0, need)
        return True

    def drop(self, lease):
        self.held.pop(id(lease), None)
        lease.row = None

    def release(self, lease, token_ids, prompt_tokens, keep=True):
        if lease.row is not None:
            self.released.append((lease.owner.rid, list(token_ids)))
        self.drop(lease)

    def prefetch_ready(self, lease):
        return None if lease.owner.rid in self.prefetching else StorageRange()

    def before_prefill(self, backlog, waiting, decoding):
        self.backlog, self.grace = backlog, decoding if waiting else None

    def poll(self, leases):
        return []

    def refresh(self, lease): ...
    def dequeued(self, lease): ...
    def advance(self, lease, computed): ...
    def record_prefill(self, tokens, seconds): ...


class FakePolicy:
    """Parks the requests named in `parked`; the latest arrival is the retraction victim."""

    def __init__(self, parked=()):
        self.parked = set(parked)

    def parks(self, req, running):
        return req.rid in self.parked

    @staticmethod
    def victim(running):
        return max(running, key=lambda r: r.arrival_seq)


def req(rid: str, prompt: int, max_new: int = 8, seq: int = 0) -> Req:
    r = Req(rid, list(range(10, 10 + prompt)), SamplingParams(max_new_tokens=max_new, temperature=0.0), rid,
            None, False, 0)
    r.arrival_seq = seq
    return r


def running(queue: QueueState, cache: FakeCache, r: Req, kv: int, outputs: list[int] = ()) -> Req:
    """`r` admitted with `kv` tokens computed (their slots held) and `outputs` sampled."""
    queue.add(r)
    assert cache.admit(r.lease, FakeMatch(0), 0) is not None and cache.grow(r.lease, kv)
    queue.admit(r)
    r.kv_len, r.output_ids = kv, list(outputs)
    return r


def budget_policy(max_running: int = 4) -> BudgetPolicy:
    rc = RuntimeConfig(chunked_prefill_size=48, max_prefill_tokens=96, max_running_requests=max_running)
    return BudgetPolicy(rc, PAGE, 1024, prefill_ahead=False, has_host_tier=False)


def test_queue_state_version_changes_on_arrival_admission_finish_and_retraction():
    queue, a, b = QueueState(), req("a", 8, seq=0), req("b", 8, seq=1)
    seen = [queue.version]

    def changed() -> bool:
        seen.append(queue.version)
        return seen[-1] != seen[-2]

    queue.add(a)
    queue.add(b)
    assert changed() and queue.waiting == (a, b) and a.status is Status.WAITING
    queue.admit(a)
    assert changed() and queue.running == (a,) and queue.waiting == (b,) and queue.is_running(a)
    queue.requeue(a)  # retracted: back before b, who arrived later
    assert changed() and queue.waiting == (a, b) and not queue.running_count() and queue.early_releases == 1
    queue.admit(b)
    queue.remove(b)
    assert changed() and b.status is Status.FINISHED and queue.find("b") is None and queue.find("a") is a
    queue.remove(a)  # a waiting request leaves too (aborted)
    assert changed() and not queue.has_waiting() and a.status is Status.FINISHED
    assert queue.early_releases == 1
    with pytest.raises(AttributeError):
        queue.waiting.append(b)  # a snapshot, not the list


def test_prefill_planner_chunks_and_admits_against_the_cache():
    queue, cache, counters = QueueState(), FakeCache(cached={"a": 10}), Counters()
    policy = budget_policy(max_running=2)
    planner = prefill_planner(queue, cache, policy, counters)
    a, b, c = req("a", 100, seq=0), req("b", 30, seq=1), req("c", 20, seq=2)
    for r in (a, b, c):
        queue.add(r)
    plan = planner.plan()
    # a: its cached 8 tokens (whole pages of 10), then a chunk of 48; b: all 30 (it samples); c: two run already
    assert plan.mode == "extend" and [r.rid for r in plan.reqs] == ["a", "b"]
    assert (plan.starts, plan.extend_lens, plan.sample) == ([8, 0], [48, 30], [False, True])
    assert queue.running == (a, b) and queue.waiting == (c,) and not c.holds_kv
    assert a.kv_len == 8 and a.cached_tokens == 8 and counters["cached_device"] == 8
    assert a.status is b.status is Status.PREFILL and c.status is Status.WAITING
    assert cache.backlog == 100 + 30 + 20 and cache.grace is False
    assert cache.held[id(a.lease)] == 56 and cache.held[id(b.lease)] == 32

    a.kv_len, b.kv_len, b.output_ids = 56, 30, [7]  # the step applied: b decodes next
    assert b.status is Status.DECODE
    plan = planner.plan()
    assert [r.rid for r in plan.reqs] == ["a"] and (plan.starts, plan.extend_lens, plan.sample) == ([56], [44], [True])
    assert cache.grace is True  # b decodes: a short grace for prefetches


def test_prefill_planner_leaves_waiting_what_the_prefetch_or_the_cache_holds_back():
    queue, cache = QueueState(), FakeCache(capacity=64, prefetching={"a"})
    planner = prefill_planner(queue, cache, budget_policy(), Counters())
    a, b, c = req("a", 16, seq=0), req("b", 40, seq=1), req("c", 40, seq=2)
    for r in (a, b, c):
        queue.add(r)
    version = queue.version
    plan = planner.plan()
    assert [r.rid for r in plan.reqs] == ["b"] and queue.version == version + 1
    assert a.status is Status.PREFETCHING and c.status is Status.WAITING  # c: no room for its chunk
    assert queue.waiting == (a, c) and not c.holds_kv and cache.used() == 40
    cache.prefetching.clear()
    b.kv_len, b.output_ids = 40, [7]
    plan = planner.plan()
    assert [r.rid for r in plan.reqs] == ["a"] and a.status is Status.PREFILL and queue.waiting == (c,)


def test_budget_policy_reserves_the_outputs_to_come():
    """An admission keeps room for the running requests' and its own output still to come: all of
    it when its length is certain (ignore_eos), half of it (at most NEW_TOKENS_CLIP) when the
    request may stop early; with schedule_conservativeness 0, a page per decoding request only."""
    policy = budget_policy()
    certain = req("a", 8, max_new=40)
    certain.params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    certain.output_ids = [5] * 10  # 30 to come: 8 pages of 4
    may_stop = req("b", 8, max_new=40)  # half of 40: 5 pages
    assert policy.future_tokens(certain) == 32 and policy.future_tokens(may_stop) == 20
    assert policy.decode_headroom([certain], launched=False, admitting=may_stop) == 52
    policy.conservativeness = 0
    assert policy.decode_headroom([certain], launched=True, admitting=may_stop) == PAGE  # certain decodes next


def test_prefill_planner_admits_only_what_can_finish_without_retraction():
    """Four requests whose prompts fit L1 together but whose certain outputs do not: the planner
    admits the two that can finish; with schedule_conservativeness 0 it admits all four."""
    for conservativeness, admitted in ((1.0, ["r0", "r1"]), (0.0, ["r0", "r1", "r2", "r3"])):
        queue, cache = QueueState(), FakeCache(capacity=128)
        policy = budget_policy()
        policy.conservativeness = conservativeness
        planner = prefill_planner(queue, cache, policy, Counters())
        for i in range(4):
            r = req(f"r{i}", 16, max_new=40, seq=i)
            r.params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
            queue.add(r)
        plan = planner.plan()
        assert [r.rid for r in plan.reqs] == admitted, conservativeness


def test_a_short_prompt_is_admitted_beside_the_chunks_of_a_long_one():
    """A long prompt's chunks leave half the step to a waiting prompt that fits in it whole,
    rather than taking every step's whole budget until the long one is computed."""
    queue, cache = QueueState(), FakeCache(capacity=2048)
    rc = RuntimeConfig(chunked_prefill_size=-1, max_prefill_tokens=96)
    planner = prefill_planner(queue, cache, BudgetPolicy(rc, PAGE, 2048, False, False), Counters())
    long = running(queue, cache, req("long", 800, seq=0), kv=96)
    plan = planner.plan()
    assert plan.reqs == [long] and plan.extend_lens == [96]  # alone, it takes the whole step
    long.kv_len = 192
    short = req("short", 20, max_new=4, seq=1)
    queue.add(short)
    plan = planner.plan()
    assert plan.reqs == [long, short] and plan.extend_lens == [48, 20] and plan.sample == [False, True]
    assert queue.running == (long, short)
    queue.add(other := req("other", 60, seq=2))  # more than half the step: it waits its turn
    long.kv_len, short.kv_len, short.output_ids = 240, 20, [7]
    plan = planner.plan()
    assert [r.rid for r in plan.reqs] == ["long", "short"] and plan.extend_lens == [96, 1] and other.kv_len == 0


def test_decoding_requests_join_each_chunk_of_a_long_prompt():
    """Requests that decode get their next token in every step that computes a chunk of a long
    prompt; on CPU (max_prefill_tokens auto) the chunks are smaller meanwhile."""
    queue, cache = QueueState(), FakeCache(capacity=8192)
    planner = prefill_planner(queue, cache, BudgetPolicy(RuntimeConfig(), PAGE, 8192, False, False), Counters())
    long = running(queue, cache, req("long", 4000, seq=0), kv=1024)
    assert planner.plan().extend_lens == [PREFILL_TOKENS_CPU]  # nobody decodes: the CPU step's whole budget
    dec = running(queue, cache, req("dec", 10, seq=1), kv=10, outputs=[5])
    plan = planner.plan()
    assert plan.mode == "extend" and plan.reqs == [long, dec] and plan.joined
    assert (plan.starts, plan.extend_lens, plan.sample) == ([1024, 10], [PREFILL_TOKENS_CPU_SHARED, 1], [False, True])


def prefill_planner(queue, cache, policy, counters) -> PrefillPlanner:
    memory = Memory(queue, cache, policy, counters)
    stops = StopChecker(None, [EOS])
    output = OutputProcessor(queue, cache, memory, GrammarCompiler(None, 100, [EOS]), stops,
                             JumpForward(False, None, stops, 4096, counters), counters, 4096)
    decode = DecodePlanner(queue, cache, policy, memory, stops, 4096)
    return PrefillPlanner(queue, cache, policy, memory, output, decode, counters)


def test_decode_planner_plans_one_token_per_decoding_request_and_skips_parked_ones():
    queue, cache, counters = QueueState(), FakeCache(), Counters()
    policy = FakePolicy(parked={"b"})
    planner = DecodePlanner(queue, cache, policy, Memory(queue, cache, policy, counters), StopChecker(None, [EOS]), 4096)
    c = running(queue, cache, req("c", 10, seq=2), kv=4)  # still computing its prompt
    a = running(queue, cache, req("a", 10, seq=0), kv=10, outputs=[5])
    b = running(queue, cache, req("b", 10, seq=1), kv=10, outputs=[5])
    assert (a.status, b.status, c.status) == (Status.DECODE, Status.DECODE, Status.PREFILL)
    plan = planner.plan()
    assert plan.mode == "decode" and not plan.joined and plan.reqs == [a]
    assert (plan.starts, plan.extend_lens, plan.sample) == ([10], [1], [True])
    policy.parked.clear()
    assert planner.plan().reqs == [a, b]  # by arrival
    extend = BatchPlan("extend", [c], [4], [6], [False])
    assert planner.plan(extend) is extend and extend.joined and extend.reqs == [c, a, b]


def test_decode_planner_retracts_the_latest_arrival_when_short():
    queue, cache, counters = QueueState(), FakeCache(capacity=32), Counters()
    policy = FakePolicy()
    planner = DecodePlanner(queue, cache, policy, Memory(queue, cache, policy, counters), StopChecker(None, [EOS]), 4096)
    a = running(queue, cache, req("a", 16, seq=0), kv=16, outputs=[5])  # 16 held; its next token needs a page
    d = running(queue, cache, req("d", 16, seq=1), kv=16, outputs=[5])
    version = queue.version
    plan = planner.plan()
    assert plan.reqs == [a] and queue.waiting == (d,) and d.status is Status.WAITING and d.kv_len == 0
    assert counters["retractions"] == 1 and queue.early_releases == 1 and queue.version == version + 1
    assert cache.released == [("d", d.input_ids)] and cache.held[id(a.lease)] == 20


def test_output_processor_finishes_on_stop_and_length_and_emits_outputs():
    queue, cache, counters = QueueState(), FakeCache(), Counters()
    memory = Memory(queue, cache, FakePolicy(), counters)
    stops = StopChecker(None, [EOS])
    output = OutputProcessor(queue, cache, memory, GrammarCompiler(None, 100, [EOS]), stops,
                             JumpForward(False, None, stops, 4096, counters), counters, 4096)
    a = running(queue, cache, req("a", 10, max_new=4), kv=9)
    b = running(queue, cache, req("b", 10, max_new=1), kv=9)
    c = running(queue, cache, req("c", 10, max_new=4), kv=9)
    e = running(queue, cache, req("e", 60, max_new=4), kv=0)
    plan = BatchPlan("extend", [a, b, c, e], [9, 9, 9, 0], [1, 1, 1, 48], [True, True, True, False])
    out = StepOutput([5, 6, EOS, None], [None] * 4, [None] * 4, [None] * 4)
    version = queue.version
    output.apply(plan, out)
    outs = {o.rid: o for o in output.take()}
    assert sorted(outs) == ["a", "b", "c"] and not output.pending()
    assert outs["a"].new_token_ids == [5] and outs["a"].finish_reason is None
    assert outs["b"].new_token_ids == [6] and outs["b"].finish_reason == {"type": "length", "length": 1}
    assert outs["c"].new_token_ids == [EOS] and outs["c"].finish_reason == {"type": "stop", "matched": EOS}
    assert outs["a"].meta["completion_tokens"] == 1 and outs["a"].meta["prompt_tokens"] == 10
    assert queue.running == (a, e) and b.status is c.status is Status.FINISHED and queue.version == version + 2
    assert cache.released == [("b", b.input_ids), ("c", c.input_ids)]
    assert (a.kv_len, a.output_ids, a.status) == (10, [5], Status.DECODE)
    assert (e.kv_len, e.status) == (48, Status.PREFILL)
    assert counters["generation_tokens"] == 3 and counters["requests_finished"] == 2
    assert counters["prompt_tokens"] == 3 + 48 and counters["forward_steps"] == 1


PARTS = Path(__file__).resolve().parents[2] / "runtime" / "scheduler"


def test_the_overlap_loop_reads_only_public_names_of_the_queue_and_the_scheduler():
    """Every private name the loop touches is its own (`self._...`)."""
    tree = ast.parse((PARTS / "overlap.py").read_text())
    reached = [f"overlap.py:{n.lineno} {ast.unparse(n)}" for n in ast.walk(tree)
               if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")
               and not (isinstance(n.value, ast.Name) and n.value.id == "self")]
    assert not reached, reached


def test_the_parts_do_not_reach_back_into_the_scheduler():
    """The planners, the output processor, the queue state and memory import neither the
    `Scheduler` nor its package's front, and hold no reference to a scheduler."""
    for name in ("queue.py", "prefill.py", "decode.py", "output.py", "memory.py"):
        tree = ast.parse((PARTS / name).read_text())
        modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not modules & {"hicache.runtime.scheduler", "hicache.runtime.scheduler.scheduler"}, name
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        assert not names & {"sched", "scheduler", "Scheduler"}, name
