"""`DraftModel`: STANDALONE drafts, a smaller model with the target's vocabulary decoding a
request's next tokens greedily (a deterministic draft: `verify.py` accepts or rejects each token
as it does NGRAM's, so greedy outputs are unchanged and sampled ones keep the target's
distribution).

Its KV lives apart from the target's: a pool of its own, with its own allocator and
request-to-token table, under a `CacheManager` of its own whose radix tree caches the draft's KV
of the prefixes it computed, keyed by the same token ids and namespaces (cache salt, adapter) as
the target's tree. A tree of its own rather than the target's tree under another namespace: a
tree's nodes hold slots of one allocator, and evicting, backing up to L2 / L3 or loading back
a node assumes the target's page layout; the draft's pages would need every tier to tell two
pools apart, for KV that is cheap to recompute.

Each drafting request has a shadow `Req` on that cache (`SpecState.shadow`): the request's
prompt and output followed by its drafts, `kv_len` of them computed by the draft model. Before
it drafts, the shadow is cut to what it shares with the request (rejected drafts go: their KV is
freed, never cached); it catches up in one extend pass over the tokens the draft has not
computed (a cached prefix of its tree first), whose last position gives the first draft token,
then decodes one pass a token. When its request leaves the running set (finished, aborted,
retracted), the shadow gives its tree what it computed of the request's tokens.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from hicache.runtime.batch import BatchPlan
from hicache.runtime.request import Req

if TYPE_CHECKING:
    from hicache.manager import CacheManager
    from hicache.runtime.runner import ModelRunner


class DraftModel:
    def __init__(self, runner: ModelRunner, cache: CacheManager, rows: int):
        """`runner`: the draft model's, over its pool and table; `cache`: over its tree and
        table; `rows`: the table's rows in all."""
        self.runner, self.cache, self.rows = runner, cache, rows

    def draft(self, reqs: list[Req], lengths: list[int]) -> list[list[int]]:
        """Per request, `lengths[i]` greedy draft tokens after its tokens (none where 0, or where
        the draft's pool has no room for them)."""
        out: list[list[int]] = [[] for _ in reqs]
        active = [(i, s, n) for i, n in enumerate(lengths)
                  if n > 0 and (s := self._ready(reqs[i], n)) is not None]
        if not active:
            return out
        plan = BatchPlan("extend", [], [], [], [])
        for _, s, _ in active:
            plan.add(s, s.kv_len, s.seq_len - s.kv_len, True)
        for step in range(max(n for _, _, n in active)):
            for (i, s, _), token in zip(active, self._greedy(plan)):
                s.kv_len = s.seq_len
                s.output_ids.append(token)
                out[i].append(token)
            active = [a for a in active if a[2] > step + 1]
            plan = BatchPlan("decode", [s for _, s, _ in active], [s.kv_len for _, s, _ in active],
                             [1] * len(active), [True] * len(active))
        return out

    def _greedy(self, plan: BatchPlan) -> list[int]:
        _, logits = self.runner.forward(plan)
        return logits.argmax(dim=-1).tolist()

    def _ready(self, req: Req, n: int) -> Req | None:
        """`req`'s shadow, cut to the tokens it shares with `req`, holding a table row and slots
        for its tokens and `n` - 1 drafts after them; None when the draft's pool or table is full."""
        s = req.spec.shadow
        if s is None:
            s = req.spec.shadow = Req(req.rid, req.input_ids, req.params, req.namespace, None, False, 0)
        self._sync(req, s)
        if not s.lease.held:
            match = self.cache.match(s.all_ids[:s.seq_len - 1], s.namespace)
            admitted = self.cache.admit(s.lease, match, 0, load=False)
            if admitted is None:
                return None
            s.kv_len = admitted.prefix
        if not self.cache.grow(s.lease, s.seq_len + n - 1):
            return None
        return s

    def _sync(self, req: Req, s: Req) -> None:
        """The shadow's tokens become `req`'s; of its KV, that of the tokens they share is kept."""
        s.kv_len = min(s.kv_len, _shared(s.all_ids, req.all_ids, s.kv_len), req.seq_len - 1)
        s.output_ids = list(req.output_ids)
        if s.lease.held:
            self.cache.shrink(s.lease, s.kv_len)

    def verified(self, req: Req) -> None:
        """A verify step kept `req.kv_len` of its tokens: the draft's KV past them is freed."""
        s = req.spec.shadow
        if s is not None and s.lease.held and s.kv_len > req.kv_len:
            s.kv_len = req.kv_len
            self.cache.shrink(s.lease, s.kv_len)

    def release(self, req: Req) -> None:
        """`req` leaves the running set: its shadow gives the draft's tree the KV it computed
        of `req`'s tokens and frees the rest."""
        s = req.spec.shadow if req.spec is not None else None
        if s is None or not s.lease.held:
            return
        self._sync(req, s)
        self.cache.release(s.lease, s.all_ids[:s.kv_len], len(s.input_ids), req.cache_kv)
        s.kv_len = 0

    def check_integrity(self, reqs: list[Req]) -> None:
        """The draft's cache: every slot free, held by one running request's shadow or owned by
        one node; every table row free or held by one shadow."""
        shadows = [r.spec.shadow for r in reqs if r.spec is not None and r.spec.shadow is not None]
        self.cache.check_integrity([s.lease for s in shadows if s.lease.held], self.rows)

    def flush(self) -> bool:
        return self.cache.flush()


def _shared(a: list[int], b: list[int], n: int) -> int:
    """How many of the first `n` tokens of `a` and `b` are equal, before the first that differs."""
    n = min(n, len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i in range(n) if a[i] != b[i])
