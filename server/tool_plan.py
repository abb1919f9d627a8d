"""What one request does about tools, whatever its API: the neutral conversation (see
`server/tools.py`) checked and rendered for the chat template, the constraint that forces the
calls (`server/tool_grammar.py`), and how the answer is read back (`server/tool_parser.py`).
Each API route (OpenAI, Anthropic, Ollama) turns its own shapes into `Tool`s, a `ToolChoice` and
neutral messages, calls `make_plan`, and shapes the calls it reads back in its own way."""
from __future__ import annotations

import json
from dataclasses import dataclass

from fastapi import Request

from hicache.server.protocol import APIError
from hicache.server.serving import tm_of
from hicache.server.tool_grammar import call_constraint
from hicache.server.tool_parser import ParsedText, ToolParser, parse_text
from hicache.server.tools import Tool, ToolChoice, ToolError, ToolStyle, check_history, render, template_style


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

    def read(self, text: str) -> ParsedText:
        """A whole answer's content and calls (no calls when the answer is not read for them)."""
        return parse_text(text, self.style.format, self.parallel) if self.parses else ParsedText(text or None, [])


def request_style(request: Request) -> ToolStyle:
    """The served model's tool-call style: its chat template's, or the --tool-call-parser flag's."""
    template = getattr(tm_of(request).tokenizer, "chat_template", None)
    return template_style(template if isinstance(template, str) else None, request.app.state.config.tool_call_parser)


def make_plan(messages: list[dict], tools: list[Tool], choice: ToolChoice, parallel: bool, style: ToolStyle,
              schema_param: str = "function.parameters") -> ToolPlan:
    """Check the history and render it with the tools; a problem is a `ToolError` naming the field
    (`schema_param`: where a tool's schema sits under `tools.<i>` in the API's shape)."""
    check_history(messages)
    rendered = render(messages, tools, choice, style)
    constraint = call_constraint(tools, choice, style.format, parallel, schema_param)
    return ToolPlan(rendered.messages, rendered.tools, constraint, style, parallel,
                    parses=bool(tools) and choice.mode != "none")


def bad_request(e: ToolError) -> APIError:
    """The 400 for a malformed tool, choice or tool message (the route's error style applies)."""
    return APIError(400, str(e), param=e.param, code="invalid_value")


def arguments_object(arguments: str) -> dict:
    """A call's arguments as an object, for APIs that send them so; `{}` when the text is not a
    JSON object (a call cut short by the token limit)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
