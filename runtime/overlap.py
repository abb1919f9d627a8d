"""Overlap scheduling: the host prepares step t+1 while the device runs step t.

Without it a step is schedule -> run -> wait for the sampled ids -> apply, and the device idles
while the host builds the batch, checks stops and emits. With it (`Scheduler.step` on CUDA unless
`disable_overlap_schedule`; on CPU with `enable_overlap_schedule`, for the tests: no speedup there)
a step's results are applied one `step()` later:

- A step that follows a decode step of the whole running set, with nothing admittable waiting
  (an empty queue, a full batch, or a queue the last `schedule()` could not admit from with no
  arrival, finish, abort or retraction since), is the *continuation*: the same requests (less
  those whose step-t token is their last by length) decode the next position, reading their
  step-t tokens from the device (no host sync). Its forward pass is queued first; then step t's
  results are applied (the host waits for step t's ids only: they were copied to pinned memory
  behind an event); then the continuation samples, for the requests still running, with their
  host-side history complete (penalties work; ids and log-probs go to the host together). A
  request that finished at step t (stop token, stop string) had its next position computed too:
  that KV slot lies past its `kv_len`, so its release frees it and no token of it is emitted.
- Prefill steps are launched ahead too (on wherever overlap is; `HICACHE_PREFILL_AHEAD=0` turns
  it off): a step that follows a prefill step t running every running request is planned *ahead*
  (`Scheduler.schedule(after=t)`) when it can be: the next chunks of t's unfinished prompts
  (starting where t's chunks end) and admissions from the queue, with their load-backs. It is
  launched before step t's results are applied, so that the host's work between prefill steps
  (folding in results, write-through backups, matching, eviction, the next batch's tensors) runs
  while the device computes. It takes memory only from the free pool and the tree (no
  retraction: t's requests still own their slots), leaves failed loads to t's results (a request
  of the new step retracted then has that step's results dropped and its sampler rewound), and
  leaves waiting a request that shares a page past its cached prefix with a request of t, which
  may give that page to the tree once applied. Otherwise the step drains.
  Its load-backs follow only the compute queued before t (`CacheController.ordered_after` with
  t's fence), so they run while t computes, unless a request of t gave its slots back since t was
  launched (a failed load); the backups of t's results follow t, not the step queued after it.
  With an L2, a prefill step's requests hold at most `HICACHE_PREFILL_AHEAD_L1_SHARE` (0.5) of
  L1 past the first request, so that the next step's loads find room while it runs: on an H100,
  issue 7's rounds took 10.9-11.1 s this way against 12.2 s with prefill steps drained and
  11.1-12.1 s launched ahead without the cap (benchmarks/RESULTS.md).
- Any other step drains: step t's results are applied, then `schedule()` plans as without
  overlap (admission, chunked prefill, retraction, load-backs); that plan is launched and applied
  at the next step. A changing batch (decode after prefill, admission beside decoding requests,
  retraction) therefore costs one sync.
- `abort` of a request in the launched step applies that step first.

Syncs that remain inside a continuation on CUDA: the sampler's top_p cut (`tolist`) and presence
penalties (`torch.unique`), and a decode batch too large for the CUDA graphs (correct, less overlap).
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, NamedTuple

import torch

from hicache.runtime.batch import BatchPlan
from hicache.runtime.pinned import tensor_to
from hicache.runtime.runner import PendingStep

if TYPE_CHECKING:
    from hicache.runtime.scheduler import Scheduler

# 0: every prefill step drains (its results applied before the next is planned)
PREFILL_AHEAD = os.environ.get("HICACHE_PREFILL_AHEAD", "1") != "0"
# With them and an L2: the share of L1 that one prefill step's requests may hold together (at least
# one request), so that the next step's load-backs find room, and start, while it runs. 1: no cap.
AHEAD_L1_SHARE = float(os.environ.get("HICACHE_PREFILL_AHEAD_L1_SHARE", "0.5"))


class Launched(NamedTuple):
    plan: BatchPlan
    step: PendingStep
    fence: torch.cuda.Event | None  # the device work queued before the step (ModelRunner.fence)
    frees: tuple  # OverlapLoop._frees() at its launch


class OverlapLoop:
    """Owned by the scheduler; runs on its thread."""

    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.inflight: Launched | None = None  # launched, not applied
        self._blocked_at: tuple | None = None  # queue state when schedule() last left requests waiting
        self.continued = 0  # decode steps launched before the previous one was applied
        self.ahead = 0  # prefill steps launched before the previous one was applied

    def step(self) -> None:
        prev, self.inflight = self.inflight, None
        s, frees = self.sched, self._frees()
        cont = self._continuation(prev) if prev is not None else None
        if cont is not None:
            plan, keep = cont
            self.continued += 1
            fence = s.runner.fence()
            rows, logits = s.runner.forward(plan, _gather(prev.step.next_ids, keep))
        ahead = self._ahead(prev) if cont is None and prev is not None else None
        if ahead is not None:
            plan = ahead
            self.ahead += 1
            fence = s.runner.fence()
            rows, logits = s.runner.forward(plan)
        if prev is not None:  # the backups of prev's results follow prev, not the step queued after it
            with s.cache.ordered_after(fence if cont is not None or ahead is not None else None):
                s.process_result(prev.plan, prev.step.result())
        if cont is not None:
            plan, logits = self._still_running(plan, logits)
            rows = list(range(len(plan.reqs)))
        elif ahead is not None:
            self._blocked_at = None
        if cont is not None or ahead is not None:  # sampled once the host has step t's results
            if plan.reqs:
                self.inflight = Launched(plan, s.runner.sample(plan, rows, logits), fence, frees)
            return
        plan = s.schedule()
        self._blocked_at = self._queue_state() if s.waiting and (plan is None or plan.mode == "decode") else None
        if plan is not None:
            fence = s.runner.fence()
            self.inflight = Launched(plan, s.runner.launch(plan), fence, self._frees())
        elif prev is None:
            s.idle_wait()

    def apply(self) -> None:
        """Applies the launched step now (waits for its tokens)."""
        prev, self.inflight = self.inflight, None
        if prev is not None:
            self.sched.process_result(prev.plan, prev.step.result())

    def holds(self, rid: str) -> bool:
        return self.inflight is not None and any(r.rid == rid for r in self.inflight.plan.reqs)

    # ---- the continuation -------------------------------------------------------------------

    def _continuation(self, prev: Launched) -> tuple[BatchPlan, list[int]] | None:
        """The decode step after `prev` for the same requests, planned before prev's tokens reach
        the host, with the positions in prev of its requests; None when the batch would change."""
        s, plan = self.sched, prev.plan
        if plan.mode != "decode" or plan.kv_wait is not None or len(plan.reqs) != len(s.running):
            return None  # kv_wait None: no request of the plan (= all running) waits on a load-back
        if s.waiting and len(s.running) < s.rc.max_running_requests and not self._still_blocked():
            return None  # admission may change the batch
        s._poll_transfers()  # retracts only requests with load-backs in flight: none here
        keep = [i for i, r in enumerate(plan.reqs) if not s.stop_checker.length_reached(r, s.context_length, 1)]
        if not keep:
            return None
        for i in keep:  # slots for position start + 1; no retraction while a step is in flight
            if not s._ensure_slots(plan.reqs[i], plan.starts[i] + 2):
                return None
        n = len(keep)
        return BatchPlan("decode", [plan.reqs[i] for i in keep], [plan.starts[i] + 1 for i in keep], [1] * n,
                         [True] * n), keep

    # ---- a prefill step launched ahead ------------------------------------------------------

    def _ahead(self, prev: Launched) -> BatchPlan | None:
        """After a prefill step that runs every running request, the next step can only be more
        prefill: the next chunks of its prompts and admissions from the queue. It is planned
        (`Scheduler.schedule(after=...)`) and its forward pass queued before `prev`'s results are
        applied; it samples after them (a sampler that syncs then waits for its own pass only,
        not `prev`'s outputs). None when a request outside `prev` runs, or nothing was planned."""
        s, plan = self.sched, prev.plan
        if not PREFILL_AHEAD or plan.mode != "extend" or (all(plan.sample) and not s.waiting):
            return None
        launched = {id(r) for r in plan.reqs}
        if any(id(r) not in launched for r in s.running):
            return None
        # Its loads may start while `prev` runs: their slots come from the free pool and the tree,
        # which held none of prev's slots at its launch unless prev's requests were released since
        # (a load failed under it); then they wait for prev, as any copy does.
        with s.cache.ordered_after(prev.fence if self._frees() == prev.frees else None):
            return s.schedule(after=plan)

    def step_kv_cap(self) -> int | None:
        """Tokens of KV that the requests of one prefill step may hold together, past the first
        (AHEAD_L1_SHARE of L1), when steps are launched ahead with an L2 to load back from; None
        otherwise. Without it, a step of a few long conversations fills L1 and the next step's
        loads wait for it to end (benchmarks/RESULTS.md, issue 7 rounds)."""
        s = self.sched
        if not PREFILL_AHEAD or s.cache.host_pool is None or AHEAD_L1_SHARE >= 1:
            return None
        return int(s.alloc.capacity_tokens() * AHEAD_L1_SHARE)

    def _frees(self) -> tuple:
        """Changes when a running request may have given its slots back to the free pool."""
        return self.sched.counters["retractions"], self.sched.cache.counters["transfer_failures"]

    def _still_running(self, plan: BatchPlan, logits: torch.Tensor) -> tuple[BatchPlan, torch.Tensor]:
        """The continuation less the requests that finished at the step before it."""
        running = {id(r) for r in self.sched.running}
        alive = [i for i, r in enumerate(plan.reqs) if id(r) in running]
        if len(alive) == len(plan.reqs):
            return plan, logits
        kept = BatchPlan("decode", [plan.reqs[i] for i in alive], [plan.starts[i] for i in alive], [1] * len(alive),
                         [True] * len(alive))
        return kept, _gather(logits, alive)

    def _queue_state(self) -> tuple:
        c = self.sched.counters
        return len(self.sched.waiting), c["requests_finished"], c["requests_aborted"], c["retractions"]

    def _still_blocked(self) -> bool:
        """Nothing could be admitted at the last schedule() and nothing changed since (no arrival,
        finish, abort or retraction, no L3 prefetch pending): decoding on does not delay anyone."""
        storage = self.sched.storage
        return self._blocked_at == self._queue_state() and (storage is None or not storage.waiting())


def _gather(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    if len(rows) == t.shape[0]:
        return t
    return t[tensor_to(rows, t.device)]
