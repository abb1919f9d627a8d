"""GPU benchmark: the hardware floors, then our kernels and model steps, with ratios to the floors.

    python benchmarks/gpu.py [--parts kernels,l1,l2,hf] [--floors floors.json] [--json out.json]
                             [--overlap off|on|both] [--decode-batches 1,16,64,256] [--l1-tokens N]
                             [--rounds-configs L1,L1+L2,...] [--profile trace.json] [--io-backend direct|kernel]
                             [--attention-backend auto|flashinfer|triton]

Shapes are Llama-3.1-8B's (benchmarks/configs/llama-3.1-8b.json, dummy weights, bf16). Floors:
device-to-device copy (bytes read + written / s), pinned host<->device copies of 1 GiB, bf16 GEMM
8192^3. Parts: `kernels` (one layer's decode / extend attention, Triton's and FlashInfer's when
installed, decode-sized linears through cuBLAS and through the Triton few-row kernel, then
`transfers`: 32k-token load-back, also with the engine's cap on programs, and backup), `l1`
(decode steps at batch 1..256 with context 2k, with overlap scheduling off and on, an 8k prefill,
through the Engine), `l2` (an extend of 1k tokens after a 31k prefix resident vs loaded back from
L2), `rounds` (the GPU multi-turn workload of benchmarks/RESULTS.md, in process: L1 only, L1 + L2,
and L1 holding everything; `--profile` traces a round of L1 + L2), `hf` (64 x 1k prompts x 128 new
tokens, HF transformers vs ours, medians of 3 runs, and the bound from the floors). Run the model
parts in separate processes so that each engine's GPU memory is released. Kernel timings are
medians with CUDA events; model timings are wall clock around `Engine.generate`.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

CONFIG = Path(__file__).resolve().parent / "configs" / "llama-3.1-8b.json"
LAYERS, HQ, HKV, D = 32, 32, 8, 128
KV_TOKEN_BYTES = 2 * LAYERS * HKV * D * 2  # 128 KiB
IO_BACKEND = "direct"  # the engines' hicache_io_backend (--io-backend)
ATTENTION_BACKEND = "auto"  # the engines' attention_backend (--attention-backend)
GiB = 2**30


def timed(fn, reps: int = 10, warmup: int = 3) -> float:
    """Median seconds of `fn()` over `reps` runs (CUDA events)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def graph_timed(fn, reps: int = 20) -> float:
    """Median seconds of one replay of `fn` captured in a CUDA graph: GPU time, no launch overhead."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # builds the kernels
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return timed(graph.replay, reps=reps)


def row(name: str, value: str, ratio: str = "") -> None:
    print(f"| {name} | {value} | {ratio} |", flush=True)


# ---- floors ---------------------------------------------------------------------------------

def floors() -> dict:
    f = {}
    a = torch.empty(2 * GiB, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    t = timed(lambda: b.copy_(a))
    f["d2d_bytes_per_s"] = 2 * a.numel() / t
    row("D2D copy 2 GiB (read+write)", f"{f['d2d_bytes_per_s'] / 1e12:.2f} TB/s")
    del a, b
    host = torch.empty(GiB, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(GiB, dtype=torch.uint8, device="cuda")
    f["h2d_bytes_per_s"] = GiB / timed(lambda: dev.copy_(host, non_blocking=True), reps=5)
    f["d2h_bytes_per_s"] = GiB / timed(lambda: host.copy_(dev, non_blocking=True), reps=5)
    row("pinned H2D 1 GiB", f"{f['h2d_bytes_per_s'] / 1e9:.1f} GB/s")
    row("pinned D2H 1 GiB", f"{f['d2h_bytes_per_s'] / 1e9:.1f} GB/s")
    del host, dev
    n = 8192
    x = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    y = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    f["gemm_flops"] = 2 * n**3 / timed(lambda: x @ y)
    row("bf16 GEMM 8192^3", f"{f['gemm_flops'] / 1e12:.0f} TFLOP/s")
    return f


# ---- kernels --------------------------------------------------------------------------------

def paged_rows(batch: int, length: int, page_size: int = 64) -> tuple[torch.Tensor, int]:
    """[batch, length] slots on shuffled pages; returns (table, pool slots)."""
    pages = -(-length // page_size)
    order = torch.randperm(batch * pages, device="cuda")
    ar = torch.arange(page_size, device="cuda")
    table = (order.view(batch, pages, 1) * page_size + ar).view(batch, -1)[:, :length].contiguous()
    return table, batch * pages * page_size


def kernels(f: dict) -> dict:
    from hicache.kernels.decode import decode_attention, default_num_splits
    from hicache.kernels.extend import extend_attention

    out = {}
    for batch in (1, 16, 64, 256):
        table, slots = paged_rows(batch, 2048)
        k = torch.randn(slots, HKV, D, dtype=torch.bfloat16, device="cuda")
        v = torch.randn_like(k)
        q = torch.randn(batch, HQ, D, dtype=torch.bfloat16, device="cuda")
        rows = torch.arange(batch, device="cuda")
        lens = torch.full((batch,), 2048, device="cuda")
        splits = default_num_splits(batch, HKV, 2048, torch.cuda.get_device_properties(0).multi_processor_count)
        t = graph_timed(lambda: decode_attention(q, k, v, table, rows, lens, D ** -0.5, num_splits=splits))
        floor = batch * 2048 * HKV * D * 2 * 2 / f["d2d_bytes_per_s"]
        out[f"decode_attn_b{batch}_s"] = t
        row(f"decode attention, 1 layer, batch {batch} x 2k ({splits} splits, graph)", f"{t * 1e6:.1f} us",
            f"{t / floor:.2f}x the KV-read floor {floor * 1e6:.1f} us")
        del k, v
    for prefix, ext in ((0, 8192), (31 * 1024, 1024)):
        table, slots = paged_rows(1, prefix + ext)
        k = torch.randn(slots, HKV, D, dtype=torch.bfloat16, device="cuda")
        v = torch.randn_like(k)
        q = torch.randn(ext, HQ, D, dtype=torch.bfloat16, device="cuda")
        zero, pre, n = (torch.tensor([x], device="cuda") for x in (0, prefix, ext))
        t = timed(lambda: extend_attention(q, k, v, table, zero, pre, n, zero, ext, D ** -0.5))
        flops = 4 * HQ * D * ext * (prefix + (ext + 1) / 2)
        out[f"extend_attn_p{prefix}_e{ext}_s"] = t
        row(f"extend attention, 1 layer, prefix {prefix} + {ext} new", f"{t * 1e3:.2f} ms",
            f"{flops / t / 1e12:.0f} TFLOP/s = {flops / t / f['gemm_flops']:.2f} of GEMM")
        del k, v
    out |= flashinfer_kernels(f)
    out |= linears(f)
    out |= transfers(f)
    return out


def flashinfer_kernels(f: dict) -> dict:
    """The same attention shapes through FlashInfer's kernels (`hicache.kernels.flashinfer`), when installed."""
    from hicache.kernels import flashinfer as fi

    if not fi.available():
        row("flashinfer attention", "not installed")
        return {}
    out = {}
    workspace = torch.zeros(fi.WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    for batch in (1, 16, 64, 256):
        table, slots = paged_rows(batch, 2048)
        k = torch.randn(slots, HKV, D, dtype=torch.bfloat16, device="cuda")
        v = torch.randn_like(k)
        q = torch.randn(batch, HQ, D, dtype=torch.bfloat16, device="cuda")
        buffers = fi.PagedAttention.graph_buffers(batch, batch * 2048, torch.device("cuda"))
        floor = batch * 2048 * HKV * D * 2 * 2 / f["d2d_bytes_per_s"]
        for cores in (False, True):
            attn = fi.PagedAttention(HQ, HKV, D, torch.bfloat16, workspace, batch, buffers,
                                     tensor_cores=cores)
            attn.plan_decode(table.reshape(-1).int(), [2048] * batch, D ** -0.5)
            t = graph_timed(lambda: attn.run(q, k, v))
            out[f"flashinfer_decode_attn_b{batch}{'_tc' * cores}_s"] = t
            row(f"flashinfer decode attention{' (tensor cores)' * cores}, 1 layer, batch {batch} x 2k (graph)",
                f"{t * 1e6:.1f} us", f"{t / floor:.2f}x the KV-read floor {floor * 1e6:.1f} us")
        del k, v
    attn = fi.PagedAttention(HQ, HKV, D, torch.bfloat16, workspace)
    for prefix, ext in ((0, 8192), (31 * 1024, 1024)):
        table, slots = paged_rows(1, prefix + ext)
        k = torch.randn(slots, HKV, D, dtype=torch.bfloat16, device="cuda")
        v = torch.randn_like(k)
        q = torch.randn(ext, HQ, D, dtype=torch.bfloat16, device="cuda")
        attn.plan_extend(table.reshape(-1).int(), [ext], [prefix + ext], D ** -0.5)
        t = timed(lambda: attn.run(q, k, v))
        flops = 4 * HQ * D * ext * (prefix + (ext + 1) / 2)
        out[f"flashinfer_extend_attn_p{prefix}_e{ext}_s"] = t
        row(f"flashinfer extend attention, 1 layer, prefix {prefix} + {ext} new", f"{t * 1e3:.2f} ms",
            f"{flops / t / 1e12:.0f} TFLOP/s = {flops / t / f['gemm_flops']:.2f} of GEMM")
        del k, v
    return out


def linears(f: dict) -> dict:
    """Decode-sized linears, cuBLAS (F.linear) against the Triton few-row kernel, per Llama weight:
    8 copies of the weight (past L2) in one CUDA graph, per-launch median."""
    from hicache.kernels.linear import linear_rows, prefers

    out = {}
    shapes = {"q/k/v": (HQ * D + 2 * HKV * D, 4096), "o": (4096, HQ * D), "gate/up": (2 * 14336, 4096),
              "down": (4096, 14336)}
    for name, (n, k) in shapes.items():
        ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(8)]
        floor = n * k * 2 / f["d2d_bytes_per_s"]
        for m in (1, 16):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            cublas = graph_timed(lambda: [torch.nn.functional.linear(x, w) for w in ws]) / len(ws)
            ours = graph_timed(lambda: [linear_rows(x, w) for w in ws]) / len(ws)
            out[f"linear_{name}_m{m}_cublas_s"], out[f"linear_{name}_m{m}_triton_s"] = cublas, ours
            row(f"linear {name} {n}x{k}, {m} rows: cuBLAS / Triton (the model takes "
                f"{'Triton' if prefers(x, ws[0]) else 'cuBLAS'})", f"{cublas * 1e6:.1f} / {ours * 1e6:.1f} us",
                f"{cublas / floor:.2f}x / {ours / floor:.2f}x the weight-read floor")
        del ws
    return out


