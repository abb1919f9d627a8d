"""Structured outputs over HTTP, through the shared server and the `openai` client: response_format
json_schema / json_object / text on chat and completions (streamed and not), logit_bias, native
sampling_params grammars, and bad grammars answered with a 400 naming the field while the server
keeps serving."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.model

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}
ASK = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def test_chat_json_schema_streamed_and_not(client, model):
    kw = dict(model=model, messages=ASK, max_tokens=48, temperature=0, response_format=_schema_format(PERSON))
    r = client.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True)
                       if c.choices)
    jsonschema.validate(json.loads(streamed), PERSON)


def test_json_object_text_and_logit_bias(client, model, http):
    r = client.chat.completions.create(model=model, messages=ASK, max_tokens=48, temperature=0.8, seed=1,
                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    native = http.post("/generate", json={"text": "Colors:", "sampling_params": {
        "max_new_tokens": 3, "temperature": 0, "logit_bias": {"28": 100}}}).json()
    assert native["output_ids"] == [28, 28, 28]
    t = client.completions.create(model=model, prompt="Colors:", max_tokens=3, temperature=0,
                                  logit_bias={"28": 100}, extra_body={"response_format": {"type": "text"}})
    assert t.choices[0].text == native["text"]


def test_completions_json_schema(client, model):
    r = client.completions.create(model=model, prompt="A person as JSON:", max_tokens=48, temperature=0,
                                  extra_body={"response_format": _schema_format(PERSON)})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)


def test_native_regex_and_ebnf(http):
    for text, key, grammar, check in [("A phone number:", "regex", r"[0-9]{3}-[0-9]{4}", r"[0-9]{3}-[0-9]{4}"),
                                      ("Yes or no?", "ebnf", 'root ::= ("yes" | "no") "!"', r"(yes|no)!")]:
        out = http.post("/generate", json={"text": text, "sampling_params": {key: grammar, "temperature": 0,
                                                                             "max_new_tokens": 16}}).json()
        assert re.fullmatch(check, out["text"]) and out["meta_info"]["finish_reason"]["type"] == "stop", out


def test_schema_keywords_the_grammar_would_drop_are_400s_naming_them(client, model, http):
    tags = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
            "required": ["tags"]}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=8, response_format=_schema_format(tags))
    assert e.value.body["param"] == "response_format.json_schema.schema"
    assert "'uniqueItems'" in e.value.body["message"] and "/properties/tags" in e.value.body["message"]
    r = http.post("/generate", json={"text": "x", "sampling_params": {"json_schema": json.dumps(tags)}})
    assert r.status_code == 400 and "'uniqueItems'" in r.json()["error"]["message"]
    r = http.post("/api/chat", json={"model": model, "messages": ASK, "format": tags, "stream": False})
    assert r.status_code == 400 and "'uniqueItems'" in r.text


def test_bad_grammars_are_400s_naming_the_field(client, model, http):
    cases = [({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
              "response_format.json_schema.schema"),
             ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
             ({"type": "yaml"}, "response_format.type")]
    for fmt, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model, messages=ASK, max_tokens=4, response_format=fmt)
        assert e.value.body["param"] == param, e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="x", max_tokens=1, logit_bias={"99999999": 5})
    assert e.value.body["param"] == "logit_bias"
    for key, value in [("regex", "[a-"), ("ebnf", "root ::= nothing"), ("json_schema", "{bad")]:
        r = http.post("/generate", json={"text": "x", "sampling_params": {key: value}})
        assert r.status_code == 400 and r.json()["error"]["param"] == f"sampling_params.{key}", r.text
    ok = client.chat.completions.create(model=model, messages=ASK, max_tokens=24, temperature=0,
                                        response_format=_schema_format(PERSON))
    assert re.match(r"\s*\{", ok.choices[0].message.content)
