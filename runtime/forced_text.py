"""The text a grammar forces next, found one byte at a time up to a bound.

XGrammar's `GrammarMatcher.find_jump_forward_string` returns the whole forced text, with no bound:
a grammar whose only string doubles at every rule (`a1 ::= a0 a0`, ..., forty times) or that never
ends (`root ::= "x" root`) forces more text than memory holds, and the call never returns. The
forced text is found here instead on a fork of the matcher, a byte per step: a byte is forced when
the next-token bitmask allows exactly one of the tokens that spell a single byte, no stop token
(the grammar may end here) and no token whose first byte has no single-byte token of its own (the
bitmask cannot say whether such a byte could come next). Up to `limit` bytes; the result holds
whole UTF-8 characters only, as XGrammar's does.

A step costs one bitmask fill in a state with a single next byte (microseconds: XGrammar's
precomputed masks decide it) and one more where the run ends.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch


class ForcedText:
    """Built once per tokenizer (`xgrammar.TokenizerInfo`); `find` runs on the scheduler thread."""

    def __init__(self, info: Any):
        vocab = info.decoded_vocab
        special = set(info.special_token_ids)
        self._words = (info.vocab_size + 31) // 32
        byte_token = np.full(256, -1, dtype=np.int64)  # the token that is exactly that byte, or -1
        for i, text in enumerate(vocab):
            if len(text) == 1 and i not in special and byte_token[text[0]] < 0:
                byte_token[text[0]] = i
        self._bytes = np.flatnonzero(byte_token >= 0)  # [n] the bytes that have a token
        self._tokens = byte_token[self._bytes]  # [n] their tokens
        # tokens whose first byte has no single-byte token, and the stop tokens: their bits
        self._blind = _bits([i for i, text in enumerate(vocab)
                             if text and i not in special and byte_token[text[0]] < 0], self._words)
        self._stops = _bits(list(info.stop_token_ids), self._words)
        self._mask = torch.zeros((1, self._words), dtype=torch.int32)

    def find(self, matcher: Any, limit: int) -> str:
        """The text `matcher`'s grammar forces from its state, at most `limit` bytes of it (whole
        characters). `matcher` is not changed."""
        if limit <= 0 or matcher.is_terminated():
            return ""
        fork = matcher.fork()
        out = bytearray()
        while len(out) < limit:
            byte = self._next_byte(fork)
            if byte is None or not fork.accept_string(bytes([byte])):
                break
            out.append(byte)
        return _whole_characters(bytes(out))

    def _next_byte(self, matcher: Any) -> int | None:
        """The one byte the grammar allows next, or None (several, none, or it may end)."""
        matcher.fill_next_token_bitmask(self._mask)
        words = self._mask.numpy()[0]
        if (words & self._stops).any() or (words & self._blind).any():
            return None
        allowed = (words[self._tokens >> 5] >> (self._tokens & 31)) & 1
        hits = np.flatnonzero(allowed)
        return int(self._bytes[hits[0]]) if len(hits) == 1 else None


def _bits(ids: list[int], words: int) -> np.ndarray:
    """[words] int32: the bitmask holding `ids`."""
    t = np.asarray([i for i in ids if i < words * 32], dtype=np.int64)
    out = np.zeros(words, dtype=np.uint32)
    np.bitwise_or.at(out, t >> 5, np.left_shift(np.uint32(1), (t & 31).astype(np.uint32)))
    return out.view(np.int32)


def _whole_characters(data: bytes) -> str:
    """The longest prefix of `data` that is whole UTF-8 characters, decoded ("" when it starts
    inside a character: the token before it split one)."""
    if data and 0x80 <= data[0] < 0xC0:
        return ""
    for cut in range(len(data), max(len(data) - 4, 0) - 1, -1):
        try:
            return data[:cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return ""
