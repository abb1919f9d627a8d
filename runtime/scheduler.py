"""The scheduler: continuous batching over the KV cache.

Only the thread that calls `step()` touches the scheduler and its cache. A step is `schedule()`
(a BatchPlan: a prefill batch when prompts or forced runs (runtime/jump_forward.py) wait, else one
decode token for every running request), `runner.run(plan)`, then `process_result(plan, output)`
(runtime/results.py); with overlap scheduling (runtime/overlap.py) it is applied during the next.

What a request holds of the cache goes through the `CacheManager` (`hicache.manager`): admit,
grow, release, poll. Budget decisions (chunk sizes, order, retraction victim) are the
`BudgetPolicy`'s (runtime/policy.py). Parts come from `runtime/build.py`.
"""
from __future__ import annotations

import itertools
import logging

from hicache.manager import CacheManager
from hicache.runtime.batch import BatchPlan
from hicache.runtime.config import RuntimeConfig
from hicache.runtime.counters import Counters
from hicache.runtime.grammar import GrammarCompiler, any_unseen, look_at, wait_compiling
from hicache.runtime.jump_forward import JumpForward
from hicache.runtime.messages import GenerateRequest, TokenOutput
from hicache.runtime.overlap import OverlapLoop
from hicache.runtime.policy import BudgetPolicy, decodes
from hicache.runtime.request import Req, check_logprob_start, check_prompt
from hicache.runtime.results import StepResults
from hicache.runtime.sampler import make_generator
from hicache.runtime.sampling import SamplingParams
from hicache.runtime.stop import StopChecker

logger = logging.getLogger(__name__)


