"""Triton few-row linear (decode-sized batches) vs torch's, on fresh random tensors (on CUDA, or on
the CPU under Triton's interpreter: kernel_env)."""
from __future__ import annotations

import kernel_env as env  # first: it may turn on Triton's interpreter
import pytest
import torch
import torch.nn.functional as F

from hicache.runtime.models import llama

pytestmark = env.kernels
if env.CUDA or env.INTERPRETED:
    from hicache.kernels.linear import MAX_ROWS, linear_rows

DEV = env.DEV


def rel_err(out, want):
    return float((out.float() - want).norm() / want.norm())


@pytest.mark.parametrize("dtype", sorted({env.half(torch.bfloat16), torch.float16}, key=str))
@pytest.mark.parametrize("rows", [1, 7, 16])
@pytest.mark.parametrize("n,k", env.sizes([(6144, 4096), (28672, 4096), (4096, 14336), (100, 300)], [(256, 1024), (100, 300)]))
def test_linear_rows_matches_torch(dtype, rows, n, k):
    gen = torch.Generator(DEV).manual_seed(torch.seed() % 2**31)
    x = torch.randn(rows, k, generator=gen, device=DEV).to(dtype)
    w = (torch.randn(n, k, generator=gen, device=DEV) / k**0.5).to(dtype)
    out = linear_rows(x, w)
    assert out.shape == (rows, n) and out.dtype == dtype
    assert rel_err(out, F.linear(x.float(), w.float())) < 1e-2


@env.needs_cuda  # llama.linear dispatches to the kernel on CUDA tensors only
def test_model_linear_takes_the_kernel_where_it_is_preferred():
    gen = torch.Generator(DEV).manual_seed(torch.seed() % 2**31)
    deep = torch.randn(256, 512, generator=gen, device=DEV).to(torch.bfloat16)  # o/down-shaped: N <= K
    wide = torch.randn(1024, 512, generator=gen, device=DEV).to(torch.bfloat16)  # q/k/v-shaped
    few = torch.randn(MAX_ROWS, 512, generator=gen, device=DEV).to(torch.bfloat16)
    many = torch.randn(MAX_ROWS + 1, 512, generator=gen, device=DEV).to(torch.bfloat16)
    assert torch.equal(llama.linear(few, deep), linear_rows(few, deep))
    assert torch.equal(llama.linear(few, wide), F.linear(few, wide))
    assert torch.equal(llama.linear(many, deep), F.linear(many, deep))
    assert torch.equal(llama.linear(few.float(), deep.float()), F.linear(few.float(), deep.float()))


def test_linear_rows_rejects_bad_arguments():
    w = torch.zeros(64, 32, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="at most 16"):
        linear_rows(torch.zeros(MAX_ROWS + 1, 32, device=DEV, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="bf16 or both fp16"):
        linear_rows(torch.zeros(2, 32, device=DEV), w.float())
    with pytest.raises(ValueError, match="contiguous"):
        linear_rows(torch.zeros(2, 64, device=DEV, dtype=torch.bfloat16), w.t())
    if env.CUDA:  # (the interpreter takes CPU tensors)
        with pytest.raises(ValueError, match="CUDA"):
            linear_rows(torch.zeros(2, 32, dtype=torch.bfloat16), w)
