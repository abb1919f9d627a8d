"""`SamplingParams`: one request's decoding options, with SGLang's native field names.

Parsed once, at the edge (the `Engine`, the HTTP process), with `SamplingParams.from_dict(d,
vocab_size)`, which raises `ValueError` naming the offending field so that the message can go back
to the client as a 400. From there on the typed object travels: across the scheduler socket as
`to_wire()` / `from_wire()`, a plain dict that is rebuilt without checking again.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from typing import Any

# Temperatures below this are treated as greedy (as SGLang does): dividing logits by ~0 only overflows.
GREEDY_TEMPERATURE = 1e-6


@dataclass(frozen=True)
class SamplingParams:
    """Immutable, validated decoding options of one request.

    `stop` and `stop_token_ids` are stored as tuples so that the object stays hashable;
    `to_wire()` gives them back as lists.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF semantics, over prompt + output tokens
    frequency_penalty: float = 0.0  # OpenAI semantics, over output tokens
    presence_penalty: float = 0.0  # OpenAI semantics, over output tokens
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    # Grammar constraints (at most one; see runtime/grammar.py): JSON schema text, regular
    # expression, EBNF grammar, or XGrammar structural tag (JSON text).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit), OpenAI semantics

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, text) of the grammar constraint, or None."""
        return next(((k, getattr(self, k)) for k in GRAMMAR_KINDS if getattr(self, k) is not None), None)

    def to_wire(self) -> dict[str, Any]:
        """Every field as msgpack / JSON builtins (tuples as lists); also a valid `from_dict` input."""
        d = asdict(self)
        d["stop"] = list(self.stop)
        d["stop_token_ids"] = list(self.stop_token_ids)
        d["logit_bias"] = [list(pair) for pair in self.logit_bias]
        return d

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> SamplingParams:
        """Rebuild `to_wire()`'s dict without validating the values again: only a front end that
        parsed them with `from_dict` writes it. An unknown key raises TypeError."""
        kw = {k: tuple(v) if k in _TUPLE_FIELDS else v for k, v in d.items()}
        if "logit_bias" in kw:
            kw["logit_bias"] = tuple(tuple(pair) for pair in kw["logit_bias"])
        return cls(**kw)

    @classmethod
    def from_dict(cls, d: dict | None, vocab_size: int) -> SamplingParams:
        """Validate `d` (None or {} gives the defaults). A key whose value is None takes its default.

        Raises ValueError naming the field for unknown keys, wrong types and out-of-range values.
        """
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise ValueError(f"sampling_params must be an object, got {type(d).__name__}")
        for key in d:
            if key not in _FIELD_NAMES and key not in INERT_VALUES:
                raise ValueError(f"unknown sampling parameter {key!r}")
        _check_inert(d)
        kwargs = {k: _VALIDATORS[k](k, v, vocab_size) for k, v in d.items() if v is not None and k in _FIELD_NAMES}
        given = [k for k in GRAMMAR_KINDS if k in kwargs]
        if len(given) > 1:
            raise ValueError(f"{given[1]} cannot be combined with {given[0]}: give at most one grammar constraint")
        return cls(**kwargs)


# ---- validation ---------------------------------------------------------------------------------

# SGLang's sampling parameters that this runtime does not implement, with the values that ask for
# nothing (what SGLang's frontend language sends by default): accepted at those, else refused.
# name -> (the values accepted, how the error names them)
INERT_VALUES: dict[str, tuple[tuple, str]] = {"min_new_tokens": ((0,), "0"),
                                              "stop_regex": (((), [], ""), "null, an empty list or an empty string")}


def _check_inert(d: dict) -> None:
    for key, (inert, shown) in INERT_VALUES.items():
        v = d.get(key)
        if v is not None and (isinstance(v, bool) or not any(v == x and type(v) is type(x) for x in inert)):
            raise ValueError(f"{key} is not implemented: only {shown} (which asks for nothing) "
                             f"is accepted, got {v!r}")


def _int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{name} must be an integer, got {type(v).__name__} {v!r}")
    return v


def _float(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{name} must be a number, got {type(v).__name__} {v!r}")
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {v!r}")
    return float(v)


def _bool(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"{name} must be a boolean, got {type(v).__name__} {v!r}")
    return v


def _check(ok: bool, name: str, rule: str, v: Any) -> None:
    if not ok:
        raise ValueError(f"{name} must be {rule}, got {v!r}")


def _max_new_tokens(name: str, v: Any, _vocab: int) -> int:
    v = _int(name, v)
    _check(v >= 0, name, ">= 0", v)
    return v


def _temperature(name: str, v: Any, _vocab: int) -> float:
    v = _float(name, v)
    _check(v >= 0, name, ">= 0", v)
    return v


def _top_p(name: str, v: Any, _vocab: int) -> float:
    v = _float(name, v)
    _check(0 < v <= 1, name, "in (0, 1]", v)
    return v


def _top_k(name: str, v: Any, _vocab: int) -> int:
    v = _int(name, v)
    _check(v == -1 or v >= 1, name, "-1 (off) or >= 1", v)
    return v


def _min_p(name: str, v: Any, _vocab: int) -> float:
    v = _float(name, v)
    _check(0 <= v <= 1, name, "in [0, 1]", v)
    return v


def _repetition_penalty(name: str, v: Any, _vocab: int) -> float:
    v = _float(name, v)
    _check(v > 0, name, "> 0", v)
    return v


def _openai_penalty(name: str, v: Any, _vocab: int) -> float:
    v = _float(name, v)
    _check(-2 <= v <= 2, name, "in [-2, 2]", v)
    return v


def _n(name: str, v: Any, _vocab: int) -> int:
    v = _int(name, v)
    _check(v >= 1, name, ">= 1", v)
    return v


def _stop(name: str, v: Any, _vocab: int) -> tuple[str, ...]:
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"{name} must be a string or a list of strings, got {type(v).__name__}")
    for s in items:
        if not isinstance(s, str) or not s:
            raise ValueError(f"{name} must hold non-empty strings, got {s!r}")
    return tuple(items)


def _stop_token_ids(name: str, v: Any, vocab_size: int) -> tuple[int, ...]:
    if not isinstance(v, (list, tuple)):
        raise ValueError(f"{name} must be a list of integers, got {type(v).__name__}")
    for t in v:
        _int(name, t)
        _check(0 <= t < vocab_size, name, f"token ids in [0, {vocab_size})", t)
    return tuple(v)


def _seed(name: str, v: Any, _vocab: int) -> int:
    return _int(name, v)


def _flag(name: str, v: Any, _vocab: int) -> bool:
    return _bool(name, v)


def _grammar(name: str, v: Any, _vocab: int) -> str:
    """A grammar's text, checked by parsing it (compiling it for the tokenizer is the scheduler's
    work); `json_schema` may also be given as an object, stored as its JSON text."""
    from hicache.runtime.grammar import check_grammar

    if name == "json_schema" and isinstance(v, dict):
        v = json.dumps(v)
    if not isinstance(v, str):
        raise ValueError(f"{name} must be a string, got {type(v).__name__}")
    check_grammar(name, v)
    return v


MAX_LOGIT_BIAS = 100.0


def _logit_bias(name: str, v: Any, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """{token id: bias} (ids may be strings of digits: OpenAI's JSON keys) or [[id, bias], ...]
    (`to_wire`'s form). Sorted by id."""
    if isinstance(v, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in v):
        v = dict(v)
    if not isinstance(v, dict):
        raise ValueError(f"{name} must be an object mapping token ids to biases, got {type(v).__name__}")
    out = {}
    for key, bias in v.items():
        tid = int(key) if isinstance(key, str) and key.isdigit() else key
        if isinstance(tid, bool) or not isinstance(tid, int) or not 0 <= tid < vocab_size:
            raise ValueError(f"{name} must be keyed by token ids in [0, {vocab_size}), got {key!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not abs(bias) <= MAX_LOGIT_BIAS:
            raise ValueError(f"{name} values must be numbers in [-100, 100], got {bias!r} for {key!r}")
        out[tid] = float(bias)
    return tuple(sorted(out.items()))


_VALIDATORS = {
    "max_new_tokens": _max_new_tokens,
    "temperature": _temperature,
    "top_p": _top_p,
    "top_k": _top_k,
    "min_p": _min_p,
    "repetition_penalty": _repetition_penalty,
    "frequency_penalty": _openai_penalty,
    "presence_penalty": _openai_penalty,
    "stop": _stop,
    "stop_token_ids": _stop_token_ids,
    "ignore_eos": _flag,
    "seed": _seed,
    "n": _n,
    "skip_special_tokens": _flag,
    "spaces_between_special_tokens": _flag,
    "no_stop_trim": _flag,
    "json_schema": _grammar,
    "regex": _grammar,
    "ebnf": _grammar,
    "structural_tag": _grammar,
    "logit_bias": _logit_bias,
}
_FIELD_NAMES = frozenset(f.name for f in fields(SamplingParams))
_TUPLE_FIELDS = frozenset({"stop", "stop_token_ids"})
GRAMMAR_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")
assert _FIELD_NAMES == set(_VALIDATORS), "every field needs a validator"
