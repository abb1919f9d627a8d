"""Gemma 3 text decoder (HF Gemma3ForCausalLM, GGUF `gemma3`), built from llama.py's pieces.

What differs from Llama: RMSNorm scales by (1 + weight), in fp32; q and k are RMS-normalised per
head before RoPE; windowed layers (`ModelConfig.layer_windows`) rotate with their own base
(`rope_local_theta`, plain RoPE), full layers with `rope_theta` and the config's scaling; the MLP
is GeGLU (tanh GELU); each block has norms after attention and after the MLP as well as before;
embeddings are scaled by sqrt(hidden); the attention scale is query_pre_attn_scalar**-0.5 and
each layer's window is known to the attention backend (runtime/build.py makes it with
`ModelConfig.attn_scale` and `layer_windows`); final logits are soft-capped when configured.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hicache.runtime.model_config import ModelConfig
from hicache.runtime.models.layers import RotaryEmbedding, linear
from hicache.runtime.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from hicache.runtime.models.sharding import vocab_embedding
from hicache.runtime.parallel import SINGLE, TensorParallel

_EXTRA_LAYER_NAMES = ("pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight")


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), computed in fp32 and cast back (as HF's Gemma3RMSNorm)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class RotaryPair(nn.Module):
    """The full layers' RoPE and the windowed layers' RoPE; `ensure` grows both."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.full = RotaryEmbedding(config)
        self.local = RotaryEmbedding(replace(config, rope_theta=config.rope_local_theta or config.rope_theta,
                                             rope_scaling=None))

    def ensure(self, num_positions: int, device: torch.device | str | None = None) -> None:
        self.full.ensure(num_positions, device)
        self.local.ensure(num_positions, device)


class Gemma3Attention(LlamaAttention):
    """The shared attention (its config has `qk_norm`) with Gemma's (1 + weight) q/k norms."""

    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype, device: torch.device | str,
                 tp: TensorParallel = SINGLE):
        super().__init__(config, layer_id, dtype, device, tp)
        self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)
        self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, batch: Any) -> torch.Tensor:
        T = x.shape[0]
        qkv = linear(x, self.qkv_proj, self.packs.get("qkv_proj"))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.view(T, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(T, self.num_kv_heads, self.head_dim))
        q, k = rope(positions, q, k)
        out = batch.attn.forward(q, k, v.view(T, self.num_kv_heads, self.head_dim), self.layer_id, batch)
        return self.tp.all_reduce(linear(out.reshape(T, self.q_size), self.o_proj, self.packs.get("o_proj")))


class GegluMLP(LlamaMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear(x, self.gate_up_proj, self.packs.get("gate_up_proj")).chunk(2, dim=-1)
        return self.reduced(linear(F.gelu(gate, approximate="tanh") * up, self.down_proj, self.packs.get("down_proj")))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype, device: torch.device | str,
                 tp: TensorParallel):
        super().__init__()
        norm = lambda: GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.self_attn = Gemma3Attention(config, layer_id, dtype, device, tp)
        self.mlp = GegluMLP(config, dtype, device, tp=tp)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, batch: Any) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), positions, rope, batch))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3ForCausalLM(LlamaForCausalLM):
    """The whole model; weights as LlamaForCausalLM's (HF names, fused on load), norm weights
    start at 0 (a unit scale)."""

    NORM_INIT = 0.0  # weights/dummy.py: what norm weights of random models are set to

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 tp: TensorParallel = SINGLE):
        nn.Module.__init__(self)
        self.init_common(config, dtype, device, tp)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i, dtype, device, tp) for i in range(config.num_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.rotary_emb = RotaryPair(config)
        self.num_heads, self.num_kv_heads = self.layers[0].self_attn.num_heads, self.layers[0].self_attn.num_kv_heads
        self.embed_scale = float(torch.tensor(config.hidden_size ** 0.5, dtype=dtype))  # rounded to dtype, as HF

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: Any) -> torch.Tensor:
        """As LlamaForCausalLM.forward: [T] ids and positions -> [T, hidden] after the final norm."""
        x = vocab_embedding(input_ids, self.embed_tokens, self.vocab, self.tp) * self.embed_scale
        for layer, window in zip(self.layers, self.config.layer_windows):
            x = layer(x, positions, self.rotary_emb.local if window else self.rotary_emb.full, batch)
        return self.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def expected_weight_names(self) -> set[str]:
        extra = {f"model.layers.{i}.{s}" for i in range(self.config.num_layers) for s in _EXTRA_LAYER_NAMES}
        return super().expected_weight_names() | extra

    def _target(self, name: str) -> tuple[torch.Tensor, tuple] | None:
        m = self._LAYER_RE.match(name)
        if m is None or int(m.group(1)) >= self.config.num_layers or m.group(2) not in _EXTRA_LAYER_NAMES:
            return super()._target(name)
        return self.layers[int(m.group(1))].get_submodule(m.group(2).rsplit(".", 1)[0]).weight, ()
