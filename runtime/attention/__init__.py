"""Attention backends: store the new tokens' K/V in the L1 pool and attend over the paged KV.

One contract (`AttentionBackend`, and `GraphAttentionBackend` for those whose decode runs in CUDA
graphs) and one registry: `BACKENDS` maps a name to a factory that imports the backend's module,
and with it its optional dependencies (triton, flashinfer), only when that backend is asked for.
`runtime/build.py` calls `make_attention` once, with the model's device and dtype, and gets a
concrete backend: nothing is chosen later.

Names (`attention_backend` for prefill and extend, `decode_attention_backend` for decode):
"torch" is the reference path (any device); "cpu" runs the compiled CPU kernel of
`hicache.kernels.cpu` (float32 and bfloat16 pools; it reads the pool in place, where "torch"
gathers each request's KV); "triton" runs the Triton kernels of `hicache.kernels` (CUDA);
"flashinfer" runs FlashInfer's paged kernels (CUDA, fp16/bf16). "auto" (`resolve`): prefill and
extend on flashinfer where it is importable and serves the pool's dtype and head size on CUDA,
else triton on CUDA; on CPU "cpu" where the kernels build and serve the pool's dtype, else torch;
decode as the prefill name, or, when both are "auto", triton on CUDA (measured faster at decode
than FlashInfer's, slower at extend; see benchmarks/RESULTS.md).

Models with multi-head latent attention (DeepSeek-V2) attend through `make_latent_attention`:
the torch latent backend (`attention/latent.py`) on every device; there are no Triton or
FlashInfer MLA kernels yet, so naming those backends for such a model is refused.

This module imports no torch, so that `RuntimeConfig` (and with it the CLI's flag parsing) can
check names against `NAMES` without loading it.
"""
from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    import torch

    from hicache.runtime.batch import ForwardBatch
    from hicache.tiers.gpu.pool import DeviceKVPool
    from hicache.tiers.gpu.req_table import ReqToTokenTable


