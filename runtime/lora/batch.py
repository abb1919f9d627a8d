"""`LoraBatch`: the LoRA deltas of one forward pass whose requests use different adapters (or none).

The batch's tokens are grouped by adapter (a request's tokens are contiguous); for each group the
target linear's output gains `lora_B(lora_A(x[rows])) * scaling` at that module's columns. One
pair of small matmuls per adapter and module, on CPU and CUDA alike (torch ops); decode batches
with adapters run outside the CUDA graphs (`ModelRunner.forward`).
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F

from hicache.runtime.lora.adapter import LoraAdapter


class LoraGroup(NamedTuple):
    adapter: LoraAdapter
    rows: slice | torch.Tensor  # its tokens in the batch: a slice when contiguous, else [n] int64 on the device


class LoraBatch:
    def __init__(self, groups: list[LoraGroup]):
        self.groups = groups

    @classmethod
    def build(cls, adapters: Sequence[LoraAdapter | None], lens: Sequence[int], device: torch.device
              ) -> LoraBatch | None:
        """The groups of a batch whose request i computes `lens[i]` tokens under `adapters[i]`;
        None when no request has an adapter."""
        spans: dict[int, tuple[LoraAdapter, list[tuple[int, int]]]] = {}
        start = 0
        for adapter, n in zip(adapters, lens):
            if adapter is not None:
                spans.setdefault(id(adapter), (adapter, []))[1].append((start, start + n))
            start += n
        if not spans:
            return None
        return cls([LoraGroup(a, _rows(s, device)) for a, s in spans.values()])

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, columns: Sequence[tuple[str, int, int]]) -> None:
        """Adds, in place, each group's delta of the modules in `columns` ((module, first, end):
        the module's output columns in `out`, [T, out_features] of the fused linear) to `out`'s
        rows; x: [T, in_features], the linear's input."""
        for adapter, rows in self.groups:
            xs = None
            for module, first, end in columns:
                ab = adapter.weights.get((layer, module))
                if ab is None:
                    continue
                if xs is None:
                    xs = x[rows] if isinstance(rows, slice) else x.index_select(0, rows)
                delta = F.linear(F.linear(xs, ab[0]), ab[1]) * adapter.scaling
                if isinstance(rows, slice):
                    out[rows, first:end] += delta
                else:
                    out[:, first:end].index_add_(0, rows, delta)


def _rows(spans: list[tuple[int, int]], device: torch.device) -> slice | torch.Tensor:
    merged = [spans[0]]
    for a, b in spans[1:]:
        merged[-1:] = [(merged[-1][0], b)] if a == merged[-1][1] else [merged[-1], (a, b)]
    spans = merged
    if len(spans) == 1:
        return slice(*spans[0])
    return torch.cat([torch.arange(a, b) for a, b in spans]).to(device)
