"""Random paged inputs for the attention kernel tests: a pool, each sequence on scattered pages,
a request-to-token table, fresh generators, and the relative error the tolerances bound."""
from __future__ import annotations

from typing import NamedTuple

import kernel_env as env
import torch

DEV = env.DEV


def fresh_gen() -> torch.Generator:
    return torch.Generator(DEV).manual_seed(torch.seed() % 2**31)


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    return float((out.float() - want.float()).norm() / want.float().norm())


def paged_slots(lens: list[int], page_size: int, gen: torch.Generator) -> tuple[list[torch.Tensor], int]:
    """Each sequence on its own scattered pages; returns per-sequence slots and the pool size."""
    pages = [-(-n // page_size) for n in lens]
    total = sum(pages) + 3  # a few pages nobody uses
    order = torch.randperm(total, generator=gen, device=DEV)
    slots, used = [], 0
    for n, p in zip(lens, pages):
        seq_pages = order[used:used + p]
        used += p
        s = (seq_pages[:, None] * page_size + torch.arange(page_size, device=DEV)[None, :]).reshape(-1)
        slots.append(s[:n])
    return slots, total * page_size


def table_of(slots: list[torch.Tensor], extra_rows: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """A req-to-token table with unused rows between requests; returns (table, rows)."""
    width = max(s.numel() for s in slots) + 5
    table = torch.zeros(len(slots) * extra_rows + 1, width, dtype=torch.int64, device=DEV)
    rows = torch.arange(len(slots), device=DEV) * extra_rows + 1
    for r, s in zip(rows.tolist(), slots):
        table[r, : s.numel()] = s
    return table, rows


def random_pool(num_slots: int, hkv: int, d: int, dtype, gen) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randn(num_slots, hkv, d, generator=gen, device=DEV).to(dtype),
            torch.randn(num_slots, hkv, d, generator=gen, device=DEV).to(dtype))


class ExtendCase(NamedTuple):
    """An extend batch over cached prefixes: queries for the new tokens, a pool holding prefix and
    new tokens on scattered pages, the table, and the per-request lengths and query offsets."""
    q: torch.Tensor  # [sum(extends), hq, d]
    k_buf: torch.Tensor
    v_buf: torch.Tensor
    slots: list[torch.Tensor]
    table: torch.Tensor
    rows: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    starts: torch.Tensor


def extend_case(prefixes: list[int], extends: list[int], page_size: int, hq: int, hkv: int, d: int, dtype,
                gen: torch.Generator) -> ExtendCase:
    slots, num_slots = paged_slots([p + e for p, e in zip(prefixes, extends)], page_size, gen)
    k_buf, v_buf = random_pool(num_slots, hkv, d, dtype, gen)
    table, rows = table_of(slots)
    q = torch.randn(sum(extends), hq, d, generator=gen, device=DEV).to(dtype)
    lens = torch.tensor(extends, device=DEV)
    return ExtendCase(q, k_buf, v_buf, slots, table, rows, torch.tensor(prefixes, device=DEV), lens,
                      torch.cumsum(lens, 0) - lens)
