"""Checked copies of L3 pages in compiled code (`cpu_io.cpp`): the CRC-32C of a batch of values'
payloads and their copies into host pages (`check_copy`), and a host page's copy into a value with
its CRC-32C (`copy_crc`), each in one ctypes call that runs with the GIL released.

The storage threads check and frame pages beside the scheduler thread. With a checksum call and a
copy call per page, a thread needs the GIL back after each, and while the scheduler thread runs
Python between its steps it gets it only at the interpreter's switch interval: reads into L2 then
crawl. A batch in one call needs it once, and spreads its pages over an OpenMP team.

Built at first use like the CPU kernels (`kernels/cpu.py`: the user's cache folder, keyed by the
source, compiler and CPU). Where it cannot be, `library()` is None (one warning) and callers keep
their per-page path. A host page is either contiguous or a run of equal contiguous blocks at a
fixed stride (`Runs`: a page of a layer-first L2, one block per layer and K/V).
"""
from __future__ import annotations

import ctypes
import functools
import math
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from hicache.kernels.cpu import load

SOURCE = Path(__file__).with_name("cpu_io.cpp")
_P, _I, _N = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
SIGNATURES = {"hc_crc32c": [_P, _I], "hc_check_copy": [_I] + [_P] * 7 + [_N], "hc_copy_crc": [_P, _I, _I, _I, _P]}
RESULTS = {"hc_crc32c": ctypes.c_uint32, "hc_copy_crc": ctypes.c_uint32}


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled checked copies, built on first call; None (after one warning) where they cannot be."""
    return load("cpu_io", (SOURCE,), (), SIGNATURES, RESULTS, "L3 pages are checked and copied one call at a time")


class Runs(NamedTuple):
    """A CPU tensor's bytes as `runs` blocks of `run_bytes` contiguous bytes, `stride` bytes apart."""

    base: int
    runs: int
    stride: int
    run_bytes: int


def runs(page: torch.Tensor) -> Runs | None:
    """`page` as `Runs`; None for a tensor not so laid out (or not on the CPU, or empty)."""
    if page.device.type != "cpu" or page.numel() == 0:
        return None
    dims = [(n, s) for n, s in zip(page.shape, page.stride()) if n != 1]
    inner = 1
    while dims and dims[-1][1] == inner:
        inner *= dims.pop()[0]
    outer = math.prod(n for n, _ in dims)
    if any(s1 != s2 * n2 for (_, s1), (n2, s2) in zip(dims, dims[1:])):
        return None
    item = page.element_size()
    return Runs(page.data_ptr(), outer, (dims[-1][1] if dims else inner) * item, inner * item)


def crc32c(data) -> int:
    """CRC-32C of a buffer (for tests against the crc32c package)."""
    lib = library()
    src = np.frombuffer(data, dtype=np.uint8)
    return lib.hc_crc32c(src.ctypes.data, src.size)


def check_copy(payloads: list, pages: list[Runs], want: list[int], threads: int) -> list[bool]:
    """For each payload (a buffer, read-only is fine): if its CRC-32C is want[i], copies it into
    page i (`runs` of it: run count x run bytes must be the payload's length) and answers True;
    else writes nothing there and answers False. One call for all of them."""
    n = len(payloads)
    srcs = [np.frombuffer(p, dtype=np.uint8) for p in payloads]
    for src, page in zip(srcs, pages):
        if src.size != page.runs * page.run_bytes:
            raise ValueError(f"a payload of {src.size} bytes for a page of {page.runs * page.run_bytes}")
    ptrs = np.array([s.ctypes.data for s in srcs], dtype=np.uint64)
    shape = np.array([(p.base, p.runs, p.stride, p.run_bytes) for p in pages], dtype=np.int64).reshape(n, 4).T.copy()
    crcs = np.array(want, dtype=np.uint32)
    ok = np.zeros(n, dtype=np.uint8)
    library().hc_check_copy(n, ptrs.ctypes.data, shape[0].ctypes.data, shape[1].ctypes.data,
                            shape[2].ctypes.data, shape[3].ctypes.data, crcs.ctypes.data, ok.ctypes.data, threads)
    return ok.astype(bool).tolist()


def copy_crc(page: Runs, out: np.ndarray) -> int:
    """Copies the page into `out` (contiguous uint8 of exactly its bytes) and returns their CRC-32C."""
    if out.size != page.runs * page.run_bytes or not out.flags.c_contiguous:
        raise ValueError(f"out must be {page.runs * page.run_bytes} contiguous bytes, got {out.size}")
    return library().hc_copy_crc(page.base, page.runs, page.stride, page.run_bytes, out.ctypes.data)
