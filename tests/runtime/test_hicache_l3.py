"""HiCache L3 end to end on a tiny random 2-layer model, the Scheduler driven directly.

- A scheduler started on the LMDB path an earlier one wrote serves its prompts from storage, with
  the outputs of an uncached engine.
- Prefetch policies against a slow backend: best_effort does not wait, wait_complete gets every
  page, timeout gives up after its allowance; an abort in the middle of a fetch frees its pages.
- Faults: a backend that raises, a corrupt value, a full backup queue, an LMDB path that cannot be
  opened (degraded): counted, outputs unchanged.
- check_integrity() after every step (prefetch-held host pages and backup pins included).
"""
from __future__ import annotations

import random
import threading
import time

import pytest

from hicache.config import HiCacheConfig
from hicache.pagekey import page_keys
from hicache.runtime.config import RuntimeConfig
from hicache.runtime.messages import GenerateRequest
from hicache.runtime.sampling import SamplingParams
from hicache.runtime.build import build_scheduler
from hicache.runtime.scheduler import Scheduler

GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 4}


def request(rid: str, ids: list[int], params: dict, **kw) -> GenerateRequest:
    """A scheduler message whose sampling parameters are written as a dict (parsed as a front end does)."""
    return GenerateRequest(rid, ids, SamplingParams.from_dict(params, vocab_size=2**31), **kw)


PAGE = 4
THRESHOLD = 16


def l3_scheduler(config_path, backend="lmdb", policy="wait_complete", total=256, ratio=2.0, overlap=False,
                 io="process", radix=True, **extra) -> Scheduler:
    rc = RuntimeConfig(model_path=str(config_path), load_format="dummy", max_total_tokens=total,
                       max_running_requests=6, chunked_prefill_size=48, max_prefill_tokens=96,
                       overlap_schedule=overlap)
    # the tiny model recomputes faster than L3 loads: tests of the tiers' mechanics load every hit
    cc = HiCacheConfig(page_size=PAGE, disable_radix_cache=not radix, hicache_ratio=ratio, hicache_storage_backend=backend,
                       hicache_storage_prefetch_policy=policy, hicache_load_decision="always", hicache_storage_io=io,
                       hicache_storage_backend_extra_config={"prefetch_threshold": THRESHOLD, **extra})
    return build_scheduler(rc, cc)


def drain(sched: Scheduler, limit: int = 5000) -> dict[str, list]:
    out: dict[str, list] = {}
    for _ in range(limit):
        if not sched.has_requests():  # L3 operations may still run: settle() waits for them
            return out
        for o in sched.step():
            rec = out.setdefault(o.rid, [[], None])
            rec[0] += o.new_token_ids
            rec[1] = o.meta
        sched.check_integrity()
    raise AssertionError("the scheduler did not go idle")


def settle(sched: Scheduler) -> None:
    """Waits until every L3 write has landed and been folded in."""
    for _ in range(500):
        if not sched.cache.storage.busy():
            return
        sched.cache.storage.wait(0.02)
        sched.cache.storage.poll()
    raise AssertionError("L3 operations still in flight")


def prompts(seed: int, n: int = 3, length: int = 90) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(length)] for _ in range(n)]


def run_each(sched: Scheduler, ps: list[list[int]], tag: str) -> list[list]:
    """One request at a time; returns [output ids, meta] per prompt."""
    out = []
    for i, p in enumerate(ps):
        sched.add_request(request(f"{tag}{i}", p, dict(GREEDY)))
        out.append(drain(sched)[f"{tag}{i}"])
    return out


@pytest.fixture(scope="module")
def reference(tiny_config_path):
    """Greedy outputs with no cache at all, per prompt (memoised; new prompts run as one batch)."""
    sched = l3_scheduler(tiny_config_path, backend="none", total=16384, radix=False)
    memo: dict[tuple, list[int]] = {}

    def outputs(ps: list[list[int]]) -> list[list[int]]:
        todo = list({tuple(p) for p in ps if tuple(p) not in memo})
        for i, p in enumerate(todo):
            sched.add_request(request(f"ref{i}", list(p), dict(GREEDY)))
        got = drain(sched)
        for i, p in enumerate(todo):
            memo[p] = got[f"ref{i}"][0]
        return [memo[tuple(p)] for p in ps]

    return outputs