class Scheduler(StepResults):
    def __init__(self, parts, rc: RuntimeConfig):
        """`parts`: `runtime.build.Components` (model config, tokenizer, cache manager, runner)."""
        self.rc = rc
        self.model_config, self.tokenizer = parts.model_config, parts.tokenizer
        self.cache: CacheManager = parts.cache
        self.runner = parts.runner
        self.context_length, self.model_name = parts.context_length, parts.model_name
        self.bytes_per_token = parts.pool.bytes_per_token()
        self.page_size = self.cache.page_size
        self.stop_checker = StopChecker(self.tokenizer, self.model_config.eos_token_ids)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.model_config.eos_token_ids)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self._outputs: list[TokenOutput] = []
        self._arrivals = itertools.count()
        self.counters = Counters()
        cuda = self.runner.device.type == "cuda"
        self.jump = JumpForward(rc.features(cuda).jump_forward, self.tokenizer, self.stop_checker,
                                self.context_length, self.counters)
        # Change markers for the overlap loop: the queue or the running set changed (arrival,
        # admission, finish, abort, retraction); a running request gave its slots back early.
        self.queue_version = 0
        self.early_releases = 0
        overlap = rc.features(cuda).overlap_schedule
        prefill_ahead = overlap and not rc.disable_prefill_ahead
        self.policy = BudgetPolicy(rc, self.page_size, self.cache.capacity_tokens(), prefill_ahead,
                                   self.cache.has_host_tier, cuda)
        self.overlap = OverlapLoop(self, prefill_ahead) if overlap else None

    # ---- front-end calls -------------------------------------------------------------------

    def validate(self, req: GenerateRequest) -> SamplingParams:
        """Checks what needs the scheduler: prompt ids in the vocabulary, prompt + max_new_tokens
        within the context and the KV pool, logprob_start_len within the prompt (the front end
        parsed the sampling parameters). Raises ValueError naming the bad field; returns the
        request's sampling parameters."""
        check_prompt(req.input_ids, req.sampling_params.max_new_tokens, self.model_config.vocab_size,
                     self.context_length, self.cache.capacity_tokens())
        check_logprob_start(req.logprob_start_len, len(req.input_ids))
        if req.sampling_params.grammar is not None and self.tokenizer is None:
            raise ValueError(f"{req.sampling_params.grammar[0]}: this model has no tokenizer to compile grammars for")
        return req.sampling_params

    def add_request(self, msg: GenerateRequest) -> None:
        try:
            params = self.validate(msg)
        except ValueError as e:
            self._outputs.append(TokenOutput(msg.rid, [], {"type": "abort"}, error=str(e)))
            return
        seq = next(self._arrivals)
        gen = None if params.is_greedy else make_generator(params.seed, self.rc.random_seed * 1_000_003 + seq,
                                                           self.runner.device)
        req = Req(msg.rid, list(msg.input_ids), params, msg.cache_salt, gen, msg.return_logprob, msg.top_logprobs_num,
                  msg.logprob_start_len)
        req.arrival_seq = seq
        if params.grammar is not None:
            req.grammar = self.grammars.start(*params.grammar)
        self._enqueue(req)  # max_new_tokens 0 too: its prompt is computed (log-probs) and cached
        self.cache.prefetch(req.rid, req.all_ids[:-1], req.namespace)

    def warm_up(self, prompt_tokens: int = 16, new_tokens: int = 8) -> None:
        """Runs one greedy request (a prefill, then decode steps) before serving, so that the
        GPU kernels compile now (Triton's in seconds, FlashInfer's on its first use in minutes)
        rather than in a user's first request. It leaves nothing behind: a namespace of its own,
        no prefetch, nothing given to the tree (nothing reaches L2 or L3), no arrival number
        (unseeded sampling draws as without it) and the counters as they were."""
        vocab = self.model_config.vocab_size
        ids = [(1 + i * 7919) % vocab for i in range(prompt_tokens)]
        params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        req = Req("hicache-warm-up", ids, params, "hicache-warm-up", None, False, 0)
        req.arrival_seq, req.cache_kv = -1, False
        counters = dict(self.counters)
        self._enqueue(req)
        while self.has_requests():
            self.step()
        self.counters.update(counters)

    def abort(self, rid: str) -> None:
        if self.overlap is not None and self.overlap.holds(rid):
            self.overlap.apply()  # its launched step first
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.rid == rid:
                    queue.remove(req)
                    self.queue_version += 1
                    self.cache.dequeued(rid)
                    self._release(req)
                    self.counters["requests_aborted"] += 1
                    self._emit(req, [], {"type": "abort"}, None)
                    return

    def _step_in_flight(self) -> bool:
        return self.overlap is not None and self.overlap.inflight is not None

    def has_requests(self) -> bool:
        """Requests to run, a step in flight or outputs to send."""
        return bool(self.waiting or self.running or self._outputs or self._step_in_flight())

    def has_work(self) -> bool:
        """Requests, or tier copies / L3 operations in flight: an idle server keeps stepping until
        they land, so that their pins and stats settle without waiting for the next request."""
        return self.has_requests() or self.cache.busy()

    def check_health(self) -> None:
        """Raises when the runner's other processes failed (a tensor-parallel rank died): the loop
        that steps the scheduler calls it between steps, so that an idle server notices too."""
        self.runner.check_health()

    def step(self) -> list[TokenOutput]:
        """One step; with overlap, the outputs are those of the step launched by the call before."""
        if self.overlap is not None:
            self.overlap.step()
        elif (plan := self.schedule()) is not None:
            self.process_result(plan, self.runner.run(plan))
        else:
            self.idle_wait()
        outs, self._outputs = self._outputs, []
        return outs

    def idle_wait(self) -> None:
        """Nothing to run: wait a little for a grammar to compile, or for the cache's transfers."""
        if not wait_compiling(self.waiting):
            self.cache.idle_wait()

    def grammars_compiling(self) -> bool:
        """A waiting request's grammar was not ready at the last admission: once it is, the
        request may join the batch (the overlap loop plans afresh meanwhile)."""
        return any_unseen(self.waiting)

    def close(self) -> None:
        self.grammars.close()
        self.runner.close()
        self.cache.close()

    def flush_cache(self) -> bool:
        """Empties L1 and L2; False while requests run or transfers are in flight."""
        if self.running or self.waiting or self._step_in_flight():
            return False
        return self.cache.flush()

    # ---- scheduling ----------------------------------------------------------------------

    def schedule(self, after: BatchPlan | None = None) -> BatchPlan | None:
        """The next step's plan. `after`: a launched prefill step whose results are not applied
        yet and which holds every running request (overlap scheduling, runtime/overlap.py); then
        the plan holds the next chunks of its unfinished prompts and admissions from the queue,
        nothing else. It retracts nothing and leaves failed load-backs to the next
        `process_result`: the device may still be writing the slots of `after`'s requests."""
        if after is not None:
            self.cache.collect()  # backups landed during `after` release their pages to eviction
            plan = self._schedule_prefill(after)
        else:
            self.poll_transfers()
            plan = self._schedule_prefill() or self._schedule_decode()
        if plan is not None:  # load-backs in flight: each layer's attention waits for its own layer, on
            # the device; process_result settles them before any token goes out
            plan.loads = self.cache.load_handle([r.lease for r in plan.reqs])
        self.cache.start_loads(whole=after is None and self.policy.parked(self.running, plan))
        if plan is not None and plan.loads is not None:
            plan.rng_states = {id(r): r.generator.get_state() for r, s in zip(plan.reqs, plan.sample)
                               if r.lease.loading and s and r.generator is not None}
        return plan

    def poll_transfers(self) -> list[Req]:
        """Folds in finished tier transfers; recomputes the requests whose load-back failed
        (returned: a batch that already ran on such a load must drop what it sampled)."""
        failed = [lease.owner for lease in self.cache.poll([r.lease for r in self.running])]
        for req in failed:
            self._retract(req, keep_kv=False)
            req.load_back_failed = True  # recompute it rather than load again
        return failed

    def _schedule_prefill(self, after: BatchPlan | None = None) -> BatchPlan | None:
        """A prefill batch: running requests' next chunks, then admissions in policy order. With
        `after` (launched, not applied), the running requests are its own: their next chunks start
        where its chunks end, and memory comes from the free pool and the tree only."""
        if self.waiting:
            self.cache.prefetch_grace(decoding=any(map(decodes, self.running)))
        self.cache.set_prefill_backlog(sum(max(0, len(r.input_ids) - r.kv_len) for r in (*self.waiting, *self.running)))
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
        for req in sorted(self.running, key=lambda r: r.arrival_seq) if after is None else ():
            if req in self.running and req.kv_len < req.seq_len - 1:
                self.cache.refresh(req.lease)
                if not self.policy.parks(req, self.running):
                    budget -= self._add_chunk(plan, req, budget)
        if after is None and any(r.grammar is not None and start >= len(r.input_ids)
                                 for r, start in zip(plan.reqs, plan.starts)):
            self._schedule_decode(plan)  # a forced run (jump-forward) is computed with the decoding requests
        self._admit_waiting(plan, budget, after)
        return plan if plan.reqs else None

    def _admit_waiting(self, plan: BatchPlan, budget: int, after: BatchPlan | None) -> None:
        ahead = frozenset(id(r) for r in after.reqs) if after is not None else frozenset()
        cached = None if self.cache.disabled else (lambda r: self.cache.match(r.all_ids[:r.prefix_limit],
                                                                              r.namespace).tokens)
        for req in look_at(self.waiting):  # its grammar did not compile
            self.waiting.remove(req)
            self.cache.dequeued(req.rid)
            self._outputs.append(TokenOutput(req.rid, [], {"type": "abort"}, error=req.grammar.error))
        for req in self.policy.order(self.waiting, cached):
            if budget <= 0 or not self.policy.admits_more(len(self.running)) or id(req) in ahead:
                break  # (one retracted from the launched step waits until that step is applied)
            if self.policy.over_step_cap(plan.kv_tokens(), req):
                break  # L1 left for the next step's load-backs (runtime/overlap.py)
            if req.grammar is not None and not req.grammar.seen_ready:
                continue  # its grammar is compiling
            got = self.cache.prefetch_ready(req.rid)
            if got is None:
                continue  # the prefetch policy keeps it waiting for its L3 pages
            if got.end > got.start:  # what landed is in the tree (host-only), loaded back like any L2 hit
                req.storage_range = (got.start, got.end)
            if not req.output_ids and self._jump_first(req):
                continue  # the forced text alone reached a stop or the length limit
            if self._waits_for_prefill(req, cached):
                continue  # a running request is computing most of its prompt: it finds it cached next
            n = self._admit(req, budget, after)
            if n == 0:
                break
            self.cache.refresh(req.lease)
            if after is None and self.policy.parks(req, self.running):
                continue  # its first chunk runs once its load has landed
            budget -= n
            self._add_chunk(plan, req, n, allocated=True)

    def _waits_for_prefill(self, req: Req, cached) -> bool:
        """Whether `req` waits for running requests computing a prompt it mostly shares; they are
        marked to publish their prompts once computed."""
        prefilling = [r for r in self.running if r.kv_len < len(r.input_ids) and r.cache_kv]
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
        headroom = self.policy.decode_headroom(self.running, launched=after is not None)
        first = self.policy.chunk_len(req, budget, start=match.tokens)
        room = -(-first // self.page_size) * self.page_size + headroom
        got = self.cache.admit(req.lease, match, room, load=not req.load_back_failed)
        if got is None:
            return 0
        req.kv_len = got.prefix
        n = self.policy.chunk_len(req, budget)
        if not self.cache.grow(req.lease, got.prefix + n, headroom):
            self.cache.drop(req.lease)
            req.kv_len = 0
            return 0
        self.waiting.remove(req)
        self.cache.dequeued(req.rid)
        self.running.append(req)
        self.queue_version += 1
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
            if not (allocated or self._make_room(req, req.kv_len + n)):
                return 0
            start = req.kv_len
        elif not self.cache.grow(req.lease, start + n):
            return 0
        plan.add(req, start, n, start + n == req.seq_len)
        return n

    def _schedule_decode(self, extend: BatchPlan | None = None) -> BatchPlan | None:
        """One token for every decoding request. With `extend` (a plan with forced runs), those
        not in it join it as chunks of one token, where a slot is free without retracting (it
        holds requests of any arrival)."""
        plan = extend or BatchPlan("decode", [], [], [], [])
        plan.joined = extend is not None
        planned = {id(r) for r in plan.reqs}
        for req in sorted(self.running, key=lambda r: r.arrival_seq):
            if id(req) not in planned and req in self.running and req.kv_len == req.seq_len - 1:
                self.cache.refresh(req.lease)
                if self.policy.parks(req, self.running):
                    continue
                if self.cache.grow(req.lease, req.seq_len) if extend else self._make_room(req, req.seq_len):
                    plan.add(req, req.kv_len, 1, True)
        return plan if plan.reqs else None

    def continue_decode(self, plan: BatchPlan) -> tuple[BatchPlan, list[int]] | None:
        """For overlap scheduling: the decode step after the launched step `plan` (a decode step, or
        an extend whose every request samples), for the same requests less those whose token from
        `plan` is their last by length, with their positions in `plan`; None when nothing would
        continue or a slot cannot be had without retracting (no retraction while a step is in
        flight)."""
        self.poll_transfers()  # retracts only requests with load-backs in flight: only those sitting out
        keep = [i for i, r in enumerate(plan.reqs)
                if not self.stop_checker.length_reached(r, self.context_length, 1)]
        if not keep:
            return None
        reqs, starts = [plan.reqs[i] for i in keep], [plan.starts[i] + plan.extend_lens[i] for i in keep]
        if not self.cache.grow_all([r.lease for r in reqs], [s + 1 for s in starts]):
            return None
        return BatchPlan("decode", reqs, starts, [1] * len(keep), [True] * len(keep)), keep

    # ---- memory ----------------------------------------------------------------------------

    def _make_room(self, req: Req, upto: int) -> bool:
        """Grows a running request's slots to `upto` tokens, retracting the policy's victims while
        short. False when `req` itself had to be retracted."""
        while not self.cache.grow(req.lease, upto):
            victim = self.policy.victim(self.running)
            self._retract(victim)
            if victim is req:
                return False
        return True

    def _release(self, req: Req, keep_kv: bool = True) -> None:
        """Gives the cache what the request computed (`keep_kv=False`: nothing new, e.g. when its
        prefix was never loaded correctly) and frees the rest."""
        self.cache.release(req.lease, req.all_ids[:req.kv_len], len(req.input_ids), keep_kv)
        req.kv_len = 0

    def _retract(self, req: Req, keep_kv: bool = True) -> None:
        """Out of KV (or its load-back failed: `keep_kv=False`): put a running request back in the
        queue; it is recomputed later (its prefix likely still cached) and continues with the same
        outputs and sampler state."""
        logger.info("retracting %s to free KV memory", req)
        self.running.remove(req)
        self._release(req, keep_kv)
        if req.grammar is not None:
            req.grammar.sync(req.output_ids)
        self.counters["retractions"] += 1
        self.early_releases += 1
        self.waiting.insert(0, req)
        self.waiting.sort(key=lambda r: r.arrival_seq)
        self.queue_version += 1

    def _enqueue(self, req: Req) -> None:
        self.waiting.append(req)
        self.queue_version += 1

    def pages_held(self) -> int:
        """Device pages owned by requests (not by the tree, not free)."""
        return sum((r.lease.slots.numel() - r.lease.prefix_len) // self.page_size for r in self.running)

    def check_integrity(self) -> None:
        self.cache.check_integrity([r.lease for r in self.running], self.rc.max_running_requests)

    def stats(self) -> dict:
        return self.counters.report(self.cache.tier_stats(self.counters.hits(), self.bytes_per_token),
                                    running=len(self.running), queued=len(self.waiting),
                                    pages_held=self.pages_held(), page_size=self.page_size)
