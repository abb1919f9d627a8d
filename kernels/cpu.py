"""CPU kernels of the decoder layer: paged attention that reads the KV pool in place, RMSNorm
(alone or after the residual add), RoPE, SiLU-and-multiply, oneDNN linears on prepacked
weights, and linears of few rows on weights held exactly in GGUF's Q4_1 or Q8_0 blocks.

The C++ sources (`cpu_ops.cpp`, `cpu_attention.cpp`, `cpu_quant.cpp`, the header `cpu_vec.h`; no
torch headers) are compiled at first use with the machine's C++ compiler (`-O3 -march=native
-fopenmp`) into the user's cache folder, keyed by the sources, the compiler and the CPU's flags,
and loaded with ctypes. Where no compiler exists or the build fails,
`library()` logs one warning and returns None: callers keep their torch paths. Each call runs an
OpenMP team of torch's thread count, in torch's own libgomp (one pool for both).

Tensors are CPU tensors of float32 or bfloat16 (`supports`; the block linears float32 only);
every launcher checks shapes, dtypes and contiguity and raises ValueError naming the argument,
since the C++ side trusts its pointers.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, NamedTuple

import torch

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("cpu_ops.cpp", "cpu_attention.cpp", "cpu_quant.cpp"))
HEADERS = (Path(__file__).with_name("cpu_vec.h"),)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}

_P, _I, _F, _N = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
SIGNATURES = {
    "hc_paged_attention": [_N] + [_P] * 6 + [_I] + [_P] * 5 + [_I] * 6 + [_F, _I, _P, _N] + [_P] * 3 + [_I, _P],
    "hc_add_rmsnorm": [_N] + [_P] * 5 + [_I, _I, _F, _N],
    "hc_rope": [_N] + [_P] * 6 + [_I] * 6 + [_N],
    "hc_silu_mul": [_N, _P, _P, _I, _I, _N],
    "hc_quantize": [_N, _P, _I, _I, _P, _N],
    "hc_linear_quant": [_N, _P, _P, _P, _I, _I, _I, _N],
}
RESULTS = {"hc_quantize": _N}


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hicache" / "cpu_kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def build(compiler: str, name: str = "cpu_ops", sources: tuple[Path, ...] = SOURCES,
          headers: tuple[Path, ...] = HEADERS) -> Path:
    """The shared library `name` compiled from `sources` (the cached one when sources, headers,
    compiler, flags and CPU are unchanged). Raises OSError or CalledProcessError."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    parts = [*(source.read_text() for source in sources + headers), compiler, version, *FLAGS, _cpu_flags()]
    key = hashlib.sha256("\0".join(parts).encode())
    target = cache_dir() / f"{name}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:  # built aside and renamed: processes building at once never load a half-written file
        subprocess.run([compiler, *FLAGS, *map(str, sources), "-o", tmp], capture_output=True, text=True, check=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load(name: str, sources: tuple[Path, ...], headers: tuple[Path, ...], signatures: dict[str, list],
         results: dict[str, object], fallback: str) -> ctypes.CDLL | None:
    """The library `name` (`build`), loaded with its functions' argument and result types; None,
    after one warning that ends with `fallback` (what callers do instead), where it cannot be."""
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        logger.warning("no C++ compiler found: %s", fallback)
        return None
    try:
        lib = ctypes.CDLL(str(build(compiler, name, sources, headers)))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", None) or str(e)
        logger.warning("building %s failed, %s: %s", name, fallback, detail[-2000:])
        return None
    for fn_name, args in signatures.items():
        fn = getattr(lib, fn_name)
        fn.argtypes, fn.restype = args, results.get(fn_name)
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, built on first call; None (after one warning) where they cannot be."""
    return load("cpu_ops", SOURCES, HEADERS, SIGNATURES, RESULTS, "the CPU model step runs on plain torch ops (slower)")


def available() -> bool:
    return library() is not None


def supports(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `paged_attention` serves a pool of this dtype and head size."""
    return dtype in DTYPES and head_dim % 16 == 0


def _require(ok: bool, message: str | Callable[[], str]) -> None:
    """ValueError(message) unless ok; a message that needs formatting comes as a callable, so that
    the launchers (a decode step calls them hundreds of times) format only what they raise."""
    if not ok:
        raise ValueError(message() if callable(message) else message)


def _check(name: str, t: torch.Tensor, dtype: torch.dtype, contiguous: bool = True) -> None:
    _require(t.device.type == "cpu", lambda: f"{name} must be a CPU tensor, got {t.device}")
    _require(t.dtype == dtype, lambda: f"{name} must be {dtype}, got {t.dtype}")
    _require(not contiguous or t.is_contiguous(), lambda: f"{name} must be contiguous")


def _rows(name: str, t: torch.Tensor, width: int) -> int:
    """The row stride of a [T, width] view whose rows are each contiguous."""
    _require(t.dim() == 2 and t.shape[1] == width and t.stride(1) == 1,
             lambda: f"{name} must be [T, {width}] with contiguous rows, got {tuple(t.shape)} strides {t.stride()}")
    return t.stride(0)


class SharedKeys(NamedTuple):
    """Decode requests whose first keys are the same slots (a prompt the radix cache shares),
    grouped so that the attention reads those keys once per group (`shared_keys`)."""

    lens: torch.Tensor  # [N] int64: the keys request i shares with its group (0: none)
    members: torch.Tensor  # [M] int64: the grouped requests, group after group
    offsets: torch.Tensor  # [G + 1] int64: group g is members[offsets[g]:offsets[g + 1]]


def shared_keys(req_to_token: torch.Tensor, req_rows: torch.Tensor, prefix_lens: torch.Tensor,
                min_keys: int = 64) -> SharedKeys | None:
    """The groups of a decode batch (request i: row req_rows[i] of req_to_token, prefix_lens[i]
    keys before its new token) whose members share at least `min_keys` first slots; None when
    no two requests do."""
    lens = prefix_lens.tolist()
    by_first: dict[int, list[int]] = {}
    for i, first in enumerate(req_to_token[req_rows, 0].tolist()):
        if lens[i] >= min_keys:
            by_first.setdefault(first, []).append(i)
    shared = [0] * len(lens)
    members, offsets = [], [0]
    for group in (g for g in by_first.values() if len(g) > 1):
        rows = req_to_token[req_rows[group], :min(lens[i] for i in group)]
        common = int((rows == rows[0]).all(0).cumprod(0).sum())
        if common >= min_keys:
            for i in group:
                shared[i] = common
            members.extend(group)
            offsets.append(len(members))
    if not members:
        return None
    return SharedKeys(torch.tensor(shared), torch.tensor(members), torch.tensor(offsets))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_buffer: torch.Tensor,
                    v_buffer: torch.Tensor, out_loc: torch.Tensor, req_to_token: torch.Tensor,
                    req_rows: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor,
                    q_starts: torch.Tensor, scale: float, window: int | None = None,
                    shared: SharedKeys | None = None) -> torch.Tensor:
    """Stores the new tokens' k and v ([T, Hkv, D], rows may be strided views) at `out_loc` ([T]
    int64), then returns [T, Hq, D]: each new token's causal attention over its request's KV,
    read in place from the pool through the request's row of `req_to_token` ([R, C] int64).
    Request i owns `extend_lens[i]` new tokens from `q_starts[i]` in q ([T, Hq, D], contiguous),
    after `prefix_lens[i]` cached ones (all [N] int64). Decode is the case of one new token a
    request. `window` W: a query at position p sees keys p - W < j <= p. `shared` (a decode
    batch's `shared_keys`, no window): each group's shared keys are read once for all its
    members."""
    lib = library()
    _require(lib is not None, "the CPU kernels are not built (no C++ compiler)")
    _require(q.dtype in DTYPES, lambda: f"q must be float32 or bfloat16, got {q.dtype}")
    T, hq, d = q.shape
    _require(k_buffer.dim() == 3 and k_buffer.shape == v_buffer.shape and k_buffer.shape[2] == d,
             lambda: f"k_buffer {tuple(k_buffer.shape)} and v_buffer {tuple(v_buffer.shape)} must be [slots, Hkv, {d}]")
    hkv = k_buffer.shape[1]
    _require(d % 16 == 0, lambda: f"head_dim must be a multiple of 16, got {d}")
    _require(hq % hkv == 0, lambda: f"query heads {hq} are not a multiple of KV heads {hkv}")
    for name, t in (("q", q), ("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        _check(name, t, q.dtype)
    _require(k.shape == v.shape == (T, hkv, d),
             lambda: f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [{T}, {hkv}, {d}]")
    for name, t in (("k", k), ("v", v)):
        _check(name, t, q.dtype, contiguous=False)
        _require(t.stride(2) == 1 and t.stride(1) == d, lambda: f"{name}'s heads must be contiguous within a token")
    n = req_rows.numel()
    for name, t, size in (("out_loc", out_loc, T), ("req_rows", req_rows, n), ("prefix_lens", prefix_lens, n),
                          ("extend_lens", extend_lens, n), ("q_starts", q_starts, n)):
        _check(name, t, torch.int64)
        _require(t.shape == (size,), lambda: f"{name} must be [{size}], got {tuple(t.shape)}")
    _check("req_to_token", req_to_token, torch.int64)
    _require(req_to_token.dim() == 2, "req_to_token must be [R, C]")
    out = torch.empty_like(q)
    groups = (None, None, None, 0, None)
    if shared is not None:
        _require(not window and bool((extend_lens == 1).all()) and shared.lens.shape == (n,)
                 and bool((shared.lens <= prefix_lens).all()), "shared keys are for decode batches without a window")
        partial = torch.empty(n, hq, d + 2)
        groups = (shared.lens.data_ptr(), shared.members.data_ptr(), shared.offsets.data_ptr(),
                  shared.offsets.numel() - 1, partial.data_ptr())
    lib.hc_paged_attention(DTYPES[q.dtype], q.data_ptr(), k.data_ptr(), v.data_ptr(), k_buffer.data_ptr(),
                           v_buffer.data_ptr(), req_to_token.data_ptr(), req_to_token.stride(0), req_rows.data_ptr(),
                           prefix_lens.data_ptr(), extend_lens.data_ptr(), q_starts.data_ptr(), out_loc.data_ptr(),
                           n, hq, hkv, d, k.stride(0), v.stride(0), scale, window or 0, out.data_ptr(),
                           torch.get_num_threads(), *groups)
    return out


def _norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
          ) -> tuple[torch.Tensor | None, torch.Tensor]:
    _require(x.dim() == 2 and weight.shape == (x.shape[1],),
             lambda: f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not fit")
    _require(x.dtype in DTYPES, lambda: f"x must be float32 or bfloat16, got {x.dtype}")
    for name, t in (("x", x), ("weight", weight)) + ((("delta", delta),) if delta is not None else ()):
        _check(name, t, x.dtype)
    _require(delta is None or delta.shape == x.shape, "delta must have x's shape")
    out = torch.empty_like(x)
    total = None if delta is None else torch.empty_like(x)
    library().hc_add_rmsnorm(DTYPES[x.dtype], x.data_ptr(), None if delta is None else delta.data_ptr(),
                             weight.data_ptr(), None if total is None else total.data_ptr(), out.data_ptr(),
                             x.shape[0], x.shape[1], eps, torch.get_num_threads())
    return total, out


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] contiguous, weight [H] of x's dtype -> new [T, H]."""
    return _norm(x, None, weight, eps)[1]


def add_rmsnorm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta rounded to x's dtype, its RMSNorm); x, delta [T, H] contiguous."""
    return _norm(x, delta, weight, eps)


def rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
         cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] int64; q [T, Hq, D], k [T, Hk, D] (heads contiguous, rows may be strided);
    cos_sin [P, D] float32 (cos | sin), P > every position (checked by the caller). Returns the
    rotate-half RoPE of q and k as new contiguous tensors."""
    T, hq, d = q.shape
    hk = k.shape[1]
    _require(k.shape == (T, hk, d) and d % 2 == 0, lambda: f"q {tuple(q.shape)} and k {tuple(k.shape)} do not fit")
    _require(q.dtype in DTYPES and k.dtype == q.dtype,
             lambda: f"q and k must be float32 or bfloat16, got {q.dtype}/{k.dtype}")
    _check("positions", positions, torch.int64)
    _require(positions.shape == (T,), lambda: f"positions must be [{T}]")
    _check("cos_sin", cos_sin, torch.float32)
    _require(cos_sin.dim() == 2 and cos_sin.shape[1] == d, lambda: f"cos_sin must be [P, {d}]")
    for name, t in (("q", q), ("k", k)):
        _check(name, t, q.dtype, contiguous=False)
        _require(t.stride(2) == 1 and t.stride(1) == d, lambda: f"{name}'s heads must be contiguous within a token")
    q_out = torch.empty((T, hq, d), dtype=q.dtype)
    k_out = torch.empty((T, hk, d), dtype=k.dtype)
    library().hc_rope(DTYPES[q.dtype], positions.data_ptr(), q.data_ptr(), k.data_ptr(), q_out.data_ptr(),
                      k_out.data_ptr(), cos_sin.data_ptr(), T, hq, hk, d, q.stride(0), k.stride(0),
                      torch.get_num_threads())
    return q_out, k_out


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = gate | up, contiguous -> silu(gate) * up, new [T, I]."""
    _require(x.dim() == 2 and x.shape[1] % 2 == 0, lambda: f"x must be [T, 2I], got {tuple(x.shape)}")
    _require(x.dtype in DTYPES, lambda: f"x must be float32 or bfloat16, got {x.dtype}")
    _check("x", x, x.dtype)
    out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype)
    library().hc_silu_mul(DTYPES[x.dtype], x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1] // 2,
                          torch.get_num_threads())
    return out


