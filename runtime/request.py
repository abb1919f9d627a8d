"""A request's state inside the scheduler."""
from __future__ import annotations

import torch

from hicache.runtime.sampling import SamplingParams


class Req:
    """One generation request as the scheduler sees it.

    KV ownership: slots [0, prefix_len) belong to the radix tree (locked through `last_node`);
    slots [prefix_len, len(slots)) belong to this request. `kv_len` tokens of `all_ids` have
    their KV computed. `slots` may run past kv_len up to the end of the last allocated page.
    """

    def __init__(self, rid: str, input_ids: list[int], params: SamplingParams, namespace: str,
                 generator: torch.Generator | None, return_logprob: bool, top_logprobs_num: int):
        self.rid = rid
        self.input_ids = input_ids
        self.params = params
        self.namespace = namespace
        self.generator = generator
        self.return_logprob = return_logprob
        self.top_logprobs_num = top_logprobs_num
        self.output_ids: list[int] = []
        self.row: int | None = None  # request-to-token table row while it holds KV
        self.slots = torch.empty(0, dtype=torch.int64)  # [allocated] int64, CPU
        self.kv_len = 0
        self.prefix_len = 0
        self.last_node = None
        self.cached_tokens: int | None = None  # prefix served from cache at first admission
        self.cached_host = 0  # the part of cached_tokens loaded back from L2 (and in L2 before it arrived)
        self.cached_storage = 0  # the part of cached_tokens that its L3 prefetch brought into L2
        self.storage_range = (0, 0)  # prompt tokens [start, end) its committed L3 prefetch inserted
        self.wait_tickets: frozenset[int] = frozenset()  # in-flight load-backs its prefix needs
        self.load_back_failed = False  # a load-back it waited for failed: recompute, never reload
        self.finish_reason: dict | None = None
        self.new_logprobs: list = []
        self.arrival_seq = 0
        self.cache_kv = True  # False: give the tree nothing of it when it finishes (the warm-up request)

    @property
    def all_ids(self) -> list[int]:
        """Prompt plus outputs. A step computes all_ids[kv_len : kv_len + n] and samples when that
        reaches the end; a decoding request has kv_len == len(all_ids) - 1."""
        return self.input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def holds_kv(self) -> bool:
        return self.row is not None

    def __repr__(self) -> str:
        return f"Req({self.rid!r}, prompt={len(self.input_ids)}, out={len(self.output_ids)}, kv={self.kv_len})"
