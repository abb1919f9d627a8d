"""The LMDB tier and its memory map: a `data.mdb` truncated under the store (which makes plain LMDB
die of SIGBUS on its next read) degrades the backend instead, at once or at the next open; so does
a sparse `data.mdb` on a full tmpfs (mounted for the test; skipped where mounting is not permitted),
until there is room for its blocks; values read or checked for presence do not stay in the
process's resident set, and writes drop what other reads left there; checks of the file's size
from many threads while it grows never mistake it for truncated."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from hicache.pagekey import namespace_seed, page_keys
from hicache.tiers.remote import disk, lmdb_env, lmdb_layout, make_backend
from hicache.tiers.remote import lmdb as lmdb_tier

NS = "00112233445566aa"
SHAPE = (2, 4, 16, 2, 64)  # 64 KiB pages: LMDB keeps them in overflow pages of their own


def run_python(code: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter: a SIGBUS there fails the test instead of killing pytest."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


def test_a_store_truncated_under_it_degrades_where_plain_lmdb_dies_of_sigbus(tmp_path):
    plain = run_python(f"""
        import os, lmdb
        env = lmdb.open({str(tmp_path / 'plain')!r})
        with env.begin(write=True) as txn:
            for i in range(16):
                txn.put(b"k%d" % i, os.urandom(1 << 16))
        os.truncate({str(tmp_path / 'plain' / 'data.mdb')!r}, 3 * 4096)
        with env.begin() as txn:
            txn.get(b"k15")
    """)
    assert plain.returncode == -signal.SIGBUS, "the hazard: a read through the map past the end of the file"
    ours = run_python(f"""
        import json, os, torch
        from hicache.pagekey import namespace_seed, page_keys
        from hicache.tiers.remote import make_backend
        from hicache.tiers.remote.backend import BackendUnavailable

        def store(name):
            b = make_backend("lmdb", {NS!r}, path={str(tmp_path)!r} + "/" + name, size_cap_gb=1, min_free_mb=0,
                             shards=1)
            k = page_keys(namespace_seed(name), list(range(64)), 4)
            b.batch_set(k, [torch.randn{SHAPE} for _ in k])
            return b, k

        def outcome(fn):
            try:
                return repr(fn())
            except BackendUnavailable as e:
                return "unavailable: " + str(e)

        live, k = store("live")
        os.truncate(live.path + "/shard-00/data.mdb", 3 * 4096)
        out = [torch.empty{SHAPE} for _ in k]
        closed, _ = store("closed")
        closed.close()
        os.truncate(closed.path + "/shard-00/data.mdb", 3 * 4096)
        reopened = make_backend("lmdb", {NS!r}, path=closed.path, min_free_mb=0)
        print(json.dumps({{"get": outcome(lambda: live.batch_get(k, out)), "exists": outcome(lambda: live.batch_exists(k)),
                          "set": outcome(lambda: live.batch_set(k[:1], out[:1])), "status": live.status(),
                          "used": live.stats()["used_bytes"], "reopened": reopened.status()}}))
    """)
    assert ours.returncode == 0, ours.stderr
    r = json.loads(ours.stdout)
    data = tmp_path / "live" / "shard-00" / "data.mdb"
    assert r["status"].startswith(f"degraded: {data}: shrank from ") and "truncated under the store" in r["status"]
    assert r["get"] == repr([False] * 16) and r["exists"] == "0"  # counted misses, the map never read
    assert r["set"] == f"unavailable: {r['status']}" and r["used"] == 0
    assert r["reopened"].startswith(f"degraded: cannot open {tmp_path / 'closed'}: Truncated: "), r["reopened"]
    assert "bytes, its pages need" in r["reopened"]


def mapped_kib(path: str) -> int:
    """Resident KiB of this process's mappings of `path`."""
    total, current = 0, None
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:
                current = fields[5] if len(fields) > 5 else None
            elif fields[0] == "Rss:" and current == path:
                total += int(fields[1])
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads resident memory from /proc (Linux)")
def test_values_read_and_checked_leave_the_resident_set(tmp_path, monkeypatch):
    b = make_backend("lmdb", NS, path=str(tmp_path / "l3"), size_cap_gb=1, min_free_mb=0, shards=1)
    k = page_keys(namespace_seed("rss"), list(range(256)), 4)
    pages = [torch.randn(SHAPE) for _ in k]
    assert b.batch_set(k, pages) == 64
    assert b.batch_set(k, pages) == 0 and b.batch_exists(k) == 64  # presence: no value read
    out = [torch.empty(SHAPE) for _ in k]
    assert b.batch_get(k, out) == [True] * 64 and all(torch.equal(a, c) for a, c in zip(out, pages))
    data = os.path.join(b.path, "shard-00", "data.mdb")
    values_kib = 64 * pages[0].numel() * 4 // 1024
    assert os.path.getsize(data) // 1024 >= values_kib
    assert mapped_kib(data) < values_kib // 8, "the values' pages stayed mapped"
    e = b._envs[0]
    with e.env.begin(buffers=True) as txn:  # what any read through the map leaves behind
        assert all(txn.get(b.storage_key(key), db=e.pages) is not None for key in k)
    assert mapped_kib(data) >= values_kib
    monkeypatch.setattr(lmdb_env, "DROP_INTERVAL_S", 0.0)
    assert b.batch_set(k[:1], pages[:1]) == 0  # a write: the writer drops the map's pages
    assert mapped_kib(data) < values_kib // 8
    b.close()


