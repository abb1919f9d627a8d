"""The scheduler's results half: a step's outputs applied to its requests (tokens accepted by
their grammars, stop checks, jump-forward, outputs queued, finished requests released).

A mixin of `Scheduler` (runtime/scheduler.py); it reads the scheduler's queues, cache, grammars,
stop checker, jump-forward and counters, and calls its `_release` and `_retract`.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from hicache.runtime.batch import BatchPlan, StepOutput
from hicache.runtime.counters import usage
from hicache.runtime.messages import TokenOutput

if TYPE_CHECKING:
    from hicache.runtime.request import Req


class StepResults:
    def process_result(self, plan: BatchPlan, out: StepOutput, accepted: Callable[[], None] | None = None) -> None:
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
            req.kv_len += plan.extend_lens[i]
            self.cache.advance(req.lease, req.kv_len)
            if plan.mode == "extend" and not (plan.joined and plan.starts[i] >= len(req.input_ids)):
                self.counters["prompt_tokens"] += plan.extend_lens[i]
                if req.publish_prompt and req.kv_len >= len(req.input_ids):
                    req.publish_prompt = False
                    self.cache.publish(req.lease, req.input_ids)
                req.input_logprobs.extend(out.input_logprobs[i] or ())
            token = out.next_ids[i]
            if token is None:
                continue
            if req.params.max_new_tokens == 0:  # the prompt alone was asked for: its token is dropped
                self._finish(req)
                self._emit(req, [], {"type": "length", "length": 0}, None)
                continue
            req.output_ids.append(token)  # its grammar accepted it above
            self.counters["generation_tokens"] += 1
            logprobs = [[out.logprobs[i], out.top_logprobs[i]]] if req.return_logprob else None
            reason = self.stop_checker.check(req, self.context_length)
            forced, reason = self.jump(req) if reason is None else ([], reason)
            if reason is not None:
                self._finish(req)
            self._emit(req, [token, *forced], reason, logprobs)

    def _jump_first(self, req: Req) -> bool:
        """Jump-forward before a request's first token (its forced run is computed with its
        prompt); True when that finished the request (it leaves the queue)."""
        forced, reason = self.jump(req)
        if reason is not None:
            self.waiting.remove(req)
            self.queue_version += 1
            self.cache.dequeued(req.lease)
            self.counters["requests_finished"] += 1
        if forced:
            self._emit(req, forced, reason, None)
        return reason is not None

    def _finish(self, req: Req) -> None:
        self.running.remove(req)
        self.queue_version += 1
        self._release(req, keep_kv=req.cache_kv)
        self.counters["requests_finished"] += 1

    def _settle_loads(self, plan: BatchPlan) -> set[int]:
        """Before a token sampled over loaded-back pages goes out, those loads must have landed (on
        CUDA they have: the pass waited for them and the sampler synced). A request whose load
        failed is retracted and recomputed; returns their ids, whose results are dropped (and
        whose sampler is rewound). So are those retracted while this plan was in flight (a step
        launched ahead of the one before it: that step's results reported their failed loads)."""
        if any(r.lease.loading and s for r, s in zip(plan.reqs, plan.sample)):
            plan.loads.settle()
        dropped = {id(r) for r in self.poll_transfers()} | {id(r) for r in plan.reqs if not r.holds_kv}
        for req in plan.reqs:
            if id(req) in dropped and id(req) in plan.rng_states:
                req.generator.set_state(plan.rng_states[id(req)])
            elif id(req) not in dropped:
                self.cache.refresh(req.lease)
        return dropped

    def _emit(self, req: Req, new_ids: list[int], reason: dict | None, logprobs: list | None) -> None:
        """An output; a request's first one after its prompt carries the prompt's log-probs."""
        prompt = req.take_input_logprobs()
        self._outputs.append(TokenOutput(req.rid, new_ids, reason, usage(req), logprobs, input_logprobs=prompt))
