"""`HiCacheConfig`: the cache brain's options, and `StorageOptions`: its keys of the L3 extra config.
CLI defaults are read from here."""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields

from hicache.decide import DECISION_MODES
from hicache.eviction import DEFAULT as DEFAULT_EVICTION, STRATEGIES

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
MEM_LAYOUTS = ("layer_first", "page_first")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
STORAGE_IO = ("process", "threads")


@dataclass(frozen=True)
class HiCacheConfig:
    page_size: int = field(default=1, metadata={"help": "Tokens per KV page: the granularity of matching, allocation and storage."})
    disable_radix_cache: bool = field(default=False, metadata={"help": "Never reuse a computed prefix."})
    radix_eviction_policy: str = field(default=DEFAULT_EVICTION, metadata={"help": "Which unlocked leaf the radix tree evicts first, on L1 and L2: next_use (the farthest predicted next use, from each prefix's pace of reuse: idle prefixes first, then never-reused ones newest first, so that sessions coming back in turn keep a stable share of the cache), lru, lfu, or lfu_aging (fewest hits, counts halved each time the cache turns over)."})
    hierarchical_cache: bool | None = field(default=None, metadata={"help": "Keep KV evicted from the device in a host tier (L2) and load it back instead of recomputing. Default: on, unless disable_radix_cache leaves nothing to keep (on with it is an error)."})
    hicache_ratio: float = field(default=2.0, metadata={"help": "Host (L2) pool size as a multiple of the device (L1) pool's tokens; sized down, with a warning, to the host memory available beyond the OS reserve (the smaller of 10 GiB, a fifth of RAM and half the available memory)."})
    hicache_size: float = field(default=0, metadata={"help": "Host (L2) pool size in GB; overrides hicache_ratio when > 0. A size the available host memory beyond the OS reserve cannot hold stops the server at start."})
    hicache_write_policy: str = field(default="write_through", metadata={"help": "When device KV is copied to host: write_through (on insert), write_through_selective (on the second hit) or write_back (on eviction)."})
    hicache_mem_layout: str = field(default="layer_first", metadata={"help": "Host pool layout: layer_first (per-layer contiguous, like L1) or page_first (all layers of a page contiguous)."})
    hicache_io_backend: str = field(default="direct", metadata={"help": "Host <-> device copies on CUDA: direct (the copy engines, a layer's pages in one cuMemcpyBatchAsync; the kernel where the driver lacks it) or kernel (a Triton gather kernel, which holds SMs); plain torch copies on CPU either way."})
    hicache_load_layerwise: bool = field(default=True, metadata={"help": "On CUDA, a load-back's layers are waited for one at a time: layer i's attention waits for layer i only, so loading overlaps compute (--no-hicache-load-layerwise: the pass waits for the whole load)."})
    hicache_load_ahead_layers: int = field(default=2, metadata={"help": "Layers of a layer-wise load-back queued ahead of the layer the forward pass waits for (queuing every layer before the pass costs the host the time its own launches need)."})
    hicache_load_blocks: int = field(default=16, metadata={"help": "Programs per layer and K/V of the Triton gather kernel that loads pages back (io_backend kernel, or direct where the driver lacks batched copies): more moves pages faster but takes more SMs from the compute it overlaps."})
    hicache_load_decision: str = field(default="measured", metadata={"help": "Whether a prefix cached on L3 (and L2) is loaded or recomputed: measured (L3 hits: whichever is faster by the load bandwidth and prefill rate measured while serving; L2 hits are loaded), measured_all (L2 hits too) or always (load every hit)."})
    hicache_storage_backend: str = field(default="lmdb", metadata={"help": "L3 storage tier: lmdb (embedded, under $HICACHE_HOME/storage), redis (shared between servers), mooncake (a Mooncake Store cluster shared between servers), memory (in the server's process, gone when it stops) or none."})
    hicache_storage_backend_extra_config: str | None = field(default=None, metadata={"help": "JSON object of L3 options: the cache brain's prefetch and backup keys and the storage backend's own (docs/configuration.md describes each); a key neither takes, or a value of the wrong type or range, is an error naming it. A Redis URL with a password: give it with --hicache-storage-backend-extra-config-file to keep it off the command line."})
    hicache_storage_io: str = field(default="process", metadata={"help": "Where L3 reads and writes run: process (a process of their own that maps the host pool, which then lives in shared memory: they never wait for the scheduler's interpreter lock nor hold it) or threads (threads of the scheduler's process). The memory backend always runs in threads."})
    hicache_storage_prefetch_policy: str = field(default="timeout", metadata={"help": "When a request waiting for an L3 prefetch may run: best_effort (with whatever has arrived), wait_complete, or timeout (a base plus a per-1k-token allowance, capped)."})
    hicache_storage_secret: str | None = field(default=None, repr=False, metadata={"help": "Secret (at least 16 bytes) that authenticates L3 values with an HMAC-SHA256: a value without a valid MAC is a counted miss, so writers to a shared store (Redis) without it cannot plant pages. Every server sharing a store needs the same one. Default: none (values are still bound to their keys and checksummed). Never logged or shown; give it with --hicache-storage-secret-file to keep it off the command line."})

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        _choice("radix_eviction_policy", self.radix_eviction_policy, tuple(STRATEGIES))
        _choice("hicache_write_policy", self.hicache_write_policy, WRITE_POLICIES)
        _choice("hicache_mem_layout", self.hicache_mem_layout, MEM_LAYOUTS)
        _choice("hicache_io_backend", self.hicache_io_backend, _io_backends())
        if not self.hicache_ratio > 0:
            raise ValueError(f"hicache_ratio must be > 0, got {self.hicache_ratio}")
        if self.hicache_load_ahead_layers < 0 or self.hicache_load_blocks < 1:
            raise ValueError("hicache_load_ahead_layers must be >= 0 and hicache_load_blocks >= 1, got "
                             f"{self.hicache_load_ahead_layers} and {self.hicache_load_blocks}")
        if self.hicache_size < 0:
            raise ValueError(f"hicache_size must be >= 0 GB (0: use hicache_ratio), got {self.hicache_size}")
        _choice("hicache_storage_backend", self.hicache_storage_backend, storage_backends())
        _choice("hicache_load_decision", self.hicache_load_decision, DECISION_MODES)
        _choice("hicache_storage_prefetch_policy", self.hicache_storage_prefetch_policy, PREFETCH_POLICIES)
        _choice("hicache_storage_io", self.hicache_storage_io, STORAGE_IO)
        extra = self.hicache_storage_backend_extra_config
        if isinstance(extra, dict):  # Engine(**options) may pass the object itself; keep the JSON form
            object.__setattr__(self, "hicache_storage_backend_extra_config", json.dumps(extra))
        extra = parse_extra(self.hicache_storage_backend_extra_config)
        if "secret" in extra:
            raise ValueError("the L3 secret goes in hicache_storage_secret, not in the extra config (which is shown)")
        check_extra(self.hicache_storage_backend, extra)
        if self.hierarchical_cache and self.disable_radix_cache:
            raise ValueError("hierarchical_cache needs the radix cache: it keeps what disable_radix_cache discards")

    @property
    def hierarchical(self) -> bool:
        """Whether L2 is in use: not turned off, and there is a radix cache to keep in it."""
        return self.hierarchical_cache is not False and not self.disable_radix_cache

    @property
    def storage(self) -> bool:
        """Whether L3 is in use: a backend is named and L2 is on (L3 pages pass through L2)."""
        return self.hierarchical and self.hicache_storage_backend != "none"

    @property
    def storage_process(self) -> bool:
        """Whether L3 I/O runs in a process of its own (the host pool then in shared memory)."""
        return self.storage and self.hicache_storage_io == "process" and self.hicache_storage_backend != "memory"

    @property
    def storage_options(self) -> StorageOptions:
        """The prefetch policy and the cache brain's keys of the extra config."""
        extra = parse_extra(self.hicache_storage_backend_extra_config)
        return StorageOptions(self.hicache_storage_prefetch_policy, **{k: extra[k] for k in CACHE_KEYS if k in extra})

    @property
    def backend_options(self) -> dict:
        """The storage backend's keys of the extra config."""
        return {k: v for k, v in parse_extra(self.hicache_storage_backend_extra_config).items() if k not in CACHE_KEYS}


