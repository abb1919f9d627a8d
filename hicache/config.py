"""`HiCacheConfig`: the cache brain's options. CLI defaults are read from here."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class HiCacheConfig:
    page_size: int = field(default=1, metadata={"help": "Tokens per KV page: the granularity of matching, allocation and storage."})
    disable_radix_cache: bool = field(default=False, metadata={"help": "Never reuse a computed prefix."})
    radix_eviction_policy: str = field(default="lru", metadata={"help": "Which unlocked leaf the radix tree evicts first: lru or lfu."})

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.radix_eviction_policy not in ("lru", "lfu"):
            raise ValueError(f"radix_eviction_policy must be lru or lfu, got {self.radix_eviction_policy!r}")
