"""Bad input of every kind against one real server, route by route: each case is answered 4xx with
an OpenAI-style JSON error within 5 s; slow clients are cut off; afterwards the server gives the
same greedy answers as before the list. Also, without a server: the JSON loader's checks and CORS."""
from __future__ import annotations

import json
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace

import httpx
import pytest
import uvicorn

from hicache.server.http_protocol import guarded_protocol
from hicache.server.protocol import APIError, load_json, nests_deeper_than
from server_harness import LIGHT_FLAGS, free_port, start_server

pytestmark = pytest.mark.model
READ_TIMEOUT_S = 2  # the server's --request-read-timeout
MAX_BODY = 1024 * 1024  # its --max-request-bytes
ANSWER_WITHIN_S = 5
ERROR_KEYS = {"message", "type", "param", "code"}
S = "\ud800"  # a lone surrogate: valid in JSON's \u escapes, not encodable as UTF-8
CHAT, CMPL, GEN, ABORT = "/v1/chat/completions", "/v1/completions", "/generate", "/abort_request"


@pytest.fixture(scope="module")
def server():
    handle = start_server(*LIGHT_FLAGS, "--request-read-timeout", str(READ_TIMEOUT_S),
                          "--max-request-bytes", str(MAX_BODY))
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=ANSWER_WITHIN_S) as c:
        yield c


def normal_answers(http: httpx.Client) -> list:
    """Greedy answers of each generating route."""
    gen = http.post(GEN, json={"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8,
                                                                                       "temperature": 0}})
    chat = http.post(CHAT, json={"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 8,
                                 "temperature": 0})
    cmpl = http.post(CMPL, json={"prompt": [504, 3575, 282], "max_tokens": 8, "temperature": 0})
    for r in (gen, chat, cmpl):
        assert r.status_code == 200, r.text
    return [gen.json()["output_ids"], chat.json()["choices"][0]["message"]["content"],
            cmpl.json()["choices"][0]["text"]]


@pytest.fixture(scope="module")
def before(http):
    """The answers before any bad input (every bad-input test asks for it, so it runs first)."""
    return normal_answers(http)


# ---- the table ------------------------------------------------------------------------------


@dataclass
class Case:
    name: str
    method: str
    path: str
    body: object = None  # dict / list: sent as JSON (surrogates as \u escapes); bytes: as they are
    status: int = 400
    param: str | None = None  # the error's param, when the case names one
    headers: dict | None = None  # replaces the JSON Content-Type


def chat(**kw) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **kw}


def cmpl(**kw) -> dict:
    return {"prompt": "hi", "max_tokens": 1, **kw}


def gen(sampling: dict | None = None, **kw) -> dict:
    return {"text": "hi", "sampling_params": {"max_new_tokens": 1, **(sampling or {})}, **kw}


def msg(content) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 1}


SURROGATES = [
    Case("chat model", "POST", CHAT, chat(model=S), param="model"),
    Case("completions model", "POST", CMPL, cmpl(model=S), param="model"),
    Case("message content", "POST", CHAT, msg(S), param="messages.0.content"),
    Case("content part text", "POST", CHAT, msg([{"type": "text", "text": "a" + S}]),
         param="messages.0.content.0.text"),
    Case("message name", "POST", CHAT, {"messages": [{"role": "user", "content": "hi", "name": S}]},
         param="messages.0.name"),
    Case("chat stop", "POST", CHAT, chat(stop=S), param="stop"),
    Case("completions stop list", "POST", CMPL, cmpl(stop=["ok", S]), param="stop.1"),
    Case("chat rid", "POST", CHAT, chat(rid=S), param="rid"),
    Case("completions rid", "POST", CMPL, cmpl(rid=S), param="rid"),
    Case("generate rid", "POST", GEN, gen(rid=S), param="rid"),
    Case("chat cache_salt", "POST", CHAT, chat(cache_salt=S), param="cache_salt"),
    Case("generate cache_salt", "POST", GEN, gen(cache_salt=S), param="cache_salt"),
    Case("generate extra_key", "POST", GEN, gen(extra_key=S), param="extra_key"),
    Case("completions prompt", "POST", CMPL, cmpl(prompt=S), param="prompt"),
    Case("completions prompt list", "POST", CMPL, cmpl(prompt=["ok", "x" + S]), param="prompt.1"),
    Case("generate text", "POST", GEN, {"text": S}, param="text"),
    Case("generate text batch", "POST", GEN, {"text": [S, "ok"]}, param="text.0"),
    Case("chat user", "POST", CHAT, chat(user=S), param="user"),
    Case("sampling_params stop", "POST", GEN, gen({"stop": S}), param="sampling_params.stop"),
    Case("abort rid", "POST", ABORT, {"rid": S}, param="rid"),
    Case("low surrogate alone", "POST", CHAT, msg("\udc00"), param="messages.0.content"),
    Case("surrogate pair reversed", "POST", CMPL, cmpl(prompt="\ude00\ud83d"), param="prompt"),
    Case("surrogate as a key", "POST", CHAT, chat(**{S: 1})),
    Case("surrogate key in sampling_params", "POST", GEN, gen({S: 1}), param="sampling_params"),
    Case("suffix", "POST", CMPL, cmpl(suffix=S), param="suffix"),
    Case("raw UTF-8 surrogate bytes", "POST", CMPL, b'{"prompt": "\xed\xa0\x80"}'),
    Case("invalid UTF-8 byte", "POST", GEN, b'{"text": "\xff"}'),
    Case("overlong UTF-8", "POST", GEN, b'{"text": "\xc0\xaf"}'),
]

