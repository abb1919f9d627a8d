"""Tool calling through a real server and the `openai` client: every tool_choice, streamed and
not, gives well-formed SDK objects; a call's result goes back in the history; bad tools and tool
messages are 400s naming the field, and the server keeps serving. The default model's template
knows no tools: the fallback rendering and the Hermes parser are what runs here."""
from __future__ import annotations

import dataclasses
import json

import httpx
import openai
import pytest

from hicache.runtime.sampling import SamplingParams
from server_harness import LIGHT_FLAGS, start_server

pytestmark = pytest.mark.model
needs_grammar = pytest.mark.skipif("ebnf" not in {f.name for f in dataclasses.fields(SamplingParams)},
                                   reason="needs the grammar branch")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Rome"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The current time"}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": {"type": "object", "properties": {}}}


def asked(i: int, city: str, days: int) -> list[dict]:
    """A user question and the assistant's call that answered it."""
    call = {"id": f"call_{i}", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city, "days": days})}}
    return [{"role": "user", "content": f"Weather in {city} for {days} days?"},
            {"role": "assistant", "content": None, "tool_calls": [call]}]


# two examples, then the question: the model answers with a call in the same format
FEW_SHOT = [*asked(1, "London", 2), *asked(2, "Rome", 1), {"role": "user", "content": "Weather in Paris for 3 days?"}]
QUESTION = [{"role": "user", "content": "What time is it?"}]


def valid(args: dict, schema: dict) -> bool:
    """The parts of JSON schema WEATHER uses: required keys, enums, integer bounds."""
    props = schema.get("properties", {})
    if set(schema.get("required", ())) - set(args) or set(args) - set(props):
        return False
    for key, value in args.items():
        rule = props[key]
        if "enum" in rule and value not in rule["enum"]:
            return False
        if rule.get("type") == "integer" and not (isinstance(value, int)
                                                   and rule["minimum"] <= value <= rule["maximum"]):
            return False
    return True


def check_calls(calls: list[tuple[str, str, str]], enforced: bool) -> list[tuple[str, dict]]:
    """(id, name, arguments) of SDK calls: well formed; valid against the schema when enforced."""
    assert len({i for i, _, _ in calls}) == len(calls)
    out = []
    for call_id, name, arguments in calls:
        assert call_id.startswith("call_") and name in SCHEMAS
        args = json.loads(arguments)
        assert isinstance(args, dict) and (valid(args, SCHEMAS[name]) or not enforced), (name, args)
        out.append((name, args))
    return out


def complete(client, model, messages, **kw):
    """(content, [(id, name, arguments)], finish_reason) of a non-streamed answer."""
    r = client.chat.completions.create(model=model, messages=messages, **{"tools": TOOLS, "temperature": 0, **kw})
    msg = r.choices[0].message
    assert msg.role == "assistant"
    calls = [(c.id, c.function.name, c.function.arguments) for c in msg.tool_calls or ()]
    assert all(c.type == "function" for c in msg.tool_calls or ())
    return msg.content, calls, r.choices[0].finish_reason


