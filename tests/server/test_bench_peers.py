"""benchmarks/peers.py's summary on synthetic runs (no server, no peer installed): the ratios are
medians of per-repeat ratios over the repeats both peers ran, oriented so that above 1 means
hicache is faster for throughput; failed repeats and missing peers show as "-"."""
from __future__ import annotations

import random
import statistics
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
import peers  # noqa: E402

sys.path.remove(str(BENCH))


def run(seconds: float, ttft: float, itl: float) -> dict:
    return {"mixed": {"seconds": seconds, "output_tok_s": 100 / seconds, "total_tok_s": 900 / seconds,
                      "ttft_p50_s": ttft, "ttft_p90_s": 2 * ttft}, "itl_ms": itl, "rss_mib": 500, "startup_s": 3}


def test_ratios_are_medians_of_per_repeat_ratios():
    rng = random.Random()
    ours = [rng.uniform(10, 20) for _ in range(3)]
    theirs = [rng.uniform(10, 20) for _ in range(3)]
    runs = {"hicache": [run(s, s / 4, 20) for s in ours],
            "vllm": [run(s, s / 2, 30) for s in theirs] + [{"error": "boom", "rss_mib": 900}]}
    runs["hicache"].append(run(99, 1, 20))  # the repeat vllm failed: not counted
    want = statistics.median(t / o for o, t in zip(ours, theirs))
    assert peers.ratio(runs, "vllm", ("mixed", "seconds"), invert=True) == want
    assert peers.ratio(runs, "vllm", ("mixed", "ttft_p50_s"), invert=False) == statistics.median(
        (o / 4) / (t / 2) for o, t in zip(ours, theirs))
    assert peers.ratio(runs, "vllm", ("itl_ms",), invert=False) == 20 / 30
    assert peers.median_of(runs["vllm"], "mixed", "seconds") == statistics.median(theirs)
    text = peers.table(runs, ["mixed", "shared"])
    assert f"| vllm | {want:.2f} | " in text  # the ratio row: mixed throughput first
    assert "| shared | vllm | - | - | - | - / - |" in text  # not run: no figures
    assert "Ratios" not in peers.table({"vllm": runs["vllm"]}, ["mixed"])  # no hicache, no ratios


def test_agreement_counts_identical_greedy_texts():
    runs = {"hicache": [{"greedy": ["a b", "c", "d"]}], "vllm": [{"greedy": ["a b", "x", "d"]}],
            "llama.cpp": [{"error": "no server"}]}
    lines = peers.agreement(runs)
    assert lines[0] == "greedy outputs, vllm vs hicache: 2 of 3 identical" and "'c' | 'x'" in lines[1]
    assert len(lines) == 2  # llama.cpp gave none: nothing said


def test_quick_takes_one_repeat_unless_told():
    assert peers.parse_args(["--quick"]).repeats == 1
    assert peers.parse_args(["--quick", "--repeats", "2"]).repeats == 2
    args = peers.parse_args(["--peers", "hicache", "vllm"])
    assert args.repeats == 3 and args.sizes == peers.FULL and args.peers == ["hicache", "vllm"]
