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
"""
from __future__ import annotations

import errno
import os

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
