"""`DecodePlanner`: one token for every decoding request (with speculative decoding, its drafts
too: a verify step), and the continuation of a launched step."""
from __future__ import annotations

from typing import TYPE_CHECKING

from hicache.runtime.batch import BatchPlan
from hicache.runtime.request import Status

if TYPE_CHECKING:
    from hicache.manager import CacheManager
    from hicache.runtime.policy import BudgetPolicy
    from hicache.runtime.scheduler.memory import Memory
    from hicache.runtime.scheduler.queue import QueueState
    from hicache.runtime.spec.drafter import Drafter
    from hicache.runtime.stop import StopChecker


class DecodePlanner:
    def __init__(self, queue: QueueState, cache: CacheManager, policy: BudgetPolicy, memory: Memory,
                 stops: StopChecker, context_length: int, drafter: Drafter | None = None):
        self.queue, self.cache, self.policy, self.memory = queue, cache, policy, memory
        self.stops, self.context_length, self.drafter = stops, context_length, drafter

    def plan(self, extend: BatchPlan | None = None) -> BatchPlan | None:
        """One token for every running request in `Status.DECODE` (by arrival), less those that sit
        out while their prefix loads (`BudgetPolicy.parks`). With `extend` (a plan with forced
        runs), those not in it join it as chunks of one token, where a slot is free without
        retracting (it holds requests of any arrival); else slots are made, retracting."""
        plan = extend or BatchPlan("decode", [], [], [], [])
        plan.joined = extend is not None
        planned = {id(r) for r in plan.reqs}
        for req in self.queue.running_by_arrival():
            if id(req) not in planned and self.queue.is_running(req) and req.phase is Status.DECODE:
                self.cache.refresh(req.lease)
                if self.policy.parks(req, self.queue.running):
                    continue
                if self.cache.grow(req.lease, req.seq_len) if extend else self.memory.make_room(req, req.seq_len):
                    plan.add(req, req.kv_len, 1, True)
        if extend is None and self.drafter is not None and plan.reqs:
            self._draft(plan)
        return plan if plan.reqs else None

    def _draft(self, plan: BatchPlan) -> None:
        """Speculative decoding: each request's draft (`Drafter.drafts`) joins its token where its
        slots grow for it without retracting; with any draft the plan is a verify step."""
        if not self.drafter.drafts_batch(len(plan.reqs)):
            return
        drafts = [d if d and self.cache.grow(r.lease, r.seq_len + len(d)) else []
                  for r, d in zip(plan.reqs, self.drafter.drafts(plan.reqs))]
        if any(drafts):
            plan.mode, plan.drafts = "verify", drafts
            plan.extend_lens = [1 + len(d) for d in drafts]

    def continue_after(self, plan: BatchPlan) -> tuple[BatchPlan, list[int]] | None:
        """For overlap scheduling: the decode step after the launched step `plan` (a decode step, or
        an extend whose every request samples), for the same requests less those whose token from
        `plan` is their last by length, with their positions in `plan`; None when nothing would
        continue or a slot cannot be had without retracting (no retraction while a step is in
        flight)."""
        self.memory.poll_transfers()  # retracts only requests with load-backs in flight: only those sitting out
        keep = [i for i, r in enumerate(plan.reqs) if not self.stops.length_reached(r, self.context_length, 1)]
        if not keep:
            return None
        reqs, starts = [plan.reqs[i] for i in keep], [plan.starts[i] + plan.extend_lens[i] for i in keep]
        if not self.cache.grow_all([r.lease for r in reqs], [s + 1 for s in starts]):
            return None
        return BatchPlan("decode", reqs, starts, [1] * len(keep), [True] * len(keep)), keep
