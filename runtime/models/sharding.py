"""How a model's tensors are split across tensor-parallel ranks.

An index is a tuple of per-dimension selectors (slices, or a 1-D tensor of row ids for fused
parameters) that picks this rank's part out of a FULL tensor; the empty tuple means the whole
tensor (every index is empty at size 1, so an unsharded model runs and loads exactly as before).
Each sharded parameter remembers its full shape and index (`full_shape`, `full_index`) so that
random weights can be drawn at full size and sliced (weights/dummy.py): the same seed gives the
same model at every size. Checkpoint tensors are sliced by the index their HF name maps to.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hicache.runtime.parallel import TensorParallel

Index = tuple  # of slice | torch.Tensor


def index(tp: TensorParallel, *selectors: Any) -> Index:
    """The selectors on a sharded model, () (the whole tensor) on an unsharded one."""
    return selectors if tp.sharded else ()


def scaled(part: slice, unit: int) -> slice:
    """A slice of items as a slice of their elements (heads -> rows of head_dim each)."""
    return slice(part.start * unit, part.stop * unit)


def fused_rows(blocks: list[tuple[int, slice]]) -> torch.Tensor:
    """Row ids, in a full fused tensor made of blocks (size, this rank's part of it) stacked in
    order, of this rank's rows: its part of every block."""
    ids, base = [], 0
    for size, part in blocks:
        ids.append(torch.arange(part.start, part.stop) + base)
        base += size
    return torch.cat(ids)


def sharded_param(full_shape: tuple[int, ...], idx: Index, dtype: torch.dtype,
                  device: torch.device | str) -> nn.Parameter:
    """An uninitialised parameter holding the part `idx` of a tensor of `full_shape`."""
    shape = torch.empty(full_shape, device="meta")[idx].shape if idx else full_shape
    p = nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)
    if idx:
        p.full_shape, p.full_index = full_shape, idx
    return p


def take(tensor: Any, idx: Index) -> torch.Tensor:
    """The part idx of a full checkpoint tensor: a torch tensor, or a lazy safetensors slice (then
    only that part is read when idx is made of slices)."""
    if isinstance(tensor, torch.Tensor):
        return tensor[idx] if idx else tensor
    if all(isinstance(s, slice) for s in idx):
        return tensor[idx or (slice(None),)]
    return tensor[:][idx]


def vocab_embedding(ids: torch.Tensor, weight: torch.Tensor, vocab: slice, tp: TensorParallel) -> torch.Tensor:
    """Embedding rows of ids when this rank holds the vocabulary rows `vocab`: the rows it holds,
    zeros for the others, summed over the ranks."""
    if not tp.sharded:
        return torch.nn.functional.embedding(ids, weight)
    local = ids - vocab.start
    outside = (local < 0) | (local >= weight.shape[0])
    x = torch.nn.functional.embedding(local.masked_fill(outside, 0), weight)
    return tp.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))
