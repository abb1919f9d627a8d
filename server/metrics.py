"""Prometheus metrics (prefix `hicache_`), on a registry of our own.

Per-request figures (tokens, cached tokens by tier, TTFT / ITL / E2E) are observed in the HTTP
process as requests finish, as are its IPC counters (refused handshakes, dropped frames) and
scheduler restarts. Scheduler-side figures (tier occupancy, evictions, queue lengths) come from the
latest statistics snapshot the scheduler process published, exposed by `SchedulerCollector`; under
`--dp-size` that is the replicas' total, with per-replica (`dp_rank`) and router series besides.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

TIERS = ("device", "host", "storage")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
# tier stats keys that are levels, not running totals
_GAUGE_HINTS = ("used", "capacity", "bandwidth", "occupancy", "cached_tokens", "bytes_per_token", "enabled", "pages",
                "in_flight", "degraded", "prefetching")


class SchedulerCollector:
    """Yields gauges and counters from the latest `Scheduler.stats()` dict."""

    def __init__(self) -> None:
        self.stats: dict = {}

    def describe(self):
        return []  # the set of series depends on the stats; don't let the registry pre-check it

    def collect(self):
        s = self.stats
        if not s:
            return
        yield _gauge("hicache_num_running_reqs", "Requests in the running batch.", s.get("running", 0))
        yield _gauge("hicache_num_queued_reqs", "Requests waiting for admission.", s.get("queued", 0))
        yield _gauge("hicache_pages_held", "Device KV pages held by requests.", s.get("pages_held", 0))
        yield from _scheduler_counters(s)
        if isinstance(s.get("speculative"), dict):
            yield from _speculative_families(s["speculative"])
        yield from _tier_families(s.get("tiers", {}))
        if isinstance(s.get("disaggregation"), dict):
            yield from _disaggregation_families(s["disaggregation"])
        if isinstance(s.get("replicas"), list):
            yield from _replica_families(s["replicas"])
        if isinstance(s.get("router"), dict):
            yield from _router_families(s["router"])


def _gauge(name: str, doc: str, value) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=float(value))


def _scheduler_counters(s: dict):
    if isinstance(s.get("stats_age_s"), (int, float)):
        yield _gauge("hicache_stats_age_seconds", "Age of the scheduler's statistics snapshot.", s["stats_age_s"])
    for key in ("retractions", "requests_finished", "requests_aborted", "ipc_dropped_frames"):
        if isinstance(s.get(key), (int, float)):
            yield CounterMetricFamily(f"hicache_scheduler_{key}", f"Scheduler counter {key}.", value=float(s[key]))


_SPEC_COUNTERS = (("drafts", "Drafts verified (one request's draft tokens in one step)."),
                  ("draft_tokens", "Draft tokens verified."), ("accepted_tokens", "Draft tokens accepted."))


def _speculative_families(spec: dict):
    """Speculative decoding: drafts, draft and accepted tokens, and the draft tokens accepted per
    draft as a histogram (a verify step emits them and one token more)."""
    for key, doc in _SPEC_COUNTERS:
        if _is_number(spec.get(key)):
            yield CounterMetricFamily(f"hicache_spec_{key}", doc, value=float(spec[key]))
    per = {int(k): v for k, v in (spec.get("accepted_per_draft") or {}).items() if str(k).isdigit() and _is_number(v)}
    if per:
        cumulative, buckets = 0.0, []
        for m in range(max(per) + 1):
            cumulative += per.get(m, 0)
            buckets.append((str(m), cumulative))
        buckets.append(("+Inf", cumulative))
        yield HistogramMetricFamily("hicache_spec_accepted_per_draft", "Draft tokens accepted per draft.",
                                    buckets=buckets, sum_value=float(spec.get("accepted_tokens", 0)))


def _disaggregation_families(d: dict):
    """Prefill-decode disaggregation: KV transfers (sent on a prefill server, received on a decode
    server), their bytes and pages, the pages not sent because the decode side had them, and
    their seconds; transfers waiting and the bandwidth so far are levels."""
    for key, value in d.items():
        if _is_number(value):
            cls = GaugeMetricFamily if key in ("waiting", "bandwidth_bytes_per_s") else CounterMetricFamily
            yield cls(f"hicache_disagg_{key}", f"Disaggregation: {key.replace('_', ' ')}.", value=float(value))


def _tier_families(tiers: dict):
    keys = sorted({k for t in tiers.values() for k, v in t.items() if _is_number(v)})
    for key in keys:
        gauge = any(h in key for h in _GAUGE_HINTS)
        cls = GaugeMetricFamily if gauge else CounterMetricFamily
        fam = cls(f"hicache_tier_{key}", f"Per-tier {key.replace('_', ' ')}.", labels=["tier"])
        for tier, values in tiers.items():
            if _is_number(values.get(key)):
                fam.add_metric([tier], float(values[key]))
        yield fam


_REPLICA_GAUGES = (("running", "hicache_replica_running_reqs", "Requests in a replica's running batch."),
                   ("queued", "hicache_replica_queued_reqs", "Requests waiting for admission on a replica."))
_REPLICA_TIER_KEYS = ("used_tokens", "capacity_tokens", "hit_tokens")


def _replica_families(replicas: list[dict]):
    """Under --dp-size: each replica's liveness, queues and per-tier occupancy and hits, by `dp_rank`."""
    up = GaugeMetricFamily("hicache_replica_up", "1 while a replica's scheduler process serves.", labels=["dp_rank"])
    for r in replicas:
        up.add_metric([str(r.get("dp_rank"))], float(bool(r.get("alive"))))
    yield up
    for key, name, doc in _REPLICA_GAUGES:
        fam = GaugeMetricFamily(name, doc, labels=["dp_rank"])
        for r in replicas:
            if _is_number(r.get(key)):
                fam.add_metric([str(r["dp_rank"])], float(r[key]))
        yield fam
    for key in _REPLICA_TIER_KEYS:
        cls = CounterMetricFamily if key == "hit_tokens" else GaugeMetricFamily
        fam = cls(f"hicache_replica_tier_{key}", f"Per-replica, per-tier {key.replace('_', ' ')}.",
                  labels=["dp_rank", "tier"])
        for r in replicas:
            for tier, values in (r.get("tiers") or {}).items():
                if isinstance(values, dict) and _is_number(values.get(key)):
                    fam.add_metric([str(r["dp_rank"]), tier], float(values[key]))
        yield fam


