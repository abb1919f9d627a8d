"""L3 backends (memory, LMDB, a real Redis, a real Mooncake master), value framing and the I/O worker over a host pool.

Framing binds a value to its full storage key and, with a secret, MACs it: a value under another
key, namespace or key prefix, of an old format version, with a flipped byte, without a MAC or with
a forged one is rejected. Every backend passes the same contract test, and turns swapped values
into counted misses; then what is particular to each: LMDB survives a reopen, evicts least
recently used pages past its size cap, survives a full map, and turns a flipped byte into a counted
miss; Redis rejects a value a raw client copied to another key, and a forged one under a secret;
Redis down at start-up is degraded and resumes when it returns, and so does an LMDB path that
cannot be opened (the worker counts misses, one warning), and a Mooncake master that is down at
start-up or killed under a running client.
"""
from __future__ import annotations

import logging
import os
import struct
import threading
import zlib
import time
import warnings

import pytest
import torch

from hicache.pagekey import namespace_seed, page_keys, salted_seed
from hicache.tiers.host.pool import HostKVPool
from hicache.tiers.remote import make_backend
from hicache.tiers.remote.framing import HEADER_SIZE, CorruptValue, StaleValue, checksum, decode_into, encode, key_digest
from hicache.tiers.remote.worker import StorageWorker

NS = "00112233445566aa"
SHAPE = (2, 3, 4, 2, 8)  # [K/V, layers, page_size, heads, head_dim]
KEY = bytes.fromhex(NS) + bytes(range(32))  # a storage key as LMDB stores it
SECRET = b"0123456789abcdef-test-secret"


def pages(n: int, seed: int = 0, dtype=torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=g).to(dtype) for _ in range(n)]


def keys(n: int, salt: str = "") -> list[str]:
    return page_keys(salted_seed(namespace_seed("test-model"), salt), list(range(n * 4)), 4)


def lmdb_backend(path, **kw):
    return make_backend("lmdb", NS, path=str(path), **kw)


@pytest.fixture(params=["memory", "lmdb", "redis", "mooncake"])
def backend(request, tmp_path):
    if request.param == "memory":
        b = make_backend("memory", NS)
    elif request.param == "lmdb":
        b = lmdb_backend(tmp_path / "lmdb", size_cap_gb=0.01)
    elif request.param == "redis":
        b = make_backend("redis", NS, url=request.getfixturevalue("redis_server").url)
    else:  # one client for the module (closing one takes seconds), emptied and reset for each test
        b = request.getfixturevalue("mooncake_backend")
        b.clear()
        b._counters.clear()
        b._secret = None
        yield b
        return
    yield b
    b.close()


@pytest.fixture(scope="module")
def mooncake_backend(mooncake_master):
    b = make_backend("mooncake", NS, **mooncake_master.options)
    yield b
    b.close()


# ---- page keys and framing ----------------------------------------------------------------


def test_page_keys_chain_and_namespaces():
    seed = namespace_seed("model", "float32", 4, "layer_first", "tp0/1")
    k = page_keys(seed, list(range(12)), 4)
    assert len(k) == 3 and len(set(k)) == 3
    assert page_keys(seed, list(range(8)) + [99, 99, 99, 99], 4)[:2] == k[:2]  # a prefix has the same keys
    assert page_keys(seed, [1] + list(range(1, 12)), 4)[1] != k[1]  # a key depends on the whole prefix
    assert page_keys(seed, list(range(13)), 4) == k  # a partial last page has no key
    for other in (namespace_seed("model", "bfloat16", 4, "layer_first", "tp0/1"), salted_seed(seed, "tenant")):
        assert not set(page_keys(other, list(range(12)), 4)) & set(k)
    assert namespace_seed("ab", "c") != namespace_seed("a", "bc")


