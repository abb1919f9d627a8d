"""L3 on a full disk: LMDB never takes the process down, evicts to keep storing, degrades when that
cannot help, and resumes when space returns.

On a real small filesystem (a tmpfs mounted for the test; skipped, saying why, where mounting is not
permitted): plain LMDB dies of SIGBUS opening a store on a full disk while the backend starts
degraded; a store that existed before the disk filled opens and serves; a disk that another writer
fills makes writes evict least recently used pages and go on; a disk that eviction cannot help
degrades the backend (reads go on) until space returns, which the I/O worker notices by itself; and a
real server started on a full disk serves the same answers, degraded, then resumes and survives the
disk filling again while it serves.

Without a mount (CI anywhere): the same paths through a fault-injecting LMDB environment whose
commits fail like a full disk, and a patched free-space probe.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import lmdb
import pytest
import torch

from hicache.pagekey import namespace_seed, page_keys, salted_seed
from hicache.tiers.host.pool import HostKVPool
from hicache.tiers.remote import disk
from hicache.tiers.remote import lmdb as lmdb_tier
from hicache.tiers.remote import lmdb_env
from hicache.tiers.remote import make_backend
from hicache.tiers.remote.backend import BackendUnavailable
from hicache.tiers.remote.worker import StorageWorker

NS = "00112233445566aa"
SHAPE = (2, 4, 16, 2, 64)  # 64 KiB pages: a few MiB of them fill the test filesystem
MIB = 1 << 20


def pages(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=g) for _ in range(n)]


def keys(n: int, salt: str = "") -> list[str]:
    return page_keys(salted_seed(namespace_seed("failsafe"), salt), list(range(n * 4)), 4)


def backend(path, **kw):
    kw.setdefault("min_free_mb", 0)
    kw.setdefault("shards", 1)  # one environment: these tests reach into it
    return make_backend("lmdb", NS, path=str(path), size_cap_gb=1, **kw)


@pytest.fixture(autouse=True)
def _fast_reopen(monkeypatch):
    monkeypatch.setattr(lmdb_tier, "REOPEN_INTERVAL_S", 0.0)


# ---- a real small filesystem ----------------------------------------------------------------


class SmallFs:
    """A size-limited tmpfs; `fill()` takes every free byte with a file, `unfill()` gives them back."""

    def __init__(self, root: Path):
        self.root = root
        self.filler = root / "filler"

    def fill(self) -> None:
        with open(self.filler, "ab", buffering=0) as f:
            try:
                while True:
                    f.write(b"\1" * 4096)
            except OSError:
                pass
        assert disk.free_bytes(str(self.root)) < 4096

    def unfill(self) -> None:
        self.filler.unlink()


def mount_tmpfs(path: Path, size_mib: int) -> SmallFs:
    path.mkdir()
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(path)],
                           capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        pytest.skip("no mount command: a size-limited tmpfs is needed to fill a real disk")
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {r.stderr.strip()}")
    return SmallFs(path)




def run_python(code: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter: a SIGBUS there fails the test instead of killing pytest."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


def test_a_full_disk_kills_plain_lmdb_but_the_backend_starts_degraded(small_fs):
    small_fs.fill()
    plain = run_python(f"""
        import lmdb
        lmdb.open({str(small_fs.root / 'plain')!r}, max_dbs=4, max_readers=256)
    """)
    assert plain.returncode == -signal.SIGBUS, "the hazard: LMDB's sparse lock file on a full disk"
    ours = run_python(f"""
        import json
        from hicache.tiers.remote import make_backend
        b = make_backend("lmdb", {NS!r}, path={str(small_fs.root / 'l3')!r})
        print(json.dumps(b.status()))
    """)
    assert ours.returncode == 0, ours.stderr
    status = json.loads(ours.stdout)
    assert status.startswith(f"degraded: cannot open {small_fs.root / 'l3'}: OSError: [Errno 28]"), status

    b = backend(small_fs.root / "l3", min_free_mb=1)
    assert b.status().startswith("degraded: cannot open") and "bytes free" in b.status()
    with pytest.raises(BackendUnavailable):
        b.batch_exists(keys(1))
    small_fs.unfill()
    b.probe()
    assert b.status() == "ok"
    k, p = keys(4), pages(4)
    assert b.batch_set(k, p) == 4
    out = [torch.empty(SHAPE) for _ in k]
    assert b.batch_get(k, out) == [True] * 4 and all(torch.equal(a, c) for a, c in zip(out, p))
    b.close()


def test_a_store_made_before_the_disk_filled_opens_and_serves(small_fs):
    path = small_fs.root / "l3"
    b = backend(path)
    k, p = keys(4), pages(4)
    b.batch_set(k, p)
    b.close()
    small_fs.fill()
    b = backend(path, min_free_mb=1)  # no new store: it opens whatever the disk's free space
    assert b.status() == "ok"
    out = [torch.empty(SHAPE) for _ in k]
    assert b.batch_get(k, out) == [True] * 4 and torch.equal(out[3], p[3])
    b.close()


def test_a_disk_filled_by_another_writer_evicts_least_recently_used_and_keeps_storing(small_fs):
    b = backend(small_fs.root / "l3")
    batches = [keys(8, str(i)) for i in range(4)]
    for i, k in enumerate(batches):
        assert b.batch_set(k, pages(8, i)) == 8
    b.batch_get(batches[0], [torch.empty(SHAPE) for _ in range(8)])  # batch 0 is now the most recent
    time.sleep(0.2)  # its access-time update is queued, not awaited
    small_fs.fill()
    for i in range(4, 8):
        assert b.batch_set(keys(8, str(i)), pages(8, i)) == 8, b.stats()
        assert b.status() == "ok"
    stats = b.stats()
    assert stats["write_failures"] + stats["disk_short"] > 0 and stats["evicted_pages"] >= 8
    assert stats["dropped_pages"] == 0 and stats["disk_free_bytes"] < 64 * 1024
    assert b.batch_exists(batches[1]) == 0  # the least recently used went first
    out = [torch.empty(SHAPE) for _ in range(8)]
    assert b.batch_get(keys(8, "7"), out) == [True] * 8 and torch.equal(out[7], pages(8, 7)[7])
    b.close()


def host_pool() -> HostKVPool:
    return HostKVPool(64, 4, num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float32, layout="page_first",
                      pin=False)


def results(worker: StorageWorker, n: int, timeout: float = 10.0) -> list:
    out, end = [], time.monotonic() + timeout
    while len(out) < n and time.monotonic() < end:
        worker.wait(0.1)
        out += worker.poll()
    assert len(out) == n, out
    return out


def wait_until(predicate, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.05)


def test_a_full_disk_that_eviction_cannot_help_degrades_then_resumes_by_itself(small_fs, request):
    b = backend(small_fs.root / "l3")
    pool = host_pool()
    pool.buffer.copy_(torch.randn(pool.buffer.shape))
    w = StorageWorker(b, pool, batch_pages=2)
    request.addfinalizer(w.close)
    small_fs.fill()  # an empty store: nothing to evict
    k, src = keys(3), pool.allocator.alloc(12)
    w.backup(k, src)  # its first two pages are dropped, then writes are blocked: the third fails fast
    backup = results(w, 1)[0]
    assert not backup.ok and backup.pages == 0 and w.stats()["errors"] == 1
    assert w.status().startswith(f"degraded: writes fail at {b._envs[0].path}: "), w.status()
    assert b.stats()["dropped_pages"] == 2
    w.backup(k, src)
    assert not results(w, 1)[0].ok and w.stats()["errors"] == 2
    w.query(k)
    assert results(w, 1)[0].ok  # reads go on
    small_fs.unfill()
    wait_until(lambda: w.status() == "ok")  # the idle worker's probe
    w.backup(k, src)
    assert results(w, 1)[0].pages == 3
    into = pool.allocator.alloc(12)
    w.fetch(k, into)
    assert results(w, 1)[0].pages == 3
    assert torch.equal(pool.page(int(into[8])), pool.page(int(src[8])))


# ---- fault injection (no mount needed) ------------------------------------------------------


class FailingEnv:
    """An LMDB environment whose commits that store pages fail like a full disk while `failures`
    lasts (-1: for ever). Deletions (eviction) still commit."""

    def __init__(self, env, pages_db, failures: int):
        self._env, self._pages_db, self.failures = env, pages_db, failures

    def begin(self, write: bool = False, **kw):
        txn = self._env.begin(write=write, **kw)
        return _FailingTxn(txn, self) if write else txn

    def fail(self) -> bool:
        if self.failures == 0:
            return False
        self.failures -= self.failures > 0
        return True

    def __getattr__(self, name):
        return getattr(self._env, name)


class _FailingTxn:
    def __init__(self, txn, env: FailingEnv):
        self._txn, self._env, self._stores = txn, env, False

    def __enter__(self):
        self._txn.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None and self._stores and self._env.fail():
            self._txn.abort()
            raise lmdb.DiskError("mdb_txn_commit: No space left on device")
        return self._txn.__exit__(exc_type, exc, tb)

    def put(self, key, value, db=None, **kw):
        self._stores = self._stores or db is self._env._pages_db
        return self._txn.put(key, value, db=db, **kw)

    def __getattr__(self, name):
        return getattr(self._txn, name)


def inject(b, failures: int) -> FailingEnv:
    env = b._envs[0]
    env.env = FailingEnv(env.env, env.pages, failures)
    return env.env


def test_a_failed_write_evicts_and_retries(tmp_path):
    b = backend(tmp_path / "l3")
    for i in range(3):
        b.batch_set(keys(8, str(i)), pages(8, i))
    inject(b, failures=2)
    assert b.batch_set(keys(8, "new"), pages(8, 9)) == 8
    stats = b.stats()
    assert stats["write_failures"] == 2 and stats["evicted_pages"] > 0 and stats["dropped_pages"] == 0
    assert b.status() == "ok" and b.batch_exists(keys(8, "0")) == 0 and b.batch_exists(keys(8, "new")) == 8
    b.close()


def test_writes_that_keep_failing_degrade_then_resume_when_space_returns(tmp_path, monkeypatch):
    b = backend(tmp_path / "l3")
    b.batch_set(keys(2, "old"), pages(2))
    fault = inject(b, failures=-1)
    assert b.batch_set(keys(4), pages(4)) == 0
    assert b.status() == f"degraded: writes fail at {b._envs[0].path}: DiskError: mdb_txn_commit: No space left on device"
    assert b.stats()["write_failures"] == lmdb_env.WRITE_ATTEMPTS and b.stats()["dropped_pages"] == 4
    with pytest.raises(BackendUnavailable):
        b.batch_set(keys(4), pages(4))
    assert b.batch_exists(keys(4)) == 0  # reads still answer
    monkeypatch.setattr(lmdb_env, "free_bytes", lambda path: 0)
    fault.failures = 0
    b.probe()
    assert b.status().startswith("degraded")  # no room yet, whatever a small write does
    monkeypatch.setattr(lmdb_env, "free_bytes", lambda path: 1 << 40)
    b.probe()
    assert b.status() == "ok" and b.batch_set(keys(4), pages(4)) == 4
    b.close()


def test_a_new_store_needs_its_free_space_and_is_retried(tmp_path, monkeypatch):
    free = {"bytes": 10 * MIB}
    monkeypatch.setattr(disk, "free_bytes", lambda path: free["bytes"])
    b = backend(tmp_path / "l3", min_free_mb=64)
    assert b.status() == (f"degraded: cannot open {tmp_path / 'l3'}: OSError: [Errno 28] 10,485,760 bytes free "
                          "(10.0 MiB), less than the 67,108,864 bytes (64.0 MiB, min_free_mb) a new store needs: "
                          f"'{tmp_path / 'l3'}'")
    free["bytes"] = 100 * MIB
    b.probe()
    assert b.status() == "ok" and b.batch_set(keys(1), pages(1)) == 1
    b.close()


def test_lmdb_maps_nothing_a_full_disk_could_sigbus(tmp_path):
    b = backend(tmp_path / "l3")
    assert b._envs[0].env.flags()["writemap"] is False  # data.mdb: read-only map, written with pwrite
    lock = os.stat(tmp_path / "l3" / "shard-00" / "lock.mdb")
    assert lock.st_size == disk.lock_file_bytes(lmdb_env.MAX_READERS)
    assert lock.st_blocks * 512 >= lock.st_size  # every block allocated: no sparse page to fault in
    b.close()


# ---- a real server on a full disk -----------------------------------------------------------

TURNS = ["Here is a long note about caches. " * 12 + "Summarise it in one line.",
         "Now list three kinds of cache, one word each. " * 4,
         "Which of them is the slowest? Answer briefly. " * 4]
OTHER = ["A different story about a lighthouse keeper and the sea. " * 10 + "Continue it.",
         "Tell it again from the point of view of the gull. " * 6]
GREEDY = {"temperature": 0, "max_new_tokens": 8}


def converse(url: str, turns: list[str]) -> list[str]:
    context, texts = "", []
    for turn in turns:
        context += turn
        r = httpx.post(url + "/generate", json={"text": context, "sampling_params": GREEDY}, timeout=300)
        assert r.status_code == 200, r.text
        texts.append(r.json()["text"])
        context += texts[-1]
    return texts


def storage(url: str) -> dict:
    return httpx.get(url + "/hicache/stats", timeout=30).json()["tiers"]["storage"]


def health_storage(url: str) -> str:
    return httpx.get(url + "/health", timeout=30).json()["details"]["storage"]


@pytest.mark.model
def test_a_server_on_a_full_disk_serves_degraded_resumes_and_survives_the_disk_filling(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
    from server_harness import LIGHT_FLAGS, start_server

    fs = mount_tmpfs(tmp_path / "fs", 48)
    server = None
    try:
        fs.fill()
        extra = {"path": str(fs.root / "l3"), "min_free_mb": 2, "prefetch_threshold": 32}
        server = start_server(*LIGHT_FLAGS, "--hicache-storage-backend", "lmdb", "--hicache-storage-prefetch-policy",
                              "wait_complete", "--hicache-storage-backend-extra-config", json.dumps(extra))
        url = server.url
        assert health_storage(url).startswith(f"degraded: cannot open {fs.root / 'l3'}: OSError: [Errno 28]")
        first = converse(url, TURNS)
        assert storage(url)["degraded"]

        fs.unfill()
        wait_until(lambda: health_storage(url) == "ok", timeout=30)
        assert converse(url, TURNS) == first
        converse(url, OTHER)  # new pages: stored now
        wait_until(lambda: storage(url)["backups_in_flight"] == 0 and storage(url)["backed_up_tokens"] > 0, 30)

        fs.fill()  # the disk fills while the server runs
        for i in range(3):
            converse(url, [f"Variation {i}. {turn}" for turn in OTHER])
            assert httpx.post(url + "/flush_cache", timeout=30).status_code == 200
            assert converse(url, TURNS) == first
        wait_until(lambda: storage(url)["backups_in_flight"] == 0, 30)
        s = storage(url)
        assert s["evicted_tokens"] > 0 or s["status"].startswith("degraded: writes fail"), s
        fs.unfill()
        wait_until(lambda: health_storage(url) == "ok", timeout=30)
        assert converse(url, OTHER[:1])
    finally:
        if server is not None:
            server.stop()
        subprocess.run(["umount", "-l", str(fs.root)], check=False)
