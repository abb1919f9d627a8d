"""Default `hicache serve` processes (no sizing flags) beside each other: their footprint is
modest and a second one starts and serves while the first runs."""
from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from server_harness import start_server

pytestmark = pytest.mark.model

FOOTPRINT_BYTES = 3 << 30  # a default server on CPU, its processes together, once ready


def rss(pid: int) -> int:
    """Resident bytes of `pid` and its descendants (memory shared between them counted once each)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
            if line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
        for task in Path(f"/proc/{p}/task").iterdir():
            todo += map(int, (task / "children").read_text().split())
    return total


def serves(server) -> bool:
    r = httpx.post(server.url + "/generate", timeout=120,
                   json={"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4}})
    return r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 4


def test_a_second_default_server_starts_beside_the_first_and_both_serve():
    first = start_server()
    second = None
    try:
        assert serves(first)
        assert rss(first.proc.pid) < FOOTPRINT_BYTES, rss(first.proc.pid)
        second = start_server()
        assert serves(second) and serves(first)
    finally:
        first.stop()
        if second is not None:
            second.stop()
