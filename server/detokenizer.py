"""Incremental detokenization for streaming.

`IncrementalDetokenizer` turns a growing list of token ids into text deltas. Byte-level BPE
splits one UTF-8 character (emoji, CJK) over several tokens; decoding a partial character
gives U+FFFD, so a delta is released only once the decoded window no longer ends with it.
Each decode covers a small window (`prefix_offset:`) rather than the whole sequence, so the
cost per token stays flat, and the window starts one step back so that tokenizers which drop
a leading space at the start of a decode still produce it.

`StopStringBuffer` sits on top: it holds back the tail of the text that could still become a
stop string, so that a stop string is never streamed and then taken back.
"""
from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.decode_kwargs = {"skip_special_tokens": skip_special_tokens}
        if not spaces_between_special_tokens:
            self.decode_kwargs["spaces_between_special_tokens"] = False
        self.ids: list[int] = []
        self.text = ""
        self.prefix_offset = 0  # start of the decode window
        self.read_offset = 0  # ids before this are already in `text`

    def add(self, new_ids: list[int]) -> str:
        """Append ids; return the text that became final (possibly "")."""
        self.ids.extend(new_ids)
        prefix = self._decode(self.prefix_offset, self.read_offset)
        full = self._decode(self.prefix_offset, len(self.ids))
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT_CHAR):
            return ""  # mid-character (or nothing visible yet): wait for more ids
        delta = full[len(prefix):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a request: release whatever is left, even an incomplete character."""
        if self.read_offset == len(self.ids):
            return ""
        prefix = self._decode(self.prefix_offset, self.read_offset)
        full = self._decode(self.prefix_offset, len(self.ids))
        delta = full[len(prefix):]
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta

    def _decode(self, start: int, end: int) -> str:
        if start >= end or self.tokenizer is None:  # no tokenizer (dummy weights): ids only
            return ""
        return self.tokenizer.decode(self.ids[start:end], **self.decode_kwargs)


class StopStringBuffer:
    """Releases text except a tail that is a prefix of some stop string."""

    def __init__(self, stops: list[str] | tuple[str, ...] = ()) -> None:
        self.stops = [s for s in stops if s]
        self.text = ""
        self.emitted = 0

    def push(self, delta: str) -> str:
        self.text += delta
        end = min(len(self.text) - self._held_tail(), self._first_full_stop())
        return self._emit_to(max(end, self.emitted))

    def finish(self, matched_stop: str | None, trim: bool = True) -> str:
        """Release the rest; with a matched stop string, cut the text where it begins."""
        end = len(self.text)
        if matched_stop:
            idx = self.text.find(matched_stop)
            if idx >= 0:
                end = idx if trim else idx + len(matched_stop)
        return self._emit_to(max(end, self.emitted))

    def _emit_to(self, end: int) -> str:
        out = self.text[self.emitted:end]
        self.emitted = end
        return out

    def _first_full_stop(self) -> int:
        """Where the first complete stop string not yet released begins (len(text) if none)."""
        first = len(self.text)
        for stop in self.stops:
            idx = self.text.find(stop, max(0, self.emitted - len(stop) + 1))
            if 0 <= idx < first:
                first = idx
        return first

    def _held_tail(self) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self.text)), best, -1):
                if self.text.endswith(stop[:k]):
                    best = k
                    break
        return best

    @property
    def final_text(self) -> str:
        return self.text[:self.emitted]
