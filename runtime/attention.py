"""Attention backends: store the new tokens' K/V in the L1 pool and attend over the paged KV.

Selected by name (`attention_backend`, and `decode_attention_backend` for decode steps): "torch"
is the reference path (any device, used on CPU); "triton" runs the Triton kernels of
`hicache.kernels` (CUDA); "flashinfer" runs FlashInfer's paged kernels (CUDA, fp16/bf16). "auto"
resolves by the KV pool's device, dtype and head size (`resolve_attention_backends`): prefill and
extend on flashinfer where it is importable and serves the pool, else triton on CUDA, else torch;
decode as the prefill names it, or, when that is "auto" too, triton on CUDA (its decode kernel
measured faster than FlashInfer's on an H100, its extend kernel slower: benchmarks/RESULTS.md).

The backends that decode inside CUDA graphs (`graphs = True`) give each captured batch size a
state (`capture_state`, passed to the pass as `ForwardBatch.graph_state`) and may refresh it
before a replay (`before_replay`).
"""
from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Callable

import torch

from hicache.kernels.attention import decode_attention, extend_attention, store_kv

if TYPE_CHECKING:
    from hicache.runtime.batch import ForwardBatch
    from hicache.tiers.gpu.pool import DeviceKVPool
    from hicache.tiers.gpu.req_table import ReqToTokenTable


class TorchAttention:
    """Reference backend: torch SDPA over K/V gathered from the pool."""

    graphs = False  # it syncs with the host

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

    graphs = True

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
        if batch.graph_state is not None:  # fixed when captured in a CUDA graph
            return batch.graph_state
        return self.splits_for(len(batch.extend_lens), k_buf.shape[1], batch.max_seq_len, k_buf.device)

    def splits_for(self, batch_size: int, num_kv_heads: int, max_len: int, device: torch.device) -> int:
        if self._num_sms is None:
            self._num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        return self._decode.default_num_splits(batch_size, num_kv_heads, max_len, self._num_sms)

    def capture_state(self, bs: int, max_batch: int, num_heads: int, pool: DeviceKVPool,
                      req_table: ReqToTokenTable) -> int:
        """A decode graph of bs rows: its split count, for contexts up to the table's width."""
        return self.splits_for(bs, pool.k_buffer(0).shape[1], req_table.max_context, pool.k_buffer(0).device)

    def before_replay(self, state: int, rows: torch.Tensor, seq_lens: torch.Tensor, lens: list[int],
                      req_table: ReqToTokenTable) -> None:
        """Nothing to refresh: the graph's kernels read rows and lengths from its inputs."""


class FlashInferAttention:
    """CUDA backend on FlashInfer's paged prefill and decode kernels (`kernels/flashinfer.py`),
    with the Triton KV store. A forward pass is planned when its first layer attends; a decode
    graph has a wrapper of its own (its `graph_state`), planned before each replay."""

    graphs = True

    def __init__(self, head_dim: int):
        if not torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
            raise ValueError("attention_backend 'flashinfer' needs a CUDA device and the triton package")
        from hicache.kernels import flashinfer, store  # needs CUDA: imported only here

        if not flashinfer.available():
            raise ValueError("attention_backend 'flashinfer' needs the flashinfer package (pip install flashinfer-python)")
        self._fi, self._store = flashinfer, store
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5
        self._workspace: torch.Tensor | None = None
        self._graph_buffers = None
        self._kernels = None  # the wrapper of passes outside graphs
        self._batch: ForwardBatch | None = None  # the pass it was last planned for

    def _make(self, num_heads: int, k_buf: torch.Tensor, graph_batch: int | None = None):
        if self._workspace is None:
            self._workspace = torch.zeros(self._fi.WORKSPACE_BYTES, dtype=torch.uint8, device=k_buf.device)
        return self._fi.PagedAttention(num_heads, k_buf.shape[1], self.head_dim, k_buf.dtype, self._workspace,
                                       graph_batch, self._graph_buffers)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        k_buf, v_buf = batch.pool.k_buffer(layer_id), batch.pool.v_buffer(layer_id)
        self._store.store_kv(k_buf, v_buf, batch.out_cache_loc, k, v)
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
        indices = self._fi.kv_indices(batch.req_to_token, batch.req_rows, batch.prefix_lens + batch.extend_lens_dev,
                                      sum(batch.kv_lens))
        if batch.mode == "decode":
            self._kernels.plan_decode(indices, batch.kv_lens, self.scale)
        else:
            self._kernels.plan_extend(indices, batch.extend_lens, batch.kv_lens, self.scale)
        self._batch = batch

    def capture_state(self, bs: int, max_batch: int, num_heads: int, pool: DeviceKVPool,
                      req_table: ReqToTokenTable):
        """A decode graph of bs rows: a wrapper over index buffers shared by all graphs (batches up
        to max_batch, each request up to the table's width), planned here for rows of one token."""
        k_buf = pool.k_buffer(0)
        if self._graph_buffers is None:
            self._graph_buffers = self._fi.PagedAttention.graph_buffers(max_batch, max_batch * req_table.max_context,
                                                                        k_buf.device)
        kernels = self._make(num_heads, k_buf, graph_batch=bs)
        kernels.plan_decode(torch.zeros(bs, dtype=torch.int32, device=k_buf.device), [1] * bs, self.scale)
        return kernels

    def before_replay(self, state, rows: torch.Tensor, seq_lens: torch.Tensor, lens: list[int],
                      req_table: ReqToTokenTable) -> None:
        """Plans the graph's wrapper for these rows (device [bs] int64) of these lengths."""
        indices = self._fi.kv_indices(req_table.table, rows, seq_lens, sum(lens))
        state.plan_decode(indices, lens, self.scale)


