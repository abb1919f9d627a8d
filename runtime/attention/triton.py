"""The "triton" attention backend (CUDA). Importing this module imports triton: the registry
(`hicache.runtime.attention`) does so only when the backend is asked for, on CUDA."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hicache.kernels import decode, extend, store

if TYPE_CHECKING:
    from hicache.runtime.batch import ForwardBatch
    from hicache.tiers.gpu.pool import DeviceKVPool
    from hicache.tiers.gpu.req_table import ReqToTokenTable


class TritonAttention:
    """Triton KV store, extend (prefill with a cached prefix) and split-K decode, all reading the
    KV through the request-to-token table. No host sync inside a forward pass. Its graph state is
    a decode graph's split count."""

    graphs = True

    def __init__(self, head_dim: int, scale: float | None = None, windows: tuple = ()):
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.windows = windows  # per layer: sliding window or None; () for none
        self._num_sms: int | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        batch = batch.for_layer(layer_id)
        k_buf, v_buf = batch.pool.k_buffer(layer_id), batch.pool.v_buffer(layer_id)
        store.store_kv(k_buf, v_buf, batch.out_cache_loc, k, v)
        batch.wait_layer(layer_id)  # this layer's load-back from L2, if one is in flight (no host sync)
        window = self.windows[layer_id] if self.windows else None
        if batch.mode == "decode":
            return decode.decode_attention(q, k_buf, v_buf, batch.req_to_token, batch.req_rows, batch.seq_lens,
                                           self.scale, self.num_splits(batch, k_buf), window=window)
        return extend.extend_attention(q, k_buf, v_buf, batch.req_to_token, batch.req_rows, batch.prefix_lens,
                                       batch.extend_lens_dev, batch.q_starts, batch.max_extend, self.scale,
                                       window=window)

    def num_splits(self, batch: ForwardBatch, k_buf: torch.Tensor) -> int:
        if batch.graph_state is not None:  # fixed when captured in a CUDA graph
            return batch.graph_state
        return self.splits_for(len(batch.extend_lens), k_buf.shape[1], batch.max_seq_len, k_buf.device)

    def splits_for(self, batch_size: int, num_kv_heads: int, max_len: int, device: torch.device) -> int:
        if self._num_sms is None:
            self._num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        return decode.default_num_splits(batch_size, num_kv_heads, max_len, self._num_sms)

    def capture_state(self, bs: int, max_batch: int, num_heads: int, pool: DeviceKVPool,
                      req_table: ReqToTokenTable) -> int:
        """A decode graph of bs rows: its split count, for contexts up to the table's width."""
        return self.splits_for(bs, pool.k_buffer(0).shape[1], req_table.max_context, pool.k_buffer(0).device)

    def before_replay(self, state: int, rows: torch.Tensor, seq_lens: torch.Tensor, lens: list[int],
                      req_table: ReqToTokenTable) -> None:
        """Nothing to refresh: the graph's kernels read rows and lengths from its inputs."""
