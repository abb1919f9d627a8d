"""HiCache L2 end to end: the scheduler with a host tier.

- Multi-turn on the default model: with L1 room for about two conversations and L2 ten times
  larger, greedy outputs equal HF transformers' (tests/golden/multiturn.json), and from the third
  turn on more than half of all prompt tokens come from host.
- A randomized stress test on a tiny random 2-layer model that drives the Scheduler directly
  (arrivals, aborts, retractions, evictions in both tiers, failed and late transfers, flushes)
  and calls check_integrity() after every step.
- Host-pool exhaustion, a failed transfer and an abort in the middle of a load-back.
"""
from __future__ import annotations

import os
import random
from typing import NamedTuple

import pytest

from engines import make_engine
from golden import first_difference, load_golden
from hicache import Engine
from hicache.config import HiCacheConfig
from hicache.runtime.config import RuntimeConfig
from hicache.runtime.messages import GenerateRequest
from hicache.runtime.sampling import SamplingParams
from hicache.runtime.build import build_scheduler
from hicache.runtime.scheduler import Scheduler
from transfer_fakes import Faults, LateTransfer, LazyTransfer

# ---------------------------------------------------------------------------------------------
# Tiny model, Scheduler driven directly
# ---------------------------------------------------------------------------------------------


def tiny_scheduler(config_path, total=256, ratio=4.0, running=6, overlap=False, park=False, **cache) -> Scheduler:
    # schedule_conservativeness 0: admissions reserve no room for outputs, so that a small L1
    # retracts too (the mechanics under test include retraction)
    rc = RuntimeConfig(model_path=str(config_path), load_format="dummy", max_total_tokens=total,
                       max_running_requests=running, chunked_prefill_size=48, max_prefill_tokens=96,
                       overlap_schedule=overlap, decode_while_loading=park, schedule_conservativeness=0)
    # the tiny model recomputes faster than L2 loads: tests of the tiers' mechanics load every hit
    return build_scheduler(rc, HiCacheConfig(hicache_ratio=ratio, **{"hicache_load_decision": "always", **cache}))


def drain(sched: Scheduler, limit: int = 5000) -> dict[str, list]:
    """Steps until idle, checking integrity after every step; returns rid -> [output ids, meta, reason]."""
    out: dict[str, list] = {}
    for _ in range(limit):
        if not sched.has_work():
            return out
        collect(out, sched.step())
        sched.check_integrity()
    raise AssertionError("the scheduler did not go idle")


def collect(out: dict, outputs) -> None:
    for o in outputs:
        rec = out.setdefault(o.rid, [[], None, None])
        rec[0] += o.new_token_ids
        rec[1], rec[2] = o.meta, o.finish_reason


GREEDY = {"temperature": 0, "ignore_eos": True}


def request(rid: str, ids: list[int], params: dict, **kw) -> GenerateRequest:
    """A scheduler message whose sampling parameters are written as a dict (parsed as a front end does)."""
    return GenerateRequest(rid, ids, SamplingParams.from_dict(params, vocab_size=2**31), **kw)


@pytest.fixture(scope="module")
def reference_outputs(tiny_config_path):
    """Greedy outputs of the same dummy model with no cache at all, per prompt (memoised)."""
    sched = tiny_scheduler(tiny_config_path, total=16384, running=128, disable_radix_cache=True)
    memo: dict[tuple, list[int]] = {}

    def outputs(prompts: list[tuple[list[int], int]]) -> list[list[int]]:
        todo = [(p, n) for p, n in prompts if (tuple(p), n) not in memo]
        for i, (p, n) in enumerate(todo):
            sched.add_request(request(f"ref{i}", p, dict(GREEDY, max_new_tokens=n)))
        got = drain(sched)
        for i, (p, n) in enumerate(todo):
            memo[(tuple(p), n)] = got[f"ref{i}"][0]
        return [memo[(tuple(p), n)] for p, n in prompts]

    return outputs


