"""The statistics of several replicas (`--dp-size`) as one: their total, in the shape of one
scheduler's `Scheduler.stats()` (so that /metrics, /health and `hicache stats` read it as they read
one server's), plus each replica's own (`replicas`) and the router's counters (`router`).

Totals: counters and sizes add up; levels that describe every replica alike (page size, bytes per
token, measured rates, free disk) are the replicas' mean or first value; a status is the first one
that is not "ok"; a flag is set when any replica's is. The L3 tier's occupancy and capacity are one
store's when the replicas share it (LMDB, Redis, Mooncake), so they are not added up.
"""
from __future__ import annotations

_SAME = ("page_size", "bytes_per_token", "disk_free_bytes")  # one value for every replica
_MEAN_SUFFIXES = ("_per_s",)
_MAX = ("stats_age_s",)
_SHARED_STORAGE = ("used_tokens", "capacity_tokens")


def merge_replicas(per: list[dict], router: dict, shared_storage: bool) -> dict:
    """`per[r]` is replica r's statistics, or {"alive": False, "error": why} for one that is down."""
    live = [s for s in per if "error" not in s]
    total = merge(live)
    storage = total.get("tiers", {}).get("storage")
    if shared_storage and isinstance(storage, dict):
        first = live[0]["tiers"]["storage"]
        storage.update({k: first[k] for k in _SHARED_STORAGE if k in first})
    replicas = [{"dp_rank": rank, "alive": "error" not in s, **s} for rank, s in enumerate(per)]
    return {**total, "dp_size": len(per), "replicas": replicas, "router": router}


def merge(stats: list[dict]) -> dict:
    """The key-wise total of several statistics dicts (see the module docstring)."""
    out: dict = {}
    for key in dict.fromkeys(k for s in stats for k in s):
        values = [s[key] for s in stats if key in s]
        out[key] = _merge_values(key, values)
    return out


def _merge_values(key: str, values: list):
    present = [v for v in values if v is not None]
    if not present:
        return None
    first = present[0]
    if all(isinstance(v, dict) for v in present):
        return merge(present)
    if isinstance(first, bool):
        return any(present)
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in present):
        return _merge_numbers(key, present)
    if isinstance(first, str):
        return next((v for v in present if v != "ok"), first) if key == "status" else first
    return first


def _merge_numbers(key: str, values: list):
    if key in _SAME:
        return values[0]
    if key in _MAX:
        return max(values)
    if key.endswith(_MEAN_SUFFIXES):
        return sum(values) / len(values)
    total = sum(values)
    return round(total, 6) if isinstance(total, float) else total
