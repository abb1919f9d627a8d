"""Sliding-window attention: the torch reference against HF's mask convention, and the Triton
extend and decode kernels against the reference on fresh random inputs (on CUDA, or under
Triton's interpreter with small shapes), at head sizes 256 (Gemma 3) and 64."""
from __future__ import annotations

import kernel_env as env  # first: it may turn on Triton's interpreter
import pytest
import torch
import torch.nn.functional as F
from paged_inputs import extend_case, fresh_gen, paged_slots, random_pool, rel_err, table_of

from hicache.kernels import attention as ref

DEV = env.DEV
HALF = env.half(torch.bfloat16)
slow = pytest.mark.slow
# the default suite runs one case of each kernel (interpreted, a case takes seconds); `make test-all` all
SHAPES = [(256, 8), pytest.param(256, 1, marks=slow), pytest.param(64, 100, marks=slow)]
DTYPES = [HALF, pytest.param(torch.float32, marks=slow)]
TOL = {torch.float16: 1e-2, torch.bfloat16: 1e-2, torch.float32: 1e-4}


def test_reference_window_is_hf_convention():
    """Extend and decode with a window equal dense attention under HF's sliding-window mask."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    n, window, h, d = 23, 5, 2, 16
    q, k, v = (torch.randn(n, h, d, generator=gen) for _ in range(3))
    allowed = sliding_window_causal_mask_function(window)
    mask = allowed(torch.tensor(0), torch.tensor(0), torch.arange(n)[:, None], torch.arange(n)[None, :])
    want = F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (q, k, v)), attn_mask=mask).transpose(0, 1)
    slots = torch.randperm(n, generator=gen)
    k_buf, v_buf = torch.empty_like(k), torch.empty_like(v)
    ref.store_kv(k_buf, v_buf, slots, k, v)
    got = ref.extend_attention(q, k_buf, v_buf, [slots[:7], slots], [7, n - 7], d ** -0.5, window)
    assert torch.allclose(got[:7], want[:7], atol=1e-5) and torch.allclose(got[7:], want[7:], atol=1e-5)
    dec = ref.decode_attention(q[[4, n - 1]], k_buf, v_buf, torch.stack([slots, slots]), torch.tensor([5, n]),
                               d ** -0.5, window)
    assert torch.allclose(dec, want[[4, n - 1]], atol=1e-5)


kernel = env.kernels[0]
if env.CUDA or env.INTERPRETED:
    from hicache.kernels.decode import decode_attention
    from hicache.kernels.extend import extend_attention


@kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,window", SHAPES)
@pytest.mark.parametrize("page_size", [pytest.param(1, marks=slow), 16])
def test_extend_window(dtype, d, window, page_size):
    gen = fresh_gen()
    hq, hkv = env.sizes((8, 1), (4, 1))
    prefixes, extends = env.sizes(([0, 3000, 37, 600], [700, 300, 129, 1]), ([0, 200, 37, 90], [80, 40, 9, 1]))
    c = extend_case(prefixes, extends, page_size, hq, hkv, d, dtype, gen)
    out = extend_attention(c.q, c.k_buf, c.v_buf, c.table, c.rows, c.prefix_lens, c.extend_lens, c.starts,
                           max(extends), d ** -0.5, window=window)
    want = ref.extend_attention(c.q.float(), c.k_buf.float(), c.v_buf.float(), c.slots, extends, d ** -0.5, window)
    for s, e in zip(c.starts.tolist(), extends):
        assert rel_err(out[s:s + e], want[s:s + e]) < TOL[dtype], (s, e)


@kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,window", SHAPES)
def test_decode_window(dtype, d, window):
    gen = fresh_gen()
    hq, hkv = env.sizes((8, 2), (4, 1))
    lens = env.sizes([1, 7, 8, 9, 300, 5000], [1, 7, 8, 9, 150])
    slots, num_slots = paged_slots(lens, 16, gen)
    k_buf, v_buf = random_pool(num_slots, hkv, d, dtype, gen)
    table, rows = table_of(slots)
    q = torch.randn(len(lens), hq, d, generator=gen, device=DEV).to(dtype)
    seq_lens = torch.tensor(lens, device=DEV)
    want = ref.decode_attention(q.float(), k_buf.float(), v_buf.float(), table[rows], seq_lens, d ** -0.5, window)
    for splits in (None, 1, 3):
        out = decode_attention(q, k_buf, v_buf, table, rows, seq_lens, d ** -0.5, num_splits=splits, window=window)
        for i in range(len(lens)):
            assert rel_err(out[i], want[i]) < TOL[dtype], (splits, i)
