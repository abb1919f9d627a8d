"""`LoraRegistry`: the adapters served by name, loaded at start and at run time.

Only the scheduler thread calls it. A request resolves its adapter's name once, on arrival, and
keeps the `LoraAdapter` itself: unloading a name refuses new requests for it while those already
queued or running finish with the weights they hold (freed with the last of them).
"""
from __future__ import annotations

import torch

from hicache.runtime.lora.adapter import AdapterError, LoraAdapter, load_adapter
from hicache.runtime.model_config import ModelConfig


class LoraRegistry:
    def __init__(self, config: ModelConfig, max_rank: int, dtype: torch.dtype, device: torch.device,
                 reserved: frozenset[str] = frozenset()):
        """`reserved`: names an adapter may not take (the served model's)."""
        if config.moe is not None or config.architecture == "Gemma3ForCausalLM":
            raise ValueError("enable_lora: LoRA adapters are served on dense Llama-family models only")
        self.config, self.max_rank, self.dtype, self.device = config, max_rank, dtype, device
        self.reserved = reserved
        self.adapters: dict[str, LoraAdapter] = {}

    def load(self, name: str, path: str) -> LoraAdapter:
        """Loads the adapter folder `path` as `name`; AdapterError for a bad adapter or a name in use."""
        if not isinstance(name, str) or not name or ":" in name:
            raise AdapterError(f"lora_name: must be a non-empty name without ':', got {name!r}")
        if name in self.adapters or name in self.reserved:
            raise AdapterError(f"lora_name: {name!r} is already in use"
                               + (" (by the served model)" if name in self.reserved else ""))
        adapter = load_adapter(name, path, self.config, self.max_rank, self.dtype, self.device)
        self.adapters[name] = adapter
        return adapter

    def unload(self, name: str) -> None:
        if name not in self.adapters:
            raise AdapterError(f"lora_name: no adapter {name!r} is loaded")
        del self.adapters[name]

    def get(self, name: str) -> LoraAdapter:
        """The adapter `lora_path` names; ValueError naming it when none is loaded under that name."""
        adapter = self.adapters.get(name)
        if adapter is None:
            known = ", ".join(map(repr, self.adapters)) or "none"
            raise ValueError(f"lora_path: no adapter {name!r} is loaded (loaded: {known})")
        return adapter

    def paths(self) -> dict[str, str]:
        """name -> path of every loaded adapter."""
        return {name: a.path for name, a in self.adapters.items()}


def namespace(cache_salt: str, adapter: LoraAdapter | None) -> str:
    """The cache namespace of a request: its cache salt, and under an adapter the adapter's digest
    too, so that KV computed under one adapter (or none) is never matched under another (the
    radix tree's subtree, and through the salted page keys L2 and L3)."""
    return cache_salt if adapter is None else f"\x00lora:{adapter.uid}\x00{cache_salt}"
