"""Qwen3-Next decoder (HF Qwen3NextForCausalLM): gated DeltaNet layers, which hold a recurrent
state per request instead of KV, between gated attention layers (`ModelConfig.layer_types`).

What differs from Llama: RMSNorms scale by (1 + weight) in fp32 (Gemma's); an attention layer's
q_proj yields each head's query and an output gate (the attention output is multiplied by its
sigmoid), q and k are RMS-normalised per head, and RoPE rotates the first `rotary_dim` dims of a
head only. A linear-attention layer (`GatedDeltaNet`) projects q, k, v, an output gate z, and per
value head a write strength beta and a decay g; q, k and v pass through a causal depthwise
convolution (SiLU), q and k are L2-normalised, and each value head's state S [key_head_dim,
value_head_dim] follows the gated delta rule per token: S <- exp(g) S, then
S <- S + k (beta (v - S^T k))^T, with output S^T q / sqrt(key_head_dim); an RMSNorm gated by
SiLU(z) and out_proj follow. The MLP is Qwen2-MoE's (a sigmoid-gated shared expert) on the
layers the MoE config names, SwiGLU elsewhere.

Contract with the runner: the attention layers call `batch.attn.forward(q, k, v, kv_layer, batch)`
(llama.py's contract) with `kv_layer` their index among the attention layers, the KV pool's
layers. The recurrent layers read and write `batch.states` (`runtime/batch.py: RecurrentBatch`):
each request's working state slot in the state pool (`tiers/gpu/state.py`), which holds the state
after the tokens before its chunk and holds the state after its chunk once the pass has run,
and the snapshots to take: the state after a given token of a chunk copied into another slot.
The computation is the torch reference (a loop over a chunk's tokens; decode batched over the
requests), in fp32 for the delta rule as HF's.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hicache.runtime.model_config import LINEAR, ModelConfig
from hicache.runtime.models.gemma3 import GemmaRMSNorm
from hicache.runtime.models.layers import RotaryEmbedding, linear
from hicache.runtime.models.llama import LlamaForCausalLM, make_mlp
from hicache.runtime.models.sharding import Index, sharded_param, vocab_embedding
from hicache.runtime.parallel import SINGLE, TensorParallel


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return sharded_param(shape, (), dtype, device)


class GatedAttention(nn.Module):
    """Full attention with an output gate, per-head (1 + weight) q/k norms and partial RoPE."""

    LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")

    def __init__(self, config: ModelConfig, kv_layer: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.kv_layer, self.head_dim = kv_layer, config.head_dim
        self.num_heads, self.num_kv_heads, self.rotary_dim = config.num_heads, config.num_kv_heads, config.rotary_dim
        h = config.hidden_size
        self.q_proj = _param((2 * config.q_size, h), dtype, device)  # per head: its query, then its gate
        self.k_proj = _param((config.kv_size, h), dtype, device)
        self.v_proj = _param((config.kv_size, h), dtype, device)
        self.o_proj = _param((h, config.q_size), dtype, device)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, dtype, device)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, dtype, device)
        self.packs: dict[str, Any] = {}

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, batch: Any) -> torch.Tensor:
        T, D, r = x.shape[0], self.head_dim, self.rotary_dim
        q, gate = linear(x, self.q_proj, self.packs.get("q_proj")).view(T, self.num_heads, 2 * D).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(linear(x, self.k_proj, self.packs.get("k_proj")).view(T, self.num_kv_heads, D))
        v = linear(x, self.v_proj, self.packs.get("v_proj")).view(T, self.num_kv_heads, D)
        q_rot, k_rot = rope(positions, q[..., :r].contiguous(), k[..., :r].contiguous())
        q, k = torch.cat([q_rot, q[..., r:]], dim=-1), torch.cat([k_rot, k[..., r:]], dim=-1)
        out = batch.attn.forward(q, k, v, self.kv_layer, batch).reshape(T, self.num_heads * D)
        out = out * torch.sigmoid(gate.reshape(T, -1))
        return linear(out, self.o_proj, self.packs.get("o_proj"))

    def targets(self) -> dict[str, tuple[torch.Tensor, Index]]:
        """`self_attn.<name>` -> (the parameter it fills, the part of the tensor read: all)."""
        return {"q_proj.weight": (self.q_proj, ()), "k_proj.weight": (self.k_proj, ()),
                "v_proj.weight": (self.v_proj, ()), "o_proj.weight": (self.o_proj, ()),
                "q_norm.weight": (self.q_norm.weight, ()), "k_norm.weight": (self.k_norm.weight, ())}


def delta_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule, fp32: state [..., H, dk, dv], q and k [..., H, dk]
    (normalised, q scaled), v [..., H, dv], g and beta [..., H]. Returns (output [..., H, dv],
    the new state)."""
    state = state * g.exp()[..., None, None]
    remembered = (state * k[..., None]).sum(-2)
    state = state + k[..., None] * ((v - remembered) * beta[..., None])[..., None, :]
    return (state * q[..., None]).sum(-2), state


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


