"""`Drafter`: the draft tokens of each request of a decode step (NGRAM), and how many of them to verify.

A request's proposal is the continuation of the longest tail of its tokens that matched, in its
own prompt and output (`ContextNgrams`) or in the token sequences the radix tree holds
(`CacheManager.propose`); its own tokens win a tie. None in a step of more than
`speculative_max_batch_size` requests, for a request whose grammar constrains its tokens or that
returns log-probs (those decode one token a step), nor past its length limits.

How many of the proposed tokens a step verifies (`fit`) is a cost decision: a verify step of n
tokens costs what steps of n tokens were measured to cost (`StepCosts`, interpolated between
the sizes measured), and request i's j-th
draft token is expected to be accepted with probability a_i ** j, a_i its smoothed share of draft
tokens accepted (`SpecState.rate`). Adding draft tokens in the order of their expected gain, the
step verifies the prefix of that order that gives the most expected tokens per second; none when
plain decoding gives more. So a request whose drafts are rejected stops drafting, large batches
(compute-bound: a rejected token costs as much as a kept one) draft little, and as a request's
record fades between verifications (`SpecState.fade`) it is tried again.
"""
from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from hicache.runtime.spec.context import ContextNgrams

if TYPE_CHECKING:
    from hicache.manager import CacheManager
    from hicache.runtime.batch import BatchPlan
    from hicache.runtime.config import RuntimeConfig
    from hicache.runtime.counters import Counters
    from hicache.runtime.request import Req

DECAY = 0.8  # weight of a request's earlier draft outcomes at each verify step
FADE = 0.95  # the same at each decode step it verifies no draft
COST_SMOOTHING = 0.3  # weight of the latest measurement of a step size's seconds
REFRESH = 64  # steps after which the cost of a plain decode step of a batch's size is measured again


class SpecState:
    """A request's drafting state: its own n-grams, its smoothed counts of draft tokens accepted
    and of rejections, and its drafts verified and draft tokens accepted so far."""

    __slots__ = ("context", "hits", "misses", "verified", "accepted")

    def __init__(self, min_window: int, max_window: int):
        self.context = ContextNgrams(min_window, max_window)
        self.hits = self.misses = 0.0
        self.verified = self.accepted = 0

    @property
    def rate(self) -> float:
        """The chance that a draft token is accepted once those before it were (1/2 with no record)."""
        return (self.hits + 1) / (self.hits + self.misses + 2)

    def record(self, drafted: int, accepted: int) -> None:
        self.hits = DECAY * self.hits + accepted
        self.misses = DECAY * self.misses + (accepted < drafted)
        self.verified += 1
        self.accepted += accepted

    def fade(self) -> None:
        self.hits *= FADE
        self.misses *= FADE


class StepCosts:
    """Smoothed seconds of decode and verify steps by the tokens they computed (`estimate`: also
    of sizes not measured yet); a size last measured more than `REFRESH` steps ago is `stale`."""

    def __init__(self):
        self._seconds: dict[int, float] = {}
        self._measured: dict[int, int] = {}  # size -> the step count at its last measurement
        self._steps = 0

    def record(self, tokens: int, seconds: float) -> None:
        old = self._seconds.get(tokens)
        self._seconds[tokens] = seconds if old is None else (1 - COST_SMOOTHING) * old + COST_SMOOTHING * seconds
        self._steps += 1
        self._measured[tokens] = self._steps

    def stale(self, tokens: int) -> bool:
        return self._steps - self._measured.get(tokens, -REFRESH) >= REFRESH

    def clear(self) -> None:
        self._seconds.clear()
        self._measured.clear()

    def estimate(self, tokens: int) -> float | None:
        """Between two measured sizes, the line between them; past the largest (or below the
        smallest), that size's seconds: an optimistic guess, which gets tried and measured."""
        if tokens in self._seconds:
            return self._seconds[tokens]
        below = max((n for n in self._seconds if n < tokens), default=None)
        above = min((n for n in self._seconds if n > tokens), default=None)
        if below is None or above is None:
            return None if below is None and above is None else self._seconds[below if above is None else above]
        lo, hi = self._seconds[below], self._seconds[above]
        return lo + (hi - lo) * (tokens - below) / (above - below)


