"""L3 with real server processes on the default model.

- An LMDB path that cannot be opened: the server starts and serves, degraded (/health, stats),
  and storage resumes once the path can be opened. Warm restart: a multi-turn conversation on
  it, the server stopped, a new one started on the same LMDB path: the same prompts are served
  from storage with identical greedy outputs.
- Two servers sharing one real Redis: the second serves what the first computed. Redis down at
  start-up (degraded, in /health and `hicache stats`), back (resumes), killed mid-run (requests
  go on, errors counted, outputs unchanged), back again (storage resumes).
"""
from __future__ import annotations

import json
import time

import httpx
import pytest

from hicache.server import stats_cli
from lmdb_corrupt import corrupt_value_nodes
from server_harness import LIGHT_FLAGS, start_server

pytestmark = pytest.mark.model

TURNS = ["Here is a long note about caches. " * 12 + "Summarise it in one line.",
         "Now list three kinds of cache, one word each. " * 4,
         "Which of them is the slowest? Answer briefly. " * 4]
GREEDY = {"temperature": 0, "max_new_tokens": 8}
STORAGE_OPTS = {"prefetch_threshold": 32}


def storage_flags(backend: str, **extra) -> tuple[str, ...]:
    return (*LIGHT_FLAGS, "--hicache-storage-backend", backend, "--hicache-storage-prefetch-policy", "wait_complete",
            "--hicache-storage-backend-extra-config", json.dumps({**STORAGE_OPTS, **extra}))


def generate(server, text: str) -> dict:
    r = httpx.post(server.url + "/generate", json={"text": text, "sampling_params": GREEDY}, timeout=120)
    r.raise_for_status()
    return r.json()


def converse(server, turns=TURNS) -> list[dict]:
    """Each turn's prompt is the whole conversation so far plus the next message."""
    context, out = "", []
    for turn in turns:
        context += turn
        res = generate(server, context)
        out.append(res)
        context += res["text"]
    return out


def storage_stats(server) -> dict:
    return httpx.get(server.url + "/hicache/stats", timeout=30).json()["tiers"]["storage"]


def health_storage(server) -> str:
    return httpx.get(server.url + "/health", timeout=30).json()["details"]["storage"]


def settle(server) -> dict:
    """Waits until the server's L3 writes have landed."""
    for _ in range(200):
        s = storage_stats(server)
        if s["backups_in_flight"] == 0:
            return s
        time.sleep(0.1)
    raise AssertionError("L3 backups still in flight")