INTEGERS = [
    Case("seed 2**64", "POST", CMPL, cmpl(seed=2**64), param="seed"),
    Case("seed below -2**63", "POST", CMPL, cmpl(seed=-(2**63) - 1), param="seed"),
    Case("seed 2**63", "POST", CHAT, chat(seed=2**63), param="seed"),
    Case("native seed 2**64", "POST", GEN, gen({"seed": 2**64}), param="sampling_params.seed"),
    Case("top_k 2**64", "POST", CMPL, cmpl(top_k=2**64), param="top_k"),
    Case("n 2**64", "POST", CMPL, cmpl(n=2**64), param="n"),
    Case("n 129", "POST", CMPL, cmpl(n=129), param="n"),
    Case("n 0", "POST", CHAT, chat(n=0), param="n"),
    Case("native n 129", "POST", GEN, gen({"n": 129}), param="n"),
    Case("native n 0", "POST", GEN, gen({"n": 0}), param="n"),
    Case("max_tokens 2**31", "POST", CMPL, cmpl(max_tokens=2**31), param="max_tokens"),
    Case("max_tokens -1", "POST", CMPL, cmpl(max_tokens=-1), param="max_tokens"),
    Case("max_tokens 2**64", "POST", CHAT, chat(max_tokens=2**64), param="max_tokens"),
    Case("max_completion_tokens 2**40", "POST", CHAT, chat(max_completion_tokens=2**40),
         param="max_completion_tokens"),
    Case("max_tokens as a string", "POST", CMPL, cmpl(max_tokens="16"), param="max_tokens"),
    Case("input_ids 2**64", "POST", GEN, {"input_ids": [2**64]}, param="input_ids.0"),
    Case("input_ids -1", "POST", GEN, {"input_ids": [-1]}, param="input_ids"),
    Case("input_ids 2**31", "POST", GEN, {"input_ids": [1, 2**31]}, param="input_ids"),
    Case("input_ids batch negative", "POST", GEN, {"input_ids": [[1], [-5]]}, param="input_ids"),
    Case("input_ids bool", "POST", GEN, {"input_ids": [True]}),
    Case("input_ids float", "POST", GEN, {"input_ids": [1.5]}),
    Case("prompt ids 2**40", "POST", CMPL, cmpl(prompt=[2**40]), param="prompt"),
    Case("prompt ids -5", "POST", CMPL, cmpl(prompt=[-5]), param="prompt"),
    Case("prompt ids bool", "POST", CMPL, cmpl(prompt=[True, False]), param="prompt"),
    Case("stop_token_ids -1", "POST", GEN, gen({"stop_token_ids": [-1]}), param="stop_token_ids"),
    Case("stop_token_ids 2**64", "POST", CHAT, chat(stop_token_ids=[2**64]), param="stop_token_ids.0"),
    Case("top_logprobs_num 21", "POST", GEN, gen(top_logprobs_num=21), param="top_logprobs_num"),
    Case("top_logprobs_num -1", "POST", GEN, gen(top_logprobs_num=-1), param="top_logprobs_num"),
    Case("logprob_start_len -2", "POST", GEN, gen(logprob_start_len=-2), param="logprob_start_len"),
    Case("top_logprobs 21", "POST", CHAT, chat(logprobs=True, top_logprobs=21), param="top_logprobs"),
    Case("completions logprobs 21", "POST", CMPL, cmpl(logprobs=21), param="logprobs"),
    Case("max_new_tokens -1", "POST", GEN, gen({"max_new_tokens": -1}), param="max_new_tokens"),
    Case("max_new_tokens 2**64", "POST", GEN, gen({"max_new_tokens": 2**64}),
         param="sampling_params.max_new_tokens"),
    Case("max_new_tokens over the context", "POST", GEN, gen({"max_new_tokens": 1_000_000}),
         param="max_new_tokens"),
    Case("5000-digit integer", "POST", CMPL, b'{"prompt": "hi", "seed": ' + b"9" * 5000 + b"}"),
    Case("prompts x n over the cap", "POST", CMPL, cmpl(prompt=["hi"] * 40, n=128), param="n"),
    Case("n a boolean", "POST", CMPL, cmpl(n=True), param="n"),
]

