"""The scheduler process killed mid-stream (SIGKILL), on real servers with the default model.

Without --restart-scheduler: every open stream ends with an error event within 2 s, then the server
process exits with code 3 (for a supervisor to restart it) and removes its socket directory.
With it: the streams fail the same way, a new scheduler process starts, the server serves the same
greedy answer again, and the L3 tier (LMDB on disk) still holds what the first scheduler stored.
"""
from __future__ import annotations

import glob
import json
import os
import signal
import threading
import time

import httpx
import pytest

from server_harness import LIGHT_FLAGS, TOGETHER, pid_alive, start_server

pytestmark = pytest.mark.model

EXIT_SCHEDULER_DIED = 3
ERROR_EVENT_WITHIN_S = 2.0
PROMPT = "Here is a long note about caches. " * 12 + "Summarise it in one line."
GREEDY = {"temperature": 0, "max_new_tokens": 8}


class LongStream(threading.Thread):
    """A streaming /generate that runs until the server ends it; records when and how it ended."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.started = threading.Event()
        self.events: list[str] = []
        self.ended_at: float | None = None
        self.failure: str | None = None

    def run(self) -> None:
        body = {"text": "Tell a long story", "stream": True,
                "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
        try:
            with httpx.stream("POST", self.url + "/generate", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[len("data: "):])
                        self.started.set()
                        if '"error"' in line:
                            self.ended_at = time.monotonic()
        except httpx.HTTPError as e:
            self.failure = f"{type(e).__name__}: {e}"
        finally:
            self.started.set()

    @property
    def error(self) -> dict | None:
        errors = [json.loads(e)["error"] for e in self.events if e != "[DONE]" and '"error"' in e]
        return errors[-1] if errors else None


def open_streams(url: str, n: int) -> list[LongStream]:
    streams = [LongStream(url) for _ in range(n)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.started.wait(60) and s.events, s.failure
    return streams


def assert_failed_in_time(streams: list[LongStream], killed_at: float) -> None:
    for s in streams:
        s.join(30)
        assert not s.is_alive(), "a stream was never ended"
        assert s.error is not None and s.error["type"] == "service_unavailable", (s.events[-3:], s.failure)
        assert s.events[-1] == "[DONE]"
        assert s.ended_at - killed_at < ERROR_EVENT_WITHIN_S, s.ended_at - killed_at


def socket_dirs(pid: int) -> list[str]:
    return glob.glob(f"/tmp/hicache-ipc-{pid}-*")


def generate(url: str, text: str = PROMPT) -> dict:
    r = httpx.post(url + "/generate", json={"text": text, "sampling_params": GREEDY}, timeout=120)
    r.raise_for_status()
    return r.json()


def test_scheduler_killed_mid_stream_fails_streams_then_server_exits_nonzero():
    handle = start_server(*LIGHT_FLAGS, *TOGETHER)
    try:
        assert socket_dirs(handle.proc.pid)
        streams = open_streams(handle.url, 3)
        killed_at = time.monotonic()
        os.kill(handle.scheduler_pid, signal.SIGKILL)
        assert_failed_in_time(streams, killed_at)
        assert "exited with code -9" in streams[0].error["message"]
        handle.proc.wait(30)
    finally:
        code = handle.stop()
    assert code == EXIT_SCHEDULER_DIED, handle.log_tail()
    assert "exiting with code 3" in handle.log.read_text()
    assert not socket_dirs(handle.proc.pid), "socket directory left behind"


def storage_flags(path: str) -> tuple[str, ...]:
    extra = json.dumps({"prefetch_threshold": 32, "path": path})
    return (*LIGHT_FLAGS, "--hicache-storage-backend", "lmdb", "--hicache-storage-prefetch-policy", "wait_complete",
            "--hicache-storage-backend-extra-config", extra)


def settle_backups(url: str) -> None:
    for _ in range(200):
        if httpx.get(url + "/hicache/stats", timeout=30).json()["tiers"]["storage"]["backups_in_flight"] == 0:
            return
        time.sleep(0.1)
    raise AssertionError("L3 backups still in flight")


def test_restart_scheduler_serves_again_and_keeps_l3(tmp_path):
    handle = start_server(*storage_flags(str(tmp_path / "lmdb")), "--restart-scheduler")
    try:
        before = generate(handle.url)
        settle_backups(handle.url)
        streams = open_streams(handle.url, 2)
        killed_at = time.monotonic()
        os.kill(handle.scheduler_pid, signal.SIGKILL)
        assert_failed_in_time(streams, killed_at)
        assert "restarting" in streams[0].error["message"]
        assert_unavailable_at_once(handle.url)  # while the new scheduler loads
        recovery = wait_healthy(handle.url, killed_at)
        print(f"\nscheduler restart: /health answers 200 again {recovery:.1f} s after the SIGKILL")
        info = httpx.get(handle.url + "/get_server_info", timeout=30).json()
        assert info["scheduler_pid"] != handle.scheduler_pid and pid_alive(info["scheduler_pid"])
        assert not pid_alive(handle.scheduler_pid)
        after = generate(handle.url)
        assert after["output_ids"] == before["output_ids"]
        assert after["meta_info"]["cached_tokens_details"]["storage"] >= 64, after["meta_info"]  # L1/L2 are new
        metrics = httpx.get(handle.url + "/metrics", timeout=30).text
        assert "hicache_scheduler_restarts_total 1.0" in metrics
        handle.scheduler_pid = info["scheduler_pid"]  # stop() checks that this one goes too
    finally:
        code = handle.stop()
    assert code == 0 and not socket_dirs(handle.proc.pid)
    assert "serving again after" in handle.log.read_text()


def assert_unavailable_at_once(url: str) -> None:
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable", r.text
    for method, path in (("POST", "/generate"), ("GET", "/hicache/stats"), ("GET", "/health")):
        assert httpx.request(method, url + path, json={"text": "hi"}, timeout=30).status_code == 503, path
    assert time.monotonic() - t0 < 5


def wait_healthy(url: str, since: float, timeout: float = 300) -> float:
    while time.monotonic() - since < timeout:
        if httpx.get(url + "/health", timeout=10).status_code == 200:
            return time.monotonic() - since
        time.sleep(0.1)
    raise AssertionError(f"not healthy {timeout} s after the scheduler died")
