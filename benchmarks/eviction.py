"""Eviction policies side by side: the L1 + L2 hit rate by round of each policy on multi-session
workloads, simulated on CPU through the real cache manager and radix tree (fake tiers, page 4).

    .venv/bin/python benchmarks/eviction.py [--policies next_use,lru,lfu,lfu_aging] [--name eviction_sim]

The workloads are those of tests/hicache/eviction_sim.py: conversations that come back in turn
(the serving shape scaled down 16x: 64 conversations, 8 in flight, L1 20% and L2 50% of the final
working set, so that round 0 alone overflows L2), the same with re-tokenized answers, with a
shared system prompt, a few conversations that fit, an agent extending one conversation among
one-off prompts, sessions that come and go, many users of one system prompt, and Zipf-popular
conversations. Prints a Markdown table: hit rate per round, the mean from round 1 on, and the
lowest round from round 1 on as a fraction of that mean. Writes the rates to
results/NAME.json and a plot of them, one panel per workload, to
results/NAME_hit_rate_by_round.png.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(RESULTS.parent.parent / "tests" / "hicache"))

import eviction_sim as sim  # noqa: E402
from hicache.eviction import STRATEGIES  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default=",".join(STRATEGIES))
    ap.add_argument("--name", default="eviction_sim", help="file names under results/")
    args = ap.parse_args()
    policies = args.policies.split(",")
    out = {}
    print("| workload (L1, L2: shares of the final working set) | policy | round 0 | 1 | 2 | 3 | 4 | 5 "
          "| mean 1-5 | min / mean |")
    print("|---|---|" + "---:|" * 8)
    for w in sim.workloads():
        for p in policies:
            rates = sim.play(p, w)
            later = rates[1:]
            mean = sum(later) / len(later)
            low = min(later) / mean if mean else 0.0
            cells = " | ".join(f"{r:.2f}" for r in rates)
            print(f"| {w.name} ({w.l1:.0%}, {w.l2:.0%}) | {p} | {cells} | {mean:.2f} | {low:.2f} |")
            out.setdefault(w.name, {})[p] = rates
    (RESULTS / f"{args.name}.json").write_text(json.dumps(out, indent=1) + "\n")
    plot(out, RESULTS / f"{args.name}_hit_rate_by_round.png")


def plot(rates: dict[str, dict[str, list[float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 5
    rows = -(-len(rates) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.3 * rows), sharey=True, squeeze=False)
    fig.subplots_adjust(hspace=0.45)
    for ax, (name, by_policy) in zip(axes.flat, rates.items()):
        for policy, r in by_policy.items():
            ax.plot(range(len(r)), r, marker="o", label=policy)
        ax.set(title=name, xlabel="round", ylim=(0, 1))
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(rates):]:
        ax.axis("off")
    for row in axes:
        row[0].set(ylabel="L1 + L2 cached / prompt")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), bbox_to_anchor=(0.5, -0.04))
    fig.suptitle("Hit rate by round per eviction policy (simulated)", y=1.01)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


if __name__ == "__main__":
    main()
