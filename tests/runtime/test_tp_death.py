"""A follower rank killed under a running `Engine` (TP=2 on the tiny random model, gloo): its callers
get an error naming the rank, and shutdown leaves no process behind. (A module of its own: one
tensor-parallel engine per process at a time, and test_tp.py holds one for its module.)"""
from __future__ import annotations

import os
import signal
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
