"""Tensor parallelism on CPU: rank 0 in the test process, rank 1 a follower process, gloo between them.

- One TP=2 scheduler on the tiny random model (for the module) with a small L1, an L2, LMDB as L3,
  chunked prefill and overlap scheduling, driven directly: a first round that retracts, a second
  served from L2 (load-backs on both ranks), a third after a flush served from LMDB (prefetch on both
  ranks). Greedy outputs equal an uncached TP=1 scheduler's; integrity holds after every step.
- Presence is the AND over the ranks: with the follower's LMDB pages of one prompt deleted, that
  prompt is recomputed, the others still come from storage.
- The fan-out's combining rules with a follower that fails (a fake rank group injects the fault): a
  transfer or an L3 operation failed on one rank is failed for all; L3 hits are the least.
"""
from __future__ import annotations

import random

import pytest
import torch

from hicache.config import HiCacheConfig
from hicache.pagekey import page_keys
from hicache.runtime.build import build_scheduler
from hicache.runtime.config import RuntimeConfig
from hicache.runtime.parallel import TensorParallel
from hicache.runtime.tp_fanout import StorageFanout, TransferFanout
from hicache.tiers.base import StorageResult, TransferResult
from test_hicache_l2 import GREEDY, drain, request
from test_hicache_l3 import settle

PAGE = 4
NEW = 6


def scheduler(config_path, tp_size: int, total: int, **cache):
    # schedule_conservativeness 0: admissions reserve no room for outputs, so a small L1 retracts
    rc = RuntimeConfig(model_path=str(config_path), load_format="dummy", max_total_tokens=total,
                       max_running_requests=6, chunked_prefill_size=32, max_prefill_tokens=64,
                       overlap_schedule=True, tp_size=tp_size, schedule_conservativeness=0)
    return build_scheduler(rc, HiCacheConfig(**{"hicache_load_decision": "always", **cache}))