QUANT_KINDS = {"q4_1": (0, 24), "q8_0": (1, 36)}  # block type -> (kernel code, bytes per 32 weights)
QUANT_MAX_ROWS = 8  # linears of up to this many rows read the blocks; larger ones run oneDNN


class QuantizedWeight(NamedTuple):
    """A float32 weight [n, k] held exactly in GGUF blocks of 32: `blocks` uint8 [n, k / 32 * block bytes]."""

    kind: str
    blocks: torch.Tensor
    shape: tuple[int, int]


class PackedLinear(NamedTuple):
    """A weight packed for `linear`: oneDNN's reordered copy, and its exact GGUF blocks where it has them."""

    dense: torch.Tensor
    quantized: QuantizedWeight | None


def quantize_exact(weight: torch.Tensor) -> QuantizedWeight | None:
    """`weight` ([n, k] float32, k a multiple of 32) in Q4_1 blocks, else Q8_0 ones, where every block
    reproduces its 32 values bit for bit (as weights dequantised from such a GGUF tensor do); None
    where neither does. `linear_quantized` then multiplies by exactly these weights."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % 32 or not weight.numel():
        return None
    w = weight.detach().contiguous()
    n, k = w.shape
    for kind, (code, size) in QUANT_KINDS.items():
        blocks = torch.empty((n, k // 32 * size), dtype=torch.uint8)
        if library().hc_quantize(code, w.data_ptr(), n, k, blocks.data_ptr(), torch.get_num_threads()):
            return QuantizedWeight(kind, blocks, (n, k))
    return None


def linear_quantized(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """x [T, k] float32 @ weight.T -> [T, n] float32, reading the weight's blocks: float32 products
    and sums, so only their order differs from a float32 linear's."""
    n, k = weight.shape
    if x.dim() != 2 or x.shape[1] != k or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"x must be a float32 CPU tensor [T, {k}], got {x.dtype} {tuple(x.shape)} on {x.device}")
    x = x.contiguous()  # checked inline: a decode step makes a hundred of these calls
    out = torch.empty((x.shape[0], n), dtype=torch.float32)
    if x.shape[0]:
        library().hc_linear_quant(QUANT_KINDS[weight.kind][0], x.data_ptr(), weight.blocks.data_ptr(), out.data_ptr(),
                                  x.shape[0], n, k, torch.get_num_threads())
    return out