JSON_SHAPE = [
    Case("arrays 10000 deep", "POST", GEN, b"[" * 10_000 + b"]" * 10_000),
    Case("objects 10000 deep", "POST", CHAT, b'{"a":' * 10_000 + b"1" + b"}" * 10_000),
    Case("65 deep inside a field", "POST", CMPL, b'{"prompt": "hi", "x": ' + b"[" * 65 + b"]" * 65 + b"}"),
    Case("deep and unterminated", "POST", GEN, b"[" * 5000),
    Case("malformed", "POST", CHAT, b'{"messages": ['),
    Case("truncated string", "POST", CMPL, b'{"prompt": "hi'),
    Case("trailing garbage", "POST", CMPL, b'{"prompt": "hi"} x'),
    Case("NaN", "POST", CMPL, b'{"prompt": "hi", "temperature": NaN}'),
    Case("Infinity", "POST", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}'),
    Case("-Infinity", "POST", GEN, b'{"text": "hi", "sampling_params": {"temperature": -Infinity}}'),
    Case("body an array", "POST", CHAT, b"[1, 2]"),
    Case("body a string", "POST", GEN, b'"hello"'),
    Case("body null", "POST", CMPL, b"null"),
    Case("body a number", "POST", ABORT, b"42"),
    Case("empty body", "POST", CMPL, b""),
    Case("whitespace body", "POST", GEN, b"  \n "),
    Case("UTF-8 BOM", "POST", GEN, b'\xef\xbb\xbf{"text": "hi"}'),
    Case("UTF-16 body", "POST", GEN, '{"text": "hi"}'.encode("utf-16")),
    Case("single quotes", "POST", CMPL, b"{'prompt': 'hi'}"),
    Case("comment", "POST", CMPL, b'{"prompt": "hi" /* c */}'),
]

