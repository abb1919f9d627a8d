"""Attention backends: store the new tokens' K/V in the L1 pool and attend over the paged KV.

Selected by name (`attention_backend`); "torch" is the reference path used on CPU.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from hicache.kernels.attention import decode_attention, extend_attention, store_kv

if TYPE_CHECKING:
    from hicache.runtime.batch import ForwardBatch


class TorchAttention:
    """Reference backend: torch SDPA over K/V gathered from the pool."""

    def __init__(self, head_dim: int):
        self.scale = head_dim ** -0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] for the batch's new tokens; returns [T, Hq, D]."""
        k_buf, v_buf = batch.pool.k_buffer(layer_id), batch.pool.v_buffer(layer_id)
        store_kv(k_buf, v_buf, batch.out_cache_loc, k, v)
        if batch.mode == "decode":
            return decode_attention(q, k_buf, v_buf, batch.slot_table, batch.seq_lens, self.scale)
        return extend_attention(q, k_buf, v_buf, batch.token_slots, batch.extend_lens, self.scale)


ATTENTION_BACKENDS: dict[str, Callable[[int], TorchAttention]] = {"torch": TorchAttention}


def make_attention_backend(name: str, head_dim: int) -> TorchAttention:
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {sorted(ATTENTION_BACKENDS)}, got {name!r}")
    return ATTENTION_BACKENDS[name](head_dim)
