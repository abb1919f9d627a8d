"""The one place that constructs concrete tiers and wires them to the model and the cache brain."""
from __future__ import annotations

import logging
import os
from typing import Any, NamedTuple

import torch

from hicache.config import HiCacheConfig
from hicache.runtime.attention import make_attention_backend
from hicache.runtime.config import RuntimeConfig
from hicache.runtime.model_config import ModelConfig
from hicache.runtime.runner import ModelRunner
from hicache.runtime.weights import load_model
from hicache.tiers.gpu.pool import DeviceKVPool
from hicache.tiers.gpu.req_table import ReqToTokenTable
from hicache.tree import RadixTree

logger = logging.getLogger(__name__)

CPU_KV_CAP_BYTES = 2 << 30  # on CPU the L1 pool shares RAM with everything else: keep it modest


class Components(NamedTuple):
    model_config: ModelConfig
    tokenizer: Any | None
    pool: DeviceKVPool
    req_table: ReqToTokenTable
    tree: RadixTree
    runner: ModelRunner
    context_length: int
    model_name: str


def build(rc: RuntimeConfig, cc: HiCacheConfig) -> Components:
    loaded = load_model(rc.model_path, rc.load_format, rc.dtype, rc.device, rc.random_seed)
    cfg = loaded.config
    device = next(loaded.model.parameters()).device
    dtype = next(loaded.model.parameters()).dtype
    context = rc.context_length or cfg.max_position_embeddings
    num_tokens = kv_pool_tokens(rc, cfg, dtype, device, cc.page_size)
    if num_tokens < cc.page_size:
        raise ValueError(f"the KV pool holds {num_tokens} tokens, less than one page ({cc.page_size})")
    pool = DeviceKVPool(num_tokens, cc.page_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype, device)
    pages_per_req = -(-context // cc.page_size)
    req_table = ReqToTokenTable(rc.max_running_requests, pages_per_req * cc.page_size, device)
    tree = RadixTree(pool.allocator, cc.page_size, cc.radix_eviction_policy, disabled=cc.disable_radix_cache)
    runner = ModelRunner(loaded.model, pool, req_table, make_attention_backend(rc.attention_backend, cfg.head_dim), device)
    logger.info("L1 KV pool: %d tokens (%.1f MiB), context %d", pool.num_slots,
                pool.num_slots * pool.bytes_per_token() / 2**20, context)
    return Components(cfg, loaded.tokenizer, pool, req_table, tree, runner, context, cfg.name)


def kv_pool_tokens(rc: RuntimeConfig, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                   page_size: int) -> int:
    """L1 size in tokens: `max_total_tokens` when given, else `mem_fraction_static` of the device
    memory minus what is already used (on CPU: of available RAM, capped at CPU_KV_CAP_BYTES)."""
    if rc.max_total_tokens is not None:
        return rc.max_total_tokens // page_size * page_size
    per_token = DeviceKVPool.token_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = free - total * (1 - rc.mem_fraction_static)
    else:
        budget = min(_available_ram() * rc.mem_fraction_static * 0.25, CPU_KV_CAP_BYTES)
    return int(max(budget, 0) // per_token) // page_size * page_size


def _available_ram() -> int:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
