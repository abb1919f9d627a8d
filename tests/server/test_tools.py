"""Tools without a server: the checks (each naming its field), the rendering through chat templates
that know tools and through the fallback, and the grammar that forces calls (XGrammar)."""
from __future__ import annotations

import json

import pytest

from hicache.runtime.tokenizer import apply_chat_template
from hicache.server.tool_grammar import call_constraint
from hicache.server.tool_parser import parse_text
from hicache.server.tools import (
    SEPARATORS,
    ToolCall,
    ToolChoice,
    ToolError,
    ToolStyle,
    check_history,
    format_call,
    parse_call,
    parse_tool_choice,
    parse_tools,
    render,
    template_style,
)

CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["city", "days"]}
TOOLS = parse_tools([{"type": "function", "function": {"name": "weather", "description": "Weather", "parameters": CITY}},
                     {"type": "function", "function": {"name": "time"}}])


def fn(**f) -> list:
    return [{"type": "function", "function": f}]


@pytest.mark.parametrize("raw,param", [
    (fn(description="no name"), "tools.0.function.name"),
    (fn(name="bad name!"), "tools.0.function.name"),
    (fn(name="f", parameters={"type": "array"}), "tools.0.function.parameters"),
    (fn(name="f", parameters="{}"), "tools.0.function.parameters"),
    (fn(name="f", description=3), "tools.0.function.description"),
    ([{"type": "function"}], "tools.0.function"),
    ([{"type": "code_interpreter"}], "tools.0"),
    (fn(name="f") + fn(name="f"), "tools"),
])
def test_malformed_tools_name_the_field(raw, param):
    with pytest.raises(ToolError) as e:
        parse_tools(raw)
    assert e.value.param == param


@pytest.mark.parametrize("raw,param", [
    ("sometimes", "tool_choice"),
    ({"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    ({"type": "function"}, "tool_choice"),
])
def test_bad_tool_choice_names_the_field(raw, param):
    with pytest.raises(ToolError) as e:
        parse_tool_choice(raw, TOOLS)
    assert e.value.param == param
    with pytest.raises(ToolError):
        parse_tool_choice("required", [])


def test_tool_choices():
    assert parse_tool_choice(None, []) == ToolChoice("auto")
    assert parse_tool_choice({"type": "function", "function": {"name": "time"}}, TOOLS) == ToolChoice("function", "time")
    assert parse_tool_choice("none", TOOLS).mode == "none"


def test_history_checks():
    call = {"id": "c1", "type": "function", "function": {"name": "time", "arguments": "{}"}}
    assert parse_call(call, "m") == ToolCall("c1", "time", "{}")
    for bad, param in [({**call, "function": {"name": "time", "arguments": "{oops"}}, "m.function.arguments"),
                       ({**call, "function": {"name": "time", "arguments": "[1]"}}, "m.function.arguments"),
                       ({**call, "id": ""}, "m.id"), ({"id": "x"}, "m")]:
        with pytest.raises(ToolError) as e:
            parse_call(bad, "m")
        assert e.value.param == param
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [parse_call(call, "m")]}]
    check_history(turns + [{"role": "tool", "content": "1", "tool_call_id": "c1"}])
    for tool_call_id in (None, "c2"):
        with pytest.raises(ToolError) as e:
            check_history(turns + [{"role": "tool", "content": "1", "tool_call_id": tool_call_id}])
        assert e.value.param == "messages.2.tool_call_id"


