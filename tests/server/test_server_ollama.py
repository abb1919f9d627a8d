"""Ollama's API of the shared server, driven by the `ollama` package; greedy answers are checked
against the OpenAI routes' on the same prompt."""
from __future__ import annotations

import httpx
import ollama
import pytest

from server_harness import ALIAS, MODEL_NAME

pytestmark = pytest.mark.model
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "num_predict": 3}


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url, timeout=120)


def test_chat_streamed_and_not_equals_the_openai_answer(client, oai):
    r = client.chat(model=ALIAS, messages=QUESTION, options=GREEDY, stream=False)
    chat = oai.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=3, temperature=0)
    assert r.message.role == "assistant" and r.message.content == chat.choices[0].message.content
    assert r.done and r.done_reason == "length" and r.model == ALIAS
    assert r.prompt_eval_count == chat.usage.prompt_tokens and r.eval_count == 3
    assert r.total_duration >= r.prompt_eval_duration + r.eval_duration and r.load_duration == 0
    parts = list(client.chat(model=f"{ALIAS}:latest", messages=QUESTION, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == r.message.content
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].message.content == "" and parts[-1].eval_count == 3 and parts[-1].done_reason == "length"


def test_generate_raw_templated_and_context(client, oai):
    raw = client.generate(model=ALIAS, prompt="The capital of France is", raw=True, options=GREEDY)
    cmpl = oai.completions.create(model=ALIAS, prompt="The capital of France is", max_tokens=3, temperature=0)
    assert raw.response == cmpl.choices[0].text and raw.prompt_eval_count == cmpl.usage.prompt_tokens
    assert len(raw.context) == cmpl.usage.prompt_tokens + 3
    more = client.generate(model=ALIAS, prompt=" It is", raw=True, context=raw.context, options={"num_predict": 1})
    assert more.prompt_eval_count > len(raw.context) and more.context[:len(raw.context)] == raw.context
    templated = client.generate(model=ALIAS, prompt=QUESTION[0]["content"], system="Be brief.", options=GREEDY)
    chat = oai.chat.completions.create(model=ALIAS, max_tokens=3, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, *QUESTION])
    assert templated.response == chat.choices[0].message.content
    streamed = "".join(p.response for p in client.generate(model=ALIAS, prompt="The capital of France is", raw=True,
                                                           options=GREEDY, stream=True))
    assert streamed == raw.response
    assert client.generate(model=ALIAS, prompt="").done_reason == "load" == client.chat(model=ALIAS).done_reason


def test_options_map_onto_sampling(client, oai):
    opts = {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": 7, "repeat_penalty": 1.1, "num_predict": 4,
            "presence_penalty": 0.5, "frequency_penalty": 0.5, "min_p": 0.05}
    r = client.chat(model=ALIAS, messages=QUESTION, options=opts)
    chat = oai.chat.completions.create(model=ALIAS, messages=QUESTION, max_tokens=4, temperature=0.8, top_p=0.9,
                                       seed=7, presence_penalty=0.5, frequency_penalty=0.5,
                                       extra_body={"top_k": 20, "repetition_penalty": 1.1, "min_p": 0.05})
    assert r.message.content == chat.choices[0].message.content and r.eval_count == 4
    stop = client.chat(model=ALIAS, messages=QUESTION, options={"temperature": 0, "stop": ["Paris"],
                                                                "num_predict": 12})
    assert "Paris" not in stop.message.content and stop.done_reason == "stop"


def test_logprobs(client):
    r = client.chat(model=ALIAS, messages=QUESTION, options=GREEDY, logprobs=True, top_logprobs=2)
    assert len(r.logprobs) == 3
    for entry in r.logprobs:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.token == entry.top_logprobs[0].token and entry.logprob <= 0


def test_tags_show_version(client, server):
    names = [m.model for m in client.list().models]
    assert names == [MODEL_NAME, ALIAS]
    shown = client.show(ALIAS)
    assert shown.capabilities == ["completion", "tools"] and shown.modelinfo["llama.context_length"] > 0
    assert shown.template  # the chat template
    assert httpx.get(server.url + "/api/version").json()["version"]


@pytest.mark.parametrize("kw, param", [
    ({"options": {"mirostat": 1}}, "options.mirostat"),
    ({"options": {"num_ctx": 4}}, "options.num_ctx"),
    ({"options": {"temperature": -1}}, "options.temperature"),
    ({"options": {"num_predict": 100_000}}, "This model's maximum context length"),
    ({"think": True}, "think"),
])
def test_bad_requests_are_ollama_400s(client, kw, param):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=ALIAS, messages=QUESTION, **kw)
    assert e.value.status_code == 400 and e.value.error.startswith(param), e.value.error


def test_unknown_model_and_field(client, server):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="llama3.2", messages=QUESTION)
    assert e.value.status_code == 404 and "llama3.2" in e.value.error
    r = httpx.post(server.url + "/api/generate", json={"model": ALIAS, "prompt": "x", "images": ["aGk="]}, timeout=30)
    assert r.status_code == 400 and r.json() == {"error": "images: not supported by this server"}
    r = httpx.post(server.url + "/api/generate", json={"model": ALIAS, "prompt": "x", "raw": True, "system": "s"},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"].startswith("system")
