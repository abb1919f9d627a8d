"""SIGTERM with open streams, on a real server and real streaming clients: the server stops
accepting, gives in-flight requests --graceful-shutdown-timeout seconds, then ends every open
stream with an error event in its family's shape and its terminator, and exits 0 without a
traceback."""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from server_harness import LIGHT_FLAGS, MODEL_NAME, TOGETHER, start_server

pytestmark = pytest.mark.model

GRACE_S = 1.0
LONG = {"max_new_tokens": 3000, "ignore_eos": True}


class Stream(threading.Thread):
    """One streaming request that runs until the server ends it; keeps every line it got."""

    def __init__(self, url: str, path: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.path, self.body = url, path, body
        self.started = threading.Event()
        self.lines: list[str] = []
        self.failure: str | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + self.path, json=self.body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        self.lines.append(line)
                        self.started.set()
        except httpx.HTTPError as e:
            self.failure = f"{type(e).__name__}: {e}"
        finally:
            self.started.set()

    def data(self) -> list[str]:
        return [line[len("data: "):] for line in self.lines if line.startswith("data: ")]


def test_sigterm_ends_every_open_stream_with_its_error_and_terminator_and_exits_cleanly():
    server = start_server(*LIGHT_FLAGS, *TOGETHER, "--graceful-shutdown-timeout", str(GRACE_S))
    chat = [{"role": "user", "content": "Tell a long story"}]
    story = [{"role": "user", "content": "Write a very long story about a dragon, at least 3000 words."}]  # greedy: 1500+ tokens
    streams = {
        "native": Stream(server.url, "/generate", {"text": "Tell a long story", "stream": True,
                                                   "sampling_params": LONG}),
        "openai": Stream(server.url, "/v1/chat/completions", {"model": MODEL_NAME, "messages": chat, "stream": True,
                                                              "max_tokens": 3000, "ignore_eos": True}),
        "anthropic": Stream(server.url, "/v1/messages", {"model": MODEL_NAME, "messages": story, "stream": True,
                                                         "max_tokens": 3000, "temperature": 0}),
        "ollama": Stream(server.url, "/api/chat", {"model": MODEL_NAME, "messages": story, "stream": True,
                                                   "options": {"num_predict": 3000, "temperature": 0}}),
    }
    try:
        for s in streams.values():
            s.start()
        for name, s in streams.items():
            assert s.started.wait(60) and s.lines, (name, s.failure)
        server.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        with pytest.raises(httpx.HTTPError):  # no longer accepting
            time.sleep(0.3)
            httpx.get(server.url + "/health", timeout=2)
        for s in streams.values():
            s.join(30)
        ended = time.monotonic() - signalled
        code = server.proc.wait(30)
    finally:
        server.stop()
    for name, s in streams.items():
        assert not s.is_alive() and s.failure is None, (name, s.failure, s.lines[-3:])
    native, openai = streams["native"].data(), streams["openai"].data()
    for data in (native, openai):
        assert data[-1] == "[DONE]", data[-3:]
        error = json.loads(data[-2])["error"]
        assert error["type"] == "service_unavailable" and "shutting down" in error["message"], error
    anthropic = streams["anthropic"].lines
    assert anthropic[-2:] == ["event: error", anthropic[-1]], anthropic[-4:]
    assert json.loads(anthropic[-1][len("data: "):])["error"]["type"] == "overloaded_error"
    assert "shutting down" in json.loads(streams["ollama"].lines[-1])["error"]
    assert GRACE_S <= ended < GRACE_S + 10
    assert code == 0
    log = server.log.read_text()
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
