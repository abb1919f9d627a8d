"""The model runner: turns a batch plan into tensors, runs the model, samples.

It never decides admission or eviction; it reads the request-to-token table the scheduler filled.
"""
from __future__ import annotations

import itertools
from typing import Callable

import torch

from hicache.runtime import prompt_logprobs
from hicache.runtime.attention import AttentionBackend
from hicache.runtime.batch import BatchPlan, ForwardBatch, RecurrentBatch, StepOutput
from hicache.runtime.bitmask import BitmaskFiller, PendingFill, allowed_ids
from hicache.runtime.lora.batch import LoraBatch
from hicache.runtime.pinned import tensor_to, to_device
from hicache.runtime.sampler import PendingSample, Sampler
from hicache.runtime.spec.verify import verify as spec_verify
from hicache.tiers.gpu.pool import DeviceKVPool
from hicache.tiers.gpu.req_table import ReqToTokenTable
from hicache.tiers.gpu.state import RecurrentStatePool


class ModelRunner:
    def __init__(self, model: torch.nn.Module, pool: DeviceKVPool, req_table: ReqToTokenTable,
                 attn: AttentionBackend, device: torch.device, cuda_graph: bool = False, max_batch: int = 256,
                 states: RecurrentStatePool | None = None):
        """`states`: the recurrent layers' state pool, for a model with such layers (whose decode
        runs without CUDA graphs)."""
        self.model = model
        self.states = states
        self.pool = pool
        self.req_table = req_table
        self.attn = attn
        self.device = device
        self.sampler = Sampler()
        self.bitmasks = BitmaskFiller(device)
        self.graphs = self._capture(max_batch) if cuda_graph and device.type == "cuda" and states is None else None

    def _capture(self, max_batch: int):
        """Decode CUDA graphs when the decode backend is triton or flashinfer (the torch one syncs)."""
        from hicache.runtime.cuda_graph import DecodeGraphs

        if not self.attn.graphs:
            return None
        return DecodeGraphs(self.model, self.pool, self.req_table, self.attn, self.device, max_batch)

    def run(self, plan: BatchPlan) -> StepOutput:
        """Runs the plan and waits for its tokens."""
        if plan.mode == "verify":
            return self.verify(plan)
        return self.launch(plan).result()

    @torch.inference_mode()
    def verify(self, plan: BatchPlan) -> StepOutput:
        """A verify step (speculative decoding): one extend pass computes every request's last
        token and its drafts; a request with drafts takes those the target accepts and one token
        more (runtime/spec/verify.py: logits at each of its positions), one without samples its
        next token as a decode step would (grammar bitmask, log-probs). It runs outside the
        decode CUDA graphs (an extend of 1 + k tokens a request, which they do not capture) and
        is not overlapped (`RuntimeConfig.features`: the next step's plan needs the accepted
        lengths on the host)."""
        plain = [i for i, d in enumerate(plan.drafts) if not d]
        drafted = [i for i, d in enumerate(plan.drafts) if d]
        fill = self.fill(plan.reqs, [not d for d in plan.drafts])
        ids, positions, batch = self._prepare(plan, None)
        hidden = self.model(ids, positions, batch)
        if plan.loads is not None:
            plan.loads.wait_layer(None)
        ends = list(itertools.accumulate(plan.extend_lens))
        logits = self.model.compute_logits(_take_rows(hidden, [ends[i] - 1 for i in plain])) if plain else None
        step = self.sample(plan, plain, logits, fill)
        blocks = [r for i in drafted for r in range(ends[i] - plan.extend_lens[i], ends[i])]
        accepted = spec_verify(self.model.compute_logits(_take_rows(hidden, blocks)),
                               [plan.reqs[i] for i in drafted], [plan.drafts[i] for i in drafted])
        out = step.result()
        extra: list[list[int]] = [[] for _ in plan.reqs]
        for i, tokens in zip(drafted, accepted):
            out.next_ids[i], extra[i] = tokens[0], tokens[1:]
        return out._replace(extra_ids=extra)

    def launch(self, plan: BatchPlan, input_ids: torch.Tensor | None = None) -> PendingStep:
        """Queues the forward pass and the sampling; the tokens reach the host in `result()`. The
        bitmask of the rows with a grammar is filled meanwhile (`fill`)."""
        fill = self.fill(plan.reqs, plan.sample)
        rows, logits = self.forward(plan, input_ids)
        return self.sample(plan, rows, logits, fill)

    def fill(self, reqs: list, sample: list[bool]) -> PendingFill | None:
        """Starts filling, on the filler's thread, the bitmask of those of `reqs` that sample (their
        matchers are fed the tokens recorded so far first; they must stay as they are until the
        step has sampled). None when none of them has a grammar."""
        grammars = [r.grammar for r, s in zip(reqs, sample) if s]
        return self.bitmasks.start(grammars, self.model.config.vocab_size) if any(grammars) else None

    def fence(self) -> torch.cuda.Event | None:
        """An event after the device work queued so far (None off CUDA, where work is not queued)."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    @torch.inference_mode()
    def forward(self, plan: BatchPlan, input_ids: torch.Tensor | None = None) -> tuple[list[int], torch.Tensor | None]:
        """Queues the forward pass (no host sync on CUDA, but for a load-back's first wait). Returns
        the plan's rows that sample and their logits [len(rows), V] float32 on the device (with a
        CUDA graph: a view valid until the next forward). An extend plan's prompt log-probs are
        queued too (`plan.prompt_logprobs`, runtime/prompt_logprobs.py). `input_ids` [N] int64 on
        the device, for a decode plan only: the token each request computes, instead of
        `req.all_ids[start]` (the previous step's samples, before the host has them)."""
        rows = [i for i, s in enumerate(plan.sample) if s]
        graph = self.graphs is not None and len(plan.reqs) <= self.graphs.max_batch and \
            not any(r.adapter for r in plan.reqs)
        if plan.mode == "decode" and graph:  # (a batch with LoRA adapters runs outside the graphs)
            if plan.loads is not None:  # a graph reads every layer: wait for whole load-backs
                plan.loads.wait_layer(None)
            ids = input_ids if input_ids is not None else [r.all_ids[s] for r, s in zip(plan.reqs, plan.starts)]
            logits = self.graphs.run(ids, [r.row for r in plan.reqs], [s + 1 for s in plan.starts])
            return rows, _take_rows(logits, rows)
        ids, positions, batch = self._prepare(plan, input_ids)
        hidden = self.model(ids, positions, batch)
        if plan.loads is not None:  # what follows on the compute stream comes after the whole load
            plan.loads.wait_layer(None)
        if plan.mode == "extend":
            plan.prompt_logprobs = prompt_logprobs.launch(self.model, hidden, self.prompt_rows(plan))
        if not rows:
            return rows, None
        ends = list(itertools.accumulate(plan.extend_lens))
        return rows, self.model.compute_logits(_take_rows(hidden, [ends[i] - 1 for i in rows]))

    def prompt_rows(self, plan: BatchPlan) -> prompt_logprobs.PromptRows | None:
        """The positions of an extend plan whose prompt log-probs its pass computes."""
        return prompt_logprobs.select_rows(plan)

    def _prepare(self, plan: BatchPlan, input_ids: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor, ForwardBatch]:
        ids, locs, token_slots = [], [], []
        for i, (req, start, n) in enumerate(zip(plan.reqs, plan.starts, plan.extend_lens)):
            if input_ids is None:
                ids.extend(plan.input_ids(i))
            slots = self.req_table.read(req.row, start + n)
            locs.append(slots[start:])
            token_slots.append(slots)
        mode = "extend" if plan.mode == "verify" else plan.mode  # a verify step attends as an extend
        batch = ForwardBatch(mode, self.attn, self.pool, torch.cat(locs), plan.extend_lens, token_slots,
                             wait_kv=plan.loads.wait_layer if plan.loads is not None else None,
                             lora=LoraBatch.build([r.adapter for r in plan.reqs], plan.extend_lens, self.device))
        lens = torch.tensor(plan.extend_lens)
        starts = torch.tensor(plan.starts)
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(plan.starts, plan.extend_lens)])
        meta = to_device(torch.cat([torch.tensor([r.row for r in plan.reqs]), starts, lens, lens.cumsum(0) - lens,
                                    positions] + ([] if input_ids is not None else [torch.tensor(ids)])),
                         self.device)  # one copy
        n, total = len(plan.reqs), positions.numel()
        batch.req_to_token = self.req_table.table
        batch.req_rows, batch.prefix_lens, batch.extend_lens_dev, batch.q_starts = meta[:4 * n].view(4, n).unbind(0)
        batch.max_extend = max(plan.extend_lens)
        batch.kv_lens = [s + n for s, n in zip(plan.starts, plan.extend_lens)]
        batch.max_seq_len = max(batch.kv_lens)
        if plan.mode == "decode":
            batch.seq_lens = batch.prefix_lens + 1
            batch.slot_table = self.req_table.table[batch.req_rows, : batch.max_seq_len]
        batch.attach_window(batch.max_seq_len)
        if self.states is not None:
            held = [r.lease.states for r in plan.reqs]
            page = self.pool.allocator.page_size
            batch.states = RecurrentBatch.build(
                self.states, [st.working for st in held],
                [st.targets(s, n, page) for st, s, n in zip(held, plan.starts, plan.extend_lens)], self.device)
        ids_dev = input_ids if input_ids is not None else meta[4 * n + total:]
        return ids_dev, meta[4 * n:4 * n + total], batch

    def sample(self, plan: BatchPlan, rows: list[int], logits: torch.Tensor | None,
               fill: PendingFill | None = None) -> PendingStep:
        """The sampling of `rows` (from `forward`); reads the requests' history on the host. Queued
        at once, unless a row has a grammar whose bitmask (`fill`, from `fill`: of these rows, in
        order; started here when not given) is still being filled: then the sampling is queued
        when the step's tokens are first needed (`PendingStep.launch`), so that the host plans
        the next step while the mask is filled. Until then the requests' tokens and matchers must
        stay as they are."""
        if not rows:
            return PendingStep(len(plan.reqs), rows, None, plan.prompt_logprobs)
        reqs = [plan.reqs[i] for i in rows]
        bitmask = fill or self.fill(reqs, [True] * len(reqs))
        args = (logits, [r.params for r in reqs], [r.generator for r in reqs], [r.input_ids for r in reqs],
                [r.output_ids for r in reqs], [r.top_logprobs_num for r in reqs], [r.return_logprob for r in reqs])

        def launch() -> tuple[PendingSample, torch.Tensor | None]:
            mask = None if bitmask is None else bitmask.result()
            with torch.inference_mode():
                return self.sampler.launch(*args, mask), mask

        step = PendingStep(len(plan.reqs), rows, launch, plan.prompt_logprobs)
        if bitmask is None or bitmask.done():
            step.launch()
        return step

    def check_health(self) -> None:
        """Raises when a part the runner depends on has failed (tensor-parallel ranks: runtime/tp.py)."""

    def close(self) -> None:
        self.bitmasks.close()


