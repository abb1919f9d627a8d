"""The LMDB tier's shards (`tiers/remote/lmdb_layout.py`): routing, the cap of each shard, a corrupt
value in one shard, the layout kept across reopens and processes, a folder of the old layout, and
a full disk under several shards."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import lmdb
import pytest
import torch
from test_storage_failsafe import NS, SHAPE, keys, pages

from hicache.tiers.remote import lmdb as lmdb_tier
from hicache.tiers.remote import make_backend
from hicache.tiers.remote.framing import HEADER_SIZE, value_size
from hicache.tiers.remote.lmdb_layout import LAYOUT_FILE, shard_of


def backend(path, **kw):
    kw.setdefault("min_free_mb", 0)
    return make_backend("lmdb", NS, path=str(path), **kw)


def stored_in(b, key: str) -> list[int]:
    """The shards whose `pages` hold page key `key`."""
    raw = b.storage_key(key)
    out = []
    for i, e in enumerate(b._envs):
        with e.env.begin(db=e.pages) as txn:
            if txn.get(raw) is not None:
                out.append(i)
    return out


def test_each_page_lives_in_the_shard_its_key_routes_to(tmp_path):
    b = backend(tmp_path, shards=4)
    k, p = keys(32), pages(32)
    assert b.batch_set(k, p) == 32 and b.batch_exists(k) == 32
    where = [stored_in(b, key) for key in k]
    assert where == [[shard_of(b.storage_key(key), 4)] for key in k]
    assert len({w[0] for w in where}) == 4  # every shard holds some
    out = [torch.zeros(SHAPE) for _ in k]
    assert b.batch_get(k, out) == [True] * 32 and all(torch.equal(a, c) for a, c in zip(out, p))
    s = b.stats()
    assert s["used_bytes"] == 32 * value_size(p[0]) and s["capacity_bytes"] == 4 * b._envs[0].size_cap
    b.close()


def test_each_shard_evicts_under_its_share_of_the_cap(tmp_path):
    value = value_size(pages(1)[0])
    b = backend(tmp_path, shards=2, size_cap_gb=8 * value / 1e9)  # 4 pages a shard
    for i in range(4):
        b.batch_set(keys(8, str(i)), pages(8, i))
    assert b.stats()["evicted_pages"] >= 20
    for e in b._envs:
        assert 0 < e.used_bytes() <= 4 * value
    assert b.batch_exists(keys(8, "0")) < 8  # the oldest went
    b.close()


def test_a_corrupt_value_in_one_shard_is_a_counted_miss(tmp_path):
    b = backend(tmp_path, shards=4)
    k, p = keys(8), pages(8)
    b.batch_set(k, p)
    e, raw = b.env_of(b.storage_key(k[5])), b.storage_key(k[5])
    with e.env.begin(write=True, db=e.pages) as txn:
        value = bytearray(txn.get(raw))
        value[HEADER_SIZE + 3] ^= 0x10
        txn.put(raw, bytes(value))
    out = [torch.zeros(SHAPE) for _ in k]
    assert b.batch_get(k, out) == [True] * 5 + [False] + [True] * 2
    assert torch.equal(out[5], torch.zeros(SHAPE)) and b.stats()["corrupt_pages"] == 1
    assert b.batch_exists(k) == 5  # deleted: the next backup stores it again
    b.close()


def test_the_layout_file_decides_the_shards_of_every_later_opener(tmp_path):
    k, p = keys(16), pages(16)
    a = backend(tmp_path, shards=3)
    a.batch_set(k, p)
    a.close()
    assert json.loads((tmp_path / LAYOUT_FILE).read_text()) == {"layout": 2, "shards": 3}
    b = backend(tmp_path, shards=8)  # an existing store keeps its own count
    out = [torch.zeros(SHAPE) for _ in k]
    assert b.shards == 3 and b.batch_get(k, out) == [True] * 16 and torch.equal(out[9], p[9])
    b.close()


def test_two_processes_share_one_sharded_store(tmp_path):
    here = backend(tmp_path, shards=4)
    assert here.batch_set(keys(6, "parent"), pages(6, 1)) == 6
    child = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(__import__("pathlib").Path(__file__).parent)!r})
        from test_storage_failsafe import NS, SHAPE, keys, pages
        from hicache.tiers.remote import make_backend
        b = make_backend("lmdb", NS, path={str(tmp_path)!r}, min_free_mb=0, shards=2)
        out = [torch.zeros(SHAPE) for _ in range(6)]
        assert b.shards == 4 and b.batch_get(keys(6, "parent"), out) == [True] * 6
        assert all(torch.equal(a, c) for a, c in zip(out, pages(6, 1)))
        assert b.batch_set(keys(6, "child"), pages(6, 2)) == 6
        b.close()
    """)], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    out = [torch.zeros(SHAPE) for _ in range(6)]
    assert here.batch_get(keys(6, "child"), out) == [True] * 6 and torch.equal(out[4], pages(6, 2)[4])
    assert here.stats()["used_bytes"] == 12 * value_size(out[0])  # each shard's total counts both writers
    here.close()