TYPES_AND_VALUES = [
    Case("messages null", "POST", CHAT, {"messages": None}, param="messages"),
    Case("messages missing", "POST", CHAT, {"max_tokens": 2}, param="messages"),
    Case("messages a string", "POST", CHAT, {"messages": "hello"}, param="messages"),
    Case("messages empty", "POST", CHAT, {"messages": []}, param="messages"),
    Case("message empty object", "POST", CHAT, {"messages": [{}]}, param="messages.0.role"),
    Case("role unknown", "POST", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, param="messages.0.role"),
    Case("content a number", "POST", CHAT, msg(5), param="messages.0.content"),
    Case("content part image", "POST", CHAT, msg([{"type": "image_url", "image_url": {"url": "x"}}]),
         param="messages.0.content"),
    Case("prompt null", "POST", CMPL, {"prompt": None}, param="prompt"),
    Case("prompt empty", "POST", CMPL, cmpl(prompt=""), param="prompt"),
    Case("prompt empty list", "POST", CMPL, cmpl(prompt=[]), param="prompt"),
    Case("prompt empty nested", "POST", CMPL, cmpl(prompt=[[]]), param="prompt"),
    Case("prompt mixed types", "POST", CMPL, cmpl(prompt=[1, "a"]), param="prompt"),
    Case("prompt over the context", "POST", CMPL, cmpl(prompt="word " * 5000), param="max_tokens"),
    Case("max_tokens over the context", "POST", CMPL, cmpl(max_tokens=1_000_000), param="max_tokens"),
    Case("neither text nor input_ids", "POST", GEN, {"sampling_params": {}}, param="text"),
    Case("text and input_ids", "POST", GEN, {"text": "hi", "input_ids": [1]}, param="text"),
    Case("input_ids empty", "POST", GEN, {"input_ids": []}, param="input_ids"),
    Case("input_ids empty nested", "POST", GEN, {"input_ids": [[1], []]}, param="input_ids"),
    Case("text empty batch", "POST", GEN, {"text": []}, param="text"),
    Case("text batch of numbers", "POST", GEN, {"text": [1, 2]}, param="text"),
    Case("sampling_params a list", "POST", GEN, {"text": "hi", "sampling_params": [1]}, param="sampling_params"),
    Case("sampling_params a string", "POST", GEN, {"text": "hi", "sampling_params": "x"}, param="sampling_params"),
    Case("unknown sampling param", "POST", GEN, gen({"temprature": 1}), param="sampling_params"),
    Case("sampling value a string", "POST", GEN, gen({"max_new_tokens": "x"}), param="max_new_tokens"),
    Case("stream a string", "POST", CMPL, cmpl(stream="yes"), param="stream"),
    Case("stream a number", "POST", GEN, gen(stream=1), param="stream"),
    Case("stream_options a string", "POST", CMPL, cmpl(stream_options="x"), param="stream_options"),
    Case("logprobs a string", "POST", CHAT, chat(logprobs="x"), param="logprobs"),
    Case("echo a string", "POST", CMPL, cmpl(echo="x"), param="echo"),
    Case("suffix unsupported", "POST", CMPL, cmpl(suffix="x"), param="suffix"),
    Case("chat unknown field", "POST", CHAT, chat(reasoning_effort="high"), param="reasoning_effort"),
    Case("chat functions", "POST", CHAT, chat(functions=[{"name": "f"}]), param="functions"),
    Case("chat store true", "POST", CHAT, chat(store=True), param="store"),
    Case("message unknown field", "POST", CHAT, {"messages": [{"role": "user", "content": "hi", "audio": {}}]},
         param="messages.0.audio"),
    Case("stream_options unknown field", "POST", CHAT, chat(stream_options={"x": 1}), param="stream_options.x"),
    Case("completions best_of", "POST", CMPL, cmpl(best_of=2), param="best_of"),
    Case("generate lora_path without --enable-lora", "POST", GEN, gen(lora_path="x"), param="lora_path"),
    Case("router field asking for more", "POST", GEN, gen(return_hidden_states=True), param="return_hidden_states"),
    Case("chat continue_final_message", "POST", CHAT, chat(continue_final_message=True),
         param="continue_final_message"),
    Case("temperature a word", "POST", CHAT, chat(temperature="hot"), param="temperature"),
    Case("temperature -1", "POST", CHAT, chat(temperature=-1), param="temperature"),
    Case("top_p 0", "POST", CMPL, cmpl(top_p=0), param="top_p"),
    Case("top_p 1.5", "POST", CMPL, cmpl(top_p=1.5), param="top_p"),
    Case("top_k 0", "POST", GEN, gen({"top_k": 0}), param="top_k"),
    Case("min_p 2", "POST", GEN, gen({"min_p": 2}), param="min_p"),
    Case("repetition_penalty 0", "POST", CHAT, chat(repetition_penalty=0), param="repetition_penalty"),
    Case("frequency_penalty 3", "POST", CMPL, cmpl(frequency_penalty=3), param="frequency_penalty"),
    Case("presence_penalty -3", "POST", CHAT, chat(presence_penalty=-3), param="presence_penalty"),
    Case("stop a number", "POST", CMPL, cmpl(stop=5), param="stop"),
    Case("stop list of numbers", "POST", CMPL, cmpl(stop=[1]), param="stop"),
    Case("stop empty string", "POST", GEN, gen({"stop": [""]}), param="stop"),
    Case("65 stop strings", "POST", CHAT, chat(stop=[f"s{i}" for i in range(65)]), param="stop"),
    Case("stop string of 2000 characters", "POST", GEN, gen({"stop": "x" * 2000}), param="stop"),
    Case("65 stop token ids", "POST", GEN, gen({"stop_token_ids": list(range(65))}), param="stop_token_ids"),
    Case("rid of 600 characters", "POST", GEN, gen(rid="r" * 600), param="rid"),
    Case("unknown model", "POST", CMPL, cmpl(model="gpt-17"), status=404, param="model"),
    Case("abort rid a number", "POST", ABORT, {"rid": 5}, param="rid"),
    Case("abort without rid", "POST", ABORT, {}, param="rid"),
    Case("abort unknown rid", "POST", ABORT, {"rid": "no-such-request"}, status=404, param="rid"),
    Case("abort_all a string", "POST", ABORT, {"abort_all": "yes"}, param="abort_all"),
]