@pytest.mark.parametrize("policy,layout,page_size,late,overlap,park", [
    ("write_through", "layer_first", 1, False, False, False),
    ("write_through_selective", "page_first", 4, True, False, True),  # park: decode while loading
    ("write_back", "page_first", 1, False, False, False),
    ("write_back", "layer_first", 4, True, False, False),
    ("write_through", "page_first", 4, True, True, True),  # overlap: steps launched before the last is applied
    ("write_back", "layer_first", 1, False, True, False),
])
def test_random_stress_keeps_integrity_and_outputs(tiny_config_path, reference_outputs, policy, layout, page_size,
                                                   late, overlap, park):
    rng = random.Random(f"{policy}{layout}{page_size}{late}{overlap}{os.environ.get('HICACHE_STRESS_SEED', '')}")
    sched = tiny_scheduler(tiny_config_path, total=256, ratio=2.0, page_size=page_size, overlap=overlap,
                           park=park, hicache_write_policy=policy, hicache_mem_layout=layout)
    real = sched.cache.host.transfer
    if late:
        sched.cache.host.transfer = LateTransfer(real)
    if policy.startswith("write_through"):  # loads land only when waited for (or late, on their own)
        ctl = sched.cache.host
        ctl.transfer = LazyTransfer(ctl.transfer, real.device_pool, real.host_pool)
    faults = Faults(sched)
    stems = [[rng.randrange(3, 500) for _ in range(60)] for _ in range(4)]
    prompts, aborted, results, flushes = {}, set(), {}, 0
    for step in range(200):
        r = rng.random()
        burst = step % 100 == 40  # more decoding than L1 holds: retractions
        for k in range(5 if burst else 1 if r < 0.2 else 0):
            rid = f"q{step}-{k}"
            p = rng.choice(stems)[: rng.randrange(1, 61)] + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 40))]
            prompts[rid] = (p, rng.randrange(30, 40) if burst else rng.randrange(1, 24))
            sched.add_request(request(rid, p, dict(GREEDY, max_new_tokens=prompts[rid][1]),
                                  cache_salt=rng.choice(["", "", "", "tenant"])))
        if 0.2 <= r < 0.23 and (sched.running or sched.waiting):
            victim = rng.choice(sched.running + sched.waiting).rid
            aborted.add(victim)
            sched.abort(victim)
        if step % 100 == 99:  # go idle, then flush both tiers
            collect(results, drain_all(sched))
            flush(sched)
            flushes += 1
        if rng.random() < 0.03:
            faults.arm()
        collect(results, sched.step())
        sched.check_integrity()
    collect(results, drain_all(sched))
    stats = sched.stats()
    host = stats["tiers"]["host"]
    assert stats["retractions"] > 0, stats
    assert host["evicted_tokens"] > 0 and stats["tiers"]["device"]["evicted_tokens"] > 0, stats
    assert host["loaded_back_tokens"] > 0 and host["transfer_failures"] > 0, host
    done = [rid for rid in prompts if rid not in aborted]
    want = reference_outputs([prompts[rid] for rid in done])
    for rid, w in zip(done, want):
        assert results[rid][0] == w, f"{rid}: output differs from the uncached reference"
        details = results[rid][1]["cached_tokens_details"]
        assert details["device"] + details["host"] == results[rid][1]["cached_tokens"]
    flush(sched)
    assert sched.cache.tree.total_tokens() == sched.cache.tree.host_tokens() == 0
    host = sched.cache.host.host_pool.allocator
    assert host.num_free_tokens() == host.capacity_tokens()
    if overlap:  # (the default seed's runs do both; another HICACHE_STRESS_SEED may not)
        assert sched.overlap.continued > 0 and sched.overlap.ahead > 0


def flush(sched: Scheduler) -> None:
    """flush_cache() once late transfers have landed (it refuses while any is in flight)."""
    for _ in range(3):
        if sched.flush_cache():
            sched.check_integrity()
            return
        sched.step()
    raise AssertionError("flush_cache kept refusing")


def drain_all(sched):
    outs = []
    while sched.has_work():
        outs += sched.step()
        sched.check_integrity()
    return outs


def test_idle_scheduler_steps_until_its_copies_land(tiny_config_path):
    """The write-through copy of a request's last pages is issued as it finishes; the scheduler
    has work until that copy is folded in (an idle server would otherwise report it in flight,
    and hold its pins, until the next request)."""
    sched = tiny_scheduler(tiny_config_path, total=256, ratio=4.0)
    # copies land a poll later, as on a GPU
    sched.cache.host.transfer = LateTransfer(sched.cache.host.transfer)
    sched.add_request(request("a", list(range(3, 70)), dict(GREEDY, max_new_tokens=4)))
    steps = 0
    while sched.has_work():
        sched.step()
        steps += 1
        assert steps < 1000
    tiers = sched.stats()["tiers"]
    assert tiers["host"]["in_flight"] == 0 and tiers["host"]["used_tokens"] > 0
    sched.check_integrity()


