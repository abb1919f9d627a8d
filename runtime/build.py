"""The one place that constructs concrete tiers and wires them to the model and the cache brain."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, NamedTuple

import torch

from hicache.config import HiCacheConfig, StorageOptions
from hicache.manager import CacheManager, StorageSetup
from hicache.pagekey import namespace_seed
from hicache.runtime.default_model import hicache_home
from hicache.runtime.attention import AttentionBackend, make_attention, make_latent_attention
from hicache.runtime.lora.registry import LoraRegistry
from hicache.runtime.config import RuntimeConfig
from hicache.runtime.model_config import ModelConfig
from hicache.runtime.parallel import SINGLE, TensorParallel
from hicache.runtime.runner import ModelRunner
from hicache.runtime.scheduler import Scheduler
from hicache.runtime.spec.draft_model import DraftModel
from hicache.runtime.tp import RankGroup, rank_device
from hicache.recurrent import RecurrentPolicy
from hicache.runtime.tp_fanout import JournaledReqTable, StorageFanout, TPModelRunner, TransferFanout
from hicache.runtime.weights import LoadedModel, load_model
from hicache.tiers.gpu.pool import DeviceKVPool
from hicache.tiers.gpu.req_table import ReqToTokenTable
from hicache.tiers.gpu.state import RecurrentStatePool
from hicache.tiers.host.pool import HostKVPool, available_ram, host_pool_tokens
from hicache.tiers.host.transfer import HostTransferEngine
from hicache.tiers.remote import make_backend
from hicache.tiers.remote.process import StorageProcess
from hicache.tiers.remote.redact import redact
from hicache.tiers.remote.worker import StorageWorker
from hicache.ngram import NgramIndex
from hicache.tree import RadixTree
from hicache.window import WindowPolicy

logger = logging.getLogger(__name__)

CPU_KV_CAP_BYTES = 512 << 20  # on CPU the L1 pool (zeroed: resident at once) shares RAM with everything else


class Components(NamedTuple):
    """What the scheduler runs on."""

    model_config: ModelConfig
    tokenizer: Any | None
    pool: DeviceKVPool
    cache: CacheManager  # the scheduler's door to L1 (and L2, L3 when on)
    runner: ModelRunner
    context_length: int
    model_name: str
    loras: LoraRegistry | None = None  # the served LoRA adapters, with enable_lora
    draft: DraftModel | None = None  # STANDALONE speculative decoding's draft model



class RankParts(NamedTuple):
    """What every tensor-parallel rank holds of the model and the KV tiers (its share of them)."""

    loaded: LoadedModel
    pool: DeviceKVPool
    req_table: ReqToTokenTable
    host_pool: HostKVPool | None
    transfer: HostTransferEngine | None
    attn: AttentionBackend
    device: torch.device
    context: int
    states: RecurrentStatePool | None = None  # the recurrent layers' states, for a model with such layers


def build(rc: RuntimeConfig, cc: HiCacheConfig) -> Components:
    """The scheduler's parts; with `tp_size` > 1 this process is rank 0 and starts the others
    (runtime/tp.py), whose parts it drives through stand-ins (runtime/tp_fanout.py)."""
    if rc.tp_size == 1:
        return assemble(rc, cc, build_rank(rc, cc, SINGLE, ReqToTokenTable), None)
    ranks = RankGroup.start(rc, cc)
    try:
        return assemble(rc, cc, build_rank(rc, cc, ranks.tp, JournaledReqTable), ranks)
    except BaseException:
        ranks.close()
        raise


def build_rank(rc: RuntimeConfig, cc: HiCacheConfig, tp: TensorParallel, table_class=ReqToTokenTable) -> RankParts:
    """This rank's model share, L1 pool, request table, L2 pool and transfer engine, and the
    attention backend. Sizes that depend on free memory are the least over the ranks."""
    device = rank_device(rc.device, tp.rank) if tp.sharded else rc.device
    loaded = load_model(rc.model_path, rc.load_format, rc.dtype, device, rc.random_seed, tp)
    cfg, heads = loaded.config, loaded.num_kv_heads
    device = next(loaded.model.parameters()).device
    dtype = next(loaded.model.parameters()).dtype
    windows = {i: w for i, w in enumerate(cfg.layer_windows) if w}
    ratio = rc.swa_full_tokens_ratio if windows and not tp.sharded else 0.0  # (TP ranks keep one pool)
    states = StateSpec.of(rc, cfg) if cfg.recurrent_layers else None
    reserved = states.nbytes(dtype) if states is not None else 0
    num_tokens = least_over_ranks(tp, kv_pool_tokens(rc, cfg, dtype, device, cc.page_size, heads, ratio, reserved),
                                  device)
    if num_tokens < cc.page_size:
        state = (f" beside the recurrent-state pool ({states.slots} slots, {reserved / 2**20:.0f} MiB: lower "
                 "max_mamba_cache_size or max_running_requests)") if states is not None else ""
        raise ValueError(f"the KV pool holds {num_tokens} tokens{state}, less than one page ({cc.page_size})")
    window_tokens = int(num_tokens * ratio) // cc.page_size * cc.page_size
    # with an L2 a running request keeps every window part it computed: its context fits the windowed pool
    held = window_tokens if window_tokens and cc.hierarchical else num_tokens
    context = served_context(rc.context_length or cfg.max_position_embeddings, min(num_tokens, held))
    pool = DeviceKVPool(num_tokens, cc.page_size, cfg.kv_layers, heads, cfg.cache_head_dim, dtype, device,
                        frozenset(windows), max(windows.values(), default=0), window_tokens)
    pages_per_req = -(-context // cc.page_size)
    req_table = table_class(rc.max_running_requests, pages_per_req * cc.page_size, device)
    host_pool = build_host_pool(cc, pool, cfg, dtype, heads) if cc.hierarchical else None
    transfer = None if host_pool is None else HostTransferEngine(
        pool, host_pool, cc.hicache_io_backend, cc.hicache_load_layerwise, cc.hicache_load_ahead_layers,
        cc.hicache_load_blocks, frozenset(windows))
    state_pool = states.build(dtype, device) if states is not None else None
    return RankParts(loaded, pool, req_table, host_pool, transfer, attention(rc, loaded, device, dtype), device,
                     context, state_pool)


def attention(rc: RuntimeConfig, loaded: LoadedModel, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """The attention backend of `loaded` (its CPU kernels turned on where they apply)."""
    cfg = loaded.config
    cpu_kernels = device.type == "cpu" and not rc.disable_cpu_kernels
    if cpu_kernels and hasattr(loaded.model, "use_cpu_kernels"):
        loaded.model.use_cpu_kernels(quantized=not rc.disable_cpu_quantized_linears)
    if cfg.mla is not None:
        return make_latent_attention(rc.attention_backend, rc.decode_attention_backend, cfg.mla.kv_lora_rank,
                                     cfg.attn_scale)
    return make_attention(rc.attention_backend, rc.decode_attention_backend, device, dtype, cfg.head_dim,
                          cfg.attn_scale, cfg.layer_windows, cpu_kernels)


class StateSpec(NamedTuple):
    """The L1 state pool of a model with recurrent layers: `slots` slots of one convolution state
    `conv` and one recurrence state `ssm` per recurrent layer (`layers` of them)."""

    slots: int
    layers: int
    conv: tuple[int, ...]
    ssm: tuple[int, ...]

    @classmethod
    def of(cls, rc: RuntimeConfig, cfg: ModelConfig) -> StateSpec:
        """`max_mamba_cache_size` slots (default five per running request: three for each, the
        rest for the radix tree's snapshots)."""
        slots = rc.max_mamba_cache_size or 5 * rc.max_running_requests
        if slots <= 3 * rc.max_running_requests:
            raise ValueError(f"max_mamba_cache_size ({slots}) must exceed 3 x max_running_requests "
                             f"({3 * rc.max_running_requests}): every running request holds three state slots")
        lin = cfg.linear
        return cls(slots, len(cfg.recurrent_layers), (lin.conv_dim, lin.conv_kernel - 1),
                   (lin.num_value_heads, lin.key_head_dim, lin.value_head_dim))

    def nbytes(self, dtype: torch.dtype) -> int:
        return self.slots * RecurrentStatePool.slot_bytes(self.layers, self.conv, self.ssm, dtype)

    def build(self, dtype: torch.dtype, device: torch.device) -> RecurrentStatePool:
        pool = RecurrentStatePool(self.slots, self.layers, self.conv, self.ssm, dtype, device)
        logger.info("L1 recurrent-state pool: %d slots (%.1f MiB)", self.slots, self.nbytes(dtype) / 2**20)
        return pool


def assemble(rc: RuntimeConfig, cc: HiCacheConfig, parts: RankParts, ranks: RankGroup | None) -> Components:
    """Rank 0's cache brain and runner over its parts (and, through `ranks`, the followers')."""
    loaded, pool, cfg = parts.loaded, parts.pool, parts.loaded.config
    host_pool, transfer = parts.host_pool, parts.transfer
    tree = RadixTree(pool.allocator, cc.page_size, cc.radix_eviction_policy, disabled=cc.disable_radix_cache,
                     host_allocator=host_pool.allocator if host_pool is not None else None)
    windows = [w for w in cfg.layer_windows if w]
    if ranks is not None and transfer is not None:
        transfer = TransferFanout(transfer, ranks)
    policy = WindowPolicy(tree, max(windows), host=host_pool is not None and not cc.disable_radix_cache) \
        if windows else None
    storage = storage_setup(cc, rc, loaded, host_pool, ranks) if storage_on(cc, host_pool) else None
    states = RecurrentPolicy(tree, parts.states) if parts.states is not None else None
    cache = CacheManager.build(tree, parts.req_table, host_pool, transfer, write_policy=cc.hicache_write_policy,
                               load_decision=cc.hicache_load_decision, windows=policy, storage=storage,
                               ngrams=ngram_index(rc, bool(windows), states is not None), states=states)
    args = (loaded.model, pool, parts.req_table, parts.attn, parts.device)
    options = {"cuda_graph": not rc.disable_cuda_graph, "max_batch": rc.max_running_requests}
    if parts.states is not None:
        options["states"] = parts.states
    runner = ModelRunner(*args, **options) if ranks is None else TPModelRunner(ranks, *args, **options)
    nbytes = sum(b.numel() * b.element_size() for b in pool.k_buffers + pool.v_buffers)
    logger.info("L1 KV pool: %d tokens (%.1f MiB%s), context %d", pool.num_slots, nbytes / 2**20,
                f"; windowed layers: {pool.window_slots} slots" if pool.window_layers else "", parts.context)
    return Components(cfg, loaded.tokenizer, pool, cache, runner, parts.context, cfg.name, lora_registry(rc, loaded),
                      draft_model(rc, cc, parts))


def draft_model(rc: RuntimeConfig, cc: HiCacheConfig, parts: RankParts) -> DraftModel | None:
    """STANDALONE's draft model (None for other algorithms) on the target's device and dtype,
    with an L1 pool of as many tokens as the target's, a request table as large, and a radix
    tree of its own (runtime/spec/draft_model.py says why). ValueError naming
    speculative_draft_model_path when its vocabulary is not the target's, or its architecture
    has sliding-window layers, latent attention or recurrent layers."""
    if rc.speculative_algorithm != "STANDALONE":
        return None
    target, dtype = parts.loaded, next(parts.loaded.model.parameters()).dtype
    loaded = load_model(rc.speculative_draft_model_path, rc.load_format, dtype, parts.device, rc.random_seed)
    check_draft_vocabulary(loaded, target)
    cfg = loaded.config
    if any(cfg.layer_windows) or cfg.mla is not None or cfg.recurrent_layers:
        raise ValueError(f"speculative_draft_model_path: {loaded.path} has sliding-window layers, latent "
                         "attention or recurrent layers, not supported in a draft model")
    pool = DeviceKVPool(parts.pool.num_slots, cc.page_size, cfg.num_layers, loaded.num_kv_heads, cfg.cache_head_dim,
                        dtype, parts.device, frozenset(), 0, 0)
    table = ReqToTokenTable(rc.max_running_requests, parts.req_table.max_context, parts.device)
    runner = ModelRunner(loaded.model, pool, table, attention(rc, loaded, parts.device, dtype), parts.device)
    tree = RadixTree(pool.allocator, cc.page_size, cc.radix_eviction_policy, disabled=cc.disable_radix_cache)
    logger.info("draft model %s: L1 KV pool of %d tokens", loaded.path, pool.num_slots)
    return DraftModel(runner, CacheManager.build(tree, table), rc.max_running_requests)


def check_draft_vocabulary(draft: LoadedModel, target: LoadedModel) -> None:
    """ValueError naming speculative_draft_model_path unless the draft's vocabulary is the
    target's: the same size and, where both have tokenizers, the same token of every id."""
    same = draft.config.vocab_size == target.config.vocab_size
    if same and draft.tokenizer is not None and target.tokenizer is not None:
        same = draft.tokenizer.get_vocab() == target.tokenizer.get_vocab()
    elif same:
        same = draft.tokenizer is None and target.tokenizer is None
    if not same:
        raise ValueError(f"speculative_draft_model_path: the draft model's vocabulary ({draft.config.vocab_size} "
                         f"tokens, {draft.path}) is not the target model's ({target.config.vocab_size} tokens): a "
                         "draft model must share the target's tokenizer")


def lora_registry(rc: RuntimeConfig, loaded: LoadedModel) -> LoraRegistry | None:
    """The LoRA adapters' registry with those of `lora_paths` loaded (None without enable_lora)."""
    if not rc.lora_on:
        return None
    if loaded.config.recurrent_layers:
        raise ValueError("enable_lora: LoRA adapters are not served on recurrent models (Qwen3-Next)")
    param = next(loaded.model.parameters())
    reserved = frozenset({loaded.config.name} | ({rc.model_path} if rc.model_path else set()))
    loras = LoraRegistry(loaded.config, rc.max_lora_rank, param.dtype, param.device, reserved)
    for name, path in rc.lora_adapters().items():
        loras.load(name, path)
        logger.info("LoRA adapter %r loaded from %s", name, path)
    return loras


def ngram_index(rc: RuntimeConfig, windowed: bool, recurrent: bool = False) -> NgramIndex | None:
    """The index over the tree's tokens that NGRAM drafts come from (None: no speculative
    decoding, another algorithm, or drafts from each request's own tokens only)."""
    if rc.speculative_algorithm is None:
        return None
    if windowed:
        raise ValueError("speculative_algorithm: not supported with sliding-window models yet")
    if recurrent:  # a rejected draft would have to be taken out of the recurrent state
        raise ValueError("speculative_algorithm: not supported with recurrent models (Qwen3-Next) yet")
    if rc.speculative_algorithm != "NGRAM" or rc.speculative_ngram_capacity == 0:
        return None
    return NgramIndex(rc.speculative_ngram_min_match_window_size, rc.speculative_ngram_max_match_window_size,
                      rc.speculative_ngram_capacity)


def least_over_ranks(tp: TensorParallel, n: int, device: torch.device) -> int:
    """The least of each rank's `n` (n itself on one rank): every rank must size its pools alike."""
    if not tp.sharded:
        return n
    t = torch.tensor([n], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=tp.group)
    return int(t.item())


def storage_on(cc: HiCacheConfig, host_pool: HostKVPool | None) -> bool:
    """L3 is attached: a backend is named and L2 is on (under a radix tree that shares pages)."""
    return bool(cc.storage) and host_pool is not None and not cc.disable_radix_cache


def build_host_pool(cc: HiCacheConfig, pool: DeviceKVPool, cfg: ModelConfig, dtype: torch.dtype,
                    kv_heads: int) -> HostKVPool:
    """L2: `hicache_size` GB (ValueError if the host lacks the RAM), or `hicache_ratio` x the L1
    tokens (sized down to the RAM there is, with a warning), of pages of `kv_heads` heads (this rank's)."""
    tokens = host_pool_tokens(pool.num_slots, pool.bytes_per_token(), cc.page_size, cc.hicache_ratio, cc.hicache_size)
    host = HostKVPool(tokens, cc.page_size, cfg.kv_layers, kv_heads, cfg.cache_head_dim, dtype,
                      cc.hicache_mem_layout, shared=cc.storage_process)
    logger.info("L2 host KV pool: %d tokens (%.1f MiB, %s, %s, write policy %s)", host.num_slots,
                host.num_slots * host.bytes_per_token() / 2**20, cc.hicache_mem_layout,
                "pinned" if host.pinned else "not pinned", cc.hicache_write_policy)
    return host


def storage_setup(cc: HiCacheConfig, rc: RuntimeConfig, loaded: LoadedModel, host_pool: HostKVPool,
                  ranks: RankGroup | None = None) -> StorageSetup:
    """L3: the backend named by `hicache_storage_backend`, its I/O worker over the host pool, and
    the page-key namespace (docs/formats.md: model, KV dtype, page size, layout, TP rank and size);
    with `ranks`, every rank's worker behind one `StorageFanout`."""
    worker, seed, options, where = storage_worker(cc, rc, loaded, host_pool, ranks.tp if ranks else SINGLE)
    engine = worker if ranks is None else StorageFanout(worker, ranks)
    logger.info("L3 %s storage: %s (prefetch %s from %d tokens; values %s)", cc.hicache_storage_backend,
                redact(where), options.policy, options.prefetch_threshold,
                "MACed" if cc.hicache_storage_secret else "key-bound, not MACed")
    return StorageSetup(engine, seed, options, cc.hicache_storage_backend)


def storage_worker(cc: HiCacheConfig, rc: RuntimeConfig, loaded: LoadedModel, host_pool: HostKVPool,
                   tp: TensorParallel) -> tuple[StorageWorker | StorageProcess, bytes, StorageOptions, str]:
    """This rank's L3 worker over its backend (its pages under its own namespace), the namespace
    seed, the storage options and where the backend lives."""
    options, backend_options = cc.storage_options, cc.backend_options
    if cc.hicache_storage_backend == "lmdb":
        backend_options.setdefault("path", str(hicache_home() / "storage" / "lmdb"))
    seed = namespace_seed(model_fingerprint(rc, loaded), host_pool.buffer.dtype, cc.page_size, cc.hicache_mem_layout,
                          f"tp{tp.rank}/{tp.size}")
    where = str(next((backend_options[k] for k in ("path", "url", "master") if k in backend_options), "in memory"))
    if cc.storage_process:
        return StorageProcess(cc.hicache_storage_backend, seed.hex()[:16], cc.hicache_storage_secret, backend_options,
                              host_pool, options.batch_pages), seed, options, where
    backend = make_backend(cc.hicache_storage_backend, seed.hex()[:16], cc.hicache_storage_secret, **backend_options)
    return StorageWorker(backend, host_pool, options.batch_pages), seed, options, where


def model_fingerprint(rc: RuntimeConfig, loaded: LoadedModel) -> str:
    """The architecture's fingerprint plus what identifies the weights wherever they live: the
    weight files' names and sizes, or the seed of dummy weights."""
    if rc.load_format == "dummy":
        return f"{loaded.config.fingerprint}:dummy:{rc.random_seed}"
    path = Path(loaded.path)
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix in (".gguf", ".safetensors"))
    return loaded.config.fingerprint + ":" + ",".join(f"{p.name}:{p.stat().st_size}" for p in files)