TEXT = {"content-type": "text/plain"}
HTTP_RULES = [
    Case("generate as text/plain", "POST", GEN, gen(), status=415, headers=TEXT),
    Case("chat as a form", "POST", CHAT, chat(), status=415,
         headers={"content-type": "application/x-www-form-urlencoded"}),
    Case("completions without Content-Type", "POST", CMPL, cmpl(), status=415, headers={}),
    Case("abort as multipart", "POST", ABORT, {"abort_all": True}, status=415,
         headers={"content-type": "multipart/form-data; boundary=x"}),
    Case("abort_all as text/plain", "POST", ABORT, {"abort_all": True}, status=415, headers=TEXT),
    Case("json-ish Content-Type", "POST", GEN, gen(), status=415, headers={"content-type": "text/json"}),
    Case("flush_cache as text/plain", "POST", "/flush_cache", b"x", status=415, headers=TEXT),
    Case("flush_cache bare from a page", "POST", "/flush_cache", b"", status=415,
         headers={"origin": "http://evil.example"}),
    Case("flush_cache bare cross-site", "POST", "/flush_cache", b"", status=415,
         headers={"sec-fetch-site": "cross-site"}),
    Case("GET /flush_cache", "GET", "/flush_cache", status=405),
    Case("GET /abort_request", "GET", ABORT, status=405),
    Case("GET /generate", "GET", GEN, status=405),
    Case("GET /v1/completions", "GET", CMPL, status=405),
    Case("GET /v1/chat/completions", "GET", CHAT, status=405),
    Case("PUT /v1/completions", "PUT", CMPL, cmpl(), status=405),
    Case("DELETE /v1/models", "DELETE", "/v1/models", status=405),
    Case("POST /v1/models", "POST", "/v1/models", {}, status=405),
    Case("POST /health", "POST", "/health", {}, status=405),
    Case("POST /metrics", "POST", "/metrics", {}, status=405),
    Case("POST /hicache/stats", "POST", "/hicache/stats", {}, status=405),
    Case("POST /get_server_info", "POST", "/get_server_info", {}, status=405),
    Case("POST /get_model_info", "POST", "/get_model_info", {}, status=405),
    Case("POST /health_generate", "POST", "/health_generate", {}, status=405),
    Case("CORS preflight (CORS off)", "OPTIONS", GEN, status=405,
         headers={"origin": "http://evil.example", "access-control-request-method": "POST"}),
    Case("unknown route", "POST", "/v1/nothing", {}, status=404),
    Case("URL over 8 KiB", "GET", "/v1/models?" + "a" * 9000, status=414),
    Case("header over 32 KiB", "GET", "/v1/models", status=431, headers={"x-big": "a" * 40_000}),
    Case("body over the limit (chunked)", "POST", GEN, iter([b'{"text": "' + b"x" * (MAX_BODY + 10) + b'"}']),
         status=413),
]

CASES = SURROGATES + INTEGERS + JSON_SHAPE + TYPES_AND_VALUES + HTTP_RULES


