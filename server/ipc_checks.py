"""Field type checks for the IPC messages: every decoded dataclass is checked against its annotated
field types (`rid` a str, token ids ints, nested dataclasses recursively) before the loops see it.
`check_fields` raises ValueError naming the first field that fails."""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Callable

_Check = Callable[[Any], bool]
_CHECKS: dict[type, list[tuple[str, _Check]]] = {}


def check_fields(obj) -> None:
    """Raise ValueError naming the first field of dataclass `obj` whose value does not have its
    annotated type (nested dataclasses included). Ints are ints, not bools; a float field takes ints."""
    cls = type(obj)
    checks = _CHECKS.get(cls)
    if checks is None:
        hints = typing.get_type_hints(cls)
        checks = _CHECKS[cls] = [(f.name, _checker(hints[f.name])) for f in dataclasses.fields(cls)]
    for name, ok in checks:
        value = getattr(obj, name)
        if not ok(value):
            raise ValueError(f"malformed {cls.__name__}: {name} has the wrong type ({_describe(value)})")


def _describe(value) -> str:
    if isinstance(value, (list, tuple)):
        bad = {type(v).__name__ for v in value}
        return f"{type(value).__name__} of {', '.join(sorted(bad))}"
    return type(value).__name__


def _checker(hint) -> _Check:
    if hint is Any:
        return lambda v: True
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        parts = [_checker(a) for a in args]
        return lambda v: any(p(v) for p in parts)
    if origin is tuple and args and args[-1] is not Ellipsis:  # fixed length: a type per position
        parts = [_checker(a) for a in args]
        return lambda v: isinstance(v, (list, tuple)) and len(v) == len(parts) and all(
            p(x) for p, x in zip(parts, v))
    if origin in (list, tuple):
        return _sequence_checker(args[0] if args else Any)
    if origin is dict or hint in (dict, list):
        base = origin or hint
        return lambda v: isinstance(v, base)
    if hint is type(None):
        return lambda v: v is None
    if hint is float:
        return lambda v: type(v) in (float, int)
    if hint in (int, bool, str, bytes):
        return lambda v: type(v) is hint
    if dataclasses.is_dataclass(hint):
        return lambda v: isinstance(v, hint) and _nested_ok(v)
    return lambda v: isinstance(v, hint)


def _sequence_checker(item) -> _Check:
    if item in (int, str):  # the long ones (token ids): one pass, no call per element
        return lambda v: isinstance(v, (list, tuple)) and all(type(x) is item for x in v)
    each = _checker(item)
    return lambda v: isinstance(v, (list, tuple)) and all(each(x) for x in v)


def _nested_ok(obj) -> bool:
    try:
        check_fields(obj)
    except ValueError:
        return False
    return True
