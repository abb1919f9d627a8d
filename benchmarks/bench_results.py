"""What a multi-turn run reports (`multiturn.py` and the scripts built on it): latency
percentiles, hit rates by tier and by round, the JSON line and its console summary."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from statistics import quantiles

TIERS = ("device", "host", "storage")


@dataclass
class Record:
    session: int
    round: int
    start: float
    ttft: float
    itls: list[float]
    e2e: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cached_by_tier: dict[str, int] = field(default_factory=dict)


def percentiles(values: list[float]) -> dict:
    """mean / p50 / p90 / p99 in milliseconds."""
    if not values:
        return {}
    ms = sorted(v * 1000 for v in values)
    if len(ms) == 1:
        return {k: round(ms[0], 2) for k in ("mean", "p50", "p90", "p99")}
    q = quantiles(ms, n=100, method="inclusive")
    return {"mean": round(sum(ms) / len(ms), 2), "p50": round(q[49], 2), "p90": round(q[89], 2), "p99": round(q[98], 2)}


def hit_rates(records: list[Record]) -> dict:
    prompt = sum(r.prompt_tokens for r in records)
    by_tier = {t: sum(r.cached_by_tier.get(t, 0) for r in records) for t in TIERS}
    return {"prompt_tokens": prompt, "cached_tokens": sum(r.cached_tokens for r in records),
            "cache_hit_rate": round(sum(r.cached_tokens for r in records) / max(prompt, 1), 4),
            "hit_rate_by_tier": {t: round(n / max(prompt, 1), 4) for t, n in by_tier.items()}}


def summarize(records: list[Record], duration: float) -> dict:
    rounds = sorted({r.round for r in records})
    per_round = []
    for n in rounds:
        rs = [r for r in records if r.round == n]
        per_round.append({"round": n, "requests": len(rs), "ttft_ms": percentiles([r.ttft for r in rs]),
                          "e2e_ms": percentiles([r.e2e for r in rs]), **hit_rates(rs)})
    final: dict[int, int] = {}
    for r in records:  # a conversation's final length: its longest prompt plus that reply
        final[r.session] = max(final.get(r.session, 0), r.prompt_tokens + r.completion_tokens)
    out_tokens = sum(r.completion_tokens for r in records)
    return {"requests": len(records), "duration_s": round(duration, 3),
            "request_throughput": round(len(records) / duration, 4),
            "input_token_throughput": round(sum(r.prompt_tokens for r in records) / duration, 2),
            "output_token_throughput": round(out_tokens / duration, 2), "completion_tokens": out_tokens,
            "ttft_ms": percentiles([r.ttft for r in records]),
            "itl_ms": percentiles([x for r in records for x in r.itls]),
            "e2e_ms": percentiles([r.e2e for r in records]), **hit_rates(records),
            "working_set_tokens": sum(final.values()), "rounds": per_round}


def append_jsonl(result: dict, path: str | Path) -> None:
    """Appends the result as one JSON line; an empty path ('') writes nothing."""
    if not str(path):
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(result) + "\n")


def report(result: dict) -> str:
    t, i, e = result["ttft_ms"], result["itl_ms"], result["e2e_ms"]
    tiers = "  ".join(f"{k} {v:.1%}" for k, v in result["hit_rate_by_tier"].items())
    lines = [f"{result['requests']} requests in {result['duration_s']:.1f} s: "
             f"{result['request_throughput']:.2f} req/s, input {result['input_token_throughput']:.1f} tok/s, "
             f"output {result['output_token_throughput']:.1f} tok/s",
             f"TTFT ms  mean {t['mean']:.0f}  p50 {t['p50']:.0f}  p90 {t['p90']:.0f}  p99 {t['p99']:.0f}",
             f"ITL ms   mean {i.get('mean', 0):.1f}  p50 {i.get('p50', 0):.1f}  p90 {i.get('p90', 0):.1f}  "
             f"p99 {i.get('p99', 0):.1f}",
             f"E2E ms   mean {e['mean']:.0f}  p50 {e['p50']:.0f}  p90 {e['p90']:.0f}  p99 {e['p99']:.0f}",
             f"cache hit rate {result['cache_hit_rate']:.1%} ({tiers}); "
             f"working set {result['working_set_tokens']} tokens"]
    for r in result["rounds"]:
        lines.append(f"  round {r['round']}: {r['requests']} requests, TTFT p50 {r['ttft_ms']['p50']:.0f} ms, "
                     f"hit rate {r['cache_hit_rate']:.1%}")
    return "\n".join(lines)
