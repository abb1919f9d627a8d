"""A follower rank (1..N-1) of tensor parallelism: `python -m hicache.runtime.tp_worker`.

Started by rank 0 (`runtime/tp.py: RankGroup.start`), which writes its configuration to the
follower's stdin (a length-prefixed msgpack map) and keeps that pipe open: end-of-file means rank 0
is gone, and the follower exits at once. It holds its own share of the model, of L1 (pool and
request table), of L2 (host pool and transfer engine) and of L3 (its own backend namespace), and no
scheduler: it applies rank 0's messages in order (runtime/tp_fanout.py says what they are) and
sends back what rank 0 needs to know (transfers it finished, L3 results). It never samples.
"""
from __future__ import annotations

import logging
import os
import struct
import threading
from typing import Callable, NamedTuple

import msgpack
import torch
import zmq

from hicache.config import HiCacheConfig
from hicache.runtime import prompt_logprobs
from hicache.runtime.batch import BatchPlan
from hicache.runtime.build import RankParts, build_rank, storage_on, storage_worker
from hicache.runtime.config import RuntimeConfig
from hicache.runtime.runner import ModelRunner
from hicache.runtime.tp import join_group, rank_device, rendezvous, unpack_slots, unpack_spec

logger = logging.getLogger("hicache.tp_worker")

BUSY_POLL_MS = 2  # while L3 operations run: how often their results are looked for


class Row(NamedTuple):
    """A request of rank 0's plan, as a follower's runner sees it: its table row (and no LoRA
    adapter: adapters are not served with tensor parallelism)."""

    row: int
    adapter: None = None


class Loads(NamedTuple):
    """The load-backs a step waits for, on this rank's transfer engine (`BatchPlan.loads`)."""

    wait_layer: Callable[[int | None], None]


class FollowerRunner(ModelRunner):
    """A runner whose prompt log-prob rows come with rank 0's plan."""

    rows: prompt_logprobs.PromptRows | None = None

    def prompt_rows(self, plan: BatchPlan) -> prompt_logprobs.PromptRows | None:
        return self.rows


class Follower:
    def __init__(self, parts: RankParts, runner: FollowerRunner, storage, outbox: zmq.Socket, rank: int):
        self.parts, self.runner, self.storage, self.outbox, self.rank = parts, runner, storage, outbox, rank
        self.transfer = parts.transfer
        self.finished: dict[int, tuple[bool, str | None]] = {}  # transfer ticket -> (ok, error), not yet asked for
        self.l3_pending = 0
        self.running = True

    def handle(self, msg: list) -> None:
        getattr(self, "on_" + msg[0])(*msg[1:])

    def _reply(self, body) -> None:
        self.outbox.send(msgpack.packb(["reply", self.rank, body]))

    # ---- steps ----------------------------------------------------------------------------

    def on_plan(self, mode, rows, starts, lens, sample, ids, journal, loads, prompt) -> None:
        table = self.parts.req_table
        for kind, a, b, slots in journal:
            (table.write if kind == "w" else table.scatter)(a, b, unpack_slots(slots))
        device = self.parts.device
        if ids is None:  # still on rank 0's device: broadcast
            input_ids = torch.empty(len(rows), dtype=torch.int64, device=device)
            torch.distributed.broadcast(input_ids, src=0)
        else:
            input_ids = torch.tensor(ids, dtype=torch.int64).to(device, non_blocking=True)
        waiter = None
        if loads is not None:
            def waiter(layer: int | None) -> None:
                for t in loads:
                    self.transfer.wait_layer(t, layer)
        plan = BatchPlan(mode, [Row(r) for r in rows], starts, lens, sample,
                         loads=Loads(waiter) if waiter is not None else None)
        self.runner.rows = None if prompt is None else prompt_logprobs.PromptRows(*prompt)
        self.runner.forward(plan, input_ids)

    # ---- L1 <-> L2 -------------------------------------------------------------------------

    def on_backup(self, device_slots: bytes, host_slots: bytes) -> None:
        self.transfer.backup(unpack_slots(device_slots), unpack_slots(host_slots))

    def on_load(self, host_slots: bytes, device_slots: bytes, skip: int, repair_host: bytes | None,
                repair_device: bytes | None) -> None:
        self.transfer.load(unpack_slots(host_slots), unpack_slots(device_slots),
                           spec=unpack_spec(skip, repair_host, repair_device))

    def on_start_loads(self, whole: bool) -> None:
        self.transfer.start_loads(whole)

    def on_synchronize(self, ticket: int) -> None:
        self.transfer.synchronize(ticket)

    def on_poll(self, tickets: list[int]) -> None:
        """Waits for these transfers (rank 0 saw its own finish) and says how each ended here."""
        for t in tickets:
            self.transfer.synchronize(t)
        for res in self.transfer.poll():
            self.finished[res.ticket] = (res.ok, res.error)
        self._reply([[t, *self.finished.pop(t, (False, "never reported"))] for t in tickets])

    # ---- L3 --------------------------------------------------------------------------------

    def on_l3(self, kind: str, ticket: int, keys: list[str], slots: bytes | None) -> None:
        args = [keys] if slots is None else [keys, unpack_slots(slots)]
        mine = getattr(self.storage, kind)(*args)
        if mine != ticket:
            raise RuntimeError(f"L3 ticket {mine} on rank {self.rank}, {ticket} on rank 0")
        self.l3_pending += 1

    def on_l3_cancel(self, ticket: int) -> None:
        self.storage.cancel(ticket)

    def on_l3_revoke(self, ticket: int) -> None:
        self._reply(self.storage.revoke(ticket))

    def on_l3_quiesce(self, timeout: float) -> None:
        self.storage.quiesce(timeout)

    def report_l3(self) -> None:
        for res in self.storage.poll():
            self.l3_pending -= 1
            self.outbox.send(msgpack.packb(["l3", self.rank, res.ticket, res.kind, res.ok, res.pages, res.skipped,
                                            res.error]))

    def on_stop(self) -> None:
        self.running = False


