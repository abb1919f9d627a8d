"""The configuration reference, docs/configuration.md, generated from the parser of `hicache serve`
and the keys the L3 extra config takes:

    python -m hicache.server.reference > docs/configuration.md

(`make docs`). tests/server/test_reference.py fails when the committed file differs.
"""
from __future__ import annotations

import argparse
import json

from hicache.config import CACHE_KEYS, extra_keys, storage_backends
from hicache.server.cli import add_serve_flags
from hicache.server.flags import SHOWN_DEFAULT, TriState

JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string"}
HEADER = """# Configuration reference

Every flag of `hicache serve`, generated from its parser (`make docs`; do not edit by hand). The
in-process `Engine(model_path, **options)` takes the options of the "model and scheduling" and
"KV cache" groups under their field names. A tri-state option's default, auto, depends on the
device: each one's description says how; `--enable-...` or `--disable-...` (in Python, True or
False) decides.
"""

EXTRA = """## Keys of `--hicache-storage-backend-extra-config`

A JSON object (in Python, a dict too). The cache brain's keys apply with every backend; the others
are those of the backend `--hicache-storage-backend` names. A key the backend does not take, or a
value of the wrong type or out of range, stops the server at start with an error naming it. The
storage secret goes in `--hicache-storage-secret`, never here (the extra config is shown).
"""


def render() -> str:
    parser = argparse.ArgumentParser(prog="hicache serve")
    add_serve_flags(parser)
    parts = [HEADER]
    for group in parser._action_groups:  # argparse keeps the groups only there
        actions = [a for a in group._group_actions if a.help != argparse.SUPPRESS and a.dest != "help"]
        if actions:
            parts.append(_flag_table(group.title, actions))
    parts.append(EXTRA)
    parts.append(_key_table("The cache brain's keys (every backend)", extra_keys("none")))
    for backend in storage_backends():
        keys = {k: v for k, v in extra_keys(backend).items() if k not in CACHE_KEYS}
        if keys:
            parts.append(_key_table(f"`{backend}`", keys))
    return "\n".join(parts)


def _flag_table(title: str, actions: list[argparse.Action]) -> str:
    rows = [f"## {title[0].upper()}{title[1:]}\n", "| flag | option | default | description |", "|---|---|---|---|"]
    for a in actions:
        flags = " / ".join(f"`{s}`" for s in a.option_strings)
        rows.append(f"| {flags} | `{a.dest}` | {_default(a)} | {_cell(a.help.removesuffix(SHOWN_DEFAULT))} |")
    return "\n".join(rows) + "\n"


def _key_table(title: str, keys: dict) -> str:
    rows = [f"### {title}\n", "| key | type | default | description |", "|---|---|---|---|"]
    for key, option in keys.items():
        low = "" if option.minimum is None else f", {'>' if option.above else '>='} {option.minimum}"
        default = "" if option.default is None else f"`{json.dumps(option.default)}`"
        rows.append(f"| `{key}` | {JSON_TYPES[option.kind]}{low} | {default} | {_cell(option.help)} |")
    return "\n".join(rows) + "\n"


def _default(action: argparse.Action) -> str:
    if isinstance(action, TriState):
        return "auto"
    if isinstance(action, (argparse._StoreTrueAction, argparse.BooleanOptionalAction)):
        return "on" if action.default else "off"
    if action.default in (None, ()):
        return ""
    return f"`{action.default}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


if __name__ == "__main__":
    print(render(), end="")
