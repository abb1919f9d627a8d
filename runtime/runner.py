"""The model runner: turns a batch plan into tensors, runs the model, samples.

It never decides admission or eviction; it reads the request-to-token table the scheduler filled.
"""
from __future__ import annotations

import torch

from hicache.runtime.attention import AutoAttention, TritonAttention
from hicache.runtime.batch import BatchPlan, ForwardBatch, StepOutput
from hicache.runtime.sampler import Sampler
from hicache.tiers.gpu.pool import DeviceKVPool
from hicache.tiers.gpu.req_table import ReqToTokenTable


class ModelRunner:
    def __init__(self, model: torch.nn.Module, pool: DeviceKVPool, req_table: ReqToTokenTable,
                 attn, device: torch.device, cuda_graph: bool = False, max_batch: int = 256):
        self.model = model
        self.pool = pool
        self.req_table = req_table
        self.attn = attn
        self.device = device
        self.sampler = Sampler()
        self.graphs = self._capture(max_batch) if cuda_graph and device.type == "cuda" else None

    def _capture(self, max_batch: int):
        """Decode CUDA graphs when the attention backend is triton (the torch one syncs)."""
        from hicache.runtime.cuda_graph import DecodeGraphs

        impl = self.attn.resolve(self.device) if isinstance(self.attn, AutoAttention) else self.attn
        if not isinstance(impl, TritonAttention):
            return None
        hkv = self.pool.k_buffer(0).shape[1]
        return DecodeGraphs(self.model, self.pool, self.req_table, self.attn, self.device, max_batch,
                            lambda bs, max_len: impl.splits_for(bs, hkv, max_len, self.device))

    @torch.inference_mode()
    def run(self, plan: BatchPlan) -> StepOutput:
        if plan.mode == "decode" and self.graphs is not None and len(plan.reqs) <= self.graphs.max_batch:
            if plan.kv_wait is not None:  # a graph reads every layer: wait for whole load-backs
                plan.kv_wait(None)
            logits = self.graphs.run([r.all_ids[s] for r, s in zip(plan.reqs, plan.starts)],
                                     [r.row for r in plan.reqs], [s + 1 for s in plan.starts])
            rows = [i for i, s in enumerate(plan.sample) if s]
            return self._sample(plan, rows, logits[rows])
        input_ids, positions, batch = self._prepare(plan)
        hidden = self.model(input_ids, positions, batch)
        if plan.kv_wait is not None:  # what follows on the compute stream comes after the whole load
            plan.kv_wait(None)
        rows = [i for i, s in enumerate(plan.sample) if s]
        if not rows:
            return StepOutput([None] * len(plan.reqs), [None] * len(plan.reqs), [None] * len(plan.reqs))
        ends = torch.tensor(plan.extend_lens, device=self.device).cumsum(0) - 1
        logits = self.model.compute_logits(hidden[ends[rows]])
        return self._sample(plan, rows, logits)

    def _prepare(self, plan: BatchPlan) -> tuple[torch.Tensor, torch.Tensor, ForwardBatch]:
        ids, pos, locs, token_slots = [], [], [], []
        for req, start, n in zip(plan.reqs, plan.starts, plan.extend_lens):
            ids.extend(req.all_ids[start:start + n])
            pos.append(torch.arange(start, start + n))
            slots = self.req_table.read(req.row, start + n)
            locs.append(slots[start:])
            token_slots.append(slots)
        batch = ForwardBatch(plan.mode, self.attn, self.pool, torch.cat(locs), plan.extend_lens, token_slots,
                             wait_kv=plan.kv_wait)
        lens = torch.tensor(plan.extend_lens)
        meta = torch.stack([torch.tensor([r.row for r in plan.reqs]), torch.tensor(plan.starts), lens,
                            lens.cumsum(0) - lens]).to(self.device, non_blocking=True)  # one copy
        batch.req_to_token = self.req_table.table
        batch.req_rows, batch.prefix_lens, batch.extend_lens_dev, batch.q_starts = meta.unbind(0)
        batch.max_extend = max(plan.extend_lens)
        batch.max_seq_len = max(s + n for s, n in zip(plan.starts, plan.extend_lens))
        if plan.mode == "decode":
            batch.seq_lens = batch.prefix_lens + 1
            batch.slot_table = self.req_table.table[batch.req_rows, : batch.max_seq_len]
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        return input_ids, torch.cat(pos).to(self.device), batch

    def _sample(self, plan: BatchPlan, rows: list[int], logits: torch.Tensor) -> StepOutput:
        reqs = [plan.reqs[i] for i in rows]
        res = self.sampler.sample(
            logits, [r.params for r in reqs], [r.generator for r in reqs],
            [r.input_ids for r in reqs], [r.output_ids for r in reqs],
            [r.top_logprobs_num for r in reqs], [r.return_logprob for r in reqs])
        out = StepOutput([None] * len(plan.reqs), [None] * len(plan.reqs), [None] * len(plan.reqs))
        for j, i in enumerate(rows):
            out.next_ids[i], out.logprobs[i], out.top_logprobs[i] = res.next_ids[j], res.logprobs[j], res.top_logprobs[j]
        return out
