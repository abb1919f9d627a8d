"""FlashInfer over the L1 pool (`hicache.kernels.flashinfer`) vs the torch reference on fresh
random inputs. The slot lists it reads (`kv_indices`) are checked everywhere, on CPU tensors too;
the kernels need CUDA and the flashinfer package (pytest -m gpu on the device).

Tolerances as for the Triton kernels (issue 6): relative error under 1e-2 in bf16 and fp16.
"""
from __future__ import annotations

import kernel_env as env  # first: it may turn on Triton's interpreter
import pytest
import torch
from paged_inputs import fresh_gen, paged_slots, random_pool, rel_err, table_of

from hicache.kernels import attention as ref
from hicache.kernels import flashinfer as fi

DEV = env.DEV


def needs_flashinfer(test):
    test = pytest.mark.skipif(not (env.CUDA and fi.available()), reason="needs CUDA and flashinfer")(test)
    return pytest.mark.gpu(test)


GROUPS = [(8, 8), (32, 8), (32, 4)]  # (Hq, Hkv): GQA 1, 4, 8


def test_kv_indices_lists_each_rows_slots_in_order():
    gen = fresh_gen()
    lens = [1, 300, 17, 64, 2]
    slots, _ = paged_slots(lens, 16, gen)
    table, rows = table_of(slots)
    out = fi.kv_indices(table, rows, torch.tensor(lens, device=DEV), sum(lens))
    assert out.dtype == torch.int32
    assert torch.equal(out.long(), torch.cat(slots))
    shorter = [n - 1 for n in lens[1:]]  # a prefix of each row, other rows
    out = fi.kv_indices(table, rows[1:], torch.tensor(shorter, device=DEV), sum(shorter))
    assert torch.equal(out.long(), torch.cat([s[:n] for s, n in zip(slots[1:], shorter)]))


def test_kv_indices_lists_a_tail_of_each_row_when_given_starts():
    gen = fresh_gen()
    lens, starts = [1, 300, 17, 64], [0, 250, 0, 63]
    slots, _ = paged_slots(lens, 16, gen)
    table, rows = table_of(slots)
    total = sum(n - s for n, s in zip(lens, starts))
    out = fi.kv_indices(table, rows, torch.tensor(lens, device=DEV), total, torch.tensor(starts, device=DEV))
    assert torch.equal(out.long(), torch.cat([sl[s:] for sl, s in zip(slots, starts)]))


@pytest.mark.parametrize("window", [1, 5, 64])
def test_a_windowed_layer_reads_only_the_visible_tail(window):
    """Attention over the tail `visible` lists equals attention over the whole KV, both masked by
    the window (the torch reference): the tail holds every key a query of the window reads."""
    gen = fresh_gen()
    prefixes, extends = [0, 3, 200, 64, 10], [7, 1, 30, 1, 1]
    lens = [p + e for p, e in zip(prefixes, extends)]
    slots, num_slots = paged_slots(lens, 16, gen)
    k_buf, v_buf = random_pool(num_slots, 2, 16, torch.float32, gen)
    q = torch.randn(sum(extends), 4, 16, generator=gen, device=DEV)
    seen = fi.visible(window, lens, extends)
    tails = [s[n - v:] for s, n, v in zip(slots, lens, seen)]
    assert all(v <= n for v, n in zip(seen, lens)) and fi.visible(None, lens, extends) == lens
    want = ref.extend_attention(q, k_buf, v_buf, slots, extends, 0.25, window)
    assert torch.allclose(ref.extend_attention(q, k_buf, v_buf, tails, extends, 0.25, window), want, atol=1e-6)
    assert fi.window_left(window) == window - 1 and fi.window_left(None) == -1


def test_kv_indices_rejects_bad_arguments():
    table = torch.zeros(4, 8, dtype=torch.int64, device=DEV)
    rows = torch.tensor([0, 1], device=DEV)
    with pytest.raises(ValueError, match="kv_lens"):
        fi.kv_indices(table, rows, torch.tensor([1], device=DEV), 1)
    with pytest.raises(ValueError, match="kv_lens"):
        fi.kv_indices(table, rows, torch.tensor([1.0, 1.0], device=DEV), 2)


def test_supports_half_dtypes_and_common_head_sizes():
    assert fi.supports(torch.bfloat16, 128) and fi.supports(torch.float16, 64)
    assert not fi.supports(torch.float32, 128) and not fi.supports(torch.bfloat16, 80)


def make(hq: int, hkv: int, d: int, dtype, graph_batch: int | None = None, buffers=None) -> fi.PagedAttention:
    workspace = torch.zeros(fi.WORKSPACE_BYTES, dtype=torch.uint8, device=DEV)
    return fi.PagedAttention(hq, hkv, d, dtype, workspace, graph_batch, buffers)


def indices_of(table, rows, lens: list[int]) -> torch.Tensor:
    return fi.kv_indices(table, rows, torch.tensor(lens, device=DEV), sum(lens))


