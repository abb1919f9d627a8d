"""Logit constraints applied before the sampler's penalties and filters: OpenAI's `logit_bias` and
the grammar's allowed-token bitmask (`runtime/bitmask.py: fill_bitmask`).

Both act on a copy of the logits, outside any CUDA graph: the bias is added to the listed tokens,
then every token the bitmask does not allow gets -inf, so that penalties, temperature, top-k,
top-p and min-p still apply, among the allowed tokens only.
"""
from __future__ import annotations

from typing import Sequence

import torch

from hicache.runtime.pinned import tensor_to, to_device
from hicache.runtime.sampling import SamplingParams

# bit j of byte b, for every byte value: lookup tables that unpack a bitmask byte by byte
_BYTE_BITS = (torch.arange(256)[:, None] >> torch.arange(8)) & 1 == 1  # [256, 8] bool
_tables: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def constrain(raw: torch.Tensor,  # [B, V] float32
              params: Sequence[SamplingParams],
              bitmask: torch.Tensor | None = None,  # [B, ceil(V / 32)] int32, host or device
              ) -> torch.Tensor:
    """Logits with each row's bias added and its disallowed tokens at -inf: a copy when any row
    has either, else `raw` itself."""
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    if not biased and bitmask is None:
        return raw
    scores = raw
    if biased:
        vocab = raw.shape[1]
        flat = [i * vocab + t for i in biased for t, _ in params[i].logit_bias]
        bias = [b for i in biased for _, b in params[i].logit_bias]
        scores = raw.clone()
        scores.view(-1).index_add_(0, tensor_to(flat, raw.device), tensor_to(bias, raw.device, raw.dtype))
    if bitmask is not None:  # adding 0 or -inf: one cheap pass, where a select costs several
        scores = scores + _unpack(to_device(bitmask, raw.device), raw.shape[1], _table(raw.device, raw.dtype))
    return scores


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] bool from a [B, W] int32 bitmask (bit j of word w: token 32 w + j allowed)."""
    return _unpack(bitmask, vocab_size, _table(bitmask.device, torch.bool))


def _table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 8]: bit j of byte value b, as bool, or as 0 (set) / -inf (clear) of a float dtype."""
    key = (device, dtype)
    if key not in _tables:
        bits = _BYTE_BITS if dtype == torch.bool else torch.where(_BYTE_BITS, 0.0, float("-inf")).to(dtype)
        _tables[key] = bits.to(device)
    return _tables[key]


def _unpack(bitmask: torch.Tensor, vocab_size: int, table: torch.Tensor) -> torch.Tensor:
    """table's entry for each token's bit: [B, V]. The words are little-endian, so byte k of word w
    holds tokens 32 w + 8 k .. 32 w + 8 k + 7."""
    as_bytes = bitmask.contiguous().view(torch.uint8).long()  # [B, 4 W]
    return table[as_bytes].reshape(bitmask.shape[0], -1)[:, :vocab_size]