def _two_rounds(sched, convs, new=4):
    """Round 1 computes each prompt; round 2 asks each again, extended, after the others pushed it out."""
    for i, p in enumerate(convs):
        sched.add_request(request(f"a{i}", p, dict(GREEDY, max_new_tokens=new)))
        drain(sched)
    for i, p in enumerate(convs):
        sched.add_request(request(f"b{i}", p + [7, 8, 9], dict(GREEDY, max_new_tokens=new)))
    return drain(sched)


def test_second_round_is_served_from_host(tiny_config_path, reference_outputs):
    sched = tiny_scheduler(tiny_config_path, total=128, ratio=8.0)
    rng = random.Random(1)
    convs = [[rng.randrange(3, 500) for _ in range(60)] for _ in range(4)]
    got = _two_rounds(sched, convs)
    want = reference_outputs([(p + [7, 8, 9], 4) for p in convs])
    for i, w in enumerate(want):
        out, meta, _ = got[f"b{i}"]
        assert out == w and meta["cached_tokens"] == 60
    from_host = {"device": 0, "host": 60, "storage": 0}
    assert any(got[f"b{i}"][1]["cached_tokens_details"] == from_host for i in range(len(convs)))
    stats = sched.stats()
    assert stats["tokens"]["cached"]["host"] >= 2 * 60
    host = stats["tiers"]["host"]
    assert host["enabled"] and host["capacity_tokens"] == 1024 and host["loaded_back_tokens"] >= 2 * 60
    assert host["backed_up_bytes"] == host["backed_up_tokens"] * host["bytes_per_token"] > 0
    assert set(stats["tiers"]["device"]) <= set(host)  # same keys as the device tier, and more


@pytest.mark.parametrize("page_size,layout", [(1, "layer_first"), (4, "page_first")])
def test_forward_waits_for_each_layer_of_a_load_in_flight(tiny_config_path, reference_outputs, page_size, layout):
    """Requests run while their load-back is in flight (no scheduler wait); each layer's attention
    waits for its own layer: with copies that land only when waited for, outputs stay exact."""
    sched = tiny_scheduler(tiny_config_path, total=128, ratio=8.0, page_size=page_size, hicache_mem_layout=layout)
    real = sched.cache.host.transfer
    lazy = LazyTransfer(LateTransfer(real), real.device_pool, real.host_pool)  # backups land late too
    sched.cache.host.transfer = lazy
    rng = random.Random(6)
    convs = [[rng.randrange(3, 500) for _ in range(60)] for _ in range(4)]
    got = _two_rounds(sched, convs)
    want = reference_outputs([(p + [7, 8, 9], 4) for p in convs])
    assert [got[f"b{i}"][0] for i in range(4)] == want
    assert sched.stats()["tiers"]["host"]["loaded_back_tokens"] >= 2 * 60 and lazy.waits > 0
    flush(sched)


def first_on_l2(sched: Scheduler, seed: int) -> tuple[LateTransfer, list[list[int]]]:
    """Makes the scheduler's copies land late (`LateTransfer`, returned) and runs three 60-token
    conversations one at a time: with L1 at 128 tokens and LRU eviction, the first one's prefix
    is then on L2 only (returned with the others)."""
    late = LateTransfer(sched.cache.host.transfer)
    sched.cache.host.transfer = late
    rng = random.Random(seed)
    convs = [[rng.randrange(3, 500) for _ in range(60)] for _ in range(3)]
    for i, p in enumerate(convs):
        sched.add_request(request(f"a{i}", p, dict(GREEDY, max_new_tokens=4)))
        drain(sched)
    return late, convs


