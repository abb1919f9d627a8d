"""`BudgetPolicy`: the scheduler's budget decisions, apart from its bookkeeping.

How many prompt tokens a step may take (`max_prefill_tokens`) and a request may take in one step
(`chunked_prefill_size`), how much of a step the chunks of running prompts may take beside short
waiting prompts and decoding requests, how many requests run together, in which order waiting
requests are considered (`schedule_policy`), which request is retracted when L1 runs out, and how much of L1
one prefill step may hold when steps are launched ahead with an L2 to load back from, and which
requests sit out a prefill step while their prefix loads back.
"""
from __future__ import annotations

from typing import Callable, Sequence

from hicache.runtime.config import RuntimeConfig
from hicache.runtime.request import Req, Status

# a request waits for another's prefill only to save at least this many tokens of its own
SHARED_PREFILL_MIN = 64
# Of a running request's output still to come, the share an admission keeps room for when the
# request may stop early (EOS, stop strings), and at most this many tokens of it (as SGLang).
NEW_TOKEN_RATIO, NEW_TOKENS_CLIP = 0.5, 4096
PREFILL_TOKENS_CUDA, PREFILL_TOKENS_CPU = 8192, 256  # max_prefill_tokens's auto values
# On CPU (max_prefill_tokens auto), the running prompts' chunks of a step while short prompts
# wait or other requests decode beside them
PREFILL_TOKENS_CPU_SHARED = 64


