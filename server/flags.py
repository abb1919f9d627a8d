"""argparse flags built from the config dataclasses: one field, one `--kebab-case` flag.

Defaults and help come from the field (written once, in the dataclass); a bool field becomes a
store_true flag (with its `--no-` form when on by default), a tri-state `bool | None` field the
pair `--enable-<name>` / `--disable-<name>` (neither: None, automatic), a `tuple[str, ...]` field a
flag taking one or more values. `config_from_args` rebuilds the frozen configs, so their own
checks apply.
"""
from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

_SCALARS = (int, float, str)
SHOWN_DEFAULT = " (default: %(default)s)"  # argparse fills it in


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type, title: str) -> None:
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "")
        base, optional = _base_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else None
        if base is bool and optional:
            name = f.name.replace("_", "-")
            group.add_argument(f"--enable-{name}", f"--disable-{name}", dest=f.name, action=TriState, default=None,
                               help=help_text)
            continue
        if base is bool:  # a flag that is on by default also gets its --no- form
            action = argparse.BooleanOptionalAction if default else "store_true"
            group.add_argument(flag, dest=f.name, action=action, default=bool(default), help=help_text)
            continue
        if base is tuple:
            group.add_argument(flag, dest=f.name, nargs="+", type=str, default=default, metavar=f.name.upper(),
                               help=help_text)
            continue
        shown = "" if default is None else SHOWN_DEFAULT
        group.add_argument(flag, dest=f.name, type=_parser_for(base, optional), default=default,
                           metavar=f.name.upper(), help=help_text + shown)


class TriState(argparse.Action):
    """`--enable-<name>` sets the field to True, `--disable-<name>` to False (the last one given wins)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, option_string.startswith("--enable-"))


def _base_type(hint: Any) -> tuple[type, bool]:
    """(scalar type, whether None is allowed) of `int`, `str | None`, `Optional[float]`, ..."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return _base_type(args[0])[0], True
        return str, True
    if hint in (bool, *_SCALARS):
        return hint, False
    if origin is tuple:
        return tuple, False
    return str, False


def _parser_for(base: type, optional: bool):
    def parse(text: str):
        if optional and text.lower() in ("none", "null"):
            return None
        return base(text)

    parse.__name__ = base.__name__  # argparse names the type in its error message
    return parse


def config_from_args(cls: type, args: argparse.Namespace):
    """Instantiate `cls` from the parsed flags (ValueError from its checks propagates)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})
