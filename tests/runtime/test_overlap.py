"""Overlap scheduling (runtime/scheduler/overlap.py) forced on, on CPU: the same outputs as without it.

The tiny random 2-layer model drives the Scheduler directly with the same script of arrivals and
aborts in both modes; integrity is checked after every step, and once idle no page is held (the
position a finished request computed one step too many is freed).
"""
from __future__ import annotations

import argparse
import dataclasses
import random

import pytest
import torch

from hicache import Engine
from hicache.config import HiCacheConfig
from hicache.runtime.config import RuntimeConfig
from hicache.runtime.messages import GenerateRequest
from hicache.runtime.sampling import SamplingParams
from hicache.runtime.build import build_scheduler
from hicache.runtime.scheduler import Scheduler
from transfer_fakes import Faults, FencedTransfer, LateTransfer, LazyTransfer

GREEDY = {"temperature": 0, "ignore_eos": True}


def request(rid: str, ids: list[int], params: dict, **kw) -> GenerateRequest:
    """A scheduler message whose sampling parameters are written as a dict (parsed as a front end does)."""
    return GenerateRequest(rid, ids, SamplingParams.from_dict(params, vocab_size=2**31), **kw)


def scheduler(config_path, overlap: bool, total=1024, running=8, page_size=4, device="cpu", policy="fcfs",
              ahead: bool = True, **cache) -> Scheduler:
    rc = RuntimeConfig(model_path=str(config_path), load_format="dummy", max_total_tokens=total, schedule_policy=policy,
                       max_running_requests=running, chunked_prefill_size=48, max_prefill_tokens=96,
                       device=device, dtype="float32", overlap_schedule=overlap,
                       disable_prefill_ahead=not ahead)
    cache.setdefault("hicache_storage_backend", "none")
    sched = build_scheduler(rc, HiCacheConfig(page_size=page_size, **cache))
    assert (sched.overlap is not None) == overlap
    return sched


def run(sched: Scheduler, arrivals: dict[int, list[GenerateRequest]], abort_after: dict[str, int] | None = None,
        limit: int = 3000) -> dict[str, dict]:
    """Steps through the script (arrivals before step i; `abort_after[rid] = k`: abort once k tokens
    came out) until idle; returns rid -> {"ids", "reason", "meta", "logprobs", "prompt"}."""
    abort_after, out = dict(abort_after or {}), {}
    for i in range(limit):
        for msg in arrivals.get(i, []):
            sched.add_request(msg)
        if i > max(arrivals, default=0) and not sched.has_work():
            break
        for o in sched.step():
            rec = out.setdefault(o.rid, {"ids": [], "reason": None, "meta": None, "logprobs": [], "prompt": None})
            assert o.input_logprobs is None or rec["prompt"] is None  # sent once
            rec["prompt"] = o.input_logprobs or rec["prompt"]
            rec["ids"] += o.new_token_ids
            rec["reason"], rec["meta"] = o.finish_reason, o.meta
            rec["logprobs"] += o.logprobs or []
        sched.check_integrity()
        for rid, k in list(abort_after.items()):
            if rid in out and len(out[rid]["ids"]) >= k:
                sched.abort(rid)
                sched.check_integrity()
                del abort_after[rid]
    else:
        raise AssertionError("the scheduler did not go idle")
    assert sched.pages_held() == 0 and not sched.running and not sched.waiting
    sched.check_integrity()  # every L1 slot free or owned by the tree
    return out


def both(config_path, script, abort_after=None, **kw) -> tuple[dict, dict, Scheduler]:
    plain = run(scheduler(config_path, False, **kw), script(), abort_after)
    sched = scheduler(config_path, True, **kw)
    overlapped = run(sched, script(), abort_after)
    assert sched.overlap.continued > 0, "no step was overlapped"
    return plain, overlapped, sched


