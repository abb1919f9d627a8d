"""`Drafter`: the draft tokens of each request of a decode step, and how many of them to verify.

NGRAM: a request's proposal is the continuation of the longest tail of its tokens that matched,
in its own prompt and output (`ContextNgrams`) or in the token sequences the radix tree holds
(`CacheManager.propose`); its own tokens win a tie. STANDALONE: the draft model (`DraftModel`)
decodes as many tokens as `fit` gives the request, after the fit (its drafts are not known before
they are computed). None in a step of more than `speculative_max_batch_size` requests, for a
request whose grammar constrains its tokens or that returns log-probs (those decode one token a
step), nor past its length limits.

How many draft tokens a step verifies (`fit`) is a cost decision, on costs measured
while serving: a step of n tokens costs what whole steps of n tokens (planning, drafting, the
forward pass, verification and output processing) were measured to cost (`StepCosts`,
interpolated between the sizes measured), and request i's j-th draft token is expected to be
accepted with probability a_i ** j, a_i its smoothed share of draft tokens accepted
(`SpecState.rate`, which starts from and fades back to the server's recent share). Adding draft
tokens in the order of their expected gain, the step verifies the prefix of that order that gives
the most expected tokens per second; none when plain decoding gives more. So a request whose
drafts are rejected stops drafting, large batches (compute-bound: a rejected token costs as much as
a kept one) draft little, and as a request's record fades between verifications
(`SpecState.fade`) it is tried again. What verify steps of a batch's size actually gave is
measured too (`VerifyYields`: seconds per token emitted, over the latest few): while that is
worse than a plain decode step of that size, steps of that size do not draft, and they try again
once the measure is `REFRESH` steps old.
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
    from hicache.runtime.spec.draft_model import DraftModel

DECAY = 0.8  # weight of a request's earlier draft outcomes at each verify step
SERVER_DECAY = 0.99  # the same for the server's share of draft tokens accepted, a new request's prior
FADE = 0.95  # the same at each decode step it verifies no draft
COST_SMOOTHING = 0.3  # weight of the latest measurement of a step size's seconds
REFRESH = 64  # steps after which the cost of a plain decode step of a batch's size is measured again
YIELD_DECAY = 0.8  # weight of a batch size's earlier verify steps at each of its verify steps
YIELD_EVIDENCE = 4  # verify steps of a batch size measured before their yield may stop its drafts


class SpecState:
    """A request's drafting state: its own n-grams (NGRAM) or its shadow on the draft model's
    cache (STANDALONE, `DraftModel`), its smoothed counts of draft tokens accepted and of
    rejections, and its drafts verified and draft tokens accepted so far."""

    __slots__ = ("context", "shadow", "hits", "misses", "verified", "accepted")

    def __init__(self, min_window: int, max_window: int):
        self.context = ContextNgrams(min_window, max_window)
        self.shadow: Req | None = None
        self.hits = self.misses = 0.0
        self.verified = self.accepted = 0

    def rate(self, prior: float = 0.5) -> float:
        """The chance that a draft token is accepted once those before it were (`prior` with no
        record, as though it had two outcomes at that rate)."""
        return (self.hits + 2 * prior) / (self.hits + self.misses + 2)

    def record(self, drafted: int, accepted: int) -> None:
        self.hits = DECAY * self.hits + accepted
        self.misses = DECAY * self.misses + (accepted < drafted)
        self.verified += 1
        self.accepted += accepted

    def fade(self) -> None:
        self.hits *= FADE
        self.misses *= FADE


class StepCosts:
    """Smoothed seconds by size (of decode and verify steps: the tokens they computed; `estimate`:
    also of sizes not measured yet); a size last measured `REFRESH` steps or more ago is `stale`.
    `tick()` counts a step."""

    def __init__(self):
        self._seconds: dict[int, float] = {}
        self._measured: dict[int, int] = {}  # size -> the step count at its last measurement
        self._steps = 0

    def tick(self) -> None:
        self._steps += 1

    def record(self, tokens: int, seconds: float) -> None:
        old = self._seconds.get(tokens)
        self._seconds[tokens] = seconds if old is None else (1 - COST_SMOOTHING) * old + COST_SMOOTHING * seconds
        self._measured[tokens] = self._steps

    def stale(self, tokens: int) -> bool:
        return self._steps - self._measured.get(tokens, -REFRESH) >= REFRESH

    def measured(self, tokens: int) -> float | None:
        """The seconds of size `tokens`, while not stale."""
        return None if self.stale(tokens) else self._seconds.get(tokens)

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


class VerifyYields:
    """What verify steps gave, by batch size: their seconds and the tokens they emitted (sums
    decayed by YIELD_DECAY at each verify step of that size), how many were measured, and when
    the latest was (steps counted by `tick()`)."""

    def __init__(self):
        self._sums: dict[int, list[float]] = {}  # batch -> [seconds, tokens, verify steps, step of the latest]
        self._steps = 0

    def tick(self) -> None:
        self._steps += 1

    def record(self, batch: int, seconds: float, tokens: int) -> None:
        s = self._sums.setdefault(batch, [0.0, 0.0, 0, 0])
        s[0], s[1] = YIELD_DECAY * s[0] + seconds, YIELD_DECAY * s[1] + tokens
        s[2] += 1
        s[3] = self._steps

    def seconds_per_token(self, batch: int) -> float | None:
        """Of verify steps of `batch` requests; None with fewer than YIELD_EVIDENCE measured, or
        the latest `REFRESH` steps ago or more."""
        s = self._sums.get(batch)
        if s is None or s[2] < YIELD_EVIDENCE or self._steps - s[3] >= REFRESH:
            return None
        return s[0] / s[1]

    def clear(self) -> None:
        self._sums.clear()


class Drafter:
    def __init__(self, rc: RuntimeConfig, cache: CacheManager, counters: Counters, context_length: int,
                 model: DraftModel | None = None):
        """`model`: STANDALONE's draft model (None: NGRAM)."""
        self.cache, self.counters, self.context_length, self.model = cache, counters, context_length, model
        self.num_draft_tokens = rc.speculative_num_draft_tokens
        self.max_batch_size = rc.speculative_max_batch_size
        self.windows = (rc.speculative_ngram_min_match_window_size, rc.speculative_ngram_max_match_window_size)
        self.costs = StepCosts()  # seconds of a step by the tokens it computed
        self.yields = VerifyYields()
        self._hits = self._misses = 0.0  # the server's draft outcomes, decayed by SERVER_DECAY
        self._accepted = 0  # draft tokens accepted in the step being applied
        counters.spec_lengths(self.num_draft_tokens)

    @property
    def prior(self) -> float:
        """The server's recent share of draft tokens accepted: where a request's rate starts."""
        return (self._hits + 1) / (self._hits + self._misses + 2)

    def drafts_batch(self, batch: int) -> bool:
        """Whether a decode step of `batch` requests drafts."""
        return batch <= self.max_batch_size

    def drafts(self, reqs: list[Req]) -> list[list[int]]:
        """Per request of a decode step, the draft tokens to verify after its last token (empty:
        it decodes one token), cut to what pays (`fit`)."""
        proposed = [self._propose(r) for r in reqs]
        prior = self.prior
        lengths = self.fit([r.spec.rate(prior) if r.spec is not None else 0.0 for r in reqs],
                           [len(p) if p is not None else self._room(r) for r, p in zip(reqs, proposed)])
        drafts = self.model.draft(reqs, lengths) if self.model is not None else \
            [p[:n] for p, n in zip(proposed, lengths)]
        for req, draft in zip(reqs, drafts):
            if req.spec is not None and not draft:
                req.spec.fade()
        return drafts

    def _propose(self, req: Req) -> list[int] | None:
        """NGRAM's proposal for `req` (empty: it does not draft); None: the draft model's, not
        computed yet."""
        n = self._room(req)
        if n <= 0 or req.grammar is not None or req.return_logprob or req.top_logprobs_num:
            return []
        if req.spec is None:
            req.spec = SpecState(*self.windows)
        if self.model is not None:
            return None
        tokens = req.all_ids
        own = req.spec.context.propose(tokens, n)
        cached = self.cache.propose(tokens, req.namespace, n)
        return (cached if cached.window > own.window else own).tokens

    def fit(self, rates: list[float], lengths: list[int]) -> list[int]:
        """How many of its `lengths[i]` proposed tokens request i verifies: see the module
        docstring. None while plain decode steps of this batch's size were not measured lately
        (this step measures one), nor while verify steps of this size lately gave fewer tokens
        a second than plain ones."""
        batch = len(lengths)
        taken = [0] * batch
        if self.costs.stale(batch):
            return taken
        base = self.costs.estimate(batch)
        verified = self.yields.seconds_per_token(batch)
        if not any(lengths) or (verified is not None and verified > base / batch):
            return taken
        gains = [(-rates[i], i) for i, n in enumerate(lengths) if n]
        heapq.heapify(gains)
        tokens, expected = batch, float(batch)
        best, best_taken = expected / base, list(taken)
        while gains:
            gain, i = heapq.heappop(gains)
            taken[i] += 1
            tokens, expected = tokens + 1, expected - gain
            if taken[i] < lengths[i]:
                heapq.heappush(gains, (-rates[i] ** (taken[i] + 1), i))
            rate = expected / self.costs.estimate(tokens)
            if rate > best:
                best, best_taken = rate, list(taken)
        return best_taken

    def timed(self, plan: BatchPlan, seconds: float) -> None:
        """A decode or verify step `plan` took `seconds` to plan, run and apply."""
        if plan.mode not in ("decode", "verify"):
            return
        self.costs.tick()
        self.yields.tick()
        self.costs.record(sum(plan.extend_lens), seconds)
        if plan.mode == "verify":
            self.yields.record(len(plan.reqs), seconds, len(plan.reqs) + self._accepted)
        self._accepted = 0

    def reset(self) -> None:
        """Forgets what steps taught it: their costs and yields, and the server's acceptance."""
        self.costs.clear()
        self.yields.clear()
        self._hits = self._misses = 0.0

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
        self._accepted += accepted
        self._hits = SERVER_DECAY * self._hits + accepted
        self._misses = SERVER_DECAY * self._misses + (accepted < drafted)
        req.spec.record(drafted, accepted)
        if self.model is not None:
            self.model.verified(req)

    def release(self, req: Req) -> None:
        """`req` leaves the running set (finished, aborted or retracted): what the draft model
        holds for it goes."""
        if self.model is not None:
            self.model.release(req)

    def check_integrity(self, reqs: list[Req]) -> None:
        """The draft model's cache, where there is one (`DraftModel.check_integrity`)."""
        if self.model is not None:
            self.model.check_integrity(reqs)

    def flush(self) -> bool:
        """Empties the draft model's cache, where there is one; False while transfers are in flight."""
        return self.model is None or self.model.flush()
