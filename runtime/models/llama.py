"""Llama-family decoder: Llama 2/3/3.1, Mistral (sliding window in the attention backend), SmolLM2, Qwen2/2.5, Qwen3,
and the mixtures of experts Qwen2-MoE, Qwen3-MoE and Mixtral.

Our own implementation (the norms, RoPE and linears in `models/layers.py`): GQA attention
through a pluggable backend, SwiGLU MLP or a sparse MLP (`models/moe.py`), optional tied
embeddings. The families differ by config options only (`ModelConfig.qkv_bias`, `qk_norm`,
`moe`): a Llama layer runs exactly the Llama code. Weights are fused on load (q/k/v into
`qkv_proj`, gate/up into `gate_up_proj`); `load_weights` takes HF-named tensors.

Contract with the attention backend (runtime/attention/): each layer calls
`batch.attn.forward(q, k, v, layer_id, batch)` with q [T, num_heads, head_dim] and k, v
[T, num_kv_heads, head_dim] in the model dtype, on the model device, RoPE already applied to q and
k; q and k are contiguous, v may be a strided view (last dim contiguous). The backend stores k/v in
the KV pool, attends with scale head_dim**-0.5 and returns [T, num_heads, head_dim].
"""
from __future__ import annotations

import re
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from hicache.runtime.model_config import ModelConfig
from hicache.runtime.models.layers import RMSNorm, RotaryEmbedding, cpu_kernels, cuda_kernels, repack, linear
from hicache.runtime.models.moe import SparseMoeBlock, covered_names, hf_name
from hicache.runtime.models.sharding import Index, fused_rows, index, scaled, sharded_param, take, vocab_embedding
from hicache.runtime.parallel import SINGLE, TensorParallel


class LlamaAttention(nn.Module):
    """Column-parallel q/k/v (this rank's query heads and the KV heads they read), row-parallel
    o_proj summed over the ranks; the per-head q/k norms are whole on every rank."""

    LINEARS = ("qkv_proj", "o_proj")  # the weights `use_cpu_kernels` prepacks into `packs`

    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype, device: torch.device | str,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        self.layer_id, self.tp, self.head_dim = layer_id, tp, config.head_dim
        heads, kv_heads = tp.shard(config.num_heads, "num_heads"), tp.kv_heads(config.num_kv_heads)
        self.num_heads, self.num_kv_heads = heads.stop - heads.start, kv_heads.stop - kv_heads.start
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q_rows, kv_rows = scaled(heads, self.head_dim), scaled(kv_heads, self.head_dim)
        blocks = [(config.q_size, q_rows), (config.kv_size, kv_rows), (config.kv_size, kv_rows)]
        self.parts = {"q": index(tp, q_rows), "k": index(tp, kv_rows), "v": index(tp, kv_rows),
                      "o": index(tp, slice(None), q_rows)}  # of the checkpoint's q/k/v/o_proj
        fused = index(tp, fused_rows(blocks))
        full_qkv = config.q_size + 2 * config.kv_size
        self.qkv_proj = sharded_param((full_qkv, config.hidden_size), fused, dtype, device)
        self.o_proj = sharded_param((config.hidden_size, config.q_size), self.parts["o"], dtype, device)
        self.qkv_bias = sharded_param((full_qkv,), fused, dtype, device) if config.qkv_bias else None
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device) if config.qk_norm else None
        self.packs: dict[str, Any] = {}
        q, kv = self.q_size, self.kv_size  # the LoRA targets' columns of qkv_proj (runtime/lora/batch.py)
        self.lora_columns = (("q_proj", 0, q), ("k_proj", q, q + kv), ("v_proj", q + kv, q + 2 * kv))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, batch: Any) -> torch.Tensor:
        """`batch.lora`, where set (a `LoraBatch`), adds its adapters' deltas to q/k/v and o_proj."""
        T = x.shape[0]
        lora = getattr(batch, "lora", None)
        qkv = linear(x, self.qkv_proj, self.packs.get("qkv_proj"))
        if lora is not None:
            lora.add(qkv, x, self.layer_id, self.lora_columns)
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = q.view(T, self.num_heads, self.head_dim), k.view(T, self.num_kv_heads, self.head_dim)
        q, k = rope(positions, q, k, None if self.q_norm is None else (self.q_norm, self.k_norm))
        out = batch.attn.forward(q, k, v.view(T, self.num_kv_heads, self.head_dim), self.layer_id, batch).reshape(
            T, self.q_size)
        o = linear(out, self.o_proj, self.packs.get("o_proj"))
        if lora is not None:
            lora.add(o, out, self.layer_id, (("o_proj", 0, o.shape[1]),))
        return self.tp.all_reduce(o)

    def targets(self) -> dict[str, tuple[torch.Tensor, Index]]:
        """`self_attn.<name>` -> (the parameter or the rows of a fused one it fills, the part of
        the checkpoint tensor this rank reads)."""
        table = {"o_proj.weight": (self.o_proj, self.parts["o"])}
        for suffix, fused in (("weight", self.qkv_proj), ("bias", self.qkv_bias)):
            if fused is not None:
                table |= {f"{p}_proj.{suffix}": (part, self.parts[p])
                          for p, part in zip("qkv", fused.split([self.q_size, self.kv_size, self.kv_size]))}
        if self.q_norm is not None:
            table |= {"q_norm.weight": (self.q_norm.weight, ()), "k_norm.weight": (self.k_norm.weight, ())}
        return table