def pack_linear(weight: torch.Tensor, quantized: bool = False) -> PackedLinear | None:
    """`weight` [out, in] reordered once for oneDNN's linear (`linear`), and with `quantized` its
    exact GGUF blocks (`quantize_exact`) for linears of few rows; None where torch has no oneDNN, or
    for bfloat16 where oneDNN has no bfloat16 path on this CPU (no AVX-512 BW/VL/DQ nor AVX-NE-CONVERT).
    oneDNN runs float32 linears several times faster than the default BLAS on small batches; the
    blocks read 5 (Q4_1) or 3.8 (Q8_0) times fewer weight bytes than float32."""
    if not torch.backends.mkldnn.is_available() or weight.dtype not in DTYPES:
        return None
    if weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    return PackedLinear(torch.ops.mkldnn._reorder_linear_weight(weight.detach()),
                        quantize_exact(weight) if quantized else None)


def linear(x: torch.Tensor, packed: PackedLinear) -> torch.Tensor:
    """x [T, in] @ weight.T with the weight from `pack_linear`: on its blocks for T up to
    `QUANT_MAX_ROWS` where it has them, else through oneDNN."""
    if packed.quantized is not None and x.dim() == 2 and x.shape[0] <= QUANT_MAX_ROWS:
        return linear_quantized(x, packed.quantized)
    return torch.ops.mkldnn._linear_pointwise(x, packed.dense, None, "none", [], "")
