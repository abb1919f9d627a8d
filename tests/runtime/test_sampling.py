"""SamplingParams.from_dict: validation messages name the field; good dicts round-trip, also over the wire."""
from __future__ import annotations

import dataclasses
import random

import pytest

from hicache.runtime.sampling import SamplingParams

V = 1000


def test_defaults():
    p = SamplingParams()
    assert SamplingParams.from_dict(None, V) == p
    assert SamplingParams.from_dict({}, V) == p
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (128, 1.0, 1.0, -1, 0.0)
    assert (p.repetition_penalty, p.frequency_penalty, p.presence_penalty) == (1.0, 0.0, 0.0)
    assert p.stop == () and p.stop_token_ids == () and p.seed is None and p.n == 1
    assert not p.ignore_eos and p.skip_special_tokens and p.spaces_between_special_tokens
    assert not p.no_stop_trim and not p.is_greedy


def _random_good_dict(rng: random.Random) -> dict:
    return {
        "max_new_tokens": rng.randint(0, 4096),
        "temperature": rng.choice([0, 0.0, rng.uniform(0, 2), 1]),
        "top_p": rng.uniform(0.01, 1.0),
        "top_k": rng.choice([-1, 1, rng.randint(1, V * 2)]),
        "min_p": rng.uniform(0, 1),
        "repetition_penalty": rng.uniform(0.01, 3),
        "frequency_penalty": rng.uniform(-2, 2),
        "presence_penalty": rng.uniform(-2, 2),
        "stop": ["".join(rng.choices("abc\n ", k=rng.randint(1, 5))) for _ in range(rng.randint(0, 3))],
        "stop_token_ids": [rng.randrange(V) for _ in range(rng.randint(0, 4))],
        "ignore_eos": rng.random() < 0.5,
        "seed": rng.choice([None, rng.randint(-2**63, 2**64)]),
        "n": rng.randint(1, 8),
        "skip_special_tokens": rng.random() < 0.5,
        "spaces_between_special_tokens": rng.random() < 0.5,
        "no_stop_trim": rng.random() < 0.5,
    }


def test_good_dicts_round_trip():
    rng = random.Random()
    for _ in range(200):
        d = _random_good_dict(rng)
        # also a random subset of the keys: the rest takes defaults
        d = {k: v for k, v in d.items() if rng.random() < 0.8}
        p = SamplingParams.from_dict(d, V)
        out = p.to_wire()
        for k, v in d.items():
            if v is not None:
                assert out[k] == v, k
        assert SamplingParams.from_dict(out, V) == p
        assert hash(p) == hash(SamplingParams.from_dict(out, V))
        assert SamplingParams.from_wire(out) == p
        assert hash(SamplingParams.from_wire(out)) == hash(p)


def test_none_takes_default_and_stop_string_wraps():
    p = SamplingParams.from_dict({"stop": "###", "temperature": None, "stop_token_ids": None}, V)
    assert p.stop == ("###",) and p.temperature == 1.0 and p.stop_token_ids == ()
    assert p.to_wire()["stop"] == ["###"]


def test_from_wire_does_not_validate_again_but_refuses_unknown_keys():
    assert SamplingParams.from_wire({"stop_token_ids": [V + 5]}).stop_token_ids == (V + 5,)  # vocab: the edge's job
    with pytest.raises(TypeError):
        SamplingParams.from_wire({"bogus": 1})


def test_frozen():
    p = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.5  # type: ignore[misc]


@pytest.mark.parametrize("field,value", [
    ("max_new_tokens", -1), ("max_new_tokens", 1.5), ("max_new_tokens", True), ("max_new_tokens", "8"),
    ("temperature", -0.1), ("temperature", "1"), ("temperature", float("nan")), ("temperature", float("inf")),
    ("temperature", False),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -0.5), ("top_p", True),
    ("top_k", 0), ("top_k", -2), ("top_k", 2.0), ("top_k", True),
    ("min_p", -0.01), ("min_p", 1.5), ("min_p", "0.1"),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("frequency_penalty", 2.5), ("frequency_penalty", -2.01),
    ("presence_penalty", 2.01), ("presence_penalty", -3),
    ("n", 0), ("n", -1), ("n", 1.0), ("n", True),
    ("stop", 3), ("stop", [""]), ("stop", ["ok", 5]), ("stop", [None]), ("stop", {"a": 1}), ("stop", ""),
    ("stop_token_ids", [V]), ("stop_token_ids", [-1]), ("stop_token_ids", [1.0]), ("stop_token_ids", [True]),
    ("stop_token_ids", 5), ("stop_token_ids", "1,2"),
    ("seed", 1.5), ("seed", "42"), ("seed", True),
    ("ignore_eos", 1), ("skip_special_tokens", "yes"), ("spaces_between_special_tokens", 0),
    ("no_stop_trim", 1),
])
def test_bad_value_names_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict({field: value}, V)


def test_unknown_key():
    with pytest.raises(ValueError, match="unknown sampling parameter 'foo'"):
        SamplingParams.from_dict({"temperature": 0.5, "foo": 1}, V)


def test_not_a_dict():
    with pytest.raises(ValueError, match="sampling_params"):
        SamplingParams.from_dict([("temperature", 1.0)], V)  # type: ignore[arg-type]


def test_is_greedy():
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(top_k=1).is_greedy
    assert SamplingParams(temperature=1e-9).is_greedy  # would overflow as a divisor
    assert not SamplingParams(temperature=0.1, top_k=2).is_greedy


def test_expand_n_fans_out_typed_copies_with_consecutive_seeds():
    from hicache.runtime.messages import GenerateRequest, expand_n

    one = GenerateRequest("r", [1, 2], SamplingParams(n=1, seed=5))
    assert expand_n(one) == [one]
    many = expand_n(GenerateRequest("r", [1, 2], SamplingParams(n=3, seed=5, temperature=0.7), cache_salt="t"))
    assert [m.rid for m in many] == ["r-0", "r-1", "r-2"]
    assert [m.sampling_params.seed for m in many] == [5, 6, 7]
    assert all(m.sampling_params.n == 1 and m.sampling_params.temperature == 0.7 and m.cache_salt == "t" for m in many)
    unseeded = expand_n(GenerateRequest("u", [1], SamplingParams(n=2)))
    assert [m.sampling_params.seed for m in unseeded] == [None, None]
