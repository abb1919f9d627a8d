"""Model registry: HF architecture name -> our implementation."""
from __future__ import annotations

from hicache.runtime.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
}


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    if architecture not in MODEL_REGISTRY:
        raise ValueError(f"unsupported architecture {architecture!r}: hicache runs {', '.join(MODEL_REGISTRY)}")
    return MODEL_REGISTRY[architecture]


__all__ = ["LlamaForCausalLM", "MODEL_REGISTRY", "get_model_class"]