def test_a_sparse_data_file_on_a_full_disk_is_degraded_where_plain_lmdb_dies_of_sigbus(tmp_path, small_fs,
                                                                                       monkeypatch):
    monkeypatch.setattr(lmdb_tier, "REOPEN_INTERVAL_S", 0.0)
    made = make_backend("lmdb", NS, path=str(tmp_path / "made"), size_cap_gb=1, min_free_mb=0, shards=1)
    k = page_keys(namespace_seed("sparse"), list(range(64)), 4)
    made.batch_set(k, [torch.zeros(SHAPE) for _ in k])  # values of zeros: whole blocks of them
    made.close()
    store = small_fs.root / "l3"
    shard = store / "shard-00"
    shard.mkdir(parents=True)
    shutil.copy(tmp_path / "made" / lmdb_layout.LAYOUT_FILE, store)
    subprocess.run(["cp", "--sparse=always", str(tmp_path / "made" / "shard-00" / "data.mdb"), str(shard)], check=True)
    data = os.stat(shard / "data.mdb")
    assert data.st_blocks * 512 < data.st_size // 2, "the copy should have holes"
    disk.allocate(str(shard / "lock.mdb"), disk.lock_file_bytes(lmdb_env.MAX_READERS))  # only data.mdb is sparse
    small_fs.fill()
    plain = run_python(f"""
        import lmdb
        env = lmdb.open({str(shard)!r}, max_dbs=4, max_readers={lmdb_env.MAX_READERS})
        with env.begin(db=env.open_db(b"pages")) as txn:
            print(sum(len(v) for _, v in txn.cursor()))
    """)
    assert plain.returncode == -signal.SIGBUS, "the hazard: a hole read through the map on a full tmpfs"
    b = make_backend("lmdb", NS, path=str(store), min_free_mb=0)
    assert b.status().startswith(f"degraded: cannot open {store}: OSError: [Errno 28] cannot allocate the blocks "
                                 "of data.mdb"), b.status()
    small_fs.unfill()
    b.probe()
    assert b.status() == "ok"
    out = [torch.ones(SHAPE) for _ in k]
    assert b.batch_get(k, out) == [True] * len(k) and all(not o.any() for o in out)
    b.close()


def test_checks_from_many_threads_while_the_file_grows_never_report_a_truncation(tmp_path):
    """Readers and the writer check `data.mdb` at once while LMDB grows it: a check whose size
    was read before another check recorded a larger one must not take the file for shrunk."""
    path = tmp_path / "data.mdb"
    path.write_bytes(bytes(4096))
    data = disk.DataFile(str(tmp_path), 4096)
    errors: list[Exception] = []
    stop = threading.Event()

    def grow() -> None:
        with open(path, "ab") as f:
            while not stop.is_set():
                f.write(bytes(4096))
                f.flush()

    def check() -> None:
        try:
            for _ in range(3000):
                data.check()
        except disk.Truncated as e:
            errors.append(e)
    grower = threading.Thread(target=grow)
    checkers = [threading.Thread(target=check) for _ in range(4)]
    grower.start()
    for t in checkers:
        t.start()
    for t in checkers:
        t.join()
    stop.set()
    grower.join()
    data.close()
    assert not errors, errors[0]
