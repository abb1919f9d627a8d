"""logit_bias and the grammar bitmask in the sampler, against torch references on fresh random
logits; SamplingParams' grammar and logit_bias fields (validation, wire round trip)."""
from __future__ import annotations

import json
import random

import pytest
import torch

from hicache.runtime.constraint import allowed_tokens, constrain
from hicache.runtime.sampler import Sampler
from hicache.runtime.sampling import SamplingParams

V = 100  # not a multiple of 32: the last bitmask word is partly padding


def _bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """Reference packing: bit j of word w is token 32 w + j, as int32 (two's complement)."""
    b, v = allowed.shape
    words = torch.zeros(b, (v + 31) // 32, dtype=torch.int64)
    for t in range(v):
        words[:, t // 32] |= allowed[:, t].long() << (t % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _sample(logits, params, bitmask=None, generators=None):
    b = logits.shape[0]
    return Sampler().sample(logits, params, generators or [None] * b, [[] for _ in range(b)],
                            [[] for _ in range(b)], [0] * b, bitmask=bitmask)


def test_bitmask_unpacks_to_the_allowed_tokens():
    allowed = torch.rand(5, V) < 0.3
    assert torch.equal(allowed_tokens(_bitmask(allowed), V), allowed)


def test_logit_bias_and_mask_against_a_torch_reference():
    rng = random.Random(0)
    logits = torch.randn(6, V) * 3
    params = [SamplingParams.from_dict({"logit_bias": {str(t): rng.uniform(-100, 100) for t in rng.sample(range(V), 5)}},
                                       V) if i % 2 else SamplingParams() for i in range(6)]
    allowed = torch.rand(6, V) < 0.5
    allowed[:, 0] = True
    want = logits.clone()
    for i, p in enumerate(params):
        for t, b in p.logit_bias:
            want[i, t] += b
    want[~allowed] = float("-inf")
    assert torch.equal(constrain(logits, params, _bitmask(allowed)), want)
    assert constrain(logits, [SamplingParams()] * 6) is logits  # nothing to do: no copy


def test_greedy_picks_the_best_allowed_token_and_bias_moves_it():
    logits = torch.randn(8, V)
    allowed = torch.rand(8, V) < 0.2
    allowed[:, 7] = True
    greedy = [SamplingParams(temperature=0)] * 8
    got = _sample(logits, greedy, _bitmask(allowed)).next_ids
    assert got == logits.masked_fill(~allowed, float("-inf")).argmax(-1).tolist()
    target = [int(t) for t in torch.randint(0, V, (8,))]
    biased = [SamplingParams(temperature=0, logit_bias=((t, 100.0),)) for t in target]
    assert _sample(logits, biased).next_ids == target


def test_sampled_rows_with_filters_stay_inside_the_mask():
    logits = torch.randn(6, V) * 2
    allowed = torch.rand(6, V) < 0.1
    allowed[:, 3] = True
    params = [SamplingParams(top_k=20), SamplingParams(top_p=0.9), SamplingParams(min_p=0.05),
              SamplingParams(temperature=2.0), SamplingParams(repetition_penalty=1.3), SamplingParams(top_k=5, top_p=0.5)]
    gens = [torch.Generator().manual_seed(i) for i in range(6)]
    for _ in range(20):
        for i, t in enumerate(_sample(logits, params, _bitmask(allowed), gens).next_ids):
            assert allowed[i, t]


def test_sampling_params_grammar_and_bias_fields():
    p = SamplingParams.from_dict({"json_schema": {"type": "object"}, "logit_bias": {"5": 1, 3: -2.5}}, V)
    assert p.grammar == ("json_schema", '{"type": "object"}')
    assert p.logit_bias == ((3, -2.5), (5, 1.0))
    assert SamplingParams.from_wire(p.to_wire()) == p
    assert SamplingParams.from_dict({"regex": "a+"}, V).grammar == ("regex", "a+")
    for tag in ({"structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}], "triggers": ["<f"]},
                {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f"], "tags": [
                    {"begin": "<f>", "content": {"type": "json_schema", "json_schema": {"type": "object"}}, "end": "</f>"}]}}):
        assert SamplingParams.from_dict({"structural_tag": json.dumps(tag)}, V).grammar[0] == "structural_tag"
    for bad, match in [({"logit_bias": {"100": 1}}, "^logit_bias must be keyed"),
                       ({"logit_bias": {"x": 1}}, "^logit_bias must be keyed"),
                       ({"logit_bias": {"1": 101}}, "^logit_bias values"),
                       ({"logit_bias": [1]}, "^logit_bias must be an object"),
                       ({"logit_bias": [[1, 2, 3]]}, "^logit_bias must be an object"),
                       ({"ebnf": 3}, "^ebnf must be a string"),
                       ({"regex": "(", "json_schema": "{}"}, "^regex "),
                       ({"ebnf": 'root ::= "a"', "structural_tag": "{}"}, "^structural_tag "),
                       ({"structural_tag": '{"structures": [{"begin": "x"}]}'}, "^structural_tag .* lacks 'schema'")]:
        with pytest.raises(ValueError, match=match):
            SamplingParams.from_dict(bad, V)