@pytest.mark.parametrize("overlap,tail", [(False, [5]), (False, [5, 6, 7]), (True, [5]), (True, [5, 6, 7])])
def test_decoding_goes_on_while_a_prefix_loads_back(tiny_config_path, reference_outputs, overlap, tail):
    """With a request decoding, one admitted with its prefix loading back from L2 sits out the
    steps until its copy lands (held here), whether what it computes after the prefix is one
    token (a decode) or more (an extend): the decoding request goes on emitting tokens meanwhile,
    and every output equals the uncached reference."""
    sched = tiny_scheduler(tiny_config_path, total=128, ratio=8.0, overlap=overlap, park=True,
                           radix_eviction_policy="lru")
    late, convs = first_on_l2(sched, seed=7)
    got: dict[str, list] = {}
    sched.add_request(request("d", [11, 12, 13], dict(GREEDY, max_new_tokens=24)))
    while not got.get("d"):
        collect(got, sched.step())
    late.hold = True  # b0's copy does not land until released
    sched.add_request(request("b0", convs[0] + tail, dict(GREEDY, max_new_tokens=4)))
    for _ in range(2):
        collect(got, sched.step())
    emitted = len(got["d"][0])
    for _ in range(4):
        collect(got, sched.step())
        sched.check_integrity()
    b0 = next(r for r in sched.running if r.rid == "b0")
    assert b0.lease.loading and b0.kv_len == 60 and "b0" not in got
    assert len(got["d"][0]) == emitted + 4, "decoding stalled while the load was in flight"
    late.hold = False
    collect(got, drain_all(sched))
    assert got["b0"][1]["cached_tokens_details"]["host"] == 60
    want = reference_outputs([([11, 12, 13], 24), (convs[0] + tail, 4)])
    assert [got["d"][0], got["b0"][0]] == want


def test_host_pool_exhaustion_recomputes(tiny_config_path, reference_outputs):
    sched = tiny_scheduler(tiny_config_path, total=128, ratio=0.5)  # L2 holds 64 tokens
    rng = random.Random(2)
    convs = [[rng.randrange(3, 500) for _ in range(60)] for _ in range(4)]
    got = _two_rounds(sched, convs)
    want = reference_outputs([(p + [7, 8, 9], 4) for p in convs])
    assert [got[f"b{i}"][0] for i in range(4)] == want
    host = sched.stats()["tiers"]["host"]
    assert host["used_tokens"] <= 64 and host["evicted_tokens"] > 0
    assert sched.flush_cache()
    sched.check_integrity()


@pytest.mark.parametrize("late", [False, True])
def test_failed_transfers_recompute_and_leak_nothing(tiny_config_path, reference_outputs, late):
    sched = tiny_scheduler(tiny_config_path, total=128, ratio=8.0)
    if late:
        sched.cache.host.transfer = LateTransfer(sched.cache.host.transfer)
    faults = Faults(sched)
    rng = random.Random(3)
    convs = [[rng.randrange(3, 500) for _ in range(60)] for _ in range(3)]
    for i, p in enumerate(convs):
        sched.add_request(request(f"a{i}", p, dict(GREEDY, max_new_tokens=4)))
        drain(sched)
    faults.on = True  # every load-back (and backup) now fails
    for i, p in enumerate(convs):
        sched.add_request(request(f"b{i}", p + [7], dict(GREEDY, max_new_tokens=4)))
    got = drain(sched)
    faults.on = False
    want = reference_outputs([(p + [7], 4) for p in convs])
    assert [got[f"b{i}"][0] for i in range(3)] == want
    assert sched.stats()["tiers"]["host"]["transfer_failures"] > 0
    if late:  # the request was admitted with its load in flight, then recomputed without it
        assert sched.stats()["retractions"] > 0
    assert sched.flush_cache()
    sched.check_integrity()


def test_abort_in_the_middle_of_a_load_back(tiny_config_path, reference_outputs):
    sched = tiny_scheduler(tiny_config_path, total=128, ratio=8.0, radix_eviction_policy="lru")
    late, convs = first_on_l2(sched, seed=4)
    sched.add_request(request("b0", convs[0] + [5], dict(GREEDY, max_new_tokens=4)))
    late.hold = True  # the copy will not land until released
    plan = sched.schedule()  # admitted and planned at once, its load-back in flight: the pass would wait per layer
    assert plan is not None and plan.loads is not None and plan.reqs[0].lease.loading
    sched.check_integrity()
    sched.abort("b0")  # before the plan runs
    sched.check_integrity()
    out = []
    while sched.waiting or sched.running:
        out += sched.step()
        sched.check_integrity()
    out += sched.step()
    assert sched.has_work() and sched.stats()["tiers"]["host"]["in_flight"] >= 1  # the held copy keeps it stepping
    late.hold = False
    assert out and out[-1].finish_reason == {"type": "abort"}
    sched.schedule()  # folds in the landed copy
    sched.check_integrity()
    assert sched.flush_cache()
    sched.check_integrity()
    sched.add_request(request("c0", convs[0] + [5], dict(GREEDY, max_new_tokens=4)))
    assert drain(sched)["c0"][0] == reference_outputs([(convs[0] + [5], 4)])[0]


