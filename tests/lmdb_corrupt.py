"""A real corruption of an LMDB store on disk, one that its checks pass and its reads crash on."""
from __future__ import annotations

import struct
from pathlib import Path


def corrupt_value_nodes(data_mdb: Path) -> int:
    """Overwrites the B-tree's leaf nodes of large values (LMDB's F_BIGDATA: the value lives in
    overflow pages) with a size of about 2 GiB: LMDB's checks pass, and reading such a value runs
    off its map (SIGBUS or SIGSEGV). Returns the nodes overwritten."""
    data, psize, page, smashed = bytearray(data_mdb.read_bytes()), 4096, 2, 0
    while page < len(data) // psize:
        base = page * psize
        flags, lower = struct.unpack_from("<HH", data, base + 10)
        if flags & 4:  # P_OVERFLOW: skip the value's pages
            page += struct.unpack_from("<I", data, base + 12)[0]
            continue
        page += 1
        if not flags & 2:  # P_LEAF
            continue
        for i in range((lower - 16) // 2):
            node = base + struct.unpack_from("<H", data, base + 16 + 2 * i)[0]
            if struct.unpack_from("<H", data, node + 4)[0] & 1:  # F_BIGDATA
                struct.pack_into("<HH", data, node, 0xFFFF, 0x7FFF)
                smashed += 1
    data_mdb.write_bytes(bytes(data))
    return smashed
