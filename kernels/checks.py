"""Argument checks shared by the Triton launchers (each raises ValueError naming the argument),
and their launch helpers, `pipeline_stages` and `num_sms`.

Under Triton's interpreter (`TRITON_INTERPRET=1`, set before triton is imported) the kernels run
on CPU tensors, in numpy: slow, fp32 and fp16 only (its bf16 gives wrong numbers), but the same
kernel code, which is how the CPU-only CI checks them (tests/kernels/kernel_env.py).
"""
from __future__ import annotations

import functools
import os

import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def on_cuda(**tensors: torch.Tensor) -> torch.device:
    """All tensors on one CUDA device (or on the CPU under the interpreter); returns it."""
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    for name, dev in devices.items():
        require(dev.type == "cuda" or (INTERPRETED and dev.type == "cpu"), f"{name} must be a CUDA tensor, got {dev}")
        require(dev == first, f"{name} is on {dev}, the others on {first}")
    return first


def index_vector(name: str, t: torch.Tensor, length: int | None = None) -> None:
    require(t.dim() == 1 and t.dtype in (torch.int32, torch.int64),
            f"{name} must be a 1-D int32/int64 tensor, got {tuple(t.shape)} {t.dtype}")
    require(length is None or t.numel() == length, f"{name} has {t.numel()} entries, expected {length}")
    require(t.is_contiguous(), f"{name} must be contiguous")


def kv_buffers(k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> None:
    require(k_buffer.dim() == 3 and k_buffer.shape == v_buffer.shape and k_buffer.dtype == v_buffer.dtype,
            f"k_buffer {tuple(k_buffer.shape)} {k_buffer.dtype} and v_buffer {tuple(v_buffer.shape)} "
            f"{v_buffer.dtype} must be equal [slots, Hkv, D]")
    require(k_buffer.is_contiguous() and v_buffer.is_contiguous(), "k_buffer and v_buffer must be contiguous")


def heads(q: torch.Tensor, k_buffer: torch.Tensor) -> int:
    """q [*, Hq, D] against a [slots, Hkv, D] buffer: returns the group size Hq // Hkv."""
    require(q.dim() == 3 and q.shape[2] == k_buffer.shape[2],
            f"q {tuple(q.shape)} and k_buffer {tuple(k_buffer.shape)} must be [*, H, D] with equal D")
    require(q.shape[1] % k_buffer.shape[1] == 0,
            f"query heads {q.shape[1]} are not a multiple of KV heads {k_buffer.shape[1]}")
    d = q.shape[2]
    require(d >= 16 and d & (d - 1) == 0, f"head_dim must be a power of two >= 16, got {d}")
    require(q.dtype == k_buffer.dtype, f"q dtype {q.dtype} differs from the KV pool's {k_buffer.dtype}")
    require(q.dtype in (torch.float16, torch.bfloat16, torch.float32), f"unsupported dtype {q.dtype}")
    require(q.stride(2) == 1, "q's last dimension must be contiguous")
    return q.shape[1] // k_buffer.shape[1]


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs use exact fp32 products (tf32 would miss the 1e-4 tolerance)."""
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.cache
def pipeline_stages(device: torch.device, tile_bytes: int, depths: tuple[int, ...]) -> int:
    """The first of `depths` (deepest first) whose tiles fit in one program's shared memory on
    `device` beside a 16 KiB margin, else the last: tuned depths on Hopper, shallower elsewhere."""
    if device.type != "cuda":
        return depths[-1]
    smem = getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0)
    return next((d for d in depths if d * tile_bytes + 16 * 1024 <= smem), depths[-1])


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; under the interpreter, a small GPU's 8."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
