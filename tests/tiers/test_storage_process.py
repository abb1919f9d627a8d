"""The storage process: the L3 worker in a child process over the shared host pool, real backends."""
from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from hicache.config import HiCacheConfig
from hicache.runtime.build import build_scheduler
from hicache.runtime.config import RuntimeConfig
from hicache.tiers.host.pool import HostKVPool
from hicache.tiers.remote import make_backend
from hicache.tiers.remote.process import StorageProcess
from lmdb_corrupt import corrupt_value_nodes
from test_remote import results

NS = "5ea15ea15ea15ea1"


def shared_pool(layout: str = "page_first", tokens: int = 64, head_dim: int = 8) -> HostKVPool:
    pool = HostKVPool(tokens, 4, num_layers=3, num_kv_heads=2, head_dim=head_dim, dtype=torch.float32, layout=layout,
                      pin=False, shared=True)
    pool.buffer.copy_(torch.randn(pool.buffer.shape))
    return pool


def keys(n: int, salt: str = "") -> list[str]:
    return [f"{salt}{i:x}".rjust(64, "0") for i in range(n)]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_pages_go_through_the_child_and_come_back_identical(tmp_path, layout):
    pool = shared_pool(layout)
    proc = StorageProcess("lmdb", NS, None, {"path": str(tmp_path)}, pool, batch_pages=2)
    try:
        k, slots = keys(5), pool.allocator.alloc(20)
        want = [pool.page(int(s)).clone() for s in slots[::4]]
        t = proc.backup(k, slots)
        (res,) = results(proc, 1)
        assert (res.ticket, res.ok, res.pages, res.skipped) == (t, True, 5, 0)
        into = pool.allocator.alloc(20)
        q, f = proc.query(k + keys(7, "f")), proc.fetch(k, into)
        r_query, r_fetch = results(proc, 2)
        assert (r_query.ticket, r_query.pages) == (q, 5)
        assert (r_fetch.ticket, r_fetch.ok, r_fetch.pages) == (f, True, 5)
        for i, page in enumerate(want):  # the child wrote them into the memory this process reads
            assert torch.equal(pool.page(int(into[4 * i])), page)
        stats = proc.stats()
        assert (stats["backed_up_pages"], stats["fetched_pages"], stats["queries"]) == (5, 5, 1)
        assert proc.status() == "ok"
    finally:
        proc.close()
    assert proc._proc.returncode == 0
    backend = make_backend("lmdb", NS, path=str(tmp_path))  # what the child wrote is in the store
    assert backend.batch_exists(k) == 5
    backend.close()


def test_statistics_never_wait_for_the_child(tmp_path):
    pool = shared_pool()
    proc = StorageProcess("lmdb", NS, None, {"path": str(tmp_path)}, pool, batch_pages=2)
    try:
        assert "queries" not in proc.stats() and proc.status() == "ok"  # the first report is waited for
        os.kill(proc._proc.pid, signal.SIGSTOP)  # a child that answers nothing for a while
        try:
            proc.query(keys(3))
            assert proc.status() == "ok" and "queries" not in proc.stats()  # its last report, at once
        finally:
            os.kill(proc._proc.pid, signal.SIGCONT)
        assert results(proc, 1)[0].pages == 0
        end = time.monotonic() + 10
        while "queries" not in proc.stats() and time.monotonic() < end:  # each call asks for the next report
            proc.wait(0.05)
        assert proc.stats()["queries"] == 1
    finally:
        proc.close()


