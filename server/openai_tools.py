"""Tool calling on /v1/chat/completions: the request's tools, choice and history checked and
rendered (`plan_tools`), and the answer's calls shaped as OpenAI's `message.tool_calls` and streamed
`delta.tool_calls`. The format-neutral parts live in `server/tools.py`, `server/tool_parser.py`
and `server/tool_grammar.py`."""
from __future__ import annotations

from dataclasses import dataclass

from hicache.server.protocol import APIError, ChatCompletionRequest
from hicache.server.tool_grammar import call_constraint
from hicache.server.tool_parser import ToolDelta, ToolParser, parse_text
from hicache.server.tools import (
    ToolError,
    ToolStyle,
    check_history,
    parse_call,
    parse_tool_choice,
    parse_tools,
    render,
    template_style,
)


@dataclass(frozen=True)
class ToolPlan:
    """What one chat request does about tools."""

    messages: list[dict]  # for the chat template
    template_tools: list[dict] | None  # the template's `tools` argument
    constraint: dict  # sampling fields that force the calls ({} when none are forced)
    style: ToolStyle
    parallel: bool
    parses: bool  # whether the answer is read for calls

    def parser(self) -> ToolParser | None:
        return ToolParser(self.style.format, self.parallel) if self.parses else None


def plan_tools(body: ChatCompletionRequest, template: str | None, parser_flag: str | None) -> ToolPlan:
    """Check the request's tools, choice and history (400 naming the field) and render them."""
    try:
        messages = _conversation(body)
        tools = parse_tools(body.tools)
        choice = parse_tool_choice(body.tool_choice, tools)
        check_history(messages)
        style = template_style(template, parser_flag)
        rendered = render(messages, tools, choice, style)
        constraint = call_constraint(tools, choice, style.format, body.parallel_tool_calls)
    except ToolError as e:
        raise APIError(400, str(e), param=e.param, code="invalid_value") from None
    return ToolPlan(rendered.messages, rendered.tools, constraint, style, body.parallel_tool_calls,
                    parses=bool(tools) and choice.mode != "none")


def _conversation(body: ChatCompletionRequest) -> list[dict]:
    """The messages in the neutral shape of `server/tools.py`."""
    out = []
    for i, m in enumerate(body.messages):
        turn = {"role": "system" if m.role == "developer" else m.role, "content": m.text(),
                **({"name": m.name} if m.name else {})}
        if m.tool_calls:
            if m.role != "assistant":
                raise ToolError("only assistant messages carry tool calls", f"messages.{i}.tool_calls")
            turn["tool_calls"] = [parse_call(c, f"messages.{i}.tool_calls.{j}") for j, c in enumerate(m.tool_calls)]
        if m.role == "tool":
            turn["tool_call_id"] = m.tool_call_id
        out.append(turn)
    return out


def final_message(plan: ToolPlan | None, text: str, reason: str | None) -> tuple[dict, str | None]:
    """The choice's message and finish reason ('tool_calls' when the answer called tools)."""
    if plan is None or not plan.parses:
        return {"role": "assistant", "content": text}, reason
    parsed = parse_text(text, plan.style.format, plan.parallel)
    if not parsed.calls:
        return {"role": "assistant", "content": parsed.content}, reason
    calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for c in parsed.calls]
    return {"role": "assistant", "content": parsed.content, "tool_calls": calls}, _reason(reason)


def _reason(reason: str | None) -> str | None:
    return "tool_calls" if reason == "stop" else reason


class StreamShaper:
    """One streamed choice's text deltas turned into OpenAI deltas, tool calls read out."""

    def __init__(self, plan: ToolPlan | None) -> None:
        self.parser = plan.parser() if plan is not None else None

    def deltas(self, text: str, finished: bool) -> list[dict]:
        """The deltas (`content` or `tool_calls`) that `text` completes, in order."""
        if self.parser is None:
            return [{"content": text}] if text else []
        events = self.parser.feed(text) + (self.parser.finish() if finished else [])
        return [{"content": e} if isinstance(e, str) else {"tool_calls": [_tool_delta(e)]} for e in events]

    def finish_reason(self, reason: str | None) -> str | None:
        return _reason(reason) if self.parser is not None and self.parser.calls else reason


def _tool_delta(d: ToolDelta) -> dict:
    if d.id is not None:
        return {"index": d.index, "id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}}
    return {"index": d.index, "function": {"arguments": d.arguments}}
