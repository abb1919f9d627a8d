"""Deaths under tensor parallelism (TP=2 on the tiny random model, gloo):

- a follower killed under a running `Engine`: its callers get an error naming the rank, and
  shutdown leaves no process behind;
- rank 0's process killed (SIGKILL, no cleanup of its own): its follower exits by itself.

(A module of its own: one tensor-parallel engine per process at a time, and test_tp.py holds one
for its module.)"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from hicache import Engine
from test_hicache_l2 import GREEDY


def test_a_killed_follower_fails_the_engine_and_leaves_no_process(tiny_config_path):
    engine = Engine(str(tiny_config_path), load_format="dummy", tp_size=2, max_total_tokens=1024,
                    hicache_storage_backend="memory")
    (follower,) = engine.scheduler.runner.ranks.procs
    assert engine.generate(input_ids=[5, 6, 7], sampling_params=dict(GREEDY, max_new_tokens=2))["output_ids"]
    os.kill(follower.pid, signal.SIGKILL)
    with pytest.raises(RuntimeError) as failure:
        for _ in range(50):
            engine.generate(input_ids=[5, 6, 7], sampling_params=dict(GREEDY, max_new_tokens=2))
            time.sleep(0.1)
    assert "tensor-parallel rank 1" in str(failure.value.__cause__)
    engine.shutdown()
    assert follower.poll() == -signal.SIGKILL


RANK0 = """
import sys
from hicache import Engine
engine = Engine(sys.argv[1], load_format="dummy", tp_size=2, max_total_tokens=1024, hicache_storage_backend="memory")
print(engine.scheduler.runner.ranks.procs[0].pid, flush=True)
sys.stdin.read()
"""


def test_a_follower_exits_when_rank_0_is_killed(tiny_config_path):
    rank0 = subprocess.Popen([sys.executable, "-c", RANK0, str(tiny_config_path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        follower = int(rank0.stdout.readline())
        os.kill(rank0.pid, signal.SIGKILL)
        rank0.wait(30)
        deadline = time.monotonic() + 10
        while _alive(follower) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(follower)
    finally:
        rank0.kill()
        rank0.wait()


def _alive(pid: int) -> bool:
    """Running (an exited follower, orphaned, is reaped by init; a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False
