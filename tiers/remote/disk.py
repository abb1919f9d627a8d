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
process truncated, or a page the disk fails to read (EIO). `DataFile` narrows both. Values (the
bulk of the file, pages of KV) are copied out with `pread` at the offset LMDB's buffer points to,
never touched through the map: a failing read is an OSError, a short one a truncated file. Only the
small B-tree pages are read through the map; before each operation `DataFile.check` compares the
file's size with the largest seen (LMDB never shrinks it), so a truncation is found before the
map is touched again (one that lands between the check and a B-tree read can still SIGBUS). Not
touching values through the map also keeps them out of the process's resident set: they stay in
the kernel's page cache, which it reclaims under pressure.
"""
from __future__ import annotations

import errno
import os
import threading

import numpy as np

MIB = 1 << 20
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
    """Before `lmdb.open(path)`: a new store (no `data.mdb` yet) needs `min_free` bytes free, and
    the lock file gets real blocks. OSError (ENOSPC) otherwise; the caller degrades and retries."""
    if not os.path.exists(os.path.join(path, "data.mdb")):
        free = free_bytes(path)
        if free < min_free:
            raise OSError(errno.ENOSPC, f"{free / MIB:.1f} MiB free, a new store needs {min_free / MIB:.1f} MiB "
                          "(min_free_mb)", path)
    allocate_lock_file(os.path.join(path, "lock.mdb"), lock_file_bytes(max_readers))


def allocate_lock_file(lock: str, size: int) -> None:
    """Allocates every block of `lock`: a new (empty) file to `size`, as LMDB would size it; an existing
    one to its own size, never more (a process that has it mapped reads its reader count from it and
    must not see slots past its map). Filesystems without fallocate are left to LMDB as before."""
    fallocate = getattr(os, "posix_fallocate", None)  # not on macOS
    if fallocate is None:
        return
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        current = os.fstat(fd).st_size
        try:
            fallocate(fd, 0, current or size)
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                return
            raise OSError(e.errno, f"cannot allocate LMDB's lock file: {e.strerror}", lock) from None
    finally:
        os.close(fd)


class Truncated(OSError):
    """`data.mdb` is shorter than LMDB's pages need: truncated under the store."""


class DataFile:
    """`data.mdb` of an open LMDB environment, read with `pread` (see the module docstring)."""

    def __init__(self, path: str, pages_bytes: int):
        """`pages_bytes`: what LMDB's pages take, (last page number + 1) x page size. Truncated if
        the file is shorter: opening checks the meta pages only, the first read of a page past the
        end would SIGBUS."""
        self.path = os.path.join(path, "data.mdb")
        self.fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        self.size = os.fstat(self.fd).st_size
        if self.size < pages_bytes:
            os.close(self.fd)
            raise Truncated(errno.EIO, f"{self.size} bytes, its pages need {pages_bytes}: truncated",
                            self.path)
        self.base = map_start(self.fd)
        self._local = threading.local()  # a reused buffer per reading thread: no fresh pages per value

    def check(self) -> None:
        """Truncated if the file shrank since the last check (LMDB only ever grows it)."""
        size = os.fstat(self.fd).st_size
        if size < self.size:
            raise Truncated(errno.EIO, f"shrank from {self.size} to {size} bytes: truncated under the store",
                            self.path)
        self.size = size

    def read(self, value) -> memoryview:
        """The bytes of `value`, a buffer LMDB returned (it points into the map), read from the file at
        the same offset into this thread's buffer: valid until the thread's next read. `value`
        itself where the map was not found. Truncated on a short read."""
        n = len(value)
        if self.base is None or not n:
            return memoryview(value)
        offset = np.frombuffer(value, dtype=np.uint8).__array_interface__["data"][0] - self.base
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < n:
            buf = self._local.buf = bytearray(n)
        view = memoryview(buf)[:n]
        got = os.preadv(self.fd, [view], offset)
        if got != n:
            raise Truncated(errno.EIO, f"read {got} of {n} bytes at {offset}: truncated", self.path)
        return view

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
