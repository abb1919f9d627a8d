"""Typed messages between a front end (Engine, HTTP server) and the scheduler.

Plain dataclasses of builtins so that they cross a ZMQ socket as msgpack (never pickle):
`dataclasses.asdict(msg)` encodes, `Cls(**d)` decodes.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerateRequest:
    rid: str
    input_ids: list[int]
    sampling_params: dict  # validated by SamplingParams.from_dict in the scheduler
    return_logprob: bool = False
    top_logprobs_num: int = 0
    cache_salt: str = ""  # tenants with different salts never share cached KV


@dataclass
class AbortRequest:
    rid: str


@dataclass
class TokenOutput:
    """New tokens of one request since the previous output for it (`new_token_ids`).

    `finish_reason` is None while running, else {"type": "stop"|"length"|"abort", ...}
    with "matched" naming the stop token id or stop string. `meta` carries prompt_tokens,
    completion_tokens, cached_tokens and cached_tokens_details {device, host, storage}.
    `logprobs`: per new token [token_logprob, [[token_id, logprob], ...top-k]] when asked.
    `error` is set (and finish_reason type "abort") when the request was rejected.
    """

    rid: str
    new_token_ids: list[int]
    finish_reason: dict | None = None
    meta: dict = field(default_factory=dict)
    logprobs: list | None = None
    error: str | None = None


def expand_n(msg: GenerateRequest) -> list[GenerateRequest]:
    """Fan a request with sampling n > 1 out into n requests `{rid}-{i}`. With a seed, copy i
    uses seed + i, so the n outputs differ yet the whole set is reproducible."""
    params = dict(msg.sampling_params or {})
    n = params.pop("n", None)
    n = 1 if n is None else n
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")
    if n == 1:
        return [GenerateRequest(msg.rid, msg.input_ids, params, msg.return_logprob, msg.top_logprobs_num, msg.cache_salt)]
    out = []
    for i in range(n):
        p = dict(params)
        if isinstance(p.get("seed"), int) and not isinstance(p["seed"], bool):
            p["seed"] = p["seed"] + i
        out.append(GenerateRequest(f"{msg.rid}-{i}", msg.input_ids, p, msg.return_logprob, msg.top_logprobs_num, msg.cache_salt))
    return out
