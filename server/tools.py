"""Tool calling, independent of any one API: the typed tools, choices and calls, their checks, and
how a conversation with tools is rendered through a chat template.

An API route turns its body into `Tool`s (`parse_tools`), a `ToolChoice` (`parse_tool_choice`) and
neutral messages (dicts with `role`, `content`, optionally `name`, and `tool_calls: list[ToolCall]`
on assistant turns or `tool_call_id` on tool results, and `path` naming that id's field in the
API's request when it is not `messages.<i>.tool_call_id`, checked by `check_history`); `render`
prepares them for `apply_chat_template`. `server/tool_parser.py` reads calls back out of the
model's text and `server/tool_grammar.py` builds the constraint that forces them.

A chat template that takes `tools` renders everything itself. One that does not gets the tools
described in a system section and the calls written in the parser's own format, with tool results
as a user turn wrapping each in `<tool_response>` tags; the parser reads that format back.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal, NamedTuple

FORMATS = ("hermes", "llama3")
_NAME = re.compile(r"[A-Za-z0-9_\-]{1,64}")


class ToolError(ValueError):
    """A malformed tool, choice or tool message; `param` names the field (dotted path)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    description: str = ""
    parameters: dict = field(default_factory=dict, hash=False)  # a JSON schema of type object

    def spec(self) -> dict:
        """OpenAI's function-tool shape, which chat templates expect."""
        fn = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object


@dataclass(frozen=True)
class ToolChoice:
    mode: Literal["auto", "none", "required", "function"] = "auto"
    name: str | None = None  # the forced function when mode == "function"

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "function")


class ToolStyle(NamedTuple):
    """How a model's tool calls look (`format`, one of FORMATS) and whether its chat template
    renders tools itself (`native`)."""

    format: str
    native: bool


# ---- checks -----------------------------------------------------------------------------------


def parse_tools(raw: list | None, param: str = "tools") -> list[Tool]:
    """OpenAI-shaped function tools ({"type": "function", "function": {...}}) as `Tool`s."""
    tools: list[Tool] = []
    for i, item in enumerate(raw or []):
        at = f"{param}.{i}"
        if not isinstance(item, dict) or item.get("type", "function") != "function":
            raise ToolError("a tool must be an object of type 'function'", at)
        fn = item.get("function")
        if not isinstance(fn, dict):
            raise ToolError("missing the 'function' object", f"{at}.function")
        tools.append(make_tool(fn.get("name"), fn.get("description"), fn.get("parameters"), f"{at}.function"))
    return check_unique(tools, param)