class GatedDeltaNet(nn.Module):
    """A linear-attention layer over its slice of the state pool (`state_layer`)."""

    LINEARS = ("in_proj_qkvz", "in_proj_ba", "out_proj")

    def __init__(self, config: ModelConfig, state_layer: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        lin, h = config.linear, config.hidden_size
        self.lin, self.state_layer, self.eps = lin, state_layer, config.rms_norm_eps
        self.in_proj_qkvz = _param((2 * lin.key_dim + 2 * lin.value_dim, h), dtype, device)
        self.in_proj_ba = _param((2 * lin.num_value_heads, h), dtype, device)
        self.conv1d = _param((lin.conv_dim, 1, lin.conv_kernel), dtype, device)
        self.dt_bias = _param((lin.num_value_heads,), dtype, device)
        self.A_log = _param((lin.num_value_heads,), dtype, device)
        self.norm = _param((lin.value_head_dim,), dtype, device)
        self.out_proj = _param((h, lin.value_dim), dtype, device)
        self.packs: dict[str, Any] = {}

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(q, k and v of each token as the convolution's channels [T, conv_dim], z [T, Hv, dv],
        beta [T, Hv] and g [T, Hv] fp32), from the projections' grouped layout (per key head:
        its q, k, then the v and z of its value heads; its value heads' b, then their a)."""
        lin, T = self.lin, x.shape[0]
        r = lin.num_value_heads // lin.num_key_heads
        qkvz = linear(x, self.in_proj_qkvz, self.packs.get("in_proj_qkvz")).view(T, lin.num_key_heads, -1)
        ba = linear(x, self.in_proj_ba, self.packs.get("in_proj_ba")).view(T, lin.num_key_heads, 2 * r)
        q, k, v, z = qkvz.split([lin.key_head_dim, lin.key_head_dim, r * lin.value_head_dim,
                                 r * lin.value_head_dim], dim=-1)
        b, a = ba.split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
        g = -self.A_log.float().exp() * F.softplus(a.reshape(T, -1).float() + self.dt_bias)
        return mixed, z.reshape(T, lin.num_value_heads, lin.value_head_dim), b.reshape(T, -1).sigmoid(), g

    def rule_inputs(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolution's output [..., conv_dim] as the delta rule's fp32 q, k [..., Hv, dk]
        (each key head repeated for its value heads, L2-normalised, q scaled) and v [..., Hv, dv]."""
        lin = self.lin
        q, k, v = conv_out.float().split([lin.key_dim, lin.key_dim, lin.value_dim], dim=-1)
        r = lin.num_value_heads // lin.num_key_heads
        q, k = (t.unflatten(-1, (lin.num_key_heads, lin.key_head_dim)).repeat_interleave(r, dim=-2) for t in (q, k))
        return _l2norm(q) * lin.key_head_dim ** -0.5, _l2norm(k), v.unflatten(-1, (lin.num_value_heads, -1))

    def forward(self, x: torch.Tensor, batch: Any) -> torch.Tensor:
        mixed, z, beta, g = self.project(x)
        states = batch.states
        conv, ssm = states.pool.conv[self.state_layer], states.pool.ssm[self.state_layer]
        if batch.mode == "decode":
            out = self.decode(mixed, beta, g, conv, ssm, states)
        else:
            ends = torch.tensor(batch.extend_lens).cumsum(0).tolist()
            out = torch.cat([self.extend(mixed[e - n:e], beta[e - n:e], g[e - n:e], conv, ssm, states.slots[i],
                                         states.snapshots_of(i))
                             for i, (e, n) in enumerate(zip(ends, batch.extend_lens))])
        return linear(self.gated_norm(out.to(x.dtype), z).flatten(1), self.out_proj, self.packs.get("out_proj"))

    def extend(self, mixed: torch.Tensor, beta: torch.Tensor, g: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor,
               slot: int, snapshots: dict[int, list[int]]) -> torch.Tensor:
        """One request's chunk of n tokens from its state in `slot`, which it leaves holding the
        state after the chunk; `snapshots`: token offset -> the slots that get the state after it."""
        n, K = mixed.shape[0], self.lin.conv_kernel
        window = torch.cat([conv[slot], mixed.t().to(conv.dtype)], dim=-1)  # [conv_dim, K - 1 + n]
        conv_out = F.silu(F.conv1d(window[None], self.conv1d, groups=window.shape[0])[0]).t()
        q, k, v = self.rule_inputs(conv_out)
        state, outs = ssm[slot].clone(), []
        for t in range(n):
            out, state = delta_step(state, q[t], k[t], v[t], g[t], beta[t])
            outs.append(out)
            for dst in snapshots.get(t, ()):
                conv[dst].copy_(window[:, t + 1:t + K])
                ssm[dst].copy_(state)
        conv[slot].copy_(window[:, n:])
        ssm[slot].copy_(state)
        return torch.stack(outs)

    def decode(self, mixed: torch.Tensor, beta: torch.Tensor, g: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor,
               states: Any) -> torch.Tensor:
        """One token of every request, batched."""
        slots = states.slots_dev
        window = torch.cat([conv[slots], mixed.to(conv.dtype)[:, :, None]], dim=-1)  # [N, conv_dim, K]
        conv_out = F.silu((window * self.conv1d[:, 0]).sum(-1))
        q, k, v = self.rule_inputs(conv_out)
        out, state = delta_step(ssm[slots], q, k, v, g, beta)
        conv[slots], ssm[slots] = window[:, :, 1:], state
        for i, _, dst in states.snapshots:
            conv[dst].copy_(window[i, :, 1:])
            ssm[dst].copy_(state[i])
        return out

    def gated_norm(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Per value head: RMSNorm (fp32, cast back, scaled) times SiLU(z) in fp32, cast back."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.norm * xf.to(x.dtype) * F.silu(z.float())).to(x.dtype)

    def targets(self) -> dict[str, tuple[torch.Tensor, Index]]:
        """`linear_attn.<name>` -> (the parameter it fills, the part of the tensor read: all)."""
        return {"in_proj_qkvz.weight": (self.in_proj_qkvz, ()), "in_proj_ba.weight": (self.in_proj_ba, ()),
                "conv1d.weight": (self.conv1d, ()), "dt_bias": (self.dt_bias, ()), "A_log": (self.A_log, ()),
                "norm.weight": (self.norm, ()), "out_proj.weight": (self.out_proj, ())}


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, mixer_index: int, dtype: torch.dtype,
                 device: torch.device | str):
        """`mixer_index`: the layer's index among the layers of its kind (the state pool's layers
        for a linear-attention layer, the KV pool's for an attention layer)."""
        super().__init__()
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.recurrent = config.layer_types[layer_id] == LINEAR
        self.mixer_name = "linear_attn" if self.recurrent else "self_attn"
        mixer = (GatedDeltaNet if self.recurrent else GatedAttention)(config, mixer_index, dtype, device)
        setattr(self, self.mixer_name, mixer)
        self.mixer = mixer
        self.mlp = make_mlp(config, layer_id, dtype, device)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, batch: Any) -> torch.Tensor:
        normed = self.input_layernorm(x)
        x = x + (self.mixer(normed, batch) if self.recurrent else self.mixer(normed, positions, rope, batch))
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3NextForCausalLM(LlamaForCausalLM):
    """The whole model; weights as LlamaForCausalLM's (HF names, `linear_attn.*` for the recurrent
    layers). Its KV pool holds the attention layers only (`ModelConfig.kv_layers`); the
    recurrent layers' states live in the state pool. One rank only."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 tp: TensorParallel = SINGLE):
        if tp.sharded:
            raise ValueError("Qwen3-Next is not supported with tp_size > 1")
        nn.Module.__init__(self)
        self.init_common(config, dtype, device, tp)
        recurrent = config.recurrent_layers
        self.layers = nn.ModuleList(
            Qwen3NextDecoderLayer(config, i, recurrent.index(i) if i in recurrent else
                                  i - sum(1 for j in recurrent if j < i), dtype, device)
            for i in range(config.num_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.rotary_emb = RotaryEmbedding(replace(config, head_dim=config.rotary_dim or config.head_dim))
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: Any) -> torch.Tensor:
        x = vocab_embedding(input_ids, self.embed_tokens, self.vocab, self.tp)
        for layer in self.layers:
            x = layer(x, positions, self.rotary_emb, batch)
        return self.norm(x)

    def expected_weight_names(self) -> set[str]:
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if not self.config.tie_word_embeddings:
            names.add("lm_head.weight")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            names |= {p + s for s in ("input_layernorm.weight", "post_attention_layernorm.weight")}
            names |= {f"{p}{layer.mixer_name}.{s}" for s in layer.mixer.targets()}
            names |= {p + "mlp." + s for s in layer.mlp.weight_names()}
        return names

    def _target(self, name: str) -> tuple[torch.Tensor, Index] | None:
        m = self._LAYER_RE.match(name)
        if m is None or int(m.group(1)) >= self.config.num_layers:
            return super()._target(name)
        layer, rest = self.layers[int(m.group(1))], m.group(2)
        mixer, _, tail = rest.partition(".")
        if mixer in ("linear_attn", "self_attn"):
            return layer.mixer.targets().get(tail) if mixer == layer.mixer_name else None
        return super()._target(name)
