"""The "cpu" attention backend: the compiled CPU kernel that reads the paged pool in place
(`hicache.kernels.cpu.paged_attention`), for decode and extend, requests of any lengths in one
ragged batch; in a decode batch, the keys that requests share (the same slots: a prompt the radix
cache shares) read once for all of them (`cpu.shared_keys`). A pass with a chunk of `LONG_CHUNK`
new tokens or more attends through torch's SDPA over the gathered keys instead (the reference
`extend_attention`), several times faster than the kernel on many query rows
(benchmarks/cpu_attention.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hicache.kernels import cpu
from hicache.kernels.attention import extend_attention, store_kv

if TYPE_CHECKING:
    from hicache.runtime.batch import ForwardBatch

LONG_CHUNK = 16


class CpuAttention:
    """Stores the new tokens' K/V and attends over each request's slots in the request-to-token
    table (`batch.req_to_token`, `req_rows`, `prefix_lens`, `extend_lens_dev`, `q_starts`)."""

    graphs = False  # CPU: no CUDA graphs

    def __init__(self, head_dim: int, scale: float | None = None, windows: tuple = ()):
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.windows = windows  # per layer: sliding window or None; () for none
        self._batch: ForwardBatch | None = None  # the pass `_shared` was found for
        self._shared: cpu.SharedKeys | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        batch.wait_layer(layer_id)  # this layer's load-back from L2 (other slots than the new tokens')
        window = self.windows[layer_id] if self.windows else None
        if self._batch is not batch:
            self._batch = batch
            self._shared = cpu.shared_keys(batch.req_to_token, batch.req_rows, batch.prefix_lens) \
                if batch.mode == "decode" and len(batch.extend_lens) > 1 else None
        shared = None if window else self._shared
        batch = batch.for_layer(layer_id)
        k_buf, v_buf = batch.pool.k_buffer(layer_id), batch.pool.v_buffer(layer_id)
        if batch.mode != "decode" and batch.max_extend >= LONG_CHUNK:
            store_kv(k_buf, v_buf, batch.out_cache_loc, k, v)
            return extend_attention(q, k_buf, v_buf, batch.token_slots, batch.extend_lens, self.scale, window)
        return cpu.paged_attention(q, k, v, k_buf, v_buf, batch.out_cache_loc, batch.req_to_token, batch.req_rows,
                                   batch.prefix_lens, batch.extend_lens_dev, batch.q_starts, self.scale, window, shared)
