"""Tool calling on /v1/chat/completions: the request's tools, choice and history checked and
rendered (`plan_tools`), and the answer's calls shaped as OpenAI's `message.tool_calls` and streamed
`delta.tool_calls`. The API-neutral parts live in `server/tool_plan.py` and the modules it uses."""
from __future__ import annotations

from fastapi import Request
from hicache.server.bodies import ChatCompletionRequest
from hicache.server.tool_parser import ToolDelta
from hicache.server.tool_plan import ToolPlan, bad_request, make_plan, request_style
from hicache.server.tools import ToolError, parse_call, parse_tool_choice, parse_tools


def plan_tools(body: ChatCompletionRequest, request: Request) -> ToolPlan:
    """Check the request's tools, choice and history (400 naming the field) and render them."""
    try:
        tools = parse_tools(body.tools)
        choice = parse_tool_choice(body.tool_choice, tools)
        return make_plan(_conversation(body), tools, choice, body.parallel_tool_calls, request_style(request))
    except ToolError as e:
        raise bad_request(e) from None


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
    parsed = plan.read(text)
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
