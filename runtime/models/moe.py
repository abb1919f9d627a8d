"""The sparse MLP of Qwen2-MoE, Qwen3-MoE and Mixtral: a router, routed experts, and (Qwen2-MoE) a
sigmoid-gated shared expert.

Routing as HF computes it: softmax of the router logits in fp32, the top k, renormalised to sum
to 1 when the config says so (Mixtral always), cast to the model dtype. The experts' weights are
stacked, w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I]; on CUDA they run through the
fused Triton grouped GEMM (`hicache.kernels.moe`), elsewhere through the torch reference
(`hicache.kernels.experts`).

Checkpoint names are Qwen's (`mlp.gate.weight`, `mlp.experts.{e}.gate_proj.weight`, ...);
`hf_name` maps Mixtral's (`block_sparse_moe.experts.{e}.w1.weight`, ...) onto them. Whole stacks
load too: `mlp.experts.gate_up_proj` / `mlp.experts.down_proj` (transformers' in-memory layout)
and `mlp.experts.gate_proj` / `mlp.experts.up_proj` (GGUF's per-layer tensors).
"""
from __future__ import annotations

import functools
import importlib.util
import re

import torch
import torch.nn.functional as F
from torch import nn

from hicache.kernels.experts import moe_reference
from hicache.runtime.model_config import ModelConfig
from hicache.runtime.models.sharding import Index, fused_rows, index, sharded_param
from hicache.runtime.parallel import SINGLE, TensorParallel

_MIXTRAL = re.compile(r"\.block_sparse_moe\.(?:experts\.(\d+)\.(w[123])|gate)\.weight$")
_MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_STACK = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj|gate_proj|up_proj)$")
_EXPERT = re.compile(r"^experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_STACKED = {"gate_up_proj": ("gate_proj", "up_proj"), "gate_proj": ("gate_proj",), "up_proj": ("up_proj",),
            "down_proj": ("down_proj",)}


@functools.cache
def _fused_moe():
    """The Triton grouped GEMM where triton is installed, else None."""
    if importlib.util.find_spec("triton") is None:
        return None
    from hicache.kernels.moe import fused_moe

    return fused_moe


def hf_name(name: str) -> str:
    """Mixtral's MoE tensor names in Qwen's spelling; other names unchanged."""
    m = _MIXTRAL.search(name)
    if m is None:
        return name
    head = name[:m.start()]
    if m.group(1) is None:
        return f"{head}.mlp.gate.weight"
    return f"{head}.mlp.experts.{m.group(1)}.{_MIXTRAL_PROJ[m.group(2)]}.weight"


def covered_names(name: str, num_experts: int) -> list[str]:
    """The per-expert names a stacked tensor stands for; [name] for any other tensor."""
    m = _STACK.match(name)
    if m is None:
        return [name]
    return [f"{m.group(1)}.{e}.{p}.weight" for e in range(num_experts) for p in _STACKED[m.group(2)]]


