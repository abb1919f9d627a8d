"""`hicache stats`: per-tier hit rates, occupancy, traffic and evictions of a running server, or of
several replicas (one `--url` each): each replica's, then the total over them."""
from __future__ import annotations

import json
import sys
import time

import httpx
from rich.columns import Columns
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from hicache.runtime.redact import redact

TIERS = ("device", "host", "storage")
_SHOWN = {"used_tokens", "capacity_tokens", "cached_tokens", "hit_tokens", "evicted_tokens", "enabled",
          "bytes_per_token", "status", "degraded"}


class StatsUnavailable(Exception):
    pass


def fetch(url: str, api_key: str | None, timeout: float = 5.0) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(url.rstrip("/") + "/hicache/stats", headers=headers, timeout=timeout)
    except httpx.HTTPError as e:
        raise StatsUnavailable(redact(f"no hicache server answers at {url} ({type(e).__name__}: {e}). "
                                      "Start one with `hicache serve`, or point --url at it.")) from None
    shown = redact(url)
    if r.status_code == 401:
        raise StatsUnavailable(f"the server at {shown} rejected the API key: pass --api-key (or set HICACHE_API_KEY).")
    if r.status_code != 200:
        raise StatsUnavailable(redact(f"the server at {shown} answered HTTP {r.status_code}: {r.text[:200]}"))
    try:
        return r.json()
    except ValueError:
        raise StatsUnavailable(f"the server at {shown} did not answer JSON (is it a hicache server?)") from None


