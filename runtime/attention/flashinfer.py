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
    store. A forward pass is planned when its first layer attends; a decode graph has a wrapper of
    its own (its graph state), planned before each replay."""

    graphs = True

    def __init__(self, head_dim: int, scale: float | None = None):
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self._workspace: torch.Tensor | None = None
        self._graph_buffers = None
        self._kernels = None  # the wrapper of passes outside graphs
        self._batch: ForwardBatch | None = None  # the pass it was last planned for

    def _make(self, num_heads: int, k_buf: torch.Tensor, graph_batch: int | None = None):
        if self._workspace is None:
            self._workspace = torch.zeros(flashinfer.WORKSPACE_BYTES, dtype=torch.uint8, device=k_buf.device)
        return flashinfer.PagedAttention(num_heads, k_buf.shape[1], self.head_dim, k_buf.dtype, self._workspace,
                                         graph_batch, self._graph_buffers)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        k_buf, v_buf = batch.pool.k_buffer(layer_id), batch.pool.v_buffer(layer_id)
        store.store_kv(k_buf, v_buf, batch.out_cache_loc, k, v)
        kernels = batch.graph_state
        if kernels is None:
            if self._batch is not batch:
                self._plan(q.shape[1], k_buf, batch)
            kernels = self._kernels
        batch.wait_layer(layer_id)  # this layer's load-back from L2, if one is in flight (no host sync)
        return kernels.run(q, k_buf, v_buf)

    def _plan(self, num_heads: int, k_buf: torch.Tensor, batch: ForwardBatch) -> None:
        if self._kernels is None:
            self._kernels = self._make(num_heads, k_buf)
        indices = flashinfer.kv_indices(batch.req_to_token, batch.req_rows, batch.prefix_lens + batch.extend_lens_dev,
                                        sum(batch.kv_lens))
        if batch.mode == "decode":
            self._kernels.plan_decode(indices, batch.kv_lens, self.scale)
        else:
            self._kernels.plan_extend(indices, batch.extend_lens, batch.kv_lens, self.scale)
        self._batch = batch

    def capture_state(self, bs: int, max_batch: int, num_heads: int, pool: DeviceKVPool,
                      req_table: ReqToTokenTable) -> flashinfer.PagedAttention:
        """A decode graph of bs rows: a wrapper over index buffers shared by all graphs (batches up
        to max_batch, each request up to the table's width), planned here for rows of one token."""
        k_buf = pool.k_buffer(0)
        if self._graph_buffers is None:
            self._graph_buffers = flashinfer.PagedAttention.graph_buffers(max_batch, max_batch * req_table.max_context,
                                                                          k_buf.device)
        kernels = self._make(num_heads, k_buf, graph_batch=bs)
        kernels.plan_decode(torch.zeros(bs, dtype=torch.int32, device=k_buf.device), [1] * bs, self.scale)
        return kernels

    def before_replay(self, state: flashinfer.PagedAttention, rows: torch.Tensor, seq_lens: torch.Tensor,
                      lens: list[int], req_table: ReqToTokenTable) -> None:
        """Plans the graph's wrapper for these rows of these lengths."""
        indices = flashinfer.kv_indices(req_table.table, rows, seq_lens, sum(lens))
        state.plan_decode(indices, lens, self.scale)