class SplitAttention:
    """Prefill and extend passes on one backend, decode passes on another (the graph hooks are
    the decode backend's)."""

    def __init__(self, prefill, decode):
        self.prefill, self.decode = prefill, decode
        self.graphs = decode.graphs

    def capture_state(self, *args):
        return self.decode.capture_state(*args)

    def before_replay(self, *args) -> None:
        self.decode.before_replay(*args)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        impl = self.decode if batch.mode == "decode" else self.prefill
        return impl.forward(q, k, v, layer_id, batch)


class AutoAttention:
    """"auto" (with `decode_name` for decode): chosen on the first forward pass (or graph capture),
    when the KV pool's device and dtype are known (the model's device is only known once it runs)."""

    def __init__(self, head_dim: int, decode_name: str = "auto"):
        self.head_dim, self.names = head_dim, ("auto", decode_name)
        self.impl = None

    def resolve(self, device: torch.device, dtype: torch.dtype):
        if self.impl is None:
            self.impl = build(*resolve_attention_backends(*self.names, device, dtype, self.head_dim), self.head_dim)
        return self.impl

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        return self.resolve(q.device, batch.pool.k_buffer(layer_id).dtype).forward(q, k, v, layer_id, batch)


ATTENTION_BACKENDS: dict[str, Callable[[int], object]] = {
    "torch": TorchAttention, "triton": TritonAttention, "flashinfer": FlashInferAttention}
NAMES = ("auto", *ATTENTION_BACKENDS)


def resolve_attention_backends(name: str, decode_name: str, device: torch.device, dtype: torch.dtype,
                               head_dim: int) -> tuple[str, str]:
    """The (prefill, decode) backends that "auto" stands for here (module docstring); other names
    are kept."""
    cuda = device.type == "cuda" and importlib.util.find_spec("triton") is not None
    if name == "auto":
        from hicache.kernels import flashinfer

        name = "flashinfer" if cuda and flashinfer.available() and flashinfer.supports(dtype, head_dim) else (
            "triton" if cuda else "torch")
        if decode_name == "auto":
            decode_name = "triton" if cuda else "torch"
    return name, name if decode_name == "auto" else decode_name


def build(name: str, decode_name: str, head_dim: int):
    prefill = ATTENTION_BACKENDS[name](head_dim)
    return prefill if decode_name == name else SplitAttention(prefill, ATTENTION_BACKENDS[decode_name](head_dim))


def make_attention_backend(name: str, head_dim: int, decode_name: str = "auto"):
    """The backend named `name` (prefill and extend) and `decode_name` (decode; "auto": as `name`,
    or the measured choice when both are "auto")."""
    for option, value in (("attention_backend", name), ("decode_attention_backend", decode_name)):
        if value not in NAMES:
            raise ValueError(f"{option} must be one of {', '.join(NAMES)}, got {value!r}")
    if name == "auto":
        return AutoAttention(head_dim, decode_name)
    return build(name, name if decode_name == "auto" else decode_name, head_dim)
