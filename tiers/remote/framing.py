"""L3 values: one page (K and V of every layer) behind a fixed header.

Header (little-endian, 48 bytes): magic b"HKV" + format version (1 byte), dtype code (u16), ndim
(u16), shape (6 x u32, zero-padded), payload length (u64), CRC-32 of the payload (u32), then 4 pad
bytes. `decode_into` checks every field against the page it fills and raises `CorruptValue` on any
mismatch, before copying a byte.
"""
from __future__ import annotations

import struct
import zlib

import numpy as np
import torch

MAGIC = b"HKV"
VERSION = 1
_HEADER = struct.Struct("<3sBHH6IQI4x")
HEADER_SIZE = _HEADER.size
_DTYPES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4, torch.uint8: 5, torch.int8: 6}


class CorruptValue(ValueError):
    """A stored value whose header or checksum does not match the page it should fill."""


def encode(page: torch.Tensor) -> bytes:
    """Header + the page's bytes (row-major, one copy if `page` is not contiguous)."""
    if page.dim() > 6 or page.dtype not in _DTYPES:
        raise ValueError(f"cannot frame a {page.dtype} tensor of {page.dim()} dims")
    raw = page.detach().contiguous().view(torch.uint8).reshape(-1).numpy()
    shape = list(page.shape) + [0] * (6 - page.dim())
    header = _HEADER.pack(MAGIC, VERSION, _DTYPES[page.dtype], page.dim(), *shape, raw.nbytes, zlib.crc32(raw))
    return b"".join((header, raw.data))


def decode_into(value, page: torch.Tensor) -> None:
    """Copies the payload of `value` (bytes or a buffer) into `page` after checking the header and
    the checksum against it; CorruptValue otherwise."""
    view = memoryview(value)
    if len(view) < HEADER_SIZE:
        raise CorruptValue(f"value of {len(view)} bytes is shorter than the header")
    magic, version, dtype, ndim, *rest = _HEADER.unpack_from(view)
    shape, length, crc = tuple(rest[:ndim]), rest[6], rest[7]
    want = (MAGIC, VERSION, _DTYPES.get(page.dtype), page.dim(), tuple(page.shape), page.numel() * page.element_size())
    if (magic, version, dtype, ndim, shape, length) != want:
        raise CorruptValue(f"header {(magic, version, dtype, ndim, shape, length)} does not match the page {want}")
    payload = view[HEADER_SIZE:]
    if len(payload) != length:
        raise CorruptValue(f"payload of {len(payload)} bytes, header says {length}")
    if zlib.crc32(payload) != crc:
        raise CorruptValue("checksum mismatch")
    _copy_bytes(payload, page)


def _copy_bytes(payload: memoryview, page: torch.Tensor) -> None:
    """One copy of the row-major bytes `payload` into `page` (a host page, contiguous or strided).
    The payload is often read-only (bytes, a buffer into LMDB's map): numpy views it as it is,
    where `torch.frombuffer` warns that its tensor over a read-only buffer is writable; the page is
    written through a numpy view of its bytes. Other pages take an extra copy of the payload."""
    src = np.frombuffer(payload, dtype=np.uint8)
    try:
        dst = page.view(torch.uint8).numpy()  # [..., last dim * element size], the page's strides
    except (RuntimeError, TypeError):  # no numpy byte view: a device page, a last dim with stride > 1
        page.copy_(torch.frombuffer(bytearray(payload), dtype=page.dtype).view(page.shape))
        return
    np.copyto(dst, src.reshape(dst.shape))
