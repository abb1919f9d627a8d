"""Logit constraints applied before the sampler's penalties and filters: OpenAI's `logit_bias` and
the grammar's allowed-token bitmask (`runtime/grammar.py: fill_bitmask`).

Both act on a copy of the logits, outside any CUDA graph: the bias is added to the listed tokens,
then every token the bitmask does not allow gets -inf, so that penalties, temperature, top-k,
top-p and min-p still apply, among the allowed tokens only.
"""
from __future__ import annotations

from typing import Sequence

import torch

from hicache.runtime.pinned import tensor_to, to_device
from hicache.runtime.sampling import SamplingParams

_BITS = torch.arange(32, dtype=torch.int32)


def constrain(raw: torch.Tensor,  # [B, V] float32
              params: Sequence[SamplingParams],
              bitmask: torch.Tensor | None = None,  # [B, ceil(V / 32)] int32, host or device
              ) -> torch.Tensor:
    """Logits with each row's bias added and its disallowed tokens at -inf: a copy when any row
    has either, else `raw` itself."""
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    if not biased and bitmask is None:
        return raw
    scores = raw.clone()
    if biased:
        vocab = raw.shape[1]
        flat = [i * vocab + t for i in biased for t, _ in params[i].logit_bias]
        bias = [b for i in biased for _, b in params[i].logit_bias]
        scores.view(-1).index_add_(0, tensor_to(flat, raw.device), tensor_to(bias, raw.device, raw.dtype))
    if bitmask is not None:
        scores.masked_fill_(~allowed_tokens(to_device(bitmask, raw.device), raw.shape[1]), float("-inf"))
    return scores


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] bool from a [B, W] int32 bitmask (bit j of word w: token 32 w + j allowed)."""
    bits = _BITS.to(bitmask.device)
    unpacked = (bitmask[:, :, None] >> bits) & 1  # arithmetic shift: & 1 keeps the one bit
    return unpacked.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()