def test_the_child_reuses_the_large_blocks_it_frees():
    """LMDB's write transactions allocate and free each large value's pages: the storage process
    keeps those blocks, so that writing again faults in no fresh memory (counted in page faults)."""
    code = textwrap.dedent("""
        import ctypes, resource, threading
        from hicache.tiers.remote.process_main import keep_freed_memory
        assert keep_freed_memory()
        libc = ctypes.CDLL(None)
        libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
        libc.free.argtypes, libc.memset.argtypes = [ctypes.c_void_p], [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
        faults = []
        def transactions():  # on a thread, as the shards' writers
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for _ in range(20):
                blocks = [libc.malloc((8 << 20) + 4096) for _ in range(4)]
                for b in blocks:
                    libc.memset(b, 1, 8 << 20)
                for b in blocks:
                    libc.free(b)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        t = threading.Thread(target=transactions)
        t.start()
        t.join()
        print(faults[0])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    pages = 4 * (8 << 20) // 4096  # one transaction's blocks, faulted in once
    assert int(out.stdout) < 3 * pages  # not once per transaction (20 times)


def test_closing_a_shared_pool_ends_its_memfd_and_keeps_its_bytes():
    for i in range(3):  # with CUDA, each new pool is registered, maybe where a closed one was mapped
        pool = shared_pool()
        pool.buffer.fill_(i)
        fd = pool.shared_fd
        pool.close()
        with pytest.raises(OSError):
            os.fstat(fd)
        assert pool.shared_fd is None and not pool.pinned and bool((pool.buffer == i).all())
        del pool


def test_a_closed_scheduler_closes_its_shared_host_pool(tmp_path, tiny_config_path):
    """The cache facade's close ends the storage process, then the pool it shared (with CUDA, its
    registration: a later pool mapped at its address could not be registered otherwise)."""
    rc = RuntimeConfig(model_path=str(tiny_config_path), load_format="dummy", device="cpu", dtype="float32",
                       max_total_tokens=256)
    cc = HiCacheConfig(page_size=4, hicache_storage_backend="lmdb", hicache_storage_io="process",
                       hicache_storage_backend_extra_config={"path": str(tmp_path)})
    sched = build_scheduler(rc, cc)
    pool = sched.cache.host.host_pool
    fd = pool.shared_fd
    os.fstat(fd)
    sched.close()
    assert pool.shared_fd is None
    with pytest.raises(OSError):
        os.fstat(fd)


def test_bad_options_and_a_backend_that_cannot_start_raise_here(tmp_path):
    pool = shared_pool()
    with pytest.raises(ValueError, match="does not take colour"):
        StorageProcess("lmdb", NS, None, {"path": str(tmp_path), "colour": 1}, pool, 2)
    with pytest.raises(ValueError, match="shards"):  # raised by the backend in the child, named here
        StorageProcess("lmdb", NS, None, {"path": str(tmp_path), "shards": 65}, pool, 2)
    with pytest.raises(ValueError, match="shared memory"):
        StorageProcess("lmdb", NS, None, {"path": str(tmp_path)}, HostKVPool(64, 4, 3, 2, 8, torch.float32), 2)


def test_revoke_withdraws_a_queued_op_but_not_a_running_one(redis_server):
    pool = shared_pool()
    proc = StorageProcess("redis", NS, None, {"url": redis_server.url, "socket_timeout": 30}, pool, 2)
    try:
        k = keys(4)
        os.kill(redis_server.proc.pid, signal.SIGSTOP)  # the first backup hangs inside its write
        try:
            first = proc.backup(k[:2], pool.allocator.alloc(8))
            second = proc.backup(k[2:], pool.allocator.alloc(8))
            time.sleep(1.0)
            assert not proc.revoke(first) and proc.revoke(second)
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        r_first, r_second = results(proc, 2, timeout=40)
        assert (r_first.ok, r_first.pages) == (True, 2)
        assert (r_second.ok, r_second.pages, r_second.error) == (False, 0, "cancelled")
        proc.query(k)
        assert results(proc, 1)[0].pages == 2  # the revoked pages were never written
    finally:
        proc.close()


def test_a_dead_child_turns_everything_into_misses_until_a_new_one_runs(tmp_path):
    pool = shared_pool(tokens=1024)
    proc = StorageProcess("lmdb", NS, None, {"path": str(tmp_path)}, pool, batch_pages=1)
    k = keys(40)
    proc.backup(k, pool.allocator.alloc(160))
    assert results(proc, 1)[0].pages == 40
    fetch = proc.fetch(k, pool.allocator.alloc(160))
    while proc.progress(fetch) == 0:  # some pages landed, one page a batch
        time.sleep(0.001)
    proc._proc.kill()
    proc._proc.wait()
    seen = proc.progress(fetch)
    (res,) = results(proc, 1)
    assert (res.ticket, res.ok) == (fetch, False) and 0 < seen == res.pages < 40  # landed pages stay landed
    assert "exited" in res.error and proc.status().startswith("degraded: the storage process exited")
    later = proc.fetch(k, pool.allocator.alloc(160))
    with pytest.raises(ValueError, match="no host slots"):
        proc.backup(k, None)
    (res,) = results(proc, 1)
    assert (res.ticket, res.ok, res.pages) == (later, False, 0)
    assert proc.revoke(later) is False and proc.stats() == {"process_restarts": 0, "process_crashes": 0} and proc.quiesce(1.0)
    end = time.monotonic() + 60  # a new child starts after the backoff and serves again
    while proc.status() != "ok" and time.monotonic() < end:
        proc.wait(0.1)
        proc.poll()
    assert proc.status() == "ok" and proc.stats()["process_restarts"] == 1
    into = pool.allocator.alloc(160)
    proc.fetch(k, into)
    (res,) = results(proc, 1)
    assert (res.ok, res.pages) == (True, 40)
    proc.close()


def test_a_child_whose_server_died_still_lands_its_queued_backups(tmp_path):
    """The scheduler's process exits without closing: the child's socket closes and it finishes
    the backups it was given before it exits."""
    script = textwrap.dedent(f"""
        import os, sys, torch
        sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parent.parent)!r}]  # tests/tiers, tests
        from test_storage_process import shared_pool, keys
        from hicache.tiers.remote.process import StorageProcess
        pool = shared_pool(tokens=512)
        proc = StorageProcess("lmdb", {NS!r}, None, {{"path": {str(tmp_path)!r}}}, pool, 2)
        for i in range(4):
            proc.backup(keys(32, str(i)), pool.allocator.alloc(128))
        print(proc._proc.pid, flush=True)
        os._exit(0)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    child = int(out.stdout.split()[-1])
    end = time.monotonic() + 60
    while alive(child) and time.monotonic() < end:
        time.sleep(0.1)
    assert not alive(child)
    backend = make_backend("lmdb", NS, path=str(tmp_path))
    assert [backend.batch_exists(keys(32, str(i))) for i in range(4)] == [32] * 4
    backend.close()


