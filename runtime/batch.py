"""What one scheduling step runs: the scheduler's plan and the runner's tensors for it."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import torch

if TYPE_CHECKING:
    from hicache.manager import LoadHandle
    from hicache.runtime.request import Req
    from hicache.tiers.gpu.pool import DeviceKVPool


@dataclass
class BatchPlan:
    """Made by `Scheduler.schedule()`, run by `ModelRunner.run()`, applied by `process_result()`.

    For request i: compute tokens [starts[i], starts[i] + extend_lens[i]) of `req.all_ids`; the KV
    slots of tokens [0, starts[i] + extend_lens[i]) are already in the request-to-token table.
    sample[i] is False for a prefill chunk that does not reach the end of `all_ids`.
    A "verify" plan (speculative decoding) is a decode step whose requests compute their last
    token followed by their draft tokens, `drafts[i]` (extend_lens[i] = 1 + len(drafts[i]); the
    slots of the drafts are in the table too), with logits at every position.
    `loads` is set when some request's prefix is still being loaded back from L2: the pass calls
    its `wait_layer` with each layer before that layer's attention (`hicache.manager.LoadHandle`).
    """

    mode: str  # "extend" | "decode" | "verify"
    reqs: list[Req]
    starts: list[int]
    extend_lens: list[int]
    sample: list[bool]
    loads: LoadHandle | None = None
    rng_states: dict = field(default_factory=dict)  # id(req) -> generator state before a sample that may be dropped
    prompt_logprobs: Any = None  # set by ModelRunner.forward: its PendingPromptLogprobs (runtime/prompt_logprobs.py)
    created: float = field(default_factory=time.perf_counter)  # when planned: its result's wait measures prefill
    joined: bool = False  # an extend that the decoding requests joined (a forced run's step: jump-forward)
    drafts: list[list[int]] | None = None  # a verify plan's draft tokens per request (empty: none)

    def add(self, req: Req, start: int, n: int, sample: bool) -> None:
        self.reqs.append(req)
        self.starts.append(start)
        self.extend_lens.append(n)
        self.sample.append(sample)

    def input_ids(self, i: int) -> list[int]:
        """The tokens chunk i computes: of its request's `all_ids`, then its drafts."""
        req, start, n = self.reqs[i], self.starts[i], self.extend_lens[i]
        if not self.drafts or not self.drafts[i]:
            return req.all_ids[start:start + n]
        return req.all_ids[start:start + n - len(self.drafts[i])] + self.drafts[i]

    def past_prompt(self, i: int) -> bool:
        """Whether chunk i starts past its request's prompt (a forced run, or a decode position)."""
        return self.starts[i] >= len(self.reqs[i].input_ids)

    def kv_tokens(self) -> int:
        """KV tokens its requests hold once it has run (cached prefixes included)."""
        return sum(s + n for s, n in zip(self.starts, self.extend_lens))


class RecurrentBatch(NamedTuple):
    """The recurrent layers' part of a pass (a model with recurrent layers only): each request's
    working slot of the state pool (`tiers/gpu/state.py`), and the snapshots to take, as
    (request i, offset j in its chunk, slot): the state after the chunk's token j is copied into
    that slot (the state at a page boundary the chunk reaches)."""

    pool: Any  # a RecurrentStatePool
    slots: list[int]  # per request
    slots_dev: torch.Tensor  # [N] int64, device: the same
    snapshots: list[tuple[int, int, int]]

    @classmethod
    def build(cls, pool: Any, slots: list[int], targets: list[list[tuple[int, int]]],
              device: torch.device) -> RecurrentBatch:
        """`targets[i]`: request i's snapshots, (offset j in its chunk, slot)."""
        snapshots = [(i, j, dst) for i, pairs in enumerate(targets) for j, dst in pairs]
        return cls(pool, slots, torch.tensor(slots, dtype=torch.int64, device=device), snapshots)

    def snapshots_of(self, i: int) -> dict[int, list[int]]:
        """Request i's snapshots: offset in its chunk -> the slots that get the state after it."""
        out: dict[int, list[int]] = {}
        for r, j, dst in self.snapshots:
            if r == i:
                out.setdefault(j, []).append(dst)
        return out