def send(http: httpx.Client, case: Case) -> httpx.Response:
    headers = {"content-type": "application/json"} if case.headers is None else dict(case.headers)
    if isinstance(case.body, (dict, list)):
        content = json.dumps(case.body).encode()  # ensure_ascii: a surrogate goes as \ud800
    else:
        content = case.body
    if content is None:
        headers.pop("content-type", None)
    return http.request(case.method, case.path, content=content, headers=headers)


def assert_json_error(status: int, payload: bytes, expected: int, param: str | None = None) -> dict:
    assert status == expected, payload[:300]
    err = json.loads(payload)["error"]
    assert set(err) == ERROR_KEYS and err["message"] and err["type"], err
    if param is not None:
        assert err["param"] == param, err
    return err


def test_the_table_is_long_enough():
    assert len(CASES) + len(RAW_CASES) >= 100
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_a_json_4xx(http, before, case):
    started = time.monotonic()
    r = send(http, case)
    assert time.monotonic() - started < ANSWER_WITHIN_S
    assert r.headers["content-type"].startswith("application/json")
    assert_json_error(r.status_code, r.content, case.status, case.param)
    assert not any(k.startswith("access-control-") for k in r.headers), r.headers


# ---- malformed HTTP, on a raw socket ----------------------------------------------------------