HISTORY = [{"role": "user", "content": "Weather in Rome?"},
           {"role": "assistant", "content": None, "tool_calls": [ToolCall("c1", "weather", '{"city": "Rome", "days": 1}')]},
           {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]


@pytest.mark.parametrize("fmt", ["hermes", "llama3"])
def test_fallback_rendering_writes_calls_the_parser_reads(fmt):
    out = render(HISTORY, TOOLS, ToolChoice(), ToolStyle(fmt, native=False))
    assert out.tools is None and [m["role"] for m in out.messages] == ["system", "user", "assistant", "user"]
    assert '"name": "weather"' in out.messages[0]["content"] and "<tools>" in out.messages[0]["content"]
    call = parse_text(out.messages[2]["content"], fmt).calls
    assert [(c.name, json.loads(c.arguments)) for c in call] == [("weather", {"city": "Rome", "days": 1})]
    assert out.messages[3]["content"] == "<tool_response>\nsunny\n</tool_response>"
    quiet = render([{"role": "system", "content": "Be brief."}, *HISTORY], TOOLS, ToolChoice("none"), ToolStyle(fmt, False))
    assert quiet.messages[0]["content"] == "Be brief." and "<tool_call>" not in quiet.messages[0]["content"]


NATIVE = """{%- if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}
{%- for m in messages %}<{{ m.role }}>{{ m.content }}
{%- for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} {{ c.function.arguments | tojson }}</tool_call>{% endfor %}
{%- if m.tool_call_id %}[{{ m.tool_call_id }} {{ m.name }}]{% endif %}{% endfor %}"""


def test_native_rendering_goes_through_the_template():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"x": 0, "y": 1}, unk_token="x")))
    tok.chat_template = NATIVE
    style = template_style(tok.chat_template)
    assert style == ToolStyle("hermes", native=True)
    out = render(HISTORY, TOOLS, ToolChoice(), style)
    text = tok.apply_chat_template(out.messages, tools=out.tools, tokenize=False)
    assert text.startswith("<tools>weather;time;</tools>")
    assert '<tool_call>weather {"city": "Rome", "days": 1}</tool_call>' in text and "<tool>sunny[c1 weather]" in text
    tok.chat_template = "{% if tools %}y{% else %}x{% endif %}"  # the runtime's helper passes the tools on
    assert apply_chat_template(tok, out.messages, out.tools) == [1] and apply_chat_template(tok, out.messages) == [0]


def test_template_styles():
    assert template_style(None) == ToolStyle("hermes", False)
    assert template_style("{{ 'You may use tools.' }}{{ messages[0].content }}") == ToolStyle("hermes", False)
    assert template_style("{{ '<|start_header_id|>' }}{% if tools %}{% endif %}") == ToolStyle("llama3", True)
    assert template_style("<|python_tag|>") == ToolStyle("llama3", False)
    assert template_style("<tool_call>{{ tools }}", "llama3") == ToolStyle("llama3", True)


@pytest.mark.parametrize("fmt", ["hermes", "llama3"])
def test_forced_calls_grammar(fmt):
    xgrammar = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string as accepts

    rome = format_call("weather", '{"city": "Rome", "days": 3}', fmt)
    now = format_call("time", "{}", fmt)
    assert call_constraint(TOOLS, ToolChoice("auto"), fmt, True) == {}
    many = xgrammar.Grammar.from_ebnf(call_constraint(TOOLS, ToolChoice("required"), fmt, True)["ebnf"])
    assert accepts(many, rome) and accepts(many, rome + SEPARATORS[fmt] + now)
    assert not accepts(many, SEPARATORS[fmt].join([rome, now, now]))  # at most a call a tool: no runaway
    for bad in ("", "hi " + rome, rome.replace("Rome", "Oslo"), rome.replace("3", "12"),
                format_call("weather", '{"city": "Rome"}', fmt), format_call("sleep", "{}", fmt)):
        assert not accepts(many, bad), bad
    one = xgrammar.Grammar.from_ebnf(call_constraint(TOOLS, ToolChoice("required"), fmt, False)["ebnf"])
    assert accepts(one, now) and not accepts(one, rome + SEPARATORS[fmt] + now)
    named = xgrammar.Grammar.from_ebnf(call_constraint(TOOLS, ToolChoice("function", "time"), fmt, True)["ebnf"])
    assert accepts(named, now) and not accepts(named, rome)


def test_a_schema_the_grammar_cannot_use_names_the_tool():
    pytest.importorskip("xgrammar")
    tools = TOOLS + parse_tools(fn(name="f", parameters={"type": "object", "properties": {
        "a": {"type": "string", "pattern": "[unclosed"}}}))
    with pytest.raises(ToolError) as e:
        call_constraint(tools, ToolChoice("required"), "hermes", True)
    assert e.value.param == "tools.2.function.parameters"


def test_the_parser_flag_is_checked():
    from hicache.server.config import ServerConfig

    assert ServerConfig(tool_call_parser="llama3").tool_call_parser == "llama3"
    with pytest.raises(ValueError, match="tool_call_parser"):
        ServerConfig(tool_call_parser="mistral")
