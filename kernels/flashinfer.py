"""FlashInfer's paged prefill and decode kernels over the L1 pool's K/V buffers.

A pool buffer [slots, Hkv, D] is FlashInfer's NHD paged cache with pages of one token
([slots, 1, Hkv, D]), so a request's KV is the list of its slots in the request-to-token table,
whatever the pool's page size. `kv_indices` builds that list on the device (no host sync, testable
on CPU); `PagedAttention` plans a forward pass once and then runs every layer of it. A layer with a
sliding window of W keys gets a wrapper of its own, planned over each request's last keys only
(`visible`: the W - 1 before its first new token, and the new ones) with `window_left = W - 1`,
so that it neither reads nor lists the slots before the window. flashinfer is imported only when
a `PagedAttention` is made (CUDA, fp16/bf16).
"""
from __future__ import annotations

import importlib.util

import torch

from hicache.kernels.checks import index_vector, require

HALF_DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (64, 128, 256)
WORKSPACE_BYTES = 128 << 20  # split-KV partial results (FlashInfer advises 128 MB); shared by one backend's wrappers


def available() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def supports(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernels built here serve a KV pool of this dtype and head size."""
    return dtype in HALF_DTYPES and head_dim in HEAD_DIMS


def kv_indices(req_to_token: torch.Tensor, rows: torch.Tensor, kv_lens: torch.Tensor, total: int,
               starts: torch.Tensor | None = None) -> torch.Tensor:
    """The slots of tokens [starts[i], kv_lens[i]) of table row rows[i] (starts: 0 where None),
    request after request: [total] int32 on the table's device (total = the tokens listed, given so
    that nothing waits for the device). rows, kv_lens, starts: [N] int64 on that device."""
    named = (("rows", rows), ("kv_lens", kv_lens)) + ((("starts", starts),) if starts is not None else ())
    for name, t in named:
        index_vector(name, t, rows.numel())
        require(t.device == req_to_token.device, f"{name} is on {t.device}, the table on {req_to_token.device}")
    counts = kv_lens if starts is None else kv_lens - starts
    seq = torch.repeat_interleave(torch.arange(rows.numel(), device=rows.device), counts, output_size=total)
    pos = torch.arange(total, device=rows.device) - (counts.cumsum(0) - counts)[seq]
    return req_to_token[rows[seq], pos if starts is None else pos + starts[seq]].to(torch.int32)


def visible(window: int | None, kv_lens: list[int], q_lens: list[int]) -> list[int]:
    """How many of each request's last keys a layer of this sliding window (None: full attention)
    reads when q_lens[i] new tokens end its kv_lens[i]."""
    if window is None:
        return kv_lens
    return [min(kv, q + window - 1) for kv, q in zip(kv_lens, q_lens)]


def window_left(window: int | None) -> int:
    """FlashInfer's `window_left` for a window of W keys (the query's own included); -1: none."""
    return -1 if window is None else window - 1


def _ones(lens: list[int]) -> torch.Tensor:
    """Each request's last page holds one token (pages of one token): host int32."""
    return torch.ones(len(lens), dtype=torch.int32)


def _indptr(lens: list[int]) -> torch.Tensor:
    out = torch.zeros(len(lens) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0, out=out[1:])
    return out


class PagedAttention:
    """One plan, many layers: `plan_extend` / `plan_decode` once per forward pass (host work and
    small copies on the current stream), then `run` for each layer. Only the scheduler thread
    calls it.

    With `graph_batch` set it is a decode wrapper for a CUDA graph of that batch size: its index
    buffers keep their addresses, so a graph captured over `run` replays whatever the last
    `plan_decode` put there. Such wrappers share `buffers` (indptr, indices, last-page lengths),
    since one graph replays at a time on one stream.
    """

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 workspace: torch.Tensor, graph_batch: int | None = None,
                 buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                 tensor_cores: bool | None = None):
        require(supports(dtype, head_dim), f"flashinfer attention needs fp16/bf16 and head_dim in {HEAD_DIMS}, "
                                           f"got {dtype} and {head_dim}")
        import flashinfer

        self.heads = (num_qo_heads, num_kv_heads, head_dim)
        self.dtype = dtype
        self._planned: torch.cuda.Event | None = None
        if tensor_cores is None:  # decode on the matrix units when a KV head serves 4+ query heads
            tensor_cores = num_qo_heads // num_kv_heads >= 4
        if graph_batch is None:
            self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
            self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD",
                                                                         use_tensor_cores=tensor_cores)
        else:
            indptr, indices, last = buffers
            self._prefill = None
            self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores,
                paged_kv_indptr_buffer=indptr[:graph_batch + 1], paged_kv_indices_buffer=indices,
                paged_kv_last_page_len_buffer=last[:graph_batch])
        self._active = self._decode

    @staticmethod
    def graph_buffers(max_batch: int, max_tokens: int, device: torch.device):
        """(indptr, indices, last-page lengths) for the graph wrappers of batches up to max_batch
        whose KV lengths sum to at most max_tokens."""
        return (torch.zeros(max_batch + 1, dtype=torch.int32, device=device),
                torch.zeros(max_tokens, dtype=torch.int32, device=device),
                torch.ones(max_batch, dtype=torch.int32, device=device))

    def _before_plan(self) -> None:
        # plan() stages its schedule in a pinned host buffer and copies it on the stream: the last
        # plan's copy must have left that buffer before it is written again (overlap scheduling
        # plans step t+1 while step t may still be queued).
        if self._planned is not None:
            self._planned.synchronize()

    def _after_plan(self) -> None:
        self._planned = torch.cuda.Event()
        self._planned.record()

    def plan_extend(self, indices: torch.Tensor, q_lens: list[int], kv_lens: list[int], scale: float,
                    window: int | None = None) -> None:
        """New tokens (q_lens[i] of request i, the last of its kv_lens[i] tokens listed) attend
        causally to the request's KV, within `window` keys where given; `indices` from `kv_indices`."""
        hq, hkv, d = self.heads
        self._before_plan()
        self._prefill.plan(_indptr(q_lens), _indptr(kv_lens), indices, _ones(kv_lens),
                           hq, hkv, d, 1, causal=True, sm_scale=scale, q_data_type=self.dtype,
                           kv_data_type=self.dtype, window_left=window_left(window))
        self._after_plan()
        self._active = self._prefill

    def plan_decode(self, indices: torch.Tensor, kv_lens: list[int], scale: float,
                    window: int | None = None) -> None:
        """One query token per request, the last of its kv_lens[i] tokens listed, within `window`
        keys where given."""
        hq, hkv, d = self.heads
        self._before_plan()
        self._decode.plan(_indptr(kv_lens), indices, _ones(kv_lens), hq, hkv, d, 1, sm_scale=scale,
                          q_data_type=self.dtype, kv_data_type=self.dtype, window_left=window_left(window))
        self._after_plan()
        self._active = self._decode

    def run(self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D] -> [T, Hq, D] over k/v_buffer [slots, Hkv, D], as planned last."""
        cache = (k_buffer.unsqueeze(1), v_buffer.unsqueeze(1))
        return self._active.run(q.contiguous(), cache)
