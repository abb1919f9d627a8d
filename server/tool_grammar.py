"""The grammar that forces tool calls (`tool_choice` 'required' or a named function): calls in the
parser's format (`server/tool_parser.py`), each naming a given tool, with arguments that match
that tool's parameters schema, and nothing else. A named function, or parallel calls turned off,
allows exactly one call; 'required' with parallel calls allows one and at most as many as there
are tools, the answer ending after any of them (unbounded, a small model repeats its call until
the token limit).

It is written as an XGrammar structural tag (a `tag` per tool, whose begin text is the call up to
its arguments and whose content is the parameters' JSON schema; the calls after the first each
follow the separator) and handed to the sampler as EBNF text (`SamplingParams.ebnf`). Grammars
are cached by their input.
"""
from __future__ import annotations

import json
from functools import lru_cache

from hicache.server.tools import CALL_SUFFIX, SEPARATORS, Tool, ToolChoice, ToolError, call_prefix

MAX_WHITESPACE = 1  # in a row inside the arguments: a small model must not loop on blanks


def call_constraint(tools: list[Tool], choice: ToolChoice, fmt: str, parallel: bool,
                    schema_param: str = "function.parameters") -> dict[str, str]:
    """Sampling fields ({"ebnf": ...}) forcing the calls `choice` asks for; {} when it forces none.
    A named function or `parallel` false allows exactly one call. A schema XGrammar rejects is a
    `ToolError` naming `tools.<i>.<schema_param>`."""
    if not choice.forced:
        return {}
    chosen = [t for t in tools if choice.mode == "required" or t.name == choice.name]
    most = 1 if choice.mode == "function" or not parallel else len(chosen)
    key = json.dumps([[t.name, t.parameters] for t in chosen], sort_keys=True)
    try:
        return {"ebnf": _ebnf(key, fmt, most)}
    except Exception as e:  # xgrammar rejects a schema: name the tool
        i = next((i for i, t in enumerate(tools) if t in chosen and not _usable(t.parameters)), 0)
        raise ToolError(f"this schema cannot constrain the call: {e}", f"tools.{i}.{schema_param}") from None


def _usable(schema: dict) -> bool:
    import xgrammar

    try:
        xgrammar.Grammar.from_json_schema(json.dumps(schema))
    except Exception:
        return False
    return True


@lru_cache(maxsize=256)
def _ebnf(key: str, fmt: str, most: int) -> str:
    """One call, then up to `most - 1` more after the separator; the answer may end after any."""
    import xgrammar

    tags = [{"type": "tag", "begin": call_prefix(name, fmt), "end": CALL_SUFFIX[fmt],
             "content": {"type": "json_schema", "json_schema": params, "max_whitespace_cnt": MAX_WHITESPACE}}
            for name, params in json.loads(key)]
    call = {"type": "or", "elements": tags}
    more = {"type": "sequence", "elements": [{"type": "const_string", "value": SEPARATORS[fmt]}, call]}
    calls = {"type": "sequence", "elements": [call, {"type": "repeat", "min": 0, "max": most - 1, "content": more}]}
    tag = {"type": "structural_tag", "format": calls if most > 1 else call}
    return str(xgrammar.Grammar.from_structural_tag(json.dumps(tag)))