def serve(follower: Follower, inbox: zmq.Socket) -> None:
    """Applies rank 0's messages until told to stop."""
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    while follower.running:
        busy = follower.storage is not None and follower.l3_pending > 0
        if poller.poll(BUSY_POLL_MS if busy else None):
            while follower.running:
                try:
                    frame = inbox.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                follower.handle(msgpack.unpackb(frame))
        if follower.storage is not None:
            follower.report_l3()


def _read_config() -> dict:
    (n,) = struct.unpack(">I", _read_stdin(4))
    return msgpack.unpackb(_read_stdin(n))


def _read_stdin(n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = os.read(0, n - len(data))
        if not chunk:
            raise SystemExit("rank 0 closed the configuration pipe")
        data += chunk
    return data


def _watch_parent() -> None:
    """Rank 0 holds our stdin open for as long as it lives."""
    while os.read(0, 4096):
        pass
    os._exit(0)


def main() -> None:
    config = _read_config()
    threading.Thread(target=_watch_parent, name="hicache-tp-parent", daemon=True).start()
    rank, size = config["rank"], config["size"]
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {rank} %(levelname)s %(message)s")
    rc, cc = RuntimeConfig(**config["rc"]), HiCacheConfig(**config["cc"])
    if rank_device(rc.device, rank) == "cpu" and not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(max(1, torch.get_num_threads() // size))  # the ranks share the cores
    tp = join_group(rendezvous(rank, size, config["port"]), rank, size, rank_device(rc.device, rank))
    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.connect(f"ipc://{config['folder']}/to{rank}")
    outbox.connect(f"ipc://{config['folder']}/from")
    parts = build_rank(rc, cc, tp)
    runner = FollowerRunner(parts.loaded.model, parts.pool, parts.req_table, parts.attn, parts.device,
                            cuda_graph=not rc.disable_cuda_graph, max_batch=rc.max_running_requests)
    storage = storage_worker(cc, rc, parts.loaded, parts.host_pool, tp)[0] if storage_on(cc, parts.host_pool) else None
    try:
        serve(Follower(parts, runner, storage, outbox, rank), inbox)
    finally:
        if storage is not None:
            storage.close()
        runner.close()
        outbox.close(linger=1000)
        inbox.close(0)
        ctx.term()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