@dataclass(frozen=True)
class StorageOptions:
    """The prefetch policy (`hicache_storage_prefetch_policy`) and the cache brain's keys of
    `hicache_storage_backend_extra_config` (each field but `policy`; the backend's keys are in
    `hicache.tiers.base.STORAGE_BACKENDS`). `HiCacheConfig` checks them."""

    policy: str = "timeout"
    prefetch_threshold: int = field(default=256, metadata={"help": "Least tokens an L3 query must find past what L1 and L2 hold for them to be fetched; fewer are recomputed.", "minimum": 0})
    prefetch_timeout_base: float = field(default=2.0, metadata={"help": "Timeout policy: seconds a request may wait for its prefetch, plus prefetch_timeout_per_ki_token per 1024 tokens asked for, at most prefetch_timeout_max; then it runs with what has arrived.", "minimum": 0})
    prefetch_timeout_per_ki_token: float = field(default=0.1, metadata={"help": "Timeout policy: seconds more per 1024 tokens asked for.", "minimum": 0})
    prefetch_timeout_max: float = field(default=30.0, metadata={"help": "Timeout policy: the most seconds a request waits for its prefetch.", "minimum": 0})
    backup_queue_pages: int = field(default=4096, metadata={"help": "Most pages of backups to L3 in flight; backups past them are dropped (counted).", "minimum": 0})
    batch_pages: int = field(default=128, metadata={"help": "Pages per backend call of the L3 I/O worker.", "minimum": 1})
    prefetch_grace: float = field(default=0.1, metadata={"help": "Seconds a prefill batch, before it is formed, waits for the L3 queries and fetches of waiting requests while nothing decodes (policies other than best_effort).", "minimum": 0})
    query_grace: float = field(default=0.005, metadata={"help": "The same while requests decode, for queries only (a round trip), so that their next token waits no longer.", "minimum": 0})

    def timeout(self, tokens: int) -> float:
        return min(self.prefetch_timeout_base + tokens / 1024 * self.prefetch_timeout_per_ki_token,
                   self.prefetch_timeout_max)


