"""Where the kernel tests run: on CUDA, or, on a machine without it, under Triton's interpreter
(`TRITON_INTERPRET=1`, set here before triton is imported, so test files import this module
before any kernel). The interpreter runs the same kernels on CPU tensors, in numpy: much slower,
so tests take smaller shapes there (`sizes`), and fp16 where they take bf16 on CUDA (`half`:
the interpreter's bf16 arithmetic is wrong). Test files import it as `kernel_env` (pytest puts
this folder on sys.path)."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA and importlib.util.find_spec("triton") is not None:
    os.environ["TRITON_INTERPRET"] = "1"
INTERPRETED = not CUDA and os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cuda" if CUDA else "cpu"

# a kernel test: on the GPU (marked gpu), else interpreted, else skipped
kernels = [pytest.mark.gpu] if CUDA else [pytest.mark.skipif(not INTERPRETED, reason="needs CUDA or triton")]
# a test of CUDA streams, the copy engines, raw device pointers or the model's CUDA dispatch
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")


def half(dtype: torch.dtype) -> torch.dtype:
    """bf16 on CUDA, fp16 under the interpreter; other dtypes as they are."""
    return torch.float16 if INTERPRETED and dtype == torch.bfloat16 else dtype


def sizes(gpu, cpu):
    """The shapes a test takes: `gpu` on CUDA, `cpu` under the interpreter."""
    return cpu if INTERPRETED else gpu
