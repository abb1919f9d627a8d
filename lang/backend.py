"""Backends: where a program's calls go. `RuntimeEndpoint(url, api_key=...)` talks to a running
`hicache serve` over its native API (httpx); `EngineBackend(engine)` calls an in-process `Engine`.

A backend does four things, all of them safe to call from several threads at once: tokenize text
(no special tokens added), render a conversation with the model's chat template as text, and
generate from token ids, whole or streamed. Results have the native shape: `{"text", "output_ids",
"meta_info"}` (`meta_info` with `prompt_tokens`, `cached_tokens`, and logprobs when asked for).
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, Iterator

import httpx

from hicache.lang.chat import RoleTemplate


class Backend:
    """The interface the interpreter uses; subclasses implement all of it but `role_template`."""

    def role_template(self) -> RoleTemplate:
        """The role framing of this backend's chat template (computed once per role sequence)."""
        if "_roles" not in self.__dict__:
            self._roles = RoleTemplate(self.render_chat)
        return self._roles

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        raise NotImplementedError

    def render_chat(self, messages: list[dict]) -> str:
        """The conversation rendered by the chat template, without a generation prompt."""
        raise NotImplementedError

    def generate(self, input_ids: list[list[int]], params: dict, logprobs: dict) -> list[dict]:
        """One result per prompt; the prompts are sent together (one batch)."""
        raise NotImplementedError

    def generate_stream(self, input_ids: list[int], params: dict, logprobs: dict) -> Iterator[dict]:
        """Cumulative results of one prompt as they grow; the last is the whole result."""
        raise NotImplementedError


class EngineBackend(Backend):
    """An in-process `Engine` (its scheduler thread batches the calls of all threads)."""

    def __init__(self, engine: Any):
        if engine.tokenizer is None:
            raise ValueError("the frontend language needs a model with a tokenizer")
        self.engine = engine
        self.tokenizer = engine.tokenizer

    def flush_cache(self) -> bool:
        return self.engine.flush_cache()

    def get_server_info(self) -> dict:
        return self.engine.get_stats()

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return [list(self.tokenizer.encode(t, add_special_tokens=False)) for t in texts]

    def render_chat(self, messages: list[dict]) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template: roles need one")
        return self.tokenizer.apply_chat_template(messages, tokenize=False)

    def generate(self, input_ids: list[list[int]], params: dict, logprobs: dict) -> list[dict]:
        return self.engine.generate(input_ids=[list(i) for i in input_ids], sampling_params=params, **logprobs)

    def generate_stream(self, input_ids: list[int], params: dict, logprobs: dict) -> Iterator[dict]:
        agen = self.engine.async_generate(input_ids=list(input_ids), sampling_params=params, **logprobs)
        loop = asyncio.new_event_loop()
        try:
            while True:
                try:
                    yield loop.run_until_complete(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            loop.run_until_complete(agen.aclose())
            loop.close()


class RuntimeEndpoint(Backend):
    """A running `hicache serve` (or any server with SGLang's native `/generate`, `/tokenize` and
    hicache's `/apply_chat_template`)."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float | None = None):
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self.client = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout, limits=limits)
        self.model_info = self._call("GET", "/get_model_info")

    def get_model_name(self) -> str:
        return self.model_info.get("model_path") or self.model_info.get("model_name", "")

    def get_server_info(self) -> dict:
        return self._call("GET", "/get_server_info")

    def flush_cache(self) -> dict:
        return self._call("POST", "/flush_cache", {})

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return self._call("POST", "/tokenize", {"prompt": texts, "add_special_tokens": False})["tokens"]

    def render_chat(self, messages: list[dict]) -> str:
        return self._call("POST", "/apply_chat_template", {"messages": messages})["text"]

    def generate(self, input_ids: list[list[int]], params: dict, logprobs: dict) -> list[dict]:
        body = {"input_ids": [list(i) for i in input_ids], "sampling_params": params, **logprobs}
        return self._call("POST", "/generate", body)

    def generate_stream(self, input_ids: list[int], params: dict, logprobs: dict) -> Iterator[dict]:
        body = {"input_ids": list(input_ids), "sampling_params": params, "stream": True, **logprobs}
        with self.client.stream("POST", "/generate", json=body) as res:
            if res.status_code != 200:
                res.read()
                raise RuntimeError(_error_of(res))
            for line in res.iter_lines():
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    raise RuntimeError(event["error"].get("message", event["error"]))
                yield event

    def close(self) -> None:
        self.client.close()

    def _call(self, method: str, path: str, body: dict | None = None) -> Any:
        res = self.client.request(method, path, json=body)
        if res.status_code != 200:
            raise RuntimeError(f"{path}: {_error_of(res)}")
        return res.json()


def _error_of(res: httpx.Response) -> str:
    try:
        return f"HTTP {res.status_code}: {res.json()['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {res.status_code}: {res.text[:500]}"


def as_backend(obj: Any) -> Backend:
    """obj as a backend: a `Backend` as it is, an `Engine` (anything with `generate` and a
    `tokenizer`) wrapped in an `EngineBackend`."""
    if isinstance(obj, Backend):
        return obj
    if hasattr(obj, "generate") and hasattr(obj, "tokenizer"):
        return EngineBackend(obj)
    raise TypeError(f"not a backend: {type(obj).__name__} (give a RuntimeEndpoint or an Engine)")