class LlamaMLP(nn.Module):
    """Column-parallel gate/up, row-parallel down_proj (this rank's share of the intermediate
    dimension), summed over the ranks unless `reduce` is False (a shared expert, which the sparse
    MLP sums with the routed experts)."""

    LINEARS = ("gate_up_proj", "down_proj")
    cpu: Any = None

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                 intermediate_size: int | None = None, tp: TensorParallel = SINGLE, reduce: bool = True):
        super().__init__()
        full = intermediate_size or config.intermediate_size
        part = tp.shard(full, "intermediate_size" if intermediate_size is None else "shared_expert_intermediate_size")
        self.tp, self.reduce, self.intermediate_size = tp, reduce, part.stop - part.start
        self.parts = {"gate": index(tp, part), "up": index(tp, part), "down": index(tp, slice(None), part)}
        fused = index(tp, fused_rows([(full, part), (full, part)]))
        self.gate_up_proj = sharded_param((2 * full, config.hidden_size), fused, dtype, device)
        self.down_proj = sharded_param((config.hidden_size, full), self.parts["down"], dtype, device)
        self.packs: dict[str, Any] = {}

    def forward(self, x: torch.Tensor, lora: Any = None, layer_id: int = 0) -> torch.Tensor:
        """With `lora` (a `LoraBatch`), its adapters' deltas of layer `layer_id`'s gate/up/down."""
        gate_up = linear(x, self.gate_up_proj, self.packs.get("gate_up_proj"))
        if lora is not None:
            i = self.intermediate_size
            lora.add(gate_up, x, layer_id, (("gate_proj", 0, i), ("up_proj", i, 2 * i)))
        h = self.silu_mul(gate_up)
        down = linear(h, self.down_proj, self.packs.get("down_proj"))
        if lora is not None:
            lora.add(down, h, layer_id, (("down_proj", 0, down.shape[1]),))
        return self.reduced(down)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.cpu is not None and gate_up.dim() == 2:
            return self.cpu.silu_mul(gate_up)
        if gate_up.is_cuda and gate_up.dim() == 2 and cuda_kernels() is not None:
            return cuda_kernels().silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def reduced(self, out: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(out) if self.reduce else out

    def weight_names(self) -> list[str]:
        return ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]

    def target(self, rest: str) -> tuple[torch.Tensor, Index] | None:
        """(The parameter or the slice of one that the tensor `mlp.<rest>` fills, the part of it
        this rank reads.)"""
        i, p = self.intermediate_size, self.parts
        return {"gate_proj.weight": (self.gate_up_proj[:i], p["gate"]),
                "up_proj.weight": (self.gate_up_proj[i:], p["up"]),
                "down_proj.weight": (self.down_proj, p["down"])}.get(rest)