def transfers(f: dict) -> dict:
    from hicache.kernels.transfer import copy_kv, layer_pointers
    from hicache.tiers.host.copy_engine import BatchCopier, page_copies
    from hicache.tiers.host.pool import HostKVPool
    from hicache.config import HiCacheConfig

    out = {}
    blocks = HiCacheConfig().hicache_load_blocks  # the engine's default cap on programs
    tokens, page = 32 * 1024, 64
    k_bufs = [torch.zeros(tokens + 4096, HKV, D, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
    v_bufs = [torch.zeros_like(b) for b in k_bufs]
    ptrs = layer_pointers(k_bufs, v_bufs)
    dslots = (torch.randperm((tokens + 4096) // page, device="cuda")[: tokens // page, None] * page
              + torch.arange(page, device="cuda")).view(-1)
    for layout in ("layer_first", "page_first"):
        host = HostKVPool(tokens + 8192, page, LAYERS, HKV, D, torch.bfloat16, layout, pin=True)
        hslots = (torch.randperm((tokens + 8192) // page, device="cuda")[: tokens // page, None] * page
                  + torch.arange(page, device="cuda")).view(-1)
        nbytes = tokens * KV_TOKEN_BYTES

        def load(max_blocks=0):
            for layer in range(LAYERS):
                copy_kv(host.buffer, layout, ptrs, hslots, dslots, range(layer, layer + 1), to_host=False,
                        max_blocks=max_blocks)

        t = timed(load, reps=5)
        out[f"load_{layout}_bytes_per_s"] = nbytes / t
        row(f"load-back 32k tokens ({layout}, 32 per-layer launches)", f"{nbytes / t / 1e9:.1f} GB/s",
            f"{nbytes / t / f['h2d_bytes_per_s']:.2f} of pinned H2D")
        t = timed(lambda: load(blocks), reps=5)  # what the engine runs beside compute
        out[f"load_{layout}_capped_bytes_per_s"] = nbytes / t
        row(f"  same, {blocks} programs per layer and K/V (the engine's load-back)",
            f"{nbytes / t / 1e9:.1f} GB/s", f"{nbytes / t / f['h2d_bytes_per_s']:.2f} of pinned H2D")
        copier, stream = BatchCopier(torch.device("cuda")), torch.cuda.Stream()  # not the legacy stream
        h_cpu, d_cpu = hslots.cpu(), dslots.cpu()
        plan = page_copies(host, k_bufs, v_bufs, h_cpu, d_cpu, range(LAYERS), to_host=False)
        with torch.cuda.stream(stream):  # timed on that stream
            t = timed(lambda: [copier.copy(plan[0][:, i], plan[1][:, i], plan[2][:, i], False, stream)
                               for i in range(LAYERS)], reps=5)
        out[f"load_{layout}_copy_engine_bytes_per_s"] = nbytes / t
        row(f"  same, copy engines (a driver call per layer, {plan[0].shape[2]} runs)", f"{nbytes / t / 1e9:.1f} GB/s",
            f"{nbytes / t / f['h2d_bytes_per_s']:.2f} of pinned H2D")
        back = page_copies(host, k_bufs, v_bufs, h_cpu, d_cpu, range(LAYERS), to_host=True)
        with torch.cuda.stream(stream):
            t = timed(lambda: copier.copy(*back, True, stream), reps=5)
        out[f"backup_{layout}_copy_engine_bytes_per_s"] = nbytes / t
        row("  backup, copy engines (one driver call)", f"{nbytes / t / 1e9:.1f} GB/s",
            f"{nbytes / t / f['d2h_bytes_per_s']:.2f} of pinned D2H")
        t = timed(lambda: copy_kv(host.buffer, layout, ptrs, hslots, dslots, range(LAYERS), to_host=True), reps=5)
        out[f"backup_{layout}_bytes_per_s"] = nbytes / t
        row(f"backup 32k tokens ({layout}, one launch)", f"{nbytes / t / 1e9:.1f} GB/s",
            f"{nbytes / t / f['d2h_bytes_per_s']:.2f} of pinned D2H")
        del host
    return out


# ---- model steps through the Engine ---------------------------------------------------------

LINEAR_PARAMS = LAYERS * (4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 14336 * 4096)  # per token
WEIGHT_BYTES = 2 * (LINEAR_PARAMS + 128256 * 4096)  # decode reads every matrix once, lm_head included


def engine(**options):
    from hicache import Engine
    from hicache.config import HiCacheConfig

    if "hicache_storage_backend" in HiCacheConfig.__dataclass_fields__:
        options.setdefault("hicache_storage_backend", "none")  # L1/L2 figures only
    options.setdefault("hicache_io_backend", IO_BACKEND)
    options.setdefault("attention_backend", ATTENTION_BACKEND)
    return Engine(str(CONFIG), load_format="dummy", dtype="bfloat16", page_size=64, **options)


def prompts(n: int, length: int, rng: torch.Generator) -> list[list[int]]:
    return torch.randint(1000, 120000, (n, length), generator=rng).tolist()


def wall(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def greedy(new: int) -> dict:
    return {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}


def attention_flops(prefix: int, new: int) -> float:
    return 4 * HQ * D * LAYERS * new * (prefix + (new + 1) / 2)


def graph_replay(eng, batch: int) -> float:
    """Seconds of one replay of the decode graph that ran the last step of `batch` requests (its
    inputs still hold that step: the replay rewrites the same K/V). Reaches into the runner."""
    graphs = eng.scheduler.runner.graphs
    bucket = graphs.graphs[min(b for b in graphs.sizes if b >= batch)]
    return timed(bucket.replay, reps=20)


def set_overlap(eng, on: bool) -> None:
    """Switches overlap scheduling of an idle engine (reaches into the scheduler: between two
    `generate` calls nothing is in flight)."""
    from hicache.runtime.scheduler.overlap import OverlapLoop

    def switch():
        sched = eng.scheduler
        assert sched.overlap is None or sched.overlap.inflight is None
        sched.overlap = OverlapLoop(sched) if on else None

    eng._call(switch)


def decode_step(eng, ps: list[list[int]], steps: int) -> float:
    """Seconds of one decode step of len(ps) requests: the difference between 1 and 1 + steps new
    tokens (the prompts are cached: the prefill computes one token each)."""
    t1 = min(wall(lambda: eng.generate(input_ids=ps, sampling_params=greedy(1))) for _ in range(2))
    t2 = min(wall(lambda: eng.generate(input_ids=ps, sampling_params=greedy(1 + steps))) for _ in range(2))
    return (t2 - t1) / steps


def model_l1(f: dict, overlap: str = "both", batches=(1, 16, 64, 256), l1_tokens: int | None = None) -> dict:
    """Decode steps at batch 1..256 (context 2k), overlap scheduling off and/or on, and an 8k
    prefill, on L1 alone. `decode_step_b*_s` is overlap off,
    `decode_step_overlap_b*_s` overlap on. A batch whose KV does not fit the pool is skipped."""
    out, rng, steps = {}, torch.Generator().manual_seed(0), 32
    modes = {"off": [False], "on": [True], "both": [False, True]}[overlap]
    with engine(max_total_tokens=l1_tokens, hierarchical_cache=False, max_running_requests=256,
                chunked_prefill_size=8192, max_prefill_tokens=32768, context_length=16384) as eng:
        capacity = eng.get_stats()["tiers"]["device"]["capacity_tokens"]
        row("L1 pool", f"{capacity} tokens")
        for batch in batches:
            if batch * (2048 + steps + 64) > capacity:
                row(f"decode step, batch {batch}, context 2k", "skipped", f"needs {batch * (2048 + steps + 64)} "
                    f"tokens of KV, the pool holds {capacity} (--l1-tokens)")
                continue
            ps = prompts(batch, 2048, rng)
            eng.generate(input_ids=ps, sampling_params=greedy(1))  # prefill, cached afterwards
            floor = (WEIGHT_BYTES + batch * 2048 * KV_TOKEN_BYTES) / f["d2d_bytes_per_s"]
            best = {}
            for _ in range(2):  # the modes interleaved, so that a drift of the clocks hits both
                for on in modes:
                    set_overlap(eng, on)
                    best[on] = min(best.get(on, float("inf")), decode_step(eng, ps, steps))
            for on, step in best.items():
                out[f"decode_step{'_overlap' if on else ''}_b{batch}_s"] = step
                row(f"decode step, batch {batch}, context 2k (CUDA graphs, overlap {'on' if on else 'off'})",
                    f"{step * 1e3:.2f} ms", f"{step / floor:.2f}x the floor {floor * 1e3:.2f} ms")
            replay = graph_replay(eng, batch)
            out[f"decode_replay_b{batch}_s"] = replay
            row("  its graph replay alone (GPU time of the step)", f"{replay * 1e3:.2f} ms", f"{replay / floor:.2f}x")
        times = []
        for _ in range(3):
            p = prompts(1, 8192, rng)
            times.append(wall(lambda: eng.generate(input_ids=p, sampling_params=greedy(1))))
        t = statistics.median(times)
        flops = 2 * LINEAR_PARAMS * 8192 + attention_flops(0, 8192)
        out["prefill_8k_s"] = t
        row("prefill 8k tokens (one request, one chunk)", f"{t * 1e3:.0f} ms",
            f"{flops / t / 1e12:.0f} TFLOP/s = {flops / t / f['gemm_flops']:.2f} of GEMM")
    return out


def model_l2(f: dict) -> dict:
    """Extend of 1k new tokens after a 31k prefix resident in L1 vs loaded back from L2."""
    out, rng = {}, torch.Generator().manual_seed(1)
    prefix_len, new = 31 * 1024, 1024
    with engine(max_total_tokens=40_000, hicache_size=12, chunked_prefill_size=8192, max_prefill_tokens=8192,
                context_length=34_000, max_running_requests=8) as eng:
        prefix = prompts(1, prefix_len, rng)[0]
        eng.generate(input_ids=prefix, sampling_params=greedy(1))
        resident, loaded, host = [], [], []
        for _ in range(3):
            tail = prompts(1, new, rng)[0]
            resident.append(wall(lambda: eng.generate(input_ids=prefix + tail, sampling_params=greedy(1))))
        for _ in range(3):
            eng.generate(input_ids=prompts(1, prefix_len, rng)[0], sampling_params=greedy(1))  # evicts the prefix
            tail = prompts(1, new, rng)[0]
            res = []
            loaded.append(wall(lambda: res.append(eng.generate(input_ids=prefix + tail, sampling_params=greedy(1)))))
            host.append(res[0]["meta_info"]["cached_tokens_details"]["host"])
        t_res, t_l2 = statistics.median(resident), statistics.median(loaded)
        out |= {"extend_resident_s": t_res, "extend_from_l2_s": t_l2, "host_tokens": host}
        row("extend 1k after a 31k prefix in L1", f"{t_res * 1e3:.0f} ms",
            f"{(2 * LINEAR_PARAMS * new + attention_flops(prefix_len, new)) / t_res / 1e12:.0f} TFLOP/s")
        row(f"same, prefix loaded back from L2 (host tokens {host})", f"{t_l2 * 1e3:.0f} ms",
            f"{t_l2 / t_res:.2f}x resident; the load alone at pinned H2D: "
            f"{prefix_len * KV_TOKEN_BYTES / f['h2d_bytes_per_s'] * 1e3:.0f} ms")
    return out


def model_rounds(f: dict, clients: int = 12, rounds: int = 10, turn: int = 2048, profile: str | None = None,
                 names=("L1", "L1+L2", "L1 holds all")) -> dict:
    """The GPU multi-turn workload (benchmarks/RESULTS.md) in process, without HTTP: every round each of `clients`
    conversations appends `turn` new tokens and all are submitted together (one output token each).
    L1 holds 20% of the working set. Configurations: L1 only, L1 + L2 (5.2 x L1), and L1 holding
    everything (what L1 + L2 would take if its loads cost nothing). With `profile`, round 5 of L1 + L2
    is traced with torch.profiler (chrome trace at that path, summarised per stream; the compute
    stream's idle spans in PATH.gaps.txt) and round 6 runs under cProfile; both count in its total."""
    out, working_set = {}, clients * rounds * (turn + 1)
    l1 = working_set // 5
    configs = {"L1": dict(max_total_tokens=l1, hierarchical_cache=False),
               "L1+L2": dict(max_total_tokens=l1, hicache_ratio=5.2),
               "L1 holds all": dict(max_total_tokens=working_set + 8192, hierarchical_cache=False)}
    row("rounds: working set", f"{working_set} tokens", f"L1 {l1} tokens")
    for name in names:
        with engine(chunked_prefill_size=8192, max_running_requests=32, context_length=rounds * (turn + 1) + 64,
                    **configs[name]) as eng:
            # Unmeasured, other tokens: Triton's JIT of every kernel specialisation the rounds reach
            # (the fourth round outgrows L1, so L1 + L2 loads back)
            conversation(eng, clients, 4, turn, torch.Generator().manual_seed(1000))
            eng.flush_cache()
            trace = profile if name == "L1+L2" else None
            loop = eng.scheduler.overlap  # prefill steps launched ahead (runtime/scheduler/overlap.py), if on
            ahead = loop.ahead if loop is not None else 0
            out[name] = conversation(eng, clients, rounds, turn, torch.Generator().manual_seed(2), trace)
            out[name]["prefill_steps_ahead"] = (loop.ahead if loop is not None else 0) - ahead
            row(f"rounds, {name}", f"{out[name]['total_s']:.2f} s",
                f"computed {out[name]['computed_tokens']} of {out[name]['prompt_tokens']} prompt tokens; "
                f"{out[name]['prefill_steps_ahead']} prefill steps launched ahead; "
                f"rounds {' '.join(f'{t:.2f}' for t in out[name]['round_s'])}")
    if "L1" in out:
        row("rounds vs L1", ", ".join(f"{name} {out['L1']['total_s'] / out[name]['total_s']:.2f}x" for name in out))
    return out


def conversation(eng, clients: int, rounds: int, turn: int, rng: torch.Generator, trace: str | None = None) -> dict:
    """Runs the rounds (see model_rounds); with `trace`, the middle round under torch.profiler and
    the next one under cProfile."""
    convs, times, computed, prompted = [[] for _ in range(clients)], [], 0, 0
    for r in range(rounds):
        for conv, question in zip(convs, prompts(clients, turn, rng)):
            conv += question
        traced = trace is not None and r == rounds // 2
        host_profiled = trace is not None and r == rounds // 2 + 1
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with (torch.profiler.profile(activities=activities, with_stack=True) if traced
              else contextlib.nullcontext()) as prof:
            host = cProfile.Profile()
            if host_profiled:  # Python 3.12's cProfile sees every thread (sys.monitoring): the scheduler's too
                host.enable()
            res = []
            times.append(wall(lambda: res.extend(eng.generate(input_ids=convs, sampling_params=greedy(1)))))
            if host_profiled:
                host.disable()
                print(f"\nround {r} under cProfile ({times[-1]:.2f} s with its overhead):")
                pstats.Stats(host).sort_stats("tottime").print_stats(18)
                print("our scheduler-side functions by cumulative time:")
                pstats.Stats(host).sort_stats("cumulative").print_stats(
                    r"(scheduler|controller|tree|runner|overlap|transfer|copy_engine|sampler|pool)\.py", 30)
        if traced:
            prof.export_chrome_trace(trace)
            trace_summary(trace, f"round {r}")
        for conv, o in zip(convs, res):
            computed += len(conv) - o["meta_info"]["cached_tokens"]
            prompted += len(conv)
            conv += o["output_ids"]
    return {"round_s": times, "total_s": sum(times), "computed_tokens": computed, "prompt_tokens": prompted}


def trace_summary(path: str, title: str) -> None:
    """Per CUDA stream of a chrome trace: busy time, its top kernels, and how much of the busiest
    (compute) stream's idle time other streams filled."""
    everything = [e for e in json.loads(Path(path).read_text())["traceEvents"] if e.get("ph") == "X"]
    events = [e for e in everything if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not events:
        print(f"{title}: no GPU events in the trace")
        return
    start = min(e["ts"] for e in events)
    window = max(e["ts"] + e["dur"] for e in events) - start
    streams: dict = {}
    for e in events:
        streams.setdefault(e["args"].get("stream"), []).append(e)

    def busy(evs) -> list:
        spans = []
        for s, d in sorted((e["ts"], e["ts"] + e["dur"]) for e in evs):
            if spans and s <= spans[-1][1]:
                spans[-1][1] = max(spans[-1][1], d)
            else:
                spans.append([s, d])
        return spans

    def total(spans) -> float:
        return sum(d - s for s, d in spans)

    compute = max(streams, key=lambda k: total(busy(streams[k])))
    print(f"\n{title}: GPU window {window / 1e3:.1f} ms")
    for sid, evs in sorted(streams.items(), key=lambda kv: -total(busy(kv[1]))):
        names: dict = {}
        for e in evs:
            names[e["name"][:70]] = names.get(e["name"][:70], 0) + e["dur"]
        top = ", ".join(f"{n} {d / 1e3:.1f}" for n, d in sorted(names.items(), key=lambda kv: -kv[1])[:4])
        print(f"  stream {sid}{' (compute)' if sid == compute else ''}: busy {total(busy(evs)) / 1e3:.1f} ms, "
              f"{len(evs)} ops; top (ms): {top}")
    others = busy([e for k, evs in streams.items() if k != compute for e in evs])
    mine = busy(streams[compute])
    idle_filled = total(others) - sum(max(0, min(d, md) - max(s, ms)) for s, d in others for ms, md in mine)
    print(f"  compute stream idle {(window - total(mine)) / 1e3:.1f} ms, of which other streams busy "
          f"{idle_filled / 1e3:.1f} ms (transfers not hidden) and nothing on the GPU "
          f"{(window - total(mine) - idle_filled) / 1e3:.1f} ms (host-bound)")
    calls: dict = {}
    for e in everything:
        if e.get("cat") == "cuda_runtime":
            calls[e["name"]] = calls.get(e["name"], 0) + e["dur"]
    print("  host time in CUDA runtime calls (ms): "
          + ", ".join(f"{n} {d / 1e3:.1f}" for n, d in sorted(calls.items(), key=lambda kv: -kv[1])[:6]))
    gaps, last = [], None  # the compute stream's idle spans, which other streams ran in them, what came next
    next_op = {e["ts"]: e["name"][:40] for e in streams[compute]}
    for s0, s1 in mine:
        if last is not None and s0 - last > 300:
            during = sorted({str(e["args"].get("stream")) for e in events
                             if e["args"].get("stream") != compute and e["ts"] < s0 and e["ts"] + e["dur"] > last})
            gaps.append(f"{(last - start) / 1e3:9.2f} ms: idle {(s0 - last) / 1e3:6.2f} ms, "
                        f"other streams busy: {', '.join(during) or 'none'}; then {next_op.get(s0, '?')}\n")
            if s0 - last > 10_000:  # a long one: the host's innermost calls that span most of it
                host = [e for e in everything if e.get("cat") in ("python_function", "cpu_op", "cuda_runtime")
                        and e["ts"] < s0 and e["ts"] + e["dur"] > last and e["dur"] > (s0 - last) / 2]
                for e in sorted(host, key=lambda e: e["dur"])[:6]:
                    gaps.append(f"{'':14}host: {e['name'][:90]} ({e['dur'] / 1e3:.1f} ms)\n")
        last = s1
    Path(path + ".gaps.txt").write_text("".join(gaps))
    print(f"  compute idle spans over 0.3 ms: {len(gaps)} (listed in {path}.gaps.txt)")


def vs_hf(f: dict, n: int = 64, length: int = 1024, new: int = 128, reps: int = 3) -> dict:
    """Output tokens per second, HF transformers (bf16, sdpa, its KV cache) vs ours, same shapes,
    each the median of `reps` runs (ours on fresh prompts each time: no cache hits), and ours
    against the bound from the floors (prefill at the GEMM rate, decode steps at the copy rate)."""
    import gc

    from transformers import LlamaConfig, LlamaForCausalLM

    rng = torch.Generator().manual_seed(2)
    runs = [prompts(n, length, rng) for _ in range(reps)]
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        hf = LlamaForCausalLM(LlamaConfig.from_json_file(str(CONFIG))).eval()
    torch.set_default_dtype(torch.float32)
    ids = torch.tensor(runs[0], device="cuda")

    def run():
        return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0)

    warm = torch.tensor(prompts(8, length, rng), device="cuda")  # both sides warm up on the same shapes
    hf.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=8, do_sample=False, pad_token_id=0)
    hf_runs = [wall(run) for _ in range(reps)]
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    with engine(max_total_tokens=200_000, hicache_size=20, max_running_requests=256) as eng:
        eng.generate(input_ids=warm.tolist(), sampling_params=greedy(8))  # warm-up (Triton JIT), other tokens
        ours_runs = [wall(lambda: eng.generate(input_ids=ps, sampling_params=greedy(new))) for ps in runs]
    t_hf, t_ours = statistics.median(hf_runs), statistics.median(ours_runs)
    prefill = (2 * LINEAR_PARAMS * n * length + n * attention_flops(0, length)) / f["gemm_flops"]
    decode = sum(WEIGHT_BYTES + n * (length + j) * KV_TOKEN_BYTES for j in range(1, new)) / f["d2d_bytes_per_s"]
    bound = n * new / (prefill + decode)
    out = {"hf_tok_per_s": n * new / t_hf, "ours_tok_per_s": n * new / t_ours, "bound_tok_per_s": bound,
           "hf_runs_s": hf_runs, "ours_runs_s": ours_runs}
    row(f"HF transformers, {n} x {length} prompts x {new} new (median of {reps})",
        f"{out['hf_tok_per_s']:.0f} output tok/s", "runs " + ", ".join(f"{t:.2f} s" for t in hf_runs))
    row("hicache, same", f"{out['ours_tok_per_s']:.0f} output tok/s",
        f"{t_hf / t_ours:.1f}x HF; runs " + ", ".join(f"{t:.2f} s" for t in ours_runs))
    row("bound from the floors (prefill at the GEMM rate, decode at the copy rate)", f"{bound:.0f} output tok/s",
        f"hicache at {out['ours_tok_per_s'] / bound:.2f} of it; {bound * t_hf / (n * new):.1f}x HF at most")
    return out


PARTS = {"kernels": kernels, "transfers": transfers, "l1": model_l1, "l2": model_l2, "rounds": model_rounds,
         "hf": vs_hf}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="kernels,l1,l2,hf", help=f"comma-separated, of {', '.join(PARTS)}")
    ap.add_argument("--floors", default=None, help="JSON file: reuse its floors if it exists, else write them")
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--overlap", default="both", choices=("off", "on", "both"),
                    help="l1: decode steps with overlap scheduling off, on, or both (same engine, same prompts)")
    ap.add_argument("--decode-batches", default="1,16,64,256", help="l1: decode batch sizes (context 2k)")
    ap.add_argument("--l1-tokens", type=int, default=0,
                    help="l1: KV pool tokens (0: sized by mem_fraction_static, 0.85); 256 x 2k needs ~540k, "
                         "more than an 80 GB H100 holds beside the weights (that batch is then skipped)")
    ap.add_argument("--profile", default=None, help="rounds: write a chrome trace of one L1 + L2 round here")
    ap.add_argument("--io-backend", default="direct", choices=("direct", "kernel"),
                    help="l2, rounds: the engines' L1 <-> L2 copies (the copy engines, or the Triton gather kernel)")
    ap.add_argument("--rounds-configs", default="L1,L1+L2,L1 holds all", help="rounds: comma-separated configurations")
    ap.add_argument("--attention-backend", default="auto", choices=("auto", "flashinfer", "triton"),
                    help="the engines' attention kernels (auto: flashinfer when installed)")
    args = ap.parse_args()
    global IO_BACKEND, ATTENTION_BACKEND
    IO_BACKEND, ATTENTION_BACKEND = args.io_backend, args.attention_backend
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    print("| measure | value | vs floor |\n|---|---|---|")
    t0 = time.perf_counter()
    saved = Path(args.floors) if args.floors else None
    if saved is not None and saved.exists():
        f = json.loads(saved.read_text())
        row("floors", f"from {saved}")
    else:
        f = floors()
        if saved is not None:
            saved.write_text(json.dumps(f))
    results = {"floors": f}
    for part in args.parts.split(","):
        if part == "l1":
            results[part] = model_l1(f, args.overlap, [int(b) for b in args.decode_batches.split(",")],
                                     args.l1_tokens or None)
        elif part == "rounds":
            results[part] = model_rounds(f, profile=args.profile, names=args.rounds_configs.split(","))
        else:
            results[part] = PARTS[part](f)
    print(f"total {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
