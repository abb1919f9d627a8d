"""Grammar-constrained decoding on the default model through the Engine: outputs parse and
validate against their JSON schema (the `jsonschema` package), regular expression or EBNF grammar,
batched, streamed, with overlap scheduling forced on (the mask applied in continuation steps),
and across retractions (a KV pool too small for the batch); jump-forward against decoding every
token."""
from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest

from engines import make_engine
from golden import first_difference
from hicache.runtime.bitmask import BitmaskFiller, allowed_ids, fill_bitmask
from hicache.runtime.grammar import GrammarCompiler
from hicache.runtime.jump_forward import forced_tokens
from schemas import EBNFS, NAME, REGEXES, SCHEMAS, schema_prompt

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def engine(default_model_path):
    e = make_engine(default_model_path, overlap_schedule=True, max_total_tokens=384, page_size=16)
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


def test_without_jump_forward_the_mask_is_filled_as_soon_as_tokens_are_accepted(engine, monkeypatch):
    """Overlap scheduling without jump-forward: a continuation's bitmask starts filling once the
    matchers have accepted the previous step's tokens, before that step's results are applied;
    requests ending at different steps leave the continuation the rows of those still running."""
    monkeypatch.setattr(engine.scheduler.jump, "enabled", False)
    overlap = engine.scheduler.overlap
    before = overlap.filled_early
    prompts, params, cases = _batch(SCHEMAS[3:6], REGEXES[1:2], EBNFS[1:2], 40, temperature=0)
    _check(cases, engine.generate(prompts, sampling_params=params))
    assert overlap.filled_early > before


def test_sampled_outputs_follow_the_grammar_across_retractions(engine, monkeypatch):
    monkeypatch.setattr(engine.scheduler.policy, "conservativeness", 0)  # admit past the outputs' room: retract
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


@pytest.mark.parametrize("chunk_rows", [None, 3])
def test_tokens_recorded_by_their_bitmask_match_accepting_them_one_by_one(engine, monkeypatch, chunk_rows):
    """A step's tokens recorded by `GrammarCompiler.accept` with whether the bitmask they were
    sampled under allowed them, the matchers fed them on the filler's thread before the next fill
    (`BitmaskFiller`, filling on several threads: forced here, CI has two cores; with
    `chunk_rows`, a batch large enough to be fed and filled in chunks of rows), leave each
    grammar as accepting its tokens one at a time does: its accepted count, its end (a stop token)
    or its refusal, its next bitmask; so does reading a matcher with tokens still pending."""
    from hicache.runtime import bitmask

    tok = engine.tokenizer
    compiler, filler = GrammarCompiler(tok, 49152, [tok.eos_token_id]), BitmaskFiller()
    texts = ['{"a": [1, 22]}', '[true, null]', '"xyz"', '{"b": {}}'] * 5
    try:
        monkeypatch.setattr(bitmask, "FILL_THREADS", 3)
        if chunk_rows is not None:
            monkeypatch.setattr(bitmask, "CHUNK_ROWS", chunk_rows)
        batch = [compiler.start("json_schema", "{}") for _ in texts]
        one = [compiler.start("json_schema", "{}") for _ in texts]
        for step in range(4):
            tokens = [(tok.encode(t, add_special_tokens=False) + [tok.eos_token_id] * 4)[step] for t in texts]
            tokens[step] = tok.encode("}", add_special_tokens=False)[0]  # refused where no object is open
            live = [i for i, g in enumerate(batch) if not g.finished]
            mask = filler.start([batch[i] for i in live], 49152).result()
            compiler.accept([(batch[i], tokens[i], ok) for i, ok in zip(live, allowed_ids(mask, [tokens[i] for i in live]))])
            for i in live:
                one[i].accept(tokens[i])
            assert [(g.accepted, g.rejected, g.finished) for g in batch] == [(g.accepted, g.rejected, g.finished) for g in one]
        assert any(g.rejected for g in batch) and any(g.finished and not g.rejected for g in batch)
        live = [None if g.finished else g for g in batch] + [None], [None if g.finished else g for g in one] + [None]
        assert (fill_bitmask(live[0], 49152) == fill_bitmask(live[1], 49152)).all()  # fed on this thread
        assert (filler.start(live[0], 49152).result() == fill_bitmask(live[1], 49152)).all()
    finally:
        filler.close()
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


# ---- jump-forward ------------------------------------------------------------------------------

LONG_KEYS = {"type": "object", "properties": {
    "customer_full_legal_name": NAME, "is_preferred_customer_account": {"type": "boolean"}},
    "required": ["customer_full_legal_name", "is_preferred_customer_account"]}
ANSWER = r"The answer is (yes|no)\. Because it is [a-z]{2,10}\."
ANSWER_PROMPT = "Is water wet? Reply in one sentence."


def _steps(engine, prompts, params) -> tuple[list[dict], int, int]:
    """Outputs, model steps and jump-forward tokens of one batch."""
    before = engine.get_stats()
    outs = engine.generate(prompts, sampling_params=params)
    after = engine.get_stats()
    return outs, after["forward_steps"] - before["forward_steps"], after["tokens"]["jump_forward"] - before["tokens"]["jump_forward"]


