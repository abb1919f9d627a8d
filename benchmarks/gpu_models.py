"""GPU benchmark of model configs on dummy weights (bf16) against their floors, and of tensor parallelism.

    python benchmarks/gpu_models.py [--parts qwen3-8b,qwen3-30b-a3b,moe-kernel] [--floors floors.json]
                                    [--json out.json] [--decode-batches 1,64] [--context 2048]
                                    [--overlap on|off] [--sweep] [--tp-size N]

Parts: any config of benchmarks/configs (`qwen3-8b`, `qwen3-30b-a3b`, `llama-3.1-8b`,
`llama-3.1-70b`, ...) through the Engine: decode steps at each batch with `--context` tokens of
context, CUDA graphs on, overlap scheduling as `--overlap` says, then an 8k prefill; with
`--tp-size N` the engine runs N ranks, one GPU each, and the floors are one rank's share (weights,
KV and FLOPs divided by N; the all-reduces are not in them), so that TP scaling reads as the same
ratio at N = 1 and N = 2 (`llama-3.1-70b` needs N = 2 on H200s); `moe-kernel` (the fused MoE of one Qwen3-30B-A3B layer
alone, tokens routed uniformly at random, against the grouped-GEMM bound and the torch reference
loop; `--sweep` also times a grid of launch shapes and prints the fastest for each token count).

Floors, from gpu.py's measured device-to-device bandwidth and bf16 GEMM rate: a decode step
reads the dense weights (lm_head included, the embedding excluded), the experts the batch
touches, and the batch's KV; with uniform routing a layer's batch of B tokens touches
E * (1 - (1 - k/E)^B) of its E experts. Prefill: 2 x active parameters x tokens plus causal
attention, at the GEMM rate. A batch whose KV does not fit the pool is skipped.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

from gpu import decode_step, floors, graph_replay, greedy, prompts, row, set_overlap, timed, wall

CONFIGS = Path(__file__).resolve().parent / "configs"


class Shape(NamedTuple):
    """Bytes and FLOPs of a config's forward, from its parameters (bf16)."""
    dense_params: int  # read once per decode step: all but the embedding and the routed experts
    expert_params: int  # one routed expert's, all layers that route
    experts: int
    top_k: int
    kv_bytes_per_token: int
    attn_flops_per_pair: int  # 4 * heads * head_dim * layers: one query against one key

    def touched(self, batch: int) -> float:
        if not self.experts:
            return 0.0
        return self.experts * (1 - (1 - self.top_k / self.experts) ** batch)

    def decode_bytes(self, batch: int, context: int) -> float:
        params = self.dense_params + self.touched(batch) * self.expert_params
        return 2 * params + batch * context * self.kv_bytes_per_token

    def active_params(self) -> int:
        return self.dense_params + self.top_k * self.expert_params


def shape(config: Path) -> Shape:
    from hicache.runtime.model_config import ModelConfig
    from hicache.runtime.models import get_model_class

    cfg = ModelConfig.from_json_file(config)
    model = get_model_class(cfg.architecture)(cfg, dtype=torch.bfloat16, device="meta")
    total = sum(p.numel() for p in model.parameters())
    embed = 0 if cfg.tie_word_embeddings else model.embed_tokens.numel()
    routed = sum(p.numel() for n, p in model.named_parameters() if n.endswith((".w13", ".w2")))
    experts, top_k = (cfg.moe.num_experts, cfg.moe.top_k) if cfg.moe else (0, 0)
    return Shape(total - embed - routed, routed // experts if experts else 0, experts, top_k,
                 2 * cfg.num_layers * cfg.kv_size * 2, 4 * cfg.q_size * cfg.num_layers)


def engine(config: Path, **options):
    from hicache import Engine

    return Engine(str(config), load_format="dummy", dtype="bfloat16", page_size=64, hierarchical_cache=False,
                  hicache_storage_backend="none", **options)


def model_part(f: dict, name: str, batches: list[int], context: int, overlap: bool, tp: int = 1) -> dict:
    config = CONFIGS / f"{name}.json"
    s, out, rng, steps = shape(config), {}, torch.Generator().manual_seed(0), 32
    name = name if tp == 1 else f"{name} TP{tp}"
    row(f"{name}: parameters read by a decode step at batch 1", f"{s.decode_bytes(1, 0) / 2e9:.2f} B",
        f"active per token {s.active_params() / 1e9:.2f} B")
    with engine(config, max_running_requests=max(batches), chunked_prefill_size=8192, max_prefill_tokens=32768,
                context_length=16384, tp_size=tp) as eng:
        set_overlap(eng, overlap)
        capacity = eng.get_stats()["tiers"]["device"]["capacity_tokens"]
        row(f"{name}: L1 pool", f"{capacity} tokens")
        for batch in batches:
            if batch * (context + steps + 64) > capacity:
                row(f"{name}: decode step, batch {batch}", "skipped", f"the pool holds {capacity} tokens")
                continue
            ps = prompts(batch, context, rng)
            eng.generate(input_ids=ps, sampling_params=greedy(1))
            floor = s.decode_bytes(batch, context) / tp / f["d2d_bytes_per_s"]
            step = min(decode_step(eng, ps, steps) for _ in range(2))
            out[f"decode_step_b{batch}_s"] = step
            row(f"{name}: decode step, batch {batch}, context {context}", f"{step * 1e3:.2f} ms",
                f"{step / floor:.2f}x the floor {floor * 1e3:.2f} ms")
            if tp == 1:  # (a rank's graph holds all-reduces: it cannot replay alone)
                replay = out[f"decode_replay_b{batch}_s"] = graph_replay(eng, batch)
                row("  its graph replay alone", f"{replay * 1e3:.2f} ms", f"{replay / floor:.2f}x")
        times = []
        for _ in range(3):
            p = prompts(1, 8192, rng)
            times.append(wall(lambda: eng.generate(input_ids=p, sampling_params=greedy(1))))
        t = statistics.median(times)
        flops = (2 * s.active_params() * 8192 + s.attn_flops_per_pair * 8192 * 8193 / 2) / tp
        out["prefill_8k_s"] = t
        row(f"{name}: prefill 8k tokens", f"{t * 1e3:.0f} ms",
            f"{flops / t / 1e12:.0f} TFLOP/s = {flops / t / f['gemm_flops']:.2f} of GEMM")
    return out


