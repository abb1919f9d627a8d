"""`Drafter`: the draft tokens of each request of a decode step (NGRAM), and when to draft none.

A request's draft is the continuation of the longest tail of its tokens that matched, in its own
prompt and output (`ContextNgrams`) or in the token sequences the radix tree holds
(`CacheManager.propose`); its own tokens win a tie. No drafts in a step of more than
`speculative_max_batch_size` requests, for a request whose grammar constrains its tokens or that
returns log-probs (those decode one token a step), nor past its length limits.

Back-off: a verify step of k drafts costs more than a decode step, so a request whose drafts are
mostly rejected stops drafting for a while: when the smoothed share of its draft tokens
accepted falls below `ACCEPT_FLOOR`, it sits out `backoff` steps, doubled at each consecutive
failure up to `MAX_BACKOFF`, and drafts again after that.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from hicache.runtime.spec.context import ContextNgrams

if TYPE_CHECKING:
    from hicache.manager import CacheManager
    from hicache.runtime.config import RuntimeConfig
    from hicache.runtime.counters import Counters
    from hicache.runtime.request import Req

ACCEPT_FLOOR = 0.25  # smoothed accepted / drafted below which a request backs off
SMOOTHING = 0.5  # weight of the latest verify step in the smoothed acceptance
MAX_BACKOFF = 64  # most decode steps a request sits out in a row


class SpecState:
    """A request's drafting state: its own n-grams, its smoothed acceptance, its back-off, and
    its drafts verified and draft tokens accepted so far."""

    __slots__ = ("context", "acceptance", "skip", "backoff", "verified", "accepted")

    def __init__(self, min_window: int, max_window: int):
        self.context = ContextNgrams(min_window, max_window)
        self.acceptance = 1.0
        self.skip = 0  # decode steps left without drafts
        self.backoff = 1  # steps to sit out at the next failure
        self.verified = self.accepted = 0

    def record(self, drafted: int, accepted: int) -> None:
        self.verified += 1
        self.accepted += accepted
        self.acceptance = (1 - SMOOTHING) * self.acceptance + SMOOTHING * accepted / drafted
        if self.acceptance >= ACCEPT_FLOOR:
            self.backoff = 1
            return
        self.skip, self.backoff = self.backoff, min(2 * self.backoff, MAX_BACKOFF)
        self.acceptance = ACCEPT_FLOOR  # a retry that is accepted lifts it at once


class Drafter:
    def __init__(self, rc: RuntimeConfig, cache: CacheManager, counters: Counters, context_length: int):
        self.cache, self.counters, self.context_length = cache, counters, context_length
        self.num_draft_tokens = rc.speculative_num_draft_tokens
        self.max_batch_size = rc.speculative_max_batch_size
        self.windows = (rc.speculative_ngram_min_match_window_size, rc.speculative_ngram_max_match_window_size)
        counters.spec_lengths(self.num_draft_tokens)

    def drafts_batch(self, batch: int) -> bool:
        """Whether a decode step of `batch` requests drafts."""
        return batch <= self.max_batch_size

    def draft(self, req: Req) -> list[int]:
        """Draft tokens to verify after `req`'s last token (empty: it decodes one token)."""
        n = self._room(req)
        if n <= 0 or req.grammar is not None or req.return_logprob or req.top_logprobs_num:
            return []
        if req.spec is None:
            req.spec = SpecState(*self.windows)
        state = req.spec
        if state.skip:
            state.skip -= 1
            return []
        tokens = req.all_ids
        own = state.context.propose(tokens, n)
        cached = self.cache.propose(tokens, req.namespace, n)
        return (cached if cached.window > own.window else own).tokens

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
