"""When a request stops: EOS, stop token ids, stop strings, length limits."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from hicache.runtime.request import Req


class StopChecker:
    def __init__(self, tokenizer: Any | None, eos_token_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.eos = frozenset(eos_token_ids)

    def check(self, req: Req, context_length: int) -> dict | None:
        """Finish reason after req's newest output token, or None to go on."""
        p, token = req.params, req.output_ids[-1]
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos):
            return {"type": "stop", "matched": token}
        if req.grammar is not None and req.grammar.finished:
            return {"type": "stop", "matched": token}
        matched = self._stop_string(req)
        if matched is not None:
            return {"type": "stop", "matched": matched}
        if self.length_reached(req, context_length):
            return {"type": "length", "length": len(req.output_ids)}
        return None

    @staticmethod
    def length_reached(req: Req, context_length: int, pending: int = 0) -> bool:
        """Whether req is at its length limit once `pending` more tokens are appended."""
        return (len(req.output_ids) + pending >= req.params.max_new_tokens
                or req.seq_len + pending >= context_length)

    def _stop_string(self, req: Req) -> str | None:
        stops = req.params.stop
        if not stops or self.tokenizer is None:
            return None
        # a stop string of k characters spans at most k tokens (+1 for a split multi-byte char)
        tail = self.tokenizer.decode(req.output_ids[-(max(map(len, stops)) + 1):])
        return next((s for s in stops if s in tail), None)


def trim_stop(text: str, reason: dict | None, no_stop_trim: bool = False) -> str:
    """Cut the output text at the stop string that ended it (the stop string is not returned)."""
    if no_stop_trim or not reason or not isinstance(reason.get("matched"), str):
        return text
    cut = text.find(reason["matched"])
    return text if cut < 0 else text[:cut]
