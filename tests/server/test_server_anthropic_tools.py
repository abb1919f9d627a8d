"""Tool use on Anthropic's Messages API of the shared server, driven by the `anthropic` package:
every tool_choice, streamed and not, gives well-formed SDK blocks (a forced call's input validates
against its schema); a tool_result goes back through the same rendering as OpenAI's tool
messages; bad tools, choices and blocks are Anthropic 400s naming the field."""
from __future__ import annotations

import json

import anthropic
import openai
import pytest

from server_harness import ALIAS, MODEL_NAME
from test_server_tools import WEATHER, valid

pytestmark = pytest.mark.model
GREEDY = {"temperature": 0}
TOOLS = [{"name": "get_weather", "description": "Weather forecast", "input_schema": WEATHER},
         {"name": "get_time", "description": "The current time", "input_schema": {"type": "object", "properties": {}}}]
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}
QUESTION = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", timeout=120, max_retries=0)


def create(client, streamed: bool, **kw):
    """The SDK's message, built from the stream's events when `streamed`."""
    args = {"model": ALIAS, "messages": QUESTION, "tools": TOOLS, "extra_body": GREEDY, **kw}
    if not streamed:
        return client.messages.create(**args)
    with client.messages.stream(**args) as stream:
        kinds = [(e.type, getattr(e, "content_block", None)) for e in stream]
        message = stream.get_final_message()
    starts = [b.type for kind, b in kinds if kind == "content_block_start"]
    assert starts == [b.type for b in message.content] and kinds[-1][0] == "message_stop"
    return message


def check_uses(message, enforced: bool) -> list[str]:
    """The tool_use blocks' names; each block well formed, its input valid when enforced."""
    uses = [b for b in message.content if b.type == "tool_use"]
    assert all(isinstance(b, anthropic.types.ToolUseBlock) for b in uses)
    assert len({b.id for b in uses}) == len(uses) and all(b.id.startswith("toolu_") for b in uses)
    for b in uses:
        assert b.name in SCHEMAS and isinstance(b.input, dict)
        assert valid(b.input, SCHEMAS[b.name]) or not enforced, (b.name, b.input)
    assert (message.stop_reason == "tool_use") == bool(uses) or message.stop_reason == "max_tokens"
    return [b.name for b in uses]


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("choice", [{"type": "any", "disable_parallel_tool_use": True},
                                    {"type": "tool", "name": "get_weather"}], ids=["any", "tool"])
def test_forced_choices_give_valid_tool_use_blocks(client, choice, streamed):
    m = create(client, streamed, max_tokens=64, tool_choice=choice)
    assert [b.type for b in m.content] == ["tool_use"] and m.stop_reason == "tool_use"
    names = check_uses(m, enforced=True)
    assert names == ["get_weather"] or choice["type"] == "any"


def asked(i: int, city: str, days: int) -> list[dict]:
    """A question, the assistant's tool_use answering it, and the tool's result."""
    use = {"type": "tool_use", "id": f"toolu_{i}", "name": "get_weather", "input": {"city": city, "days": days}}
    return [{"role": "user", "content": f"Weather in {city} for {days} days?"},
            {"role": "assistant", "content": [use]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": "sunny"}]},
            {"role": "assistant", "content": "Sunny."}]


# two examples, then the question: the model answers with a call in the same format
FEW_SHOT = [*asked(1, "London", 2), *asked(2, "Rome", 1), {"role": "user", "content": "Weather in Paris for 3 days?"}]


def test_a_repeated_forced_call_reads_only_its_prompt_from_the_cache(client):
    """The forced call's first tokens, left in the tree by the first request, are matched with the
    prompt by the second: they do not count as cached input."""
    first = create(client, False, max_tokens=64, tool_choice={"type": "tool", "name": "get_weather"})
    again = create(client, False, max_tokens=64, tool_choice={"type": "tool", "name": "get_weather"})
    prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == prompt
    assert again.usage.input_tokens >= 1 and again.usage.cache_read_input_tokens > 0


def test_auto_reads_the_calls_out_of_the_answer_streamed_or_not(client):
    whole, streamed = (create(client, s, max_tokens=40, messages=FEW_SHOT) for s in (False, True))
    assert check_uses(whole, enforced=False)[:1] == ["get_weather"], whole.content
    assert [b.type for b in streamed.content] == [b.type for b in whole.content]
    assert [(b.type, b.text if b.type == "text" else (b.name, b.input)) for b in streamed.content] == \
        [(b.type, b.text if b.type == "text" else (b.name, b.input)) for b in whole.content]
    assert streamed.stop_reason == whole.stop_reason


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_none_gives_text_only(client, streamed):
    m = create(client, streamed, max_tokens=8, messages=FEW_SHOT, tool_choice={"type": "none"})
    assert [b.type for b in m.content] == ["text"] and m.stop_reason != "tool_use"


def test_a_tool_result_round_trip_renders_as_openai_does(client, server):
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "days": 3}}
    history = [*QUESTION, {"role": "assistant", "content": [use]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                             "content": [{"type": "text", "text": "sunny, 24 C"}]}]}]
    m = create(client, False, max_tokens=4, messages=history, tool_choice={"type": "none"})
    assert m.content[0].type == "text" and m.usage.output_tokens >= 1
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120, max_retries=0)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(use["input"])}}
    chat = oai.chat.completions.create(model=MODEL_NAME, max_tokens=1, tools=[
        {"type": "function", "function": {"name": t["name"], "description": t["description"],
                                          "parameters": t["input_schema"]}} for t in TOOLS],
        messages=[*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"}])
    assert client.messages.count_tokens(model=ALIAS, messages=history, tools=TOOLS).input_tokens == \
        chat.usage.prompt_tokens
    # with tool_choice none the tools are not shown: the prompt is shorter by their description
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens < chat.usage.prompt_tokens


def use_turn(tool_input=None) -> dict:
    return {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_time",
                                              "input": {} if tool_input is None else tool_input}]}


def result_turn(use_id: str = "toolu_1") -> dict:
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use_id, "content": "12:00"}]}


BAD = [
    ({"tools": [{"name": "f"}]}, "tools.0.input_schema"),
    ({"tools": [{"name": "no spaces", "input_schema": {"type": "object"}}]}, "tools.0.name"),
    ({"tools": [{"name": "f", "input_schema": {"type": "array"}}]}, "tools.0.input_schema"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({"tools": [*TOOLS, TOOLS[0]]}, "tools"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"tool_choice": {"type": "tool", "name": "get_stock"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "any", "name": "get_time"}}, "tool_choice.name"),
    ({"tools": [], "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"messages": [*QUESTION, use_turn(), result_turn("toolu_9")]}, "messages.2.content.0.tool_use_id"),
    ({"messages": [*QUESTION, use_turn([1]), result_turn()]}, "messages.1.content.0.input"),
    ({"messages": [*QUESTION, use_turn()]}, "messages.1.content"),
    ({"messages": [result_turn()]}, "messages.0.content.0.tool_use_id"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0.type"),
    ({"messages": [*QUESTION, {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x"}]}]},
     "messages.1.content.0.type"),
]


@pytest.mark.parametrize("kw, param", BAD, ids=[p for _, p in BAD])
def test_bad_tools_are_anthropic_400s(client, kw, param):
    args = {"model": ALIAS, "max_tokens": 1, "messages": QUESTION, "tools": TOOLS, **kw}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(**args)
    error = e.value.body
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith(param + ":"), error