def check_unique(tools: list[Tool], param: str = "tools") -> list[Tool]:
    names = [t.name for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ToolError(f"two tools are named {dup!r}", param)
    return tools


def make_tool(name: Any, description: Any, parameters: Any, param: str, schema_key: str = "parameters") -> Tool:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ToolError("a function name of 1 to 64 letters, digits, '_' or '-' is required", f"{param}.name")
    if description is not None and not isinstance(description, str):
        raise ToolError("must be a string", f"{param}.description")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise ToolError("must be a JSON schema of type 'object'", f"{param}.{schema_key}")
    return Tool(name, description or "", parameters)


def parse_tool_choice(raw: Any, tools: list[Tool], param: str = "tool_choice") -> ToolChoice:
    """OpenAI's tool_choice: 'auto' (the default), 'none', 'required' or a named function."""
    if raw is None:
        return ToolChoice()
    if isinstance(raw, str):
        if raw not in ("auto", "none", "required"):
            raise ToolError(f"must be 'auto', 'none', 'required' or a function, got {raw!r}", param)
        choice = ToolChoice(raw)
    else:
        fn = raw.get("function") if isinstance(raw, dict) and raw.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise ToolError("a named choice is {\"type\": \"function\", \"function\": {\"name\": ...}}", param)
        if name not in {t.name for t in tools}:
            raise ToolError(f"no tool named {name!r} in tools", param)
        choice = ToolChoice("function", name)
    if choice.forced and not tools:
        raise ToolError(f"{choice.mode!r} needs a non-empty tools list", param)
    return choice


def parse_call(raw: Any, param: str) -> ToolCall:
    """An assistant turn's call in OpenAI's shape; arguments must be JSON text of an object."""
    fn = raw.get("function") if isinstance(raw, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ToolError("a tool call is {\"id\", \"type\": \"function\", \"function\": {\"name\", \"arguments\"}}",
                        param)
    call_id = raw.get("id")
    if not isinstance(call_id, str) or not call_id:
        raise ToolError("a tool call needs a non-empty string id", f"{param}.id")
    args = fn.get("arguments", "{}")
    try:
        ok = isinstance(args, str) and isinstance(json.loads(args), dict)
    except ValueError:
        ok = False
    if not ok:
        raise ToolError("must be a string holding a JSON object", f"{param}.function.arguments")
    return ToolCall(call_id, fn["name"], args)


def check_history(messages: list[dict], param: str = "messages") -> None:
    """Each tool result answers a call made by an earlier assistant turn."""
    calls: set[str] = set()
    for i, m in enumerate(messages):
        calls.update(c.id for c in m.get("tool_calls") or ())
        if m["role"] != "tool":
            continue
        call_id, at = m.get("tool_call_id"), m.get("path") or f"{param}.{i}.tool_call_id"
        if not isinstance(call_id, str) or not call_id:
            raise ToolError("a tool message needs the tool_call_id of the call it answers", at)
        if call_id not in calls:
            raise ToolError(f"{call_id!r} answers no earlier assistant tool call", at)


# ---- rendering --------------------------------------------------------------------------------


def template_style(template: str | None, override: str | None = None) -> ToolStyle:
    """The tool-call format a chat template uses (or `override`), and whether it renders tools."""
    text = template or ""
    native = "tools" in _template_variables(text)
    if override is not None:
        return ToolStyle(override, native)
    if "<tool_call>" in text:
        return ToolStyle("hermes", native)
    if "<|python_tag|>" in text or ("<|start_header_id|>" in text and native):
        return ToolStyle("llama3", native)
    return ToolStyle("hermes", native)


@lru_cache(maxsize=16)
def _template_variables(template: str) -> frozenset[str]:
    """The variables a Jinja template reads from its context (none if it does not parse)."""
    import jinja2
    from jinja2 import meta

    try:
        return frozenset(meta.find_undeclared_variables(jinja2.Environment().parse(template)))
    except jinja2.TemplateError:
        return frozenset()


class Rendered(NamedTuple):
    messages: list[dict]  # for apply_chat_template
    tools: list[dict] | None  # its `tools` argument


def render(messages: list[dict], tools: list[Tool], choice: ToolChoice, style: ToolStyle) -> Rendered:
    """The template's input. With `choice.mode == 'none'` the tools are not shown at all (the
    history's calls and results still are)."""
    shown = tools if choice.mode != "none" else []
    if style.native:
        return Rendered([_native(m, messages) for m in messages], [t.spec() for t in shown] or None)
    out = _fallback_turns(messages, style.format)
    if shown:
        section = tools_section(shown, style.format)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{section}"}
        else:
            out.insert(0, {"role": "system", "content": section})
    return Rendered(out, None)


def _native(m: dict, messages: list[dict]) -> dict:
    out = {"role": m["role"], "content": m.get("content") or "", **({"name": m["name"]} if m.get("name") else {})}
    if m.get("tool_calls"):
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": json.loads(c.arguments)}}
                             for c in m["tool_calls"]]
    if m["role"] == "tool":
        out["tool_call_id"] = m["tool_call_id"]
        out["name"] = next((c.name for x in messages for c in x.get("tool_calls") or () if c.id == m["tool_call_id"]),
                           "")
    return out


def _fallback_turns(messages: list[dict], fmt: str) -> list[dict]:
    """Calls written out in `fmt`; consecutive tool results merged into one user turn."""
    out: list[dict] = []
    for m in messages:
        text = m.get("content") or ""
        if m["role"] == "tool":
            wrapped = f"<tool_response>\n{text}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + wrapped}
            else:
                out.append({"role": "user", "content": wrapped, "tool_results": True})
            continue
        calls = [format_call(c.name, c.arguments, fmt) for c in m.get("tool_calls") or ()]
        joined = SEPARATORS[fmt].join(calls)
        out.append({"role": m["role"], "content": f"{text}\n{joined}" if text and joined else text or joined,
                    **({"name": m["name"]} if m.get("name") else {})})
    return [{k: v for k, v in m.items() if k != "tool_results"} for m in out]


SEPARATORS = {"hermes": "\n", "llama3": "; "}
ARGUMENT_KEYS = {"hermes": "arguments", "llama3": "parameters"}


def call_prefix(name: str, fmt: str) -> str:
    """What a call in `fmt` looks like up to its arguments (the constraint forces this text)."""
    head = f'{{"name": {json.dumps(name)}, "{ARGUMENT_KEYS[fmt]}": '
    return f"<tool_call>\n{head}" if fmt == "hermes" else head


CALL_SUFFIX = {"hermes": "}\n</tool_call>", "llama3": "}"}


def format_call(name: str, arguments: str, fmt: str) -> str:
    return call_prefix(name, fmt) + json.dumps(json.loads(arguments), ensure_ascii=False) + CALL_SUFFIX[fmt]


def tools_section(tools: list[Tool], fmt: str) -> str:
    """The system text that describes `tools` to a template that has no place for them."""
    listing = "\n".join(json.dumps(t.spec(), ensure_ascii=False) for t in tools)
    example = format_call("function_name", '{"argument": "value"}', fmt)
    how = {"hermes": "To call a function, write a JSON object with its name and arguments between "
                     "<tool_call> and </tool_call> tags, one block per call, like this:",
           "llama3": "To call a function, answer with only a JSON object holding its name and its "
                     "parameters (several calls separated by '; '), like this:"}[fmt]
    return (f"# Tools\n\nYou can call the functions listed between <tools> and </tools> to help with the "
            f"user's request.\n<tools>\n{listing}\n</tools>\n\n{how}\n{example}\n"
            "The results come back between <tool_response> and </tool_response> tags.")
