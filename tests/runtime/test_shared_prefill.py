"""Requests that arrive together with a long shared prompt: the first computes it, the others wait
for it and find it cached (`BudgetPolicy.prefill_leaders`, `CacheManager.publish`), with the same
greedy outputs as when every prompt is computed in full. The tiny random model, driven through the
Scheduler with and without overlap scheduling; integrity checked after every step."""
from __future__ import annotations

import random

import pytest

from test_overlap import GREEDY, request, run, scheduler

SHARED, TAIL, NEW = 160, 8, 6


def script(prefix: list[int], tails: list[list[int]]):
    return lambda: {0: [request(f"r{i}", prefix + t, {**GREEDY, "max_new_tokens": NEW}) for i, t in enumerate(tails)]}


@pytest.mark.parametrize("overlap", [False, True])
def test_a_shared_prompt_is_computed_once_and_outputs_match(tiny_config_path, overlap):
    rng = random.Random(7)
    prefix = [rng.randrange(3, 500) for _ in range(SHARED)]
    tails = [[rng.randrange(3, 500) for _ in range(TAIL)] for _ in range(4)]
    want = run(scheduler(tiny_config_path, False, disable_radix_cache=True), script(prefix, tails)())
    sched = scheduler(tiny_config_path, overlap)
    got = run(sched, script(prefix, tails)())
    assert {r: o["ids"] for r, o in got.items()} == {r: o["ids"] for r, o in want.items()}
    cached = sorted(o["meta"]["cached_tokens"] for o in got.values())
    assert cached[0] == 0 and all(c >= SHARED // 4 * 4 for c in cached[1:]), cached
    assert sched.counters["prompt_tokens"] <= SHARED + 4 * (TAIL + 4)  # the prefix once, each tail (a page more)


def test_a_short_shared_prefix_does_not_hold_anyone_back(tiny_config_path):
    rng = random.Random(8)
    prefix = [rng.randrange(3, 500) for _ in range(16)]
    tails = [[rng.randrange(3, 500) for _ in range(12)] for _ in range(3)]  # all three fit one step
    sched = scheduler(tiny_config_path, False)
    for msg in script(prefix, tails)()[0]:
        sched.add_request(msg)
    sched.step()
    assert len(sched.running) == 3 and not sched.waiting
