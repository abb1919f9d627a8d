"""L3 values: one page (K and V of every layer) behind a fixed header that binds it to its key.

Header (little-endian, 104 bytes, `struct` format `<3sBHH6IQQH6x16s32s`): magic b"HKV", format
version (u8, `VERSION`), dtype code (u16), ndim (u16), shape (6 x u32, zero-padded), payload length
(u64), CRC-32C of the payload (u64 holding the u32), flags (u16; `FLAG_MAC`: the MAC field holds a MAC), 6 pad
bytes, key digest (16 bytes), MAC (32 bytes; zeros without a secret). The payload follows.

- Key digest: blake2b-128 (personalised `hicache-l3-key`) of the full storage key, the exact bytes
  the backend stores the value under (its namespace prefix included), so a value copied or swapped
  to another key, namespace or tenant does not decode.
- MAC (with a storage secret only): HMAC-SHA256 keyed with the secret over u32-LE length of the
  storage key, the storage key, the header's first 64 bytes (everything but the MAC) and the
  payload. A writer without the secret cannot make a value that a reader with it accepts.

`decode_into(value, page, key, secret)` checks all of it against the page it fills and the key it
was read under, before copying a byte: `StaleValue` for another format version, `CorruptValue` for
anything else. With a secret the MAC is checked instead of the checksum (it covers the payload);
without one the checksum is checked and a MAC, if any, is ignored.

The checksum is CRC-32C computed by the CPU's CRC instruction, and, like the copies that frame and
unframe a page, it runs with the GIL released: the storage threads frame and check pages beside the
scheduler thread instead of taking turns with it. Where the compiled copies build
(`kernels/cpu_io.py`), a page is framed with one call (copy and checksum), and a backend checks and
copies a whole batch of pages read with one call (`open_value`, then `cpu_io.check_copy`).
"""
from __future__ import annotations

import hashlib
import hmac
import struct

import crc32c
import numpy as np
import torch

import hicache.kernels.cpu_io as cpu_io

MAGIC = b"HKV"
VERSION = 4
FLAG_MAC = 1
MIN_SECRET_BYTES = 16
_HEADER = struct.Struct("<3sBHH6IQQH6x16s32s")
HEADER_SIZE = _HEADER.size
_SIGNED = HEADER_SIZE - 32  # the header bytes the MAC covers: all but the MAC itself
_NO_MAC = bytes(32)
_KEY_PERSON = b"hicache-l3-key"
_DTYPES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4, torch.uint8: 5, torch.int8: 6}


class CorruptValue(ValueError):
    """A stored value that does not match the page it should fill or the key it was read under
    (header, key digest, checksum or MAC)."""


class StaleValue(CorruptValue):
    """A value of another format version (written before an upgrade, or by another version)."""


def check_secret(secret: str | bytes | None) -> bytes | None:
    """The storage secret as bytes (None: no MAC). ValueError, naming no part of it, if it is
    shorter than `MIN_SECRET_BYTES`."""
    if secret is None:
        return None
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    if len(raw) < MIN_SECRET_BYTES:
        raise ValueError(f"the L3 storage secret must be at least {MIN_SECRET_BYTES} bytes (got {len(raw)}); "
                         "use e.g. 32 random bytes in hex")
    return raw


def key_digest(key: bytes | str) -> bytes:
    """16-byte digest of a full storage key (bytes, or a str stored as its UTF-8)."""
    return hashlib.blake2b(_raw_key(key), digest_size=16, person=_KEY_PERSON).digest()


def value_size(page: torch.Tensor) -> int:
    """The bytes of `page`'s value: header and payload."""
    return HEADER_SIZE + page.numel() * page.element_size()


def encode(page: torch.Tensor, key: bytes | str, secret: bytes | None = None,
           out: np.ndarray | None = None) -> memoryview:
    """Header + the page's bytes (row-major), bound to the storage key `key` and, with `secret`
    (from `check_secret`), MACed: a buffer made with one copy of the page, in a new buffer or at
    the start of `out` (uint8, at least `value_size(page)` bytes; reusing one saves the page faults
    of a new buffer)."""
    if page.dim() > 6 or page.dtype not in _DTYPES:
        raise ValueError(f"cannot frame a {page.dtype} tensor of {page.dim()} dims")
    nbytes = page.numel() * page.element_size()
    value = np.empty(HEADER_SIZE + nbytes, dtype=np.uint8) if out is None else out[:HEADER_SIZE + nbytes]
    payload = value[HEADER_SIZE:]
    blocks = cpu_io.runs(page) if cpu_io.library() is not None else None
    if blocks is not None:  # copy and checksum in one call, the GIL released
        crc = cpu_io.copy_crc(blocks, payload)
    else:
        np.copyto(payload.reshape(-1 if page.dim() == 0 else page.shape[:-1] + (-1,)), _byte_view(page))
        crc = checksum(payload)
    shape = list(page.shape) + [0] * (6 - page.dim())
    key = _raw_key(key)
    flags = FLAG_MAC if secret else 0
    header = _HEADER.pack(MAGIC, VERSION, _DTYPES[page.dtype], page.dim(), *shape, nbytes, crc,
                          flags, key_digest(key), _NO_MAC)
    if secret:
        header = header[:_SIGNED] + _mac(secret, key, header, payload.data)
    value[:HEADER_SIZE] = np.frombuffer(header, dtype=np.uint8)
    return value.data


