"""Long-context benchmark: a few long documents, many questions about each, arriving interleaved.

`--num-docs` documents of `--doc-length MIN MAX` tokens (default 8k to 32k) get `--questions-per-doc`
questions of `--question-length` tokens each; a request is one document followed by one question,
answered with `--output-length` tokens (`ignore_eos`). Requests are queued round-robin over the
documents (question 0 of every document, then question 1 of every document, ...), so consecutive
requests share no prefix and a document's KV must stay cached (in some tier) while the other
documents are read. A "round" in the report is a question index: round 0 reads each document
cold, later rounds can hit. Arrivals, the in-flight cap, the round barrier, the protocols and the
report are those of `multiturn.py` (its options apply).

    .venv/bin/python benchmarks/long_context.py --url http://127.0.0.1:30000 \\
        --num-docs 4 --doc-length 8192 32768 --questions-per-doc 16 --max-parallel 8

The default model (SmolLM2-135M, 8k context) needs shorter documents, e.g. `--doc-length 2048 6144`.
"""
from __future__ import annotations

import argparse
import asyncio
import random

from multiturn import RESULTS, Reply, Turn, add_common_args, append_jsonl, question, report, run


class LongContext:
    """Every request is ready at once, ordered round-robin over the documents."""

    def __init__(self, args):
        rng = random.Random(args.seed)
        self.args = args
        self.docs = [question(rng, rng.randint(*args.doc_length), args) for _ in range(args.num_docs)]
        self.questions = [[question(rng, args.question_length, args) for _ in range(args.questions_per_doc)]
                          for _ in range(args.num_docs)]
        self.round_sizes = {q: args.num_docs for q in range(args.questions_per_doc)}

    def start(self) -> list[Turn]:
        return [self._turn(d, q) for q in range(self.args.questions_per_doc) for d in range(self.args.num_docs)]

    def complete(self, turn: Turn, reply: Reply) -> list[Turn]:
        return []

    def _turn(self, d: int, q: int) -> Turn:
        if self.args.api == "openai":
            return Turn(d, q, [{"role": "user", "content": self.docs[d] + "\n\n" + self.questions[d][q]}])
        return Turn(d, q, self.docs[d] + self.questions[d][q])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-docs", type=int, default=4)
    p.add_argument("--doc-length", type=int, nargs=2, default=[8192, 32768], metavar=("MIN", "MAX"),
                   help="document lengths in tokens, drawn uniform in [MIN, MAX]")
    p.add_argument("--questions-per-doc", type=int, default=16)
    p.add_argument("--question-length", type=int, default=64)
    p.add_argument("--log-file", default=str(RESULTS / "long_context.jsonl"), help="JSON line appended here ('': none)")
    add_common_args(p)
    args = p.parse_args(argv)
    args.benchmark = "long_context"
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    result = asyncio.run(run(args, LongContext(args)))
    print(report(result))
    append_jsonl(result, args.log_file)


if __name__ == "__main__":
    main()
