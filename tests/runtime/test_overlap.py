"""Overlap scheduling (runtime/overlap.py) forced on, on CPU: the same outputs as without it.

The tiny random 2-layer model drives the Scheduler directly with the same script of arrivals and
aborts in both modes; integrity is checked after every step, and once idle no page is held (the
position a finished request computed one step too many is freed).
"""
from __future__ import annotations

import argparse
import random

import pytest
import torch

from hicache import Engine
from hicache.config import HiCacheConfig
from hicache.runtime.config import RuntimeConfig
from hicache.runtime.messages import GenerateRequest
from hicache.runtime.scheduler import Scheduler

GREEDY = {"temperature": 0, "ignore_eos": True}


def scheduler(config_path, overlap: bool, total=1024, running=8, page_size=4, device="cpu", **cache) -> Scheduler:
    rc = RuntimeConfig(model_path=str(config_path), load_format="dummy", max_total_tokens=total,
                       max_running_requests=running, chunked_prefill_size=48, max_prefill_tokens=96,
                       device=device, dtype="float32", enable_overlap_schedule=overlap and device == "cpu",
                       disable_overlap_schedule=not overlap)
    cache.setdefault("hicache_storage_backend", "none")
    sched = Scheduler(rc, HiCacheConfig(page_size=page_size, **cache))
    assert (sched.overlap is not None) == overlap
    return sched


def run(sched: Scheduler, arrivals: dict[int, list[GenerateRequest]], abort_after: dict[str, int] | None = None,
        limit: int = 3000) -> dict[str, dict]:
    """Steps through the script (arrivals before step i; `abort_after[rid] = k`: abort once k tokens
    came out) until idle; returns rid -> {"ids", "reason", "meta", "logprobs"}."""
    abort_after, out = dict(abort_after or {}), {}
    for i in range(limit):
        for msg in arrivals.get(i, []):
            sched.add_request(msg)
        if i > max(arrivals, default=0) and not sched.has_work():
            break
        for o in sched.step():
            rec = out.setdefault(o.rid, {"ids": [], "reason": None, "meta": None, "logprobs": []})
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
            arrivals.setdefault(rng.randrange(0, 40), []).append(GenerateRequest(f"r{i}", prompt, params(rng, i)))
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
                    m.sampling_params["stop_token_ids"] = stops[m.rid]
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
                    m.return_logprob, m.top_logprobs_num = True, 3
        return arrivals

    plain, overlapped, _ = both(tiny_config_path, script, device=device)
    assert {r: v["ids"] for r, v in overlapped.items()} == {r: v["ids"] for r, v in plain.items()}
    for rid in ("r2", "r7"):
        a, b = plain[rid]["logprobs"], overlapped[rid]["logprobs"]
        assert len(a) == len(b) == len(plain[rid]["ids"]) > 0
        for (lp_a, top_a), (lp_b, top_b) in zip(a, b):
            assert lp_b == pytest.approx(lp_a, abs=1e-5)
            assert [t for t, _ in top_b] == [t for t, _ in top_a]


def test_small_pool_retracts(tiny_config_path):
    script = staggered(4, n=10, params=lambda rng, i: dict(GREEDY, max_new_tokens=30 + rng.randrange(10)))
    reference = run(scheduler(tiny_config_path, False, total=8192), script())
    plain, overlapped, sched = both(tiny_config_path, script, total=320, running=6)
    assert sched.counters["retractions"] > 0
    assert {r: v["ids"] for r, v in plain.items()} == {r: v["ids"] for r, v in reference.items()}
    assert {r: v["ids"] for r, v in overlapped.items()} == {r: v["ids"] for r, v in reference.items()}


def test_second_round_loads_back_from_l2(tiny_config_path):
    """Round 2 finds its prefixes in L2 only (L1 too small) and decodes on top of the load-back."""
    rng = random.Random(5)
    convs = [[rng.randrange(3, 500) for _ in range(60)] for _ in range(4)]

    def script():
        arrivals = {5 * i: [GenerateRequest(f"a{i}", p, dict(GREEDY, max_new_tokens=6))] for i, p in enumerate(convs)}
        arrivals[60] = [GenerateRequest(f"b{i}", p + [7, 8, 9], dict(GREEDY, max_new_tokens=6))
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
        with Engine(str(tiny_config_path), enable_overlap_schedule=overlap, **kw) as eng:
            assert (eng.scheduler.overlap is not None) == overlap
            outs.append([o["output_ids"] for o in eng.generate(**req)])
            eng.check_integrity()
    assert outs[0] == outs[1] and len(outs[0]) == 6
    with pytest.raises(ValueError, match="overlap"):
        RuntimeConfig(enable_overlap_schedule=True, disable_overlap_schedule=True)
    from hicache.server.flags import add_dataclass_flags, config_from_args

    parser = argparse.ArgumentParser()
    add_dataclass_flags(parser, RuntimeConfig, "runtime")
    assert config_from_args(RuntimeConfig, parser.parse_args(["--disable-overlap-schedule"])).disable_overlap_schedule
    assert not config_from_args(RuntimeConfig, parser.parse_args([])).disable_overlap_schedule
