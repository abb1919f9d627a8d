"""Content blocks of Anthropic's Messages API, in and out: the request's tools, tool_choice and
message blocks (text, tool_use, tool_result) turned into the neutral shapes of `server/tools.py`,
and the answer read back (`server/tool_plan.py`) into text and tool_use blocks, whole or as the
content-block events of a stream.

A tool_result becomes a tool message answering its tool_use (its text prefixed with "Error: "
when `is_error`); a final assistant turn is a prefill that the answer continues, so it cannot
hold tool_use blocks. A call whose arguments are not a JSON object (cut short by max_tokens) has
the input `{}` in a whole answer; a stream sends the arguments as the model wrote them.
"""
from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, StrictBool, ValidationError

from hicache.server.bodies import Strict
from hicache.server.protocol import APIError, describe_validation
from hicache.server.tool_plan import ToolPlan, arguments_object
from hicache.server.tools import Tool, ToolCall, ToolChoice, ToolError, check_unique, make_tool

TOOL_FIELDS = {"type", "name", "description", "input_schema", "cache_control"}
CHOICES = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}


class CacheControl(Strict):
    type: Literal["ephemeral"]
    ttl: Optional[Literal["5m", "1h"]] = None


class TextBlock(Strict):
    """A text block. `cache_control` is accepted: every prefix is cached whether marked or not."""

    type: Literal["text"]
    text: str
    cache_control: Optional[CacheControl] = None


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: Optional[CacheControl] = None


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[str, list[dict[str, Any]]] = ""
    is_error: StrictBool = False
    cache_control: Optional[CacheControl] = None


BLOCKS = {"user": {"text": TextBlock, "tool_result": ToolResultBlock},
          "assistant": {"text": TextBlock, "tool_use": ToolUseBlock}}


# ---- the request ------------------------------------------------------------------------------


def parse_tools(raw: list | None) -> list[Tool]:
    """Client tools ({name, description, input_schema}); server tools are not supported."""
    tools = []
    for i, item in enumerate(raw or []):
        at = f"tools.{i}"
        if not isinstance(item, dict):
            raise ToolError("a tool must be an object", at)
        if item.get("type", "custom") != "custom":
            raise ToolError(f"server tools ({item['type']!r}) are not supported, only client tools", f"{at}.type")
        unknown = sorted(set(item) - TOOL_FIELDS)
        if unknown:
            raise ToolError("this field is not supported by this server", f"{at}.{unknown[0]}")
        if "input_schema" not in item:
            raise ToolError("required", f"{at}.input_schema")
        tools.append(make_tool(item.get("name"), item.get("description"), item["input_schema"], at, "input_schema"))
    return check_unique(tools)


def parse_choice(raw: dict | None, tools: list[Tool]) -> tuple[ToolChoice, bool]:
    """(the choice, whether several calls are allowed) of Anthropic's tool_choice."""
    if raw is None:
        return ToolChoice(), True
    kind = raw.get("type")
    if kind not in CHOICES:
        raise ToolError(f"must be 'auto', 'any', 'tool' or 'none', got {kind!r}", "tool_choice.type")
    unknown = sorted(set(raw) - {"type", "disable_parallel_tool_use", *(("name",) if kind == "tool" else ())})
    if unknown:
        raise ToolError(f"not a field of a tool_choice of type {kind!r}", f"tool_choice.{unknown[0]}")
    single = raw.get("disable_parallel_tool_use", False)
    if not isinstance(single, bool):
        raise ToolError("must be a boolean", "tool_choice.disable_parallel_tool_use")
    name = raw.get("name")
    if kind == "tool" and name not in {t.name for t in tools}:
        raise ToolError(f"no tool named {name!r} in tools", "tool_choice.name")
    choice = ToolChoice(CHOICES[kind], name)
    if choice.forced and not tools:
        raise ToolError(f"{kind!r} needs a non-empty tools list", "tool_choice")
    return choice, not single


def conversation(system: str | list | None, messages: list) -> tuple[list[dict], str]:
    """The neutral messages, and the prefill (the text of a final assistant turn) to continue.
    Consecutive turns of one role are one turn."""
    turns = [{"role": "system", "content": block_text(system, "system")}] if system else []
    for i, m in enumerate(messages):
        for turn in _turns(m.role, m.content, f"messages.{i}"):
            prev = turns[-1] if turns else None
            if prev is None or prev["role"] != turn["role"] or turn["role"] == "tool" or prev.get("tool_calls"):
                turns.append(turn)
                continue
            prev["content"] = "\n\n".join(t for t in (prev["content"], turn["content"]) if t)
            if turn.get("tool_calls"):
                prev["tool_calls"] = turn["tool_calls"]
    if turns[-1]["role"] != "assistant":
        return turns, ""
    if turns[-1].get("tool_calls"):
        raise ToolError("a final assistant turn is continued, so it cannot hold tool_use blocks: answer them "
                        "with tool_result blocks in a user turn", f"messages.{len(messages) - 1}.content")
    return turns, turns.pop()["content"]


