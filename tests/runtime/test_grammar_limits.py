"""What one grammar may cost: its text and its EBNF form are bounded before anything compiles
(`check_grammar`), and the compiled grammars kept are bounded in memory (`GrammarCompiler`)."""
from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

from hicache.runtime.grammar import CACHE_BYTES, MAX_GRAMMAR_CHARS, MAX_GRAMMAR_TEXT, GrammarCompiler, check_grammar


def test_an_enum_too_large_to_compile_is_refused_at_once_naming_the_limit():
    schema = json.dumps({"type": "string", "enum": [f"v{i}" for i in range(100_000)]})
    start = time.perf_counter()
    with pytest.raises(ValueError, match=rf"^json_schema is too large to compile: .* at most {MAX_GRAMMAR_CHARS}"):
        check_grammar("json_schema", schema)
    assert time.perf_counter() - start < 10


@pytest.mark.parametrize("kind, text", [
    ("regex", "(" + "|".join(f"word{i}" for i in range(40_000)) + ")"),
    ("ebnf", "root ::= " + " | ".join(f'"word{i}"' for i in range(40_000))),
])
def test_alternatives_too_many_to_compile_are_refused(kind, text):
    with pytest.raises(ValueError, match=rf"^{kind} is too large to compile"):
        check_grammar(kind, text)


def test_a_text_past_the_limit_is_refused_before_parsing():
    text = json.dumps({"type": "object", "description": "x" * MAX_GRAMMAR_TEXT})
    start = time.perf_counter()
    with pytest.raises(ValueError, match=rf"^json_schema is too long: {len(text)} characters, at most {MAX_GRAMMAR_TEXT}"):
        check_grammar("json_schema", text)
    assert time.perf_counter() - start < 1


def test_grammars_within_the_limits_pass():
    check_grammar("json_schema", json.dumps({"type": "string", "enum": [f"v{i}" for i in range(1000)]}))
    check_grammar("json_schema", json.dumps({"type": "object", "properties": {
        f"property_{i}": {"type": "integer"} for i in range(100)}}))


def test_the_compiled_grammars_kept_are_bounded_in_memory(monkeypatch):
    """Compiled grammars of a third of the bound each: the cache keeps the three that fit and the
    newest, however many entries it could hold."""
    compiler = GrammarCompiler(None, 0, [])
    monkeypatch.setattr(compiler, "_compile", lambda kind, text: SimpleNamespace(memory_size_bytes=CACHE_BYTES // 3 - 64))
    try:
        for i in range(8):
            grammar = compiler.start("regex", f"a{i}")
            grammar._compiled.result()
            assert compiler.cached() <= 4
        assert compiler.cached() == 4 and grammar.done
    finally:
        compiler.close()
