"""Model registry: HF architecture name -> our implementation (one decoder, parameterised by the
config's family options: see `hicache.runtime.model_config.FAMILIES`)."""
from __future__ import annotations

from hicache.runtime.model_config import SUPPORTED_ARCHITECTURES
from hicache.runtime.models.deepseek import DeepseekV2ForCausalLM
from hicache.runtime.models.gemma3 import Gemma3ForCausalLM
from hicache.runtime.models.llama import LlamaForCausalLM
from hicache.runtime.models.qwen3_next import Qwen3NextForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {arch: LlamaForCausalLM for arch in SUPPORTED_ARCHITECTURES}
MODEL_REGISTRY["Gemma3ForCausalLM"] = Gemma3ForCausalLM  # its own blocks around the shared attention
MODEL_REGISTRY["DeepseekV2ForCausalLM"] = DeepseekV2ForCausalLM  # latent attention, its own MoE
MODEL_REGISTRY["DeepseekV3ForCausalLM"] = DeepseekV2ForCausalLM  # the same blocks, V3's routing (MoEConfig)
MODEL_REGISTRY["Qwen3NextForCausalLM"] = Qwen3NextForCausalLM  # gated DeltaNet and gated attention layers


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    if architecture not in MODEL_REGISTRY:
        raise ValueError(f"unsupported architecture {architecture!r}: hicache runs {', '.join(MODEL_REGISTRY)}")
    return MODEL_REGISTRY[architecture]


__all__ = ["DeepseekV2ForCausalLM", "Gemma3ForCausalLM", "LlamaForCausalLM", "MODEL_REGISTRY", "Qwen3NextForCausalLM",
           "get_model_class"]
