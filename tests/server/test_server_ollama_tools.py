"""Tools and `format` on Ollama's API of the shared server, driven by the `ollama` package: a
conversation with calls and results renders as OpenAI's does, the calls the model writes come
back as `message.tool_calls` (arguments as objects) streamed or not, and `format` constrains the
answer to JSON; bad tools, tool messages and formats are 400s naming the field."""
from __future__ import annotations

import json

import httpx
import ollama
import pytest

from server_harness import ALIAS

pytestmark = pytest.mark.model
# what the ollama package keeps of a schema (it drops keywords it does not know, such as bounds)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Rome"]},
                                            "days": {"type": "integer"}}, "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}}]


def asked(city: str, days: int, result: bool) -> list[dict]:
    """A question, the assistant's call in Ollama's shape, and (`result`) the tool's answer."""
    call = {"function": {"name": "get_weather", "arguments": {"city": city, "days": days}}}
    return [{"role": "user", "content": f"Weather in {city} for {days} days?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            *([{"role": "tool", "tool_name": "get_weather", "content": '{"forecast": "sunny"}'}] if result else [])]


FEW_SHOT = [*asked("London", 2, False), *asked("Rome", 1, False), {"role": "user", "content": "Weather in Paris for 3 days?"}]


def as_openai(messages: list[dict]) -> list[dict]:
    """The same conversation in OpenAI's shape (calls with ids, results answering them)."""
    out, last = [], None
    for i, m in enumerate(messages):
        if m.get("tool_calls"):
            last = f"call_{i}"
            calls = [{"id": last, "type": "function", "function": {**c["function"], "arguments": json.dumps(
                c["function"]["arguments"])}} for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": None, "tool_calls": calls})
        elif m["role"] == "tool":
            out.append({"role": "tool", "tool_call_id": last, "content": m["content"]})
        else:
            out.append(m)
    return out


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url, timeout=120)


def test_calls_come_back_as_tool_calls_streamed_or_not(client, oai):
    options = {"temperature": 0, "num_predict": 30}
    r = client.chat(model=ALIAS, messages=FEW_SHOT, tools=TOOLS, options=options)
    chat = oai.chat.completions.create(model=ALIAS, messages=as_openai(FEW_SHOT), tools=TOOLS, temperature=0,
                                       max_tokens=30)
    assert r.prompt_eval_count == chat.usage.prompt_tokens
    expected = [(c.function.name, json.loads(c.function.arguments)) for c in chat.choices[0].message.tool_calls]
    assert expected, chat  # the examples lead the model to call
    assert [(c.function.name, dict(c.function.arguments)) for c in r.message.tool_calls] == expected
    assert r.message.content == (chat.choices[0].message.content or "")
    parts = list(client.chat(model=ALIAS, messages=FEW_SHOT, tools=TOOLS, options=options, stream=True))
    streamed = [(c.function.name, dict(c.function.arguments)) for p in parts for c in p.message.tool_calls or ()]
    assert streamed == expected and "".join(p.message.content for p in parts) == r.message.content
    assert parts[-1].done and not parts[-1].message.tool_calls


def test_tool_results_render_as_openai_tool_messages(client, oai):
    history = [*asked("Rome", 1, True), {"role": "user", "content": "Shall I take an umbrella?"}]
    r = client.chat(model=ALIAS, messages=history, tools=TOOLS, options={"temperature": 0, "num_predict": 1})
    chat = oai.chat.completions.create(model=ALIAS, messages=as_openai(history), tools=TOOLS, max_tokens=1)
    assert r.prompt_eval_count == chat.usage.prompt_tokens and r.message.content


WEATHER_ASK = ([{"role": "user", "content": "Weather in Paris for 3 days, as JSON?"}], {"temperature": 0})
# free JSON nests without end under greedy decoding: sampled, as the OpenAI json_object test does
PERSON_ASK = ([{"role": "user", "content": "Describe a person as JSON with a name and an age."}],
              {"temperature": 0.8, "seed": 1})


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("fmt, ask", [("json", PERSON_ASK), (WEATHER, WEATHER_ASK)], ids=["json", "schema"])
def test_format_constrains_the_answer_to_json(client, fmt, ask, streamed):
    messages, options = ask[0], {**ask[1], "num_predict": 48}
    if streamed:
        parts = list(client.chat(model=ALIAS, messages=messages, format=fmt, options=options, stream=True))
        text, reason = "".join(p.message.content for p in parts), parts[-1].done_reason
    else:
        r = client.chat(model=ALIAS, messages=messages, format=fmt, options=options)
        text, reason = r.message.content, r.done_reason
    assert reason == "stop", text
    value = json.loads(text)
    assert isinstance(value, dict)
    if fmt != "json":
        assert value["city"] in ("Paris", "London", "Rome") and isinstance(value["days"], int)


def test_format_on_generate(client):
    r = client.generate(model=ALIAS, prompt="The weather in Rome, as JSON:", raw=True, format=WEATHER,
                        options={"temperature": 0, "num_predict": 40})
    value = json.loads(r.response)
    assert r.done_reason == "stop" and value["city"] in ("Paris", "London", "Rome") and isinstance(value["days"], int)


@pytest.mark.parametrize("kw, param", [
    ({"format": "yaml"}, "format"),
    ({"format": {"type": "string", "pattern": "(unclosed"}}, "format"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "12:00"}]}, "messages.1.role"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"function": {
        "name": "f", "arguments": "{}"}}]}]}, "messages.1.tool_calls.0.function.arguments"),
])
def test_bad_tools_and_formats_are_ollama_400s(server, kw, param):
    body = {"model": ALIAS, "messages": [{"role": "user", "content": "hi"}], "stream": False, **kw}
    r = httpx.post(server.url + "/api/chat", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"].startswith(param), r.text