def stream(client, model, messages, **kw):
    """The same, rebuilt from the streamed deltas (name first, then argument fragments)."""
    chunks = list(client.chat.completions.create(model=model, messages=messages, stream=True,
                                                 **{"tools": TOOLS, "temperature": 0, **kw}))
    content, calls, finish = "", {}, None
    for chunk in chunks:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        finish = choice.finish_reason or finish
        for d in choice.delta.tool_calls or ():
            if d.index not in calls:
                assert d.id and d.type == "function" and d.function.name and not d.function.arguments
                calls[d.index] = [d.id, d.function.name, ""]
            else:
                assert d.id is None and d.function.name is None
                calls[d.index][2] += d.function.arguments
    assert sorted(calls) == list(range(len(calls)))
    assert [c.choices[0].finish_reason for c in chunks].count(finish) == 1
    return content or None, [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.fixture(scope="module")
def auto(client, model):
    """The non-streamed answer to FEW_SHOT with tool_choice auto."""
    return client.chat.completions.create(model=model, messages=FEW_SHOT, tools=TOOLS, temperature=0, max_tokens=40)


def test_auto_reads_the_calls_out_of_the_answer_streamed_or_not(client, model, auto):
    msg = auto.choices[0].message
    whole = (msg.content, [(c.id, c.function.name, c.function.arguments) for c in msg.tool_calls or ()],
             auto.choices[0].finish_reason)
    assert whole[1], whole  # the examples lead the model to call
    assert all(c.type == "function" for c in msg.tool_calls)
    streamed = stream(client, model, FEW_SHOT, max_tokens=40)
    for content, calls, finish in (whole, streamed):
        assert check_calls(calls, enforced=False)[0][0] == "get_weather"
        assert "<tool_call>" not in (content or "") and "</tool_call>" not in (content or "")
        assert finish in ("tool_calls", "length")
    assert streamed[0] == whole[0] and streamed[2] == whole[2]
    assert [c[1:] for c in streamed[1]] == [c[1:] for c in whole[1]]


def test_none_renders_no_tools_and_reads_no_calls(client, model):
    plain = client.chat.completions.create(model=model, messages=FEW_SHOT, max_tokens=1)
    r = client.chat.completions.create(model=model, messages=FEW_SHOT, tools=TOOLS, tool_choice="none", temperature=0,
                                       max_tokens=8)
    assert r.choices[0].message.tool_calls is None and isinstance(r.choices[0].message.content, str)
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens
    streamed = stream(client, model, FEW_SHOT, max_tokens=8, tool_choice="none")
    assert streamed[1] == [] and streamed[0] == r.choices[0].message.content


def test_a_call_and_its_result_go_back_in_the_history(client, model, auto):
    msg = auto.choices[0].message
    assert msg.tool_calls
    history = [*FEW_SHOT, msg.model_dump(exclude_none=True),
               *({"role": "tool", "tool_call_id": c.id, "content": '{"forecast": "sunny"}'} for c in msg.tool_calls),
               {"role": "user", "content": "So, shall I take an umbrella?"}]
    content, calls, finish = complete(client, model, history, max_tokens=4, tool_choice="none")
    assert calls == [] and content and finish in ("stop", "length")


@needs_grammar
@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_forced_calls_match_the_schema(client, model, choice, streamed):
    content, calls, finish = (stream if streamed else complete)(client, model, QUESTION, max_tokens=64, tool_choice=choice,
                                                                parallel_tool_calls=False)
    assert len(calls) == 1 and finish == "tool_calls" and not content
    (name, _), = check_calls(calls, enforced=True)
    assert name == "get_weather" or choice == "required"


@needs_grammar
@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_required_parallel_calls_do_not_run_away(client, model, streamed):
    """tool_choice 'required' with parallel calls (OpenAI's default): at most a call a tool, the
    answer ending with its calls, no cut call in the content."""
    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    one = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                             "parameters": city}}]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    for tools, messages, most in ((one, ask, 1), (TOOLS, ask, 2), (TOOLS, FEW_SHOT, 2)):
        r = (stream if streamed else complete)(client, model, messages, max_tokens=120, tool_choice="required",
                                               tools=tools)
        content, calls, finish = r
        assert 1 <= len(calls) <= most and finish == "tool_calls" and not content, r


def call_msg(arguments: str = "{}", call_id: str = "c1") -> dict:
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": "get_time", "arguments": arguments}}]}


BAD = [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "(unclosed"}}}}}], "tool_choice": "required"}, "tools.0.function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_stock"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": "get_time"}, "tools"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": [*QUESTION, call_msg(), {"role": "tool", "content": "12:00"}]}, "messages.2.tool_call_id"),
    ({"messages": [*QUESTION, call_msg(), {"role": "tool", "content": "12:00", "tool_call_id": "c9"}]},
     "messages.2.tool_call_id"),
    ({"messages": [*QUESTION, call_msg("{not json")]}, "messages.1.tool_calls.0.function.arguments"),
    ({"messages": [*QUESTION, {"role": "tool", "content": "12:00", "tool_call_id": "c1"}]}, "messages.1.tool_call_id"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": call_msg()["tool_calls"]}]}, "messages.0.tool_calls"),
]


@pytest.mark.parametrize("fields,param", BAD, ids=[p for _, p in BAD])
def test_bad_tools_are_400s_naming_the_field(server, fields, param):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 1, **fields},
                   timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_still_serving_after_bad_tools(client, model):
    content, calls, _ = complete(client, model, [*QUESTION, call_msg(), {"role": "tool", "content": "12:00",
                                                                          "tool_call_id": "c1"}], max_tokens=2,
                            tool_choice="none")
    assert content and calls == []


@pytest.mark.slow
def test_llama3_format_through_a_server_of_its_own():
    """--tool-call-parser llama3: the fallback writes calls as bare JSON and the answer is read so."""
    handle = start_server(*LIGHT_FLAGS, "--skip-server-warmup", "--tool-call-parser", "llama3")
    try:
        client = openai.OpenAI(base_url=handle.url + "/v1", api_key="unused", timeout=120, max_retries=0)
        model = client.models.list().data[0].id
        whole = complete(client, model, FEW_SHOT, max_tokens=30)
        streamed = stream(client, model, FEW_SHOT, max_tokens=30)
        for content, calls, _ in (whole, streamed):
            assert calls and check_calls(calls, enforced=False)[0][0] == "get_weather"
            assert '"parameters"' not in (content or "")
        assert [c[1:] for c in streamed[1]] == [c[1:] for c in whole[1]] and streamed[0] == whole[0]
    finally:
        handle.stop()