RAW_CASES = [
    ("request line garbage", b"GARBAGE\r\n\r\n", 400),
    ("header line without a colon", b"GET /health HTTP/1.1\r\nHost: localhost\r\nbad header\r\n\r\n", 400),
    ("Content-Length not a number", b"POST /generate HTTP/1.1\r\nHost: localhost\r\nContent-Length: abc\r\n\r\n", 400),
    ("two Content-Lengths", b"POST /generate HTTP/1.1\r\nHost: localhost\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
     400),
    ("Transfer-Encoding gzip", b"POST /generate HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: gzip\r\n\r\n", 400),
    ("non-ASCII request line", b"GET /h\xc3\xa9 HTTP/1.1\r\nHost: localhost\r\n\r\n", 400),
    ("HTTP/2 preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 404),  # h11 takes PRI for a method; then 400 for SM
    ("no Host header", b"GET /health HTTP/1.1\r\n\r\n", 400),
    ("bad chunk size", b"POST /generate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                       b"Transfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
    ("request line over 32 KiB", b"GET /" + b"a" * 40_000, 414),
    ("headers over 32 KiB, unfinished", b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-A: " + b"a" * 40_000, 431),
    ("Content-Length over the limit", b"POST /generate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                                      b"Content-Length: 20000000\r\n\r\n", 413),
]


def raw_exchange(url: str, data: bytes, wait: float = ANSWER_WITHIN_S) -> tuple[bytes, float]:
    """Send `data`, read until the server closes; (what came back, seconds until the close)."""
    host, port = url.removeprefix("http://").split(":")
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=wait) as s:
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except (socket.timeout, ConnectionResetError):
            pass
    return out, time.monotonic() - started


def split_response(raw: bytes) -> tuple[int, dict, bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split(" ")[1]), headers, body


@pytest.mark.parametrize("case", RAW_CASES, ids=[c[0] for c in RAW_CASES])
def test_malformed_http_is_a_json_4xx(server, before, case):
    _, data, expected = case
    out, took = raw_exchange(server.url, data)
    assert took < ANSWER_WITHIN_S, "the server kept the connection open"
    status, headers, body = split_response(out)
    assert headers["content-type"] == "application/json"
    assert_json_error(status, body[:int(headers["content-length"])], expected)


# ---- slow clients ----------------------------------------------------------------------------


def test_partial_headers_get_408_and_the_connection_closed(server, before):
    out, took = raw_exchange(server.url, b"GET /health HTTP/1.1\r\nHost: localhost\r\n", wait=READ_TIMEOUT_S + 5)
    assert READ_TIMEOUT_S - 0.5 < took < READ_TIMEOUT_S + 3
    status, _, body = split_response(out)
    assert_json_error(status, body, 408)


def test_headers_dripped_byte_by_byte_are_cut_at_the_deadline(server, before):
    host, port = server.url.removeprefix("http://").split(":")
    started, closed_at = time.monotonic(), None
    with socket.create_connection((host, int(port)), timeout=READ_TIMEOUT_S + 5) as s:
        for byte in b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Slow: " + b"a" * 100:
            try:
                s.sendall(bytes([byte]))
                time.sleep(0.2)
            except OSError:
                closed_at = time.monotonic()
                break
            if time.monotonic() - started > READ_TIMEOUT_S + 3:
                break
    assert closed_at is not None and closed_at - started < READ_TIMEOUT_S + 3


def test_silent_connection_is_closed(server, before):
    out, took = raw_exchange(server.url, b"", wait=READ_TIMEOUT_S + 5)
    assert out == b"" and took < READ_TIMEOUT_S + 3


def test_partial_body_gets_408_and_the_connection_closed(server, before):
    head = b"POST /generate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    out, took = raw_exchange(server.url, head + b'{"te', wait=READ_TIMEOUT_S + 5)
    assert took < READ_TIMEOUT_S + 3
    status, headers, body = split_response(out)
    assert headers.get("connection") == "close"
    assert_json_error(status, body, 408)


def test_unread_body_of_a_get_does_not_hold_the_connection(server, before):
    out, took = raw_exchange(server.url, b"GET /health HTTP/1.1\r\nHost: localhost\r\nContent-Length: 100000\r\n\r\nabc")
    assert split_response(out)[0] == 200 and took < 2


# ---- what must still work --------------------------------------------------------------------


def test_bare_flush_cache_post_of_sglang_clients(http, before):
    r = http.post("/flush_cache")  # no body, no Content-Type, no Origin
    assert r.status_code == 200 and r.json()["success"] is True


def test_null_means_the_default(http, before):
    r = http.post(CMPL, json={"prompt": "Hi", "max_tokens": None, "n": None, "stream": None, "logprobs": None,
                              "temperature": None, "echo": None, "best_of": None})  # null asks for nothing
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 16 and len(r.json()["choices"]) == 1


def test_the_fields_sglang_router_adds_are_accepted(http, before):
    """The bodies SGLang's router forwards (its defaults added to what the client sent)."""
    common = {"return_hidden_states": False, "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True}
    bodies = {GEN: {"text": "Hi", "model": None, "sampling_params": {"max_new_tokens": 2}, "stream": False,
                    "return_text_in_logprobs": False, "log_metrics": True, "return_hidden_states": False,
                    "background": False, "no_logs": False, "return_bytes": False, "return_entropy": False},
              CHAT: {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 2, "logprobs": False,
                     "continue_final_message": False, "separate_reasoning": True, "stream_reasoning": True, **common},
              CMPL: {"prompt": "Hi", "max_tokens": 2, "echo": False, **common}}
    for route, body in bodies.items():
        r = http.post(route, json=body)
        assert r.status_code == 200, (route, r.text)


def test_still_serving_the_same_answers(server, http, before):
    assert http.get("/health").status_code == 200
    assert normal_answers(http) == before
    assert "Traceback" not in server.log.read_text(errors="replace")


# ---- without a server --------------------------------------------------------------------------


@pytest.mark.parametrize("raw, depth", [(b"[]", 1), (b'{"a": "[[[[["}', 1), (b'["\\"[[[["]', 1),
                                        (b'["\\\\"' + b"[" * 70, 71), (b"[" * 70 + b"]" * 70, 70),
                                        (b'[[[["]]]]"' + b"]" * 4, 4)])
def test_nesting_depth_ignores_brackets_in_strings(raw, depth):
    assert nests_deeper_than(raw, depth - 1) and not nests_deeper_than(raw, depth)


@pytest.mark.parametrize("raw, param", [(b'{"a": ["ok", "\\ud800"]}', "a.1"), (b'{"a": {"b": 18446744073709551616}}',
                                                                               "a.b")])
def test_loader_names_the_field(raw, param):
    with pytest.raises(APIError) as e:
        load_json(raw)
    assert e.value.status == 400 and e.value.param == param


def test_loader_keeps_valid_pairs_and_big_but_valid_integers():
    assert load_json(b'{"a": "\\ud83d\\ude00", "b": 9223372036854775807}') == {"a": "😀", "b": 2**63 - 1}


def _app(tm=None, **config):
    from hicache.server.app import create_app
    from hicache.server.config import ServerConfig

    tm = tm or SimpleNamespace()
    tm.info = SimpleNamespace(model_name="m", context_length=16)
    tm.runtime_config = SimpleNamespace(model_path=None)
    return create_app(tm, ServerConfig(**config))


def test_a_chat_template_that_refuses_the_messages_is_a_400():
    from jinja2 import TemplateError
    from starlette.testclient import TestClient

    def refuse(_messages, _tools=None):
        raise TemplateError("Conversation roles must alternate user/assistant/user/assistant/...")

    with TestClient(_app(SimpleNamespace(apply_chat_template=refuse, tokenizer=None)), base_url="http://localhost") as c:
        r = c.post(CHAT, json=msg("hi"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


def test_cors_only_for_the_configured_origins():
    from starlette.testclient import TestClient

    preflight = {"access-control-request-method": "POST", "access-control-request-headers": "content-type"}
    with TestClient(_app(allowed_origins="https://ok.example"), base_url="http://localhost") as c:
        ok = c.options(GEN, headers={"origin": "https://ok.example", **preflight})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://ok.example"
        bad = c.options(GEN, headers={"origin": "https://evil.example", **preflight})
        assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers
        assert set(bad.json()["error"]) == ERROR_KEYS
    with TestClient(_app(), base_url="http://localhost") as c:
        r = c.options(GEN, headers={"origin": "https://ok.example", **preflight})
        assert r.status_code == 405 and "access-control-allow-origin" not in r.headers


def test_allowed_origins_are_checked():
    from hicache.server.config import ServerConfig

    assert ServerConfig(allowed_origins="https://a.example, http://127.0.0.1:8080").origins() == [
        "https://a.example", "http://127.0.0.1:8080"]
    for bad in ("a.example", "https://a.example/path", "ftp://a.example"):
        with pytest.raises(ValueError):
            ServerConfig(allowed_origins=bad)


@contextmanager
def tiny_server(read_timeout: float, max_connections: int):
    """uvicorn with the guarded protocol around an app that answers 200 "ok"."""
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="off",
                                          http=guarded_protocol(read_timeout, max_connections)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def test_connections_over_the_cap_get_503_and_idle_ones_are_closed():
    with tiny_server(read_timeout=1.0, max_connections=1) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=5) as first:
            time.sleep(0.2)
            out, _ = raw_exchange(url, b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")
            status, _, body = split_response(out)
            assert_json_error(status, body, 503)
            started = time.monotonic()
            assert first.recv(100) == b""  # said nothing: closed at the deadline, without an answer
            assert time.monotonic() - started < 2
        assert httpx.get(url, timeout=5).text == "ok"


def test_only_the_allowed_hosts_are_answered():
    from starlette.testclient import TestClient

    def status(client, host=None):  # 404: past the Host check, to a route that does not exist
        return client.get("/no-such-route", headers={"host": host} if host else None).status_code

    with TestClient(_app(), base_url="http://evil.example") as c:  # bound to 127.0.0.1: loopback names only
        r = c.get("/health")
        assert r.status_code == 400 and r.json()["error"]["code"] == "host_not_allowed", r.text
        assert [status(c, h) for h in ("localhost:30000", "127.0.0.1", "[::1]:8080")] == [404] * 3
    with TestClient(_app(allowed_hosts="api.example"), base_url="http://api.example:443") as c:
        assert status(c) == 404 and status(c, "localhost") == 400
    with TestClient(_app(host="0.0.0.0"), base_url="http://anything.example") as c:
        assert status(c) == 404


def test_a_stream_whose_client_stops_reading_is_aborted():
    import asyncio

    from starlette.responses import StreamingResponse

    from hicache.server.app import WriteDeadlineMiddleware

    closed = []

    async def tokens():
        try:
            for i in range(1000):
                yield f"data: {i}\n\n"
        finally:
            closed.append(True)  # what aborts the stream's requests in the server

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            await asyncio.Event().wait()  # the client's socket is full: the write never completes

    async def receive():
        await asyncio.Event().wait()

    app = WriteDeadlineMiddleware(StreamingResponse(tokens()), timeout=0.2)
    scope = {"type": "http", "method": "GET", "path": "/", "headers": []}
    started = time.monotonic()
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 10))
    assert time.monotonic() - started < 5 and closed == [True]