def test_a_folder_of_the_single_environment_layout_is_degraded_until_moved(tmp_path, monkeypatch):
    monkeypatch.setattr(lmdb_tier, "REOPEN_INTERVAL_S", 0.0)
    old = lmdb.open(str(tmp_path), max_dbs=4)  # layout 1: data.mdb at the top
    old.close()
    b = backend(tmp_path)
    assert b.status().startswith(f"degraded: cannot open {tmp_path}: OldLayout: ") and "move or delete" in b.status()
    for name in ("data.mdb", "lock.mdb"):
        (tmp_path / name).unlink()
    b.probe()
    assert b.status() == "ok" and b.batch_set(keys(2), pages(2)) == 2
    b.close()


def test_a_disk_filled_under_several_shards_evicts_in_each_and_keeps_storing(small_fs):
    b = backend(small_fs.root / "l3", shards=2, size_cap_gb=1)
    for i in range(4):
        assert b.batch_set(keys(8, str(i)), pages(8, i)) == 8
    small_fs.fill()
    for i in range(4, 7):
        assert b.batch_set(keys(8, str(i)), pages(8, i)) == 8, b.stats()
    s = b.stats()
    assert b.status() == "ok" and s["dropped_pages"] == 0 and s["evicted_pages"] >= 8
    out = [torch.empty(SHAPE) for _ in range(8)]
    assert b.batch_get(keys(8, "6"), out) == [True] * 8 and torch.equal(out[2], pages(8, 6)[2])
    b.close()


@pytest.mark.parametrize("shards", [0, 65, 2.5])
def test_a_bad_shard_count_is_an_error_naming_it(tmp_path, shards):
    with pytest.raises(ValueError, match="lmdb.*shards"):
        backend(tmp_path, shards=shards)


def test_a_new_store_is_readable_by_its_owner_alone(tmp_path):
    """Cached prompts' KV: the store's folders and files are not readable by other users."""
    store = tmp_path / "store"
    b = backend(store, shards=2)
    assert b.batch_set(keys(4), pages(4)) == 4
    made = [store, *store.rglob("*")]
    b.close()
    assert any(p.name == "data.mdb" for p in made) and any(p.name == "hicache-l3.json" for p in made)
    for p in made:
        assert p.stat().st_mode & 0o077 == 0, f"{p} is {oct(p.stat().st_mode & 0o777)}"


def test_a_store_the_disk_is_too_short_for_says_how_short_and_what_is_free(tmp_path):
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    b = backend(tmp_path / "store", min_free_mb=(free + (1 << 30)) / (1 << 20))
    assert b.status().startswith("degraded")
    assert re.search(r"[\d,]+ bytes free \([\d.]+ MiB\), less than the [\d,]+ bytes", b.status())
    assert b.stats()["disk_free_bytes"] > 0  # read while the store is not open, as it would be once it is
    b.close()