def _byte_view(page: torch.Tensor) -> np.ndarray:
    """The page's bytes as numpy sees them ([..., last dim * element size], its strides), or a
    contiguous copy where numpy cannot view them (a device page, a last dim with stride > 1)."""
    try:
        return page.detach().view(torch.uint8).numpy()
    except (RuntimeError, TypeError):
        return page.detach().contiguous().cpu().view(torch.uint8).numpy()


def decode_into(value, page: torch.Tensor, key: bytes | str, secret: bytes | None = None) -> None:
    """Copies the payload of `value` (bytes or a buffer), read under the storage key `key`, into
    `page` after checking header, key digest and checksum (with `secret`: the MAC instead of the
    checksum) against them; StaleValue or CorruptValue otherwise, with nothing copied."""
    payload, crc = open_value(value, page, key, secret)
    if crc is not None and checksum(payload) != crc:
        raise CorruptValue("checksum mismatch")
    _copy_bytes(payload, page)


def open_value(value, page: torch.Tensor, key: bytes | str,
               secret: bytes | None = None) -> tuple[memoryview, int | None]:
    """`decode_into`'s checks but the checksum's: (the payload, the CRC-32C it must have; None when
    the MAC, checked already, covers it). StaleValue or CorruptValue as `decode_into`."""
    view = memoryview(value)
    fields = _header(view)
    magic, version, dtype, ndim, *rest = fields
    shape, length, crc, flags, digest, mac = tuple(rest[:ndim]), rest[6], rest[7], rest[8], rest[9], rest[10]
    key = _raw_key(key)
    if not hmac.compare_digest(digest, key_digest(key)):
        raise CorruptValue("the value is stored under another key")
    want = (_DTYPES.get(page.dtype), page.dim(), tuple(page.shape), page.numel() * page.element_size())
    if (dtype, ndim, shape, length) != want:
        raise CorruptValue(f"header {(dtype, ndim, shape, length)} does not match the page {want}")
    payload = view[HEADER_SIZE:]
    if len(payload) != length:
        raise CorruptValue(f"payload of {len(payload)} bytes, header says {length}")
    if flags & ~FLAG_MAC or (not flags & FLAG_MAC and mac != _NO_MAC):
        raise CorruptValue(f"bad flags {flags:#x} or a MAC field without the flag")
    if secret:
        if not flags & FLAG_MAC:
            raise CorruptValue("no MAC, and this store requires one")
        if not hmac.compare_digest(mac, _mac(secret, key, view[:_SIGNED], payload)):
            raise CorruptValue("MAC mismatch")
        return payload, None
    return payload, crc


def checksum(payload) -> int:
    """CRC-32C of a payload (bytes or a buffer): the value's checksum without a secret."""
    return crc32c.crc32c(payload)


def _header(view: memoryview) -> tuple:
    """The unpacked header of a value of this version; StaleValue for another version,
    CorruptValue for anything that is not a value."""
    if len(view) < len(MAGIC) + 1 or bytes(view[:len(MAGIC)]) != MAGIC:
        raise CorruptValue("not a framed value (bad magic)")
    version = view[len(MAGIC)]
    if version != VERSION:
        raise StaleValue(f"format version {version}, this server reads {VERSION}")
    if len(view) < HEADER_SIZE:
        raise CorruptValue(f"value of {len(view)} bytes is shorter than the header")
    return _HEADER.unpack_from(view)


def _mac(secret: bytes, key: bytes, header, payload) -> bytes:
    m = hmac.new(secret, len(key).to_bytes(4, "little"), hashlib.sha256)
    m.update(key)
    m.update(header[:_SIGNED])
    m.update(payload)
    return m.digest()


def _raw_key(key: bytes | str) -> bytes:
    return key.encode() if isinstance(key, str) else bytes(key)


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
