"""SGLang's `meta_info` log-prob fields, built from the scheduler's log-prob entries.

An entry (`TokenOutput.logprobs`, `TokenOutput.input_logprobs`) is [logprob, top] for one token,
top being [[token_id, logprob], ...] best first, or None. SGLang's format, which the Engine and the
native /generate both return when `return_logprob` is set:

- `input_token_logprobs`: [[logprob, token_id, text], ...] for the prompt tokens from
  `logprob_start_len` on; the first one's logprob is None (nothing before it is scored); empty
  with `logprob_start_len` -1 (the default) or equal to the prompt's length.
- `output_token_logprobs`: the same for every generated token.
- `input_top_logprobs`, `output_top_logprobs` (only with `top_logprobs_num` > 0): per token, a list
  of [logprob, token_id, text] best first; the first prompt token's is None.

`text` is the token decoded alone with `return_text_in_logprobs`, else None.
"""
from __future__ import annotations

from typing import Callable

Decode = Callable[[int], str]


def sglang_logprobs(prompt_ids: list[int], input_entries: list | None, output_ids: list[int],
                    output_entries: list, top_logprobs_num: int, decode: Decode | None) -> dict:
    """The meta_info fields. `input_entries` cover the last len(input_entries) prompt tokens;
    `output_entries` the last len(output_entries) of `output_ids`."""
    inputs = input_entries or []
    in_ids = prompt_ids[len(prompt_ids) - len(inputs):]
    out_ids = output_ids[len(output_ids) - len(output_entries):] if output_entries else []
    meta = {"input_token_logprobs": _tokens(inputs, in_ids, decode),
            "output_token_logprobs": _tokens(output_entries, out_ids, decode)}
    if top_logprobs_num > 0:
        meta["input_top_logprobs"] = [_top(e[1], decode) for e in inputs]
        meta["output_top_logprobs"] = [_top(e[1], decode) or [] for e in output_entries]
    return meta


def _tokens(entries: list, ids: list[int], decode: Decode | None) -> list[list]:
    return [[None if e[0] is None else float(e[0]), int(t), _text(int(t), decode)] for e, t in zip(entries, ids)]


def _top(top: list | None, decode: Decode | None) -> list[list] | None:
    if top is None:
        return None
    return [[float(lp), int(t), _text(int(t), decode)] for t, lp in top]


def _text(token_id: int, decode: Decode | None) -> str | None:
    return None if decode is None else decode(token_id)
