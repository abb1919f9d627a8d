"""Disk space for the LMDB tier: what must hold before LMDB maps a file, so that a full disk is an
error LMDB returns and never a SIGBUS.

LMDB maps two files. `lock.mdb` (the reader table) is mapped read-write and created by ftruncate,
so it is sparse: the first write into one of its pages (LMDB does it on open, and whenever a
thread takes a reader slot) makes the filesystem allocate a block, and on a full disk the kernel
answers that page fault with SIGBUS, which kills the process. `prepare` gives the lock file real
blocks first (`posix_fallocate`, which fails with ENOSPC instead). `data.mdb` is mapped read-only
(`writemap=False`, py-lmdb's default, which `lmdb_env.py` passes explicitly): LMDB writes it with
`pwrite`, which returns ENOSPC or EIO on a full disk. With `writemap=True` LMDB would ftruncate it to
the whole map size, sparse, and write through the map: the same SIGBUS as soon as the disk fills.

Reads of `data.mdb` through the map can still SIGBUS: a page past the end of a file that another
process truncated, or a page the disk fails to read (EIO). `DataFile.check` compares the file's
size with the largest seen (LMDB never shrinks it) before each operation, so a truncation is found
before the map is read again (one that lands between the check and a read can still SIGBUS). A
disk that fails to read a page still SIGBUSes: py-lmdb touches every page of a value when it looks
it up, so no read path through py-lmdb avoids the map.

Pages of the map that were read count in the process's resident set (file-backed, shared with the
page cache) until the kernel reclaims them. `release` drops a value's pages from it right after
the value was copied out, and `DataFile.drop` the whole map's now and then (the writer does, after
a write): they stay in the page cache, which the kernel reclaims under pressure.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading

import numpy as np

MIB = 1 << 20
PRIVATE_DIR, PRIVATE_FILE = 0o700, 0o600  # a store's folders and files: its owner's alone (cached prompts' KV)
# LMDB 0.9 sizes its lock file (max_readers - 1) * sizeof(MDB_reader) + sizeof(MDB_txninfo): 64 and
# 192 bytes on 64-bit builds
_READER_BYTES, _HEADER_BYTES = 64, 192


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still use on the filesystem of `path`."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def lock_file_bytes(max_readers: int) -> int:
    return (max_readers - 1) * _READER_BYTES + _HEADER_BYTES


def prepare(path: str, max_readers: int, min_free: int) -> None:
    """Before `lmdb.open(path)`: a new store (no `data.mdb` yet) needs `min_free` bytes free; the
    lock file gets real blocks, and so does an existing `data.mdb` (a copy made sparse, or a file a
    `writemap` process sized, has holes: on tmpfs, reading a hole through the map on a full disk is
    a SIGBUS too). OSError (ENOSPC) otherwise; the caller degrades and retries."""
    data = os.path.join(path, "data.mdb")
    if not os.path.exists(data):
        need_free(path, min_free)
    allocate(os.path.join(path, "lock.mdb"), lock_file_bytes(max_readers))
    if os.path.exists(data):
        allocate(data, 0)


def need_free(path: str, min_free: int) -> None:
    """OSError (ENOSPC) unless the filesystem of `path` has `min_free` bytes free: what a new store needs."""
    free = free_bytes(path)
    if free < min_free:
        raise OSError(errno.ENOSPC, f"{free:,} bytes free ({free / MIB:.1f} MiB), less than the {min_free:,} bytes "
                      f"({min_free / MIB:.1f} MiB, min_free_mb) a new store needs", path)


def allocate(file: str, size: int) -> None:
    """Allocates every block of `file`: a new (empty) file to `size`, as LMDB would size it; an existing
    one to its own size, never more (a process that has the lock file mapped reads its reader count
    from it and must not see slots past its map). Filesystems without fallocate are left as they are."""
    fallocate = getattr(os, "posix_fallocate", None)  # not on macOS
    if fallocate is None:
        return
    fd = os.open(file, os.O_RDWR | os.O_CREAT, PRIVATE_FILE)
    try:
        length = os.fstat(fd).st_size or size
        if not length:
            return
        try:
            fallocate(fd, 0, length)
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                return
            raise OSError(e.errno, f"cannot allocate the blocks of {os.path.basename(file)}: {e.strerror}",
                          file) from None
    finally:
        os.close(fd)


class Truncated(OSError):
    """`data.mdb` is shorter than LMDB's pages need: truncated under the store."""


class DataFile:
    """The size of `data.mdb` under an open LMDB environment, watched (see the module docstring)."""

    def __init__(self, path: str, pages_bytes: int):
        """`pages_bytes`: what LMDB's pages take, (last page number + 1) x page size. Truncated if
        the file is shorter: opening checks the meta pages only, the first read of a page past the
        end would SIGBUS."""
        self.path = os.path.join(path, "data.mdb")
        self.fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        self.size = os.fstat(self.fd).st_size
        if self.size < pages_bytes:
            os.close(self.fd)
            raise Truncated(errno.EIO, f"{self.size} bytes, its pages need {pages_bytes}: truncated", self.path)
        self.base = map_start(self.fd)  # where this process maps it (LMDB has, by now)
        self._lock = threading.Lock()

    def check(self) -> None:
        """Truncated if the file shrank since the last check (LMDB only ever grows it). Readers and
        the writer check at once: each reads the size and compares it under the lock, so that a size
        read before another check recorded a larger one is never taken for a shrink."""
        with self._lock:
            size = os.fstat(self.fd).st_size
            if size < self.size:
                raise Truncated(errno.EIO, f"shrank from {self.size} to {size} bytes: truncated under the store",
                                self.path)
            self.size = size

    def drop(self, map_size: int) -> None:
        """Drops every page of the map from this process's resident set (see `release`): B-tree
        pages move with every write (copy-on-write), so the pages once read spread over the file."""
        if self.base is not None:
            _madvise(self.base, map_size, _DONTNEED)

    def close(self) -> None:
        os.close(self.fd)


def map_start(fd: int) -> int | None:
    """The address at which this process maps offset 0 of the file open as `fd` (None: not mapped,
    or no /proc)."""
    st = os.fstat(fd)
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[3] == device and int(fields[4]) == st.st_ino:
                    return int(fields[0].split("-")[0], 16) - int(fields[2], 16)
    except OSError:
        return None
    return None


def release(values: list) -> None:
    """Drops the map's pages under `values` (buffers LMDB returned; None: skipped) from this
    process's resident set (`MADV_DONTNEED`; their data stays in the file and the page cache). A
    large value owns whole pages (LMDB's overflow pages), so the pages around it are its own."""
    for value in values:
        if value is not None and len(value) >= _PAGE:
            address = np.frombuffer(value, dtype=np.uint8).__array_interface__["data"][0]
            start, end = address - address % _PAGE, -(-(address + len(value)) // _PAGE) * _PAGE
            _madvise(start, end - start, _DONTNEED)


def _libc_madvise():
    """libc's madvise (a no-op where the C library has none)."""
    fn = getattr(ctypes.CDLL(None), "madvise", None)
    if fn is None:
        return lambda *_args: 0
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


_PAGE = mmap.PAGESIZE
_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)
_madvise = _libc_madvise()