def make_mlp(config: ModelConfig, layer_id: int, dtype: torch.dtype, device: torch.device | str,
             tp: TensorParallel = SINGLE, sparse: type[SparseMoeBlock] = SparseMoeBlock) -> nn.Module:
    """A dense SwiGLU MLP, or the sparse MLP (`sparse`) on the layers the MoE config names."""
    moe = config.moe
    if moe is None or not moe.is_sparse(layer_id):
        return LlamaMLP(config, dtype, device, tp=tp)
    shared = (LlamaMLP(config, dtype, device, moe.shared_intermediate_size, tp=tp, reduce=False)
              if moe.shared_intermediate_size else None)
    return sparse(config, dtype, device, shared, tp)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype, device: torch.device | str,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.self_attn = LlamaAttention(config, layer_id, dtype, device, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.mlp = make_mlp(config, layer_id, dtype, device, tp)

    def forward(self, x: torch.Tensor, normed: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream entering the layer; normed: input_layernorm(x). Returns (stream
        after attention, MLP output): the caller adds the two with the next norm (one launch)."""
        x, normed = self.post_attention_layernorm.add_forward(x, self.self_attn(normed, positions, rope, batch))
        lora = getattr(batch, "lora", None)  # (LoRA adapters are served on dense MLPs only)
        return x, self.mlp(normed) if lora is None else self.mlp(normed, lora, self.self_attn.layer_id)


class LlamaForCausalLM(nn.Module):
    """The whole model. Parameters are created uninitialised (torch.empty) in `dtype` on `device`;
    fill them with `load_weights` or a random init (weights/dummy.py). Norm weights start at 1.

    With `tp` of size > 1 the model holds this rank's share (models/sharding.py): its query and KV
    heads (`num_heads`, `num_kv_heads`: what its KV pool and attention backend are sized for), its
    share of every MLP's intermediate dimension and of the vocabulary (embedding and LM head)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 tp: TensorParallel = SINGLE):
        super().__init__()
        self.init_common(config, dtype, device, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, dtype, device, tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.rotary_emb = RotaryEmbedding(config)
        self.num_heads, self.num_kv_heads = self.layers[0].self_attn.num_heads, self.layers[0].self_attn.num_kv_heads

    def init_common(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                    tp: TensorParallel) -> None:
        """What every family sets first: config, dtype, device, tp and the vocabulary-parallel
        embedding and LM head."""
        self.config, self.dtype, self.device, self.tp = config, dtype, torch.device(device), tp
        self.vocab = tp.shard(config.vocab_size, "vocab_size")
        full = (config.vocab_size, config.hidden_size)
        self.embed_tokens = sharded_param(full, index(tp, self.vocab), dtype, device)
        self.lm_head = self.embed_tokens if config.tie_word_embeddings else sharded_param(
            full, index(tp, self.vocab), dtype, device)
        self.packs: dict[str, Any] = {}  # use_cpu_kernels: the prepacked lm_head

    def use_cpu_kernels(self, on: bool = True, quantized: bool = True) -> bool:
        """Runs the layers' RMSNorm, RoPE and SiLU-mul on the compiled CPU kernels
        (`hicache.kernels.cpu`) and the linears through oneDNN on weights prepacked now, or, with
        `on` False, back on torch ops. Only a CPU model of float32 or bfloat16 turns them on, and
        only where the kernels build; returns whether they are on. A packed weight replaces its
        parameter's data (left empty, restored when turned off), but for a tied lm_head, which the
        embedding still reads. With `quantized`, linears of few rows (decode) read the weights
        from GGUF blocks that hold them exactly (float32 weights dequantised from Q4_1 or Q8_0
        tensors), several times fewer bytes. Call it once the weights are final: `load_weights`
        turns it off."""
        kernels = cpu_kernels() if on and self.device.type == "cpu" and self.dtype in (
            torch.float32, torch.bfloat16) else None
        for module in self.modules():
            if isinstance(module, (RMSNorm, RotaryEmbedding, LlamaMLP)):
                module.cpu = kernels
            if hasattr(module, "LINEARS"):
                repack(module, module.LINEARS, kernels, quantized=quantized)
        repack(self, ("lm_head",), kernels, keep=self.config.tie_word_embeddings, quantized=quantized)
        return kernels is not None

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: Any) -> torch.Tensor:
        """input_ids, positions: [T] int64 (all requests' new tokens concatenated), on the model
        device. `batch.attn` is the attention backend. Returns [T, hidden] after the final norm."""
        x = vocab_embedding(input_ids, self.embed_tokens, self.vocab, self.tp)
        normed = self.layers[0].input_layernorm(x)
        norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        for layer, next_norm in zip(self.layers, norms):
            x, delta = layer(x, normed, positions, self.rotary_emb, batch)
            x, normed = next_norm.add_forward(x, delta)
        return normed

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32, the whole vocabulary on every rank."""
        return self.tp.all_gather(linear(hidden, self.lm_head, self.packs.get("lm_head"))).float()

    # ---- weights -------------------------------------------------------------------------
    _LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors (`model.layers.3.self_attn.q_proj.weight`, ...) into the fused
        parameters, converting dtype and device. Tensors are whole (as in the checkpoint): torch
        tensors, or lazy safetensors slices of which only this rank's part is read. Returns the
        HF names it consumed; unknown names (rotary inv_freq buffers, ...) are skipped. Call
        `check_loaded` afterwards."""
        self.use_cpu_kernels(False)
        loaded = set()
        experts = self.config.moe.num_experts if self.config.moe is not None else 0
        for name, tensor in weights:
            name = hf_name(name)
            found = self._target(name)
            if found is None:
                continue
            dst, part = found
            tensor = take(tensor, part)
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not fit {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.update(covered_names(name, experts))
        return loaded

    def expected_weight_names(self) -> set[str]:
        """HF names a complete checkpoint provides for this config."""
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if not self.config.tie_word_embeddings:
            names.add("lm_head.weight")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            names |= {p + s for s in ("input_layernorm.weight", "post_attention_layernorm.weight")}
            names |= {p + "self_attn." + s for s in layer.self_attn.targets()}
            names |= {p + "mlp." + s for s in layer.mlp.weight_names()}
        return names

    def check_loaded(self, loaded: set[str]) -> None:
        missing = self.expected_weight_names() - loaded
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:5]}")

    def _target(self, name: str) -> tuple[torch.Tensor, Index] | None:
        """(The parameter, or the rows of a fused one, that an HF tensor name fills; the part of
        the tensor this rank reads.)"""
        vocab = index(self.tp, self.vocab)
        if name == "model.embed_tokens.weight":
            return self.embed_tokens, vocab
        if name == "lm_head.weight":
            return None if self.config.tie_word_embeddings else (self.lm_head, vocab)
        if name == "model.norm.weight":
            return self.norm.weight, ()
        m = self._LAYER_RE.match(name)
        if m is None or int(m.group(1)) >= self.config.num_layers:
            return None
        layer, rest = self.layers[int(m.group(1))], m.group(2)
        if rest.startswith("mlp."):
            return layer.mlp.target(rest[len("mlp."):])
        if rest.startswith("self_attn."):
            return layer.self_attn.targets().get(rest[len("self_attn."):])
        return {"input_layernorm.weight": (layer.input_layernorm.weight, ()),
                "post_attention_layernorm.weight": (layer.post_attention_layernorm.weight, ())}.get(rest)
