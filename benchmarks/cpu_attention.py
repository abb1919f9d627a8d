"""CPU attention of one request's chunk over its cached prefix: the compiled paged kernel
(`hicache.kernels.cpu.paged_attention`) against torch's SDPA over the gathered keys (the
reference `extend_attention`, which the "cpu" backend takes from `LONG_CHUNK` new tokens on).
SmolLM2's heads (9 query, 3 KV, 64 wide), float32, median of `--repeat` calls per case.

    python benchmarks/cpu_attention.py [--repeat 5]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from hicache.kernels import cpu
from hicache.kernels.attention import extend_attention

HQ, HKV, D = 9, 3, 64
CASES = ((1000, 1), (3000, 1), (1000, 4), (1000, 16), (1000, 64), (0, 512), (3000, 512), (0, 2048))


def median_s(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def case(prefix: int, n: int, repeat: int) -> tuple[float, float]:
    total = prefix + n
    gen = torch.Generator().manual_seed(prefix * 7 + n)
    k_buf, v_buf = torch.randn(total, HKV, D, generator=gen), torch.randn(total, HKV, D, generator=gen)
    q, k, v = (torch.randn(n, h, D, generator=gen) for h in (HQ, HKV, HKV))
    slots = torch.randperm(total, generator=gen)
    table = slots[None].contiguous()
    zero = torch.zeros(1, dtype=torch.int64)

    def kernel():
        return cpu.paged_attention(q, k, v, k_buf, v_buf, slots[prefix:], table, zero, torch.tensor([prefix]),
                                   torch.tensor([n]), zero, D ** -0.5)

    def sdpa():
        return extend_attention(q, k_buf, v_buf, [slots], [n], D ** -0.5)

    torch.testing.assert_close(kernel(), sdpa(), atol=1e-4, rtol=1e-4)
    return median_s(kernel, repeat), median_s(sdpa, repeat)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'prefix':>7} {'new':>5} {'kernel ms':>10} {'GFLOP/s':>8} {'sdpa ms':>9} {'GFLOP/s':>8} "
          f"{'kernel/sdpa':>11}")
    for prefix, n in CASES:
        tk, ts = case(prefix, n, args.repeat)
        flops = n * (prefix + (n + 1) / 2) * HQ * D * 4
        print(f"{prefix:>7} {n:>5} {tk * 1e3:>10.2f} {flops / tk / 1e9:>8.1f} {ts * 1e3:>9.2f} "
              f"{flops / ts / 1e9:>8.1f} {tk / ts:>11.2f}")


if __name__ == "__main__":
    main()
