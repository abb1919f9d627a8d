"""CUDA graphs for decode: one graph per bucketed batch size, captured once at startup.

A graph replays the whole decode forward pass (embedding, every layer with the KV store and the
backend's decode kernels, final norm, logits) from static input buffers, so a decode step costs
one launch instead of a thousand. A batch of n requests runs in the smallest bucket >= n; the
padding rows repeat row 0 (same token, slot and table row), so they write row 0's K/V again with
the same values and their logits are dropped. Capture runs before any request exists: its
warm-up passes write into whatever slot row 0 of the table names, which no request owns yet.
"""
from __future__ import annotations

import bisect
import logging
import time

import torch

from hicache.runtime.attention import GraphAttentionBackend
from hicache.runtime.batch import ForwardBatch
from hicache.runtime.pinned import tensor_to

logger = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 224, 256)


class DecodeGraphs:
    """Captured decode graphs of `model` over `pool` / `req_table` with the attention backend
    `attn` (one whose `graphs` is true).

    Only the scheduler thread calls `run`. Its logits are views into the graph's output buffer,
    valid until the next `run`.
    """

    def __init__(self, model: torch.nn.Module, pool, req_table, attn: GraphAttentionBackend, device: torch.device,
                 max_batch: int):
        self.model, self.pool, self.req_table, self.attn = model, pool, req_table, attn
        self.sizes = sorted({b for b in BUCKETS if b < max_batch} | {min(max_batch, BUCKETS[-1])})
        self.inputs = torch.zeros((3, self.sizes[-1]), dtype=torch.int64, device=device)  # ids, rows, seq_lens
        self.inputs[2].fill_(1)
        self.states = {bs: attn.capture_state(bs, self.sizes[-1], model.num_heads, pool, req_table)
                       for bs in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        model.rotary_emb.ensure(req_table.max_context, device)
        t0 = time.perf_counter()
        mempool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.sizes):  # largest first: the smaller ones reuse its memory
            self._capture(bs, mempool)
        logger.info("captured %d decode CUDA graphs (batch %d..%d) in %.1f s", len(self.sizes), self.sizes[0],
                    self.sizes[-1], time.perf_counter() - t0)

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def _forward(self, bs: int) -> torch.Tensor:
        ids, rows, seq_lens = self.inputs[0, :bs], self.inputs[1, :bs], self.inputs[2, :bs]
        positions = seq_lens - 1
        table = self.req_table.table
        batch = ForwardBatch("decode", self.attn, self.pool, table[rows, positions], [1] * bs, [],
                             req_to_token=table, req_rows=rows, seq_lens=seq_lens,
                             max_seq_len=self.req_table.max_context, graph_state=self.states[bs])
        batch.attach_window(self.req_table.max_context)
        return self.model.compute_logits(self.model(ids, positions, batch))

    @torch.inference_mode()
    def _capture(self, bs: int, mempool) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # builds the kernels, settles the allocator
                self._forward(bs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=mempool):
            self.logits[bs] = self._forward(bs)
        self.graphs[bs] = graph

    def run(self, ids: list[int] | torch.Tensor, rows: list[int], seq_lens: list[int]) -> torch.Tensor:
        """Decode one token for each of n <= max_batch requests: logits [n, vocab] float32. `ids`
        may be a [n] int64 device tensor (the previous step's samples). No host sync: the inputs
        are copied from pinned memory, or from the device."""
        n = len(rows)
        bs = self.sizes[bisect.bisect_left(self.sizes, n)]
        pad = bs - n
        host = [rows + rows[:1] * pad, seq_lens + seq_lens[:1] * pad]
        if isinstance(ids, torch.Tensor):
            self.inputs[0, :n].copy_(ids)
            if pad:
                self.inputs[0, n:bs].copy_(ids[:1].expand(pad))
            self.inputs[1:, :bs].copy_(tensor_to(host, self.inputs.device))
        else:
            self.inputs[:, :bs].copy_(tensor_to([ids + ids[:1] * pad] + host, self.inputs.device))
        self.attn.before_replay(self.states[bs], self.inputs[1, :bs], self.inputs[2, :bs], host[1], self.req_table)
        self.graphs[bs].replay()
        return self.logits[bs][:n]