@pytest.mark.parametrize("secret", [None, SECRET], ids=["plain", "mac"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_framing_round_trip_and_every_mismatch_is_caught(dtype, secret):
    page = pages(1, dtype=dtype)[0]
    value = encode(page[:, :, :], KEY, secret)
    out = torch.empty_like(page)
    decode_into(value, out, KEY, secret)
    assert torch.equal(out, page)
    strided = torch.empty(SHAPE[:2] + (8,) + SHAPE[3:], dtype=dtype)[:, :, 2:6]  # a layer_first-like view
    decode_into(value, strided, KEY, secret)
    assert torch.equal(strided, page)
    # magic, version, dtype, length, checksum, flags, key digest, payload (and the MAC, where there is one)
    positions = [0, 3, 5, 33, 41, 48, 58, HEADER_SIZE - 6, HEADER_SIZE, len(value) - 1]
    for pos in positions:
        bad = bytearray(value)
        bad[pos] ^= 0x10
        with pytest.raises(CorruptValue):
            decode_into(bytes(bad), out, KEY, secret)
    with pytest.raises(CorruptValue):
        decode_into(value[:-1], out, KEY, secret)
    with pytest.raises(CorruptValue):
        decode_into(value, torch.empty(SHAPE, dtype=torch.int8), KEY, secret)


def test_a_value_is_bound_to_its_full_storage_key():
    page = pages(1)[0]
    out = torch.zeros(SHAPE)
    for secret in (None, SECRET):
        value = encode(page, KEY, secret)
        for other in (KEY[:-1] + b"\x00",  # another page of the namespace
                      bytes.fromhex("ffffffffffffffff") + KEY[8:],  # the same page key in another namespace
                      KEY[8:],  # without the namespace prefix
                      "hicache:" + NS + ":" + KEY[8:].hex()):  # the same bytes as another backend's key
            with pytest.raises(CorruptValue, match="another key"):
                decode_into(value, out, other, secret)
        assert torch.equal(out, torch.zeros(SHAPE))  # nothing was copied
    redis_key = "hicache:" + NS + ":" + KEY[8:].hex()
    decode_into(encode(page, redis_key), out, redis_key.encode())  # a str key is its UTF-8 bytes
    assert torch.equal(out, page)
    with pytest.raises(CorruptValue, match="another key"):
        decode_into(encode(page, redis_key), out, "other:" + NS + ":" + KEY[8:].hex())  # another key_prefix


def test_without_a_valid_mac_a_value_is_rejected_where_a_secret_is_set():
    page, out = pages(1)[0], torch.zeros(SHAPE)
    plain = encode(page, KEY)  # what a writer without the secret makes: right key, valid checksum
    decode_into(plain, out, KEY)  # accepted where no secret is set
    with pytest.raises(CorruptValue, match="no MAC"):
        decode_into(plain, out, KEY, SECRET)
    with pytest.raises(CorruptValue, match="MAC mismatch"):
        decode_into(encode(page, KEY, b"another secret, 16+ bytes"), out, KEY, SECRET)
    forged = bytearray(encode(page, KEY, SECRET))  # a payload changed, its checksum fixed, the MAC kept
    forged[HEADER_SIZE:HEADER_SIZE + 4] = b"\x00\x00\x80\x7f"
    struct.pack_into("<Q", forged, 40, checksum(bytes(forged[HEADER_SIZE:])))
    decode_into(bytes(forged), out, KEY)  # a well-formed value...
    out.zero_()
    with pytest.raises(CorruptValue, match="MAC mismatch"):  # ...that the MAC rejects
        decode_into(bytes(forged), out, KEY, SECRET)
    unflagged = bytearray(encode(page, KEY, SECRET))
    struct.pack_into("<H", unflagged, 48, 0)  # the MAC flag cleared: no longer a MACed value
    with pytest.raises(CorruptValue):
        decode_into(bytes(unflagged), out, KEY)
    assert torch.equal(out, torch.zeros(SHAPE))
    decode_into(encode(page, KEY, SECRET), out, KEY)  # a reader without the secret checks the checksum only
    assert torch.equal(out, page)


def v1_value(page: torch.Tensor) -> bytes:
    """A value in the first format (48-byte header, no key digest)."""
    raw = page.contiguous().view(torch.uint8).reshape(-1).numpy()
    header = struct.pack("<3sBHH6IQI4x", b"HKV", 1, 1, page.dim(), *page.shape, 0, raw.nbytes, zlib.crc32(raw))
    return header + raw.tobytes()


def v2_value(page: torch.Tensor) -> bytes:
    """A value in the second format (96-byte header, CRC-32): a valid frame of that version."""
    raw = page.contiguous().view(torch.uint8).reshape(-1).numpy()
    header = struct.pack("<3sBHH6IQIH2x16s32s", b"HKV", 2, 1, page.dim(), *page.shape, 0, raw.nbytes,
                         zlib.crc32(raw), 0, key_digest(KEY), bytes(32))
    return header + raw.tobytes()


def test_an_old_format_version_is_stale():
    page, out = pages(1)[0], torch.zeros(SHAPE)
    for secret in (None, SECRET):
        for old in (v1_value(page), v2_value(page)):
            with pytest.raises(StaleValue):
                decode_into(old, out, KEY, secret)
    assert issubclass(StaleValue, CorruptValue) and torch.equal(out, torch.zeros(SHAPE))
    with pytest.raises(CorruptValue, match="magic"):
        decode_into(b"HK", out, KEY)


def test_a_storage_secret_is_checked_and_never_shown(tmp_path):
    with pytest.raises(ValueError, match="at least 16 bytes") as e:
        make_backend("memory", NS, secret="short-secret")
    assert "short-secret" not in str(e.value)
    with pytest.raises(ValueError, match="does not take") as e:
        make_backend("memory", NS, bogus=1)
    assert "secret" not in str(e.value)  # the extra config cannot carry it
    b = lmdb_backend(tmp_path, secret=SECRET)
    b.batch_set(keys(1), pages(1))
    assert SECRET.decode() not in repr(b.stats()) + repr(b) + b.status()
    b.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoding_a_read_only_value_warns_nothing_and_leaves_it_intact(dtype):
    page = pages(1, dtype=dtype)[0]
    value = encode(page, KEY)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. torch's "The given buffer is not writable"
        for out in (torch.empty_like(page), torch.zeros(SHAPE[:2] + (8,) + SHAPE[3:], dtype=dtype)[:, :, 2:6],
                    torch.empty(SHAPE[:3] + SHAPE[:2:-1], dtype=dtype).transpose(-1, -2)):  # no byte view: copied
            decode_into(memoryview(value), out, KEY)
            assert torch.equal(out, page)
            out.zero_()
    assert value == encode(page, KEY)


# ---- the backend contract -----------------------------------------------------------------


def test_backend_contract(backend):
    k, p = keys(6), pages(6)
    assert backend.batch_exists(k) == 0
    assert backend.batch_set(k[:4], p[:4]) == 4
    assert backend.batch_set(k[:5], p[:5]) == 1  # present keys are skipped
    assert backend.batch_exists(k) == 5
    assert backend.batch_exists([k[0], k[5], k[1]]) == 1  # the length of the existing prefix
    out = [torch.zeros(SHAPE) for _ in range(6)]
    assert backend.batch_get(k, out) == [True] * 5 + [False]
    assert all(torch.equal(a, b) for a, b in zip(out[:5], p[:5]))
    other = make_backend(backend.name, "ffffffffffffffff", **_same_store(backend))
    assert other.batch_exists(k) == 0  # another namespace sees nothing
    backend.delete([k[1]])
    assert backend.batch_exists(k) == 1
    backend.clear()
    assert backend.batch_exists(k) == 0
    s = backend.stats()
    assert s["set_pages"] == 5 and s["hit_pages"] == 5 and s["miss_pages"] == 1 and s["bytes_written"] > 0
    assert backend.status() == "ok"


class RawStore:
    """A backend's store reached around the backend, by full storage key (a writer with access to
    the store but not going through hicache)."""

    def __init__(self, backend):
        self.backend = backend
        if backend.name == "redis":
            import redis

            self.client = redis.Redis.from_url(backend.url)
        if backend.name == "mooncake":
            self.client = backend._store

    def get(self, key: bytes) -> bytes:
        b = self.backend
        if b.name == "memory":
            return b._data[key.decode()]
        if b.name == "redis":
            return self.client.get(key)
        if b.name == "mooncake":
            return self.client.get(key.decode())
        env = b.env_of(key)
        with env.env.begin(db=env.pages) as txn:
            return txn.get(key)

    def put(self, key: bytes, value: bytes) -> None:
        b = self.backend
        if b.name == "memory":
            b._data[key.decode()] = value
        elif b.name == "redis":
            self.client.set(key, value)
        elif b.name == "mooncake":
            assert self.client.upsert(key.decode(), value) == 0
        else:
            env = b.env_of(key)
            with env.env.begin(write=True, db=env.pages) as txn:
                txn.put(key, value)


@pytest.mark.parametrize("secret", [None, SECRET], ids=["plain", "mac"])
def test_swapped_values_are_counted_misses_and_deleted(backend, secret):
    if secret:
        backend._secret = secret
    k, p = keys(6), pages(6)
    assert backend.batch_set(k, p) == 6
    raw, sk = RawStore(backend), [backend.storage_key(x) for x in k]
    v = [raw.get(x) for x in sk]
    raw.put(sk[1], v[4])  # two pages swapped, one overwritten with another's value
    raw.put(sk[4], v[1])
    raw.put(sk[2], v[0])
    out = [torch.zeros(SHAPE) for _ in range(6)]
    assert backend.batch_get(k, out) == [True, False, False, True, False, True]
    assert all(torch.equal(out[i], torch.zeros(SHAPE)) for i in (1, 2, 4))  # nothing of them was copied
    assert all(torch.equal(out[i], p[i]) for i in (0, 3, 5))
    s = backend.stats()
    assert s["corrupt_pages"] == 3 and s["hit_pages"] == 3 and s["miss_pages"] == 3
    assert [backend.batch_exists([x]) for x in k] == [1, 0, 0, 1, 0, 1]  # deleted: the next backup rewrites them
    assert backend.batch_set(k, p) == 3
    assert backend.batch_get(k, out) == [True] * 6 and torch.equal(out[4], p[4])


def test_an_old_format_value_is_a_stale_miss(backend):
    k, p = keys(2), pages(2)
    backend.batch_set(k, p)
    RawStore(backend).put(backend.storage_key(k[1]), v1_value(p[1]))
    out = [torch.zeros(SHAPE) for _ in range(2)]
    assert backend.batch_get(k, out) == [True, False]
    s = backend.stats()
    assert s["stale_pages"] == 1 and s["corrupt_pages"] == 0 and s["miss_pages"] == 1
    assert backend.batch_exists(k) == 1  # deleted, so that the next backup stores it in the new format


def _same_store(backend) -> dict:
    if backend.name == "lmdb":
        return {"path": backend.path}
    if backend.name == "redis":
        return {"url": backend.url}
    if backend.name == "mooncake":
        return {"master": backend.master, "metadata_server": backend.metadata_server, "global_segment_mb": 16,
                "local_buffer_mb": 16}
    return {}


# ---- LMDB -----------------------------------------------------------------------------------


def test_lmdb_survives_reopen_and_shares_an_environment(tmp_path):
    k, p = keys(3), pages(3)
    a = lmdb_backend(tmp_path)
    b = lmdb_backend(tmp_path)  # a second engine of the process: the same environment
    assert a.batch_set(k, p) == 3 and b.batch_exists(k) == 3
    a.close()
    b.close()
    c = lmdb_backend(tmp_path)
    out = [torch.zeros(SHAPE) for _ in range(3)]
    assert c.batch_get(k, out) == [True] * 3 and torch.equal(out[2], p[2])
    assert c.stats()["used_bytes"] == 3 * len(encode(p[0], KEY))
    c.close()


def test_lmdb_flipped_byte_is_a_counted_miss(tmp_path):
    import lmdb

    k, p = keys(2), pages(2)
    b = lmdb_backend(tmp_path)
    b.batch_set(k, p)
    raw = bytes.fromhex(NS) + bytes.fromhex(k[1])
    shard = b.env_of(raw).path
    b.close()
    env = lmdb.open(shard, max_dbs=4)
    db = env.open_db(b"pages")
    with env.begin(write=True, db=db) as txn:
        value = bytearray(txn.get(raw))
        value[HEADER_SIZE + 17] ^= 0x01
        txn.put(raw, bytes(value))
    env.close()
    b = lmdb_backend(tmp_path)
    out = [torch.zeros(SHAPE) for _ in range(2)]
    assert b.batch_get(k, out) == [True, False]
    assert torch.equal(out[1], torch.zeros(SHAPE))  # nothing of the corrupt value was copied
    assert b.stats()["corrupt_pages"] == 1
    assert b.batch_exists(k) == 1  # the corrupt page was deleted: the next backup stores it again
    b.close()


def test_lmdb_evicts_least_recently_used_past_its_cap(tmp_path):
    value_bytes = len(encode(pages(1)[0], KEY))
    b = lmdb_backend(tmp_path, size_cap_gb=10 * value_bytes / 1e9, shards=1)  # room for 10 pages, one LRU
    k, p = keys(30), pages(30)
    b.batch_set(k[:8], p[:8])
    time.sleep(0.01)
    b.batch_get(k[:2], [torch.empty(SHAPE) for _ in range(2)])  # pages 0 and 1 are now the newest
    for _ in range(100):  # the access-time update is queued to the writer thread
        if b._envs[0].submit(lambda: None).result() is None:
            break
    b.batch_set(k[8:30], p[8:30])
    s = b.stats()
    assert s["used_bytes"] <= 10 * value_bytes and s["evicted_pages"] >= 20
    held = [i for i in range(30) if b.batch_exists([k[i]])]
    assert held and held[-1] == 29 and 2 not in held  # the newest stay, untouched old ones go
    b.close()


def test_lmdb_full_map_evicts_and_never_raises(tmp_path):
    value_bytes = len(encode(pages(1)[0], KEY))
    b = lmdb_backend(tmp_path, size_cap_gb=1.0, map_size_gb=100 * value_bytes / 1e9, shards=1)  # the map fills first
    k, p = keys(200), pages(200)
    for lo in range(0, 200, 20):
        b.batch_set(k[lo:lo + 20], p[lo:lo + 20])
    s = b.stats()
    assert s["map_full"] > 0 and s["evicted_pages"] > 0
    assert b.batch_exists(k[199:]) == 1  # the latest batch is stored
    b.close()


# ---- Mooncake ---------------------------------------------------------------------------------


def test_mooncake_down_at_start_and_killed_mid_run_is_degraded_then_resumes(mooncake_master, mooncake_backend):
    """A client made while the master is down is degraded at once, and is set up on the probe once
    the master is back (its writes, larger than its transfer buffer, go in several puts); the master killed under a running client: calls fail fast (the worker
    counts them), the status says so, and the probe clears it when the master returns."""
    from hicache.tiers.remote.backend import BackendUnavailable

    mooncake_master.stop()
    small = HEADER_SIZE + 2 * pages(1)[0].numel() * 4  # a transfer buffer that holds two pages: puts are split
    late = make_backend("mooncake", NS, **{**mooncake_master.options, "local_buffer_mb": small / 2**20})
    assert late.status().startswith(f"degraded: master {mooncake_master.options['master']}: ConnectionRefusedError")
    with pytest.raises(BackendUnavailable):
        late.batch_exists(keys(1))
    with pytest.raises(BackendUnavailable):
        mooncake_backend.batch_exists(keys(1))
    assert mooncake_backend.status() == "degraded: master %s: the master does not answer (RPC_FAIL)" % (
        mooncake_master.options["master"])
    mooncake_master.start()  # back, empty
    time.sleep(1.0)  # the set-up is retried at most once a second
    for b in (late, mooncake_backend):
        b.probe()
        assert b.status() == "ok"
    k, p = keys(3), pages(3)
    assert late.batch_set(k, p) == 3
    out = [torch.zeros(SHAPE) for _ in range(3)]
    assert mooncake_backend.batch_get(k, out) == [True] * 3  # one client's pages through the other's
    assert all(torch.equal(a, b) for a, b in zip(out, p))
    late.close()


# ---- Redis ------------------------------------------------------------------------------------


def test_redis_down_at_start_is_degraded_then_resumes(redis_server):
    import redis

    redis_server.stop()
    b = make_backend("redis", NS, url=redis_server.url, socket_timeout=0.5, connect_timeout=0.5)
    assert b.status().startswith("degraded")
    with pytest.raises((ConnectionError, OSError, redis.ConnectionError)):
        b.batch_exists(keys(1))
    redis_server.start()
    b.probe()
    assert b.status() == "ok"
    assert b.batch_set(keys(2), pages(2)) == 2
    b.close()


def test_redis_rejects_a_value_copied_to_another_key(redis_server):
    import redis

    client = redis.Redis.from_url(redis_server.url)
    b = make_backend("redis", NS, url=redis_server.url)
    tenant_b = make_backend("redis", NS, url=redis_server.url, key_prefix="tenant-b")
    k, p = keys(3), pages(3)
    assert b.batch_set(k[:1], p[:1]) == 1 and tenant_b.batch_set(k[1:2], p[1:2]) == 1
    stored = client.get(f"hicache:{NS}:{k[0]}")
    assert stored is not None and client.get(f"tenant-b:{NS}:{k[1]}") is not None
    client.set(f"hicache:{NS}:{k[2]}", stored)  # another page of the namespace
    client.set(f"tenant-b:{NS}:{k[0]}", stored)  # the same page under another key prefix
    client.set(f"hicache:{NS}:{k[1]}", client.get(f"tenant-b:{NS}:{k[1]}"))  # tenant-b's page, copied over
    out = [torch.zeros(SHAPE) for _ in range(3)]
    assert b.batch_get(k, out) == [True, False, False]
    assert tenant_b.batch_get(k[:2], out[:2]) == [False, True]
    assert torch.equal(out[2], torch.zeros(SHAPE))
    assert b.stats()["corrupt_pages"] == 2 and tenant_b.stats()["corrupt_pages"] == 1
    assert client.get(f"hicache:{NS}:{k[2]}") is None  # deleted
    b.close()
    tenant_b.close()


def test_redis_with_a_secret_rejects_a_forged_value(redis_server):
    import redis

    client = redis.Redis.from_url(redis_server.url)
    b = make_backend("redis", NS, url=redis_server.url, secret=SECRET)
    k, p = keys(2), pages(2)
    b.batch_set(k[:1], p[:1])
    plain = make_backend("redis", NS, url=redis_server.url)  # a client without the secret
    assert plain.batch_set(k[1:], p[1:]) == 1
    client.set(f"hicache:{NS}:{k[0]}", encode(pages(1, seed=9)[0], f"hicache:{NS}:{k[0]}"))  # a forged page
    out = [torch.zeros(SHAPE) for _ in range(2)]
    assert b.batch_get(k, out) == [False, False]
    assert b.stats()["corrupt_pages"] == 2 and torch.equal(out[0], torch.zeros(SHAPE))
    assert b.batch_set(k, p) == 2 and b.batch_get(k, out) == [True, True] and torch.equal(out[1], p[1])
    b.close()
    plain.close()


# ---- the I/O worker over a host pool ----------------------------------------------------------


def host_pool(layout: str) -> HostKVPool:
    return HostKVPool(64, 4, num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float32, layout=layout, pin=False)


def results(worker: StorageWorker, n: int, timeout: float = 10.0) -> list:
    out, end = [], time.monotonic() + timeout
    while len(out) < n and time.monotonic() < end:
        worker.wait(0.1)
        out += worker.poll()
    assert len(out) == n, out
    return sorted(out, key=lambda r: r.ticket)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_worker_backs_up_and_fetches_host_pages(tmp_path, layout):
    src, dst = host_pool(layout), host_pool(layout)
    src.buffer.copy_(torch.randn(src.buffer.shape))
    w_src = StorageWorker(lmdb_backend(tmp_path), src, batch_pages=2)
    k = keys(5)
    slots = src.allocator.alloc(20)
    t = w_src.backup(k, slots)
    (res,) = results(w_src, 1)
    assert (res.ticket, res.ok, res.pages, res.skipped) == (t, True, 5, 0)
    w_src.backup(k[:3], slots[:12])
    assert results(w_src, 1)[0].skipped == 3  # keys L3 holds are not written again
    w_dst = StorageWorker(lmdb_backend(tmp_path), dst, batch_pages=2)
    q = w_dst.query(k + keys(7)[5:])
    into = dst.allocator.alloc(20)
    f = w_dst.fetch(k, into)
    r_query, r_fetch = results(w_dst, 2)
    assert (r_query.ticket, r_query.pages) == (q, 5)
    assert (r_fetch.ticket, r_fetch.ok, r_fetch.pages) == (f, True, 5)
    assert r_fetch.nbytes == 5 * src.bytes_per_token() * 4
    for i in range(5):
        assert torch.equal(dst.page(int(into[4 * i])), src.page(int(slots[4 * i])))
    w_src.close()
    w_dst.close()


def test_worker_stops_a_fetch_at_the_first_miss_and_counts_failures(tmp_path):
    pool = host_pool("page_first")
    backend = make_backend("memory", NS)
    w = StorageWorker(backend, pool, batch_pages=2)
    k = keys(5)
    backend.batch_set(k[:3], pages(3))
    w.fetch(k, pool.allocator.alloc(20))
    (res,) = results(w, 1)
    assert (res.ok, res.pages) == (False, 3)

    def boom(*_):
        raise ConnectionError("injected")

    backend.batch_get = boom
    backend.batch_exists = boom
    w.fetch(k, pool.allocator.alloc(20))
    w.backup(k, pool.allocator.alloc(20))
    fetch, backup = results(w, 2)
    assert (fetch.ok, fetch.pages) == (False, 0) and "injected" in fetch.error
    assert (backup.ok, backup.pages) == (False, 0)
    assert w.stats()["errors"] == 2
    w.close()


def test_worker_revokes_a_queued_backup_but_not_a_running_one():
    pool = host_pool("page_first")
    backend = make_backend("memory", NS)
    running, release = threading.Event(), threading.Event()
    real_set = backend.batch_set

    def slow_set(keys_, pages_):
        running.set()
        release.wait(10)
        return real_set(keys_, pages_)

    backend.batch_set = slow_set
    w = StorageWorker(backend, pool, batch_pages=2)
    k = keys(4)
    first = w.backup(k[:2], pool.allocator.alloc(8))
    second = w.backup(k[2:], pool.allocator.alloc(8))
    assert running.wait(10)
    assert not w.revoke(first) and w.revoke(second)
    release.set()
    r_first, r_second = results(w, 2)
    assert (r_first.ok, r_first.pages) == (True, 2)
    assert (r_second.ok, r_second.pages, r_second.error) == (False, 0, "cancelled")
    assert backend.batch_exists(k) == 2  # the revoked pages were never read nor written
    w.close()


def block(path, how: str) -> None:
    """Makes `path` an LMDB path that cannot be opened."""
    if how == "file":  # a file where the folder should be
        path.write_bytes(b"not a folder")
    elif how == "not_lmdb":
        path.mkdir()
        (path / "data.mdb").write_bytes(b"\x01" * 8192)
    else:
        path.mkdir()
        path.chmod(0o500)


def unblock(path, how: str) -> None:
    if how == "file":
        path.unlink()
    elif how == "not_lmdb":
        (path / "data.mdb").unlink()
    else:
        path.chmod(0o700)


@pytest.mark.parametrize("how", ["file", "not_lmdb", "read_only"])
def test_lmdb_path_that_cannot_be_opened_is_degraded_then_resumes(tmp_path, how, caplog):
    if how == "read_only" and os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    path = tmp_path / "lmdb"
    block(path, how)
    pool = host_pool("page_first")
    with caplog.at_level(logging.WARNING, logger="hicache"):
        backend = lmdb_backend(path)
        assert backend.status().startswith(f"degraded: cannot open {path}: ")
        w = StorageWorker(backend, pool, batch_pages=2)
        k = keys(3)
        src = pool.allocator.alloc(12)
        w.query(k)
        w.fetch(k, pool.allocator.alloc(12))
        w.backup(k, src)
        query, fetch, backup = results(w, 3)
        assert not (query.ok or fetch.ok or backup.ok) and query.pages == fetch.pages == backup.pages == 0
        assert w.stats()["errors"] == 3 and w.stats()["used_bytes"] == 0
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and str(path) in warnings[0] and "cannot open" in warnings[0], warnings

        unblock(path, how)
        end = time.monotonic() + 10
        while backend.status() != "ok" and time.monotonic() < end:  # the idle worker's probe reopens it
            time.sleep(0.1)
        assert backend.status() == "ok"
    pool.buffer.copy_(torch.randn(pool.buffer.shape))
    w.backup(k, src)
    assert results(w, 1)[0].pages == 3
    into = pool.allocator.alloc(12)
    w.fetch(k, into)
    assert results(w, 1)[0].pages == 3
    for i in range(3):
        assert torch.equal(pool.page(int(into[4 * i])), pool.page(int(src[4 * i])))
    w.close()


def test_worker_cancel_and_quiesce(tmp_path):
    pool = host_pool("layer_first")
    backend = make_backend("memory", NS)
    gate = threading.Event()
    real = backend.batch_get

    def slow(keys_, pages_):
        gate.wait(5)
        return real(keys_, pages_)

    backend.batch_get = slow
    w = StorageWorker(backend, pool, batch_pages=1)
    k = keys(4)
    backend.batch_set(k, pages(4))
    t = w.fetch(k, pool.allocator.alloc(16))
    queued = w.fetch(k, pool.allocator.alloc(16))
    w.cancel(t)
    gate.set()
    first, second = results(w, 2)
    assert first.ticket == t and first.pages <= 1 and not first.ok
    assert second.ticket == queued and second.pages == 4
    gate.clear()
    w.fetch(k, pool.allocator.alloc(16))
    threading.Timer(0.2, gate.set).start()
    assert w.quiesce(5.0)
    assert results(w, 1)[0].pages <= 1
    w.close()
