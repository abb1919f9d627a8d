"""Native routes of a real server, driven by httpx: /generate, metrics, cache control, bad input,
cancelled streams, and the `hicache stats` CLI against it."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_harness import free_port

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def sse_events(lines) -> list:
    events = []
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[len("data: "):]))
    return events


def wait_idle(http: httpx.Client, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = http.get("/hicache/stats").json()
        if (stats["running"] == 0 and stats["queued"] == 0 and stats["open_requests"] == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def test_generate_text(http):
    r = http.post("/generate", json={"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert r.status_code == 200
    body = r.json()
    meta = body["meta_info"]
    assert len(body["output_ids"]) == 4 and body["text"]
    assert meta["finish_reason"] == {"type": "length", "length": 4}
    assert meta["completion_tokens"] == 4 and meta["prompt_tokens"] == 5
    assert set(meta["cached_tokens_details"]) == {"device", "host", "storage"} and "id" in meta


def test_generate_input_ids_stream_is_cumulative(http):
    ids = http.post("/generate", json={"text": "Count: one, two,", "sampling_params": {"max_new_tokens": 0}}).json()
    with http.stream("POST", "/generate", json={"input_ids": [4363, 42, 582, 28, 827, 28], "stream": True,
                                                "sampling_params": {"max_new_tokens": 6, "temperature": 0}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert ids["output_ids"] == []
    assert len(events) >= 2
    for a, b in zip(events, events[1:]):
        assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"] and b["text"].startswith(a["text"])
    assert events[0]["meta_info"]["prompt_tokens"] == 6
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length" and len(events[-1]["output_ids"]) == 6
    done = http.post("/generate", json={"input_ids": [4363, 42, 582, 28, 827, 28],
                                        "sampling_params": {"max_new_tokens": 6, "temperature": 0}}).json()
    assert done["text"] == events[-1]["text"] and done["output_ids"] == events[-1]["output_ids"]


def test_generate_streams_emoji_and_cjk_whole(http):
    with http.stream("POST", "/generate", json={"text": "Repeat exactly: 😀😀 世界 你好 🎉", "stream": True,
                                                "sampling_params": {"max_new_tokens": 24, "temperature": 0}}) as r:
        events = sse_events(r.iter_lines())
    assert all("\ufffd" not in e["text"] for e in events)


def test_generate_batch_and_logprobs(http):
    r = http.post("/generate", json={"text": ["Hi", "Hello there"], "return_logprob": True, "top_logprobs_num": 2,
                                     "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    out = r.json()
    assert isinstance(out, list) and len(out) == 2
    lp = out[0]["meta_info"]["output_token_logprobs"]
    assert len(lp) == 2 and lp[0][1] == out[0]["output_ids"][0]
    assert len(out[0]["meta_info"]["output_top_logprobs"][0]) == 2


def test_metrics_parse(http):
    http.post("/generate", json={"text": "Metrics please", "sampling_params": {"max_new_tokens": 2}})
    text = http.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("hicache_prompt_tokens", "hicache_generation_tokens", "hicache_cached_tokens",
                 "hicache_time_to_first_token_seconds", "hicache_inter_token_latency_seconds",
                 "hicache_e2e_request_latency_seconds", "hicache_num_running_reqs", "hicache_num_queued_reqs",
                 "hicache_tier_used_tokens", "hicache_tier_capacity_tokens", "hicache_tier_evicted_tokens"):
        assert name in families, name
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert samples[("hicache_prompt_tokens_total", ())] > 0
    assert samples[("hicache_tier_capacity_tokens", (("tier", "device"),))] == 8192
    assert ("hicache_cached_tokens_total", (("tier", "host"),)) in samples
    assert samples[("hicache_e2e_request_latency_seconds_count", ())] >= 1


def test_flush_cache_drops_cached_prefix(http):
    body = {"text": "A shared prefix that is long enough to fill pages. " * 8, "sampling_params": {"max_new_tokens": 1}}
    http.post("/generate", json=body)
    assert http.post("/generate", json=body).json()["meta_info"]["cached_tokens"] > 0
    stats = wait_idle(http)
    assert stats["running"] == 0 and stats["queued"] == 0, stats
    r = http.post("/flush_cache")
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert http.post("/generate", json=body).json()["meta_info"]["cached_tokens"] == 0


BAD_INPUTS = [
    ("malformed json", "POST", "/v1/chat/completions", b'{"messages": [', 400),
    ("body not an object", "POST", "/v1/chat/completions", b"[1, 2]", 400),
    ("empty body", "POST", "/v1/completions", b"", 400),
    ("messages missing", "POST", "/v1/chat/completions", {"max_tokens": 2}, 400),
    ("messages wrong type", "POST", "/v1/chat/completions", {"messages": "hello"}, 400),
    ("messages empty", "POST", "/v1/chat/completions", {"messages": []}, 400),
    ("bad role", "POST", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("max_tokens not int", "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}, 400),
    ("negative max_tokens", "POST", "/v1/completions", {"prompt": "hi", "max_tokens": -3}, 400),
    ("top_p out of range", "POST", "/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400),
    ("temperature negative", "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": -0.1}, 400),
    ("n zero", "POST", "/v1/completions", {"prompt": "hi", "n": 0}, 400),
    ("unknown model", "POST", "/v1/completions", {"model": "gpt-17", "prompt": "hi"}, 404),
    ("context too long", "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1_000_000}, 400),
    ("prompt over context", "POST", "/v1/completions", {"prompt": "word " * 5000, "max_tokens": 1}, 400),
    ("stop wrong type", "POST", "/v1/completions", {"prompt": "hi", "stop": 5}, 400),
    ("empty prompt", "POST", "/v1/completions", {"prompt": ""}, 400),
    ("token id out of vocab", "POST", "/generate", {"input_ids": [1, 10_000_000]}, 400),
    ("text and input_ids", "POST", "/generate", {"text": "hi", "input_ids": [1]}, 400),
    ("neither text nor input_ids", "POST", "/generate", {"sampling_params": {}}, 400),
    ("unknown sampling param", "POST", "/generate", {"text": "hi", "sampling_params": {"temprature": 1}}, 400),
    ("sampling value wrong type", "POST", "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": "x"}}, 400),
    ("top_logprobs too large", "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 99}, 400),
    ("abort without rid", "POST", "/abort_request", {}, 400),
    ("unknown route", "POST", "/v1/nothing", {}, 404),
    ("wrong method", "GET", "/v1/chat/completions", None, 405),
    ("body too large", "POST", "/v1/completions", b'{"prompt": "' + b"x" * (17 * 1024 * 1024) + b'"}', 413),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_4xx_with_openai_error(http, case):
    _, method, path, body, status = case
    if isinstance(body, bytes):
        r = http.request(method, path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.request(method, path, json=body) if body is not None else http.request(method, path)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]


def test_still_serving_after_bad_input(http):
    assert len(BAD_INPUTS) >= 15
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json={"prompt": "Still alive?", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text  # greedy: no EOS here


def test_cancelled_streams_free_all_pages(server, http):
    async def one(client: httpx.AsyncClient, i: int) -> int:
        body = {"text": f"Story number {i}: once upon a time", "stream": True,
                "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
        got = 0
        async with client.stream("POST", "/generate", json=body) as r:
            async for line in r.aiter_lines():
                got += line.startswith("data: ")
                if got >= 3:
                    break  # leave mid-stream: the server must abort the request
        return got

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(20)))

    assert all(n == 3 for n in asyncio.run(main()))
    stats = wait_idle(http)
    assert stats["pages_held"] == 0 and stats["running"] == 0 and stats["queued"] == 0
    assert stats["open_requests"] == 0


def test_abort_request_by_rid(server, http):
    rid = "abort-me-please"
    with httpx.stream("POST", server.url + "/generate", timeout=120, json={
            "text": "Tell me a long story", "rid": rid, "stream": True,
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["meta_info"]["id"] == rid
        assert http.post("/abort_request", json={"rid": rid}).json()["aborted"] == 1
        events = sse_events(lines)
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "abort"}
    assert len(events[-1]["output_ids"]) < 400
    assert http.post("/abort_request", json={"rid": rid}).status_code == 404


def test_health_generate_and_server_info(http):
    assert http.get("/health_generate").json() == {"status": "ok"}
    info = http.get("/get_server_info").json()
    assert info["page_size"] == 16 and info["max_total_tokens"] == 8192 and info["port"] > 0
    assert "api_key" not in info and info["scheduler"]["page_size"] == 16


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hicache.server.cli", "stats", *args],
                          capture_output=True, text=True, timeout=60)


def test_stats_cli_shows_each_tier(server, http):
    http.post("/generate", json={"text": "Fill the stats", "sampling_params": {"max_new_tokens": 1}})
    out = run_cli("--url", server.url)
    assert out.returncode == 0, out.stderr
    for word in ("device", "host", "storage", "hit rate", "occupancy", "evicted"):
        assert word in out.stdout, word
    raw = json.loads(run_cli("--url", server.url, "--json").stdout)
    assert set(raw["tiers"]) >= {"device", "host", "storage"}


def test_stats_cli_against_dead_port_exits_1():
    out = run_cli("--url", f"http://127.0.0.1:{free_port()}")
    assert out.returncode == 1
    assert "no hicache server answers" in out.stderr
