"""The scheduler: continuous batching over the L1 pool and the radix tree.

Only the thread that calls `step()` touches the scheduler, the tree and the pools. A step is
`schedule()` (a BatchPlan: a prefill batch when prompts wait, else one decode token for every
running request), `runner.run(plan)`, then `process_result(plan, output)`; with overlap
scheduling (runtime/overlap.py) the result of a step is applied during the next one.
"""
from __future__ import annotations

import collections
import itertools
import logging
import time

import torch

from hicache.config import HiCacheConfig
from hicache.runtime.batch import BatchPlan, StepOutput
from hicache.runtime.build import build
from hicache.runtime.config import RuntimeConfig
from hicache.runtime.messages import GenerateRequest, TokenOutput
from hicache.runtime.overlap import OverlapLoop
from hicache.runtime.request import Req
from hicache.runtime.sampler import make_generator
from hicache.runtime.sampling import SamplingParams
from hicache.runtime.stop import StopChecker

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, runtime_config: RuntimeConfig | None = None, cache_config: HiCacheConfig | None = None):
        self.rc = runtime_config or RuntimeConfig()
        self.cc = cache_config or HiCacheConfig()
        parts = build(self.rc, self.cc)
        self.model_config, self.tokenizer = parts.model_config, parts.tokenizer
        self.pool, self.req_table, self.tree, self.runner = parts.pool, parts.req_table, parts.tree, parts.runner
        self.cache = parts.cache  # the cache brain: match, load-back, insert, eviction over L1 and L2
        self.context_length, self.model_name = parts.context_length, parts.model_name
        self.page_size = self.cc.page_size
        self.alloc = self.pool.allocator
        self.stop_checker = StopChecker(self.tokenizer, self.model_config.eos_token_ids)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self._outputs: list[TokenOutput] = []
        self._arrivals = itertools.count()
        self.storage = self.cache.storage  # L3 prefetch and backup (None when off)
        self.counters = dict(prompt_tokens=0, generation_tokens=0, cached_device=0, cached_host=0, cached_storage=0,
                             retractions=0, requests_finished=0, requests_aborted=0)
        overlap = self.rc.enable_overlap_schedule or (self.runner.device.type == "cuda"
                                                      and not self.rc.disable_overlap_schedule)
        self.overlap = OverlapLoop(self) if overlap else None  # runtime/overlap.py

    # ---- front-end calls -------------------------------------------------------------------

    def validate(self, req: GenerateRequest) -> SamplingParams:
        """Raises ValueError naming the bad field; returns the parsed sampling parameters."""
        params = SamplingParams.from_dict(req.sampling_params, self.model_config.vocab_size)
        ids = req.input_ids
        if not ids:
            raise ValueError("input_ids: the prompt is empty")
        if min(ids) < 0 or max(ids) >= self.model_config.vocab_size:
            raise ValueError(f"input_ids: token ids must be in [0, {self.model_config.vocab_size})")
        if len(ids) + params.max_new_tokens > self.context_length:
            raise ValueError(f"input_ids: prompt of {len(ids)} tokens + max_new_tokens {params.max_new_tokens} "
                             f"exceeds the context length {self.context_length}")
        if len(ids) + params.max_new_tokens > self.alloc.capacity_tokens():
            raise ValueError(f"input_ids: prompt + max_new_tokens ({len(ids) + params.max_new_tokens}) exceeds "
                             f"the KV pool ({self.alloc.capacity_tokens()} tokens)")
        if req.top_logprobs_num < 0:
            raise ValueError("top_logprobs_num must be >= 0")
        return params

    def add_request(self, msg: GenerateRequest) -> None:
        try:
            params = self.validate(msg)
        except ValueError as e:
            self._outputs.append(TokenOutput(msg.rid, [], {"type": "abort"}, error=str(e)))
            return
        seq = next(self._arrivals)
        gen = None if params.is_greedy else make_generator(params.seed, self.rc.random_seed * 1_000_003 + seq,
                                                           self.runner.device)
        req = Req(msg.rid, list(msg.input_ids), params, msg.cache_salt, gen, msg.return_logprob, msg.top_logprobs_num)
        req.arrival_seq = seq
        if params.max_new_tokens == 0:
            req.cached_tokens = 0
            self._finish(req, {"type": "length", "length": 0})
            return
        self.waiting.append(req)
        if self.storage is not None:
            self.storage.prefetch(req.rid, req.all_ids[:-1], req.namespace)

    def warm_up(self, prompt_tokens: int = 16, new_tokens: int = 8) -> None:
        """Runs one greedy request (a prefill, then decode steps) before serving, so that the
        GPU kernels compile now (Triton's in seconds, FlashInfer's on its first use in minutes)
        rather than in a user's first request. It leaves nothing behind: a namespace of its own,
        no prefetch, nothing given to the tree (nothing reaches L2 or L3), no arrival number
        (unseeded sampling draws as without it) and the counters as they were."""
        vocab = self.model_config.vocab_size
        ids = [(1 + i * 7919) % vocab for i in range(prompt_tokens)]
        params = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}, vocab)
        req = Req("hicache-warm-up", ids, params, "hicache-warm-up", None, False, 0)
        req.arrival_seq, req.cache_kv = -1, False
        counters = dict(self.counters)
        self.waiting.append(req)
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
                    if self.storage is not None:
                        self.storage.revoke(rid)
                    self._release(req)
                    self.counters["requests_aborted"] += 1
                    self._finish(req, {"type": "abort"})
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
        """Nothing to run: wait a little for what may change that (L3 answers, tier copies)."""
        if self.storage is not None and (self.storage.waiting() or self.storage.busy()):
            self.storage.wait(0.01)
        elif self.cache.busy():
            time.sleep(0.001)

    def close(self) -> None:
        """Stops the L3 I/O threads (after their in-flight writes)."""
        if self.storage is not None:
            self.storage.close()

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
        nothing else. It retracts nothing and
        leaves failed load-backs to the next `process_result`: the device may still be writing
        the slots of `after`'s requests."""
        if after is not None:
            self.cache.collect()  # backups landed during `after` release their pages to eviction
            plan = self._schedule_prefill(after)
        else:
            self._poll_transfers()
            plan = self._schedule_prefill() or self._schedule_decode()
        tickets = frozenset().union(*(r.wait_tickets for r in plan.reqs)) if plan is not None else None
        if tickets:  # load-backs in flight (or failed, unreported): each layer's attention waits for its
            # own layer, on the device; process_result settles them before any token goes out
            plan.kv_wait = self.cache.layer_waiter(tickets)
            self.cache.start_loads()  # now that the batch is known: its loads go together
            plan.rng_states = {id(r): r.generator.get_state() for r, s in zip(plan.reqs, plan.sample)
                               if r.wait_tickets and s and r.generator is not None}
        return plan

    def _poll_transfers(self) -> list[Req]:
        """Fold in finished L1 <-> L2 transfers; recompute the requests whose load-back failed
        (returned: a batch that already ran on such a load must drop what it sampled)."""
        failed = self.cache.poll()
        retracted = [r for r in self.running if r.wait_tickets & failed] if failed else []
        for req in retracted:
            self._retract(req, keep_kv=False)
            req.load_back_failed = True  # recompute it rather than load again
        if failed:
            self.cache.drop_stale()
        return retracted

    def _kv_ready(self, req: Req) -> bool:
        """Forgets the request's load-backs that have landed. It runs at once all the same: the
        forward pass waits per layer (plan.kv_wait) and process_result settles them before its tokens
        go out."""
        if req.wait_tickets and self.cache.loads_done(req.wait_tickets):
            req.wait_tickets = frozenset()
        return True

    def _schedule_prefill(self, after: BatchPlan | None = None) -> BatchPlan | None:
        """A prefill batch: running requests' next chunks, then admissions in policy order. With
        `after` (launched, not applied), the running requests are its own: their next chunks start
        where its chunks end, and memory comes from the free pool and the tree only."""
        if self.storage is not None and self.waiting:
            self.storage.grace()
        plan = BatchPlan("extend", [], [], [], [])
        budget = self.rc.max_prefill_tokens
        ahead = frozenset(id(r) for r in after.reqs) if after is not None else frozenset()
        if after is not None:
            for req, start, n, sample in zip(after.reqs, after.starts, after.extend_lens, after.sample):
                if sample or not req.holds_kv:  # (not holding: retracted in flight, its load failed)
                    continue
                added = self._add_chunk(plan, req, budget, start=start + n) if budget > 0 else 0
                if added == 0:  # no budget, or no room without retracting: plan once `after` is applied
                    return None
                budget -= added
        for req in sorted(self.running, key=lambda r: r.arrival_seq) if after is None else ():
            if req in self.running and req.kv_len < req.seq_len - 1 and self._kv_ready(req):
                budget -= self._add_chunk(plan, req, budget)
        cap = self.overlap.step_kv_cap() if self.overlap is not None else None
        for req in self._ordered_waiting():
            if budget <= 0 or len(self.running) >= self.rc.max_running_requests or id(req) in ahead:
                break  # (one retracted from the launched step waits until that step is applied)
            if cap is not None and plan.reqs and plan.kv_tokens() + req.seq_len > cap:
                break  # L1 left for the next step's load-backs (runtime/overlap.py)
            if not self._storage_ready(req):
                continue
            n = self._admit(req, budget, after)
            if n == 0:
                break
            if self._kv_ready(req):
                budget -= n
                self._add_chunk(plan, req, n, allocated=True)
        return plan if plan.reqs else None

    def _storage_ready(self, req: Req) -> bool:
        """False while the prefetch policy keeps `req` waiting for its L3 pages; once it lets the
        request go, what landed is in the tree (host-only) and `req.storage_range` names it."""
        if self.storage is None:
            return True
        got = self.storage.ready(req.rid)
        if got is None:
            return False
        if got.end > got.start:
            req.storage_range = (got.start, got.end)
        return True

    def _ordered_waiting(self) -> list[Req]:
        if self.rc.schedule_policy == "fcfs" or self.cache.disabled:
            return list(self.waiting)
        matches = {r.rid: self.cache.match(r.all_ids[:-1], r.namespace) for r in self.waiting}
        matched = {rid: m.device_slots.numel() + m.host_hit_tokens for rid, m in matches.items()}
        return sorted(self.waiting, key=lambda r: (-matched[r.rid], r.arrival_seq))

    def _chunk_len(self, req: Req, budget: int, start: int | None = None) -> int:
        n = min(req.seq_len - (req.kv_len if start is None else start), budget)
        if self.rc.chunked_prefill_size > 0:
            n = min(n, self.rc.chunked_prefill_size)
        return n

    def _admit(self, req: Req, budget: int, after: BatchPlan | None = None) -> int:
        """Match the prefix (L1, then L2), lock it, take a table row, load the L2 part back into
        fresh L1 pages (all or nothing) and take the slots of the first chunk.
        Returns the chunk length, or 0 (nothing held) when memory is short, or when a request of
        the launched step `after` may give the tree more of this prompt once applied."""
        match = self.cache.match(req.all_ids[:-1], req.namespace)
        if after is not None and self._would_grow(req, match.device_slots.numel() + match.host_hit_tokens, after.reqs):
            return 0
        self.cache.lock(match.last_node)
        req.last_node, req.slots = match.last_node, match.device_slots
        req.prefix_len = req.kv_len = req.slots.numel()
        # room for the next token of each decoding request (all those of a launched step decode next)
        decoding = len(self.running) if after is not None else sum(1 for r in self.running if r.kv_len >= r.seq_len - 1)
        headroom = self.page_size * decoding
        req.row = self.req_table.alloc()
        host = self._load_back(req, match, budget, headroom) if req.row is not None else 0
        if host is None:  # L2 holds more of the prompt than L1 has room for yet: wait, not recompute
            self._release(req)
            return 0
        prefix = req.prefix_len = req.kv_len = req.slots.numel()
        n = self._chunk_len(req, budget)
        if req.row is not None:
            self.req_table.write(req.row, 0, req.slots)
        if req.row is None or not self._ensure_slots(req, prefix + n, headroom):
            self._release(req)
            return 0
        self.waiting.remove(req)
        self.running.append(req)
        req.wait_tickets = self.cache.pending_loads(req.last_node)
        if req.cached_tokens is None:
            start, end = req.storage_range  # the loaded-back part [prefix - host, prefix) may include it
            storage = max(0, min(end, prefix) - max(start, prefix - host))
            req.cached_tokens, req.cached_host, req.cached_storage = prefix, host - storage, storage
            self.counters["cached_device"] += prefix - host
            self.counters["cached_host"] += host - storage
            self.counters["cached_storage"] += storage
        return n

    def _would_grow(self, req: Req, matched: int, launched: list[Req]) -> bool:
        """True when a request of the launched step shares at least a page of `req`'s prompt past
        the `matched` tokens the tree holds: once that step is applied and the request finished,
        the tree may hold it, so `req` waits for it rather than computing it again."""
        upto = matched + self.page_size
        ids = req.all_ids[:upto]
        return len(req.all_ids) > upto and any(
            r.namespace == req.namespace and r.all_ids[:upto] == ids for r in launched)

    def _load_back(self, req: Req, match, budget: int, headroom: int) -> int | None:
        """Bring the L2 part of `match` back to L1 with room for the first chunk after it; extends
        req.slots and moves its lock. Returns the tokens loaded (0: none, the request recomputes
        them), or None when L1 has no room for them yet (the request waits)."""
        if not match.host_hit_tokens or req.load_back_failed:
            return 0
        first_chunk = self._chunk_len(req, budget, start=req.kv_len + match.host_hit_tokens)
        loaded = self.cache.load_back(match, -(-first_chunk // self.page_size) * self.page_size + headroom)
        if loaded.refused:
            return None if loaded.refused == "room" else 0
        req.last_node, req.slots = loaded.last_node, torch.cat([req.slots, loaded.device_slots])
        return loaded.device_slots.numel()

    def _add_chunk(self, plan: BatchPlan, req: Req, budget: int, allocated: bool = False,
                   start: int | None = None) -> int:
        """The request's next chunk, from `kv_len` (or `start`: where a launched, unapplied
        chunk ends; then memory is taken without retracting anyone)."""
        n = self._chunk_len(req, budget, start)
        if n <= 0:
            return 0
        if start is None:
            if not (allocated or self._make_room(req, req.kv_len + n)):
                return 0
            start = req.kv_len
        elif not self._ensure_slots(req, start + n):
            return 0
        plan.reqs.append(req)
        plan.starts.append(start)
        plan.extend_lens.append(n)
        plan.sample.append(start + n == req.seq_len)
        return n

    def _schedule_decode(self) -> BatchPlan | None:
        plan = BatchPlan("decode", [], [], [], [])
        for req in sorted(self.running, key=lambda r: r.arrival_seq):
            if (req in self.running and req.kv_len == req.seq_len - 1 and self._kv_ready(req)
                    and self._make_room(req, req.kv_len + 1)):
                plan.reqs.append(req)
                plan.starts.append(req.kv_len)
                plan.extend_lens.append(1)
                plan.sample.append(True)
        return plan if plan.reqs else None

    # ---- memory ----------------------------------------------------------------------------

    def _ensure_slots(self, req: Req, upto: int, headroom: int = 0) -> bool:
        """Grow req's slots to cover `upto` tokens (whole pages), evicting the tree if needed,
        keeping `headroom` tokens free for running requests. False when it cannot."""
        need = -(-upto // self.page_size) * self.page_size - req.slots.numel()
        if need <= 0:
            return True
        short = need + headroom - self.alloc.num_free_tokens()
        if short > 0:
            self.cache.evict_device(short)
            if need + headroom > self.alloc.num_free_tokens():
                return False
        new = self.alloc.alloc(need)
        self.req_table.write(req.row, req.slots.numel(), new)
        req.slots = torch.cat([req.slots, new])
        return True

    def _make_room(self, req: Req, upto: int) -> bool:
        """Like _ensure_slots for a running request, retracting the latest arrivals while short.
        False when `req` itself had to be retracted."""
        while not self._ensure_slots(req, upto):
            victim = max(self.running, key=lambda r: r.arrival_seq)
            self._retract(victim)
            if victim is req:
                return False
        return True

    def _release(self, req: Req, keep_kv: bool = True) -> None:
        """Give the cache what the request computed (page-aligned) and free everything else
        (`keep_kv=False`: cache nothing new, e.g. when its prefix was never loaded correctly)."""
        if req.last_node is None:
            return
        kv, ps = (req.kv_len if keep_kv else req.prefix_len), self.page_size
        present = self.cache.insert(req.all_ids[:kv], req.slots[:kv], req.namespace, len(req.input_ids)) if kv else 0
        taken_end = present if self.cache.disabled else kv // ps * ps
        self.alloc.free(req.slots[req.prefix_len:max(present, req.prefix_len)])
        self.alloc.free(req.slots[max(taken_end, req.prefix_len):])
        self.cache.unlock(req.last_node)
        if req.row is not None:
            self.req_table.free(req.row)
        req.row, req.last_node, req.slots = None, None, req.slots[:0]
        req.kv_len = req.prefix_len = 0
        req.wait_tickets = frozenset()

    def _retract(self, req: Req, keep_kv: bool = True) -> None:
        """Out of KV (or its load-back failed: `keep_kv=False`): put a running request back in the
        queue; it is recomputed later (its prefix likely still cached) and continues with the same
        outputs and sampler state."""
        logger.info("retracting %s to free KV memory", req)
        self.running.remove(req)
        self._release(req, keep_kv)
        self.counters["retractions"] += 1
        self.waiting.insert(0, req)
        self.waiting.sort(key=lambda r: r.arrival_seq)

    # ---- results ---------------------------------------------------------------------------

    def process_result(self, plan: BatchPlan, out: StepOutput) -> None:
        dropped = self._settle_loads(plan) if plan.kv_wait is not None else ()
        for i, req in enumerate(plan.reqs):
            if dropped and id(req) in dropped:  # it ran on a load that failed: recomputed later
                continue
            req.kv_len += plan.extend_lens[i]
            if plan.mode == "extend":
                self.counters["prompt_tokens"] += plan.extend_lens[i]
            token = out.next_ids[i]
            if token is None:
                continue
            req.output_ids.append(token)
            self.counters["generation_tokens"] += 1
            logprobs = [[out.logprobs[i], out.top_logprobs[i]]] if req.return_logprob else None
            reason = self.stop_checker.check(req, self.context_length)
            if reason is not None:
                self.running.remove(req)
                self._release(req, keep_kv=req.cache_kv)
                self.counters["requests_finished"] += 1
            self._emit(req, [token], reason, logprobs)

    def _settle_loads(self, plan: BatchPlan) -> set[int]:
        """Before a token sampled over loaded-back pages goes out, those loads must have landed (on
        CUDA they have: the pass waited for them and the sampler synced). A request whose load
        failed is retracted and recomputed; returns their ids, whose results are dropped (and
        whose sampler is rewound). So are those retracted while this plan was in flight (a step
        launched ahead of the one before it: that step's results reported their failed loads)."""
        if any(r.wait_tickets and s for r, s in zip(plan.reqs, plan.sample)):
            self.cache.settle_loads(frozenset().union(*(r.wait_tickets for r in plan.reqs)))
        dropped = {id(r) for r in self._poll_transfers()} | {id(r) for r in plan.reqs if not r.holds_kv}
        for req in plan.reqs:
            if id(req) in dropped and id(req) in plan.rng_states:
                req.generator.set_state(plan.rng_states[id(req)])
            elif id(req) not in dropped:
                self._kv_ready(req)
        return dropped

    def _finish(self, req: Req, reason: dict) -> None:
        self._emit(req, [], reason, None)

    def _emit(self, req: Req, new_ids: list[int], reason: dict | None, logprobs: list | None) -> None:
        cached, host, storage = req.cached_tokens or 0, req.cached_host, req.cached_storage
        details = {"device": cached - host - storage, "host": host, "storage": storage}
        meta = {"prompt_tokens": len(req.input_ids), "completion_tokens": len(req.output_ids),
                "cached_tokens": cached, "cached_tokens_details": details}
        self._outputs.append(TokenOutput(req.rid, new_ids, reason, meta, logprobs))

    # ---- introspection ---------------------------------------------------------------------

    def pages_held(self) -> int:
        """Device pages owned by requests (not by the tree, not free)."""
        return sum((r.slots.numel() - r.prefix_len) // self.page_size for r in self.running)

    def check_integrity(self) -> None:
        held = [r.slots[r.prefix_len:] for r in self.running]
        locks = collections.Counter(r.last_node for r in self.running)
        self.cache.check_integrity(torch.cat(held) if held else None, locks)
        assert self.req_table.num_free() + len(self.running) == self.rc.max_running_requests, "table rows leaked"

    def stats(self) -> dict:
        c = self.counters
        device = {"used_tokens": self.alloc.capacity_tokens() - self.alloc.num_free_tokens(),
                  "capacity_tokens": self.alloc.capacity_tokens(), "cached_tokens": self.tree.total_tokens(),
                  "hit_tokens": c["cached_device"], "evicted_tokens": self.cache.counters["device_evicted_tokens"],
                  "bytes_per_token": self.pool.bytes_per_token()}
        host = dict(self.cache.host_stats(), hit_tokens=c["cached_host"]) if self.cache.enabled else None
        storage = dict(self.storage.stats(), hit_tokens=c["cached_storage"]) if self.storage is not None else None
        empty = {"used_tokens": 0, "capacity_tokens": 0, "hit_tokens": 0, "evicted_tokens": 0, "enabled": False}
        return {"running": len(self.running), "queued": len(self.waiting), "pages_held": self.pages_held(),
                "page_size": self.page_size, "retractions": c["retractions"],
                "requests_finished": c["requests_finished"], "requests_aborted": c["requests_aborted"],
                "tiers": {"device": device, "host": host or dict(empty), "storage": storage or dict(empty)},
                "tokens": {"prompt": c["prompt_tokens"], "generation": c["generation_tokens"],
                           "cached": {"device": c["cached_device"], "host": c["cached_host"],
                                      "storage": c["cached_storage"]}}}
