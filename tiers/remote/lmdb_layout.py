"""The folder of the `lmdb` L3: `hicache-l3.json` (`{"layout": 2, "shards": N}`) and N LMDB
environments in `shard-00` ... (one writer each, so that N write transactions run at once). A page
key lives in shard `crc32c(storage key) % N`.

The first process to open a new folder writes the layout file (atomically: a link to a finished
file), with its `shards` option; every later opener, of this process or another, reads N from the
file, so all of them route a key to the same shard. A folder with `data.mdb` at its top holds a
store of the single-environment layout (layout 1): it is not opened (`OldLayout`) until it is moved
or deleted. `quarantine` moves a store aside (one that crashed its reader), keeping it for inspection.
"""
from __future__ import annotations

import errno
import json
import os
import threading
import time

import crc32c

from hicache.tiers.remote.disk import PRIVATE_DIR, PRIVATE_FILE, need_free

LAYOUT = 2
LAYOUT_FILE = "hicache-l3.json"
MAX_SHARDS = 64


class OldLayout(OSError):
    """The folder holds an LMDB store of another layout."""


def shard_of(key: bytes, shards: int) -> int:
    """The shard that holds storage key `key`."""
    return crc32c.crc32c(key) % shards


def check_shards(shards: int) -> int:
    if not isinstance(shards, int) or not 1 <= shards <= MAX_SHARDS:
        raise ValueError(f"lmdb shards must be an integer from 1 to {MAX_SHARDS}, got {shards!r}")
    return shards


def shard_folders(path: str, shards: int, min_free: int) -> list[str]:
    """The shard folders of the store at `path`: the layout file's count, or `shards` for a new
    store (whose layout file this writes, given `min_free` bytes free). OSError: an unusable
    folder, too little space for a new store, `OldLayout`, a layout file that is not one."""
    os.makedirs(path, mode=PRIVATE_DIR, exist_ok=True)
    if os.path.exists(os.path.join(path, "data.mdb")):
        raise OldLayout(errno.EEXIST, "holds an L3 store of the single-environment layout (data.mdb at the top); "
                        f"this version keeps {LAYOUT_FILE} and shard folders: move or delete it", path)
    file = os.path.join(path, LAYOUT_FILE)
    if not os.path.exists(file):
        need_free(path, min_free)
        _create(file, shards)
    return [os.path.join(path, f"shard-{i:02d}") for i in range(_read(file))]


def _create(file: str, shards: int) -> None:
    """Writes the layout file unless another opener did first (a link never replaces a file)."""
    tmp = f"{file}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE), "w") as f:
        json.dump({"layout": LAYOUT, "shards": shards}, f)
    try:
        os.link(tmp, file)
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)


def _read(file: str) -> int:
    try:
        with open(file) as f:
            layout = json.load(f)
        if layout["layout"] != LAYOUT:
            raise OldLayout(errno.EINVAL, f"layout {layout['layout']}, this version reads layout {LAYOUT}", file)
        return check_shards(layout["shards"])
    except (ValueError, KeyError, TypeError) as e:
        raise OSError(errno.EINVAL, f"not an L3 layout file ({e})", file) from None


def quarantine(path: str) -> str:
    """Moves the store at `path` to a new sibling `<path>.quarantined-<UTC time>[-n]`, its folders
    and files made private (0700, 0600), and returns that path; OSError if it cannot be moved."""
    path = os.path.realpath(path)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest, n = f"{path}.quarantined-{stamp}", 1
    while os.path.lexists(dest):
        n += 1
        dest = f"{path}.quarantined-{stamp}-{n}"
    os.rename(path, dest)
    os.chmod(dest, PRIVATE_DIR)
    for root, dirs, files in os.walk(dest):
        for name in dirs:
            os.chmod(os.path.join(root, name), PRIVATE_DIR)
        for name in files:
            os.chmod(os.path.join(root, name), PRIVATE_FILE)
    return dest
