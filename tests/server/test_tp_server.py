"""`hicache serve --tp-size 2` on the tiny random model (CPU, gloo): a follower rank killed while a
stream runs ends that stream with a 503 error, then the server exits with code 3, and neither the
scheduler process (rank 0) nor any follower is left behind; a server stopped with SIGTERM after
serving exits 0 and leaves no follower either. Slow (a server of three processes starts
on two cores): the default suite kills the follower of an in-process Engine (tests/runtime/test_tp.py)."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from server_harness import pid_alive, start_server

EXIT_SCHEDULER_DIED = 3
TINY = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "tiny-llama.json"
FLAGS = ("--model-path", str(TINY), "--load-format", "dummy", "--tp-size", "2", "--max-total-tokens", "4096",
         "--hicache-storage-backend", "memory", "--skip-server-warmup")


def children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(k) for k in (task / "children").read_text().split()]
    return kids


def stream(url: str, events: list[str], started: threading.Event) -> None:
    body = {"input_ids": [5, 6, 7, 8], "stream": True,
            "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True, "temperature": 0}}
    try:
        with httpx.stream("POST", url + "/generate", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    started.set()
    except httpx.HTTPError as e:
        events.append(f"transport error: {e}")
    finally:
        started.set()


@pytest.mark.slow
def test_a_killed_follower_ends_the_server_and_leaves_no_process():
    handle = start_server(*FLAGS)
    try:
        (follower,) = children(handle.scheduler_pid)
        events: list[str] = []
        started = threading.Event()
        client = threading.Thread(target=stream, args=(handle.url, events, started), daemon=True)
        client.start()
        assert started.wait(60) and events
        os.kill(follower, signal.SIGKILL)
        client.join(30)
        errors = [json.loads(e)["error"] for e in events if '"error"' in e]
        assert errors and errors[-1]["type"] == "service_unavailable", events[-3:]
        handle.proc.wait(30)
    finally:
        code = handle.stop()
    assert code == EXIT_SCHEDULER_DIED, handle.log_tail()
    assert "tensor-parallel rank 1" in handle.log.read_text()
    deadline = time.monotonic() + 10
    while pid_alive(follower) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(follower)


@pytest.mark.slow
def test_a_stopped_server_stops_its_followers():
    handle = start_server(*FLAGS)
    try:
        (follower,) = children(handle.scheduler_pid)
        r = httpx.post(handle.url + "/generate", json={"input_ids": [5, 6, 7], "sampling_params": {
            "max_new_tokens": 4, "temperature": 0}}, timeout=60)
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 4
    finally:
        code = handle.stop()
    assert code == 0, handle.log_tail()
    assert not pid_alive(follower)
