"""`PrefillPlanner`: a prefill (extend) step: running requests' next chunks, then admissions.

Admission of a waiting request, in the policy's order: its grammar compiled, its L3 prefetch let
it go (`CacheManager.prefetch_ready`), no running request computing most of its prompt
(`BudgetPolicy.prefill_leaders`), then its cached prefix matched, locked and loaded back where it
is on L2 (`CacheManager.admit`), and the slots of its first chunk taken (`CacheManager.grow`).
On a decode server (runtime/disagg/), a request with a bootstrap room is admitted with the slots
of its whole prompt instead, and asks the prefill server for the KV of what its cached prefix
lacks (`KVReceiver.ask`); once that lands (`KVReceiver.land`) it decodes from its first token.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from hicache.runtime.batch import BatchPlan
from hicache.runtime.grammar import look_at
from hicache.runtime.request import Status

if TYPE_CHECKING:
    from hicache.manager import CacheManager
    from hicache.runtime.counters import Counters
    from hicache.runtime.disagg.receiver import KVReceiver
    from hicache.runtime.policy import BudgetPolicy
    from hicache.runtime.request import Req
    from hicache.runtime.scheduler.decode import DecodePlanner
    from hicache.runtime.scheduler.memory import Memory
    from hicache.runtime.scheduler.output import OutputProcessor
    from hicache.runtime.scheduler.queue import QueueState


class PrefillPlanner:
    """`decode` adds the decoding requests to a step that computes a forced run (jump-forward);
    `output` applies a jump-forward before a request's first token and emits the abort of a
    request whose grammar failed to compile; `receiver` (a decode server's): prompts' KV from
    prefill servers."""

    def __init__(self, queue: QueueState, cache: CacheManager, policy: BudgetPolicy, memory: Memory,
                 output: OutputProcessor, decode: DecodePlanner, counters: Counters,
                 receiver: KVReceiver | None = None):
        self.queue, self.cache, self.policy, self.memory = queue, cache, policy, memory
        self.output, self.decode, self.counters, self.receiver = output, decode, counters, receiver
        self.page_size = cache.page_size

    def plan(self, after: BatchPlan | None = None) -> BatchPlan | None:
        """A prefill batch: running requests' next chunks (those in `Status.PREFILL`, by arrival,
        within `BudgetPolicy.running_share`), then admissions in policy order. Where it computes
        a chunk of a prompt that goes on after it, or a forced run, the decoding requests join it
        (one token each), so that they do not wait for every chunk of a long prompt. With `after`
        (launched, not applied), the running requests are its own: their next chunks start where
        its chunks end, and memory comes from the free pool and the tree only."""
        if self.receiver is not None and self.receiver.pending:
            self._land()
        waiting = self.queue.has_waiting()
        self.cache.before_prefill(sum(r.prompt_left for r in (*self.queue.waiting, *self.queue.running)), waiting,
                                  decoding=waiting and any(r.phase is Status.DECODE for r in self.queue.running))
        plan = BatchPlan("extend", [], [], [], [])
        budget = self.policy.max_prefill_tokens
        if after is not None:
            for req, start, n, sample in zip(after.reqs, after.starts, after.extend_lens, after.sample):
                if sample or not req.holds_kv:  # (not holding: retracted in flight, its load failed)
                    continue
                added = self._add_chunk(plan, req, budget, start=start + n) if budget > 0 else 0
                if added == 0:  # no budget, or no room without retracting: plan once `after` is applied
                    return None
                budget -= added
            self._admit_waiting(plan, budget, budget, after)
        else:
            share = self.policy.running_share(budget, self.queue.waiting, self.queue.running)
            budget -= share - self._continue_running(plan, share)
            self._admit_waiting(plan, budget, share, after)
            if not all(plan.sample) or any(r.grammar is not None and plan.past_prompt(i)
                                           for i, r in enumerate(plan.reqs)):
                self.decode.plan(plan)  # the decoding requests join a chunk of a long prompt or a forced run
        return plan if plan.reqs else None

    def _continue_running(self, plan: BatchPlan, budget: int) -> int:
        """The next chunks of the running requests in `Status.PREFILL`; returns the budget left."""
        for req in self.queue.running_by_arrival():
            if self.queue.is_running(req) and req.phase is Status.PREFILL:
                self.cache.refresh(req.lease)
                if not self.policy.parks(req, self.queue.running):
                    budget -= self._add_chunk(plan, req, budget)
        return budget

    def _admit_waiting(self, plan: BatchPlan, budget: int, share: int, after: BatchPlan | None) -> None:
        """Admissions within `budget`; a prompt that does not fit in it whole gets a first chunk
        of at most `share` (`BudgetPolicy.running_share`), as the running prompts' chunks do."""
        ahead = frozenset(id(r) for r in after.reqs) if after is not None else frozenset()
        cached = None if self.cache.disabled else (lambda r: self.cache.match(r.all_ids[:r.prefix_limit],
                                                                              r.namespace).tokens)
        for req in look_at(self.queue.waiting):  # its grammar did not compile
            self.queue.remove(req)
            self.cache.dequeued(req.lease)
            self.output.reject(req.rid, req.grammar.error)
        for req in self.policy.order(self.queue.waiting, cached):
            if budget <= 0 or not self.policy.admits_more(self.queue.running_count()) or id(req) in ahead:
                break  # (one retracted from the launched step waits until that step is applied)
            if self.policy.over_step_cap(plan.kv_tokens(), req):
                break  # L1 left for the next step's load-backs (runtime/scheduler/overlap.py)
            if req.grammar is not None and not req.grammar.seen_ready:
                continue  # its grammar is compiling
            if not self.policy.adapter_fits(req, self.queue.running):
                continue  # max_loras_per_batch other adapters are running
            got = self.cache.prefetch_ready(req.lease)
            req.prefetch_wait = got is None
            if got is None:
                continue  # the prefetch policy keeps it waiting for its L3 pages
            if got.end > got.start:  # what landed is in the tree (host-only), loaded back like any L2 hit
                req.storage_range = (got.start, got.end)
            if req.bootstrap is not None and self.receiver is not None:
                if not self._receive(req, after):
                    break
                continue  # its KV comes from the prefill server: no compute, no budget
            if not req.output_ids and self.output.jump_first(req):
                continue  # the forced text alone reached a stop or the length limit
            if self._waits_for_prefill(req, cached):
                continue  # a running request is computing most of its prompt: it finds it cached next
            n = self._admit(req, budget if req.prompt_left <= budget else min(budget, share), after)
            if n == 0:
                break
            self.cache.refresh(req.lease)
            if after is None and self.policy.parks(req, self.queue.running):
                continue  # its first chunk runs once its load has landed
            budget -= n
            self._add_chunk(plan, req, n, allocated=True)

    def _receive(self, req: Req, after: BatchPlan | None) -> bool:
        """Admits `req` with its cached prefix and the slots of the rest of its prompt, and asks
        the prefill server for that rest. False (nothing held) when memory is short."""
        match = self.cache.match(req.input_ids[:req.prefix_limit], req.namespace)
        headroom = self.policy.decode_headroom(self.queue.running, launched=after is not None, admitting=req)
        rest = len(req.input_ids) - match.tokens
        got = self.cache.admit(req.lease, match, -(-rest // self.page_size) * self.page_size + headroom,
                               load=not req.load_back_failed)
        if got is None:
            return False
        if not self.cache.grow(req.lease, len(req.input_ids), headroom):
            self.cache.drop(req.lease)
            return False
        self.queue.admit(req)
        self.cache.dequeued(req.lease)
        if req.cached_tokens is None:
            self.counters.count_cached(req, got.prefix, got.loaded)
        req.kv_len = got.prefix
        req.incoming = self.receiver.ask(req.bootstrap, req.input_ids, got.prefix)
        return True

    def _land(self) -> None:
        """Transfers that landed: their pages go into the slots their requests reserved, and each
        request goes on from its first token; one that failed ends with its error."""
        for req in [r for r in self.queue.running if r.incoming is not None and r.incoming.done]:
            t, req.incoming = req.incoming, None
            self.receiver.land(t, req.lease.slots[t.start:t.tokens])
            if t.error is not None:
                self.queue.remove(req)
                self.memory.release(req, keep_kv=False)
                self.counters["requests_aborted"] += 1
                self.output.reject(req.rid, t.error, 502)
                continue
            req.kv_len = t.tokens
            self.output.received(req, t.first_token)

    def _waits_for_prefill(self, req: Req, cached) -> bool:
        """Whether `req` waits for running requests computing a prompt it mostly shares; they are
        marked to publish their prompts once computed."""
        prefilling = [r for r in self.queue.running if r.prompt_left and r.cache_kv]
        leaders = self.policy.prefill_leaders(req, cached(req), prefilling) if prefilling and cached else []
        for r in leaders:
            r.publish_prompt = True
        return bool(leaders)

    def _admit(self, req: Req, budget: int, after: BatchPlan | None = None) -> int:
        """Admits `req` with its cached prefix (loaded back from L2 where needed) and the slots of
        its first chunk. Returns the chunk length, or 0 (nothing held) when memory is short, or
        when a request of the launched step `after` may give the tree more of this prompt."""
        match = self.cache.match(req.all_ids[:req.prefix_limit], req.namespace)
        if after is not None and self.policy.wait_for_launched(req, match.tokens, after.reqs):
            return 0
        headroom = self.policy.decode_headroom(self.queue.running, launched=after is not None, admitting=req)
        first = self.policy.chunk_len(req, budget, start=match.tokens)
        room = -(-first // self.page_size) * self.page_size + headroom
        got = self.cache.admit(req.lease, match, room, load=not req.load_back_failed, resume_limit=req.prefix_limit)
        if got is None:
            return 0
        req.kv_len = got.prefix
        n = self.policy.chunk_len(req, budget)
        if not self.cache.grow(req.lease, got.prefix + n, headroom):
            self.cache.drop(req.lease)
            req.kv_len = 0
            return 0
        self.queue.admit(req)
        self.cache.dequeued(req.lease)
        if req.cached_tokens is None:
            self.counters.count_cached(req, got.prefix, got.loaded)
        return n

    def _add_chunk(self, plan: BatchPlan, req: Req, budget: int, allocated: bool = False,
                   start: int | None = None) -> int:
        """The request's next chunk, from `kv_len` (or `start`: where a launched, unapplied
        chunk ends; then memory is taken without retracting anyone)."""
        n = self.policy.chunk_len(req, budget, start)
        if n <= 0:
            return 0
        if start is None:
            if not (allocated or self.memory.make_room(req, req.kv_len + n)):
                return 0
            start = req.kv_len
        elif not self.cache.grow(req.lease, start + n):
            return 0
        plan.add(req, start, n, start + n == req.seq_len)
        return n
