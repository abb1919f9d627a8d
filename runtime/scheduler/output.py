"""`OutputProcessor`: a step's results applied to its requests.

Tokens are accepted by their requests' grammars, appended, stop-checked (runtime/stop.py) and
followed by the text the grammar forces (runtime/jump_forward.py); outputs are queued as
`TokenOutput`s until the scheduler's caller takes them; finished requests leave the queue and give
the cache their KV.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from hicache.runtime.counters import usage
from hicache.runtime.messages import TokenOutput
from hicache.runtime.request import Status

if TYPE_CHECKING:
    from hicache.manager import CacheManager
    from hicache.runtime.batch import BatchPlan, StepOutput
    from hicache.runtime.counters import Counters
    from hicache.runtime.disagg.sender import KVSender
    from hicache.runtime.grammar import GrammarCompiler
    from hicache.runtime.jump_forward import JumpForward
    from hicache.runtime.request import Req
    from hicache.runtime.scheduler.memory import Memory
    from hicache.runtime.scheduler.queue import QueueState
    from hicache.runtime.spec.drafter import Drafter
    from hicache.runtime.stop import StopChecker


class OutputProcessor:
    """`sender` (a prefill server's, runtime/disagg/): a finishing request with a bootstrap room
    ships its prompt's KV and first token to the decode server before its slots are released."""

    def __init__(self, queue: QueueState, cache: CacheManager, memory: Memory, grammars: GrammarCompiler,
                 stops: StopChecker, jump: JumpForward, counters: Counters, context_length: int,
                 drafter: Drafter | None = None, sender: KVSender | None = None):
        self.queue, self.cache, self.memory, self.grammars = queue, cache, memory, grammars
        self.stops, self.jump, self.counters, self.context_length = stops, jump, counters, context_length
        self.drafter, self.sender = drafter, sender
        self._outbox: list[TokenOutput] = []

    def apply(self, plan: BatchPlan, out: StepOutput, accepted: Callable[[], None] | None = None) -> None:
        """Applies a step's results. `accepted` is called once the step's tokens are recorded for
        the grammars' matchers (runtime/grammar.py), before the requests' results (stop checks,
        jump-forward, outputs)."""
        dropped = self._settle_loads(plan) if plan.loads is not None else ()
        if plan.mode == "extend" and all(r.cache_kv for r in plan.reqs):  # not the warm-up (it compiles kernels)
            # the prefill rate that loads from L2 and L3 are weighed against
            self.cache.record_prefill(sum(plan.extend_lens), time.perf_counter() - plan.created)
        self.grammars.accept([(req.grammar, out.next_ids[i], out.allowed and out.allowed[i])
                              for i, req in enumerate(plan.reqs)
                              if req.grammar is not None and out.next_ids[i] is not None
                              and req.params.max_new_tokens != 0 and not (dropped and id(req) in dropped)])
        if accepted is not None:
            accepted()
        self.counters["forward_steps"] += 1
        for i, req in enumerate(plan.reqs):
            if dropped and id(req) in dropped:  # it ran on a load that failed: recomputed later
                continue
            if plan.drafts and plan.drafts[i]:
                self._verified(req, len(plan.drafts[i]), len(out.extra_ids[i]))
            else:
                req.kv_len += plan.extend_lens[i]
            self.cache.advance(req.lease, req.kv_len)
            if plan.mode == "extend" and not (plan.joined and plan.past_prompt(i)):
                self._prompt_computed(req, plan.extend_lens[i], out.input_logprobs[i])
            if out.next_ids[i] is not None:
                self._sampled(req, out, i)

    def _verified(self, req: Req, drafted: int, accepted: int) -> None:
        """A verify step computed `req`'s last token and `drafted` drafts, of which the first
        `accepted` hold: their KV is kept, the slots of the rejected ones are freed (whole pages
        past the next token's), none of them ever reaches the tree."""
        req.kv_len += 1 + accepted
        self.memory.trim(req)
        self.drafter.record(req, drafted, accepted)

    def _prompt_computed(self, req: Req, n: int, input_logprobs: list | None) -> None:
        """`n` more of `req`'s prompt tokens computed (with their prompt log-probs)."""
        self.counters["prompt_tokens"] += n
        if req.publish_prompt and not req.prompt_left:
            req.publish_prompt = False
            self.cache.publish(req.lease, req.input_ids)
        req.input_logprobs.extend(input_logprobs or ())

    def _sampled(self, req: Req, out: StepOutput, i: int) -> None:
        """`req`'s token from the step (its grammar accepted it), and after it those a verify step
        accepted: appended and stop-checked one by one (a stop drops the rest), followed by the
        tokens its grammar forces, emitted together."""
        token = out.next_ids[i]
        if req.params.max_new_tokens == 0:  # the prompt alone was asked for: its token is dropped
            self._finish(req)
            self.emit(req, [], {"type": "length", "length": 0}, None)
            return
        logprobs = [[out.logprobs[i], out.top_logprobs[i]]] if req.return_logprob else None
        self._append(req, [token, *(out.extra_ids[i] if out.extra_ids else ())], logprobs)

    def received(self, req: Req, token: int) -> None:
        """`req`'s prompt KV landed with its first token, sampled by the prefill server."""
        self._append(req, [token], None)

    def _append(self, req: Req, tokens: list[int], logprobs: list | None) -> None:
        """Appends and stop-checks `tokens` one by one (a stop drops the rest; past the first: a
        verify step's accepted drafts), follows them with what the grammar forces, emits them."""
        new, reason = [], None
        for t in tokens:
            req.output_ids.append(t)
            new.append(t)
            self.counters["generation_tokens"] += 1
            reason = self.stops.check(req, self.context_length)
            if reason is not None:
                break
        forced, reason = self.jump(req) if reason is None else ([], reason)
        if reason is not None:
            self._finish(req)
        self.emit(req, [*new, *forced], reason, logprobs)

    def jump_first(self, req: Req) -> bool:
        """Jump-forward before a waiting request's first token (its forced run is computed with its
        prompt); True when that finished the request (it leaves the queue)."""
        forced, reason = self.jump(req)
        if reason is not None:
            self.queue.remove(req)
            self.cache.dequeued(req.lease)
            self.counters["requests_finished"] += 1
        if forced:
            self.emit(req, forced, reason, None)
        return reason is not None

    def _finish(self, req: Req) -> None:
        self.queue.remove(req)
        if req.bootstrap is not None and self.sender is not None:
            self.sender.ship(req.bootstrap.room, req.input_ids, req.lease.slots, req.output_ids[0])
        self.memory.release(req, keep_kv=req.cache_kv)
        self.counters["requests_finished"] += 1

    def _settle_loads(self, plan: BatchPlan) -> set[int]:
        """Before a token sampled over loaded-back pages goes out, those loads must have landed (on
        CUDA they have: the pass waited for them and the sampler synced). A request whose load
        failed is retracted and recomputed; returns their ids, whose results are dropped (and
        whose sampler is rewound). So are those retracted while this plan was in flight (a step
        launched ahead of the one before it: that step's results reported their failed loads)."""
        if any(r.status is Status.LOADING and s for r, s in zip(plan.reqs, plan.sample)):
            plan.loads.settle()
        dropped = {id(r) for r in self.memory.poll_transfers()} | {id(r) for r in plan.reqs if not r.holds_kv}
        for req in plan.reqs:
            if id(req) in dropped and id(req) in plan.rng_states:
                req.generator.set_state(plan.rng_states[id(req)])
            elif id(req) not in dropped:
                self.cache.refresh(req.lease)
        return dropped

    def emit(self, req: Req, new_ids: list[int], reason: dict | None, logprobs: list | None) -> None:
        """An output; a request's first one after its prompt carries the prompt's log-probs."""
        prompt = req.take_input_logprobs()
        self._outbox.append(TokenOutput(req.rid, new_ids, reason, usage(req), logprobs, input_logprobs=prompt))

    def reject(self, rid: str, error: str | None, status: int = 400) -> None:
        """The abort output of a request refused before it ran, or failed (`error` says why,
        `status`: its HTTP status)."""
        self._outbox.append(TokenOutput(rid, [], {"type": "abort"}, error=error, error_status=status))

    def pending(self) -> bool:
        """Outputs not taken yet."""
        return bool(self._outbox)

    def take(self) -> list[TokenOutput]:
        """The outputs queued since the last call, in order."""
        outs, self._outbox = self._outbox, []
        return outs
