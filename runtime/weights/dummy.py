"""Random weights for a config.json (e.g. Llama-3.1-8B's shape), for benchmarks without a
checkpoint. Allocated and filled directly in the target dtype on the target device; seeded, so
the same seed gives the same weights on the same device."""
from __future__ import annotations

from pathlib import Path

import torch

from hicache.runtime.model_config import ModelConfig
from hicache.runtime.models.llama import LlamaForCausalLM

INIT_STD = 0.02


def dummy_config(path: str | Path, seed: int) -> ModelConfig:
    """The config of a config.json file or a folder holding one; its name records the seed so
    that cache keys of different random models never collide."""
    path = Path(path)
    cfg = ModelConfig.from_json_file(path)
    base = cfg.name or (path.name if path.is_dir() else path.stem)
    return ModelConfig(**{**cfg.__dict__, "name": f"dummy-seed{seed}:{base}"})


@torch.no_grad()
def init_dummy(model: LlamaForCausalLM, seed: int) -> None:
    """Fill matrices and biases with N(0, INIT_STD); norm weights get the model's `NORM_INIT`
    (default 1: a unit scale). Parameters are visited in registration order (a tied lm_head only
    once); a tensor-parallel share is drawn at full size and sliced (models/sharding.py), so that
    every rank holds its part of the unsharded model's weights."""
    gen = torch.Generator(device=model.device)
    gen.manual_seed(seed)
    for name, p in model.named_parameters():
        if hasattr(p, "full_index"):
            full = torch.empty(p.full_shape, dtype=p.dtype, device=p.device).normal_(0.0, INIT_STD, generator=gen)
            p.copy_(full[p.full_index])
        elif p.dim() >= 2 or name.endswith("bias"):
            p.normal_(0.0, INIT_STD, generator=gen)
        else:
            p.fill_(getattr(model, "NORM_INIT", 1.0))