class Drafter:
    def __init__(self, rc: RuntimeConfig, cache: CacheManager, counters: Counters, context_length: int):
        self.cache, self.counters, self.context_length = cache, counters, context_length
        self.num_draft_tokens = rc.speculative_num_draft_tokens
        self.max_batch_size = rc.speculative_max_batch_size
        self.windows = (rc.speculative_ngram_min_match_window_size, rc.speculative_ngram_max_match_window_size)
        self.costs = StepCosts()
        counters.spec_lengths(self.num_draft_tokens)

    def drafts_batch(self, batch: int) -> bool:
        """Whether a decode step of `batch` requests drafts."""
        return batch <= self.max_batch_size

    def drafts(self, reqs: list[Req]) -> list[list[int]]:
        """Per request of a decode step, the draft tokens to verify after its last token (empty:
        it decodes one token), cut to what pays (`fit`)."""
        proposed = [self._propose(r) for r in reqs]
        fitted = self.fit([r.spec.rate if r.spec is not None else 0.0 for r in reqs], proposed)
        for req, draft in zip(reqs, fitted):
            if req.spec is not None and not draft:
                req.spec.fade()
        return fitted

    def _propose(self, req: Req) -> list[int]:
        n = self._room(req)
        if n <= 0 or req.grammar is not None or req.return_logprob or req.top_logprobs_num:
            return []
        if req.spec is None:
            req.spec = SpecState(*self.windows)
        tokens = req.all_ids
        own = req.spec.context.propose(tokens, n)
        cached = self.cache.propose(tokens, req.namespace, n)
        return (cached if cached.window > own.window else own).tokens

    def fit(self, rates: list[float], proposed: list[list[int]]) -> list[list[int]]:
        """The prefix of each proposal to verify: see the module docstring. None while plain
        decode steps of this batch's size were not measured lately (this step measures one)."""
        if self.costs.stale(len(proposed)):
            return [[] for _ in proposed]
        base = self.costs.estimate(len(proposed))
        if not any(proposed):
            return proposed
        taken = [0] * len(proposed)
        gains = [(-rates[i], i) for i, d in enumerate(proposed) if d]
        heapq.heapify(gains)
        tokens, expected = len(proposed), float(len(proposed))
        best, best_taken = expected / base, list(taken)
        while gains:
            gain, i = heapq.heappop(gains)
            taken[i] += 1
            tokens, expected = tokens + 1, expected - gain
            if taken[i] < len(proposed[i]):
                heapq.heappush(gains, (-rates[i] ** (taken[i] + 1), i))
            rate = expected / self.costs.estimate(tokens)
            if rate > best:
                best, best_taken = rate, list(taken)
        return [d[:k] for d, k in zip(proposed, best_taken)]

    def timed(self, plan: BatchPlan, seconds: float) -> None:
        """A decode or verify step `plan` took `seconds` to run."""
        if plan.mode in ("decode", "verify"):
            self.costs.record(sum(plan.extend_lens), seconds)

    def _room(self, req: Req) -> int:
        """Drafts that fit: the step emits them and one token more, within `max_new_tokens` and the context."""
        left = min(req.params.max_new_tokens - len(req.output_ids), self.context_length - req.seq_len)
        return min(self.num_draft_tokens, left - 1)

    def record(self, req: Req, drafted: int, accepted: int) -> None:
        """A verify step accepted `accepted` of `req`'s `drafted` draft tokens."""
        self.counters["spec_drafts"] += 1
        self.counters["spec_draft_tokens"] += drafted
        self.counters["spec_accepted_tokens"] += accepted
        self.counters[f"spec_accepted_{accepted}"] += 1
        req.spec.record(drafted, accepted)
