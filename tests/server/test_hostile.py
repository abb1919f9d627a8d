"""Hostile requests against the shared server: each gets a fast 4xx or bounded service, and a
probe request is answered meanwhile. A prompt that cannot fit the context by its length is refused
without tokenizing it; prompts are tokenized off the event loop; a grammar too large to compile is
refused naming the limit; a grammar that forces endless text costs what the request may emit; a
long prompt's chunked prefill lets short requests through between its chunks."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from hicache.runtime.grammar import MAX_GRAMMAR_CHARS

pytestmark = pytest.mark.model
PROBE_WITHIN_S = 10  # generous on a loaded 2-core machine: an unloaded probe takes about a second
PROBE = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}


class Attack(threading.Thread):
    """One request sent on a thread of its own; `response` once answered."""

    def __init__(self, url: str, path: str, body: dict, timeout: float = 300):
        super().__init__(daemon=True)
        self.url, self.path, self.body, self.timeout = url, path, body, timeout
        self.response: httpx.Response | None = None
        self.took: float | None = None

    def run(self) -> None:
        start = time.monotonic()
        self.response = httpx.post(self.url + self.path, json=self.body, timeout=self.timeout)
        self.took = time.monotonic() - start


def probe_while(server, attack: Attack, probes: int = 3) -> list[float]:
    """Starts `attack`, then sends `probes` short requests one after another while it is in flight;
    returns their latencies (each answered 200), checking that the attack had not finished."""
    attack.start()
    time.sleep(1.0)  # the attack's body is sent and its handling has begun
    latencies = []
    with httpx.Client(base_url=server.url, timeout=120) as http:
        for _ in range(probes):
            start = time.monotonic()
            r = http.post("/generate", json=PROBE)
            latencies.append(time.monotonic() - start)
            assert r.status_code == 200, r.text
    assert attack.is_alive(), f"the attack ended before the probes did ({attack.took} s, probes {latencies})"
    attack.join()
    return latencies


def test_a_prompt_far_beyond_the_context_is_refused_by_its_length(server):
    """12 MB of text cannot fit 4096 tokens whatever they are: a 400 at once, in the family's
    shape, naming the characters that fit (tokenizing it took seconds and gigabytes)."""
    text = "hello world " * 1_000_000
    for path, body, param in (("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}, "messages"),
                              ("/generate", {"text": text}, "text"),
                              ("/v1/completions", {"prompt": text}, "prompt")):
        start = time.monotonic()
        r = httpx.post(server.url + path, json=body, timeout=60)
        assert time.monotonic() - start < 5, path
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == param, err
        assert "characters fit" in err["message"] and "4096 tokens" in err["message"], err
    start = time.monotonic()
    r = httpx.post(server.url + "/v1/messages", json={"model": "smol", "max_tokens": 4,
                                                       "messages": [{"role": "user", "content": text}]}, timeout=60)
    assert time.monotonic() - start < 5
    assert r.status_code == 400 and r.json()["type"] == "error", r.text  # Anthropic's shape


def test_prompts_are_tokenized_off_the_event_loop(server):
    """A batch of texts each short enough to be tokenized, each too long to run (seconds of
    tokenizing in all): short requests are answered meanwhile."""
    attack = Attack(server.url, "/generate", {"text": ["hello world " * 25_000] * 12})
    latencies = probe_while(server, attack)
    assert max(latencies) < PROBE_WITHIN_S, latencies
    assert attack.response.status_code == 400, attack.response.text
    assert attack.response.json()["error"]["code"] == "context_length_exceeded"


def test_a_grammar_too_large_to_compile_is_refused_naming_the_limit(server):
    """An enum of 10^5 strings (its compilation took half a minute): a 400 at once."""
    schema = {"type": "string", "enum": [f"v{i}" for i in range(100_000)]}
    for path, body, param in (
            ("/generate", {"text": "Pick one.", "sampling_params": {"json_schema": json.dumps(schema)}},
             "sampling_params.json_schema"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Pick one."}], "max_tokens": 8,
                                      "response_format": {"type": "json_schema",
                                                          "json_schema": {"name": "a", "schema": schema}}}, None)):
        start = time.monotonic()
        r = httpx.post(server.url + path, json=body, timeout=30)
        assert time.monotonic() - start < 10, path
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert f"at most {MAX_GRAMMAR_CHARS}" in err["message"] and "too large" in err["message"], err
        assert param is None or err["param"] == param, err


def test_a_grammar_forcing_endless_text_is_served_within_its_length(server):
    """`root ::= "x" root` forces text without end: the request ends by length, and requests
    beside it are answered while it runs."""
    body = {"text": "Write x.", "sampling_params": {"ebnf": 'root ::= "x" root', "max_new_tokens": 1000,
                                                     "temperature": 0}}
    attack = Attack(server.url, "/generate", body, timeout=240)
    latencies = probe_while(server, attack, probes=2)
    assert max(latencies) < PROBE_WITHIN_S, latencies
    out = attack.response.json()
    assert attack.response.status_code == 200, out
    assert out["meta_info"]["finish_reason"]["type"] == "length" and set(out["text"]) == {"x"}


def test_short_requests_are_served_between_the_chunks_of_a_long_prompt(server):
    """Two prompts of nearly the whole context are computed in chunks over many seconds on CPU:
    short requests are admitted beside their chunks and decode in each of them, rather than
    waiting until they are computed."""
    prompts = [[(7 * i + k) % 40_000 + 100 for i in range(3800)] for k in (0, 1)]
    attack = Attack(server.url, "/generate", {"input_ids": prompts, "sampling_params": {"max_new_tokens": 1}})
    latencies = probe_while(server, attack, probes=2)
    assert max(latencies) < PROBE_WITHIN_S, latencies
    assert attack.response.status_code == 200, attack.response.text