SWEEP = [(bm, bn, bk, w, st) for bm in (16, 32, 64) for bn in (32, 64, 128) for bk in (64, 128) for w in (4, 8)
         for st in (3, 4)]


def moe_kernel(f: dict, token_counts=(1, 64, 512, 8192), sweep: bool = False) -> dict:
    """One Qwen3-30B-A3B layer's experts: fused kernel vs its bound (and the torch loop)."""
    from hicache.kernels.experts import moe_reference
    from hicache.kernels.moe import Tiles, fused_moe

    hidden, inter, experts, k = 2048, 768, 128, 8
    gen = torch.Generator("cuda").manual_seed(0)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen, device="cuda").to(torch.bfloat16) * 0.02
    w2 = torch.randn(experts, hidden, inter, generator=gen, device="cuda").to(torch.bfloat16) * 0.02
    out, expert_bytes = {}, 2 * 3 * inter * hidden
    for t in token_counts:
        x = torch.randn(t, hidden, generator=gen, device="cuda").to(torch.bfloat16)
        weights, ids = torch.randn(t, experts, generator=gen, device="cuda").softmax(-1).topk(k, dim=-1)
        touched = experts * (1 - (1 - k / experts) ** t)
        bound = max(touched * expert_bytes / f["d2d_bytes_per_s"], 2 * t * k * 3 * inter * hidden / f["gemm_flops"])
        fused = timed(lambda: fused_moe(x, w13, w2, weights, ids), reps=20)
        out[f"fused_moe_t{t}_s"] = fused
        row(f"fused MoE, {t} tokens x top-{k} of {experts} experts", f"{fused * 1e6:.0f} us",
            f"{fused / bound:.2f}x the grouped-GEMM bound {bound * 1e6:.0f} us")
        if t <= 512:
            ref = timed(lambda: moe_reference(x, w13, w2, weights, ids), reps=5)
            row("  the torch loop over experts", f"{ref * 1e6:.0f} us", f"{ref / fused:.1f}x the fused kernel")
        if sweep:
            best = min((_try(lambda: fused_moe(x, w13, w2, weights, ids, Tiles(*c))), c) for c in SWEEP)
            out[f"fused_moe_t{t}_best"] = [best[0], list(best[1])]
            row(f"  fastest of {len(SWEEP)} launch shapes {best[1]}", f"{best[0] * 1e6:.0f} us",
                f"{best[0] / bound:.2f}x the bound")
    return out


def _try(fn) -> float:
    """Median seconds of fn, or infinity where the launch shape does not compile or fit."""
    try:
        return timed(fn, reps=10)
    except Exception:  # noqa: BLE001 (out of shared memory, too many registers)
        return float("inf")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="qwen3-8b,qwen3-30b-a3b,moe-kernel")
    ap.add_argument("--floors", default=None, help="JSON file: reuse its floors if it exists, else write them")
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--decode-batches", default="1,64")
    ap.add_argument("--context", type=int, default=2048, help="tokens of context of each decoding request")
    ap.add_argument("--overlap", default="on", choices=("on", "off"), help="overlap scheduling of the model parts")
    ap.add_argument("--sweep", action="store_true", help="moe-kernel: also time a grid of launch shapes")
    ap.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks of the model parts (one GPU each)")
    args = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    print("| measure | value | vs floor |\n|---|---|---|")
    t0 = time.perf_counter()
    saved = Path(args.floors) if args.floors else None
    f = json.loads(saved.read_text()) if saved is not None and saved.exists() else floors()
    if saved is not None and not saved.exists():
        saved.write_text(json.dumps(f))
    results = {"floors": f}
    batches = [int(b) for b in args.decode_batches.split(",")]
    for part in args.parts.split(","):
        if part == "moe-kernel":
            results[part] = moe_kernel(f, sweep=args.sweep)
        else:
            results[part] = model_part(f, part, batches, args.context, args.overlap == "on", args.tp_size)
    print(f"total {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
