"""Disaggregation between two in-process engines on the default model over real sockets: a
prefill engine (its bootstrap server, `KVSender`) and a decode engine (`KVReceiver`). The decode
engine's greedy output equals a colocated run's, whichever of the two halves comes first. Faults
come from stand-in peers: a bootstrap server that accepts and never answers, one that dies
mid-payload, an ask for another prompt; each fails its request with an error in bounded time,
leaves both engines' caches intact (`check_integrity`), and both keep serving."""
from __future__ import annotations

import random
import socket
import threading
import time

import pytest

from engines import make_engine
from hicache.runtime.disagg import wire

pytestmark = pytest.mark.model
TIMEOUT = 6.0  # the decode engine's transfer timeout
FLAGS = {"max_total_tokens": 4096, "context_length": 2048, "page_size": 16}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def pair(default_model_path):
    port = free_port()
    with make_engine(default_model_path, **FLAGS, disaggregation_mode="prefill", disaggregation_bootstrap_port=port,
                     disaggregation_timeout=30) as p, \
            make_engine(default_model_path, **FLAGS, disaggregation_mode="decode",
                        disaggregation_timeout=TIMEOUT) as d:
        yield p, d, port


def greedy(n: int) -> dict:
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def room() -> int:
    return random.getrandbits(63)


def decode_stats(d) -> dict:
    return d.get_stats()["disaggregation"]


@pytest.mark.parametrize("prefill_first", [True, False])
def test_the_decode_engine_continues_the_prefill_engines_prompt(pair, prefill_first):
    p, d, port = pair
    ids = prompt(random.Random(), 70)  # four pages and a part
    want = d.generate(input_ids=ids, sampling_params=greedy(8), cache_salt="colocated")["output_ids"]
    r = room()
    got: dict = {}
    half = threading.Thread(target=lambda: got.update(p=p.generate(input_ids=ids, sampling_params=greedy(8),
                                                                      bootstrap=("127.0.0.1", port, r))))
    before = decode_stats(d)
    if prefill_first:
        half.run()
    else:
        half.start()
    out = d.generate(input_ids=ids, sampling_params=greedy(8), bootstrap=("127.0.0.1", port, r))
    if not prefill_first:
        half.join()
    assert out["output_ids"] == want
    assert got["p"]["output_ids"] == want[:1]  # the prefill half samples the first token only
    after = decode_stats(d)
    assert after["transfers"] == before["transfers"] + 1 and after["pages"] == before["pages"] + 5
    assert after["bytes"] - before["bytes"] == len(ids) * d.scheduler.bytes_per_token
    p.check_integrity()
    d.check_integrity()


def test_a_stalled_prefill_server_fails_the_request_within_the_timeout(pair):
    _, d, _ = pair
    stall = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel's backlog), never answers
    failed = decode_stats(d)["transfers_failed"]
    started = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="KV transfer from the prefill server .* failed: timed out"):
            d.generate(input_ids=prompt(random.Random(), 40), sampling_params=greedy(4),
                       bootstrap=("127.0.0.1", stall.getsockname()[1], room()))
    finally:
        stall.close()
    assert TIMEOUT - 0.5 < time.monotonic() - started < TIMEOUT + 10
    assert decode_stats(d)["transfers_failed"] == failed + 1 and decode_stats(d)["waiting"] == 0
    d.check_integrity()
    assert len(d.generate(input_ids=prompt(random.Random(), 20), sampling_params=greedy(3))["output_ids"]) == 3


def test_a_prefill_server_that_dies_mid_payload_fails_the_request_at_once(pair):
    _, d, _ = pair
    ids = prompt(random.Random(), 40)
    listener = socket.create_server(("127.0.0.1", 0))

    def die_mid_payload() -> None:
        conn, _ = listener.accept()
        with conn:
            ask = wire.recv_frame(conn)
            n = (ask["tokens"] - ask["start"]) * d.scheduler.bytes_per_token
            wire.send_frame(conn, {"room": ask["room"], "first_token": 7, "layout": d.scheduler.receiver.layout,
                                   "nbytes": n}, memoryview(bytes(n // 2)))

    peer = threading.Thread(target=die_mid_payload)
    peer.start()
    started = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="closed the connection mid-transfer"):
            d.generate(input_ids=ids, sampling_params=greedy(4), bootstrap=("127.0.0.1", listener.getsockname()[1],
                                                                            room()))
    finally:
        peer.join()
        listener.close()
    assert time.monotonic() - started < TIMEOUT
    d.check_integrity()
    assert len(d.generate(input_ids=ids, sampling_params=greedy(3))["output_ids"]) == 3


def test_an_ask_for_another_prompt_gets_an_error_and_the_prefill_engine_keeps_serving(pair):
    p, _, port = pair
    ids, r = prompt(random.Random(), 30), room()
    p.generate(input_ids=ids, sampling_params=greedy(4), bootstrap=("127.0.0.1", port, r))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        wire.send_frame(conn, {"room": r, "start": 0, "tokens": len(ids), "digest": wire.digest(ids[::-1])})
        assert wire.recv_frame(conn) == {"room": r, "error": "the prefill server computed another prompt for this "
                                                             "bootstrap room"}
    p.check_integrity()
    assert p.get_stats()["disaggregation"]["transfers_failed"] >= 1
    assert len(p.generate(input_ids=ids, sampling_params=greedy(3))["output_ids"]) == 3  # no room: colocated


def test_a_disaggregated_request_refuses_a_grammar(pair):
    _, d, port = pair
    with pytest.raises(ValueError, match="bootstrap_room: a disaggregated request takes no grammar"):
        d.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 4, "regex": "[ab]+"},
                   bootstrap=("127.0.0.1", port, room()))
    d.check_integrity()
