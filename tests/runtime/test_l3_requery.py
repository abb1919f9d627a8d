"""A request whose prefix L2 held on arrival but evicted while it waited is served from L3: the
scheduler asks L3 again when it considers the request, and the pages it fetches stay pinned on L2
until the request is admitted. Real scheduler on the tiny model, real LMDB, greedy outputs
checked against an uncached engine, check_integrity() after every step."""
from __future__ import annotations

import random

from hicache.config import HiCacheConfig
from hicache.runtime.build import build_scheduler
from hicache.runtime.config import RuntimeConfig
from test_hicache_l3 import GREEDY, drain, request, settle

PAGE = 4


def scheduler(config_path, path=None, disable_radix_cache=False, **runtime):
    rc = RuntimeConfig(model_path=str(config_path), load_format="dummy", max_total_tokens=256,
                       chunked_prefill_size=48, max_prefill_tokens=96, **runtime)
    store = {"hicache_storage_backend": "lmdb", "hicache_storage_prefetch_policy": "wait_complete",
             "hicache_storage_backend_extra_config": {"path": str(path), "prefetch_threshold": 16}} if path else {}
    # the tiny model recomputes faster than L3 loads: load every hit; LRU evicts the oldest prompt
    cc = HiCacheConfig(page_size=PAGE, hicache_ratio=2.0, hicache_load_decision="always",
                       radix_eviction_policy="lru", disable_radix_cache=disable_radix_cache, **store)
    return build_scheduler(rc, cc)


def run(sched, prompts: dict[str, list[int]]) -> dict[str, list]:
    for rid, ids in prompts.items():
        sched.add_request(request(rid, ids, dict(GREEDY)))
    return drain(sched)


def test_a_prefix_evicted_from_l2_while_its_request_waited_is_fetched_from_l3(tiny_config_path, tmp_path):
    rng = random.Random(7)
    doc = [rng.randrange(3, 500) for _ in range(88)]
    fillers = {f"f{i}": [rng.randrange(3, 500) for _ in range(88)] for i in range(12)}
    question = doc + [rng.randrange(3, 500) for _ in range(8)]
    sched = scheduler(tiny_config_path, tmp_path, max_running_requests=1, schedule_policy="fcfs")
    run(sched, {"doc": doc})
    settle(sched)  # the document is on L1, L2 and L3
    # the question arrives behind 12 other prompts (1,056 tokens, more than L1 + L2 hold): it is
    # cached on arrival, and gone from L1 and L2 by the time it is admitted
    got = run(sched, {**fillers, "question": question})
    assert got["question"][1]["cached_tokens_details"] == {"device": 0, "host": 0, "storage": 88}
    assert sched.stats()["tiers"]["storage"]["prefetch_requeries"] == 1
    settle(sched)
    sched.check_integrity()
    assert not any(n.host_pin for n in sched.cache.tree.nodes())  # admitted: the fetched pages are unpinned
    sched.close()
    reference = scheduler(tiny_config_path, disable_radix_cache=True, max_running_requests=1)
    want = run(reference, {**fillers, "question": question})
    assert {rid: out for rid, (out, _) in got.items()} == {rid: out for rid, (out, _) in want.items()}
    reference.close()