def kv_pool_tokens(rc: RuntimeConfig, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                   page_size: int, kv_heads: int, window_ratio: float = 0.0, reserved: int = 0) -> int:
    """L1 size in tokens of `kv_heads` heads (this rank's): `max_total_tokens` when given, else
    `mem_fraction_static` of the device memory minus what is already used (on CPU: of available
    RAM, page cache included, capped at CPU_KV_CAP_BYTES). With `window_ratio`, the windowed
    layers' pool holds that many slots per token (and the global layers' one each). `reserved`:
    bytes of that budget taken by other L1 pools (the recurrent-state pool)."""
    if rc.max_total_tokens is not None:
        return rc.max_total_tokens // page_size * page_size
    windowed = sum(1 for w in cfg.layer_windows if w) if window_ratio else 0
    layers = cfg.kv_layers - windowed + window_ratio * windowed
    per_token = DeviceKVPool.token_bytes(1, kv_heads, cfg.cache_head_dim, dtype) * layers
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = free - total * (1 - rc.mem_fraction_static)
    else:
        available = available_ram()
        budget = available * rc.mem_fraction_static * 0.25
        if budget < CPU_KV_CAP_BYTES:
            logger.warning("L1: %.2f GiB of host memory is available: the KV pool is sized down to %.0f MiB (of %.0f "
                           "MiB); pass max_total_tokens to insist on a size", available / 2**30, budget / 2**20,
                           CPU_KV_CAP_BYTES / 2**20)
        budget = min(budget, CPU_KV_CAP_BYTES)
    budget -= reserved
    return int(max(budget, 0) // per_token) // page_size * page_size


def served_context(context: int, pool_tokens: int) -> int:
    """The context length served: a running request holds all its KV in L1, so no more than L1."""
    if pool_tokens < context:
        logger.warning("the L1 KV pool (%d tokens) is smaller than the context length (%d): serving a context of "
                       "%d tokens; raise max_total_tokens or mem_fraction_static for more", pool_tokens, context,
                       pool_tokens)
    return min(context, pool_tokens)


def build_scheduler(rc: RuntimeConfig, cc: HiCacheConfig) -> Scheduler:
    """A `Scheduler` over freshly built parts."""
    return Scheduler(build(rc, cc), rc)