def test_a_store_that_crashes_the_child_is_quarantined_and_a_fresh_one_serves(tmp_path):
    """A real corrupt B-tree: the child crashes on each fetch; the second crash moves the store
    aside (kept, private) and a fresh store serves in its place, the quarantine in `stats()`."""
    store = tmp_path / "lmdb"
    pool = shared_pool(tokens=512, head_dim=64)  # 12 KiB values: LMDB keeps them in overflow pages
    k = keys(16)
    proc = StorageProcess("lmdb", NS, None, {"path": str(store), "shards": 1}, pool, batch_pages=4)
    proc.backup(k, pool.allocator.alloc(64))
    assert results(proc, 1)[0].pages == 16
    proc.close()
    assert corrupt_value_nodes(store / "shard-00" / "data.mdb") >= 16  # and free pages of older copies
    proc = StorageProcess("lmdb", NS, None, {"path": str(store), "shards": 1}, pool, batch_pages=4)
    try:
        outcomes, end = [], time.monotonic() + 90
        while proc.quarantined is None and time.monotonic() < end:
            if proc.status() == "ok":  # a child runs (again): it reads the corrupt store
                proc.fetch(k, pool.allocator.alloc(64))
                outcomes += results(proc, 1, timeout=30)
            proc.wait(0.1)
            proc.poll()
        assert proc.quarantined is not None, proc.status()
        assert [r.ok for r in outcomes] == [False, False] and all("crashed (SIG" in r.error for r in outcomes)
        assert proc.crashes == 2
        moved = Path(proc.quarantined)
        assert moved.parent == tmp_path and moved.name.startswith("lmdb.quarantined-")
        assert stat.S_IMODE(moved.stat().st_mode) == 0o700
        assert stat.S_IMODE((moved / "shard-00" / "data.mdb").stat().st_mode) == 0o600
        end = time.monotonic() + 60
        while proc.status() != "ok" and time.monotonic() < end:
            proc.wait(0.1)
            proc.poll()
        assert proc.status() == "ok"
        proc.fetch(k, pool.allocator.alloc(64))  # the fresh store: misses, no crash
        assert results(proc, 1, timeout=30)[0].pages == 0
        proc.backup(k[:4], pool.allocator.alloc(16))
        assert results(proc, 1)[0].pages == 4
        stats = proc.stats()
        assert (stats["quarantined"], stats["quarantined_stores"], stats["process_crashes"]) == (str(moved), 1, 2)
        assert (store / "shard-00" / "data.mdb").exists()
    finally:
        proc.close()


def test_a_store_that_cannot_be_moved_aside_leaves_storage_off(tmp_path, monkeypatch):
    """Crashes that quarantine cannot help (here the store cannot be renamed) end in a degraded
    storage that starts no further child."""
    pool = shared_pool()
    proc = StorageProcess("lmdb", NS, None, {"path": str(tmp_path / "lmdb")}, pool, batch_pages=2)

    def refuse(*_args):
        raise PermissionError(13, "Permission denied", str(tmp_path / "lmdb"))

    monkeypatch.setattr(os, "rename", refuse)
    try:
        for _ in range(2):
            end = time.monotonic() + 60
            while proc.status() != "ok" and time.monotonic() < end:
                proc.wait(0.1)
                proc.poll()
            os.kill(proc._proc.pid, signal.SIGSEGV)
            proc.query(keys(2))
            assert "crashed (SIGSEGV)" in results(proc, 1, timeout=30)[0].error
        assert proc.status().startswith("degraded: the storage process crashed 2 times and its store could not be "
                                        "moved aside") and proc.status().endswith("off until the server restarts")
        time.sleep(1.5)  # past the first backoff: nothing is started
        proc.poll()
        assert proc._proc.poll() is not None and proc.quarantined is None
        assert (tmp_path / "lmdb" / "hicache-l3.json").exists()
    finally:
        proc.close()