class BudgetPolicy:
    def __init__(self, rc: RuntimeConfig, page_size: int, l1_tokens: int, prefill_ahead: bool, has_host_tier: bool,
                 cuda: bool = False):
        self.page_size = page_size
        self.decode_while_loading = rc.features(cuda).decode_while_loading
        self.max_prefill_tokens = rc.max_prefill_tokens or (PREFILL_TOKENS_CUDA if cuda else PREFILL_TOKENS_CPU)
        self.shared_prefill_tokens = None if rc.max_prefill_tokens or cuda else PREFILL_TOKENS_CPU_SHARED
        self.max_running = rc.max_running_requests
        self.max_adapters = rc.max_loras_per_batch
        self.chunk_size = rc.chunked_prefill_size
        self.order_by_match = rc.schedule_policy == "lpm"
        self.conservativeness = rc.schedule_conservativeness
        # With prefill steps launched ahead and an L2: the KV that one step's requests may hold
        # together past the first (None: no cap), so that the next step's load-backs find room
        # in L1, and start, while it runs.
        share = rc.prefill_ahead_l1_share
        self.step_kv_cap = int(l1_tokens * share) if prefill_ahead and has_host_tier and share < 1 else None

    def chunk_len(self, req: Req, budget: int, start: int | None = None) -> int:
        """Prompt tokens of `req`'s next chunk from `start` (default: its computed KV) within `budget`."""
        n = min(req.seq_len - (req.kv_len if start is None else start), budget)
        return min(n, self.chunk_size) if self.chunk_size > 0 else n

    def running_share(self, budget: int, waiting: Sequence[Req], running: Sequence[Req]) -> int:
        """Of a prefill step's `budget`, the prompt tokens the running requests' next chunks may
        take: less half of it while a waiting request's whole prompt fits in that half, so that
        a short prompt is not queued behind every chunk of a long one; on CPU, at most
        `shared_prefill_tokens` while such a prompt waits or running requests decode (they join
        the step): each step delays them by what its chunks take."""
        half = budget // 2
        short = any(0 < r.prompt_left <= half for r in waiting)
        share = budget - half if short else budget
        if self.shared_prefill_tokens is not None and (short or any(r.phase is Status.DECODE for r in running)):
            share = min(share, self.shared_prefill_tokens)
        return share

    def order(self, waiting: Sequence[Req], cached_tokens: Callable[[Req], int] | None) -> list[Req]:
        """Waiting requests in the order admission considers them: arrival (fcfs), or the longest
        cached prefix first (lpm; `cached_tokens` None when nothing is cached)."""
        if not self.order_by_match or cached_tokens is None:
            return list(waiting)
        matched = {id(r): cached_tokens(r) for r in waiting}
        return sorted(waiting, key=lambda r: (-matched[id(r)], r.arrival_seq))

    def admits_more(self, running: int) -> bool:
        return running < self.max_running

    def adapter_fits(self, req: Req, running: Sequence[Req]) -> bool:
        """Whether admitting `req` keeps the running requests' distinct LoRA adapters (one batch's)
        within `max_loras_per_batch`."""
        if req.adapter is None:
            return True
        adapters = {id(r.adapter) for r in running if r.adapter is not None}
        return id(req.adapter) in adapters or len(adapters) < self.max_adapters

    def over_step_cap(self, planned_kv: int, req: Req) -> bool:
        """True when adding `req` to a step whose requests hold `planned_kv` tokens (at least one
        request) would pass the step's share of L1."""
        return self.step_kv_cap is not None and planned_kv > 0 and planned_kv + req.seq_len > self.step_kv_cap

    def decode_headroom(self, running: Sequence[Req], launched: bool, admitting: Req | None = None) -> int:
        """L1 tokens an admission leaves free: at least a page for the next token of each decoding
        request (with a launched prefill step, all running requests decode next), and the output
        the running requests and `admitting` will still produce (`future_tokens`), so that the
        requests admitted can finish without retracting one another."""
        decoding = len(running) if launched else sum(1 for r in running if r.phase is Status.DECODE)
        future = sum(self.future_tokens(r) for r in (*running, *((admitting,) if admitting else ())))
        return max(self.page_size * decoding, future)

    def future_tokens(self, req: Req) -> int:
        """The L1 tokens `req`'s output still to come is expected to take, in whole pages: all of it
        when its length is certain (ignore_eos, no stop strings), else NEW_TOKEN_RATIO of it (at
        most NEW_TOKENS_CLIP), times `schedule_conservativeness`."""
        left = req.params.max_new_tokens - len(req.output_ids)
        if left <= 0 or self.conservativeness == 0:
            return 0
        certain = req.params.ignore_eos and not req.params.stop
        expected = left if certain else min(left, NEW_TOKENS_CLIP) * NEW_TOKEN_RATIO
        return -(-int(expected * self.conservativeness) // self.page_size) * self.page_size

    def parks(self, req: Req, running: Sequence[Req]) -> bool:
        """Whether `req`, whose prefix a load-back is still copying into L1, sits out the next step:
        while some running request decodes, the copy lands beside the decode steps
        (the copy engines take no SM from them) instead of holding a prefill step, and every
        decoding request with it, until its layers have arrived."""
        return (self.decode_while_loading and req.status is Status.LOADING
                and any(r.status is Status.DECODE for r in running if r is not req))

    def parked(self, running: Sequence[Req], plan) -> bool:
        """Whether a running request outside `plan` (a `BatchPlan` or None) sits out while its load
        lands: no forward pass paces that load's copies, so they go out whole."""
        planned = {id(r) for r in plan.reqs} if plan is not None else set()
        return any(self.parks(r, running) for r in running if id(r) not in planned)

    def wait_for_launched(self, req: Req, matched: int, launched: Sequence[Req]) -> bool:
        """True when a request of a launched, unapplied step shares at least a page of `req`'s
        prompt past the `matched` tokens the tree holds: once that step is applied and the request
        finished, the tree may hold it, so `req` waits for it rather than computing it again."""
        return any(self._shared(req, matched, r) >= self.page_size for r in launched)

    def prefill_leaders(self, req: Req, matched: int, prefilling: list[Req]) -> list[Req]:
        """The requests still computing their prompts that share most of what `req` would compute
        (past the `matched` tokens the tree holds; at least `SHARED_PREFILL_MIN` tokens). `req`
        waits for them rather than computing the same tokens beside them: once computed, they
        publish their prompts (`CacheManager.publish`)."""
        own = req.prefix_limit - matched
        need = max(SHARED_PREFILL_MIN, own // 2)
        return [r for r in prefilling if self._shared(req, matched, r) >= need] if own >= need else []

    def _shared(self, req: Req, matched: int, other: Req) -> int:
        """How many tokens past `matched` `req`'s tokens share with `other`'s, whole pages (a
        binary search over slice comparisons)."""
        if other.namespace != req.namespace:
            return 0
        mine, theirs, ps = req.all_ids, other.all_ids, self.page_size
        lo, hi = matched // ps, min(len(mine), len(theirs)) // ps  # pages: lo shared (cached), hi at most
        if hi <= lo or mine[lo * ps:(lo + 1) * ps] != theirs[lo * ps:(lo + 1) * ps]:
            return 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if mine[:mid * ps] == theirs[:mid * ps] else (lo, mid - 1)
        return lo * ps - matched

    @staticmethod
    def victim(running: Sequence[Req]) -> Req:
        """The request retracted when L1 runs out: the latest arrival, not one whose prompt's KV
        is on its way from a prefill server (that KV is sent once) unless no other runs."""
        settled = [r for r in running if r.incoming is None]
        return max(settled or running, key=lambda r: r.arrival_seq)