def wait_for(predicate, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError("condition not reached in time")
        time.sleep(0.2)


def flush(server) -> None:
    """Empties the server's L1 and L2 (retried while transfers are in flight)."""
    wait_for(lambda: httpx.post(server.url + "/flush_cache", timeout=30).json()["success"])


def assert_degraded_then_resumes(server, path) -> None:
    """Serves without storage while the path is a file, then resumes once it can be opened."""
    assert health_storage(server).startswith(f"degraded: cannot open {path}: FileExistsError")
    res = generate(server, TURNS[0])
    assert res["meta_info"]["completion_tokens"] == GREEDY["max_new_tokens"]
    assert res["meta_info"]["cached_tokens_details"]["storage"] == 0
    wait_for(lambda: storage_stats(server)["errors"] > 0)
    assert storage_stats(server)["degraded"]
    path.unlink()  # the path can be opened now: the worker's probe reopens it
    wait_for(lambda: health_storage(server) == "ok")


def test_lmdb_degraded_resumes_and_a_restart_is_served_from_it(tmp_path):
    """One LMDB path through two servers. The first starts on a path that cannot be opened (a file
    where the folder should be): it serves, degraded, and storage resumes once the path can be
    opened; a conversation then (its cache flushed first: nothing of the degraded time in L1) is
    backed up. The second, started on the same path, serves the same prompts from storage with
    identical greedy outputs."""
    path = tmp_path / "lmdb"
    path.write_bytes(b"a file where the folder should be")
    flags = storage_flags("lmdb", path=str(path))
    first = start_server(*flags)
    try:
        assert_degraded_then_resumes(first, path)
        flush(first)
        cold = converse(first)
        assert health_storage(first) == "ok"
        assert settle(first)["backed_up_tokens"] > 0
    finally:
        first.stop()
    second = start_server(*flags)
    try:
        warm = converse(second)
        stats = storage_stats(second)
        metrics = httpx.get(second.url + "/metrics", timeout=30).text
    finally:
        second.stop()
    assert f'hicache_cached_tokens_total{{tier="storage"}} {float(stats["hit_tokens"])}' in metrics
    assert 'hicache_tier_prefetched_tokens_total{tier="storage"}' in metrics
    assert 'hicache_tier_degraded{tier="storage"} 0.0' in metrics
    assert [r["output_ids"] for r in warm] == [r["output_ids"] for r in cold]
    details = [r["meta_info"]["cached_tokens_details"] for r in warm]
    assert details[0]["storage"] >= 64, details
    assert stats["hit_tokens"] == sum(d["storage"] for d in details) and stats["prefetched_tokens"] > 0


def test_a_store_that_crashes_the_storage_process_is_quarantined_and_health_says_so(tmp_path, capsys):
    """A corrupt B-tree under a real server: the storage process crashes reading it; within three
    crashes the store is moved aside, /health and `hicache stats` name where, a fresh store
    serves, and the answers stay those of a server without storage."""
    path = tmp_path / "lmdb"
    flags = storage_flags("lmdb", path=str(path), shards=1)
    first = start_server(*flags)
    try:
        cold = generate(first, TURNS[0])
        settle(first)
    finally:
        first.stop()
    assert corrupt_value_nodes(path / "shard-00" / "data.mdb") > 0
    second = start_server(*flags)
    try:
        end = time.monotonic() + 120
        while "storage_quarantined" not in httpx.get(second.url + "/health", timeout=30).json()["details"]:
            assert time.monotonic() < end, storage_stats(second)
            flush(second)
            assert generate(second, TURNS[0])["output_ids"] == cold["output_ids"]  # L3 read: the child crashes
            time.sleep(0.5)
        details = httpx.get(second.url + "/health", timeout=30).json()["details"]
        stats = storage_stats(second)
        assert details["storage_quarantined"].startswith(f"{path}.quarantined-")
        assert stats["quarantined"] == details["storage_quarantined"] and stats["process_crashes"] <= 3
        wait_for(lambda: health_storage(second) == "ok", timeout=60)  # a fresh store serves
        assert stats_cli.run(second.url, None, False, None) == 0
        assert "quarantined" in capsys.readouterr().out
        assert generate(second, TURNS[1])["meta_info"]["completion_tokens"] == GREEDY["max_new_tokens"]
        metrics = httpx.get(second.url + "/metrics", timeout=30).text
        assert 'hicache_tier_quarantined_stores_total{tier="storage"} 1.0' in metrics
    finally:
        second.stop()


def test_two_servers_share_redis_and_survive_it_going_away(redis_server, capsys):
    redis_server.stop()
    flags = storage_flags("redis", url=redis_server.url, socket_timeout=0.5, connect_timeout=0.5)
    a = start_server(*flags)
    b = None
    try:
        assert health_storage(a).startswith("degraded")  # Redis down at start-up: serving without L3
        assert stats_cli.run(a.url, None, False, None) == 0
        assert "degraded" in capsys.readouterr().out
        redis_server.start()
        wait_for(lambda: health_storage(a) == "ok")  # the worker's probe noticed it is back
        b = start_server(*flags)
        share_and_survive(a, b, redis_server, q=TURNS[0][:200] + TURNS[1])
    finally:
        a.stop()
        if b is not None:
            b.stop()


@pytest.mark.slow  # the backend's own tests (tests/tiers/test_remote.py) run in the default suite
def test_two_servers_share_mooncake_and_survive_its_master_going_away(mooncake_master):
    """The second server serves from Mooncake what the first computed (pages striped over both
    servers' segments), identical greedy outputs; the master killed mid-run: requests go on as
    misses, errors counted; back (empty): storage resumes."""
    flags = storage_flags("mooncake", **mooncake_master.options)
    a = start_server(*flags)
    b = None
    try:
        b = start_server(*flags)
        share_and_survive(a, b, mooncake_master, q=TURNS[1] * 3)
    finally:
        a.stop()
        if b is not None:
            b.stop()


def share_and_survive(a, b, store, q: list) -> None:
    """b serves from the shared store what a computed, with a's greedy outputs; the store stopped
    mid-run: b serves `q` as a miss and counts errors; the store back (empty): storage resumes."""
    p = TURNS[0]
    on_a = generate(a, p)
    settle(a)
    on_b = generate(b, p)
    assert on_b["output_ids"] == on_a["output_ids"]
    assert on_b["meta_info"]["cached_tokens_details"]["storage"] >= 64

    reference_q = generate(a, q)
    store.stop()  # killed mid-run
    again = generate(b, q)
    assert again["output_ids"] == reference_q["output_ids"]
    assert again["meta_info"]["cached_tokens_details"]["storage"] == 0
    wait_for(lambda: health_storage(b).startswith("degraded"))
    assert storage_stats(b)["errors"] > 0

    store.start()
    wait_for(lambda: health_storage(b) == "ok")
    r = TURNS[2] * 3
    on_b = generate(b, r)
    settle(b)
    on_a = generate(a, r)
    assert on_a["output_ids"] == on_b["output_ids"]
    assert on_a["meta_info"]["cached_tokens_details"]["storage"] >= 64
