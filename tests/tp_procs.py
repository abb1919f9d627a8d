"""Tensor-parallel ranks for tests: `run_ranks(target, size, workdir, *args)` spawns `size`
processes joined in a gloo group (init through a file in workdir), calls
`target(tp, *args)` on each with its `TensorParallel`, and returns their results in rank order.
`target` must be a module-level function of an importable module (spawn pickles it by name) and
return something torch.save can write. A rank that raises fails the call with its traceback."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hicache.runtime.parallel import TensorParallel


def run_ranks(target: Callable[..., Any], size: int, workdir: Path, *args: Any) -> list[Any]:
    workdir = Path(workdir)
    init = f"file://{workdir / 'tp_init'}"
    mp.start_processes(_rank_main, args=(size, init, str(workdir), target, args), nprocs=size,
                       start_method="spawn", join=True)
    return [torch.load(workdir / f"rank{r}.pt", weights_only=False) for r in range(size)]


def _rank_main(rank: int, size: int, init: str, workdir: str, target: Callable[..., Any], args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size)
    try:
        result = target(TensorParallel(rank, size, dist.group.WORLD), *args)
        torch.save(result, Path(workdir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