class SparseMoeBlock(nn.Module):
    """Under tensor parallelism every rank routes every token (the router is whole) and holds
    its share of each expert's intermediate dimension, as of the shared expert's (which does not
    reduce itself): one all-reduce sums the routed and shared partial outputs.

    DeepSeek's routing options (`MoEConfig.num_groups`, `routed_scaling_factor`, V3's `routing`
    "noaux_tc" with its fp32 correction bias `score_bias`) apply when set; its shared experts are
    `DeepseekMoeBlock`'s (other names, no gate)."""

    SHARED = "shared_expert"  # the checkpoint's name of the shared expert MLP
    SHARED_GATED = True  # it is scaled by sigmoid(shared_expert_gate . x)

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                 shared: nn.Module | None = None, tp: TensorParallel = SINGLE):
        super().__init__()
        moe = config.moe
        self.top_k, self.norm_topk_prob, self.tp = moe.top_k, moe.norm_topk_prob, tp
        self.scaling, self.groups, self.topk_groups = moe.routed_scaling_factor, moe.num_groups, moe.topk_groups
        full, h = moe.intermediate_size, config.hidden_size
        part = tp.shard(full, "moe_intermediate_size")
        self.num_experts, self.inter = moe.num_experts, part.stop - part.start
        # parts of the checkpoint's per-expert [I, H] / [H, I] tensors, and of stacks of them
        self.parts = {"rows": index(tp, part), "cols": index(tp, slice(None), part),
                      "stack_rows": index(tp, slice(None), part),
                      "stack_cols": index(tp, slice(None), slice(None), part),
                      "stack_w13": index(tp, slice(None), fused_rows([(full, part), (full, part)]))}

        def param(*shape: int, idx: Index = ()) -> nn.Parameter:
            return sharded_param(shape, idx, dtype, device)

        self.gate = param(moe.num_experts, h)  # the router
        self.score_bias = nn.Parameter(torch.empty(moe.num_experts, dtype=torch.float32, device=device),
                                       requires_grad=False) if moe.routing == "noaux_tc" else None
        self.w13 = param(moe.num_experts, 2 * full, h, idx=self.parts["stack_w13"])
        self.w2 = param(moe.num_experts, h, full, idx=self.parts["stack_cols"])
        self.shared_expert = shared
        self.shared_expert_gate = param(1, h) if shared is not None and self.SHARED_GATED else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, K] in x's dtype, expert ids [T, K] int64)."""
        if self.score_bias is not None:
            weights, ids = self.route_noaux(x)
        else:
            probs = F.linear(x, self.gate).float().softmax(dim=-1)
            if self.groups > 1:
                probs = self.in_top_groups(probs, probs.view(probs.shape[0], self.groups, -1).amax(dim=-1), 0.0)
            weights, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.scaling != 1.0:
            weights = weights * self.scaling
        return weights.to(x.dtype), ids

    def route_noaux(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek-V3's: sigmoid scores in fp32; experts chosen by score plus correction bias,
        among the groups of highest top-two sum; weighted by their scores without the bias."""
        scores = F.linear(x.float(), self.gate.float()).sigmoid()
        choice = scores + self.score_bias
        if self.groups > 1:
            top2 = choice.view(choice.shape[0], self.groups, -1).topk(2, dim=-1).values.sum(dim=-1)
            choice = self.in_top_groups(choice, top2, float("-inf"))
        ids = choice.topk(self.top_k, dim=-1).indices
        return scores.gather(1, ids), ids

    def in_top_groups(self, scores: torch.Tensor, group_scores: torch.Tensor, fill: float) -> torch.Tensor:
        """scores [T, E] with the experts outside each token's `topk_groups` groups of highest
        `group_scores` [T, groups] set to `fill`."""
        grouped = scores.view(scores.shape[0], self.groups, -1)
        best = group_scores.topk(self.topk_groups, dim=-1).indices  # [T, topk_groups]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep[..., None], fill).view_as(scores)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        fused = _fused_moe() if x.is_cuda else None
        experts = fused if fused is not None else moe_reference
        out = experts(x, self.w13, self.w2, weights, ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            gate = self.shared_expert_gate
            out = out + (shared if gate is None else torch.sigmoid(F.linear(x, gate)) * shared)
        return self.tp.all_reduce(out)

    def weight_names(self) -> list[str]:
        names = ["gate.weight"] + [f"experts.{e}.{p}.weight" for e in range(self.num_experts)
                                   for p in ("gate_proj", "up_proj", "down_proj")]
        names += ["gate.e_score_correction_bias"] if self.score_bias is not None else []
        if self.shared_expert is not None:
            names += [f"{self.SHARED}.{n}" for n in self.shared_expert.weight_names()]
            names += ["shared_expert_gate.weight"] if self.SHARED_GATED else []
        return names

    def target(self, rest: str) -> tuple[torch.Tensor, Index] | None:
        """(The parameter or the slice of one that the tensor `mlp.<rest>` fills, the part of it
        this rank reads.)"""
        i, p = self.inter, self.parts
        stacks = {"gate.weight": (self.gate, ()), "gate.e_score_correction_bias": (self.score_bias, ()),
                  "experts.gate_up_proj": (self.w13, p["stack_w13"]),
                  "experts.down_proj": (self.w2, p["stack_cols"]),
                  "experts.gate_proj": (self.w13[:, :i], p["stack_rows"]),
                  "experts.up_proj": (self.w13[:, i:], p["stack_rows"])}
        if rest in stacks and stacks[rest][0] is not None:
            return stacks[rest]
        m = _EXPERT.match(rest)
        if m is not None and int(m.group(1)) < self.num_experts:
            e, proj = int(m.group(1)), m.group(2)
            return {"gate_proj": (self.w13[e, :i], p["rows"]), "up_proj": (self.w13[e, i:], p["rows"]),
                    "down_proj": (self.w2[e], p["cols"])}[proj]
        if self.shared_expert is None:
            return None
        if rest == "shared_expert_gate.weight" and self.SHARED_GATED:
            return self.shared_expert_gate, ()
        if rest.startswith(self.SHARED + "."):
            return self.shared_expert.target(rest[len(self.SHARED) + 1:])
        return None


class DeepseekMoeBlock(SparseMoeBlock):
    """DeepSeek's: `mlp.shared_experts.*`, added ungated."""

    SHARED = "shared_experts"
    SHARED_GATED = False