class AttentionBackend(Protocol):
    """What the model calls for attention. Made once per engine by `make_attention`; called only
    by the scheduler thread, once per layer of each forward pass, layers in order."""

    graphs: bool  # True: decode may be captured in CUDA graphs (no host sync), and it is a GraphAttentionBackend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        """q [T, Hq, D], k and v [T, Hkv, D] for the batch's T new tokens, request after request
        (decode: one per request), in the pool's dtype on its device, RoPE applied; q and k
        contiguous, v possibly a strided view (last dim contiguous). Stores k and v at
        `batch.out_cache_loc` in layer `layer_id`'s pool buffers, waits for that layer's load-back
        (`batch.wait_layer`), and returns [T, Hq, D] (q's dtype and device): each new token's
        causal attention over its request's KV (cached prefix and new tokens), with the scale and
        the layer's sliding window the backend was made with (`make_attention`)."""
        ...


class GraphAttentionBackend(AttentionBackend, Protocol):
    """A backend whose decode passes run inside CUDA graphs (`runtime/cuda_graph.py`). Backends that
    sync with the host (torch) have no such hooks: `graphs` says which of the two a backend is."""

    def capture_state(self, bs: int, max_batch: int, num_heads: int, pool: DeviceKVPool,
                      req_table: ReqToTokenTable) -> Any:
        """Called at capture, before any request exists, for each graph batch size bs <= max_batch:
        the state that graph's passes get as `ForwardBatch.graph_state` (and `before_replay`)."""
        ...

    def before_replay(self, state: Any, rows: torch.Tensor, seq_lens: torch.Tensor, lens: list[int],
                      req_table: ReqToTokenTable) -> None:
        """Called before each replay of the graph captured with `state`: rows and seq_lens are the
        graph's [bs] int64 device inputs (padding rows included), lens the same lengths on the
        host. May queue device work on the current stream; never syncs."""
        ...


class SplitAttention:
    """Prefill and extend passes on one backend, decode passes on another; the graph hooks are the
    decode backend's (called only when its `graphs` is true)."""

    def __init__(self, prefill: AttentionBackend, decode: AttentionBackend):
        self.prefill, self.decode = prefill, decode
        self.graphs = decode.graphs

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        impl = self.decode if batch.mode == "decode" else self.prefill
        return impl.forward(q, k, v, layer_id, batch)

    def capture_state(self, bs: int, max_batch: int, num_heads: int, pool: DeviceKVPool,
                      req_table: ReqToTokenTable) -> Any:
        return self.decode.capture_state(bs, max_batch, num_heads, pool, req_table)

    def before_replay(self, state: Any, rows: torch.Tensor, seq_lens: torch.Tensor, lens: list[int],
                      req_table: ReqToTokenTable) -> None:
        self.decode.before_replay(state, rows, seq_lens, lens, req_table)


Windows = tuple  # per layer: its sliding window W, or None (full attention); () for no windowed layer


def _torch(head_dim: int, device: torch.device, scale: float | None, windows: Windows) -> AttentionBackend:
    from hicache.runtime.attention.reference import TorchAttention

    return TorchAttention(head_dim, scale, windows)


def _cpu(head_dim: int, device: torch.device, scale: float | None, windows: Windows) -> AttentionBackend:
    if device.type != "cpu":
        raise ValueError(f"attention_backend 'cpu' runs on the CPU, got {device}")
    from hicache.kernels import cpu

    if not cpu.available():
        raise ValueError("attention_backend 'cpu' needs a C++ compiler to build its kernels; use torch")
    from hicache.runtime.attention.cpu import CpuAttention

    return CpuAttention(head_dim, scale, windows)


def _triton(head_dim: int, device: torch.device, scale: float | None, windows: Windows) -> AttentionBackend:
    _require_cuda("triton", device)
    from hicache.runtime.attention.triton import TritonAttention

    return TritonAttention(head_dim, scale, windows)


def _flashinfer(head_dim: int, device: torch.device, scale: float | None, windows: Windows) -> AttentionBackend:
    _require_cuda("flashinfer", device)
    from hicache.kernels import flashinfer

    if not flashinfer.available():
        raise ValueError("attention_backend 'flashinfer' needs the flashinfer package (pip install flashinfer-python)")
    from hicache.runtime.attention.flashinfer import FlashInferAttention

    return FlashInferAttention(head_dim, scale, windows)


def _require_cuda(name: str, device: torch.device) -> None:
    if not _cuda(device):
        raise ValueError(f"attention_backend {name!r} needs a CUDA device and the triton package, got {device}")


def _cuda(device: torch.device) -> bool:
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


# name -> factory(head_dim, device, scale (None: head_dim**-0.5), windows)
BACKENDS: dict[str, Callable[[int, torch.device, float | None, Windows], AttentionBackend]] = {
    "torch": _torch, "cpu": _cpu, "triton": _triton, "flashinfer": _flashinfer}
NAMES = ("auto", *BACKENDS)  # what attention_backend and decode_attention_backend accept


def check_names(name: str, decode_name: str) -> None:
    """ValueError naming the option whose value is not in `NAMES`."""
    for option, value in (("attention_backend", name), ("decode_attention_backend", decode_name)):
        if value not in NAMES:
            raise ValueError(f"{option} must be one of {', '.join(NAMES)}, got {value!r}")


def resolve(name: str, decode_name: str, device: torch.device, dtype: torch.dtype,
            head_dim: int, cpu_kernels: bool = True) -> tuple[str, str]:
    """The concrete (prefill, decode) names for a KV pool of this dtype and head size on this
    device: "auto" as the module
    docstring says (never cpu without `cpu_kernels`), other names kept."""
    check_names(name, decode_name)
    cuda = _cuda(device)
    if name == "auto":
        from hicache.kernels import flashinfer

        fits = cuda and flashinfer.available() and flashinfer.supports(dtype, head_dim)
        name = "flashinfer" if fits else ("triton" if cuda else _cpu_or_torch(device, dtype, head_dim, cpu_kernels))
        if decode_name == "auto":
            decode_name = "triton" if cuda else name
    return name, name if decode_name == "auto" else decode_name


def _cpu_or_torch(device: torch.device, dtype: torch.dtype, head_dim: int, allowed: bool) -> str:
    if device.type != "cpu" or not allowed:
        return "torch"
    from hicache.kernels import cpu

    return "cpu" if cpu.supports(dtype, head_dim) and cpu.available() else "torch"


def make_attention(name: str, decode_name: str, device: torch.device, dtype: torch.dtype,
                   head_dim: int, scale: float | None = None, windows: Windows = (),
                   cpu_kernels: bool = True) -> AttentionBackend:
    """The backend for a model on `device` whose KV pool holds `dtype` and heads of `head_dim`,
    attending with `scale` (None: head_dim**-0.5) and per-layer sliding `windows`: the one
    backend `resolve` names (auto never naming cpu without `cpu_kernels`), or a
    `SplitAttention` when prefill and decode differ.
    ValueError for unknown names, and for a backend that cannot run here."""
    windows = windows if any(windows) else ()
    prefill_name, decode_name = resolve(name, decode_name, device, dtype, head_dim, cpu_kernels)
    prefill = BACKENDS[prefill_name](head_dim, device, scale, windows)
    if decode_name == prefill_name:
        return prefill
    return SplitAttention(prefill, BACKENDS[decode_name](head_dim, device, scale, windows))


def make_latent_attention(name: str, decode_name: str, kv_lora_rank: int, scale: float) -> AttentionBackend:
    """The backend of a model with latent attention (MLA): `attention/latent.py`'s torch path, for
    "auto" or "torch"; ValueError for another name (no MLA kernels of that backend)."""
    check_names(name, decode_name)
    for option, value in (("attention_backend", name), ("decode_attention_backend", decode_name)):
        if value not in ("auto", "torch"):
            raise ValueError(f"{option} {value!r} has no multi-head latent attention (MLA) kernels: DeepSeek-V2 "
                             "models run on the torch latent backend only (auto or torch)")
    from hicache.runtime.attention.latent import LatentAttention

    return LatentAttention(kv_lora_rank, scale)
