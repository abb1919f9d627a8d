"""Load or recompute: whether moving a cached range up from a tier beats computing it again.

Rates are measured while serving, as exponentially weighted moving averages of real work: prefill
throughput (prompt tokens per second of prefill steps, fed by the runtime) and, per tier, the
bandwidth of its loads (`host`: L2 -> L1 copies, `storage`: L3 -> L2 fetches, in bytes per second,
fed by the controllers from their transfers' results). For a range of `tokens` on a tier, with
`queued_bytes` of that tier's loads ahead of it, loading takes (queued_bytes + tokens x bytes per
token) / bandwidth and recomputing takes (backlog + tokens) / prefill rate, where the backlog is the
prompt tokens the scheduler has yet to compute (`set_backlog`): a busy GPU queues a recomputation
as the tier queues a load. Whichever is faster wins, so that a hit on a slow tier never makes a
request slower than computing it.

Until both rates are measured, ranges are loaded. A tier whose ranges keep being recomputed would
never be measured again, so after `PROBE_EVERY` refusals in a row one range is loaded anyway
(`probes`), and its transfer refreshes the estimate. Tokens recomputed by choice are counted per
tier (`recomputed_<tier>_tokens`).

Modes: `measured` decides for L3 and loads every L2 hit: an L2 load is queued with its batch and
runs layer by layer beside the compute, so even its copies' busy time (what a transfer reports)
overstates what it costs the request; `measured_all` decides for both tiers on those times;
`always` loads every hit.
"""
from __future__ import annotations

import collections

DECISION_MODES = ("measured", "measured_all", "always")
DECIDED = {"measured": ("storage",), "measured_all": ("host", "storage"), "always": ()}
ALPHA = 0.3  # weight of the newest sample in each moving average
PROBE_EVERY = 16
TIERS = ("host", "storage")


class Rate:
    """An exponentially weighted moving average of amount per second (None until a sample)."""

    __slots__ = ("value", "samples")

    def __init__(self) -> None:
        self.value: float | None = None
        self.samples = 0

    def add(self, amount: float, seconds: float) -> None:
        if amount <= 0 or seconds <= 0:
            return
        rate = amount / seconds
        self.value = rate if self.value is None else (1 - ALPHA) * self.value + ALPHA * rate
        self.samples += 1


class LoadDecider:
    def __init__(self, mode: str = "measured", bytes_per_token: int = 0):
        if mode not in DECISION_MODES:
            raise ValueError(f"hicache_load_decision must be one of {', '.join(DECISION_MODES)}; got {mode!r}")
        self.mode, self.bytes_per_token = mode, bytes_per_token
        self.prefill = Rate()  # tokens per second
        self.bandwidth = {tier: Rate() for tier in TIERS}  # bytes per second
        self.backlog = 0  # prompt tokens queued for prefill
        self._refused = collections.Counter()  # tier -> refusals in a row
        self.counters = collections.Counter()

    def record_prefill(self, tokens: int, seconds: float) -> None:
        self.prefill.add(tokens, seconds)

    def set_backlog(self, tokens: int) -> None:
        self.backlog = tokens

    def record_load(self, tier: str, nbytes: int, seconds: float) -> None:
        self.bandwidth[tier].add(nbytes, seconds)

    def seconds(self, tier: str, tokens: int, queued_bytes: int = 0) -> tuple[float, float] | None:
        """(load seconds, recompute seconds) of `tokens` on `tier`; None until both are measured."""
        bw, prefill = self.bandwidth[tier].value, self.prefill.value
        if bw is None or prefill is None:
            return None
        return (queued_bytes + tokens * self.bytes_per_token) / bw, (self.backlog + tokens) / prefill

    def load(self, tier: str, tokens: int, queued_bytes: int = 0) -> bool:
        """Whether to load `tokens` from `tier` (True) or recompute them (False, counted)."""
        est = self.seconds(tier, tokens, queued_bytes) if tier in DECIDED[self.mode] else None
        if est is None or est[0] <= est[1]:
            self._refused[tier] = 0
            return True
        self._refused[tier] += 1
        if self._refused[tier] >= PROBE_EVERY:
            self._refused[tier] = 0
            self.counters[f"probes_{tier}"] += 1
            return True
        self.counters[f"recomputed_{tier}_tokens"] += tokens
        return False

    def stats(self, tier: str) -> dict:
        """What `tier`'s stats show of it: the mode, the measured rates (None until measured) and
        the tokens recomputed by choice."""
        bw, prefill = self.bandwidth[tier].value, self.prefill.value
        return {"load_decision": self.mode,
                "measured_load_bytes_per_s": None if bw is None else int(bw),
                "measured_prefill_tokens_per_s": None if prefill is None else round(prefill, 1),
                "recomputed_by_choice_tokens": self.counters[f"recomputed_{tier}_tokens"],
                "load_probes": self.counters[f"probes_{tier}"]}
