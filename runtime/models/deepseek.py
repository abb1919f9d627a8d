"""DeepSeek-V2 and V3 decoder (HF DeepseekV2ForCausalLM, DeepseekV3ForCausalLM), built from
llama.py's pieces; V3 differs by its routing only (`MoEConfig.routing`).

What differs from Llama: multi-head latent attention (`MLAttention`): q through a low-rank
projection with an RMSNorm (`q_lora_rank`; V2-Lite projects q directly), one latent per token
(`kv_a_proj_with_mqa`, RMS-normalised) from which `kv_b_proj` up-projects every head's K and V,
and a RoPE key shared by the heads; RoPE rotates interleaved pairs (2i, 2i+1) of the RoPE part
only, with YaRN scaling when configured. The first `first_k_dense_replace` layers run a dense
MLP, the others DeepSeek's MoE (`moe.DeepseekMoeBlock`: group-limited top-k of the router softmax,
scaled by `routed_scaling_factor`, plus ungated shared experts).

Contract with the latent attention backend (`runtime/attention/latent.py`): each layer calls
`batch.attn.forward(q, latent, layer_id, batch)` with the absorbed query q [T, H, kv_lora_rank +
qk_rope_head_dim] (the no-RoPE part of q multiplied into the latent space by kv_b's key rows) and
latent [T, kv_lora_rank + qk_rope_head_dim] (normed latent, then the rotated key); the backend
caches the latent and returns [T, H, kv_lora_rank]: the attention-weighted latents, which kv_b's
value rows turn into each head's output.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hicache.runtime.model_config import ModelConfig
from hicache.runtime.models.layers import RMSNorm, RotaryEmbedding, linear
from hicache.runtime.models.llama import LlamaDecoderLayer, LlamaForCausalLM, make_mlp
from hicache.runtime.models.moe import DeepseekMoeBlock
from hicache.runtime.models.sharding import Index, index, scaled, sharded_param
from hicache.runtime.parallel import SINGLE, TensorParallel


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by position as interleaved pairs (x[2i], x[2i+1]) (HF's complex
    rotation); cos and sin [T, 1, D/2] fp32."""
    pairs = x.float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2).to(x.dtype)


class MLAttention(nn.Module):
    """Multi-head latent attention over one cached latent per token (see the module docstring).
    Under tensor parallelism each rank holds its heads' rows of q_b (or q) and kv_b and their
    columns of o_proj, summed over the ranks; the latent's projections and norms are whole on
    every rank, and so is the cached latent."""

    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype, device: torch.device | str,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        mla, h, full_heads = config.mla, config.hidden_size, config.num_heads
        heads = tp.shard(full_heads, "num_heads")
        self.layer_id, self.mla, self.tp, self.num_heads = layer_id, mla, tp, heads.stop - heads.start
        kv_b_width = mla.qk_nope_head_dim + mla.v_head_dim
        self.parts = {"q": index(tp, scaled(heads, mla.qk_head_dim)), "kv_b": index(tp, scaled(heads, kv_b_width)),
                      "o": index(tp, slice(None), scaled(heads, mla.v_head_dim))}

        def param(*shape: int, part: str | None = None) -> nn.Parameter:
            return sharded_param(shape, self.parts[part] if part else (), dtype, device)

        q_out = full_heads * mla.qk_head_dim
        if mla.q_lora_rank is None:
            self.q_proj = param(q_out, h, part="q")
            self.LINEARS = ("q_proj", "kv_a_proj", "o_proj")
        else:
            self.q_a_proj, self.q_b_proj = param(mla.q_lora_rank, h), param(q_out, mla.q_lora_rank, part="q")
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, config.rms_norm_eps, dtype, device)
            self.LINEARS = ("q_a_proj", "q_b_proj", "kv_a_proj", "o_proj")
        self.kv_a_proj = param(mla.latent_dim, h)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, config.rms_norm_eps, dtype, device)
        self.kv_b_proj = param(full_heads * kv_b_width, mla.kv_lora_rank, part="kv_b")
        self.o_proj = param(h, full_heads * mla.v_head_dim, part="o")
        self.packs: dict[str, Any] = {}

    def query(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H, qk_head_dim]."""
        if self.mla.q_lora_rank is None:
            q = linear(x, self.q_proj, self.packs.get("q_proj"))
        else:
            q = linear(self.q_a_layernorm(linear(x, self.q_a_proj, self.packs.get("q_a_proj"))), self.q_b_proj,
                       self.packs.get("q_b_proj"))
        return q.view(x.shape[0], self.num_heads, self.mla.qk_head_dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, batch: Any) -> torch.Tensor:
        mla, T = self.mla, x.shape[0]
        q_nope, q_pe = self.query(x).split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent, k_pe = linear(x, self.kv_a_proj, self.packs.get("kv_a_proj")).split(
            [mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        rope.cover(positions)
        cos, sin = rope.cos_sin.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
        q_pe, k_pe = rotate_pairs(q_pe, cos, sin), rotate_pairs(k_pe.unsqueeze(1), cos, sin)[:, 0]
        kv_b = self.kv_b_proj.view(self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        w_k, w_v = kv_b.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=1)
        q = torch.cat([torch.einsum("thn,hnc->thc", q_nope, w_k), q_pe], dim=-1)
        cached = torch.cat([self.kv_a_layernorm(latent.contiguous()), k_pe], dim=-1)
        out = batch.attn.forward(q, cached, self.layer_id, batch)  # [T, H, kv_lora_rank]
        out = torch.einsum("thc,hvc->thv", out, w_v).reshape(T, self.num_heads * mla.v_head_dim)
        return self.tp.all_reduce(linear(out, self.o_proj, self.packs.get("o_proj")))

    def targets(self) -> dict[str, tuple[torch.Tensor, Index]]:
        """`self_attn.<name>` -> (the parameter it fills, the part of the checkpoint tensor this
        rank reads)."""
        p = self.parts
        table = {"kv_a_proj_with_mqa.weight": (self.kv_a_proj, ()),
                 "kv_a_layernorm.weight": (self.kv_a_layernorm.weight, ()),
                 "kv_b_proj.weight": (self.kv_b_proj, p["kv_b"]), "o_proj.weight": (self.o_proj, p["o"])}
        if self.mla.q_lora_rank is None:
            return table | {"q_proj.weight": (self.q_proj, p["q"])}
        return table | {"q_a_proj.weight": (self.q_a_proj, ()), "q_a_layernorm.weight": (self.q_a_layernorm.weight, ()),
                        "q_b_proj.weight": (self.q_b_proj, p["q"])}


class DeepseekV2DecoderLayer(LlamaDecoderLayer):
    """Llama's block (its forward) around MLA and DeepSeek's MLP."""

    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype, device: torch.device | str,
                 tp: TensorParallel = SINGLE):
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.self_attn = MLAttention(config, layer_id, dtype, device, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.mlp = make_mlp(config, layer_id, dtype, device, tp, sparse=DeepseekMoeBlock)


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    """The whole model; weights as LlamaForCausalLM's (HF names). Its KV pool holds one latent per
    token and layer (`ModelConfig.cache_heads`, `cache_head_dim`)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 tp: TensorParallel = SINGLE):
        nn.Module.__init__(self)
        self.init_common(config, dtype, device, tp)
        self.layers = nn.ModuleList(DeepseekV2DecoderLayer(config, i, dtype, device, tp)
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.rotary_emb = RotaryEmbedding(config)
        self.num_heads, self.num_kv_heads = self.layers[0].self_attn.num_heads, config.cache_heads