def run(sched, prompts: list[list[int]], tag: str) -> tuple[list[list[int]], list[dict]]:
    for i, p in enumerate(prompts):
        sched.add_request(request(f"{tag}{i}", p, dict(GREEDY, max_new_tokens=NEW)))
    out = drain(sched)
    return [out[f"{tag}{i}"][0] for i in range(len(prompts))], [out[f"{tag}{i}"][1] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(3)
    first = [[rng.randrange(3, 500) for _ in range(56)] for _ in range(5)]
    return first, [p + [7, 8, 9] for p in first]


@pytest.fixture(scope="module")
def want(tiny_config_path, prompts):
    ref = scheduler(tiny_config_path, 1, 16384, disable_radix_cache=True)
    try:
        return [run(ref, ps, f"r{i}")[0] for i, ps in enumerate(prompts)]
    finally:
        ref.close()


@pytest.fixture(scope="module")
def tp2(tiny_config_path, tmp_path_factory):
    path = tmp_path_factory.mktemp("tp-lmdb")
    sched = scheduler(tiny_config_path, 2, 160, page_size=PAGE, hicache_ratio=4.0, hicache_storage_backend="lmdb",
                      radix_eviction_policy="lru",  # the second round's prefixes all left L1 for L2
                      hicache_storage_prefetch_policy="wait_complete",
                      hicache_storage_io="threads",  # the test drops pages from a follower's backend
                      hicache_storage_backend_extra_config={"prefetch_threshold": 16, "path": str(path)})
    yield sched
    sched.close()


def test_tp2_matches_tp1_through_retraction_load_back_and_prefetch(tp2, prompts, want):
    sched = tp2
    got, _ = run(sched, prompts[0], "a")
    assert got == want[0] and sched.stats()["retractions"] > 0
    assert sched.overlap.continued > 0 and sched.overlap.ahead > 0  # input ids broadcast from the device
    got, meta = run(sched, prompts[1], "b")
    assert got == want[1]
    assert all(m["cached_tokens_details"]["host"] == 56 for m in meta), meta
    settle(sched)
    assert sched.flush_cache()
    _drop_follower_pages(sched, prompts[1][0])
    got, meta = run(sched, prompts[1], "c")
    assert got == want[1]
    assert [m["cached_tokens_details"]["storage"] for m in meta] == [0] + [56] * 4, meta
    storage = sched.stats()["tiers"]["storage"]
    assert storage["errors"] == 0 and storage["prefetched_tokens"] == 4 * 56


def _drop_follower_pages(sched, tokens: list[int]) -> None:
    """Deletes the pages of `tokens` that another rank than rank 0 stored (under its own namespace),
    through rank 0's LMDB shards (the store the ranks share)."""
    seed = sched.cache.storage.keys.seed("")
    keys = {bytes.fromhex(k) for k in page_keys(seed, tokens, PAGE)}
    raw = []
    for shard in sched.cache.storage.engine.local.backend._envs:
        with shard.env.begin(write=True, db=shard.pages) as txn:
            found = [k for k, _ in txn.cursor() if k[:8] != seed[:8] and k[8:] in keys]
            for k in found:
                txn.delete(k)
        raw += found
    assert len(raw) == len(keys)


# ---- the combining rules, with a fault injected on the follower's side ----------------------


class FakeRanks:
    """A rank group of one follower whose answers the test writes."""

    def __init__(self):
        self.tp = TensorParallel(0, 2)
        self.sent: list[list] = []
        self.answers: list = []
        self.l3_results: list[list] = []

    def send(self, msg: list) -> None:
        self.sent.append(msg)

    def call(self, msg: list) -> list:
        self.sent.append(msg)
        return [self.answers.pop(0)]

    def drain(self) -> None:
        pass


class LocalTransfers:
    def __init__(self):
        self.done: list[TransferResult] = []

    def backup(self, device_slots, host_slots) -> int:
        self.done.append(TransferResult(len(self.done) + 1, "backup", True, device_slots.numel(), 64, 0.0))
        return len(self.done)

    def poll(self) -> list[TransferResult]:
        done, self.done = self.done, []
        return done


def test_a_transfer_that_failed_on_a_follower_failed():
    ranks = FakeRanks()
    fan = TransferFanout(LocalTransfers(), ranks)
    slots = torch.arange(4)
    assert fan.backup(slots, slots) == 1 and fan.backup(slots, slots) == 2
    assert ranks.sent[0][0] == "backup" and len(ranks.sent) == 2
    ranks.answers.append([[1, True, None], [2, False, "RuntimeError('copy')"]])
    done = fan.poll()
    assert ranks.sent[-1] == ["poll", [1, 2]]
    assert [r.ok for r in done] == [True, False] and done[1].error == "rank 1: RuntimeError('copy')"
    assert fan.poll() == [] and len(ranks.sent) == 3  # nothing finished: no round trip


class LocalStorage:
    def __init__(self):
        self.tickets = 0
        self.done: list[StorageResult] = []

    def query(self, keys) -> int:
        self.tickets += 1
        self.done.append(StorageResult(self.tickets, "query", True, len(keys)))
        return self.tickets

    def progress(self, ticket: int) -> int:
        return 0

    def poll(self) -> list[StorageResult]:
        done, self.done = self.done, []
        return done

    def wait(self, timeout: float) -> None:
        pass


def test_l3_hits_are_the_least_over_the_ranks_and_wait_for_every_rank():
    ranks = FakeRanks()
    fan = StorageFanout(LocalStorage(), ranks)
    ticket = fan.query(["a", "b", "c"])
    assert ranks.sent == [["l3", "query", ticket, ["a", "b", "c"], None]]
    assert fan.poll() == []  # the follower has not answered
    ranks.l3_results.append([1, ticket, "query", True, 1, 0, None])
    (res,) = fan.poll()
    assert res.ok and res.pages == 1
    second = fan.query(["a"])
    ranks.l3_results.append([1, second, "query", False, 0, 0, "OSError('gone')"])
    (res,) = fan.poll()
    assert not res.ok and res.pages == 0 and res.error == "rank 1: OSError('gone')"
