"""Bounded strings rewritten (runtime/json_grammar.py) accept what XGrammar's own JSON-schema
grammar accepts: the same next-token masks and forced text at every state of random walks (tokens
drawn from each state's allowed set, fresh seed each run) through the structured-output suite's
schemas, on the default model's tokenizer."""
from __future__ import annotations

import json
import random

import pytest
import torch
import xgrammar as xgr

from hicache.runtime.grammar import MAX_JSON_WHITESPACE
from hicache.runtime.json_grammar import MAX_UNROLLED, json_schema_grammar, unroll_bounded_strings
from hicache.runtime.tokenizer import load_tokenizer
from schemas import SCHEMAS

pytestmark = pytest.mark.model
WALKS, STEPS = 3, 40
BOUNDED = [s for s in SCHEMAS if unroll_bounded_strings(str(xgr.Grammar.from_json_schema(json.dumps(s)))) !=
           str(xgr.Grammar.from_json_schema(json.dumps(s)))]


@pytest.fixture(scope="module")
def compiler(default_model_path):
    tok = load_tokenizer(default_model_path)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok), stop_token_ids=[tok.eos_token_id])
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False), len(tok)


def _walk(ours, theirs, vocab: int, rng: random.Random) -> int:
    """Steps walked with equal masks and forced text; fails at the first difference."""
    a, b = xgr.GrammarMatcher(ours), xgr.GrammarMatcher(theirs)
    masks = [torch.empty((1, (vocab + 31) // 32), dtype=torch.int32) for _ in range(2)]
    for step in range(STEPS):
        a.fill_next_token_bitmask(masks[0])
        b.fill_next_token_bitmask(masks[1])
        assert torch.equal(masks[0], masks[1]), step
        assert a.find_jump_forward_string() == b.find_jump_forward_string(), step
        bits = (masks[0][0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = bits.flatten()[:vocab].nonzero().flatten().tolist()
        token = rng.choice(allowed)
        assert a.accept_token(token) and b.accept_token(token), step
        if a.is_terminated():
            assert b.is_terminated()
            return step
    return STEPS


def test_unrolled_strings_accept_what_xgrammar_accepts(compiler):
    comp, vocab = compiler
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    assert len(BOUNDED) >= 5, "the suite's schemas bound their strings"
    for schema in BOUNDED:
        text = json.dumps(schema)
        ours = comp.compile_grammar(json_schema_grammar(text, MAX_JSON_WHITESPACE))
        theirs = comp.compile_json_schema(text, max_whitespace_cnt=MAX_JSON_WHITESPACE)
        for _ in range(WALKS):
            assert _walk(ours, theirs, vocab, rng) > 0, (seed, schema)


def test_only_bounded_strings_are_rewritten():
    ebnf = str(xgr.Grammar.from_json_schema(json.dumps({"type": "array", "items": {"type": "string"}, "maxItems": 3})))
    assert unroll_bounded_strings(ebnf) == ebnf
    long = {"type": "string", "minLength": 2, "maxLength": MAX_UNROLLED + 1}
    ebnf = str(xgr.Grammar.from_json_schema(json.dumps(long)))
    assert unroll_bounded_strings(ebnf) == ebnf
    literal = 'root_prop_0_characters{2, 5} "'  # an enum value that reads like a bounded string
    ebnf = str(xgr.Grammar.from_json_schema(json.dumps({"type": "object", "properties": {
        "a": {**long, "maxLength": 5}, "b": {"enum": [literal]}}, "required": ["a", "b"]})))
    rewritten = unroll_bounded_strings(ebnf)
    assert ebnf.count("{2, 5}") == 2 and rewritten.count("{2, 5}") == 1 and "_close_3 ::=" in rewritten
    xgr.Grammar.from_ebnf(rewritten)
