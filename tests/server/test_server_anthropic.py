"""Anthropic's Messages API of the shared server, driven by the `anthropic` package; greedy answers
are checked against the OpenAI chat route's on the same conversation."""
from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from server_harness import ALIAS, MODEL_NAME

pytestmark = pytest.mark.model
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}  # the SDK takes sampling options as extra_body
LONG_SYSTEM = "You are a helpful assistant who answers travel questions. " * 12


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120, max_retries=0)


def test_message_equals_the_openai_chat_answer(client, oai):
    m = client.messages.create(model=ALIAS, max_tokens=4, system=LONG_SYSTEM, messages=QUESTION, extra_body=GREEDY)
    chat = oai.chat.completions.create(model=MODEL_NAME, max_tokens=4, temperature=0,
                                       messages=[{"role": "system", "content": LONG_SYSTEM}, *QUESTION])
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL_NAME
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == chat.choices[0].message.content
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert m.usage.output_tokens == chat.usage.completion_tokens == 4
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    # the second time the same prompt is read from the cache (all but its last, partial page)
    assert chat.usage.prompt_tokens_details.cached_tokens >= chat.usage.prompt_tokens - 16
    again = client.messages.create(model=ALIAS, max_tokens=1, system=LONG_SYSTEM, messages=QUESTION, extra_body=GREEDY)
    assert again.usage.cache_read_input_tokens >= chat.usage.prompt_tokens - 16
    assert client.messages.count_tokens(model=ALIAS, system=LONG_SYSTEM, messages=QUESTION).input_tokens == \
        chat.usage.prompt_tokens


def test_stream_events_and_text(client, server):
    m = client.messages.create(model=ALIAS, max_tokens=4, messages=QUESTION, extra_body=GREEDY)
    with client.messages.stream(model=ALIAS, max_tokens=4, messages=QUESTION, extra_body=GREEDY) as stream:
        text = stream.get_final_text()
        final = stream.get_final_message()
    assert text == m.content[0].text and final.stop_reason == m.stop_reason
    assert final.usage.output_tokens == m.usage.output_tokens
    body = {"model": ALIAS, "max_tokens": 3, "messages": QUESTION, "stream": True, **GREEDY}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=120) as r:
        events = [line.split(": ", 1)[1] for line in r.iter_lines() if line.startswith("event: ")]
        assert r.headers["content-type"].startswith("text/event-stream")
    assert events[:3] == ["message_start", "content_block_start", "ping"]
    assert set(events[3:-3]) == {"content_block_delta"}
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_stop_sequence(client):
    base = client.messages.create(model=ALIAS, max_tokens=8, messages=QUESTION, extra_body=GREEDY).content[0].text
    words = [w for w in base.split() if len(w) >= 3]
    assert words, f"greedy output too short to pick a stop sequence: {base!r}"
    stop = words[len(words) // 2]
    m = client.messages.create(model=ALIAS, max_tokens=8, messages=QUESTION, stop_sequences=[stop], extra_body=GREEDY)
    assert m.content[0].text == base[: base.find(stop)]
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop


def test_text_blocks_and_an_assistant_prefill(client):
    blocks = [{"role": "user", "content": [{"type": "text", "text": "What is the capital "},
                                           {"type": "text", "text": "of France?", "cache_control": {"type": "ephemeral"}}]}]
    assert client.messages.count_tokens(model=ALIAS, messages=blocks).input_tokens == \
        client.messages.count_tokens(model=ALIAS, messages=QUESTION).input_tokens
    prefill = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
    assert client.messages.count_tokens(model=ALIAS, messages=prefill).input_tokens > \
        client.messages.count_tokens(model=ALIAS, messages=QUESTION).input_tokens
    m = client.messages.create(model=ALIAS, max_tokens=3, messages=prefill, extra_body=GREEDY)
    assert "Paris" in m.content[0].text


@pytest.mark.parametrize("kw, param", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}]},
     "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "citations": []}]}]},
     "messages.0.content.0.citations"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"extra_body": {"temperature": -1}}, "temperature"),
    ({"extra_body": {"top_k": 0}}, "top_k"),
    ({"extra_body": {"frequency_penalty": 1}}, "frequency_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_bad_requests_are_anthropic_400s(client, kw, param):
    args = {"model": ALIAS, "max_tokens": 1, "messages": QUESTION, **kw}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(**args)
    error = e.value.body
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith(param), error


def test_unknown_model_missing_field_and_bad_json(client, server):
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-none", max_tokens=1, messages=QUESTION)
    assert e.value.body["error"]["type"] == "not_found_error"
    for body in ({"model": ALIAS, "messages": QUESTION}, b"{not json"):
        r = httpx.post(server.url + "/v1/messages", timeout=30, headers={"content-type": "application/json"},
                       content=body if isinstance(body, bytes) else json.dumps(body))
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert "max_tokens" in httpx.post(server.url + "/v1/messages", json={"model": ALIAS, "messages": QUESTION},
                                      timeout=30).json()["error"]["message"]
