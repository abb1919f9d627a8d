"""The fused MoE grouped GEMM (kernels/moe.py) against the torch reference (kernels/experts.py) on
fresh random inputs (on CUDA, or on the CPU under Triton's interpreter: kernel_env), its
expert-sorted alignment, and the model's sparse MLP dispatching to it on CUDA."""
from __future__ import annotations

import kernel_env as env  # first: it may turn on Triton's interpreter
import pytest
import torch

from hicache.kernels.experts import moe_reference

pytestmark = env.kernels
if env.CUDA or env.INTERPRETED:
    from hicache.kernels.moe import Tiles, align, fused_moe

DEV = env.DEV
HALF = env.half(torch.bfloat16)
TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-5}


def _inputs(gen, tokens, hidden, inter, experts, top_k, dtype):
    x = torch.randn(tokens, hidden, generator=gen, device=DEV).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen, device=DEV) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen, device=DEV) / inter ** 0.5).to(dtype)
    probs = torch.randn(tokens, experts, generator=gen, device=DEV).softmax(-1)
    weights, ids = probs.topk(top_k, dim=-1)
    return x, w13, w2, weights / weights.sum(-1, keepdim=True), ids


def rel_err(out, want):
    return float((out.float() - want.float()).norm() / want.float().norm())


@pytest.mark.parametrize("dtype", [HALF, torch.float32])
@pytest.mark.parametrize("tokens,hidden,inter,experts,top_k", env.sizes(
    [(1, 2048, 768, 128, 8), (64, 2048, 768, 128, 8), (700, 4096, 1408, 8, 2), (3, 256, 96, 16, 4)],
    [(1, 64, 32, 8, 2), (13, 64, 48, 4, 2), (40, 32, 16, 16, 4)]))
def test_fused_moe_matches_reference(dtype, tokens, hidden, inter, experts, top_k):
    gen = torch.Generator(DEV).manual_seed(torch.seed() % 2**31)
    x, w13, w2, weights, ids = _inputs(gen, tokens, hidden, inter, experts, top_k, dtype)
    out = fused_moe(x, w13, w2, weights, ids)
    want = moe_reference(x.float(), w13.float(), w2.float(), weights, ids)
    assert out.dtype == dtype and out.shape == x.shape
    assert rel_err(out, want) < TOL[dtype]


@pytest.mark.parametrize("tiles", [(16, 32, 32), (32, 64, 16), (64, 16, 64)])
def test_fused_moe_tiles_agree(tiles):
    gen = torch.Generator(DEV).manual_seed(torch.seed() % 2**31)
    x, w13, w2, weights, ids = _inputs(gen, 9, 64, 48, 8, 3, torch.float32)
    out = fused_moe(x, w13, w2, weights, ids, Tiles(*tiles))
    assert rel_err(out, moe_reference(x, w13, w2, weights, ids)) < 1e-5


@pytest.mark.parametrize("tokens,experts,top_k,block", [(11, 6, 2, 4), (700, 64, 4, 16)])
def test_align_groups_pairs_by_expert_in_whole_blocks(tokens, experts, top_k, block):
    ids = torch.rand(tokens, experts).argsort(dim=-1)[:, :top_k].to(DEV)  # fresh routes, distinct per token
    al = align(ids, experts, block)
    n, used = ids.numel(), int(al.num_padded)
    pairs = al.sorted_pairs[:used].cpu()
    assert sorted(pairs[pairs < n].tolist()) == list(range(n))  # every pair exactly once
    assert bool((al.sorted_pairs[used:] == n).all()) and used % block == 0
    flat = ids.reshape(-1).cpu()
    for b in range(used // block):
        rows = pairs[b * block:(b + 1) * block]
        real = rows[rows < n]
        assert len(real) > 0 and bool((flat[real] == int(al.block_expert[b])).all())


def test_fused_moe_rejects_mismatched_weights():
    gen = torch.Generator(DEV).manual_seed(0)
    x, w13, w2, weights, ids = _inputs(gen, 2, 64, 32, 4, 2, torch.float32)
    with pytest.raises(ValueError, match="w2"):
        fused_moe(x, w13, w2[:, :, :-1], weights, ids)


@env.needs_cuda
def test_sparse_block_uses_the_fused_kernel_on_cuda(monkeypatch):
    from hicache.runtime.model_config import ModelConfig, MoEConfig
    from hicache.runtime.models import moe

    cfg = ModelConfig(vocab_size=8, hidden_size=256, intermediate_size=512, num_layers=1, num_heads=4, num_kv_heads=4,
                      head_dim=64, rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None, max_position_embeddings=64,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_ids=(), architecture="Qwen3MoeForCausalLM",
                      qk_norm=True, moe=MoEConfig(16, 4, 128, True))
    block = moe.SparseMoeBlock(cfg, torch.bfloat16, "cuda")
    gen = torch.Generator("cuda").manual_seed(torch.seed() % 2**31)
    for p in block.parameters():
        p.normal_(0, 0.05, generator=gen)
    x = torch.randn(37, 256, generator=gen, device="cuda").to(torch.bfloat16)
    calls = []
    real = moe._fused_moe()
    monkeypatch.setattr(moe, "_fused_moe", lambda: lambda *a: calls.append(1) or real(*a))
    out = block(x)
    weights, ids = block.route(x)
    want = moe_reference(x.float(), block.w13.float(), block.w2.float(), weights.float(), ids)
    assert calls and rel_err(out, want) < 2e-2
