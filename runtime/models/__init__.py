"""Model registry: HF architecture name -> our implementation."""
from __future__ import annotations

from hicache.runtime.models.gemma3 import Gemma3ForCausalLM
from hicache.runtime.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    if architecture not in MODEL_REGISTRY:
        raise ValueError(f"unsupported architecture {architecture!r}: hicache runs {', '.join(MODEL_REGISTRY)}")
    return MODEL_REGISTRY[architecture]


__all__ = ["Gemma3ForCausalLM", "LlamaForCausalLM", "MODEL_REGISTRY", "get_model_class"]