def _turns(role: str, content: str | list[dict], at: str) -> list[dict]:
    """One message's turns: tool results become tool turns, the rest one turn of `role`."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    out: list[dict] = []
    texts: list[str] = []
    calls: list[ToolCall] = []
    for j, raw in enumerate(content):
        block = _block(raw, BLOCKS[role], f"{at}.content.{j}")
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            if not block.id:
                raise ToolError("a tool_use block needs a non-empty id", f"{at}.content.{j}.id")
            calls.append(ToolCall(block.id, block.name, json.dumps(block.input, ensure_ascii=False)))
        else:
            text = block_text(block.content, f"{at}.content.{j}.content")
            out.append({"role": "tool", "content": f"Error: {text}" if block.is_error else text,
                        "tool_call_id": block.tool_use_id, "path": f"{at}.content.{j}.tool_use_id"})
    if texts or calls or not out:
        out.append({"role": role, "content": "".join(texts), **({"tool_calls": calls} if calls else {})})
    return out


def block_text(content: str | list[dict], path: str) -> str:
    """The text of a string or of a list of text blocks."""
    if isinstance(content, str):
        return content
    return "".join(_block(raw, {"text": TextBlock}, f"{path}.{j}").text for j, raw in enumerate(content))


def _block(raw: Any, kinds: dict[str, type[BaseModel]], path: str) -> BaseModel:
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind not in kinds:
        raise APIError(400, f"{path}.type: expected a block of type {' or '.join(kinds)} here, got {kind!r}",
                       param=f"{path}.type", code="unsupported")
    try:
        return kinds[kind].model_validate(raw)
    except ValidationError as e:
        message, param = describe_validation(e.errors())
        raise APIError(400, f"{path}.{message}", param=f"{path}.{param}", code="invalid_request") from None


# ---- the answer -------------------------------------------------------------------------------


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def answer_blocks(plan: ToolPlan, text: str) -> tuple[list[dict], bool]:
    """(the content blocks, whether they call tools) of a whole answer."""
    parsed = plan.read(text)
    blocks = [{"type": "text", "text": parsed.content}] if parsed.content else []
    blocks += [{"type": "tool_use", "id": tool_use_id(c.id), "name": c.name, "input": arguments_object(c.arguments)}
               for c in parsed.calls]
    return blocks or [{"type": "text", "text": ""}], bool(parsed.calls)


class BlockStream:
    """A streamed answer's text as content-block events ((type, data) pairs): text blocks and
    tool_use blocks with `input_json_delta`s, each block started and stopped in order."""

    def __init__(self, plan: ToolPlan) -> None:
        self.parser = plan.parser()
        self.index, self.open = -1, None  # the current block's index and type

    def opening(self) -> list[tuple[str, dict]]:
        """Without tools the one text block starts at once."""
        return self._start({"type": "text", "text": ""}) if self.parser is None else []

    def feed(self, text: str, finished: bool) -> list[tuple[str, dict]]:
        if self.parser is None:
            events = [text] if text else []
        else:
            events = self.parser.feed(text) + (self.parser.finish() if finished else [])
        out = []
        for e in events:
            if isinstance(e, str):
                out += self._start({"type": "text", "text": ""}) if self.open != "text" else []
                out.append(self._delta({"type": "text_delta", "text": e}))
            elif e.id is not None:
                out += self._start({"type": "tool_use", "id": tool_use_id(e.id), "name": e.name, "input": {}})
            else:
                out.append(self._delta({"type": "input_json_delta", "partial_json": e.arguments}))
        return out

    def close(self) -> list[tuple[str, dict]]:
        """The last block's stop (an empty text block when the answer had none)."""
        out = self._start({"type": "text", "text": ""}) if self.open is None else []
        return out + [("content_block_stop", {"index": self.index})]

    @property
    def called(self) -> bool:
        return self.parser is not None and bool(self.parser.calls)

    def _start(self, block: dict) -> list[tuple[str, dict]]:
        out = [("content_block_stop", {"index": self.index})] if self.open is not None else []
        self.index, self.open = self.index + 1, block["type"]
        return out + [("content_block_start", {"index": self.index, "content_block": block})]

    def _delta(self, delta: dict) -> tuple[str, dict]:
        return "content_block_delta", {"index": self.index, "delta": delta}
