"""The host cost of JSON-schema-constrained decoding per request and step: filling the next-token
bitmask and advancing the matcher, for `structured.py`'s schema, without a model.

    python benchmarks/grammar_fill.py [--tokenizer FOLDER] [--vocab-size 128256] [--batch 64] [--threads 1 8]

`--batch` matchers walk `--steps` tokens each, every token drawn uniformly from the tokens the
grammar allows there (what the random logits of dummy weights give: strings of odd characters up
to their length bound, runs of whitespace, numbers); the walks are drawn once, then replayed for
each grammar and thread count, so that all fill the same states. Grammars: `xgrammar` (its
`compile_json_schema`) and `hicache` (what runtime/grammar.py compiles: runtime/json_grammar.py's rewrite).
Prints the fill (XGrammar's `BatchGrammarMatcher`, on `--threads` threads) and the batch accept,
in microseconds per row, and the batch's milliseconds per step.
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch

from structured import schema
from hicache.runtime.bitmask import bitmask_words
from hicache.runtime.grammar import MAX_JSON_WHITESPACE
from hicache.runtime.json_grammar import json_schema_grammar


def walks(grammars: list, vocab: int, steps: int, rng: random.Random) -> list[list[int]]:
    """Each grammar's tokens, drawn from its allowed set at each step (matchers left reset)."""
    import xgrammar as xgr

    out = []
    for g in grammars:
        m, mask, tokens = xgr.GrammarMatcher(g), torch.empty((1, bitmask_words(vocab)), dtype=torch.int32), []
        for _ in range(steps):
            m.fill_next_token_bitmask(mask)
            bits = (mask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
            tokens.append(rng.choice(bits.flatten()[:vocab].nonzero().flatten().tolist()))
            assert m.accept_token(tokens[-1])
        out.append(tokens)
    return out


def replay(compiled, tokens: list[list[int]], vocab: int, threads: int) -> tuple[float, float]:
    """Seconds of fill and of accept over the walks, the batch stepping together."""
    import xgrammar as xgr

    matchers = [xgr.GrammarMatcher(compiled) for _ in tokens]
    filler = xgr.BatchGrammarMatcher(threads)
    mask = torch.empty((len(tokens), bitmask_words(vocab)), dtype=torch.int32)
    rows = list(range(len(tokens)))
    fill = accept = 0.0
    for step in range(len(tokens[0])):
        t0 = time.perf_counter()
        filler.batch_fill_next_token_bitmask(matchers, mask, rows)
        t1 = time.perf_counter()
        oks = xgr.BatchGrammarMatcher.batch_accept_token(matchers, [t[step] for t in tokens])
        accept += time.perf_counter() - t1
        fill += t1 - t0
        assert all(oks)
    return fill, accept


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default=None, help="a tokenizer folder (default: the default model's)")
    ap.add_argument("--vocab-size", type=int, default=128256, help="the model's vocabulary (the mask's width)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import xgrammar as xgr

    from hicache.runtime.default_model import default_model_path
    from hicache.runtime.tokenizer import load_tokenizer

    tok = load_tokenizer(args.tokenizer or default_model_path())
    text = json.dumps(schema(args.steps))
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=args.vocab_size, stop_token_ids=[tok.eos_token_id])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    grammars = {"xgrammar": compiler.compile_json_schema(text, max_whitespace_cnt=MAX_JSON_WHITESPACE),
                "hicache": compiler.compile_grammar(json_schema_grammar(text, MAX_JSON_WHITESPACE))}
    rng = random.Random(args.seed)
    tokens = [w for _ in range(args.batch) for w in walks([grammars["hicache"]], args.vocab_size, args.steps, rng)]
    steps = args.batch * args.steps
    for name, compiled in grammars.items():
        for threads in args.threads:
            fill, accept = replay(compiled, tokens, args.vocab_size, threads)
            print(f"{name:8s} {threads:2d} threads: fill {fill / steps * 1e6:7.1f} us/row "
                  f"({fill / args.steps * 1e3:6.2f} ms per step of {args.batch}), "
                  f"accept {accept / steps * 1e6:5.1f} us/row ({accept / args.steps * 1e3:5.2f} ms per step)")


if __name__ == "__main__":
    main()
