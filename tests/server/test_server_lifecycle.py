"""API key, the start-up warm-up, and SIGTERM with requests in flight or while loading. The keyed
server serves every test of the API key, its state at start-up is the warm-up's case (the shared
server's, which skips it, the flag's), then SIGTERM stops it. A dead scheduler process:
test_scheduler_death.py."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import anthropic
import httpx
import ollama
import openai
import pytest

from server_harness import LIGHT_FLAGS, MODEL_NAME, TOGETHER, pid_alive, start_up

pytestmark = pytest.mark.model
KEY = "s3cret-key"


@pytest.fixture(scope="module")
def keyed_start():
    started = start_up(*LIGHT_FLAGS, *TOGETHER, api_key=KEY)
    try:
        yield started
    finally:
        if started.handle.proc.poll() is None:
            started.handle.stop()


@pytest.fixture(scope="module")
def keyed_server(keyed_start):
    return keyed_start.handle


def test_api_key_enforced_on_every_route_but_health(keyed_server):
    url = keyed_server.url
    assert httpx.get(url + "/health").status_code == 200
    for method, path in [("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/hicache/stats"),
                         ("GET", "/get_server_info"), ("POST", "/generate"), ("POST", "/flush_cache"),
                         ("POST", "/v1/chat/completions"), ("GET", "/health_generate"), ("POST", "/v1/messages"),
                         ("POST", "/api/chat"), ("GET", "/api/tags"), ("POST", "/tokenize"), ("POST", "/apply_chat_template"),
                         ("POST", "/detokenize"), ("POST", "/v1/tokenize"), ("POST", "/v1/detokenize"),
                         ("GET", "/tokenizer_info")]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = httpx.request(method, url + path, headers=headers, json={})
            assert r.status_code == 401, (path, headers)
            error = r.json()["error"]  # in each API family's shape
            if path.startswith("/api/"):
                assert error.startswith("Invalid or missing API key")
            elif path == "/v1/messages":
                assert error["type"] == "authentication_error"
            else:
                assert error["code"] == "invalid_api_key"
    ok = httpx.get(url + "/v1/models", headers=keyed_server.headers)
    assert ok.status_code == 200
    assert httpx.get(url + "/tokenizer_info", headers=keyed_server.headers).json()["eos_token"]


def test_openai_client_with_key(keyed_server):
    good = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    r = good.completions.create(model=good.models.list().data[0].id, prompt="Hi", max_tokens=2)
    assert r.usage.completion_tokens == 2
    bad = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_anthropic_and_ollama_clients_with_key(keyed_server):
    question = [{"role": "user", "content": "Hi"}]
    good = anthropic.Anthropic(base_url=keyed_server.url, api_key=KEY, max_retries=0, timeout=120)  # x-api-key
    assert good.messages.count_tokens(model=MODEL_NAME, messages=question).input_tokens > 0
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=keyed_server.url, api_key="nope", max_retries=0).messages.count_tokens(
            model=MODEL_NAME, messages=question)
    assert ollama.Client(host=keyed_server.url, headers=keyed_server.headers).list().models
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=keyed_server.url).list()
    assert e.value.status_code == 401


def test_lang_runtime_endpoint_with_key(keyed_server):
    import hicache.lang as sgl

    with pytest.raises(RuntimeError, match="HTTP 401"):
        sgl.RuntimeEndpoint(keyed_server.url)

    @sgl.function
    def hello(s):
        s += sgl.user("Hello!")
        s += sgl.assistant(sgl.gen("reply", max_tokens=2))

    state = hello.run(temperature=0, backend=sgl.RuntimeEndpoint(keyed_server.url, api_key=KEY))
    assert 1 <= state.get_meta_info("reply")["completion_tokens"] <= 2


def test_stats_cli_needs_the_key(keyed_server):
    from test_server_native import run_cli

    assert run_cli("--url", keyed_server.url).returncode == 1
    out = run_cli("--url", keyed_server.url, "--api-key", KEY)
    assert out.returncode == 0 and "device" in out.stdout


@pytest.mark.parametrize("skip", [False, True])
def test_warm_up_runs_before_ready_and_counts_in_no_statistic(skip, request):
    """Each server as it started, before any test used it: the keyed one (warm-up on, the default)
    and the shared one (`--skip-server-warmup`, tests/server/conftest.py)."""
    started = request.getfixturevalue("server_start" if skip else "keyed_start")
    assert ("warm-up request done" in started.log) != skip
    frozen = re.search(r"start-up heap frozen: (\d+) objects", started.log)  # after the warm-up either way
    assert frozen and int(frozen.group(1)) > 10_000, started.log[-2000:]  # torch alone is more
    stats = started.stats
    assert stats["requests_finished"] == 0 and stats["tokens"]["prompt"] == stats["tokens"]["generation"] == 0
    assert stats["tiers"]["device"]["cached_tokens"] == stats["tiers"]["device"]["used_tokens"] == 0
    handle = started.handle
    r = httpx.post(handle.url + "/generate", timeout=60, headers=handle.headers, json={
        "text": "Hello", "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    assert r.status_code == 200 and r.json()["meta_info"]["cached_tokens"] == 0


def test_sigterm_with_streams_in_flight_leaves_no_process(keyed_server):
    """(Stops the keyed server: the module's last test on it.) SIGTERM while clients stream: the
    server finishes or fails them, exits, and takes the scheduler process with it."""
    ended, streaming = [], [threading.Event() for _ in range(3)]

    def client(first_token: threading.Event):
        try:
            with httpx.stream("POST", keyed_server.url + "/generate", headers=keyed_server.headers, timeout=120,
                              json={"text": "Tell a long story", "stream": True,
                                    "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        first_token.set()
            ended.append("closed")
        except httpx.HTTPError as e:
            ended.append(type(e).__name__)

    threads = [threading.Thread(target=client, args=(e,)) for e in streaming]
    for t in threads:
        t.start()
    assert all(e.wait(60) for e in streaming), "a stream never started"
    time.sleep(0.5)  # a few tokens more into each stream
    t0 = time.monotonic()
    code = keyed_server.stop(timeout=60)  # asserts the scheduler process is gone too
    assert time.monotonic() - t0 < 60 and code == 0
    for t in threads:
        t.join(30)
    assert len(ended) == 3  # every client got an end (no hang)


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().split(") ", 1)[1].split()[1]) == pid:
                        kids.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return kids


def test_sigterm_while_loading_stops_the_scheduler_too():
    import subprocess
    import sys

    from server_harness import free_port

    proc = subprocess.Popen([sys.executable, "-m", "hicache.server.cli", "serve", "--port", str(free_port()),
                             *LIGHT_FLAGS], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    kids: list[int] = []
    while not kids and time.monotonic() < deadline:  # the scheduler process (and multiprocessing's tracker)
        time.sleep(0.2)
        kids = _children(proc.pid)
    assert kids, "no scheduler process appeared"
    time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) != 0
    time.sleep(0.5)
    assert not [k for k in kids if pid_alive(k)], "a child outlived the server"


def test_a_busy_port_is_refused_before_the_model_loads():
    """The port is bound first: taken, the server exits at once with code 1 (not the supervisor's
    restart code) and says so, without loading the model."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "hicache.server.cli", "serve", "--host", "127.0.0.1", "--port",
                               str(port), *LIGHT_FLAGS], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr and "loading" not in done.stderr
