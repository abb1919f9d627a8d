"""Attention backends: store the new tokens' K/V in the L1 pool and attend over the paged KV.

Selected by name (`attention_backend`): "torch" is the reference path (any device, used on CPU);
"triton" runs the Triton kernels of `hicache.kernels` (CUDA). "auto" picks triton on CUDA and
torch on CPU (`resolve_attention_backend`).
"""
from __future__ import annotations

import importlib.util
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
        batch.wait_layer(layer_id)  # this layer's load-back from L2, if one is in flight
        if batch.mode == "decode":
            return decode_attention(q, k_buf, v_buf, batch.slot_table, batch.seq_lens, self.scale)
        return extend_attention(q, k_buf, v_buf, batch.token_slots, batch.extend_lens, self.scale)


class TritonAttention:
    """CUDA backend: Triton KV store, extend (prefill with a cached prefix) and split-K decode,
    all reading the KV through the request-to-token table. No host sync inside a forward pass."""

    def __init__(self, head_dim: int):
        if not torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
            raise ValueError("attention_backend 'triton' needs a CUDA device and the triton package")
        from hicache.kernels import decode, extend, store  # needs triton: imported only here

        self._decode, self._extend, self._store = decode, extend, store
        self.scale = head_dim ** -0.5
        self._num_sms: int | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        k_buf, v_buf = batch.pool.k_buffer(layer_id), batch.pool.v_buffer(layer_id)
        self._store.store_kv(k_buf, v_buf, batch.out_cache_loc, k, v)
        batch.wait_layer(layer_id)  # this layer's load-back from L2, if one is in flight (no host sync)
        if batch.mode == "decode":
            return self._decode.decode_attention(q, k_buf, v_buf, batch.req_to_token, batch.req_rows,
                                                 batch.seq_lens, self.scale, self.num_splits(batch, k_buf))
        return self._extend.extend_attention(q, k_buf, v_buf, batch.req_to_token, batch.req_rows, batch.prefix_lens,
                                             batch.extend_lens_dev, batch.q_starts, batch.max_extend, self.scale)

    def num_splits(self, batch: ForwardBatch, k_buf: torch.Tensor) -> int:
        if batch.num_splits is not None:  # fixed when captured in a CUDA graph
            return batch.num_splits
        return self.splits_for(len(batch.extend_lens), k_buf.shape[1], batch.max_seq_len, k_buf.device)

    def splits_for(self, batch_size: int, num_kv_heads: int, max_len: int, device: torch.device) -> int:
        if self._num_sms is None:
            self._num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        return self._decode.default_num_splits(batch_size, num_kv_heads, max_len, self._num_sms)


class AutoAttention:
    """"auto": on the first forward pass, becomes triton when the KV pool is on CUDA and triton
    is importable, torch otherwise (the model's device is only known once it runs)."""

    def __init__(self, head_dim: int):
        self.head_dim = head_dim
        self.impl: TorchAttention | TritonAttention | None = None

    def resolve(self, device: torch.device) -> TorchAttention | TritonAttention:
        if self.impl is None:
            self.impl = ATTENTION_BACKENDS[resolve_attention_backend("auto", device)](self.head_dim)
        return self.impl

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        return self.resolve(q.device).forward(q, k, v, layer_id, batch)


ATTENTION_BACKENDS: dict[str, Callable[[int], object]] = {
    "auto": AutoAttention, "torch": TorchAttention, "triton": TritonAttention}


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """"auto" -> triton on CUDA when triton is importable, else torch; other names unchanged."""
    if name != "auto":
        return name
    return "triton" if device.type == "cuda" and importlib.util.find_spec("triton") else "torch"


def make_attention_backend(name: str, head_dim: int):
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {name!r}")
    return ATTENTION_BACKENDS[name](head_dim)
