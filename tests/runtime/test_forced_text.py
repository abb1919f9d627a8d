"""The forced text of a grammar, found a byte at a time (runtime/forced_text.py): XGrammar's own
forced string wherever that is short, at most the bound asked for where the grammar forces
endless text, and the jump-forward of such a grammar bounded by what the request may append."""
from __future__ import annotations

import json
import random
import time

import numpy as np
import pytest

from engines import make_engine
from hicache.runtime.forced_text import ForcedText
from hicache.runtime.json_grammar import json_schema_grammar
from schemas import EBNFS, REGEXES, SCHEMAS

pytestmark = pytest.mark.model

# a grammar whose one string is 2^40 "xy"s, and one that never ends
DOUBLING = "\n".join(["root ::= a40"] + [f"a{i} ::= a{i - 1} a{i - 1}" for i in range(40, 0, -1)] + ['a0 ::= "xy"'])
ENDLESS = 'root ::= "x" root'


@pytest.fixture(scope="module")
def info(hf_tokenizer):
    import xgrammar as xgr

    return xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=49152, stop_token_ids=[2])


@pytest.fixture(scope="module")
def compiler(info):
    import xgrammar as xgr

    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


@pytest.fixture(scope="module")
def finder(info):
    return ForcedText(info)


def _allowed(matcher, mask) -> list[int]:
    matcher.fill_next_token_bitmask(mask)
    words = mask[0].numpy().view(np.uint32)
    return np.flatnonzero(((words[:, None] >> np.arange(32, dtype=np.uint32)) & 1).ravel()).tolist()


def test_the_forced_text_is_xgrammars_along_random_walks(compiler, finder):
    import xgrammar as xgr

    grammars = ([compiler.compile_grammar(json_schema_grammar(json.dumps(s), 16)) for s in SCHEMAS[:4]]
                + [compiler.compile_regex(r) for r, _ in REGEXES] + [compiler.compile_grammar(g) for g, _, _ in EBNFS]
                + [compiler.compile_regex("é|è")])
    mask = xgr.allocate_token_bitmask(1, 49152)
    rng = random.Random(0)
    checked = 0
    for compiled in grammars:
        matcher = xgr.GrammarMatcher(compiled)
        for _ in range(25):
            if matcher.is_terminated():
                break
            assert finder.find(matcher, 1 << 20) == matcher.find_jump_forward_string()
            checked += 1
            allowed = _allowed(matcher, mask)
            assert matcher.accept_token(rng.choice(allowed) if len(allowed) < 1000 or rng.random() < 0.5 else allowed[0])
    assert checked > 50


@pytest.mark.parametrize("grammar", [DOUBLING, ENDLESS])
def test_endless_forced_text_is_cut_at_the_bound(compiler, finder, grammar):
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiler.compile_grammar(grammar))
    start = time.perf_counter()
    text = finder.find(matcher, 1000)
    assert len(text) == 1000 and set(text) <= {"x", "y"}
    assert time.perf_counter() - start < 5
    assert matcher.accept_string(text)  # the matcher was not advanced by the search


@pytest.fixture(scope="module")
def engine(default_model_path):
    e = make_engine(default_model_path, jump_forward=True, max_total_tokens=1024, page_size=16)
    yield e
    e.shutdown()


@pytest.mark.parametrize("grammar", [DOUBLING, ENDLESS])
def test_a_grammar_forcing_endless_text_costs_what_the_request_may_append(engine, grammar):
    """Jump-forward tokenizes no more than the request may append: the tokenizer sees a few
    bytes per token of max_new_tokens, and the request ends by length with as many tokens."""
    tokenizer = engine.scheduler.tokenizer
    seen: list[int] = []
    encode = tokenizer.encode

    def recording(text, *args, **kwargs):
        seen.append(len(text))
        return encode(text, *args, **kwargs)

    tokenizer.encode = recording
    try:
        out = engine.generate("Say x.", sampling_params={"ebnf": grammar, "max_new_tokens": 40, "temperature": 0})
    finally:
        del tokenizer.encode
    assert out["meta_info"]["finish_reason"]["type"] == "length" and len(out["output_ids"]) == 40
    assert set(out["text"]) <= {"x", "y"}
    assert seen and max(seen) < 1000, seen
    engine.check_integrity()
