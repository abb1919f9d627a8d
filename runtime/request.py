"""A request's state inside the scheduler, and its status."""
from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING

import torch

from hicache.manager import Lease
from hicache.runtime.grammar import RequestGrammar
from hicache.runtime.lora.adapter import LoraAdapter
from hicache.runtime.sampling import SamplingParams

if TYPE_CHECKING:
    from hicache.runtime.disagg import Bootstrap
    from hicache.runtime.disagg.receiver import Transfer
    from hicache.runtime.spec.drafter import SpecState


class Status(Enum):
    """Where a request stands (`Req.status`)."""

    WAITING = "waiting"  # queued, holding no KV
    PREFETCHING = "prefetching"  # queued; the L3 prefetch policy held it back when admission last looked
    LOADING = "loading"  # running; a load-back of its cached prefix from L2 may still be in flight
    TRANSFERRING = "transferring"  # running; its prompt's KV is on its way from the prefill server (runtime/disagg/)
    PREFILL = "prefill"  # running; its next step computes tokens before its last (prompt, forced run)
    DECODE = "decode"  # running; its next step computes its last token and samples the next
    FINISHED = "finished"  # left the scheduler: finished or aborted


class Req:
    """One generation request as the scheduler sees it.

    What it holds of the KV cache is its `lease` (`hicache.manager.Lease`: table row, slots, the
    tree's prefix). `kv_len` tokens of `all_ids` have their KV computed; the lease's slots may run
    past kv_len up to the end of the last allocated page.

    Its `status` is derived, not stored: from `finished` and `prefetch_wait` (set by the
    scheduler's parts), its lease (held, loading) and `kv_len` against `seq_len`.
    """

    def __init__(self, rid: str, input_ids: list[int], params: SamplingParams, namespace: str,
                 generator: torch.Generator | None, return_logprob: bool, top_logprobs_num: int,
                 logprob_start_len: int = -1):
        self.rid = rid
        self.input_ids = input_ids
        self.params = params
        self.namespace = namespace
        self.generator = generator
        self.return_logprob = return_logprob
        self.top_logprobs_num = top_logprobs_num
        self.output_ids: list[int] = []
        # prompt log-probs: tokens [input_logprob_start, len(input_ids)) get an entry (none when
        # that is the prompt's length); position p's logits score prompt token p + 1
        n = len(input_ids)
        self.input_logprob_start = logprob_start_len if return_logprob and 0 <= logprob_start_len < n else n
        self.input_logprobs: list = []  # [logprob, top] of positions input_logprob_start, +1, ... so far
        self.input_logprobs_sent = False
        self.lease = Lease(namespace, self)
        self.kv_len = 0
        self.cached_tokens: int | None = None  # prefix served from cache at first admission
        self.cached_host = 0  # the part of cached_tokens loaded back from L2 (and in L2 before it arrived)
        self.cached_storage = 0  # the part of cached_tokens that its L3 prefetch brought into L2
        self.storage_range = (0, 0)  # prompt tokens [start, end) its committed L3 prefetch inserted
        self.load_back_failed = False  # a load-back it waited for failed: recompute, never reload
        self.arrival_seq = 0
        self.cache_kv = True  # False: give the tree nothing of it when it finishes (the warm-up request)
        self.publish_prompt = False  # a waiting request shares its prompt: cache it once computed
        self.grammar: RequestGrammar | None = None  # its matcher, when its params carry a grammar
        self.finished = False  # it left the scheduler's queues (finished or aborted): `QueueState.remove`
        self.prefetch_wait = False  # the L3 prefetch policy kept it waiting when admission last looked
        self.spec: SpecState | None = None  # its drafting state, once speculative decoding has looked at it
        self.adapter: LoraAdapter | None = None  # its LoRA adapter (part of `namespace`), None: the base model
        self.bootstrap: Bootstrap | None = None  # its other half under disaggregation (None: colocated)
        self.incoming: Transfer | None = None  # its prompt's KV in flight from the prefill server (decode side)

    @property
    def status(self) -> Status:
        if self.finished:
            return Status.FINISHED
        if not self.lease.held:
            return Status.PREFETCHING if self.prefetch_wait else Status.WAITING
        if self.lease.loading:
            return Status.LOADING
        return self.phase

    @property
    def phase(self) -> Status:
        """What its next step computes, whether or not its prefix is still loading: `PREFILL`
        (tokens before its last: a prompt chunk, a forced run, outputs recomputed after a
        retraction) or `DECODE` (its last token, sampling the next); `TRANSFERRING`: none yet,
        its prompt's KV is on its way."""
        if self.incoming is not None:
            return Status.TRANSFERRING
        return Status.DECODE if self.kv_len >= self.seq_len - 1 else Status.PREFILL

    @property
    def prompt_left(self) -> int:
        """Prompt tokens whose KV is not computed yet."""
        return max(0, len(self.input_ids) - self.kv_len)

    @property
    def all_ids(self) -> list[int]:
        """Prompt plus outputs. A step computes all_ids[kv_len : kv_len + n] and samples when that
        reaches the end; a decoding request has kv_len == len(all_ids) - 1."""
        return self.input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    def input_logprob_positions(self, start: int, n: int) -> tuple[int, int]:
        """The positions [a, b) of a chunk computing tokens [start, start + n) whose prompt
        log-probs are still missing (a == b: none)."""
        a = max(start, self.input_logprob_start + len(self.input_logprobs))
        return a, max(a, min(start + n, len(self.input_ids) - 1))

    @property
    def prefix_limit(self) -> int:
        """How many tokens of `all_ids` a cache match may cover: all but the last, and none from
        the first position whose prompt log-prob is still missing (that position is recomputed)."""
        need = self.input_logprob_start + len(self.input_logprobs)
        return min(self.seq_len - 1, need) if need < len(self.input_ids) - 1 else self.seq_len - 1

    def take_input_logprobs(self) -> list | None:
        """The prompt log-prob entries for `TokenOutput.input_logprobs`, once they are all computed,
        once (None before, after, or when none were asked for)."""
        n = len(self.input_ids)
        if self.input_logprobs_sent or self.input_logprob_start == n or \
                self.input_logprob_start + len(self.input_logprobs) < n - 1:
            return None
        self.input_logprobs_sent = True
        return [[None, None]] + self.input_logprobs

    @property
    def holds_kv(self) -> bool:
        return self.lease.held

    @property
    def row(self) -> int | None:
        """Its row of the request-to-token table while it holds KV."""
        return self.lease.row

    def __repr__(self) -> str:
        return (f"Req({self.rid!r}, prompt={len(self.input_ids)}, out={len(self.output_ids)}, kv={self.kv_len}, "
                f"{self.status.value})")


