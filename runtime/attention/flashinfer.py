"""The "flashinfer" attention backend (CUDA, fp16/bf16). Importing this module imports triton (the
KV store); flashinfer itself is imported when the first wrapper is made. The registry
(`hicache.runtime.attention`) imports this module only when the backend is asked for, on CUDA."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hicache.kernels import flashinfer, store

if TYPE_CHECKING:
    from hicache.runtime.batch import ForwardBatch
    from hicache.tiers.gpu.pool import DeviceKVPool
    from hicache.tiers.gpu.req_table import ReqToTokenTable


class FlashInferAttention:
    """FlashInfer's paged prefill and decode kernels (`kernels/flashinfer.py`) with the Triton KV
    store. A forward pass is planned when its first layer attends: one wrapper per distinct
    sliding window of the model's layers (None: full attention), each over the keys its layers
    read, its slots translated to the windowed layers' own where the pool keeps them apart. A
    decode graph has wrappers of its own (its graph state), planned before each replay."""

    graphs = True

    def __init__(self, head_dim: int, scale: float | None = None, windows: tuple = ()):
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.windows = windows  # per layer: sliding window or None; () for none
        self._kinds = tuple(dict.fromkeys(windows)) or (None,)  # distinct windows, one wrapper each
        self._workspace: torch.Tensor | None = None
        self._graph_buffers: dict = {}  # window -> index buffers of the graph wrappers
        self._kernels: dict | None = None  # window -> the wrapper of passes outside graphs
        self._batch: ForwardBatch | None = None  # the pass it was last planned for
        self._pool: DeviceKVPool | None = None  # the graphs' pool

    def _make(self, num_heads: int, k_buf: torch.Tensor, graph_batch: int | None = None, window=None):
        if self._workspace is None:
            self._workspace = torch.zeros(flashinfer.WORKSPACE_BYTES, dtype=torch.uint8, device=k_buf.device)
        return flashinfer.PagedAttention(num_heads, k_buf.shape[1], self.head_dim, k_buf.dtype, self._workspace,
                                         graph_batch, self._graph_buffers.get(window))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        k_buf, v_buf = batch.pool.k_buffer(layer_id), batch.pool.v_buffer(layer_id)
        store.store_kv(k_buf, v_buf, batch.for_layer(layer_id).out_cache_loc, k, v)
        kernels = batch.graph_state
        if kernels is None:
            if self._batch is not batch:
                self._plan(q.shape[1], k_buf, batch)
            kernels = self._kernels
        batch.wait_layer(layer_id)  # this layer's load-back from L2, if one is in flight (no host sync)
        return kernels[self.windows[layer_id] if self.windows else None].run(q, k_buf, v_buf)

    def _plan(self, num_heads: int, k_buf: torch.Tensor, batch: ForwardBatch) -> None:
        if self._kernels is None:
            self._kernels = {w: self._make(num_heads, k_buf) for w in self._kinds}
        ends = batch.prefix_lens + batch.extend_lens_dev
        for window, kernels in self._kernels.items():
            lens = flashinfer.visible(window, batch.kv_lens, batch.extend_lens)
            starts = None if window is None else ends - torch.minimum(ends, batch.extend_lens_dev + window - 1)
            indices = _own_slots(batch.pool, window, flashinfer.kv_indices(batch.req_to_token, batch.req_rows, ends,
                                                                            sum(lens), starts))
            if batch.mode == "decode":
                kernels.plan_decode(indices, lens, self.scale, window)
            else:
                kernels.plan_extend(indices, batch.extend_lens, lens, self.scale, window)
        self._batch = batch

    def capture_state(self, bs: int, max_batch: int, num_heads: int, pool: DeviceKVPool,
                      req_table: ReqToTokenTable) -> dict:
        """A decode graph of bs rows: a wrapper per window over index buffers shared by all graphs
        (batches up to max_batch, each request up to the table's width), planned here for rows
        of one token."""
        k_buf = pool.k_buffer(0)
        self._pool = pool
        state = {}
        for window in self._kinds:
            if window not in self._graph_buffers:
                self._graph_buffers[window] = flashinfer.PagedAttention.graph_buffers(
                    max_batch, max_batch * req_table.max_context, k_buf.device)
            state[window] = self._make(num_heads, k_buf, bs, window)
            state[window].plan_decode(torch.zeros(bs, dtype=torch.int32, device=k_buf.device), [1] * bs,
                                      self.scale, window)
        return state

    def before_replay(self, state: dict, rows: torch.Tensor, seq_lens: torch.Tensor,
                      lens: list[int], req_table: ReqToTokenTable) -> None:
        """Plans the graph's wrappers for these rows of these lengths."""
        for window, kernels in state.items():
            seen = flashinfer.visible(window, lens, [1] * len(lens))
            starts = None if window is None else seq_lens - seq_lens.clamp(max=window)
            indices = _own_slots(self._pool, window, flashinfer.kv_indices(req_table.table, rows, seq_lens,
                                                                           sum(seen), starts))
            kernels.plan_decode(indices, seen, self.scale, window)


def _own_slots(pool: DeviceKVPool, window: int | None, indices: torch.Tensor) -> torch.Tensor:
    """`indices` (global slots) as the slots of layers of `window`: their window slots where the
    pool keeps windowed layers apart (every slot of a visible tail holds its window part)."""
    if window is None or not pool.window_layers:
        return indices
    return pool.allocator.device_map[indices.long()].to(torch.int32)