def test_jump_forward_gives_the_greedy_output_in_fewer_steps(engine, monkeypatch):
    """Long forced keys and a regex with forced literals, greedy, against decoding every token: in
    fewer model steps, the same tokens, or the same up to a token where the model, decoding the
    forced text itself, wrote a shorter piece of it (" " then "Because" where jump-forward
    appends " Because", the tokenizer's own tokens: what follows may then differ). The tree holds
    the tokens appended; a request that returns log-probs does not jump."""
    prompts = [schema_prompt(LONG_KEYS), ANSWER_PROMPT]
    params = [{"json_schema": LONG_KEYS, "max_new_tokens": 64, "temperature": 0},
              {"regex": ANSWER, "max_new_tokens": 40, "temperature": 0}]
    cases = [("json_schema", LONG_KEYS), ("regex", ANSWER)]
    jumped, steps_on, forced = _steps(engine, prompts, params)
    _check(cases, jumped)
    assert forced > 0
    ids = engine.tokenizer(prompts[0]).input_ids + jumped[0]["output_ids"][:-1]  # less the EOS
    cached = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1})["meta_info"]["cached_tokens"]
    assert cached == (len(ids) - 1) // 16 * 16  # the tree matched every computed token, page-aligned
    monkeypatch.setattr(engine.scheduler.jump, "enabled", False)
    stepped, steps_off, _ = _steps(engine, prompts, params)
    for a, b in zip(jumped, stepped):
        _same_or_split_forced_text(engine.tokenizer, a["output_ids"], b["output_ids"])
    assert steps_on < steps_off, (steps_on, steps_off)
    monkeypatch.undo()
    out = engine.generate(ANSWER_PROMPT, sampling_params=params[1], return_logprob=True)
    assert len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"])
    assert out["output_ids"] == stepped[1]["output_ids"]
    engine.check_integrity()


def _same_or_split_forced_text(tok, jumped: list[int], stepped: list[int]) -> None:
    at = first_difference(jumped, stepped)
    if at is not None:
        assert tok.decode(jumped[:at]) == tok.decode(stepped[:at])
        piece, shorter = tok.decode(jumped[at:at + 1]), tok.decode(stepped[at:at + 1])
        assert piece.startswith(shorter) and len(piece) > len(shorter), (piece, shorter)


def test_jump_forward_stops_at_max_new_tokens(engine):
    """A forced run is cut at max_new_tokens: before the first token (the request ends without a
    model step) and after a sampled token."""
    outs, steps, _ = _steps(engine, [ANSWER_PROMPT], {"regex": ANSWER, "max_new_tokens": 2, "temperature": 0})
    assert len(outs[0]["output_ids"]) == 2 and outs[0]["meta_info"]["finish_reason"]["type"] == "length"
    assert "The answer is".startswith(outs[0]["text"]) and steps == 0
    for n in (5, 6, 7):
        out = engine.generate(ANSWER_PROMPT, sampling_params={"regex": ANSWER, "max_new_tokens": n, "temperature": 0})
        assert len(out["output_ids"]) == n and out["meta_info"]["finish_reason"]["type"] == "length", out
        assert any(f"The answer is {a}. Because it is ".startswith(out["text"]) for a in ("yes", "no")), out


def test_jump_forward_streams_the_forced_text(engine):
    async def stream() -> list[dict]:
        return [c async for c in engine.async_generate(ANSWER_PROMPT, {"regex": ANSWER, "max_new_tokens": 40,
                                                                        "temperature": 0})]

    chunks = asyncio.run(stream())
    sizes = [len(c["output_ids"]) for c in chunks]
    assert max(b - a for a, b in zip([0] + sizes, sizes)) > 1  # a forced run arrives in one chunk
    assert all(b["text"].startswith(a["text"]) for a, b in zip(chunks, chunks[1:]))
    _check([("regex", ANSWER)], chunks[-1:])


def test_forced_text_tokenizes_as_after_the_last_tokens(engine):
    tok = engine.tokenizer
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    assert forced_tokens(tok, enc('{"'), 'name": ') == enc('{"name": ')[len(enc('{"')):]
    space = enc(" ")
    assert enc(" hello")[:1] != space  # the tail would merge with the text: the text is encoded alone
    assert forced_tokens(tok, space, "hello") == enc("hello")


def test_cached_tokens_count_only_the_prompt_when_a_forced_run_is_cached_too(engine):
    """A repeated request whose grammar forces text before its first token matches, in the tree,
    its prompt and the forced tokens the first one left there: only the prompt counts as cached,
    all but its last token, as for any request."""
    forced = r"Certainly, here is the one sentence answer that you asked me for: (yes|no)\."
    params = {"regex": forced, "max_new_tokens": 40, "temperature": 0}
    engine.generate(ANSWER_PROMPT, sampling_params=params)
    meta = engine.generate(ANSWER_PROMPT, sampling_params=params)["meta_info"]
    details = meta["cached_tokens_details"]
    assert meta["cached_tokens"] == meta["prompt_tokens"] - 1, meta  # the whole prompt is in the matched pages
    assert details["device"] + details["host"] + details["storage"] == meta["cached_tokens"]
