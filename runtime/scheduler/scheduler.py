"""The scheduler: continuous batching over the KV cache, composed of named parts.

Only the thread that calls `step()` touches the scheduler and its cache. A step is `schedule()`
(a BatchPlan: a prefill batch when prompts or forced runs (runtime/jump_forward.py) wait, else one
decode token for every running request), `runner.run(plan)`, then `process_result(plan, output)`;
with overlap scheduling (`OverlapLoop`, overlap.py) it is applied during the next.

The parts, each given its collaborators: `QueueState` (queue.py: waiting and running requests,
their version), `PrefillPlanner` (prefill.py: next chunks and admissions), `DecodePlanner`
(decode.py: a token for each decoding request), `OutputProcessor` (output.py: results, stops,
grammars, jump-forward, outputs), `Memory` (memory.py: room, retraction, release); with
speculative decoding, the `Drafter` (runtime/spec/) that the decode planner and the output
processor share. A request's
phase is its `Status` (runtime/request.py). What a request holds of the cache goes through the
`CacheManager` (`hicache.manager`); budget decisions (chunk sizes, order, retraction victim) are
the `BudgetPolicy`'s (runtime/policy.py). Parts come from `runtime/build.py`.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import replace
from typing import Callable

from hicache.manager import CacheManager
from hicache.runtime.batch import BatchPlan, StepOutput
from hicache.runtime.config import RuntimeConfig
from hicache.runtime import disagg
from hicache.runtime.counters import Counters
from hicache.runtime.grammar import GrammarCompiler, any_unseen, wait_compiling
from hicache.runtime.jump_forward import JumpForward
from hicache.runtime.lora.adapter import LoraAdapter
from hicache.runtime.lora.registry import LoraRegistry, namespace as lora_namespace
from hicache.runtime.messages import GenerateRequest, TokenOutput
from hicache.runtime.policy import BudgetPolicy
from hicache.runtime.request import Req, Status, check_logprob_start, check_prompt
from hicache.runtime.sampler import make_generator
from hicache.runtime.sampling import SamplingParams
from hicache.runtime.scheduler.decode import DecodePlanner
from hicache.runtime.scheduler.memory import Memory
from hicache.runtime.scheduler.output import OutputProcessor
from hicache.runtime.scheduler.overlap import OverlapLoop
from hicache.runtime.scheduler.prefill import PrefillPlanner
from hicache.runtime.scheduler.queue import QueueState
from hicache.runtime.spec.drafter import Drafter
from hicache.runtime.stop import StopChecker


class Scheduler:
    def __init__(self, parts, rc: RuntimeConfig):
        """`parts`: `runtime.build.Components` (model config, tokenizer, cache manager, runner)."""
        self.rc = rc
        self.model_config, self.tokenizer = parts.model_config, parts.tokenizer
        self.cache: CacheManager = parts.cache
        self.runner = parts.runner
        self.context_length, self.model_name = parts.context_length, parts.model_name
        self.loras = parts.loras
        self.bytes_per_token = parts.pool.bytes_per_token()
        self.page_size = self.cache.page_size
        self.stop_checker = StopChecker(self.tokenizer, self.model_config.eos_token_ids)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.model_config.eos_token_ids)
        self._arrivals = itertools.count()
        self.counters = Counters()
        cuda = self.runner.device.type == "cuda"
        features = rc.features(cuda)
        self.jump = JumpForward(features.jump_forward, self.tokenizer, self.stop_checker, self.context_length,
                                self.counters)
        overlap = features.overlap_schedule
        prefill_ahead = overlap and not rc.disable_prefill_ahead
        self.policy = BudgetPolicy(rc, self.page_size, self.cache.capacity_tokens, prefill_ahead,
                                   self.cache.has_host_tier, cuda)
        self.queue = QueueState()
        self.sender, self.receiver = disagg.build(rc.disaggregation_mode, parts.pool, self.page_size,
                                                  rc.disaggregation_bootstrap_host or "127.0.0.1",
                                                  rc.disaggregation_bootstrap_port, rc.disaggregation_timeout)
        self.drafter = Drafter(rc, self.cache, self.counters, self.context_length, parts.draft) \
            if rc.speculative_algorithm else None
        self.memory = Memory(self.queue, self.cache, self.policy, self.counters, self.drafter)
        self.output = OutputProcessor(self.queue, self.cache, self.memory, self.grammars, self.stop_checker,
                                      self.jump, self.counters, self.context_length, self.drafter, self.sender)
        self.decode = DecodePlanner(self.queue, self.cache, self.policy, self.memory, self.stop_checker,
                                    self.context_length, self.drafter)
        self.prefill = PrefillPlanner(self.queue, self.cache, self.policy, self.memory, self.output, self.decode,
                                      self.counters, self.receiver)
        self.overlap = OverlapLoop(self, prefill_ahead) if overlap else None

    @property
    def waiting(self) -> tuple[Req, ...]:
        return self.queue.waiting

    @property
    def running(self) -> tuple[Req, ...]:
        return self.queue.running

    # ---- front-end calls -------------------------------------------------------------------

    def validate(self, req: GenerateRequest) -> SamplingParams:
        """Checks what needs the scheduler: prompt ids in the vocabulary, prompt + max_new_tokens
        within the context and the KV pool, logprob_start_len within the prompt (the front end
        parsed the sampling parameters). Raises ValueError naming the bad field; returns the
        request's sampling parameters."""
        check_prompt(req.input_ids, req.sampling_params.max_new_tokens, self.model_config.vocab_size,
                     self.context_length, self.cache.capacity_tokens)
        check_logprob_start(req.logprob_start_len, len(req.input_ids))
        if req.sampling_params.grammar is not None and self.tokenizer is None:
            raise ValueError(f"{req.sampling_params.grammar[0]}: this model has no tokenizer to compile grammars for")
        self.adapter_of(req)
        return req.sampling_params

    def adapter_of(self, msg: GenerateRequest) -> LoraAdapter | None:
        """The LoRA adapter `msg.lora_path` names (None: the base model); ValueError naming
        `lora_path` when none is loaded under that name or LoRA is off."""
        if msg.lora_path is None:
            return None
        if self.loras is None:
            raise ValueError("lora_path: LoRA adapters are not served (start with --enable-lora)")
        return self.loras.get(msg.lora_path)

    def load_lora_adapter(self, name: str, path: str) -> dict[str, str]:
        """Loads a LoRA adapter (`lora.adapter.AdapterError` naming what is wrong); returns the
        loaded adapters' name -> path."""
        self._served_loras().load(name, path)
        return self.loras.paths()

    def unload_lora_adapter(self, name: str) -> dict[str, str]:
        """Unloads an adapter: new requests for it are refused, those queued or running finish
        with it. Returns the loaded adapters' name -> path."""
        self._served_loras().unload(name)
        return self.loras.paths()

    def _served_loras(self) -> LoraRegistry:
        if self.loras is None:
            raise ValueError("LoRA adapters are not served (start with --enable-lora)")
        return self.loras

    def add_request(self, msg: GenerateRequest) -> None:
        try:
            params = self.validate(msg)
            bootstrap = self._bootstrap(msg, params)
        except ValueError as e:
            if self.sender is not None and msg.bootstrap_room is not None:
                self.sender.fail(msg.bootstrap_room, f"the prefill server refused the request: {e}")
            self.output.reject(msg.rid, str(e))
            return
        if bootstrap is not None and self.sender is not None:
            params = replace(params, max_new_tokens=1)  # the first token goes with the KV; the decode server goes on
        seq = next(self._arrivals)
        gen = None if params.is_greedy else make_generator(params.seed, self.rc.random_seed * 1_000_003 + seq,
                                                           self.runner.device)
        adapter = self.adapter_of(msg)
        req = Req(msg.rid, list(msg.input_ids), params, lora_namespace(msg.cache_salt, adapter), gen,
                  msg.return_logprob, msg.top_logprobs_num, msg.logprob_start_len)
        req.adapter = adapter
        req.arrival_seq = seq
        req.bootstrap = bootstrap
        if params.grammar is not None:
            req.grammar = self.grammars.start(*params.grammar)
        self.queue.add(req)  # max_new_tokens 0 too: its prompt is computed (log-probs) and cached
        self.cache.prefetch(req.lease, req.all_ids[:-1])

    def _bootstrap(self, msg: GenerateRequest, params: SamplingParams) -> disagg.Bootstrap | None:
        """The request's other half under disaggregation; None: served colocated (this server is
        not disaggregated, the request names no bootstrap room, or asks for no token). ValueError
        for what a disaggregated request cannot ask for yet."""
        if self.rc.disaggregation_mode == "null" or msg.bootstrap_room is None or params.max_new_tokens == 0:
            return None
        if params.grammar is not None or msg.return_logprob:
            raise ValueError("bootstrap_room: a disaggregated request takes no grammar and no log-probs yet")
        port = msg.bootstrap_port if msg.bootstrap_port is not None else self.rc.disaggregation_bootstrap_port
        return disagg.Bootstrap(msg.bootstrap_host or "127.0.0.1", port, msg.bootstrap_room)

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
        self.queue.add(req)
        while self.has_requests():
            self.step()
        self.counters.update(counters)
        if self.drafter is not None:
            self.drafter.reset()  # its steps compiled kernels: no measure of what a step costs

    def abort(self, rid: str) -> None:
        if self.overlap is not None and self.overlap.holds(rid):
            self.overlap.apply()  # its launched step first
        req = self.queue.find(rid)
        if req is None:
            return
        self.queue.remove(req)
        self.cache.dequeued(req.lease)
        if req.incoming is not None:
            self.receiver.drop(req.incoming)
            req.incoming = None
            self.memory.release(req, keep_kv=False)  # (its prompt's pages never landed)
        else:
            self.memory.release(req)
        if req.bootstrap is not None and self.sender is not None:
            self.sender.fail(req.bootstrap.room, "the request was aborted on the prefill server")
        self.counters["requests_aborted"] += 1
        self.output.emit(req, [], {"type": "abort"}, None)

    def _step_in_flight(self) -> bool:
        return self.overlap is not None and self.overlap.inflight is not None

    def has_requests(self) -> bool:
        """Requests to run, a step in flight or outputs to send."""
        return bool(self.queue.has_waiting() or self.queue.running_count() or self.output.pending()
                    or self._step_in_flight())

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
        else:
            start = time.perf_counter()
            if (plan := self.schedule()) is None:
                self.idle_wait()
            else:
                self.process_result(plan, self.runner.run(plan))
                if self.drafter is not None:  # the whole step's seconds: the drafter's step costs
                    self.drafter.timed(plan, time.perf_counter() - start)
        return self.output.take()

    def idle_wait(self) -> None:
        """Nothing to run: wait a little for a prompt's KV from a prefill server, a grammar to
        compile, or for the cache's transfers."""
        if self.receiver is not None and self.receiver.pending:
            self.receiver.wait(0.01)
        elif not wait_compiling(self.queue.waiting):
            self.cache.idle_wait()

    def grammars_compiling(self) -> bool:
        """A waiting request's grammar was not ready at the last admission: once it is, the
        request may join the batch (the overlap loop plans afresh meanwhile)."""
        return any_unseen(self.queue.waiting)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        self.grammars.close()
        self.runner.close()
        self.cache.close()

    def flush_cache(self) -> bool:
        """Empties L1 and L2; False while requests run or transfers are in flight."""
        if self.queue.running_count() or self.queue.has_waiting() or self._step_in_flight():
            return False
        return self.cache.flush() and (self.drafter is None or self.drafter.flush())

    # ---- scheduling ----------------------------------------------------------------------

    def schedule(self, after: BatchPlan | None = None) -> BatchPlan | None:
        """The next step's plan: a prefill step when prompts or forced runs wait, else a decode
        step. `after`: a launched prefill step whose results are not applied yet and which holds
        every running request (overlap scheduling, runtime/scheduler/overlap.py); then the plan
        holds the next chunks of its unfinished prompts and admissions from the queue, nothing
        else. It retracts nothing and leaves failed load-backs to the next `process_result`: the
        device may still be writing the slots of `after`'s requests."""
        if after is not None:
            self.cache.collect()  # backups landed during `after` release their pages to eviction
            plan = self.prefill.plan(after)
        else:
            self.memory.poll_transfers()
            plan = self.prefill.plan() or self.decode.plan()
        # load-backs in flight: each layer's attention waits for its own layer, on the device;
        # process_result settles them before any token goes out
        loads = self.cache.start_loads([r.lease for r in plan.reqs] if plan is not None else [],
                                       whole=after is None and self.policy.parked(self.queue.running, plan))
        if plan is not None:
            plan.loads = loads
        if plan is not None and plan.loads is not None:
            plan.rng_states = {id(r): r.generator.get_state() for r, s in zip(plan.reqs, plan.sample)
                               if r.status is Status.LOADING and s and r.generator is not None}
        return plan

    def process_result(self, plan: BatchPlan, out: StepOutput, accepted: Callable[[], None] | None = None) -> None:
        """Applies a step's results (`OutputProcessor.apply`; `accepted`: called once the step's
        tokens are recorded for the grammars' matchers)."""
        self.output.apply(plan, out, accepted)

    def continue_decode(self, plan: BatchPlan) -> tuple[BatchPlan, list[int]] | None:
        """The decode step after the launched step `plan`, with the positions in `plan` of its
        requests (`DecodePlanner.continue_after`)."""
        return self.decode.continue_after(plan)

    def can_admit(self) -> bool:
        """Some request waits and the running set has room for more."""
        return self.queue.has_waiting() and self.policy.admits_more(self.queue.running_count())

    def pages_held(self) -> int:
        """Device pages owned by requests (not by the tree, not free)."""
        return sum((r.lease.slots.numel() - r.lease.prefix_len) // self.page_size for r in self.queue.running)

    def check_integrity(self) -> None:
        self.cache.check_integrity([r.lease for r in self.queue.running], self.rc.max_running_requests)
        if self.drafter is not None:
            self.drafter.check_integrity(list(self.queue.running))

    def stats(self) -> dict:
        part = self.sender or self.receiver
        return self.counters.report(self.cache.tier_stats(self.counters.hits(), self.bytes_per_token),
                                    running=self.queue.running_count(), queued=len(self.queue.waiting),
                                    pages_held=self.pages_held(), page_size=self.page_size,
                                    disaggregation={"mode": self.rc.disaggregation_mode,
                                                    **(part.stats() if part is not None else {})})
