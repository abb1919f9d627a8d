"""Prefill-decode disaggregation as a user runs it: a `--disaggregation-mode prefill` server, a
`--disaggregation-mode decode` server and sglang-router's PD mode in front of them, all real
processes. Greedy outputs through the router equal the session's colocated server's on /generate
(streaming and not) and the OpenAI routes; a conversation's second turn moves only its new pages
(the decode side's tree holds the first turn); a client gone while its KV is on the way, and a
prefill server killed mid-request, leave the decode server serving with no page held, the latter
with an error to the client in bounded time."""
from __future__ import annotations

import json
import random
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from hicache.server import stats_cli
from server_harness import LIGHT_FLAGS, MODEL_NAME, free_port, start_server

pytest.importorskip("sglang_router", reason="sglang-router is not installed")
BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
import multiturn  # noqa: E402
import router as bench_router  # noqa: E402

sys.path.remove(str(BENCH))
pytestmark = pytest.mark.model
PAGE = 16


@pytest.fixture(scope="module")
def pd():
    """(prefill server, decode server, router url, router process), the two servers started together."""
    port = free_port()
    started: dict = {}

    def start(role: str, *flags: str) -> None:
        started[role] = start_server(*LIGHT_FLAGS, "--disaggregation-mode", role, *flags)

    threads = [threading.Thread(target=start, args=("prefill", "--disaggregation-bootstrap-port", str(port))),
               threading.Thread(target=start, args=("decode", "--disaggregation-timeout", "20"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    proc = None
    try:
        assert set(started) == {"prefill", "decode"}, "a server did not start"
        proc, url = bench_router.start_pd_router(started["prefill"].url, port, started["decode"].url)
        yield started["prefill"], started["decode"], url, proc
    finally:
        if proc is not None:
            bench_router.stop(proc)
        for handle in started.values():
            if handle.proc.poll() is None:
                handle.stop()


def disagg(url: str) -> dict:
    return httpx.get(url + "/hicache/stats", timeout=30).json()["disaggregation"]


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(multiturn.WORDS) for _ in range(words))


def greedy(text: str, n: int, stream: bool = False) -> dict:
    return {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True},
            "stream": stream}


def streamed_ids(url: str, body: dict) -> list[int]:
    ids = []
    with httpx.stream("POST", url + "/generate", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ids = json.loads(line[6:])["output_ids"]
    return ids


def test_generate_through_the_pd_router_equals_a_colocated_server(pd, server):
    prefill, decode, url, _ = pd
    rng = random.Random()
    before = disagg(decode.url)
    for words in (3, 40, 90):  # under a page, a few pages, several pages
        text = prompt(rng, words)
        want = httpx.post(server.url + "/generate", json=greedy(text, 12), timeout=120).json()
        got = httpx.post(url + "/generate", json=greedy(text, 12), timeout=120)
        assert got.status_code == 200, got.text
        assert got.json()["output_ids"] == want["output_ids"]
        assert got.json()["text"] == want["text"]
        assert streamed_ids(url, greedy(text, 8, stream=True)) == want["output_ids"][:8]
    after = disagg(decode.url)
    assert after["mode"] == "decode" and disagg(prefill.url)["mode"] == "prefill"
    assert after["transfers"] - before["transfers"] >= 6
    assert after["bytes"] > before["bytes"] and after["transfers_failed"] == before["transfers_failed"]


def test_openai_routes_through_the_pd_router_equal_a_colocated_server(pd, server):
    _, _, url, _ = pd
    rng = random.Random()
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": prompt(rng, 20)}], "max_tokens": 10,
            "temperature": 0}
    want = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=120).json()
    got = httpx.post(url + "/v1/chat/completions", json=chat, timeout=120)
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["message"] == want["choices"][0]["message"]
    text = ""
    with httpx.stream("POST", url + "/v1/chat/completions", json={**chat, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    text += choice["delta"].get("content") or ""
    assert text == want["choices"][0]["message"]["content"]
    completion = {"model": MODEL_NAME, "prompt": prompt(rng, 30), "max_tokens": 8, "temperature": 0}
    want = httpx.post(server.url + "/v1/completions", json=completion, timeout=120).json()
    got = httpx.post(url + "/v1/completions", json=completion, timeout=120)
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["text"] == want["choices"][0]["text"]


def test_the_second_turn_moves_only_its_new_pages(pd, server, capsys):
    prefill, decode, url, _ = pd
    rng = random.Random()
    history = prompt(rng, 150)  # fresh: cached on neither server
    first = httpx.post(url + "/generate", json=greedy(history, 6), timeout=120).json()
    before = disagg(decode.url)
    sent_before = disagg(prefill.url)
    turn2 = history + first["text"] + " And then " + prompt(rng, 8)
    got = httpx.post(url + "/generate", json=greedy(turn2, 6), timeout=120).json()
    after = disagg(decode.url)
    cached = got["meta_info"]["cached_tokens"]
    tokens = got["meta_info"]["prompt_tokens"]
    assert cached >= first["meta_info"]["prompt_tokens"] // PAGE * PAGE  # the first turn's pages, on the decode side
    assert after["pages_skipped"] - before["pages_skipped"] == cached // PAGE
    assert after["pages"] - before["pages"] == -(-(tokens - cached) // PAGE) <= 3
    sent = disagg(prefill.url)
    assert sent["pages"] - sent_before["pages"] == after["pages"] - before["pages"]  # both sides count the same
    assert sent["bytes"] - sent_before["bytes"] == after["bytes"] - before["bytes"]
    want = httpx.post(server.url + "/generate", json=greedy(turn2, 6), timeout=120).json()
    assert got["output_ids"] == want["output_ids"]
    metrics = httpx.get(decode.url + "/metrics", timeout=30).text
    assert f"hicache_disagg_pages_skipped_total {float(after['pages_skipped'])}" in metrics
    assert stats_cli.run([prefill.url, decode.url], None, False, None) == 0  # `hicache stats --url P --url D`
    shown = capsys.readouterr().out
    assert "prefill server" in shown and "decode server" in shown and f"received {after['pages']} pages" in shown


def settled(url: str, within: float = 30) -> dict:
    """The server's stats once it runs nothing (`within` seconds at most)."""
    deadline = time.monotonic() + within
    while (stats := httpx.get(url + "/hicache/stats", timeout=30).json())["running"]:
        assert time.monotonic() < deadline, "the server still runs a failed request"
        time.sleep(0.1)
    return stats


def assert_nothing_held(stats: dict) -> None:
    assert stats["pages_held"] == 0 and stats["disaggregation"]["waiting"] == 0
    device = stats["tiers"]["device"]
    assert device["used_tokens"] == device["cached_tokens"]  # every used slot is the tree's: none leaked


def test_a_client_gone_while_its_kv_is_on_the_way_frees_the_decode_side(pd):
    """The router or the client drops the request while the decode server waits for a prefill
    server that never answers (a stand-in bootstrap server that accepts and stalls)."""
    _, decode, _, _ = pd
    stall = socket.create_server(("127.0.0.1", 0))
    try:
        body = {**greedy(prompt(random.Random(), 50), 4), "bootstrap_host": "127.0.0.1",
                "bootstrap_port": stall.getsockname()[1], "bootstrap_room": random.getrandbits(63)}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(decode.url + "/generate", json=body, timeout=1.5)
        assert_nothing_held(settled(decode.url, 5))  # at once: not when the transfer times out (20 s)
    finally:
        stall.close()


def test_a_prefill_server_killed_mid_request_fails_it_in_bounded_time(pd):
    """Last in the module: it kills the prefill server."""
    prefill, decode, url, _ = pd
    rng = random.Random()
    result: dict = {}

    def call() -> None:
        started = time.monotonic()
        try:
            result["status"] = httpx.post(url + "/generate", json=greedy(prompt(rng, 500), 4), timeout=60).status_code
        except httpx.HTTPError as e:
            result["status"] = repr(e)
        result["seconds"] = time.monotonic() - started

    caller = threading.Thread(target=call)
    caller.start()
    deadline = time.monotonic() + 30
    while httpx.get(prefill.url + "/hicache/stats", timeout=30).json()["running"] == 0:  # computing it now
        assert time.monotonic() < deadline, "the prefill server never ran the request"
        time.sleep(0.05)
    prefill.proc.send_signal(signal.SIGKILL)
    caller.join(60)
    assert not caller.is_alive()
    assert result["status"] != 200 and result["seconds"] < 30, result
    assert_nothing_held(settled(decode.url))
    alone = httpx.post(decode.url + "/generate", json=greedy(prompt(rng, 10), 3), timeout=120)  # no room: colocated
    assert alone.status_code == 200 and len(alone.json()["output_ids"]) == 3
