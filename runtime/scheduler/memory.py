"""`Memory`: what running requests hold of L1, grown, given back or taken away.

Shared by the planners (room for the next chunk or token) and the output processor (a finished
request's release, a failed load-back's retraction). Every call into the cache goes through the
`CacheManager`; the retraction victim is the `BudgetPolicy`'s. With speculative decoding, a
request's release also releases what the `Drafter` holds for it (a draft model's KV).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hicache.manager import CacheManager
    from hicache.runtime.counters import Counters
    from hicache.runtime.policy import BudgetPolicy
    from hicache.runtime.request import Req
    from hicache.runtime.scheduler.queue import QueueState
    from hicache.runtime.spec.drafter import Drafter

logger = logging.getLogger(__name__)


class Memory:
    def __init__(self, queue: QueueState, cache: CacheManager, policy: BudgetPolicy, counters: Counters,
                 drafter: Drafter | None = None):
        self.queue, self.cache, self.policy, self.counters = queue, cache, policy, counters
        self.drafter = drafter

    def make_room(self, req: Req, upto: int) -> bool:
        """Grows a running request's slots to `upto` tokens, retracting the policy's victims while
        short. False when `req` itself had to be retracted."""
        while not self.cache.grow(req.lease, upto):
            victim = self.policy.victim(self.queue.running)
            self.retract(victim)
            if victim is req:
                return False
        return True

    def trim(self, req: Req) -> None:
        """Frees the slots a running request holds past the page of the token it computes next,
        at `kv_len` (KV of rejected draft tokens, `CacheManager.shrink`)."""
        self.cache.shrink(req.lease, req.kv_len + 1)

    def release(self, req: Req, keep_kv: bool = True) -> None:
        """Gives the cache what the request computed (`keep_kv=False`: nothing new, e.g. when its
        prefix was never loaded correctly) and frees the rest."""
        self.cache.release(req.lease, req.all_ids[:req.kv_len], len(req.input_ids), keep_kv)
        req.kv_len = 0
        if self.drafter is not None:
            self.drafter.release(req)

    def retract(self, req: Req, keep_kv: bool = True) -> None:
        """Out of KV (or its load-back failed: `keep_kv=False`): put a running request back in the
        queue; it is recomputed later (its prefix likely still cached) and continues with the same
        outputs and sampler state."""
        logger.info("retracting %s to free KV memory", req)
        self.queue.requeue(req)
        self.release(req, keep_kv)
        if req.grammar is not None:
            req.grammar.sync(req.output_ids)
        self.counters["retractions"] += 1

    def poll_transfers(self) -> list[Req]:
        """Folds in finished tier transfers; recomputes the requests whose load-back failed
        (returned: a batch that already ran on such a load must drop what it sampled)."""
        failed = [lease.owner for lease in self.cache.poll([r.lease for r in self.queue.running])]
        for req in failed:
            self.retract(req, keep_kv=False)
            req.load_back_failed = True  # recompute it rather than load again
        return failed