@dataclass
class ForwardBatch:
    """Tensors for one forward pass, read by the model and the attention backend."""

    mode: str
    attn: Any  # an attention backend (runtime/attention/)
    pool: DeviceKVPool
    out_cache_loc: torch.Tensor  # [T] int64, device: slots of the new tokens
    extend_lens: list[int]
    token_slots: list[torch.Tensor]  # extend: per request [start + extend_len] int64 slots
    slot_table: torch.Tensor | None = None  # decode: [B, L] int64
    seq_lens: torch.Tensor | None = None  # decode: [B] int64
    # For kernels that read the request-to-token table directly (triton):
    req_to_token: torch.Tensor | None = None  # [R, C] int64, device: the whole table
    req_rows: torch.Tensor | None = None  # [N] int64, device: each request's row
    prefix_lens: torch.Tensor | None = None  # [N] int64, device: tokens before the new ones
    extend_lens_dev: torch.Tensor | None = None  # [N] int64, device
    q_starts: torch.Tensor | None = None  # [N] int64, device: first new token of each request in q
    max_extend: int = 0
    max_seq_len: int = 0
    kv_lens: list[int] = field(default_factory=list)  # per request: KV tokens once the pass has run
    graph_state: Any = None  # inside a captured decode graph: the backend's state for its batch size
    wait_kv: Callable[[int | None], None] | None = None  # BatchPlan.loads.wait_layer, before each attention
    window: ForwardBatch | None = None  # with a windowed pool: this batch over the windowed layers' slots
    lora: Any = None  # a LoraBatch (runtime/lora/batch.py) when some request runs under a LoRA adapter
    states: RecurrentBatch | None = None  # with recurrent layers: the requests' state slots

    def wait_layer(self, layer_id: int) -> None:
        if self.wait_kv is not None:
            self.wait_kv(layer_id)

    def for_layer(self, layer_id: int) -> ForwardBatch:
        """The batch whose slots index layer `layer_id`'s buffers: `window` for a windowed layer
        of a pool that keeps those layers apart, else this one."""
        if self.window is not None and layer_id in self.pool.window_layers:
            return self.window
        return self

    def attach_window(self, width: int) -> None:
        """Sets `window` when the pool keeps its windowed layers apart: every slot translated
        through the pool's window map (a slot without its window part reads window slot 0, which
        the kernels mask: it lies before every query's window), and the request-to-token table
        cut to this batch's rows (row i: request i, `width` columns)."""
        if not self.pool.window_layers:
            return
        wmap = self.pool.allocator.device_map

        def tr(t: torch.Tensor) -> torch.Tensor:
            return wmap[t].clamp_(min=0)

        table = None if self.req_to_token is None else tr(self.req_to_token[self.req_rows, :width])
        rows = None if table is None else torch.arange(table.shape[0], device=table.device)
        self.window = dataclasses.replace(
            self, out_cache_loc=tr(self.out_cache_loc), token_slots=[tr(s) for s in self.token_slots],
            slot_table=None if self.slot_table is None else tr(self.slot_table), req_to_token=table, req_rows=rows)


class StepOutput(NamedTuple):
    """Per request of the plan: the sampled token (None where the plan did not sample), the
    prompt log-probs its chunk scored (`PendingPromptLogprobs.result`; None where none), and
    whether the grammars' bitmask allowed the token (None where the step sampled without one).
    A verify step's `extra_ids[i]` are the tokens request i produced after `next_ids[i]`: the two
    together are its accepted drafts followed by one token of the target's (None for other steps)."""

    next_ids: list[int | None]
    logprobs: list[float | None]
    top_logprobs: list[list | None]
    input_logprobs: list[list | None]
    allowed: list[bool | None] | None = None
    extra_ids: list[list[int]] | None = None
