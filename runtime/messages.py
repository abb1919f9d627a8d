"""Typed messages between a front end (Engine, HTTP server) and the scheduler.

Dataclasses that cross a ZMQ socket as msgpack (never pickle). Those made of builtins encode as
`dataclasses.asdict(msg)` and decode as `Cls(**d)`; `GenerateRequest`, which nests a
`SamplingParams`, has its own `to_wire()` / `from_wire()`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from hicache.runtime.sampling import SamplingParams


@dataclass
class GenerateRequest:
    """One prompt to generate for. The front end that built it has checked everything the
    scheduler need not: `sampling_params` was parsed by `SamplingParams.from_dict`."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    cache_salt: str = ""  # tenants with different salts never share cached KV
    # with return_logprob: log-probs of prompt tokens [logprob_start_len, len(input_ids)); -1: none
    logprob_start_len: int = -1
    routed_dp_rank: int | None = None  # the server replica that must serve it (--dp-size); None: any
    lora_path: str | None = None  # the name of the LoRA adapter to run under (enable_lora); None: the base model
    # prefill-decode disaggregation (sglang-router's PD mode): the prefill server's bootstrap
    # address and the room that pairs this request's two halves; None: served colocated
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None

    def to_wire(self) -> dict[str, Any]:
        """The fields as msgpack builtins; `sampling_params` as `SamplingParams.to_wire()`."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["sampling_params"] = self.sampling_params.to_wire()
        return d

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> GenerateRequest:
        """Rebuild `to_wire()`'s dict; the sampling parameters are not validated again
        (`SamplingParams.from_wire`). Missing or unknown keys raise TypeError."""
        kw = dict(d)
        if "sampling_params" in kw:
            kw["sampling_params"] = SamplingParams.from_wire(kw["sampling_params"])
        return cls(**kw)


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
    `input_logprobs`: the same per prompt token from `logprob_start_len` on (the first one's
    [None, None]: nothing predicts it), once, with the request's first output after its prompt.
    `error` is set (and finish_reason type "abort") when the request was rejected or failed;
    `error_status`: its HTTP status (400: refused as asked; 502: a peer it needed failed, such as
    the prefill server of a disaggregated request).
    """

    rid: str
    new_token_ids: list[int]
    finish_reason: dict | None = None
    meta: dict = field(default_factory=dict)
    logprobs: list | None = None
    error: str | None = None
    input_logprobs: list | None = None
    error_status: int = 400


def expand_n(msg: GenerateRequest) -> list[GenerateRequest]:
    """Fan a request with sampling n > 1 out into n requests `{rid}-{i}` of n = 1. With a seed,
    copy i uses seed + i, so the n outputs differ yet the whole set is reproducible."""
    p = msg.sampling_params
    if p.n == 1:
        return [msg]
    return [replace(msg, rid=f"{msg.rid}-{i}", sampling_params=_sample_i(p, i)) for i in range(p.n)]


def _sample_i(p: SamplingParams, i: int) -> SamplingParams:
    return replace(p, n=1, seed=None if p.seed is None else p.seed + i)