@needs_flashinfer
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hkv", GROUPS)
@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("d", [128, 64])
@pytest.mark.parametrize("batch", ["ragged", "long_prefix"])
def test_extend_with_prefix(dtype, hq, hkv, page_size, d, batch):
    gen = fresh_gen()
    prefixes, extends = {"ragged": ([0, 0, 37, 500, 1000, 64], [1, 200, 129, 1, 300, 64]),
                         "long_prefix": ([30000, 0], [100, 257])}[batch]
    lens = [p + e for p, e in zip(prefixes, extends)]
    slots, num_slots = paged_slots(lens, page_size, gen)
    k_buf, v_buf = random_pool(num_slots, hkv, d, dtype, gen)
    table, rows = table_of(slots)
    q = torch.randn(sum(extends), hq, d, generator=gen, device=DEV).to(dtype)
    attn = make(hq, hkv, d, dtype)
    attn.plan_extend(indices_of(table, rows, lens), extends, lens, d ** -0.5)
    out = attn.run(q, k_buf, v_buf)
    want = ref.extend_attention(q.float(), k_buf.float(), v_buf.float(), slots, extends, d ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape
    starts = [sum(extends[:i]) for i in range(len(extends))]
    for s, e in zip(starts, extends):  # no request hides behind the others' norm
        assert rel_err(out[s:s + e], want[s:s + e]) < 1e-2


@needs_flashinfer
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hkv", GROUPS)
@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("d", [128, 64])
def test_decode_ragged(dtype, hq, hkv, page_size, d):
    gen = fresh_gen()
    lens = [1, 17, 300, 64, 1000, 2049, 5, 30000]
    slots, num_slots = paged_slots(lens, page_size, gen)
    k_buf, v_buf = random_pool(num_slots, hkv, d, dtype, gen)
    table, rows = table_of(slots)
    q = torch.randn(len(lens), hq, d, generator=gen, device=DEV).to(dtype)
    attn = make(hq, hkv, d, dtype)
    attn.plan_decode(indices_of(table, rows, lens), lens, d ** -0.5)
    out = attn.run(q, k_buf, v_buf)
    want = ref.decode_attention(q.float(), k_buf.float(), v_buf.float(), table[rows], torch.tensor(lens, device=DEV),
                                d ** -0.5)
    for i in range(len(lens)):
        assert rel_err(out[i], want[i]) < 1e-2, i


@needs_flashinfer
@pytest.mark.parametrize("mode", ["extend", "decode"])
@pytest.mark.parametrize("window", [1, 100, 512])
def test_sliding_window_over_the_visible_tail(mode, window):
    gen = fresh_gen()
    d, dtype, hq, hkv = 256, torch.bfloat16, 8, 1  # Gemma 3 270M's heads
    prefixes = [0, 37, 500, 1000, 4000] if mode == "extend" else [0, 99, 511, 2000, 4000]
    extends = [200, 129, 1, 300, 64] if mode == "extend" else [1] * 5
    lens = [p + e for p, e in zip(prefixes, extends)]
    slots, num_slots = paged_slots(lens, 64, gen)
    k_buf, v_buf = random_pool(num_slots, hkv, d, dtype, gen)
    table, rows = table_of(slots)
    q = torch.randn(sum(extends), hq, d, generator=gen, device=DEV).to(dtype)
    seen = fi.visible(window, lens, extends)
    ends = torch.tensor(lens, device=DEV)
    indices = fi.kv_indices(table, rows, ends, sum(seen), ends - torch.tensor(seen, device=DEV))
    attn = make(hq, hkv, d, dtype)
    if mode == "extend":
        attn.plan_extend(indices, extends, seen, d ** -0.5, window)
    else:
        attn.plan_decode(indices, seen, d ** -0.5, window)
    out = attn.run(q, k_buf, v_buf)
    want = ref.extend_attention(q.float(), k_buf.float(), v_buf.float(), slots, extends, d ** -0.5, window)
    starts = [sum(extends[:i]) for i in range(len(extends))]
    for s, e in zip(starts, extends):
        assert rel_err(out[s:s + e], want[s:s + e]) < 1e-2


@needs_flashinfer
@pytest.mark.parametrize("hq,hkv", GROUPS)
def test_decode_graph_replays_what_the_last_plan_put_in_its_buffers(hq, hkv):
    """A graph captured over a wrapper planned for rows of one token, replayed after plans for
    other rows and lengths (longer than at capture), matches the reference each time."""
    gen = fresh_gen()
    d, dtype, bs = 128, torch.bfloat16, 4
    lens_sets = [[3, 700, 64, 1], [2049, 5, 300, 4000]]
    slots, num_slots = paged_slots(lens_sets[0] + lens_sets[1], 64, gen)
    k_buf, v_buf = random_pool(num_slots, hkv, d, dtype, gen)
    table, all_rows = table_of(slots)
    buffers = fi.PagedAttention.graph_buffers(8, 8 * table.shape[1], torch.device(DEV))
    attn = make(hq, hkv, d, dtype, graph_batch=bs, buffers=buffers)
    q = torch.zeros(bs, hq, d, dtype=dtype, device=DEV)
    attn.plan_decode(torch.zeros(bs, dtype=torch.int32, device=DEV), [1] * bs, d ** -0.5)
    attn.run(q, k_buf, v_buf)  # builds the kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attn.run(q, k_buf, v_buf)
    for i, lens in enumerate(lens_sets):
        rows = all_rows[4 * i:4 * i + 4]
        q.copy_(torch.randn(bs, hq, d, generator=gen, device=DEV).to(dtype))
        attn.plan_decode(indices_of(table, rows, lens), lens, d ** -0.5)
        graph.replay()
        want = ref.decode_attention(q.float(), k_buf.float(), v_buf.float(), table[rows],
                                    torch.tensor(lens, device=DEV), d ** -0.5)
        for j in range(bs):
            assert rel_err(out[j], want[j]) < 1e-2, (i, j)


@needs_flashinfer
def test_fp32_is_refused():
    with pytest.raises(ValueError, match="fp16/bf16"):
        make(8, 2, 128, torch.float32)