CACHE_KEYS = tuple(f.name for f in fields(StorageOptions) if f.name != "policy")


def extra_keys(backend: str) -> dict:
    """name -> `hicache.tiers.base.StorageOption` of each key the extra config takes with
    `backend`: the cache brain's (`StorageOptions`), then the backend's."""
    from hicache.tiers.base import STORAGE_BACKENDS, StorageOption

    keys = {f.name: StorageOption(type(f.default), f.default, f.metadata["help"], f.metadata["minimum"])
            for f in fields(StorageOptions) if f.name in CACHE_KEYS}
    entry = STORAGE_BACKENDS.get(backend)
    return {**keys, **(entry.options if entry else {})}


def check_extra(backend: str, extra: dict) -> None:
    """ValueError naming a key of the extra config that neither the cache brain nor `backend`
    takes (listing those they do), or a value of the wrong type or range."""
    from hicache.tiers.base import check_storage_options

    check_storage_options(f"hicache_storage_backend_extra_config (storage backend {backend})", extra,
                          extra_keys(backend))


def parse_extra(text: str | None) -> dict:
    """hicache_storage_backend_extra_config parsed (ValueError unless a JSON object)."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"hicache_storage_backend_extra_config is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError("hicache_storage_backend_extra_config must be a JSON object")
    return value


def storage_backends() -> tuple[str, ...]:
    """The L3 registry's names (`hicache.tiers.base.STORAGE_BACKENDS`), and none."""
    from hicache.tiers.base import STORAGE_BACKENDS

    return (*STORAGE_BACKENDS, "none")


def _io_backends() -> tuple[str, ...]:
    """The transfer engine's names (`hicache.tiers.base`, which imports torch: importing this
    module needs none)."""
    from hicache.tiers.base import IO_BACKENDS

    return IO_BACKENDS


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
