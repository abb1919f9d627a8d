"""Runs one workload against `hicache serve` in several cache configurations and plots the result.

Configurations (each a fresh server on 127.0.0.1 and a free port, same model and L1 size):
- `radix-off`: `--disable-radix-cache` (every prompt token is recomputed);
- `L1`: the radix cache on the device pool only (`--disable-hierarchical-cache`);
- `L1+L2`: plus the host tier (`--hicache-ratio`);
- `L1+L2+L3`: plus the LMDB storage tier, empty at the start;
- `L3-warm`: a new server on the LMDB folder the previous configuration filled (a warm restart).
The L3 configurations need `--hicache-storage-backend` in `hicache serve --help`; where the flag is
missing they are skipped (and said so); where it exists, the configurations without L3 pass
`--hicache-storage-backend none`.

L1 (`--max-total-tokens`) is sized to `--l1-fraction` of the workload's working set (every
conversation at its final length), so that L1 cannot hold it: the case HiCache exists for. The
script prints the working set and each tier's capacity (from `/hicache/stats`), shows a progress bar
per configuration, and writes under `--out` (default `benchmarks/results/`): `NAME.md` (tables, the
CPU seconds of the server's processes among them), `NAME.jsonl` (one line per configuration, from
multiturn.py), `NAME_ttft_by_round.png`, `NAME_throughput.png` and `NAME_hit_rate_by_round.png`.
`--replot` rewrites the tables and plots from the latest line of each configuration in `NAME.jsonl`,
so configurations can be run in separate invocations (`--configs ...`; `--l3-path` keeps the LMDB
folder for a later `L3-warm`).

The no-reuse workload (what the cache machinery costs when nothing can hit) is multiturn with one
round: every prompt is fresh random tokens (`-- --num-rounds 1 --num-clients 64`).

Workload options after the compare options go to `multiturn.py` (or `long_context.py` with
`--workload long_context`); `--url` and `--log-file` are set here. The CPU comparison of
benchmarks/RESULTS.md:

    .venv/bin/python -u benchmarks/compare.py --name multiturn_cpu -- \\
        --num-clients 16 --num-rounds 6 --request-length 256 --output-length 16 --max-parallel 16
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

import long_context
import multiturn
from proctree import cpu_since, tree_cpu

SERVER = [sys.executable, "-m", "hicache.server.cli", "serve"]
ALL_CONFIGS = ("radix-off", "L1", "L1+L2", "L1+L2+L3", "L3-warm")
CPU_ROLES = ("http", "scheduler", "storage")


@dataclass
class Config:
    name: str
    flags: list[str]
    flush: bool = True  # a warm restart keeps what it was started with


def storage_flags_available() -> bool:
    out = subprocess.run([*SERVER, "--help"], capture_output=True, text=True, timeout=120).stdout
    return "--hicache-storage-backend" in out


def configs(args, l3_dir: Path, with_l3: bool) -> list[Config]:
    none = ["--hicache-storage-backend", "none"] if with_l3 else []
    lmdb = ["--hicache-ratio", str(args.hicache_ratio), "--hicache-storage-backend", "lmdb",
            "--hicache-storage-backend-extra-config", json.dumps({"path": str(l3_dir), **json.loads(args.l3_config)})]
    table = {"radix-off": Config("radix-off", ["--disable-radix-cache", "--disable-hierarchical-cache", *none]),
             "L1": Config("L1", ["--disable-hierarchical-cache", *none]),
             "L1+L2": Config("L1+L2", ["--hicache-ratio", str(args.hicache_ratio), *none]),
             "L1+L2+L3": Config("L1+L2+L3", lmdb),
             "L3-warm": Config("L3-warm", lmdb, flush=False)}
    return [table[n] for n in args.configs if with_l3 or n not in ("L1+L2+L3", "L3-warm")]


# ---- server -----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process on 127.0.0.1 and a free port (by default `hicache serve`), ready once `ready_path`
    answers 200; its log goes to a file, shown if it fails. Another engine's server is started by
    passing its `command` (which must take `--host` and `--port`) and, where it needs them, `env`."""

    def __init__(self, flags: list[str], log: Path, startup_timeout: float = 900,
                 command: list[str] | None = None, ready_path: str = "/health", env: dict | None = None):
        start = time.monotonic()
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log, self.ready_path = log, ready_path
        command = [*SERVER, "--log-level", "warning"] if command is None else command
        cmd = [*command, "--host", "127.0.0.1", "--port", self.url.rsplit(":", 1)[1], *flags]
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + startup_timeout
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server failed to start: {' '.join(cmd)}\n{self.log_tail()}")
            time.sleep(0.5)
        self.startup_s = time.monotonic() - start

    def _healthy(self) -> bool:
        try:
            return httpx.get(self.url + self.ready_path, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def tiers(self, attempts: int = 30) -> dict:
        """The tiers of /hicache/stats (retried: a busy scheduler may not answer in time)."""
        for _ in range(attempts - 1):
            r = httpx.get(self.url + "/hicache/stats", timeout=60)
            if r.status_code == 200:
                return r.json()["tiers"]
            time.sleep(2)
        return httpx.get(self.url + "/hicache/stats", timeout=60).raise_for_status().json()["tiers"]

    def drain(self, timeout: float = 300) -> dict:
        """Waits for the tiers' background copies (L1 -> L2, L2 -> L3 backups) to finish; the tiers' stats."""
        deadline = time.monotonic() + timeout
        while True:
            tiers = self.tiers()
            busy = sum(int(t.get("in_flight", 0)) + int(t.get("backups_in_flight", 0)) for t in tiers.values())
            if not busy or time.monotonic() > deadline:
                return tiers
            time.sleep(0.5)

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def capacities(tiers: dict) -> dict[str, int]:
    return {t: int(tiers[t]["capacity_tokens"]) if tiers.get(t, {}).get("enabled", t == "device") else 0
            for t in multiturn.TIERS}


# ---- running ----------------------------------------------------------------------------------


def conversation_tokens(wl: argparse.Namespace) -> int:
    """The longest single conversation (document request) at its final length."""
    if wl.benchmark == "long_context":
        return wl.doc_length[1] + wl.question_length + wl.output_length
    return wl.request_length + (wl.num_rounds - 1) * wl.question_length + wl.num_rounds * wl.output_length


def planned_working_set(wl: argparse.Namespace) -> int:
    """Tokens of every conversation (document) at its final length, before the run."""
    if wl.benchmark == "long_context":
        return wl.num_docs * ((wl.doc_length[0] + wl.doc_length[1]) // 2 + wl.question_length + wl.output_length)
    return wl.num_clients * conversation_tokens(wl)


def run_config(cfg: Config, args, wl_argv: list[str], module, progress, logs: Path) -> dict:
    server = Server([*args.server_flags, *cfg.flags], logs / f"{cfg.name}.log")
    try:
        wl = module.parse_args([*wl_argv, "--url", server.url, "--tag", cfg.name,
                                *([] if cfg.flush else ["--no-flush"])])
        cap = capacities(server.tiers())
        progress.console.print(f"[bold]{cfg.name}[/]: flags {' '.join(cfg.flags) or '(none)'}; capacity in tokens: "
                               + ", ".join(f"{t} {n}" for t, n in cap.items()) + f"; ready in {server.startup_s:.0f} s")
        if args.prime_clients and cfg.flush:
            prime(module, wl_argv, server, args.prime_clients, args.prime_rounds, progress)
        workload = make_workload(module, wl)
        total = sum(workload.round_sizes.values())
        task = progress.add_task(cfg.name, total=total)

        ends = {sum(list(workload.round_sizes.values())[:i + 1]) for i in range(len(workload.round_sizes))}

        def done(_: multiturn.Record) -> None:
            progress.advance(task)
            n = int(progress.tasks[task].completed)
            if not progress.console.is_terminal and n in ends:  # a log file: a line per round's worth, not a bar
                progress.console.print(f"{cfg.name}: {n}/{total} requests, {progress.tasks[task].elapsed:.0f} s")

        cpu = tree_cpu(server.proc.pid)
        result = asyncio.run(multiturn.run(wl, workload, done))
        result["server"] = {"config": cfg.name, "flags": [*args.server_flags, *cfg.flags], "capacity_tokens": cap,
                            "tiers_after": server.drain(),  # so that a warm restart finds every backup
                            "cpu_s": cpu_since(server.proc.pid, cpu)}  # over the run and the drain
    except Exception:
        progress.console.print(f"[red]{cfg.name} failed[/]; server log tail:\n{server.log_tail()}")
        raise
    finally:
        t0 = time.monotonic()
        server.stop()
        progress.console.print(f"{cfg.name}: server stopped in {time.monotonic() - t0:.0f} s")
    return result


def make_workload(module, wl: argparse.Namespace):
    return module.LongContext(wl) if wl.benchmark == "long_context" else module.MultiTurn(wl)


def prime(module, wl_argv: list[str], server: Server, clients: int, rounds: int, progress) -> None:
    """Runs the workload with `clients` conversations of other tokens (another seed) and no JSON
    line, so that one-time costs (Triton's JIT compiling each kernel specialisation the workload
    reaches) fall outside the measured run; that run flushes the cache first."""
    t0 = time.monotonic()
    wl = module.parse_args([*wl_argv, "--url", server.url, "--log-file", "", "--seed", "1000",
                            *(["--num-clients", str(clients)] if module is multiturn else ["--num-docs", str(clients)]),
                            *(["--num-rounds", str(rounds)] if rounds and module is multiturn else [])])
    workload = make_workload(module, wl)
    asyncio.run(multiturn.run(wl, workload))
    progress.console.print(f"primed with {clients} conversation(s) in {time.monotonic() - t0:.0f} s (not measured)")


def l1_tokens(args, wl: argparse.Namespace) -> int:
    """The fraction of the working set, but at least one conversation (plus a page for a chat template)."""
    want = max(int(planned_working_set(wl) * args.l1_fraction), conversation_tokens(wl) + 2 * args.page_size)
    return -(-want // args.page_size) * args.page_size


def main(argv=None) -> None:
    args, wl_argv = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    log_file = args.out / f"{args.name}.jsonl"
    if args.replot:
        return write_outputs(latest_per_config(log_file), args)
    module = long_context if args.workload == "long_context" else multiturn
    wl = module.parse_args(wl_argv)
    working_set, l1 = planned_working_set(wl), l1_tokens(args, wl)
    args.server_flags = ["--page-size", str(args.page_size), "--max-total-tokens", str(l1), *args.server_args]
    with_l3 = storage_flags_available()
    if args.l3_path and "L1+L2+L3" in args.configs and args.l3_path.exists() and any(args.l3_path.iterdir()):
        raise SystemExit(f"--l3-path {args.l3_path} is not empty: L1+L2+L3 starts from an empty L3")
    wl_argv = [*wl_argv, "--log-file", str(log_file)]
    print(f"working set about {working_set} tokens; L1 {l1} tokens ({l1 / working_set:.0%}); "
          f"L2 {args.hicache_ratio:g} x L1 where on")
    if not with_l3:
        print("hicache serve has no --hicache-storage-backend yet: the L3 configurations are skipped")
    command = "python -u benchmarks/compare.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    results = []
    columns = (TextColumn("{task.description:>10}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with tempfile.TemporaryDirectory(prefix="hicache-compare-") as tmp, Progress(*columns) as bar:
        for cfg in configs(args, args.l3_path or Path(tmp) / "lmdb", with_l3):
            result = run_config(cfg, args, wl_argv, module, bar, Path(tmp))
            result["compare"] = {"command": command, "planned_working_set": working_set, "l1_tokens": l1}
            multiturn.append_jsonl(result, log_file)
            results.append(result)
            bar.console.print(multiturn.report(result))
    write_outputs(results, args)


def latest_per_config(log_file: Path) -> list[dict]:
    """The last line of each configuration in a compare JSONL file, in the configurations' order."""
    latest = {}
    for line in log_file.read_text().splitlines():
        result = json.loads(line)
        latest[result["tag"]] = result
    return [latest[n] for n in ALL_CONFIGS if n in latest]


def write_outputs(results: list[dict], args) -> None:
    md = markdown(results)
    (args.out / f"{args.name}.md").write_text(md)
    plot(results, args.out, args.name)
    print("\n" + md)


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=["multiturn", "long_context"], default="multiturn")
    p.add_argument("--configs", nargs="+", choices=ALL_CONFIGS, default=list(ALL_CONFIGS))
    p.add_argument("--l1-fraction", type=float, default=0.25, help="L1 size as a fraction of the working set")
    p.add_argument("--hicache-ratio", type=float, default=2.0, help="L2 size as a multiple of L1")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--l3-path", type=Path, default=None,
                   help="LMDB folder of the L3 configurations, to keep it between invocations "
                        "(default: a temporary folder); L1+L2+L3 wants it empty or absent")
    p.add_argument("--l3-config", default="{}",
                   help='more keys of the L3 configurations\' --hicache-storage-backend-extra-config, as JSON, '
                        'e.g. \'{"prefetch_threshold": 64}\'')
    p.add_argument("--prime-clients", type=int, default=0,
                   help="before each measured run (not L3-warm's), run the workload with this many conversations "
                        "(documents) of other tokens on the same server, unmeasured: on a GPU, 1 keeps Triton's "
                        "JIT compilation out of the figures")
    p.add_argument("--prime-rounds", type=int, default=0,
                   help="multiturn: rounds of the priming run (0: the workload's); with as many clients as the "
                        "workload and enough rounds to outgrow L1, it also primes the L2 load-back kernels")
    p.add_argument("--replot", action="store_true",
                   help="run nothing: rewrite the table and plots from the latest line per configuration of NAME.jsonl")
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[],
                   help="more `hicache serve` flags for every configuration (put last, before --)")
    p.add_argument("--name", default="compare", help="file name stem of the outputs")
    p.add_argument("--out", type=Path, default=multiturn.RESULTS)
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    return p.parse_args(argv[:split]), argv[split + 1:]


# ---- outputs ----------------------------------------------------------------------------------


def markdown(results: list[dict]) -> str:
    first = results[0]
    rounds = [r["round"] for r in first["rounds"]]
    commands = list(dict.fromkeys(r["compare"]["command"] for r in results))
    lines = [*(f"Command: `{c}`" for c in commands), "",
             f"{first['requests']} requests per configuration; working set {first['working_set_tokens']} tokens "
             f"(planned {first['compare']['planned_working_set']}), L1 {first['compare']['l1_tokens']} tokens; "
             f"run {first['time']}.", "",
             "| configuration | capacity L1 / L2 / L3 (tokens) | seconds | req/s | input tok/s | output tok/s | "
             "TTFT p50 / p90 / p99 (ms) | ITL p50 (ms) | E2E p50 (ms) | hit rate | L1 | L2 | L3 |",
             "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        cap, t, tier = r["server"]["capacity_tokens"], r["ttft_ms"], r["hit_rate_by_tier"]
        lines.append(f"| {r['tag']} | {cap['device']} / {cap['host']} / {cap['storage']} | {r['duration_s']:.1f} | "
                     f"{r['request_throughput']:.2f} | {r['input_token_throughput']:.0f} | "
                     f"{r['output_token_throughput']:.1f} | "
                     f"{t['p50']:.0f} / {t['p90']:.0f} / {t['p99']:.0f} | {r['itl_ms'].get('p50', 0):.0f} | "
                     f"{r['e2e_ms']['p50']:.0f} | {r['cache_hit_rate']:.1%} | {tier['device']:.1%} | "
                     f"{tier['host']:.1%} | {tier['storage']:.1%} |")
    lines += ["", "Cache hit rate by round: total (L1 + L2 + L3).", "",
              "| configuration | " + " | ".join(f"round {n}" for n in rounds) + " |", "|---|" + "---:|" * len(rounds)]
    for r in results:
        cells = [f"{x['cache_hit_rate']:.0%} ({_tier_rates(x['hit_rate_by_tier'])})" for x in r["rounds"]]
        lines.append(f"| {r['tag']} | " + " | ".join(cells) + " |")
    lines += ["", "CPU seconds of the server's processes over the run and the drain of its copies to L2 and L3.", "",
              "| configuration | HTTP | scheduler | L3 storage | all |", "|---|---:|---:|---:|---:|"]
    lines += [_cpu_row(r["tag"], r["server"].get("cpu_s", {})) for r in results]
    lines += ["", "TTFT p50 by round (ms).", "",
              "| configuration | " + " | ".join(f"round {n}" for n in rounds) + " |", "|---|" + "---:|" * len(rounds)]
    for r in results:
        lines.append(f"| {r['tag']} | " + " | ".join(f"{x['ttft_ms']['p50']:.0f}" for x in r["rounds"]) + " |")
    return "\n".join(lines) + "\n"


def _cpu_row(tag: str, cpu: dict[str, float]) -> str:
    """A row of CPU seconds by process role ("-": not measured, as in lines written before it was)."""
    cells = [f"{cpu[k]:.1f}" if k in cpu else "-" for k in CPU_ROLES] + [f"{sum(cpu.values()):.1f}" if cpu else "-"]
    return f"| {tag} | " + " | ".join(cells) + " |"


def _tier_rates(rates: dict) -> str:
    return f"{rates['device']:.0%} + {rates['host']:.0%} + {rates['storage']:.0%}"


def plot(results: list[dict], out: Path, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tags = [r["tag"] for r in results]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        ax.plot([x["round"] for x in r["rounds"]], [x["ttft_ms"]["p50"] / 1000 for x in r["rounds"]], marker="o",
                label=r["tag"])
    ax.set(xlabel="round", ylabel="TTFT p50 (s)", title="Time to first token by round")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.savefig(out / f"{name}_ttft_by_round.png", dpi=120, bbox_inches="tight")
    plt.close(fig)

    fig, axes = plt.subplots(1, 3, figsize=(12, 4))
    for ax, key, label in zip(axes, ("input_token_throughput", "output_token_throughput", "request_throughput"),
                              ("input tokens/s", "output tokens/s", "requests/s")):
        ax.bar(tags, [r[key] for r in results], color="tab:blue")
        ax.set(title=label)
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle("Throughput by configuration", y=1.04)
    fig.savefig(out / f"{name}_throughput.png", dpi=120, bbox_inches="tight")
    plt.close(fig)

    fig, axes = plt.subplots(1, len(results), figsize=(3.2 * len(results), 3.8), sharey=True, squeeze=False)
    for ax, r in zip(axes[0], results):
        rounds, bottom = [x["round"] for x in r["rounds"]], [0.0] * len(r["rounds"])
        for tier, label in zip(multiturn.TIERS, ("L1 (device)", "L2 (host)", "L3 (storage)")):
            vals = [x["hit_rate_by_tier"][tier] for x in r["rounds"]]
            ax.bar(rounds, vals, bottom=bottom, label=label)
            bottom = [a + b for a, b in zip(bottom, vals)]
        ax.set(title=r["tag"], xlabel="round", ylim=(0, 1))
    axes[0][0].set(ylabel="cached / prompt tokens")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, bbox_to_anchor=(0.5, -0.1))
    fig.suptitle("Cache hit rate per tier by round", y=1.03)
    fig.savefig(out / f"{name}_hit_rate_by_round.png", dpi=120, bbox_inches="tight")
    plt.close(fig)


if __name__ == "__main__":
    main()