def staggered(seed: int, n: int = 14, params=lambda rng, i: dict(GREEDY, max_new_tokens=rng.randrange(1, 26))):
    """n requests arriving over ~40 steps; prompts share stems (radix hits), some are chunked."""
    def script():
        rng = random.Random(seed)
        stems = [[rng.randrange(3, 500) for _ in range(40)] for _ in range(3)]
        arrivals: dict[int, list] = {}
        for i in range(n):
            prompt = rng.choice(stems)[: rng.randrange(0, 41)] + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 60))]
            arrivals.setdefault(rng.randrange(0, 40), []).append(request(f"r{i}", prompt, params(rng, i)))
        return arrivals
    return script


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
def test_greedy_staggered_arrivals_max_new_tokens_and_stop_ids(tiny_config_path, device):
    """On CUDA: Triton kernels, decode CUDA graphs fed from the device-side ids, pinned copies."""
    base = staggered(1)
    plain = run(scheduler(tiny_config_path, False, device=device), base())
    # stop ids taken from each request's own greedy output: some stop early, mid-decode
    stops = {rid: [rec["ids"][len(rec["ids"]) // 2]] for rid, rec in plain.items() if len(rec["ids"]) > 3}

    def script():
        arrivals = base()
        for msgs in arrivals.values():
            for m in msgs:
                if m.rid in stops:
                    m.sampling_params = dataclasses.replace(m.sampling_params, stop_token_ids=tuple(stops[m.rid]))
        return arrivals

    plain, overlapped, sched = both(tiny_config_path, script, device=device)
    if device == "cuda":
        assert sched.runner.graphs is not None
    assert overlapped == plain
    reasons = [rec["reason"]["type"] for rec in plain.values()]
    assert "stop" in reasons and "length" in reasons
    assert any(rec["meta"]["cached_tokens"] > 0 for rec in plain.values()), "no radix hit"


def test_aborts_mid_decode(tiny_config_path):
    script = staggered(2, params=lambda rng, i: dict(GREEDY, max_new_tokens=20 + i))
    reference = run(scheduler(tiny_config_path, False), script())
    aborts = {"r1": 3, "r4": 1, "r6": 7, "r9": 12}
    plain, overlapped, _ = both(tiny_config_path, script, aborts)
    for out in (plain, overlapped):
        for rid, rec in out.items():
            if rid in aborts:  # with overlap the step in flight is applied first: maybe one token more
                assert rec["reason"] == {"type": "abort"} and len(rec["ids"]) >= aborts[rid]
                assert rec["ids"] == reference[rid]["ids"][: len(rec["ids"])]
            else:  # (cached_tokens may differ: an aborted request's prefix went to the tree)
                assert (rec["ids"], rec["reason"]) == (reference[rid]["ids"], reference[rid]["reason"])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
def test_seeded_sampling_penalties_and_logprobs(tiny_config_path, device):
    def params(rng, i):
        p = dict(max_new_tokens=rng.randrange(5, 20), ignore_eos=True, temperature=0.9,
                 seed=None if i % 5 == 0 else 100 + i)
        p.update([{}, {"top_k": 20}, {"top_p": 0.8}, {"min_p": 0.05},
                  {"repetition_penalty": 1.3}, {"frequency_penalty": 0.5, "presence_penalty": 0.4}][i % 6])
        return p

    base = staggered(3, n=12, params=params)

    def script():
        arrivals = base()
        for msgs in arrivals.values():
            for m in msgs:
                if m.rid in ("r2", "r7"):
                    m.return_logprob, m.top_logprobs_num, m.logprob_start_len = True, 3, 1
        return arrivals

    plain, overlapped, _ = both(tiny_config_path, script, device=device)
    assert {r: v["ids"] for r, v in overlapped.items()} == {r: v["ids"] for r, v in plain.items()}
    for rid in ("r2", "r7"):
        a, b = plain[rid]["logprobs"], overlapped[rid]["logprobs"]
        assert len(a) == len(b) == len(plain[rid]["ids"]) > 0
        for (lp_a, top_a), (lp_b, top_b) in zip(a, b):
            assert lp_b == pytest.approx(lp_a, abs=1e-5)
            assert [t for t, _ in top_b] == [t for t, _ in top_a]
        a, b = plain[rid]["prompt"], overlapped[rid]["prompt"]  # the prompt's from token 1 on
        assert len(a) == len(b) == plain[rid]["meta"]["prompt_tokens"] - 1 and a[0] == b[0] == [None, None]
        assert [e[0] for e in b[1:]] == pytest.approx([e[0] for e in a[1:]], abs=1e-5)


def test_small_pool_retracts(tiny_config_path):
    """Recomputed requests keep their outputs, and their prompt log-probs come out once, whole."""
    base = staggered(4, n=10, params=lambda rng, i: dict(GREEDY, max_new_tokens=30 + rng.randrange(10)))

    def script():
        arrivals = base()
        for msgs in arrivals.values():
            for m in msgs:
                m.return_logprob, m.logprob_start_len = True, 0
        return arrivals

    reference = run(scheduler(tiny_config_path, False, total=8192), script())
    plain, overlapped, sched = both(tiny_config_path, script, total=320, running=6)
    assert sched.counters["retractions"] > 0
    for got in (plain, overlapped):
        assert {r: v["ids"] for r, v in got.items()} == {r: v["ids"] for r, v in reference.items()}
        for rid, rec in got.items():
            want = reference[rid]["prompt"]
            assert len(rec["prompt"]) == len(want) == rec["meta"]["prompt_tokens"]
            assert [e[0] for e in rec["prompt"][1:]] == pytest.approx([e[0] for e in want[1:]], abs=1e-4)


def test_second_round_loads_back_from_l2(tiny_config_path):
    """Round 2 finds its prefixes in L2 only (L1 too small) and decodes on top of the load-back."""
    rng = random.Random(5)
    convs = [[rng.randrange(3, 500) for _ in range(60)] for _ in range(4)]

    def script():
        arrivals = {5 * i: [request(f"a{i}", p, dict(GREEDY, max_new_tokens=6))] for i, p in enumerate(convs)}
        arrivals[60] = [request(f"b{i}", p + [7, 8, 9], dict(GREEDY, max_new_tokens=6))
                        for i, p in enumerate(convs)]
        return arrivals

    plain, overlapped, sched = both(tiny_config_path, script, total=128, running=4, hicache_ratio=8.0)
    assert overlapped == plain
    assert sched.stats()["tiers"]["host"]["loaded_back_tokens"] > 0


def test_engine_n_seeded_and_flags(tiny_config_path):
    kw = dict(load_format="dummy", max_total_tokens=1024, hicache_storage_backend="none", device="cpu")
    req = dict(input_ids=[[5, 6, 7, 8], [9, 10, 11]],
               sampling_params={"n": 3, "seed": 11, "temperature": 0.8, "max_new_tokens": 12, "ignore_eos": True})
    outs = []
    for overlap in (False, True):
        with Engine(str(tiny_config_path), overlap_schedule=overlap, **kw) as eng:
            assert (eng.scheduler.overlap is not None) == overlap
            outs.append([o["output_ids"] for o in eng.generate(**req)])
            eng.check_integrity()
    assert outs[0] == outs[1] and len(outs[0]) == 6
    with pytest.raises(TypeError, match="overlap_schedule=True"):
        Engine(str(tiny_config_path), enable_overlap_schedule=True, **kw)
    from hicache.server.flags import add_dataclass_flags, config_from_args

    parser = argparse.ArgumentParser()
    add_dataclass_flags(parser, RuntimeConfig, "runtime")
    given = {flags: config_from_args(RuntimeConfig, parser.parse_args(flags)).overlap_schedule
             for flags in ((), ("--disable-overlap-schedule",), ("--enable-overlap-schedule",))}
    assert given == {(): None, ("--disable-overlap-schedule",): False, ("--enable-overlap-schedule",): True}
    assert [RuntimeConfig(overlap_schedule=v).features(cuda).overlap_schedule
            for v in (None, False, True) for cuda in (False, True)] == [False, True, False, False, True, True]


def multiturn(n_convs: int, turn: int, rounds: int = 3, stem: int = 24):
    """Rounds of `n_convs` conversations arriving at once (round r at step 60 r), each turn `turn`
    new tokens and one output token (three for c5), the prefill-bound shape of
    benchmarks/compare.py; pairs of conversations open with the same `stem` tokens."""
    rng = random.Random(6)
    stems = [[rng.randrange(3, 500) for _ in range(stem)] for _ in range(n_convs // 2)]
    convs = [stems[i // 2] + [rng.randrange(3, 500) for _ in range(rng.randrange(20, 40))] for i in range(n_convs)]

    def script():
        arrivals, history = {}, [list(c) for c in convs]
        for r in range(rounds):
            new = [11 + r + j for j in range(turn)]
            arrivals[60 * r] = [request(f"c{i}-{r}", h + new, dict(GREEDY, max_new_tokens=3 if i == 5 else 1))
                                for i, h in enumerate(history)]
            history = [h + new + [7] for h in history]
        return arrivals
    return script


def test_prefill_steps_launched_ahead(tiny_config_path):
    """Each prefill step is planned and launched before the previous one's results are applied,
    with the next chunks of its prompts and admissions whose prefixes load back from L2. Loads land
    only when the forward pass waits for their layers (a pass that read a page before its layer
    landed would give other outputs)."""
    script = multiturn(12, 40)
    outs, launched, held = [], [], []
    for overlap in (False, True):
        sched = scheduler(tiny_config_path, overlap, total=640, hicache_ratio=8.0)
        ctl = sched.cache.host
        ctl.transfer = LazyTransfer(ctl.transfer, sched.runner.pool, ctl.host_pool)
        if overlap:
            ahead, forward = sched.overlap._ahead, sched.runner.forward

            def spy(prev, ahead=ahead):
                got = ahead(prev)
                launched.extend([got] if got is not None else [])
                return got

            def forward_spy(plan, *args, forward=forward):  # KV held by the requests of each prefill step
                held.extend([plan.kv_tokens()] if len(plan.reqs) > 1 else [])
                return forward(plan, *args)
            sched.overlap._ahead, sched.runner.forward = spy, forward_spy
        outs.append(run(sched, script()))
        assert sched.stats()["tiers"]["host"]["loaded_back_tokens"] > 0
    plain, overlapped = outs
    assert len(launched) == sched.overlap.ahead > 0
    # a step leaves the next one's load-backs room (half of L1; without the cap some held 496 tokens)
    assert held and max(held) <= sched.policy.step_kv_cap == 320
    assert any(a.loads is not None for a in launched), "no step launched ahead loaded back from L2"
    assert any(not all(a.sample) for a in launched), "no chunked prompt continued ahead"
    assert {r: v["ids"] for r, v in overlapped.items()} == {r: v["ids"] for r, v in plain.items()}
    for rid in plain:  # what the step before was about to give the tree is not computed again
        assert overlapped[rid]["meta"]["cached_tokens"] >= plain[rid]["meta"]["cached_tokens"]


def fenced(sched: Scheduler) -> FencedTransfer:
    """Wraps the scheduler's transfer engine in a FencedTransfer (where the host transfers copy
    and where the manager orders them) and gives the runner numbered fences (1, 2, ...), as on
    CUDA, where the runner's fences are events."""
    ft = sched.cache.host.transfer = sched.cache.transfer = FencedTransfer(sched.cache.host.transfer)

    def fence():
        ft.latest = (ft.latest or 0) + 1
        return ft.latest
    sched.runner.fence = fence
    return ft


def test_copies_ordered_after_the_step_they_touch(tiny_config_path):
    """The loads of a step planned ahead follow only the compute queued before the step in flight
    (their slots were free before it), so they run beside it; the backups of a step's results
    follow that step, not the one queued after it (whose fence is the latest); a step planned
    after the one before it was applied orders its loads after everything queued (no fence)."""
    sched = scheduler(tiny_config_path, True, total=640, hicache_ratio=8.0)
    ctl = sched.cache.host
    ctl.transfer = LazyTransfer(ctl.transfer, sched.runner.pool, ctl.host_pool)
    ft, ahead_loads = fenced(sched), []
    real_ahead = sched.overlap._ahead

    def spy(prev):
        n = len(ft.submitted)
        got = real_ahead(prev)
        ahead_loads.extend((prev.fence, f) for kind, f, _ in ft.submitted[n:] if kind == "load")
        return got
    sched.overlap._ahead = spy
    run(sched, multiturn(12, 40)())
    assert ahead_loads and all(f == want is not None for want, f in ahead_loads)
    loads = [f for kind, f, _ in ft.submitted if kind == "load"]
    assert len(loads) > len(ahead_loads) and loads.count(None) == len(loads) - len(ahead_loads)
    backups = [(f, latest) for kind, f, latest in ft.submitted if kind == "backup"]
    assert any(f is not None for f, _ in backups) and all(f in (None, latest) for f, latest in backups)


def test_prefill_ahead_on_by_default_and_off_by_flag(tiny_config_path):
    from hicache.server.flags import add_dataclass_flags, config_from_args

    parser = argparse.ArgumentParser()
    add_dataclass_flags(parser, RuntimeConfig, "runtime")
    assert not config_from_args(RuntimeConfig, parser.parse_args([])).disable_prefill_ahead
    assert config_from_args(RuntimeConfig, parser.parse_args(["--disable-prefill-ahead"])).disable_prefill_ahead
    plain, overlapped, sched = both(tiny_config_path, multiturn(6, 40, rounds=2), total=640, hicache_ratio=8.0,
                                    ahead=False)
    assert sched.overlap.ahead == 0 and sched.policy.step_kv_cap is None
    assert {r: v["ids"] for r, v in overlapped.items()} == {r: v["ids"] for r, v in plain.items()}


def test_step_launched_ahead_waits_for_a_prefix_the_step_before_computes(tiny_config_path):
    rng = random.Random(7)
    stem = [rng.randrange(3, 500) for _ in range(24)]
    sched = scheduler(tiny_config_path, True)
    sched.add_request(request("a", stem + [rng.randrange(3, 500) for _ in range(60)], dict(GREEDY, max_new_tokens=1)))
    sched.step()  # a's first chunk (48 tokens) is launched
    sched.add_request(request("c", [rng.randrange(3, 500) for _ in range(20)], dict(GREEDY, max_new_tokens=1)))
    sched.add_request(request("b", stem + [5, 6, 7, 8, 9], dict(GREEDY, max_new_tokens=1)))
    sched.step()  # launched ahead: a's last chunk and c, not b (a gives the tree its stem once applied)
    assert [r.rid for r in sched.overlap.inflight.plan.reqs] == ["a", "c"] and sched.overlap.ahead == 1
    assert [r.rid for r in sched.waiting] == ["b"]
    out = {}
    while sched.has_work():
        for o in sched.step():
            out[o.rid] = o
        sched.check_integrity()
    assert out["b"].meta["cached_tokens"] == 24 and out["c"].meta["cached_tokens"] == 0


def test_load_that_fails_under_a_step_launched_ahead(tiny_config_path):
    """A step launched ahead admits a request whose load-back fails; the step before it reports the
    failure while it is in flight: the request is retracted then, what its step sampled is dropped
    (its sampler rewound) and it is recomputed, with the outputs of a cache-less run."""
    sampled = {"temperature": 1.0, "top_k": 50, "seed": 1234, "max_new_tokens": 4}
    rng = random.Random(8)
    convs = [[rng.randrange(3, 500) for _ in range(60)] for _ in range(6)]
    ref = scheduler(tiny_config_path, False, disable_radix_cache=True)
    b1 = convs[1][:40] + [rng.randrange(3, 500) for _ in range(60)]  # runs past its first chunk
    ref.add_request(request("b1", b1, sampled))
    want = run(ref, {})["b1"]["ids"]

    sched = scheduler(tiny_config_path, True, total=256, policy="lpm", hicache_ratio=8.0,
                      radix_eviction_policy="lru")  # b2 (60 cached) before b1 (40); a0 leaves L1 for L2
    sched.cache.host.transfer = LateTransfer(sched.cache.host.transfer)
    ft, faults = fenced(sched), Faults(sched)
    run(sched, {i: [request(f"a{i}", p, dict(GREEDY, max_new_tokens=1))] for i, p in enumerate(convs)})
    sched.add_request(request("b0", convs[0] + [7], dict(GREEDY, max_new_tokens=1)))
    sched.step()  # b0 loads its prefix back and is launched
    assert sched.overlap.inflight.plan.loads is not None
    sched.add_request(request("b1", b1, sampled))
    faults.arm()  # b1's load-back fails; the engine reports it one poll late
    ahead = sched.overlap.ahead
    outs = sched.step()  # b1 launched ahead, then b0 applied: it reports b1's failure
    assert sched.overlap.ahead == ahead + 1 and sched.overlap.holds("b1")
    assert [r.rid for r in sched.waiting] == ["b1"] and sched.waiting[0].load_back_failed
    assert [o.rid for o in outs] == ["b0"] and sched.stats()["retractions"] == 1
    sched.check_integrity()
    sched.add_request(request("b2", convs[2] + [7], dict(GREEDY, max_new_tokens=1)))
    n = len(ft.submitted)
    sched.step()  # b2 launched ahead of b1's step, whose request gave its slots back while in flight
    assert sched.overlap.ahead == ahead + 2 and sched.overlap.holds("b2")
    assert [(kind, f) for kind, f, _ in ft.submitted[n:] if kind == "load"] == [("load", None)]
    got = run(sched, {})
    assert got["b1"]["ids"] == want
    assert sched.stats()["tiers"]["host"]["transfer_failures"] == 1
