"""`hicache stats`: per-tier hit rates, occupancy, traffic and evictions of a running server."""
from __future__ import annotations

import json
import sys
import time

import httpx
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

TIERS = ("device", "host", "storage")
_SHOWN = {"used_tokens", "capacity_tokens", "cached_tokens", "hit_tokens", "evicted_tokens", "enabled", "bytes_per_token"}


class StatsUnavailable(Exception):
    pass


def fetch(url: str, api_key: str | None, timeout: float = 5.0) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(url.rstrip("/") + "/hicache/stats", headers=headers, timeout=timeout)
    except httpx.HTTPError as e:
        raise StatsUnavailable(f"no hicache server answers at {url} ({type(e).__name__}: {e}). "
                               "Start one with `hicache serve`, or point --url at it.") from None
    if r.status_code == 401:
        raise StatsUnavailable(f"the server at {url} rejected the API key: pass --api-key (or set HICACHE_API_KEY).")
    if r.status_code != 200:
        raise StatsUnavailable(f"the server at {url} answered HTTP {r.status_code}: {r.text[:200]}")
    try:
        return r.json()
    except ValueError:
        raise StatsUnavailable(f"the server at {url} did not answer JSON (is it a hicache server?)") from None


def run(url: str, watch: float | None, as_json: bool, api_key: str | None) -> int:
    console = Console(width=None if sys.stdout.isatty() else 150)  # piped: don't squeeze to 80 columns
    try:
        if as_json:
            return _run_json(url, watch, api_key)
        if not watch:
            console.print(render(fetch(url, api_key), url))
            return 0
        with Live(render(fetch(url, api_key), url), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(watch)
                live.update(render(fetch(url, api_key), url), refresh=True)
    except StatsUnavailable as e:
        print(f"hicache stats: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


def _run_json(url: str, watch: float | None, api_key: str | None) -> int:
    while True:
        print(json.dumps(fetch(url, api_key)), flush=True)
        if not watch:
            return 0
        time.sleep(watch)


def hit_rates(stats: dict) -> dict[str, float | None]:
    """Prompt tokens served from each tier over all prompt tokens (of finished requests when the
    server counts them; else the scheduler's computed + cached tokens)."""
    server = stats.get("server") or {}
    cached = server.get("cached_tokens") or (stats.get("tokens") or {}).get("cached") or {}
    total = server.get("prompt_tokens")
    if total is None:
        tokens = stats.get("tokens") or {}
        total = tokens.get("prompt", 0) + sum(v for v in cached.values() if isinstance(v, (int, float)))
    return {t: (cached.get(t, 0) / total if total else None) for t in TIERS}


def render(stats: dict, url: str = "") -> Group:
    return Group(_summary(stats, url), _tier_table(stats))


def _summary(stats: dict, url: str) -> Table:
    server = stats.get("server") or {}
    t = Table.grid(padding=(0, 2))
    t.add_row("[bold]hicache[/bold]", url, f"model {stats.get('model', '?')}", f"up {_duration(stats.get('uptime_s'))}")
    t.add_row("requests", f"running {stats.get('running', 0)}", f"queued {stats.get('queued', 0)}",
              f"pages held {stats.get('pages_held', 0)} (page size {stats.get('page_size', '?')})")
    t.add_row("tokens", f"prompt {_num(server.get('prompt_tokens', (stats.get('tokens') or {}).get('prompt')))}",
              f"generated {_num(server.get('generation_tokens', (stats.get('tokens') or {}).get('generation')))}",
              f"finished requests {_num(server.get('requests'))}")
    return t


def _tier_table(stats: dict) -> Table:
    table = Table(title="KV cache tiers", title_justify="left")
    for col in ("tier", "hit rate", "hit tokens", "used / capacity (tokens)", "occupancy", "size", "in cache",
                "moved", "evicted tokens"):
        table.add_column(col, justify="left" if col in ("tier", "moved") else "right")
    rates = hit_rates(stats)
    tiers = stats.get("tiers") or {}
    for name in TIERS:
        table.add_row(*_tier_row(name, tiers.get(name) or {}, rates[name]))
    return table


def _tier_row(name: str, tier: dict, rate: float | None) -> list[str]:
    if tier.get("enabled") is False or not tier:
        return [name, "-", "-", "disabled", "-", "-", "-", "-", "-"]
    used, cap = tier.get("used_tokens", 0), tier.get("capacity_tokens", 0)
    occupancy = f"{100 * used / cap:.1f}%" if cap else "-"
    size = _bytes(cap * tier["bytes_per_token"]) if tier.get("bytes_per_token") and cap else "-"
    moved = ", ".join(f"{k} {_fmt_value(k, v)}" for k, v in sorted(tier.items())
                      if k not in _SHOWN and isinstance(v, (int, float)) and not isinstance(v, bool)) or "-"
    return [name, "-" if rate is None else f"{100 * rate:.1f}%", _num(tier.get("hit_tokens")),
            f"{_num(used)} / {_num(cap)}", occupancy, size, _num(tier.get("cached_tokens")), moved,
            _num(tier.get("evicted_tokens"))]


def _fmt_value(key: str, v: float) -> str:
    if key.endswith("bytes"):
        return _bytes(v)
    return _num(v)


def _num(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and not v.is_integer():
        return f"{v:,.2f}"
    return f"{int(v):,}"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _duration(s) -> str:
    if not isinstance(s, (int, float)):
        return "?"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
