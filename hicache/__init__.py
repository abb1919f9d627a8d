"""hicache: an LLM serving engine built around a hierarchical KV cache.

`from hicache import Engine` imports the runtime lazily, so that `import hicache` (the cache brain)
pulls in neither a model nor a GPU stack.
"""
from __future__ import annotations

from typing import Any

from hicache.config import HiCacheConfig

__all__ = ["Engine", "HiCacheConfig"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from importlib import import_module

        return import_module("hicache.runtime.engine").Engine
    raise AttributeError(f"module 'hicache' has no attribute {name!r}")