def _take_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t[rows] (rows ascending), without an index copy when they are all of t's rows."""
    if len(rows) == t.shape[0]:
        return t
    return t[tensor_to(rows, t.device)]


class PendingStep:
    """A step whose sampling is queued (`launch()`, at the latest by `next_ids` or `result()`):
    the sampled tokens of the sampling rows on the device (`next_ids`, [len(rows)] int64), the
    plan's `StepOutput` once `result()` has waited for them (and for its prompt log-probs, if any).
    `sample` queues the sampling and returns the grammars' host bitmask it applied, if any."""

    def __init__(self, num_reqs: int, rows: list[int],
                 sample: Callable[[], tuple[PendingSample, torch.Tensor | None]] | None,
                 prompt: prompt_logprobs.PendingPromptLogprobs | None = None):
        self.num_reqs, self.rows, self.prompt = num_reqs, rows, prompt
        self._sample = sample
        self.pending: PendingSample | None = None
        self._mask: torch.Tensor | None = None

    def launch(self) -> None:
        """Queues the sampling (once)."""
        if self._sample is not None:
            (self.pending, self._mask), self._sample = self._sample(), None

    @property
    def next_ids(self) -> torch.Tensor | None:
        self.launch()
        return None if self.pending is None else self.pending.next_ids

    def result(self) -> StepOutput:
        self.launch()
        n = self.num_reqs
        out = StepOutput([None] * n, [None] * n, [None] * n,
                         [None] * n if self.prompt is None else self.prompt.result())
        if self.pending is None:
            return out
        res = self.pending.result()
        for j, i in enumerate(self.rows):
            out.next_ids[i], out.logprobs[i] = res.next_ids[j], res.logprobs[j]
            out.top_logprobs[i] = res.top_logprobs[j]
        if self._mask is None:
            return out
        allowed: list[bool | None] = [None] * n
        for i, ok in zip(self.rows, allowed_ids(self._mask, res.next_ids)):
            allowed[i] = ok
        return out._replace(allowed=allowed)