_ROUTER_COUNTERS = (("routed", "hicache_router_requests", "Requests the router sent to each replica."),
                    ("prompt_tokens", "hicache_router_prompt_tokens", "Prompt tokens the router sent to each replica."),
                    ("matched_tokens", "hicache_router_matched_tokens",
                     "Prompt tokens of routed requests that the chosen replica's routing table matched."))


def _router_families(router: dict):
    for key, name, doc in _ROUTER_COUNTERS:
        fam = CounterMetricFamily(name, doc, labels=["dp_rank"])
        for rank, value in enumerate(router.get(key) or []):
            fam.add_metric([str(rank)], float(value))
        yield fam
    table = GaugeMetricFamily("hicache_router_table_tokens", "Tokens each replica's routing table remembers.",
                              labels=["dp_rank"])
    for rank, value in enumerate(router.get("table_tokens") or []):
        table.add_metric([str(rank)], float(value))
    yield table
    reasons = CounterMetricFamily("hicache_router_decisions", "Routing decisions by the rule that made them.",
                                  labels=["reason"])
    for reason, n in (router.get("reasons") or {}).items():
        reasons.add_metric([reason], float(n))
    yield reasons


def _is_number(v) -> bool:
    return isinstance(v, (int, float))  # bool included: enabled -> 0/1


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.prompt_tokens = Counter("hicache_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("hicache_generation_tokens", "Generated tokens of finished requests.",
                                         registry=r)
        self.cached_tokens = Counter("hicache_cached_tokens", "Prompt tokens served from a cache tier.", ["tier"],
                                     registry=r)
        self.requests = Counter("hicache_requests", "Finished requests by finish reason.", ["finish_reason"],
                                registry=r)
        self.ttft = Histogram("hicache_time_to_first_token_seconds", "Time to first token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("hicache_inter_token_latency_seconds", "Time between output tokens.",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("hicache_e2e_request_latency_seconds", "Request latency, arrival to finish.",
                             buckets=LATENCY_BUCKETS, registry=r)
        for tier in TIERS:
            self.cached_tokens.labels(tier)  # a series that never moved still reads 0
        self.ipc_rejected_handshakes = Counter(
            "hicache_ipc_rejected_handshakes", "Connections to the scheduler sockets refused (no valid CURVE key).",
            registry=r)
        self.ipc_dropped_frames = Counter("hicache_ipc_dropped_frames",
                                          "Frames from the scheduler dropped as malformed.", registry=r)
        self.scheduler_restarts = Counter("hicache_scheduler_restarts", "Scheduler processes restarted after dying.",
                                          registry=r)
        self.scheduler = SchedulerCollector()
        r.register(self.scheduler)
        self._totals = {"requests": 0, "prompt_tokens": 0, "generation_tokens": 0,
                        "cached_tokens": {t: 0 for t in TIERS}}

    def totals(self) -> dict:
        """Plain running totals over finished requests (for /hicache/stats)."""
        return {**self._totals, "cached_tokens": dict(self._totals["cached_tokens"])}

    def observe_finished(self, meta: dict, e2e_seconds: float, finish_type: str = "stop") -> None:
        self.prompt_tokens.inc(meta.get("prompt_tokens", 0))
        self.generation_tokens.inc(meta.get("completion_tokens", 0))
        for tier, n in (meta.get("cached_tokens_details") or {}).items():
            if tier in TIERS and _is_number(n):
                self.cached_tokens.labels(tier).inc(n)
        self.requests.labels(finish_type).inc()
        self.e2e.observe(e2e_seconds)
        t = self._totals
        t["requests"] += 1
        t["prompt_tokens"] += int(meta.get("prompt_tokens", 0))
        t["generation_tokens"] += int(meta.get("completion_tokens", 0))
        for tier, n in (meta.get("cached_tokens_details") or {}).items():
            if tier in TIERS and _is_number(n):
                t["cached_tokens"][tier] += int(n)

    def render(self, stats: dict | None) -> bytes:
        if stats is not None:
            self.scheduler.stats = stats
        return generate_latest(self.registry)