def test_batch_run_on_a_load_that_then_fails_is_dropped_and_recomputed(tiny_config_path):
    """The forward pass does not wait for a load-back to finish before it starts; when the load
    turns out to have failed, what that pass sampled is dropped (the sampler rewound) and the
    request is recomputed without the load."""
    sampled = {"temperature": 1.0, "top_k": 50, "seed": 1234, "max_new_tokens": 4}
    rng = random.Random(5)
    convs = [[rng.randrange(3, 500) for _ in range(60)] for _ in range(3)]
    ref = tiny_scheduler(tiny_config_path, total=1024, disable_radix_cache=True)
    ref.add_request(request("r", convs[0] + [7], sampled))
    want = drain(ref)["r"][0]

    sched = tiny_scheduler(tiny_config_path, total=128, ratio=8.0, radix_eviction_policy="lru")  # b0 from L2
    late = LateTransfer(sched.cache.host.transfer)
    sched.cache.host.transfer = late
    faults = Faults(sched)
    for i, p in enumerate(convs):
        sched.add_request(request(f"a{i}", p, dict(GREEDY, max_new_tokens=4)))
        drain(sched)
    sched.add_request(request("b0", convs[0] + [7], sampled))
    faults.arm()  # the load-back's copy fails; the engine reports it one poll late
    plan = sched.schedule()
    assert plan is not None and plan.reqs[0].rid == "b0" and plan.loads is not None and plan.reqs[0].lease.loading
    assert plan.sample == [True]
    sched.process_result(plan, sched.runner.run(plan))  # ran on the failed load, then learnt of the failure
    sched.check_integrity()
    assert not sched.output.pending(), "a token sampled over a failed load went out"
    assert [r.rid for r in sched.waiting] == ["b0"] and sched.waiting[0].load_back_failed
    assert sched.waiting[0].output_ids == [] and sched.stats()["retractions"] == 1
    got = drain(sched)["b0"]
    assert got[0] == want
    assert sched.stats()["tiers"]["host"]["transfer_failures"] == 1
    assert sched.flush_cache()
    sched.check_integrity()


# ---------------------------------------------------------------------------------------------
# Multi-turn on the default model
# ---------------------------------------------------------------------------------------------

# The workload and HF's answers are tests/golden/multiturn.json: a shared system prompt, then each
# conversation's user turns (a message with a pasted document or tool result), each answered with
# NEW greedy tokens that stay in the history of the next turn. The system prompt stays on L1
# (every request uses it), so the host part is the conversation's history: for it to pass half
# the prompt by turn 3, a turn must outweigh the system prompt.
GOLDEN = load_golden("multiturn")
SYSTEM, NEW = len(GOLDEN["system"]), GOLDEN["new_tokens"]
CONVERSATIONS, TURNS = len(GOLDEN["cases"]), len(GOLDEN["cases"][0]["turns"])
TURN = len(GOLDEN["cases"][0]["turns"][0])
# Two final-length conversations fit in L1 (the shared system prompt counted once).
L1_TOKENS = SYSTEM + 2 * TURNS * (TURN + NEW) + 64


class Run(NamedTuple):
    answers: list[list[list[int]]]  # [conversation][turn]
    metas: list[list[dict]]


def prompt(conv: int, turn: int, answers: list[list[list[int]]]) -> list[int]:
    """The system prompt, the conversation's turns before `turn` with their answers, then `turn`."""
    ids = list(GOLDEN["system"])
    for t in range(turn):
        ids += GOLDEN["cases"][conv]["turns"][t] + answers[conv][t]
    return ids + GOLDEN["cases"][conv]["turns"][turn]


