"""The benchmark suite: multiturn.py's driver against a fake server (arrival rules, errors), then
against a live server benchmarks/multiturn.py (native and OpenAI clients) and
benchmarks/long_context.py run as scripts for a tiny workload; the JSON lines they append are
checked, then fed to compare.py's tables and plots; the CPU readings of a server's process tree
(proctree.py) and storage.py's page-cache floor."""
from __future__ import annotations

import asyncio
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from server_harness import start_server

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def bench_module(name: str):
    """A script of benchmarks/ imported as a module (the folder on the path for the import only)."""
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))


multiturn = bench_module("multiturn")
CLIENTS, ROUNDS, QUESTION, OUTPUT, PAGE = 4, 3, 32, 4, 16


def fake_server(fail_at: tuple[int, int] | None = None):
    """A `send` that answers after a short sleep with OUTPUT tokens, and a log of (event, session, round)."""
    log, active = [], [0]

    async def send(turn):
        active[0] += 1
        log.append(("start", turn.session, turn.round, active[0]))
        await asyncio.sleep(0.01 * (1 + 10 * turn.session))  # conversation 0 is fast, 2 slow
        active[0] -= 1
        log.append(("end", turn.session, turn.round, active[0]))
        if (turn.session, turn.round) == fail_at:
            raise RuntimeError("HTTP 500: boom")
        return multiturn.Reply([(multiturn.time.perf_counter(), OUTPUT)], [7] * OUTPUT, len(turn.prompt), OUTPUT,
                               len(turn.prompt) // 2, {"device": len(turn.prompt) // 2})

    return send, log


def drive(argv: list[str], send) -> tuple[multiturn.Driver, float]:
    args = multiturn.parse_args(["--num-clients", "3", "--num-rounds", "3", "--request-length", "8",
                                 "--output-length", str(OUTPUT), *argv])
    driver = multiturn.Driver(multiturn.MultiTurn(args), send, args)
    return driver, asyncio.run(driver.run())


def test_driver_round_barrier_and_in_flight_cap():
    send, log = fake_server()
    driver, duration = drive(["--round-barrier", "--max-parallel", "2"], send)
    assert len(driver.records) == 9 and duration > 0
    assert max(e[3] for e in log if e[0] == "start") == 2  # the cap, reached
    for r in (1, 2):  # no round-r request starts before every round r-1 request has ended
        first_start = min(i for i, e in enumerate(log) if e[0] == "start" and e[2] == r)
        last_end = max(i for i, e in enumerate(log) if e[0] == "end" and e[2] == r - 1)
        assert last_end < first_start
    # each round resends the conversation: round r's prompt = (r + 1) questions + r answers
    assert sorted({(r.round, r.prompt_tokens) for r in driver.records}) == [(0, 8), (1, 20), (2, 32)]


def test_driver_without_barrier_lets_fast_conversations_run_ahead():
    send, log = fake_server()
    drive(["--max-parallel", "3"], send)
    starts = [(e[1], e[2]) for e in log if e[0] == "start"]
    assert starts.index((0, 2)) < starts.index((2, 1))  # the fastest conversation is a round ahead


def test_driver_error_fails_the_run():
    send, _ = fake_server(fail_at=(1, 1))
    with pytest.raises(RuntimeError, match="boom"):
        drive(["--round-barrier"], send)


def test_summary_metrics():
    records = [multiturn.make_record(multiturn.Turn(0, r, []), 10.0,
                                     multiturn.Reply([(10.5, 1), (10.7, 2), (11.0, 1)], [], 100, 4, 50 * r,
                                                     {"device": 30 * r, "host": 20 * r}))
               for r in range(2)]
    assert records[0].ttft == pytest.approx(0.5) and records[0].e2e == pytest.approx(1.0)
    assert records[0].itls == pytest.approx([0.1, 0.1, 0.3])  # a chunk of two tokens: two gaps of half
    s = multiturn.summarize(records, 2.0)
    assert s["request_throughput"] == 1.0 and s["input_token_throughput"] == 100 and s["output_token_throughput"] == 4
    assert s["cache_hit_rate"] == 0.25 and s["hit_rate_by_tier"] == {"device": 0.15, "host": 0.1, "storage": 0.0}
    assert [r["cache_hit_rate"] for r in s["rounds"]] == [0.0, 0.5]
    assert s["ttft_ms"]["p50"] == pytest.approx(500) and s["working_set_tokens"] == 104


def test_an_empty_log_file_appends_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    multiturn.append_jsonl({"requests": 1}, "")  # a warm-up run's results, kept nowhere
    assert list(tmp_path.iterdir()) == []
    multiturn.append_jsonl({"requests": 2}, tmp_path / "runs.jsonl")
    assert [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()] == [{"requests": 2}]


def storage_off() -> list[str]:
    """`--hicache-storage-backend none` where the server has an L3 tier, so no test writes to the user's."""
    out = subprocess.run([sys.executable, "-m", "hicache.server.cli", "serve", "--help"], capture_output=True,
                         text=True, timeout=120).stdout
    return ["--hicache-storage-backend", "none"] if "--hicache-storage-backend" in out else []


@pytest.fixture(scope="module")
def small_l1_server():
    """L1 holds under half of the multi-turn working set (4 x 108 tokens); L2 holds all of it."""
    handle = start_server("--max-total-tokens", "192", "--page-size", str(PAGE), "--hicache-ratio", "4",
                          "--chunked-prefill-size", "128", "--max-running-requests", "8", *storage_off())
    try:
        yield handle
    finally:
        handle.stop()


def run_bench(script: str, url: str, log: Path, *args: str) -> dict:
    cmd = [sys.executable, str(BENCH / script), "--url", url, "--log-file", str(log), "--output-length", str(OUTPUT), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "cache hit rate" in proc.stdout
    lines = log.read_text().splitlines()
    return json.loads(lines[-1])


def check_latencies(result: dict) -> None:
    for key in ("ttft_ms", "itl_ms", "e2e_ms"):
        stats = result[key]
        assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"], (key, stats)
    assert result["ttft_ms"]["p50"] <= result["e2e_ms"]["p99"]
    assert result["input_token_throughput"] > 0 and result["output_token_throughput"] > 0
    assert result["request_throughput"] > 0


@pytest.mark.model
def test_multiturn_native(small_l1_server, tmp_path):
    log = tmp_path / "mt.jsonl"
    result = run_bench("multiturn.py", small_l1_server.url, log, "--num-clients", str(CLIENTS), "--num-rounds",
                       str(ROUNDS), "--request-length", str(QUESTION), "--max-parallel", "4", "--round-barrier",
                       "--request-rate", "50", "--seed", "3")
    assert result["benchmark"] == "multiturn" and result["requests"] == CLIENTS * ROUNDS
    assert result["completion_tokens"] == CLIENTS * ROUNDS * OUTPUT
    # round r sends every earlier question and answer: (r + 1) questions and r answers, exactly (input ids)
    assert [r["prompt_tokens"] for r in result["rounds"]] == [CLIENTS * ((r + 1) * QUESTION + r * OUTPUT)
                                                              for r in range(ROUNDS)]
    assert [r["requests"] for r in result["rounds"]] == [CLIENTS] * ROUNDS
    assert result["working_set_tokens"] == CLIENTS * ROUNDS * (QUESTION + OUTPUT)
    rounds = result["rounds"]
    assert rounds[0]["cache_hit_rate"] == 0  # flushed at the start, distinct random questions
    for r in rounds[1:]:
        assert r["cache_hit_rate"] > 0, r
        # at most what the earlier rounds computed: the previous prompt and its answer
        assert r["cached_tokens"] <= CLIENTS * (r["round"] * (QUESTION + OUTPUT))
    tiers = result["hit_rate_by_tier"]
    assert tiers["host"] > 0, tiers  # L1 is too small to keep every conversation
    assert sum(tiers.values()) == pytest.approx(result["cache_hit_rate"], abs=1e-3)
    check_latencies(result)
    again = run_bench("multiturn.py", small_l1_server.url, log, "--num-clients", "2", "--num-rounds", "2",
                      "--request-length", "16")
    assert len(log.read_text().splitlines()) == 2 and again["requests"] == 4  # appended, not overwritten


@pytest.mark.model
def test_multiturn_openai(small_l1_server, tmp_path):
    result = run_bench("multiturn.py", small_l1_server.url, tmp_path / "oa.jsonl", "--api", "openai",
                       "--num-clients", "2", "--num-rounds", "2", "--request-length", "24", "--distribution",
                       "uniform", "--request-rate", "20")
    assert result["api"] == "openai" and result["requests"] == 4
    assert result["args"]["model"]  # named from /v1/models
    r0, r1 = result["rounds"]
    assert r1["prompt_tokens"] > r0["prompt_tokens"] + 2 * 24  # the history (with the answers) is resent
    assert r1["cache_hit_rate"] > 0
    check_latencies(result)


@pytest.mark.model
def test_long_context_and_compare_outputs(small_l1_server, tmp_path):
    result = run_bench("long_context.py", small_l1_server.url, tmp_path / "lc.jsonl", "--num-docs", "2",
                       "--doc-length", "64", "96", "--questions-per-doc", "3", "--question-length", "8",
                       "--max-parallel", "2", "--round-barrier")
    assert result["benchmark"] == "long_context" and result["requests"] == 6
    assert [r["requests"] for r in result["rounds"]] == [2, 2, 2]
    assert result["rounds"][0]["cache_hit_rate"] == 0
    assert all(r["cache_hit_rate"] > 0 for r in result["rounds"][1:])  # the documents are reused

    pytest.importorskip("matplotlib")
    compare = bench_module("compare")
    log = tmp_path / "t.jsonl"
    cpu = {"L1+L2": {"http": 0.5, "scheduler": 3.0, "storage": 1.3, "other": 0.0}}  # L1's lines predate it
    for name in ("L1+L2", "L1", "L1"):  # written out of order, L1 twice: the table takes the latest, in order
        server = {"capacity_tokens": {"device": 192, "host": 768, "storage": 0}}
        multiturn.append_jsonl(dict(result, tag=name, server={**server, **({"cpu_s": cpu[name]} if name in cpu else {})},
                                    compare={"command": "compare.py --test", "planned_working_set": 1000,
                                             "l1_tokens": 192}), log)
    compare.main(["--replot", "--name", "t", "--out", str(tmp_path)])
    md = (tmp_path / "t.md").read_text()
    assert md.count("\n| L1 |") == 4 and md.count("\n| L1+L2 |") == 4  # four tables, one row each
    assert "\n| L1+L2 | 0.5 | 3.0 | 1.3 | 4.8 |" in md and "\n| L1 | - | - | - | - |" in md
    assert md.index("\n| L1 |") < md.index("\n| L1+L2 |") and "round 2" in md and "compare.py --test" in md
    for suffix in ("ttft_by_round", "throughput", "hit_rate_by_round"):
        assert (tmp_path / f"t_{suffix}.png").stat().st_size > 1000


@pytest.mark.model
def test_peers_workloads_through_openai(small_l1_server):
    """benchmarks/peers.py's batch workloads (text prompts through /v1/completions, chats behind one
    system prompt), its batch-1 decode and its greedy texts against the live server."""
    peers = bench_module("peers")
    import httpx

    model = httpx.get(small_l1_server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    target = peers.Target(small_l1_server.url, model, ())
    sizes = peers.QUICK._replace(batch=2, out=OUTPUT, mixed=(20, 40), system=48, question=8, itl_out=OUTPUT,
                                 agreement=1, agreement_out=OUTPUT)
    for name in ("mixed", "shared"):
        r = peers.run_workload(name, target, 5, sizes)
        assert r["requests"] == 2 and r["output_tokens"] == 2 * OUTPUT, r
        assert 0 < r["ttft_p50_s"] <= r["ttft_p90_s"] <= r["seconds"] and r["total_tok_s"] > r["output_tok_s"]
    assert peers.decode_itl_ms(target, 6, sizes) > 0
    texts = peers.greedy_texts(target, sizes)
    assert len(texts) == 1 and texts[0]


TREE = """
import subprocess, sys, time
burn = "import sys, time\\nwhile time.process_time() < 0.3: pass\\nprint('burnt', flush=True)\\ntime.sleep(60)"
kids = [subprocess.Popen([sys.executable, "-c", burn, *extra], stdout=subprocess.PIPE, text=True)
        for extra in ([], ["hicache.tiers.remote.process_main"])]
for k in kids:
    k.stdout.readline()
print("ready", flush=True)
time.sleep(60)
"""


def test_proctree_cpu_by_role():
    """compare.py's CPU table: a live tree's CPU seconds summed by role, the storage process told
    apart by its module on the command line."""
    proctree = bench_module("proctree")
    root = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True)
    try:
        assert root.stdout.readline().strip() == "ready"
        cpu = proctree.tree_cpu(root.pid)  # each child burnt 0.3 s (psutil counts in clock ticks)
        assert set(cpu) == {"http", "scheduler", "storage"}
        assert cpu["scheduler"] >= 0.25 and cpu["storage"] >= 0.25 and cpu["http"] < 0.25
        since = proctree.cpu_since(root.pid, {"scheduler": 0.1})
        assert abs(since["scheduler"] - (cpu["scheduler"] - 0.1)) < 0.05 and since["storage"] >= 0.25
        assert len(proctree.processes(root.pid)) == 3
    finally:
        for p in reversed(proctree.processes(root.pid)):
            p.kill()
        root.wait()
    assert proctree.tree_cpu(root.pid) == {} and proctree.tree_rss(root.pid) == 0


def test_storage_page_cache_floor(tmp_path):
    """storage.py's floor under LMDB's writes: three rates, the file it wrote removed."""
    storage = bench_module("storage")
    floor = storage.page_cache_floor(str(tmp_path), 8)
    assert set(floor) == {"new", "new_again", "overwrite"} and all(v > 0 for v in floor.values())
    assert not any(tmp_path.iterdir())
