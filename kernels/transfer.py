"""Triton page transfer between the pinned host KV pool and the device KV pool.

Needs triton and a CUDA device; import this module lazily. The kernel reads or writes the pinned
host buffer directly (it is mapped into the device's address space), so many scattered pages
move in one launch instead of one copy per page per layer. Device layers are separate
[slots, H, D] buffers, reached through a table of their addresses (`layer_pointers`).

Host layouts (`hicache.tiers.host.pool.HostKVPool`):
  layer_first: [2, L, slots, H, D];  page_first: [pages, 2, L, page_size, H, D].
Reference: the pool's torch `get_layer` / `set_layer` index copies.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
import triton
import triton.language as tl

from hicache.kernels.checks import index_vector, require

BLOCK_T = 8


@triton.jit(do_not_specialize=["n", "first_layer"])  # one build for every size and layer
def _copy(Host, DevPtrs, HostSlots, DevSlots, n, first_layer, num_layers_total,
          h_stride_page, h_stride_kv, h_stride_layer,
          HOST_PAGE: tl.constexpr, ROW: tl.constexpr, ROW_P2: tl.constexpr, BLOCK_T: tl.constexpr,
          TO_HOST: tl.constexpr):
    kl = tl.program_id(1)
    kv = (kl % 2).to(tl.int64)
    layer = (first_layer + kl // 2).to(tl.int64)
    dev = tl.load(DevPtrs + kv * num_layers_total + layer).to(tl.pointer_type(Host.dtype.element_ty))
    cols = tl.arange(0, ROW_P2)
    for blk in range(tl.program_id(0), tl.cdiv(n, BLOCK_T), tl.num_programs(0)):  # grid-stride over tokens
        offs_t = blk * BLOCK_T + tl.arange(0, BLOCK_T)
        t_mask = offs_t < n
        hs = tl.load(HostSlots + offs_t, mask=t_mask, other=0).to(tl.int64)
        ds = tl.load(DevSlots + offs_t, mask=t_mask, other=0).to(tl.int64)
        h_off = (hs // HOST_PAGE) * h_stride_page + kv * h_stride_kv + layer * h_stride_layer + (hs % HOST_PAGE) * ROW
        d_off = ds * ROW
        mask = t_mask[:, None] & (cols < ROW)[None, :]
        if TO_HOST:
            x = tl.load(dev + d_off[:, None] + cols[None, :], mask=mask)
            tl.store(Host + h_off[:, None] + cols[None, :], x, mask=mask)
        else:
            x = tl.load(Host + h_off[:, None] + cols[None, :], mask=mask)
            tl.store(dev + d_off[:, None] + cols[None, :], x, mask=mask)


class DeviceLayers(NamedTuple):
    ptrs: torch.Tensor  # [2, L] int64, device: addresses of K then V of every layer
    dtype: torch.dtype
    row_shape: tuple[int, int]  # (H, D) of one slot


def layer_pointers(k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor]) -> DeviceLayers:
    """The address table of the device pool's per-layer K and V buffers (kept alive by the caller).
    Their slot counts may differ (a pool whose windowed layers hold fewer slots): the caller
    passes each layer slots it has."""
    require(len(k_buffers) == len(v_buffers) and len(k_buffers) > 0, "need as many K as V buffers, at least one")
    first = k_buffers[0]
    for b in list(k_buffers) + list(v_buffers):
        same = b.dim() == 3 and b.shape[1:] == first.shape[1:] and b.dtype == first.dtype and b.device == first.device
        require(same and b.is_contiguous(), "device layers must be contiguous [slots, H, D] buffers of one H, D, "
                                            "dtype and device")
    ptrs = [[b.data_ptr() for b in k_buffers], [b.data_ptr() for b in v_buffers]]
    return DeviceLayers(torch.tensor(ptrs, dtype=torch.int64, device=first.device), first.dtype,
                        (first.shape[1], first.shape[2]))


def _host_strides(host: torch.Tensor, layout: str, num_layers: int, row: int) -> tuple[int, int, int, int]:
    """(host slots per page, page stride, kv stride, layer stride) in elements."""
    if layout == "layer_first":
        require(host.dim() == 5 and host.shape[:2] == (2, num_layers),
                f"layer_first host buffer must be [2, {num_layers}, slots, H, D]")
        return 1, row, host.stride(0), host.stride(1)
    require(layout == "page_first", f"layout must be layer_first or page_first, got {layout!r}")
    require(host.dim() == 6 and host.shape[1:3] == (2, num_layers),
            f"page_first host buffer must be [pages, 2, {num_layers}, page, H, D]")
    return host.shape[3], host.stride(0), host.stride(1), host.stride(2)


def copy_kv(host: torch.Tensor, layout: str, device: DeviceLayers, host_slots: torch.Tensor,
            device_slots: torch.Tensor, layers: range, to_host: bool, max_blocks: int = 0) -> None:
    """Copy K and V of `layers` for token slots host_slots[i] <-> device_slots[i], in one launch.

    max_blocks > 0 caps the programs per layer and K/V (each then loops over token blocks): a
    load-back running beside compute then holds a few SMs instead of all of them.

    host: the pinned host pool buffer (`layout`), dtype of the device layers; device: from
    `layer_pointers`; host_slots, device_slots: [n] int64 on the device. Queued on the current
    stream; slots must be in range (not checked: that would sync)."""
    require(host.device.type == "cpu" and host.is_pinned() and host.is_contiguous(),
            "host must be a contiguous pinned CPU tensor")
    require(host.dtype == device.dtype, f"host dtype {host.dtype} differs from the device pool's {device.dtype}")
    dev_ptrs, row_shape = device.ptrs, device.row_shape
    require(dev_ptrs.device.type == "cuda" and dev_ptrs.dtype == torch.int64 and dev_ptrs.dim() == 2
            and dev_ptrs.shape[0] == 2,
            f"dev_ptrs must be [2, L] int64 on CUDA, got {tuple(dev_ptrs.shape)} {dev_ptrs.dtype} {dev_ptrs.device}")
    num_layers = dev_ptrs.shape[1]
    require(len(layers) > 0 and layers.step == 1 and 0 <= layers.start and layers.stop <= num_layers,
            f"layers {layers} out of [0, {num_layers})")
    index_vector("device_slots", device_slots)
    index_vector("host_slots", host_slots, device_slots.numel())
    require(host_slots.device == dev_ptrs.device == device_slots.device, "slots must be on the device of dev_ptrs")
    row = row_shape[0] * row_shape[1]
    require(host.shape[-2:] == tuple(row_shape),
            f"host rows {tuple(host.shape[-2:])} differ from the device's {tuple(row_shape)}")
    host_page, s_page, s_kv, s_layer = _host_strides(host, layout, num_layers, row)
    n = device_slots.numel()
    if n == 0:
        return
    blocks = triton.cdiv(n, BLOCK_T)
    _copy[(min(blocks, max_blocks) if max_blocks > 0 else blocks, 2 * len(layers))](
        host, dev_ptrs, host_slots, device_slots, n, layers.start, num_layers, s_page, s_kv, s_layer,
        HOST_PAGE=host_page, ROW=row, ROW_P2=triton.next_power_of_2(row), BLOCK_T=BLOCK_T, TO_HOST=to_host,
        num_warps=4)