def converse(engine: Engine, convs: range, turns: int = TURNS) -> Run:
    """Turn by turn, every conversation's next turn submitted together (greedy, NEW tokens each)."""
    answers = [[] for _ in range(CONVERSATIONS)]
    metas = [[] for _ in range(CONVERSATIONS)]
    for t in range(turns):
        prompts = [prompt(c, t, answers) for c in convs]
        outs = engine.generate(input_ids=prompts, sampling_params=dict(GREEDY, max_new_tokens=NEW))
        for c, o in zip(convs, outs):
            answers[c].append(o["output_ids"])
            metas[c].append(o["meta_info"])
    engine.check_integrity()
    return Run(answers, metas)


def host_fraction_by_turn(run: Run, convs: range) -> list[float]:
    out = []
    for t in range(len(run.metas[convs[0]])):
        host = sum(run.metas[c][t]["cached_tokens_details"]["host"] for c in convs)
        prompt_tokens = sum(run.metas[c][t]["prompt_tokens"] for c in convs)
        out.append(host / prompt_tokens)
    return out


def assert_hf_answers(run: Run, convs: range) -> None:
    """Every answer is HF's (from the golden: its history held HF's earlier answers, so the first
    difference is where the engine parted from HF)."""
    for c in convs:
        case = GOLDEN["cases"][c]
        for t in range(len(run.answers[c])):
            at = first_difference(run.answers[c][t], case["answers"][t])
            assert at is None, (f"conversation {c}, turn {t + 1}: first difference at answer token {at}, "
                                f"HF's top-2 margin there {case['margins'][t][at] if at < NEW else None}")


def l2_engine(path, **options) -> Engine:
    """L1 holds two conversations and L2 all of them. Under LRU, L1 keeps the latest turns, so the
    share L2 serves is the tested quantity (frequency ranks keep shared prefixes on L1 instead)."""
    return make_engine(path, max_total_tokens=L1_TOKENS, hicache_ratio=10.0,
                       **{"radix_eviction_policy": "lru", **options})


@pytest.mark.model
@pytest.mark.parametrize("conversations", [10, pytest.param(CONVERSATIONS, marks=pytest.mark.slow, id="all")])
def test_multi_turn_conversations_served_from_host(default_model_path, conversations):
    """10 conversations (5 times what L1 holds); `make test-all`: all 20."""
    convs = range(conversations)
    with l2_engine(default_model_path) as engine:
        run = converse(engine, convs)
        stats = engine.get_stats()
    assert_hf_answers(run, convs)
    fractions = host_fraction_by_turn(run, convs)
    print("host-served fraction by turn:", [round(f, 3) for f in fractions], stats["tiers"]["host"])
    assert all(f > 0.5 for f in fractions[2:]), fractions
    assert stats["tiers"]["host"]["capacity_tokens"] == 10 * stats["tiers"]["device"]["capacity_tokens"]
    assert stats["tokens"]["cached"]["host"] == sum(m["cached_tokens_details"]["host"] for ms in run.metas for m in ms)


VARIANT_CONVS = range(10)  # more than L1 holds at turn 3, so every history comes from L2
VARIANT_TURNS = [4, pytest.param(TURNS, marks=pytest.mark.slow, id="all-turns")]


@pytest.mark.model
@pytest.mark.parametrize("options", [
    pytest.param({"hicache_write_policy": "write_through_selective", "hicache_mem_layout": "page_first"},
                 id="selective-page_first", marks=pytest.mark.slow),
    pytest.param({"hicache_write_policy": "write_back", "hicache_mem_layout": "layer_first"},
                 id="write_back-layer_first"),
    pytest.param({"hicache_write_policy": "write_through", "hicache_mem_layout": "page_first", "page_size": 8},
                 id="write_through-page_first-page8", marks=pytest.mark.slow),
])
@pytest.mark.parametrize("turns", VARIANT_TURNS)
def test_multi_turn_each_policy_and_layout(default_model_path, options, turns):
    """4 turns: two past the third, from which on L2 must serve half the prompt; `make test-all`: 6."""
    with l2_engine(default_model_path, **options) as engine:
        run = converse(engine, VARIANT_CONVS, turns)
    assert_hf_answers(run, VARIANT_CONVS)
    fractions = host_fraction_by_turn(run, VARIANT_CONVS)
    print(options, "host-served fraction by turn:", [round(f, 3) for f in fractions])
    assert all(f > 0.5 for f in fractions[2:]), fractions