def run(urls: str | list[str], watch: float | None, as_json: bool, api_key: str | None) -> int:
    """Prints the stats of the server at `urls` (one URL, or several replicas' URLs)."""
    urls = [urls] if isinstance(urls, str) else list(urls)
    console = Console(width=None if sys.stdout.isatty() else 150)  # piped: don't squeeze to 80 columns
    try:
        if as_json:
            return _run_json(urls, watch, api_key)
        if not watch or not console.is_terminal:  # piped: one table per refresh, like `watch`
            while True:
                console.print(render_all(urls, api_key))
                if not watch:
                    return 0
                time.sleep(watch)
        with Live(render_all(urls, api_key), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(watch)
                live.update(render_all(urls, api_key), refresh=True)
    except StatsUnavailable as e:
        print(f"hicache stats: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


def _run_json(urls: list[str], watch: float | None, api_key: str | None) -> int:
    while True:
        stats = [fetch(u, api_key) for u in urls]
        out = stats[0] if len(urls) == 1 else {"replicas": dict(zip(urls, stats)), "total": total(stats)}
        print(redact(json.dumps(out)), flush=True)
        if not watch:
            return 0
        time.sleep(watch)


def render_all(urls: list[str], api_key: str | None) -> Group:
    stats = [fetch(u, api_key) for u in urls]
    if len(stats) == 1:
        return render(stats[0], urls[0])
    return Group(*(render(s, u) for s, u in zip(stats, urls)), _total_table(total(stats)))


def total(stats: list[dict]) -> dict:
    """The replicas' requests and prompt tokens summed, with the hit rate of each tier over all of them."""
    counts = [_token_counts(s) for s in stats]
    prompt = sum(n for _, n in counts)
    cached = {t: sum(c.get(t, 0) for c, _ in counts) for t in TIERS}
    return {"replicas": len(stats), "running": sum(s.get("running", 0) for s in stats),
            "queued": sum(s.get("queued", 0) for s in stats),
            "requests_finished": sum(s.get("requests_finished", 0) for s in stats),
            "prompt_tokens": prompt, "cached_tokens": cached,
            "hit_rates": {t: (cached[t] / prompt if prompt else None) for t in TIERS}}


def _total_table(tot: dict) -> Table:
    t = Table.grid(padding=(0, 2))
    t.add_row("[bold]total[/bold]", f"{tot['replicas']} replicas", f"running {tot['running']}",
              f"queued {tot['queued']}", f"finished {_num(tot['requests_finished'])}")
    t.add_row("hit rate", *(f"{name} {_pct(rate)}" for name, rate in tot["hit_rates"].items()),
              f"of {_num(tot['prompt_tokens'])} prompt tokens")
    return t


def _pct(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.1%}"


def hit_rates(stats: dict) -> dict[str, float | None]:
    """Prompt tokens served from each tier over all prompt tokens (of finished requests when the
    server counts them; else the scheduler's computed + cached tokens)."""
    cached, total_tokens = _token_counts(stats)
    return {t: (cached.get(t, 0) / total_tokens if total_tokens else None) for t in TIERS}


def _token_counts(stats: dict) -> tuple[dict, int]:
    """(cached tokens per tier, prompt tokens) of one server's stats."""
    server = stats.get("server") or {}
    cached = server.get("cached_tokens") or (stats.get("tokens") or {}).get("cached") or {}
    prompt = server.get("prompt_tokens")
    if prompt is None:
        tokens = stats.get("tokens") or {}
        prompt = tokens.get("prompt", 0) + sum(v for v in cached.values() if isinstance(v, (int, float)))
    return cached, prompt


def render(stats: dict, url: str = "") -> Group:
    """The summary, then one table a tier; a tier's hit tokens and hit rate are one count's
    (`_token_counts`)."""
    rates, (cached, _) = hit_rates(stats), _token_counts(stats)
    tiers = stats.get("tiers") or {}
    tables = [_tier_table(name, tiers.get(name) or {}, rates[name], cached.get(name)) for name in TIERS]
    return Group(_summary(stats, url), Columns(tables, padding=(0, 2)))


def _summary(stats: dict, url: str) -> Table:
    server = stats.get("server") or {}
    tokens = stats.get("tokens") or {}
    t = Table.grid(padding=(0, 2))
    t.add_row("[bold]hicache[/bold]", redact(url), f"model {stats.get('model', '?')}",
              f"up {_duration(stats.get('uptime_s'))}")
    t.add_row("requests", f"running {stats.get('running', 0)}", f"queued {stats.get('queued', 0)}",
              f"pages held {stats.get('pages_held', 0)} (page size {stats.get('page_size', '?')})")
    t.add_row("tokens", f"prompt {_num(server.get('prompt_tokens', tokens.get('prompt')))}",
              f"generated {_num(server.get('generation_tokens', tokens.get('generation')))}",
              f"finished requests {_num(server.get('requests'))}")
    spec = stats.get("speculative") or {}
    if spec.get("drafts"):
        t.add_row("speculative", f"drafts {_num(spec['drafts'])}",
                  f"accepted {_num(spec.get('accepted_tokens'))} of {_num(spec.get('draft_tokens'))} draft tokens",
                  f"{1 + spec.get('accepted_tokens', 0) / spec['drafts']:.2f} tokens a verified step")
        per = spec.get("accepted_per_draft") or {}
        if per:
            t.add_row("", "accepted per draft", "  ".join(f"{m}: {_num(n)}" for m, n in sorted(
                per.items(), key=lambda kv: int(kv[0]))), "")
    pd = stats.get("disaggregation") or {}
    if pd.get("mode") in ("prefill", "decode"):
        moved = "sent" if pd["mode"] == "prefill" else "received"
        t.add_row(f"{pd['mode']} server", f"transfers {_num(pd.get('transfers'))} "
                  f"({_num(pd.get('transfers_failed'))} failed)",
                  f"{moved} {_num(pd.get('pages'))} pages, {_bytes(pd.get('bytes', 0))} "
                  f"at {_bytes(pd.get('bandwidth_bytes_per_s', 0))}/s",
                  f"pages the decode side had {_num(pd.get('pages_skipped'))}")
    router = stats.get("router") or {}
    for r in stats.get("replicas") or []:  # one server's --dp-size replicas
        t.add_row(*_replica_row(r, router))
    return t


def _replica_row(r: dict, router: dict) -> tuple[str, ...]:
    rank = r.get("dp_rank", 0)
    if not r.get("alive"):
        return f"replica {rank}", "[bold red]down[/bold red]", redact(str(r.get("error", "")))
    routed, matched, prompt = (router.get(k) or [] for k in ("routed", "matched_tokens", "prompt_tokens"))
    matched_pct = "-" if rank >= len(prompt) or not prompt[rank] else f"{matched[rank] / prompt[rank]:.1%}"
    hits = sum((r.get("tiers") or {}).get(tier, {}).get("hit_tokens", 0) for tier in TIERS)
    return (f"replica {rank}", f"running {r.get('running', 0)}", f"queued {r.get('queued', 0)}",
            f"routed {_num(routed[rank] if rank < len(routed) else None)} ({router.get('method', '?')}, "
            f"{matched_pct} of prompts matched)", f"hit tokens {_num(hits)}")


def _tier_table(name: str, tier: dict, rate: float | None, hits: int | None) -> Table:
    """One tier: hit rate, occupancy, traffic, evictions, then whatever else the tier reports."""
    table = Table(title=f"[bold]{name}[/bold]", show_header=False, min_width=34)
    table.add_column("metric")
    table.add_column("value", justify="right")
    if tier.get("enabled") is False or not tier:
        table.add_row("status", "disabled")
        return table
    for label, value in _tier_rows(tier, rate, hits):
        table.add_row(label, value)
    return table


def _tier_rows(tier: dict, rate: float | None, hits: int | None) -> list[tuple[str, str]]:
    used, cap = tier.get("used_tokens", 0), tier.get("capacity_tokens", 0)
    per_token = tier.get("bytes_per_token")
    rows = []
    if "status" in tier:  # L3: "ok", or "degraded: <why>" while its backend is unreachable or its disk full
        status = redact(str(tier["status"]))  # an older server's may carry a URL with its password
        rows.append(("status", status if status == "ok" else f"[bold red]{status}[/bold red]"))
    rows += [("hit rate", "-" if rate is None else f"{100 * rate:.1f}%"),
            ("hit tokens", _num(hits)),
            ("used / capacity", f"{_num(used)} / {_num(cap)} tok"),
            ("occupancy", f"{100 * used / cap:.1f}%" if cap else "-"),
            ("capacity", _bytes(cap * per_token) if per_token and cap else "-"),
            ("cached in tree", _num(tier.get("cached_tokens"))),
            ("evicted", f"{_num(tier.get('evicted_tokens'))} tok")]
    rows += _traffic_rows(tier)
    shown = _SHOWN | {k for pair in _TRAFFIC for k in pair[1:]}
    rows += [(k.replace("_", " "), _fmt_value(k, v)) for k, v in sorted(tier.items()) if k not in shown]
    return rows


# (label, tokens key, bytes key, seconds key): data moved into / out of the tier
_TRAFFIC = (("loaded back", "loaded_back_tokens", "loaded_back_bytes", "load_back_seconds"),
            ("backed up", "backed_up_tokens", "backed_up_bytes", "backup_seconds"),
            ("prefetched", "prefetched_tokens", "prefetched_bytes", "prefetch_seconds"))


def _traffic_rows(tier: dict) -> list[tuple[str, str]]:
    rows = []
    for label, tok_key, byte_key, sec_key in _TRAFFIC:
        if tok_key not in tier and byte_key not in tier:
            continue
        value = f"{_num(tier.get(tok_key))} tok, {_bytes(tier.get(byte_key) or 0)}"
        seconds = tier.get(sec_key) or 0
        if seconds > 0 and tier.get(byte_key):
            value += f" @ {tier[byte_key] / seconds / 1e9:.2f} GB/s"
        rows.append((label, value))
    return rows


def _fmt_value(key: str, v) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return redact(str(v))
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
