"""The scheduler's request and token counters, and the usage it reports per request."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hicache.runtime.request import Req


class Counters(dict):
    """Counts since start: tokens computed and generated (of which appended by jump-forward),
    prompt tokens served from each tier, model steps applied, retractions, finished and aborted
    requests, and speculative decoding's drafts (a request's draft verified in a step), draft
    tokens and accepted draft tokens, and how many drafts had m tokens accepted
    (`spec_accepted_<m>`, keyed by `spec_lengths`) (a dict, so that a snapshot is a copy)."""

    def __init__(self):
        super().__init__(prompt_tokens=0, generation_tokens=0, cached_device=0, cached_host=0, cached_storage=0,
                         retractions=0, requests_finished=0, requests_aborted=0, forward_steps=0,
                         jump_forward_tokens=0, spec_drafts=0, spec_draft_tokens=0, spec_accepted_tokens=0)

    def spec_lengths(self, longest: int) -> None:
        """Keys for the drafts of 0..`longest` accepted tokens (before any step, so that a
        snapshot restored after the warm-up has them all)."""
        self.update({f"spec_accepted_{m}": 0 for m in range(longest + 1)})

    def count_cached(self, req: Req, prefix: int, loaded: int) -> None:
        """At `req`'s first admission: `prefix` tokens came from the cache, `loaded` of them (the
        last ones) back from L2, of which those in its committed L3 prefetch range came from
        storage. Only the prompt counts, all but its last token, as for every request (whose
        match stops before its last token): the prefix may also cover output tokens that a grammar
        forced before the first step (an earlier request left the same ones in the tree)."""
        start, end = req.storage_range  # the loaded-back part [prefix - loaded, prefix) may include it
        cached = min(prefix, len(req.input_ids) - 1)
        device = min(prefix - loaded, cached)
        storage = max(0, min(end, cached) - max(start, prefix - loaded))
        req.cached_tokens, req.cached_host, req.cached_storage = cached, cached - device - storage, storage
        self["cached_device"] += device
        self["cached_host"] += cached - device - storage
        self["cached_storage"] += storage

    def hits(self) -> dict[str, int]:
        return {"device": self["cached_device"], "host": self["cached_host"], "storage": self["cached_storage"]}

    def report(self, tiers: dict, **state) -> dict:
        """The scheduler's statistics: `state` (running, queued, ...), these counters, `tiers`."""
        return {**state, "retractions": self["retractions"], "requests_finished": self["requests_finished"],
                "requests_aborted": self["requests_aborted"], "forward_steps": self["forward_steps"], "tiers": tiers,
                "speculative": {"drafts": self["spec_drafts"], "draft_tokens": self["spec_draft_tokens"],
                                "accepted_tokens": self["spec_accepted_tokens"],
                                "accepted_per_draft": {k.removeprefix("spec_accepted_"): v for k, v in self.items()
                                                       if k.startswith("spec_accepted_") and k[-1].isdigit()}},
                "tokens": {"prompt": self["prompt_tokens"], "generation": self["generation_tokens"],
                           "jump_forward": self["jump_forward_tokens"], "cached": self.hits()}}


def usage(req: Req) -> dict:
    """The `meta` of a request's outputs: prompt and completion tokens, cached tokens by tier;
    with a draft verified, `spec_verify_ct` (its drafts verified) and `spec_accept_length` (the
    tokens a verify step gave it, on average: its accepted drafts and one)."""
    cached, host, storage = req.cached_tokens or 0, req.cached_host, req.cached_storage
    meta = {"prompt_tokens": len(req.input_ids), "completion_tokens": len(req.output_ids), "cached_tokens": cached,
            "cached_tokens_details": {"device": cached - host - storage, "host": host, "storage": storage}}
    if req.spec is not None and req.spec.verified:
        meta["spec_verify_ct"] = req.spec.verified
        meta["spec_accept_length"] = round(1 + req.spec.accepted / req.spec.verified, 4)
    return meta
