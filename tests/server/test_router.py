"""Two replicas behind SGLang's router (`sglang-router`, cache_aware policy): the router registers
our servers (health, model and server info), forwards /generate and the OpenAI routes with the
fields it adds to every body, and requests that share a prefix land on the replica that holds it
(their cached tokens say so); `hicache stats` over both replicas and their total."""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import httpx
import pytest

from hicache.server import stats_cli
from server_harness import LIGHT_FLAGS, start_server

pytest.importorskip("sglang_router", reason="sglang-router is not installed")
BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
import multiturn  # noqa: E402
import router as bench_router  # noqa: E402

sys.path.remove(str(BENCH))
pytestmark = pytest.mark.model
PAGE = 16


def finished(urls: list[str]) -> list[int]:
    return [httpx.get(u + "/hicache/stats", timeout=30).json()["requests_finished"] for u in urls]


def test_router_fronts_two_replicas_and_keeps_a_prefix_on_its_replica(server, capsys):
    other = start_server(*LIGHT_FLAGS)
    replicas = [server.url, other.url]
    proc = None
    try:
        proc, url = bench_router.start_router(replicas, "cache_aware")
        before = finished(replicas)
        rng = random.Random()
        for _ in range(2):  # two tenants
            system = " ".join(rng.choice(multiturn.WORDS) for _word in range(160))  # fresh: cached nowhere yet
            cached = []
            for turn in range(3):
                r = httpx.post(url + "/generate", timeout=120, json={
                    "text": f"{system} Question {turn}: {rng.choice(multiturn.WORDS)}?",
                    "sampling_params": {"temperature": 0, "max_new_tokens": 2}})
                assert r.status_code == 200, r.text
                cached.append(r.json()["meta_info"]["cached_tokens"])
            assert cached[0] < PAGE and min(cached[1:]) >= 128, cached  # the later turns hit the first's replica
        served = [a - b for a, b in zip(finished(replicas), before)]
        assert sum(served) == 6, served  # every request reached a replica once (the router spreads by load)

        assert stats_cli.run(replicas, None, True, None) == 0  # `hicache stats --url A --url B --json`
        both = json.loads(capsys.readouterr().out)
        assert list(both["replicas"]) == replicas
        assert both["total"]["requests_finished"] == sum(finished(replicas))
        assert both["total"]["cached_tokens"]["device"] >= 4 * 128
        assert stats_cli.run(replicas, None, False, None) == 0
        assert "2 replicas" in capsys.readouterr().out

        chat = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"],
            "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2})
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["completion_tokens"] == 2
    finally:
        if proc is not None:
            bench_router.stop(proc)
        other.stop()
