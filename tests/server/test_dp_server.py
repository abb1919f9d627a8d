"""`hicache serve --dp-size 2` on the default model: one server for the module (cache-aware routing,
L3 on one LMDB path that both replicas share). A prompt's later turns land on the replica that
cached its prefix, and the greedy answers equal the one-replica server's; a replica named by
`routed_dp_rank` serves a prefix the other one computed from the shared L3; /hicache/stats,
/metrics and `hicache stats` show the total, each replica and the router. Last, a replica killed
mid-stream ends its streams with a 503 and the server exits with code 3."""
from __future__ import annotations

import json
import os
import random
import signal
import time

import httpx
import pytest

from hicache.server import stats_cli
from server_harness import LIGHT_FLAGS, pid_alive, start_server
from test_scheduler_death import EXIT_SCHEDULER_DIED, assert_failed_in_time, open_streams, settle_backups

pytestmark = pytest.mark.model
PAGE = 16
GREEDY = {"temperature": 0, "max_new_tokens": 6}
WORDS = "cache page tier host device prefix token model layer store route replica batch query".split()


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory):
    extra = json.dumps({"prefetch_threshold": 32, "path": str(tmp_path_factory.mktemp("dp-l3"))})
    handle = start_server(*LIGHT_FLAGS, "--skip-server-warmup", "--dp-size", "2", "--hicache-storage-backend", "lmdb",
                          "--hicache-storage-prefetch-policy", "wait_complete",
                          "--hicache-storage-backend-extra-config", extra)
    handle.pids = httpx.get(handle.url + "/get_server_info", timeout=30).json()["scheduler_pids"]
    try:
        yield handle
    finally:
        handle.stop()


def generate(url: str, text: str, **extra) -> dict:
    r = httpx.post(url + "/generate", json={"text": text, "sampling_params": GREEDY, **extra}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def fresh_text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))  # cached nowhere yet


def stats(url: str) -> dict:
    return httpx.get(url + "/hicache/stats", timeout=30).json()


def test_turns_land_on_the_replica_of_their_prefix_with_the_one_replica_answers(dp_server, server):
    rng = random.Random()
    before = stats(dp_server.url)["router"]["routed"]
    for _tenant in range(2):
        system = fresh_text(rng, 150)
        turns = [f"{system} Question {turn}: {rng.choice(WORDS)}?" for turn in range(2)]
        outs = [generate(dp_server.url, t) for t in turns]
        assert outs[0]["meta_info"]["cached_tokens"] < PAGE
        assert outs[1]["meta_info"]["cached_tokens_details"]["device"] >= 100, outs[1]["meta_info"]
        assert [o["text"] for o in outs] == [generate(server.url, t)["text"] for t in turns]
    routed = [a - b for a, b in zip(stats(dp_server.url)["router"]["routed"], before)]
    assert routed == [2, 2], routed  # each tenant's turns on one replica, the two tenants spread


def test_a_replica_serves_what_the_other_stored_in_the_shared_l3(dp_server):
    text = fresh_text(random.Random(), 150) + " Summarise."
    first = generate(dp_server.url, text, routed_dp_rank=0)
    settle_backups(dp_server.url)
    second = generate(dp_server.url, text, routed_dp_rank=1)
    details = second["meta_info"]["cached_tokens_details"]
    assert details["device"] == 0 and details["storage"] >= 128, details
    assert second["text"] == first["text"]
    bad = httpx.post(dp_server.url + "/generate", json={"text": "hi", "routed_dp_rank": 2}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "routed_dp_rank", bad.text


def test_stats_metrics_and_the_cli_show_replicas_and_their_total(dp_server, capsys):
    generate(dp_server.url, "Count to three.")
    s = stats(dp_server.url)
    replicas = s["replicas"]
    assert s["dp_size"] == 2 and [r["dp_rank"] for r in replicas] == [0, 1] and all(r["alive"] for r in replicas)
    assert s["requests_finished"] == sum(r["requests_finished"] for r in replicas) > 0
    assert s["tiers"]["device"]["capacity_tokens"] == sum(r["tiers"]["device"]["capacity_tokens"] for r in replicas)
    assert s["tiers"]["storage"]["used_tokens"] == replicas[0]["tiers"]["storage"]["used_tokens"]  # one store
    assert sum(s["router"]["routed"]) == s["server"]["requests"], (s["router"], s["server"])
    metrics = httpx.get(dp_server.url + "/metrics", timeout=30).text
    for series in ('hicache_router_requests_total{dp_rank="1"}', 'hicache_replica_up{dp_rank="0"} 1.0',
                   'hicache_router_decisions_total{reason="cache"}', 'hicache_replica_tier_used_tokens{dp_rank="1"'):
        assert series in metrics, series
    assert stats_cli.run([dp_server.url], None, False, None) == 0
    shown = capsys.readouterr().out
    assert "replica 0" in shown and "replica 1" in shown and "cache_aware" in shown


def test_a_killed_replica_ends_its_streams_then_the_server(dp_server):
    """Runs last: the module's server does not survive it."""
    before = stats(dp_server.url)["router"]["routed"]
    streams = open_streams(dp_server.url, 1)
    rank = next(r for r, (a, b) in enumerate(zip(stats(dp_server.url)["router"]["routed"], before)) if a > b)
    killed_at = time.monotonic()
    os.kill(dp_server.pids[rank], signal.SIGKILL)
    assert_failed_in_time(streams, killed_at)
    assert f"replica {rank}" in streams[0].error["message"], streams[0].error
    assert dp_server.proc.wait(60) == EXIT_SCHEDULER_DIED, dp_server.log_tail()
    other = dp_server.pids[1 - rank]
    deadline = time.monotonic() + 10
    while pid_alive(other) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(other), "the other replica outlived the server"
