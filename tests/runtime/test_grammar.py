"""Grammar-constrained decoding on the default model through the Engine: outputs parse and
validate against their JSON schema (the `jsonschema` package), regular expression or EBNF grammar,
batched, streamed, with overlap scheduling forced on (the mask applied in continuation steps),
and across retractions (a KV pool too small for the batch)."""
from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest

from engines import make_engine
from hicache.runtime.grammar import GrammarCompiler, fill_bitmask
from schemas import EBNFS, REGEXES, SCHEMAS, schema_prompt

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def engine(default_model_path):
    e = make_engine(default_model_path, enable_overlap_schedule=True, max_total_tokens=384, page_size=16)
    yield e
    e.shutdown()


def _valid_json(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


def _check(cases: list[tuple[str, object]], outs: list[dict]) -> None:
    """cases: (kind, schema | regex); each output ended by its grammar and matches it."""
    for (kind, want), out in zip(cases, outs, strict=True):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        if kind == "json_schema":
            _valid_json(out["text"], want)
        else:
            assert re.fullmatch(want, out["text"]), (want, out["text"])


def _batch(schemas: list[dict], regexes: list, ebnfs: list, new_tokens: int, **sampling) -> tuple[list, list, list]:
    prompts = [schema_prompt(s) for s in schemas] + [p for _, p in regexes] + [p for _, _, p in ebnfs]
    params = ([{"json_schema": s} for s in schemas] + [{"regex": r} for r, _ in regexes]
              + [{"ebnf": g} for g, _, _ in ebnfs])
    cases = ([("json_schema", s) for s in schemas] + [("regex", r) for r, _ in regexes]
             + [("regex", r) for _, r, _ in ebnfs])
    return prompts, [{**p, "max_new_tokens": new_tokens, **sampling} for p in params], cases


def test_schema_regex_ebnf_batch_with_overlap(engine):
    overlap = engine.scheduler.overlap
    before = overlap.continued
    prompts, params, cases = _batch(SCHEMAS[:3], REGEXES[:1], EBNFS[:1], 40, temperature=0)
    _check(cases, engine.generate(prompts, sampling_params=params))
    assert overlap.continued > before  # decode steps sampled with the mask while the next was planned


def test_sampled_outputs_follow_the_grammar_across_retractions(engine):
    retracted = engine.get_stats()["retractions"]
    regex = r"(ab|cd)( (ab|cd)){14}"
    prompts = [" ".join(str(100 + 7 * i + j) for i in range(18)) + " Now pairs:" for j in range(4)]
    outs = engine.generate(prompts, sampling_params=[{"regex": regex, "max_new_tokens": 64, "temperature": 1.0,
                                                      "seed": j} for j in range(4)])
    assert engine.get_stats()["retractions"] > retracted  # 4 prompts of ~75 tokens fit the pool, their outputs not
    _check([("regex", regex)] * 4, outs)


def test_streamed_json_schema(engine):
    schema = SCHEMAS[11]

    async def stream() -> list[dict]:
        return [r async for r in engine.async_generate(schema_prompt(schema), {"json_schema": schema,
                                                                               "max_new_tokens": 64,
                                                                               "temperature": 0})]

    chunks = asyncio.run(stream())
    assert len(chunks) > 1
    _check([("json_schema", schema)], chunks[-1:])


def test_bad_grammars_raise_naming_the_field(engine):
    for key, value in [("json_schema", "{not json"), ("json_schema", {"type": "nonsense"}), ("regex", "[a-"),
                       ("ebnf", "root ::= undefined_rule"), ("structural_tag", "{}")]:
        with pytest.raises(ValueError, match=f"^{key} "):
            engine.generate("x", sampling_params={key: value})
    with pytest.raises(ValueError, match="^regex cannot be combined with json_schema"):
        engine.generate("x", sampling_params={"json_schema": "{}", "regex": "a"})
    assert engine.generate("x", sampling_params={"regex": "ok", "temperature": 0})["text"] == "ok"


def test_retraction_rolls_the_matcher_back(engine):
    """`sync` makes the matcher's accepted tokens the request's outputs again: after rolling back or
    replaying, its next-token mask equals a fresh matcher's after the same outputs."""
    tok = engine.tokenizer
    compiler = GrammarCompiler(tok, 49152, [tok.eos_token_id])
    outputs = tok.encode('{"a": [1, 22, 333]}', add_special_tokens=False)
    try:
        g, ref = compiler.start("json_schema", "{}"), compiler.start("json_schema", "{}")
        for t in outputs:
            g.accept(t)
        for keep in (len(outputs) - 3, 2, len(outputs)):
            g.sync(outputs[:keep])
            ref.sync(outputs[:keep])
            ref.matcher.reset()
            ref.accepted = 0
            ref.sync(outputs[:keep])
            assert g.accepted == keep and (fill_bitmask([g], 49152) == fill_bitmask([ref], 49152)).all()
    finally:
        compiler.close()


def test_batch_accept_and_fill_on_threads_match_one_by_one(engine, monkeypatch):
    """`GrammarCompiler.accept` and `fill_bitmask` on several threads (forced here: CI has two
    cores) leave each matcher as accepting its own tokens one at a time does, a refused token
    included."""
    from hicache.runtime import grammar

    tok = engine.tokenizer
    compiler = GrammarCompiler(tok, 49152, [tok.eos_token_id])
    texts = ['{"a": [1, 22]}', '[true, null]', '"xyz"', '{"b": {}}'] * 5
    try:
        monkeypatch.setattr(grammar, "FILL_THREADS", 3)
        batch = [compiler.start("json_schema", "{}") for _ in texts]
        one = [compiler.start("json_schema", "{}") for _ in texts]
        for step in range(4):
            tokens = [(tok.encode(t, add_special_tokens=False) + [tok.eos_token_id] * 4)[step] for t in texts]
            tokens[step] = tok.encode("}", add_special_tokens=False)[0]  # refused where no object is open
            compiler.accept(list(zip(batch, tokens)))
            for g, t in zip(one, tokens):
                g.accept(t)
            assert [(g.accepted, g.rejected, g.finished) for g in batch] == [(g.accepted, g.rejected, g.finished) for g in one]
            live = [None if g.finished else g for g in batch] + [None], [None if g.finished else g for g in one] + [None]
            assert (fill_bitmask(live[0], 49152) == fill_bitmask(live[1], 49152)).all()
        assert any(g.rejected for g in batch) and any(g.finished and not g.rejected for g in batch)
    finally:
        compiler.close()


@pytest.mark.slow
def test_json_schema_suite(engine):
    prompts, params, cases = _batch(SCHEMAS, REGEXES, EBNFS, 160, temperature=0)
    _check(cases, engine.generate(prompts, sampling_params=params))


@pytest.mark.slow
def test_json_schema_suite_streamed(engine):
    async def one(prompt: str, params: dict) -> dict:
        chunks = [c async for c in engine.async_generate(prompt, params)]
        return chunks[-1]

    async def run_all(prompts, params):
        return await asyncio.gather(*(one(p, q) for p, q in zip(prompts, params)))

    prompts, params, cases = _batch(SCHEMAS, REGEXES, EBNFS, 160, temperature=0.7, seed=3)
    _check(cases, asyncio.run(run_all(prompts, params)))
