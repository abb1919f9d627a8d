"""Tensor parallelism: which rank this process is, what share of a dimension it holds, and the
collectives a sharded model needs.

`TensorParallel()` is the single-process default: size 1, every collective the identity, so a
model built with it runs exactly the unsharded code. With size > 1 the collectives go through
`group`, a `torch.distributed` process group (NCCL on CUDA, gloo on CPU).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup when size > 1

    def __post_init__(self):
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is not in [0, {self.size})")

    @property
    def sharded(self) -> bool:
        return self.size > 1

    def shard(self, n: int, name: str = "dimension") -> slice:
        """This rank's contiguous part of a dimension of size n (ValueError unless size divides n)."""
        if n % self.size:
            raise ValueError(f"{name} ({n}) is not divisible by the tensor-parallel size ({self.size})")
        part = n // self.size
        return slice(self.rank * part, (self.rank + 1) * part)

    def kv_heads(self, num_kv_heads: int) -> slice:
        """The KV heads this rank holds: its share when size divides them, else the one head its
        query heads read (KV heads replicated when there are fewer of them than ranks)."""
        if num_kv_heads >= self.size:
            return self.shard(num_kv_heads, "num_kv_heads")
        if self.size % num_kv_heads:
            raise ValueError(f"the tensor-parallel size ({self.size}) is not a multiple of num_kv_heads "
                             f"({num_kv_heads})")
        head = self.rank * num_kv_heads // self.size
        return slice(head, head + 1)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of t over the ranks, in place; t itself at size 1."""
        if self.sharded:
            torch.distributed.all_reduce(t, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' t concatenated along dim, in rank order; t itself at size 1."""
        if not self.sharded:
            return t
        parts = [torch.empty_like(t) for _ in range(self.size)]
        torch.distributed.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


SINGLE = TensorParallel()  # one process: the default of every model and loader
