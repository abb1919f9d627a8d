"""Jump-forward decoding: where a request's grammar forces a run of text, its tokens are appended to
the request at once, without a model step each; the next step computes them as one extend chunk.

`jump(req, ...)` runs on the scheduler thread right after a token of `req` is appended (or, with
no token yet, when it is admitted). It asks for the text the grammar forces from its matcher's
state (`runtime/forced_text.py: ForcedText`, bounded by what the request may still append:
`BYTES_PER_TOKEN` bytes for each of at most `MAX_JUMP_TOKENS` tokens), tokenizes it, lets the matcher accept the tokens
and appends them to the request's outputs, one by one through the stop checks, so that a stop
string or the length limit cuts the run where it is met (never past `max_new_tokens`).

Tokenization keeps the tokens the model would write:

- The left edge: the forced text is encoded together with the text of the request's last
  `JOIN_TOKENS` tokens, and the tokens past those are taken, so that the forced run starts as the
  whole text's tokenization would. Tokens already appended are never rewritten (the sampled one
  may already be on the device as the next step's input); when that encoding does not begin with
  them (the tokenizer would merge them with the forced text), the forced text is encoded alone:
  the model, whose token is fixed, could not have merged them either.
- The right edge: the run's last token is held back, for the model to sample under the grammar's
  mask: the forced text's last token may be the start of a longer token whose rest is not forced
  (`"` before `":` in JSON), and the model picks it.

A token the matcher refuses (a tokenizer that normalizes text) ends the run before it. A forced
run longer than one jump's bound goes on at the next jump, after the model's next token: each jump
costs time and memory in proportion to the tokens it may append, whatever the grammar forces.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hicache.runtime.forced_text import ForcedText

if TYPE_CHECKING:
    from hicache.runtime.request import Req
    from hicache.runtime.stop import StopChecker

JOIN_TOKENS = 2  # the request's last tokens encoded with the forced text (its left edge)
MAX_JUMP_TOKENS = 32  # tokens one jump appends at most
BYTES_PER_TOKEN = 8  # forced bytes looked for per token a jump may append


class JumpForward:
    """The scheduler's jump-forward: `jump` for requests with a grammar, unless it is disabled or
    the request returns log-probs (each of its tokens keeps the log-prob of a model step); counts
    the tokens appended (`generation_tokens`, `jump_forward_tokens`)."""

    def __init__(self, enabled: bool, tokenizer: Any, stops: StopChecker, context_length: int, counters: dict):
        self.enabled = enabled and tokenizer is not None
        self._args = (tokenizer, stops, context_length)
        self._counters = counters
        self._finder: ForcedText | None = None  # built from the first grammar's tokenizer

    def __call__(self, req: Req) -> tuple[list[int], dict | None]:
        if not self.enabled or req.grammar is None or req.return_logprob:
            return [], None
        if self._finder is None:
            self._finder = ForcedText(req.grammar.tokenizer_info)
        forced, reason = jump(req, self._finder, *self._args)
        self._counters["generation_tokens"] += len(forced)
        self._counters["jump_forward_tokens"] += len(forced)
        return forced, reason


def jump(req: Req, finder: ForcedText, tokenizer: Any, stops: StopChecker, context_length: int
         ) -> tuple[list[int], dict | None]:
    """Appends the tokens `req`'s grammar forces next (accepted by its matcher) to its outputs,
    at most `MAX_JUMP_TOKENS` and never past max_new_tokens or the context. Returns them and the
    finish reason the last of them met (None: the request goes on)."""
    room = min(req.params.max_new_tokens - len(req.output_ids), context_length - req.seq_len, MAX_JUMP_TOKENS)
    grammar = req.grammar
    if room <= 0 or grammar.finished:
        return [], None
    text = finder.find(grammar.matcher, BYTES_PER_TOKEN * (room + 1))
    if not text:
        return [], None
    forced: list[int] = []
    tail = (req.input_ids[-JOIN_TOKENS:] + req.output_ids[-JOIN_TOKENS:])[-JOIN_TOKENS:]
    for token in forced_tokens(tokenizer, tail, text)[:-1][:room]:
        if not grammar.try_accept(token):
            break
        req.output_ids.append(token)
        forced.append(token)
        reason = stops.check(req, context_length)
        if reason is not None:
            return forced, reason
    return forced, None


def forced_tokens(tokenizer: Any, tail: list[int], text: str) -> list[int]:
    """`text`'s tokens where it follows the tokens `tail`: those of tail's text + `text` past
    `tail` when that encoding begins with `tail`, else those of `text` alone."""
    head = tokenizer.decode(tail) if tail else ""
    if head and "\ufffd" not in head:  # (a tail that ends inside a character decodes to U+FFFD)
        ids = tokenizer.encode(head + text, add_special_tokens=False)
        if ids[:len(tail)] == tail:
            return ids[len(tail):]
    return tokenizer.encode(text, add_special_tokens=False)