def flip_a_byte(path, namespace: str, key: str) -> None:
    import lmdb

    from hicache.tiers.remote.lmdb_layout import shard_folders, shard_of

    raw = bytes.fromhex(namespace)[:8] + bytes.fromhex(key)
    shards = shard_folders(str(path), 1, 0)  # the store's own layout file decides
    env = lmdb.open(shards[shard_of(raw, len(shards))], max_dbs=4)
    db = env.open_db(b"pages")
    with env.begin(write=True, db=db) as txn:
        value = bytearray(txn.get(raw))
        value[len(value) // 2] ^= 0x40
        txn.put(raw, bytes(value))
    env.close()


def test_restart_on_the_same_lmdb_is_served_from_storage(tiny_config_path, reference, tmp_path):
    ps = prompts(1)
    first = l3_scheduler(tiny_config_path, path=str(tmp_path), io="threads")  # its backend is read here
    cold = run_each(first, ps, "a")
    settle(first)
    assert first.stats()["tiers"]["storage"]["backed_up_tokens"] >= 3 * 88
    seed = first.cache.storage.keys.seed("")
    first.close()
    flip_a_byte(tmp_path, seed.hex(), page_keys(seed, ps[1], PAGE)[4])  # prompt 1's fifth page
    second = l3_scheduler(tiny_config_path, path=str(tmp_path))
    warm = run_each(second, ps, "b")
    want = reference(ps)
    assert [o for o, _ in cold] == want and [o for o, _ in warm] == want
    assert [m["cached_tokens_details"] for _, m in warm] == [
        {"device": 0, "host": 0, "storage": 88}, {"device": 0, "host": 0, "storage": 4 * PAGE},
        {"device": 0, "host": 0, "storage": 88}]
    stats = second.stats()
    storage = stats["tiers"]["storage"]
    assert storage["status"] == "ok" and storage["backend"] == "lmdb" and storage["corrupt_pages"] == 1
    assert storage["hit_tokens"] == stats["tokens"]["cached"]["storage"] == 2 * 88 + 4 * PAGE
    assert storage["prefetched_bytes"] > 0
    assert storage["used_tokens"] > 0 and storage["capacity_tokens"] > storage["used_tokens"]
    settle(second)
    assert second.flush_cache()
    second.check_integrity()
    second.close()


def test_backups_after_splits_land_under_the_keys_a_restart_queries(tiny_config_path, reference, tmp_path):
    """Prompts sharing prefixes split each other's nodes (keys cached on nodes are split with
    them); what was backed up is found under keys computed from the root, and served."""
    a = prompts(11, n=1)[0]
    ps = [a, a[:40] + prompts(12, n=1, length=50)[0], a[:20] + prompts(13, n=1, length=70)[0]]
    first = l3_scheduler(tiny_config_path, path=str(tmp_path), io="threads")  # its backend is read here
    run_each(first, ps, "a")
    settle(first)
    seed = first.cache.storage.keys.seed("")
    backend = first.cache.storage.engine.backend
    for p in ps:
        keys = page_keys(seed, p, PAGE)
        assert backend.batch_exists(keys) == len(keys) == 22
    first.close()
    second = l3_scheduler(tiny_config_path, path=str(tmp_path))
    warm = run_each(second, ps, "b")
    assert [o for o, _ in warm] == reference(ps)
    assert [m["cached_tokens_details"] for _, m in warm] == [
        {"device": 0, "host": 0, "storage": 88}, {"device": 40, "host": 0, "storage": 48},
        {"device": 20, "host": 0, "storage": 68}]
    settle(second)
    second.close()


def test_an_lmdb_path_that_cannot_be_opened_serves_without_storage(tiny_config_path, reference, tmp_path):
    path = tmp_path / "lmdb"
    path.write_bytes(b"a file where the folder should be")
    ps = prompts(3)
    sched = l3_scheduler(tiny_config_path, path=str(path))
    out = run_each(sched, ps, "a")
    settle(sched)
    assert [o for o, _ in out] == reference(ps)
    assert [m["cached_tokens_details"]["storage"] for _, m in out] == [0, 0, 0]
    storage = sched.stats()["tiers"]["storage"]
    assert storage["degraded"] and storage["status"].startswith(f"degraded: cannot open {path}: FileExistsError")
    assert storage["errors"] >= 3 + 3 and storage["backed_up_tokens"] == 0  # 3 queries, 3+ backups
    sched.close()


def test_lmdb_filled_past_its_cap_evicts_and_serves(tiny_config_path, reference, tmp_path):
    ps = prompts(7, n=6)
    page_bytes = 2 * 2 * 2 * 16 * 4 * PAGE  # tiny-llama: K and V, 2 layers, 2 KV heads, head_dim 16, fp32
    cap_gb = 40 * page_bytes / 1e9  # room for about two prompts of 22 pages
    first = l3_scheduler(tiny_config_path, path=str(tmp_path), size_cap_gb=cap_gb)
    run_each(first, ps, "a")
    settle(first)
    storage = first.stats()["tiers"]["storage"]
    assert storage["evicted_tokens"] > 0 and storage["used_tokens"] * storage["bytes_per_token"] <= cap_gb * 1e9
    first.close()
    second = l3_scheduler(tiny_config_path, path=str(tmp_path), size_cap_gb=cap_gb)
    order = ps[::-1]  # newest first: the last prompt written is still stored, the first ones are not
    warm = run_each(second, order, "b")
    assert [o for o, _ in warm] == reference(order)
    assert [m["cached_tokens_details"]["storage"] for _, m in warm][::5] == [88, 0]


def test_shorter_than_the_threshold_is_not_prefetched(tiny_config_path, tmp_path):
    short = prompts(2, n=1, length=THRESHOLD - 4)
    first = l3_scheduler(tiny_config_path, backend="memory", store="short")
    run_each(first, short, "a")
    settle(first)
    second = l3_scheduler(tiny_config_path, backend="memory", store="short")
    (_, meta), = run_each(second, short, "b")
    assert meta["cached_tokens"] == 0
    assert second.stats()["tiers"]["storage"].get("prefetch_queries", 0) == 0


class Gate:
    """Holds every batch_get of a backend until opened (a slow store)."""

    def __init__(self, sched: Scheduler):
        self.open = threading.Event()
        backend = sched.cache.storage.engine.backend
        real = backend.batch_get

        def slow(keys, pages):
            self.open.wait(10)
            return real(keys, pages)

        backend.batch_get = slow


def warm_store(config_path, name: str, ps) -> None:
    sched = l3_scheduler(config_path, backend="memory", store=name)
    run_each(sched, ps, "w")
    settle(sched)
    sched.close()


@pytest.mark.parametrize("policy", ["best_effort", "wait_complete", "timeout"])
def test_prefetch_policies_against_a_slow_store(tiny_config_path, reference, policy):
    ps = prompts(3, n=1)
    warm_store(tiny_config_path, f"slow-{policy}", ps)
    sched = l3_scheduler(tiny_config_path, backend="memory", policy=policy, store=f"slow-{policy}",
                         prefetch_timeout_base=0.3, prefetch_timeout_per_ki_token=0.0)
    gate = Gate(sched)
    if policy == "wait_complete":
        threading.Timer(0.5, gate.open.set).start()
    started = time.monotonic()
    (out, meta), = run_each(sched, ps, "p")
    waited = time.monotonic() - started
    gate.open.set()
    assert out == reference(ps)[0]
    storage = meta["cached_tokens_details"]["storage"]
    if policy == "wait_complete":
        assert storage == 88 and waited >= 0.5
    elif policy == "timeout":
        assert storage == 0 and 0.3 <= waited < 5
        assert sched.stats()["tiers"]["storage"]["prefetch_cut_short"] == 1
    else:  # the gate stays shut (10 s) while it runs: it must not have waited for the fetch
        assert storage == 0 and waited < 5
    settle(sched)
    assert sched.flush_cache()
    sched.check_integrity()
    host = sched.cache.host.host_pool.allocator
    assert host.num_free_tokens() == host.capacity_tokens()


@pytest.mark.parametrize("overlap", [False, True])
def test_decoding_never_waits_for_a_prefetch(tiny_config_path, reference, overlap):
    """A request decodes while another waits for its L3 fetch (held): every step emits its next
    token without the scheduler waiting on the fetch (only, a few ms at most, on the query before
    it), with overlap decode steps go on being launched ahead, and the waiting request is served
    from L3 once its pages land."""
    ps = prompts(4, n=1)
    warm_store(tiny_config_path, f"decoding-{overlap}", ps)
    sched = l3_scheduler(tiny_config_path, backend="memory", store=f"decoding-{overlap}", overlap=overlap)
    gate = Gate(sched)
    engine, storage = sched.cache.storage.engine, sched.cache.storage
    waits = []  # (timeout, the phases of the prefetches then)
    real_wait = engine.wait
    engine.wait = lambda timeout: (waits.append((timeout, {op.phase for op in storage._live})),
                                   real_wait(timeout))
    emitted: dict[str, int] = {}

    def step() -> None:
        for o in sched.step():
            emitted[o.rid] = emitted.get(o.rid, 0) + len(o.new_token_ids)
    sched.add_request(request("d", [11, 12, 13], {"temperature": 0, "ignore_eos": True, "max_new_tokens": 30}))
    while not emitted:
        step()
    sched.add_request(request("p", ps[0], dict(GREEDY)))
    step()
    before, continued = emitted["d"], sched.overlap.continued if overlap else 0
    for _ in range(6):
        step()
    assert emitted["d"] == before + 6 and "p" not in emitted
    # the only waits: a few ms for p's query, never for its fetch
    assert all(t <= storage.options.query_grace and phases == {"query"} for t, phases in waits), waits
    assert not overlap or sched.overlap.continued >= continued + 5
    gate.open.set()
    got = drain(sched)
    assert got["p"][0] == reference(ps)[0] and got["p"][1]["cached_tokens_details"]["storage"] == 88
    settle(sched)
    sched.check_integrity()


@pytest.mark.parametrize("grace", [0.5, 0.0])
def test_a_request_arriving_while_others_decode_joins_the_next_batch_once_its_query_answers(tiny_config_path,
                                                                                            grace):
    """Its query answers within `query_grace`: it is admitted in the step it arrived in, not one
    step later (with no grace, it is not: there its query is held until that step is over, so that
    a loaded machine's slow step cannot answer it in time)."""
    sched = l3_scheduler(tiny_config_path, backend="memory", store=f"query-grace-{grace}", query_grace=grace)
    sched.add_request(request("d", [11, 12, 13], {"temperature": 0, "ignore_eos": True, "max_new_tokens": 30}))
    while not any(o.new_token_ids for o in sched.step()):
        pass
    answer = threading.Event()
    if grace == 0:
        backend = sched.cache.storage.engine.backend
        real = backend.batch_exists
        backend.batch_exists = lambda keys: answer.wait(10) and real(keys)
    sched.add_request(request("q", prompts(5, n=1)[0], dict(GREEDY)))  # nothing of it in L3: the query misses
    sched.step()
    answer.set()
    admitted = any(r.rid == "q" for r in sched.running)
    assert admitted == (grace > 0)
    assert sched.cache.storage.counters["prefetch_queries"] == 1
    drain(sched)
    settle(sched)
    storage = sched.stats()["tiers"]["storage"]  # the query's round trip, as the scheduler saw it
    assert storage["queries_answered"] == 1 and 0 < storage["query_seconds"] < 10


def test_abort_during_a_fetch_frees_its_pages(tiny_config_path, reference):
    ps = prompts(4, n=1)
    warm_store(tiny_config_path, "abort", ps)
    sched = l3_scheduler(tiny_config_path, backend="memory", store="abort")
    gate = Gate(sched)
    sched.add_request(request("x", ps[0], dict(GREEDY)))
    for _ in range(200):  # until the fetch holds its host pages
        sched.step()
        sched.check_integrity()
        if sched.cache.storage.held_host_slots().numel():
            break
    assert sched.cache.storage.held_host_slots().numel() == 88
    sched.abort("x")
    sched.check_integrity()
    gate.open.set()
    settle(sched)
    sched.check_integrity()
    assert sched.cache.storage.held_host_slots().numel() == 0
    assert sched.stats()["tiers"]["storage"]["prefetch_revoked"] == 1
    (out, _), = run_each(sched, ps, "y")
    assert out == reference(ps)[0]


def test_backend_failures_are_counted_misses(tiny_config_path, reference):
    ps = prompts(5)
    warm_store(tiny_config_path, "faulty", ps)
    sched = l3_scheduler(tiny_config_path, backend="memory", store="faulty")
    backend = sched.cache.storage.engine.backend
    real_get = backend.batch_get
    calls = [0]

    def flaky(keys, pages):
        calls[0] += 1
        if calls[0] == 1:
            raise ConnectionError("injected")
        return real_get(keys, pages)

    backend.batch_get = flaky
    key = backend._prefix + page_keys(sched.cache.storage.keys.seed(""), ps[1], PAGE)[3]  # prompt 1's fourth page
    corrupt = bytearray(backend._data[key])
    corrupt[-3] ^= 0xFF
    backend._data[key] = bytes(corrupt)
    got = run_each(sched, ps, "f")
    assert [o for o, _ in got] == reference(ps)
    assert [m["cached_tokens_details"]["storage"] for _, m in got] == [0, 3 * PAGE, 88]
    storage = sched.stats()["tiers"]["storage"]
    assert storage["errors"] == 1 and storage["corrupt_pages"] == 1 and storage["prefetch_failed"] == 2


def test_a_full_backup_queue_drops_and_counts(tiny_config_path, reference):
    ps = prompts(6)
    sched = l3_scheduler(tiny_config_path, backend="memory", backup_queue_pages=1)
    got = run_each(sched, ps, "q")
    assert [o for o, _ in got] == reference(ps)
    settle(sched)
    storage = sched.stats()["tiers"]["storage"]
    assert storage["backup_dropped_tokens"] > 0 and storage["backed_up_tokens"] == 0


@pytest.mark.parametrize("policy", ["best_effort", "timeout", "wait_complete"])
def test_random_stress_with_prefetches_keeps_integrity_and_outputs(tiny_config_path, reference, policy):
    """L1 and L2 too small for the working set, L3 (memory, slow and sometimes failing) holding
    it: arrivals, aborts, prefetches cut short, failures; integrity after every step."""
    rng = random.Random(policy)
    sched = l3_scheduler(tiny_config_path, backend="memory", policy=policy, total=192, ratio=1.0,
                         prefetch_timeout_base=0.01, prefetch_timeout_per_ki_token=0.0)
    backend = sched.cache.storage.engine.backend
    real_get = backend.batch_get

    def slow_flaky(keys, pages):
        time.sleep(rng.random() * 0.01)
        if rng.random() < 0.05:
            raise ConnectionError("injected")
        return real_get(keys, pages)

    backend.batch_get = slow_flaky
    stems = prompts(8, n=5, length=70)
    asked, aborted, results = {}, set(), {}
    for step in range(200):
        if rng.random() < 0.25:
            rid = f"s{step}"
            asked[rid] = rng.choice(stems)[: rng.randrange(20, 71)] + [rng.randrange(3, 500) for _ in range(3)]
            sched.add_request(request(rid, asked[rid], dict(GREEDY)))
        if rng.random() < 0.03 and sched.waiting:
            victim = rng.choice(sched.waiting).rid
            aborted.add(victim)
            sched.abort(victim)
        for o in sched.step():
            results.setdefault(o.rid, []).extend(o.new_token_ids)
        sched.check_integrity()
    for rid, ids in drain(sched).items():
        results.setdefault(rid, []).extend(ids[0])
    done = [rid for rid in asked if rid not in aborted]
    assert [results[rid] for rid in done] == reference([asked[rid] for rid in done])
    storage = sched.stats()["tiers"]["storage"]
    assert storage["prefetch_queries"] > 0 and storage["backed_up_tokens"] > 0
    if policy != "best_effort":
        assert storage["hit_tokens"] > 0, storage
    settle(sched)
    assert sched.flush_cache()
    sched.check_integrity()
    host = sched.cache.host.host_pool.allocator
    assert host.num_free_tokens() == host.capacity_tokens()
