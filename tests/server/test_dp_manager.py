"""`TokenizerManager` over two replicas (`--dp-size 2`): real scheduler processes over ZMQ running
the fake scheduler of test_ipc_security.py (no model). Round robin alternates, an abort reaches the
replica that serves the request, and a replica killed mid-stream ends only its own streams (503),
is restarted with `restart_scheduler` while the other replica serves, then serves again."""
from __future__ import annotations

import asyncio
import os
import signal

import pytest

from hicache.config import HiCacheConfig
from hicache.runtime.config import RuntimeConfig
from hicache.runtime.messages import GenerateRequest
from hicache.runtime.sampling import SamplingParams
from hicache.server.routing import Router
from hicache.server.tokenizer_manager import TokenizerManager

FAKE = "test_ipc_security:make_fake_scheduler"
ENDLESS = 10**7  # tokens: a stream that runs until it is aborted or its replica dies


def request(rid: str, n: int, rank: int | None = None) -> GenerateRequest:
    return GenerateRequest(rid=rid, input_ids=[1, 2, 3], sampling_params=SamplingParams(max_new_tokens=n),
                           routed_dp_rank=rank)


async def run(tm: TokenizerManager, req: GenerateRequest) -> list:
    return [chunk async for chunk in tm.generate(req)]


class OpenStream:
    """A request that streams until it ends; `first` is set at its first chunk."""

    def __init__(self, tm: TokenizerManager, req: GenerateRequest) -> None:
        self.first = asyncio.Event()
        self.task = asyncio.create_task(self._drain(tm, req))

    async def _drain(self, tm, req):
        last = None
        async for chunk in tm.generate(req):
            last = chunk
            self.first.set()
        return last


async def wait_for(condition, timeout: float = 60) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def exercise() -> dict:
    fatal = []
    tm = TokenizerManager(RuntimeConfig(), HiCacheConfig(), factory=FAKE, warm_up=False, restart_scheduler=True,
                          on_fatal=fatal.append, router=Router(2, "round_robin"))
    try:
        await tm.start(120)
        for i in range(4):
            assert (await run(tm, request(f"rr-{i}", 3)))[-1].output_ids == [100, 101, 102]
        routed_rr = tm.router.stats()["routed"]

        aborted = OpenStream(tm, request("abort-me", ENDLESS, rank=1))
        await aborted.first.wait()
        assert tm._states["abort-me"].replica == 1
        assert tm.abort_prefix("abort-me") == 1
        abort_end = await asyncio.wait_for(aborted.task, 30)

        victim, survivor = (OpenStream(tm, request(rid, ENDLESS, rank=r)) for rid, r in (("v", 0), ("s", 1)))
        await asyncio.gather(victim.first.wait(), survivor.first.wait())
        os.kill(tm.replicas[0].proc.pid, signal.SIGKILL)
        victim_end = await asyncio.wait_for(victim.task, 30)
        during = await run(tm, request("during-restart", 2))  # the router sends it to the live replica
        assert not survivor.task.done()
        tm.abort("s")
        await asyncio.wait_for(survivor.task, 30)
        await wait_for(lambda: tm.replicas[0].alive)
        after = await run(tm, request("after", 2, rank=0))
        return {"routed_rr": routed_rr, "abort_end": abort_end, "victim_end": victim_end, "during": during,
                "after": after, "restarts": tm.replicas[0].restarts, "fatal": fatal, "alive": tm.alive}
    finally:
        await tm.shutdown()


@pytest.mark.slow  # minutes: the fake replicas stream as fast as they can while one restarts
def test_two_replicas_route_abort_and_survive_a_killed_one():
    got = asyncio.run(exercise())
    assert got["routed_rr"] == [2, 2]
    assert got["abort_end"].finish_reason["type"] == "abort" and got["abort_end"].error is None
    assert got["victim_end"].error_status == 503 and "replica 0" in got["victim_end"].error, got["victim_end"].error
    assert got["during"][-1].output_ids == [100, 101] and got["during"][-1].error is None
    assert got["after"][-1].output_ids == [100, 101]
    assert got["restarts"] == 1 and got["fatal"] == [] and got["alive"]
