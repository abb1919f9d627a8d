"""Without a model: model names (aliases, the model path), the API key in either header, and each
API family's error shape, from the routes and from the middlewares, on the real app."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient

from hicache.server.anthropic_api import stop_reason
from hicache.server.app import create_app
from hicache.server.cli import build_parser
from hicache.server.config import ServerConfig
from hicache.server.flags import config_from_args

PATH = "/models/smol.gguf"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
MESSAGES = {"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
OLLAMA = {"messages": [{"role": "user", "content": "hi"}]}


def _refuse(_messages, _tools=None):
    raise ValueError("no template here")


def client(**config) -> TestClient:
    tm = SimpleNamespace(info=SimpleNamespace(model_name="own", context_length=16, vocab_size=100),
                         runtime_config=SimpleNamespace(model_path=PATH), tokenizer=None, loras={},
                         apply_chat_template=_refuse)
    return TestClient(create_app(tm, ServerConfig(**config)), base_url="http://localhost")


def test_served_model_name_takes_several_names():
    args = build_parser().parse_args(["serve", "--served-model-name", "a", "b"])
    assert config_from_args(ServerConfig, args).served_model_name == ("a", "b")
    assert ServerConfig(served_model_name="a").served_model_name == ("a",)
    with pytest.raises(ValueError, match="served_model_name"):
        ServerConfig(served_model_name=("a", ""))


@pytest.mark.parametrize("served, names", [((), ["own"]), (("a", "b"), ["a", "b"])])
def test_aliases_and_the_model_path_are_accepted(served, names):
    with client(served_model_name=served) as c:
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == names
        assert [m["name"] for m in c.get("/api/tags").json()["models"]] == names
        for name in (*names, PATH):  # accepted: the request goes on to the (refusing) chat template
            assert c.post("/v1/chat/completions", json={**CHAT, "model": name}).json()["error"]["param"] == "messages"
            assert c.post("/v1/messages", json={**MESSAGES, "model": name}).status_code == 400
            assert c.post("/api/chat", json={**OLLAMA, "model": f"{name}:latest"}).status_code == 400
        unknown = c.post("/v1/chat/completions", json={**CHAT, "model": "other"})
        assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"


def test_each_family_has_its_error_shape():
    with client() as c:
        openai = c.post("/v1/chat/completions", json={**CHAT, "model": "other"}).json()
        assert openai["error"]["code"] == "model_not_found"
        anthropic = c.post("/v1/messages", json={**MESSAGES, "model": "other"}).json()
        assert anthropic["type"] == "error" and anthropic["error"]["type"] == "not_found_error"
        ollama = c.post("/api/chat", json={**OLLAMA, "model": "other"}).json()
        assert list(ollama) == ["error"] and "other" in ollama["error"]
        assert c.get("/v1/messages").json()["error"]["type"] == "invalid_request_error"  # 405
        assert c.post("/api/show", json={"model": "own", "extra": 1}).json() == {
            "error": "extra: this field is not supported by this server"}


def test_the_key_in_either_header_and_middleware_errors_in_the_family_shape():
    with client(api_key="k", max_request_bytes=1024) as c:
        assert c.get("/v1/models", headers={"x-api-key": "k"}).status_code == 200
        assert c.get("/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
        for headers in ({}, {"x-api-key": "bad"}, {"Authorization": "k"}, {"x-api-key": "Bearer k"}):
            r = c.post("/v1/messages", json=MESSAGES, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", headers
        assert c.get("/api/tags").json()["error"].startswith("Invalid or missing API key")
        assert c.get("/v1/models").json()["error"]["code"] == "invalid_api_key"
        big = c.post("/v1/messages", content=b"x" * 2048, headers={"x-api-key": "k", "content-type": "application/json"})
        assert big.status_code == 413 and big.json()["error"]["type"] == "request_too_large"


def test_anthropic_stop_reasons():
    assert stop_reason({"type": "length"}) == ("max_tokens", None)
    assert stop_reason({"type": "stop", "matched": 2}) == ("end_turn", None)  # a stop token: EOS
    assert stop_reason({"type": "stop", "matched": "\n\n"}) == ("stop_sequence", "\n\n")
    assert stop_reason(None) == (None, None)
