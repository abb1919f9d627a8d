"""The direct API calls a program's steps stand for, on the same backend: the chat API for
role-framed steps, the native generate API for plain text (greedy, as the programs run)."""
from __future__ import annotations

import hicache.lang as sgl


def chat(backend: sgl.Backend, messages: list[dict], max_tokens: int) -> str:
    if isinstance(backend, sgl.RuntimeEndpoint):
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
        res = backend.client.post("/v1/chat/completions", json=body)
        res.raise_for_status()
        return res.json()["choices"][0]["message"]["content"]
    return backend.engine.chat(messages, {"max_new_tokens": max_tokens, "temperature": 0})["text"]


def complete(backend: sgl.Backend, texts: list[str], params: dict) -> list[str]:
    if isinstance(backend, sgl.RuntimeEndpoint):
        res = backend.client.post("/generate", json={"text": texts, "sampling_params": params})
        res.raise_for_status()
        return [r["text"] for r in res.json()]
    return [r["text"] for r in backend.engine.generate(texts, params)]


def chat_turns(backend: sgl.Backend, messages: list[dict], max_tokens: list[int]) -> list[str]:
    """Replay a conversation's assistant turns one call each, the history as the program made it."""
    outs = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            outs.append(chat(backend, messages[:i], max_tokens[len(outs)]))
    return outs
