"""The replicas' router (`server/routing.py`) and the statistics total (`server/aggregate.py`), on
fresh random prompts: no model, no process."""
from __future__ import annotations

import random

import pytest

from hicache.server.aggregate import merge_replicas
from hicache.server.routing import PrefixTable, Router, block_hashes

BLOCK = 16


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(49152) for _ in range(n)]


def test_a_prompt_returns_to_the_replica_that_served_its_prefix():
    rng = random.Random()
    router = Router(2, "cache_aware", page_size=BLOCK)
    tenants = [prompt(rng, 40 * BLOCK) for _ in range(6)]
    first = [router.route(t, "", [0, 0], [True, True]).rank for t in tenants]
    assert sorted(first) == [0, 0, 0, 1, 1, 1]  # new prefixes spread: each to the emptiest table
    for t, rank in zip(tenants, first):
        route = router.route(t + prompt(rng, 50), "", [0, 0], [True, True])
        assert route == (rank, len(t), "cache"), (route, rank)
    other_salt = router.route(tenants[0], "tenant-b", [0, 0], [True, True])
    assert other_salt.matched_tokens == 0 and other_salt.reason == "spread"  # a salt never shares a prefix
    assert router.stats()["routed"] == [7, 6] or router.stats()["routed"] == [6, 7]


def test_imbalanced_loads_go_to_the_least_loaded_and_a_dead_replica_is_skipped():
    rng = random.Random()
    router = Router(2, "cache_aware", page_size=BLOCK, balance_abs_threshold=4, balance_rel_threshold=1.5)
    tenant = prompt(rng, 20 * BLOCK)
    home = router.route(tenant, "", [0, 0], [True, True]).rank
    loads = [0, 0]
    loads[home] = 10
    assert router.route(tenant, "", loads, [True, True]) == (1 - home, 0, "balance")
    loads[home] = 4  # within the thresholds: the cached prefix wins
    assert router.route(tenant, "", loads, [True, True]).reason == "cache"
    alive = [True, True]
    alive[home] = False
    assert router.route(tenant, "", [0, 0], alive).rank == 1 - home
    router.forget(1 - home)
    assert router.tables[1 - home].blocks == {}
    with pytest.raises(ValueError):
        router.route(tenant, "", [0, 0], [False, False])


def test_round_robin_alternates_over_live_replicas_and_pinned_wins():
    rng = random.Random()
    router = Router(3, "round_robin")
    ranks = [router.route(prompt(rng, 30), "", [0] * 3, [True] * 3).rank for _ in range(6)]
    assert ranks == [0, 1, 2, 0, 1, 2]
    ranks = [router.route(prompt(rng, 30), "", [0] * 3, [True, False, True]).rank for _ in range(4)]
    assert ranks == [0, 2, 0, 2]
    assert router.route(prompt(rng, 30), "", [0] * 3, [True] * 3, pinned=1) == (1, 0, "pinned")
    assert router.stats()["reasons"] == {"cache": 0, "balance": 0, "spread": 0, "round_robin": 10, "pinned": 1}


def test_prefix_table_is_bounded_and_trims_paths_from_their_ends():
    rng = random.Random()
    table = PrefixTable(max_blocks=30)
    old, new = prompt(rng, 20 * BLOCK), prompt(rng, 20 * BLOCK)
    old_h, new_h = block_hashes(old, BLOCK), block_hashes(new, BLOCK)
    table.insert(old_h)
    table.insert(new_h)
    assert len(table.blocks) == 30
    assert table.match(new_h) == 20
    assert table.match(old_h) == 10  # the older path lost its last 10 blocks, not its first
    assert block_hashes(old[:BLOCK * 3 + 5], BLOCK) == old_h[:3]  # a partial block is left out


def test_router_table_follows_the_replica_cache_unless_sized():
    router = Router(2, page_size=64)
    router.fit(0, 64 * 100)
    assert router.block == 64 and router.tables[0].max_blocks == 100
    sized = Router(2, page_size=1, max_tree_size=1600)
    sized.fit(0, 10**6)
    assert sized.block == 16 and sized.tables[0].max_blocks == 100


def test_stats_total_adds_counters_and_keeps_shared_levels():
    def replica(finished: int, used: int, status: str) -> dict:
        return {"running": 1, "requests_finished": finished, "page_size": 16, "stats_age_s": finished / 10,
                "tiers": {"device": {"used_tokens": used, "capacity_tokens": 4096, "bytes_per_token": 100},
                          "host": {"enabled": True, "measured_prefill_tokens_per_s": float(finished)},
                          "storage": {"status": status, "degraded": status != "ok", "used_tokens": 500,
                                      "capacity_tokens": 9000, "hit_tokens": finished}}}

    per = [replica(3, 100, "ok"), {"alive": False, "error": "gone"}, replica(5, 200, "degraded: down")]
    total = merge_replicas(per, {"routed": [1, 2, 3]}, shared_storage=True)
    assert total["requests_finished"] == 8 and total["running"] == 2 and total["page_size"] == 16
    assert total["stats_age_s"] == 0.5
    device, host, storage = (total["tiers"][t] for t in ("device", "host", "storage"))
    assert device == {"used_tokens": 300, "capacity_tokens": 8192, "bytes_per_token": 100}
    assert host["measured_prefill_tokens_per_s"] == 4.0 and host["enabled"] is True
    assert storage["used_tokens"] == 500 and storage["capacity_tokens"] == 9000 and storage["hit_tokens"] == 8
    assert storage["status"] == "degraded: down" and storage["degraded"] is True
    assert [r["alive"] for r in total["replicas"]] == [True, False, True] and total["dp_size"] == 3
    assert total["router"] == {"routed": [1, 2, 3]}
    per_replica_l3 = merge_replicas(per, {}, shared_storage=False)
    assert per_replica_l3["tiers"]["storage"]["used_tokens"] == 1000
