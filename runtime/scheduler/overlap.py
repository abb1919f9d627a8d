"""Overlap scheduling: the host prepares step t+1 while the device runs step t.

Without it a step is schedule -> run -> wait for the sampled ids -> apply, and the device idles
while the host builds the batch, checks stops and emits. With it (`Scheduler.step` where
`overlap_schedule` is on: by default with CUDA; on CPU when asked for, with no speedup there) a
step's results are applied one `step()` later:

- A step that follows a decode step of the whole running set (or an extend of every running
  request's forced run or next token: jump-forward; requests that sit out while their prefix
  loads back, `BudgetPolicy.parks`, do not count until their load lands), with nothing admittable waiting
  (an empty queue, a full batch, or a queue the last `schedule()` could not admit from with no
  arrival, finish, abort or retraction since), is the *continuation*: the same requests (less
  those whose step-t token is their last by length) decode the next position, reading their
  step-t tokens from the device (no host sync). Its forward pass is queued first; then step t's
  results are applied (the host waits for step t's ids only: they were copied to pinned memory
  behind an event); then the continuation samples, for the requests still running, with their
  host-side history complete (penalties work; ids and log-probs go to the host together). A
  request that finished at step t (stop token, stop string) had its next position computed too:
  that KV slot lies past its `kv_len`, so its release frees it and no token of it is emitted.
- Prefill steps are launched ahead too (wherever overlap is, unless `disable_prefill_ahead`): a
  step that follows a prefill step t running every running request is planned *ahead*
  (`Scheduler.schedule(after=t)`) when it can be: the next chunks of t's unfinished prompts
  (starting where t's chunks end) and admissions from the queue, with their load-backs. It is
  launched before step t's results are applied, so that the host's work between prefill steps
  (folding in results, write-through backups, matching, eviction, the next batch's tensors) runs
  while the device computes. It takes memory only from the free pool and the tree (no
  retraction: t's requests still own their slots), leaves failed loads to t's results (a request
  of the new step retracted then has that step's results dropped and its sampler rewound), and
  leaves waiting a request that shares a page past its cached prefix with a request of t, which
  may give that page to the tree once applied. Otherwise the step drains.
  Its load-backs follow only the compute queued before t (`CacheManager.ordered_after` with t's
  fence), so they run while t computes, unless a running request gave its slots back since t was
  launched (`QueueState.early_releases`); the backups of t's results follow t, not the step queued
  after it. With an L2, a prefill step's requests hold at most `prefill_ahead_l1_share` of L1 past
  the first request (`BudgetPolicy.step_kv_cap`), so that the next step's loads find room while it
  runs (measured: benchmarks/RESULTS.md).
- Any other step drains: step t's results are applied, then `schedule()` plans as without
  overlap (admission, chunked prefill, retraction, load-backs); that plan is launched and applied
  at the next step. A changing batch (decode after prefill, admission beside decoding requests,
  retraction) therefore costs one sync.
- `abort` of a request in the launched step applies that step first.

A step whose requests have grammars queues its sampling once its bitmask is filled (on another
thread, while the pass runs and the host applies the results before it, delivers outputs and
plans the next step): at its launch when the fill is done by then, else at the start of the next
`step()` (`PendingStep.launch`), after that step is planned. A continuation's bitmask starts
filling as soon as step t's tokens are recorded for the matchers (`Scheduler.process_result`'s
`accepted`; the fill's job feeds them to the matchers first), before the requests' results (stop
checks, outputs) are applied; a request that finished at step t leaves its row out when the
continuation samples. With jump-forward on, which
advances matchers while the results are applied, it starts once they are.

Syncs that remain inside a continuation on CUDA: the sampler's top_p cut (`tolist`) and presence
penalties (`torch.unique`), and a decode batch too large for the CUDA graphs (correct, less overlap).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from hicache.runtime.batch import BatchPlan
from hicache.runtime.bitmask import PendingFill
from hicache.runtime.pinned import tensor_to
from hicache.runtime.request import Status
from hicache.runtime.runner import PendingStep

if TYPE_CHECKING:
    from hicache.runtime.scheduler.scheduler import Scheduler


class Launched(NamedTuple):
    plan: BatchPlan
    step: PendingStep
    fence: torch.cuda.Event | None  # the device work queued before the step (ModelRunner.fence)
    early_releases: int  # QueueState.early_releases at its launch


class OverlapLoop:
    """Owned by the scheduler; runs on its thread. It uses the scheduler's public surface
    (`schedule`, `process_result`, `continue_decode`, `can_admit`, `grammars_compiling`,
    `idle_wait`, `runner`, `jump`, and the cache's `ordered_after`, `collect`, `refresh`,
    `prefetches_ready`) and the public methods of its `QueueState` (`sched.queue`)."""

    def __init__(self, sched: Scheduler, prefill_ahead: bool = True):
        self.sched = sched
        self.queue = sched.queue
        self.prefill_ahead = prefill_ahead
        self.inflight: Launched | None = None  # launched, not applied
        self._blocked_at: int | None = None  # queue.version when schedule() last left requests waiting
        self.continued = 0  # decode steps launched before the previous one was applied
        self.ahead = 0  # prefill steps launched before the previous one was applied
        self.filled_early = 0  # continuations whose bitmask began filling before prev's results were applied

    def step(self) -> None:
        prev, self.inflight = self.inflight, None
        s = self.sched
        releases = self.queue.early_releases
        cont = self._continuation(prev) if prev is not None else None
        if prev is not None:  # its sampling, if it waited for a grammar's bitmask filled meanwhile
            prev.step.launch()
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
        fill = None
        if prev is not None:  # the backups of prev's results follow prev, not the step queued after it
            fill = self._apply(prev, plan if cont is not None else None,
                               fence if cont is not None or ahead is not None else None)
        if cont is not None:
            plan, rows, logits, picked = self._still_running(plan, logits)
            fill = fill and fill.take(picked)
        elif ahead is not None:
            self._blocked_at = None
        if cont is not None or ahead is not None:  # sampled once the host has step t's results
            if plan.reqs:
                self.inflight = Launched(plan, s.runner.sample(plan, rows, logits, fill), fence, releases)
            return
        self._drain(prev)

    def _drain(self, prev: Launched | None) -> None:
        """Plans as without overlap (prev's results are applied) and launches the plan."""
        s = self.sched
        plan = s.schedule()
        blocked = self.queue.has_waiting() and (plan is None or plan.mode == "decode")
        self._blocked_at = self.queue.version if blocked else None
        if plan is not None:
            fence = s.runner.fence()
            self.inflight = Launched(plan, s.runner.launch(plan), fence, self.queue.early_releases)
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
        if plan.loads is not None or not all(plan.sample):
            return None  # loads None: no request of the plan waits on a load-back; a request that
            # did not sample jumped forward: its forced run is computed by an extend
        running = self.queue.running_count()
        if len(plan.reqs) != running and len(plan.reqs) + self._loading() != running:
            return None  # another request runs: it computes its prompt next
        if plan.mode != "decode" and not (plan.joined and all(map(plan.past_prompt, range(len(plan.reqs))))):
            return None  # a prefill step; an extend of forced runs and decoding requests continues
        if s.can_admit() and not self._still_blocked():
            return None  # admission may change the batch
        return s.continue_decode(plan)

    def _loading(self) -> int:
        """Running requests that sit out the steps while their prefix loads back, with their loads
        still in flight (one whose load has landed joins the next step; the launched step, which
        waits for no load, holds none of them)."""
        s = self.sched
        parked = self.queue.running_in(Status.LOADING)
        s.cache.collect([r.lease for r in parked])
        return sum(r.status is Status.LOADING for r in parked)

    def _still_blocked(self) -> bool:
        """Nothing could be admitted at the last schedule() and nothing changed since (no arrival,
        admission, finish, abort or retraction, no L3 prefetch landed, no grammar compiling): decoding
        on delays no one."""
        s = self.sched
        return self._blocked_at == self.queue.version and not s.cache.prefetches_ready() and not s.grammars_compiling()

    def _apply(self, prev: Launched, cont: BatchPlan | None, fence: torch.cuda.Event | None) -> PendingFill | None:
        """Applies prev's results (their backups ordered after `fence`). With a continuation `cont`
        and no jump-forward (which advances matchers while the results are applied), cont's
        bitmask starts filling as soon as the matchers have accepted prev's tokens: returned."""
        s = self.sched
        early: list[PendingFill | None] = []
        accepted = None
        if cont is not None and not s.jump.enabled:
            def accepted() -> None:
                early.append(s.runner.fill(cont.reqs, cont.sample))
        with s.cache.ordered_after(fence):
            s.process_result(prev.plan, prev.step.result(), accepted)
        fill = early[0] if early else None
        self.filled_early += fill is not None
        return fill

    def _still_running(self, plan: BatchPlan, logits: torch.Tensor
                       ) -> tuple[BatchPlan, list[int], torch.Tensor, list[int]]:
        """The continuation less the requests that finished at the step before it, the rows that
        sample, their logits and their positions in `plan`. A request that jumped forward at that
        step (its grammar forced tokens after its token) does not sample: the position computed is
        its token's, and what follows is the forced run."""
        running = {id(r) for r in self.queue.running}
        alive = [i for i, r in enumerate(plan.reqs) if id(r) in running]
        sample = [plan.starts[i] + 1 == plan.reqs[i].seq_len for i in alive]
        if len(alive) == len(plan.reqs) and all(sample):
            return plan, list(range(len(alive))), logits, alive
        kept = BatchPlan("decode", [], [], [], [])
        for i, s in zip(alive, sample):
            kept.add(plan.reqs[i], plan.starts[i], 1, s)
        picked = [i for i, s in zip(alive, sample) if s]
        return kept, [j for j, s in enumerate(sample) if s], _gather(logits, picked), picked

    # ---- a prefill step launched ahead ------------------------------------------------------

    def _ahead(self, prev: Launched) -> BatchPlan | None:
        """After a prefill step that runs every running request, the next step can only be more
        prefill: the next chunks of its prompts and admissions from the queue. It is planned
        (`Scheduler.schedule(after=...)`) and its forward pass queued before `prev`'s results are
        applied; it samples after them (a sampler that syncs then waits for its own pass only,
        not `prev`'s outputs). None when a request outside `prev` runs, or nothing was planned."""
        s, plan = self.sched, prev.plan
        if not self.prefill_ahead or plan.mode != "extend" or (all(plan.sample) and not self.queue.has_waiting()):
            return None
        launched = {id(r) for r in plan.reqs}
        if any(id(r) not in launched for r in self.queue.running):
            return None
        # Its loads may start while `prev` runs: their slots come from the free pool and the tree,
        # which held none of prev's slots at its launch unless a running request gave its slots
        # back since; then they wait for prev, as any copy does.
        with s.cache.ordered_after(prev.fence if self.queue.early_releases == prev.early_releases else None):
            return s.schedule(after=plan)


def _gather(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    if len(rows) == t.shape[0]:
        return t
    return t[tensor_to(rows, t.device)]
