"""The expressions a program appends to its state (`s += ...`), and their constructors: `gen`,
`select`, `system` / `user` / `assistant` and their `*_begin` / `*_end` halves.

Expressions are plain values: `"Q: " + gen("a")` is an `Exprs` of a `Text` and a `Gen`; only the
executor (`lang/executor.py`) gives them meaning.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# the regexes SGLang's `gen(dtype=...)` constrains to
DTYPE_REGEX = {int: r"[-+]?[0-9]+", float: r"[-+]?[0-9]*\.?[0-9]+", bool: r"(True|False)", str: r"\"[\w\d\s]*\""}


class Expr:
    """Something a program appends. `a + b` joins expressions (and strings) into one `Exprs`."""

    def __add__(self, other: Any) -> Exprs:
        return Exprs(_items(self) + _items(as_expr(other)))

    def __radd__(self, other: Any) -> Exprs:
        return Exprs(_items(as_expr(other)) + _items(self))


@dataclass(frozen=True, eq=False)
class Text(Expr):
    value: str


@dataclass(frozen=True, eq=False)
class Gen(Expr):
    """A generation: `params` holds the native sampling parameters set by this call only."""
    name: str | None
    params: dict
    logprobs: dict  # return_logprob, logprob_start_len, top_logprobs_num: those set


@dataclass(frozen=True, eq=False)
class Select(Expr):
    name: str | None
    choices: tuple[str, ...]


@dataclass(frozen=True, eq=False)
class RoleBegin(Expr):
    role: str


@dataclass(frozen=True, eq=False)
class RoleEnd(Expr):
    role: str


@dataclass(frozen=True, eq=False)
class VarScopeBegin(Expr):
    """Where the text of variable `name` begins (`with s.var_scope(name)`)."""
    name: str


@dataclass(frozen=True, eq=False)
class VarScopeEnd(Expr):
    """Where it ends: the variable is the text appended since its `VarScopeBegin`."""
    name: str


@dataclass(frozen=True, eq=False)
class Exprs(Expr):
    items: tuple[Expr, ...]


def as_expr(value: Any) -> Expr:
    """An expression for value: expressions as they are, anything else as its text (`str(value)`)."""
    if isinstance(value, Expr):
        return value
    if value is None:
        raise ValueError("cannot append None to a program state")
    return Text(str(value))


def _items(e: Expr) -> tuple[Expr, ...]:
    return e.items if isinstance(e, Exprs) else (e,)


def describe(e: Expr) -> str:
    """A short name of e for error messages."""
    if isinstance(e, (Gen, Select)):
        return f"{type(e).__name__.lower()} {e.name!r}"
    if isinstance(e, (RoleBegin, RoleEnd)):
        return f"{type(e).__name__} {e.role!r}"
    if isinstance(e, (VarScopeBegin, VarScopeEnd)):
        return f"{type(e).__name__} {e.name!r}"
    return type(e).__name__.lower()


# ---- constructors (SGLang's names and arguments) ----------------------------------------------


def gen(name: str | None = None, max_tokens: int | None = None, stop: str | list[str] | None = None,
        stop_token_ids: list[int] | None = None, temperature: float | None = None, top_p: float | None = None,
        top_k: int | None = None, min_p: float | None = None, frequency_penalty: float | None = None,
        presence_penalty: float | None = None, ignore_eos: bool | None = None, return_logprob: bool | None = None,
        logprob_start_len: int | None = None, top_logprobs_num: int | None = None, dtype: type | str | None = None,
        choices: list[str] | None = None, regex: str | None = None,
        json_schema: str | dict | None = None) -> Expr:
    """Generate into variable `name`; with `choices`, the same as `select(name, choices)`.
    Options left None take the program's defaults (`run(temperature=...)`, ...)."""
    if choices:
        return select(name, choices)
    if dtype is not None:
        if regex is not None:
            raise ValueError("gen: give dtype or regex, not both")
        regex = DTYPE_REGEX.get({"int": int, "float": float, "bool": bool, "str": str}.get(dtype, dtype))
        if regex is None:
            raise ValueError(f"gen: dtype must be int, float, bool or str, got {dtype!r}")
    if isinstance(json_schema, dict):
        json_schema = json.dumps(json_schema)
    params = {"max_new_tokens": max_tokens, "stop": stop, "stop_token_ids": stop_token_ids,
              "temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p,
              "frequency_penalty": frequency_penalty, "presence_penalty": presence_penalty,
              "ignore_eos": ignore_eos, "regex": regex, "json_schema": json_schema}
    logprobs = {"return_logprob": return_logprob, "logprob_start_len": logprob_start_len,
                "top_logprobs_num": top_logprobs_num}
    return Gen(name, _set(params), _set(logprobs))


def select(name: str | None = None, choices: list[str] | None = None, temperature: float = 0.0) -> Select:
    """Append the choice the model finds likeliest after the state's text (the highest log
    probability per token), into variable `name`."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("select: choices must be a non-empty list of non-empty strings")
    if temperature > 1e-5:
        raise ValueError("select: only temperature 0 (pick the likeliest choice) is supported")
    return Select(name, tuple(choices))


def _set(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None}


def _role(role: str, expr: Any = None) -> Exprs:
    inner = () if expr is None else _items(as_expr(expr))
    return Exprs((RoleBegin(role), *inner, RoleEnd(role)))


def system(expr: Any = None) -> Exprs:
    return _role("system", expr)


def user(expr: Any = None) -> Exprs:
    return _role("user", expr)


def assistant(expr: Any = None) -> Exprs:
    return _role("assistant", expr)


def system_begin() -> RoleBegin:
    return RoleBegin("system")


def system_end() -> RoleEnd:
    return RoleEnd("system")


def user_begin() -> RoleBegin:
    return RoleBegin("user")


def user_end() -> RoleEnd:
    return RoleEnd("user")


def assistant_begin() -> RoleBegin:
    return RoleBegin("assistant")


def assistant_end() -> RoleEnd:
    return RoleEnd("assistant")