def check_logprob_start(start: int, prompt_len: int) -> None:
    """Raises ValueError naming `logprob_start_len` unless it is -1 or in [0, prompt_len]."""
    if isinstance(start, bool) or not isinstance(start, int) or not -1 <= start <= prompt_len:
        raise ValueError(f"logprob_start_len: must be -1 (no prompt log-probs) or in [0, {prompt_len}] "
                         f"(the prompt's length), got {start!r}")


def check_prompt(ids: list[int], max_new_tokens: int, vocab_size: int, context_length: int, kv_tokens: int) -> None:
    """Raises ValueError naming `input_ids` unless the prompt is non-empty, its ids are in the
    vocabulary, and prompt + max_new_tokens fit the context and the KV pool (`kv_tokens`)."""
    if not ids:
        raise ValueError("input_ids: the prompt is empty")
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise ValueError(f"input_ids: token ids must be in [0, {vocab_size})")
    if len(ids) + max_new_tokens > context_length:
        raise ValueError(f"input_ids: prompt of {len(ids)} tokens + max_new_tokens {max_new_tokens} "
                         f"exceeds the context length {context_length}")
    if len(ids) + max_new_tokens > kv_tokens:
        raise ValueError(f"input_ids: prompt + max_new_tokens ({len(ids) + max_new_tokens}) exceeds "
                         f"the KV pool ({kv_tokens} tokens)")
