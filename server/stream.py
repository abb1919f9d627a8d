"""One request's output stream in the HTTP process: the scheduler's `TokenOutput`s merged into
`Chunk`s, detokenized incrementally, with stop strings held back and trimmed."""
from __future__ import annotations

from dataclasses import dataclass

from hicache.runtime.messages import TokenOutput
from hicache.runtime.sampling import SamplingParams
from hicache.server.detokenizer import IncrementalDetokenizer, StopStringBuffer


@dataclass
class Chunk:
    """What one request produced since its previous chunk (several TokenOutputs merged)."""

    text_delta: str
    text: str  # cumulative text released so far
    new_ids: list[int]
    output_ids: list[int]  # cumulative
    meta: dict
    finish_reason: dict | None = None
    logprobs: list | None = None  # per new id: [logprob, [[id, logprob], ...]]
    error: str | None = None
    input_logprobs: list | None = None  # the prompt's (TokenOutput.input_logprobs), in one chunk
    error_status: int = 400  # 400: rejected by the scheduler; 503: scheduler died



DEAD = "\x00scheduler-dead:"  # prefixes the reason in outputs injected by _mark_dead (-> 503)


class RequestStream:
    """Per-request detokenizer + stop-string buffer + cumulative state."""

    def __init__(self, tokenizer, params: SamplingParams) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens,
                                            spaces_between_special_tokens=params.spaces_between_special_tokens)
        self.stops = StopStringBuffer(params.stop)
        self.trim = not params.no_stop_trim
        self.output_ids: list[int] = []
        self.meta: dict = {}

    def merge(self, outs: list[TokenOutput]) -> Chunk:
        new_ids: list[int] = []
        logprobs: list | None = None
        finish, error, prompt, status = None, None, None, 400
        for o in outs:
            new_ids.extend(o.new_token_ids)
            if o.logprobs:
                logprobs = (logprobs or []) + list(o.logprobs)
            self.meta.update(o.meta or {})
            finish = o.finish_reason or finish
            error, status = (o.error, o.error_status) if o.error else (error, status)
            prompt = o.input_logprobs or prompt
        self.output_ids.extend(new_ids)
        delta = self.stops.push(self.detok.add(new_ids)) if new_ids else ""
        if finish is not None:
            delta += self._finish(finish)
        if error is not None and error.startswith(DEAD):
            error, status = error[len(DEAD):] or "scheduler process died", 503
        return Chunk(text_delta=delta, text=self.stops.final_text, new_ids=new_ids,
                     output_ids=list(self.output_ids), meta=dict(self.meta), finish_reason=finish,
                     logprobs=logprobs, error=error, error_status=status, input_logprobs=prompt)

    def _finish(self, finish: dict) -> str:
        tail = self.stops.push(self.detok.flush())
        matched = finish.get("matched")
        return tail + self.stops.finish(matched if isinstance(matched, str) else None, self.trim)
