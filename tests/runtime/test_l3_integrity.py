"""L3 values bound to their keys, end to end: a real LMDB file tampered with by a writer that goes
around hicache, and schedulers on a tiny random 2-layer model restarted on it.

- Chaos: the raw values of many key pairs swapped inside the LMDB file (every frame and checksum
  valid). A restarted scheduler replays the prompts with the outputs of a fault-free run, counts
  every swapped page corrupt, serves none (each prompt's storage hit ends at its first swapped
  page), and its backups store them again: the next restart is served in full.
- With a storage secret: values forged by a writer without it (right key, valid checksum, no MAC or a
  MAC under another secret) and a value moved from another key are counted corrupt and never
  served, where a server without the secret would accept the forgeries.
- The secret itself: flag or config field; refused in the extra config;
  absent from the config's repr, the stats and /get_server_info.
"""
from __future__ import annotations

import asyncio
import json
import random
import shutil
from types import SimpleNamespace

import lmdb
import pytest
import torch

from hicache.config import HiCacheConfig
from hicache.pagekey import page_keys
from hicache.runtime.build import build_scheduler
from hicache.runtime.config import RuntimeConfig
from hicache.runtime.messages import GenerateRequest
from hicache.runtime.sampling import SamplingParams
from hicache.runtime.scheduler import Scheduler
from hicache.tiers.remote.framing import decode_into, encode
from test_hicache_l3 import drain, settle

GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 4}
PAGE = 4
PAGES = 22  # whole pages of a 90-token prompt
SECRET = "integrity-test-secret-0123456789"


def l3_scheduler(config_path, backend="lmdb", total=256, secret=None, radix=True, io="process", **extra) -> Scheduler:
    rc = RuntimeConfig(model_path=str(config_path), load_format="dummy", max_total_tokens=total,
                       max_running_requests=6, chunked_prefill_size=48, max_prefill_tokens=96)
    cc = HiCacheConfig(page_size=PAGE, disable_radix_cache=not radix, hicache_storage_backend=backend,
                       hicache_storage_prefetch_policy="wait_complete", hicache_storage_secret=secret,
                       hicache_load_decision="always", hicache_storage_io=io,
                       hicache_storage_backend_extra_config={"prefetch_threshold": 16, **extra})
    return build_scheduler(rc, cc)


def run_each(sched: Scheduler, ps: list[list[int]], tag: str) -> tuple[list[list[int]], list[int]]:
    """One request at a time: (outputs, prompt tokens each got from L3)."""
    outs, storage = [], []
    for i, p in enumerate(ps):
        params = SamplingParams.from_dict(dict(GREEDY), vocab_size=2**31)
        sched.add_request(GenerateRequest(f"{tag}{i}", p, params))
        ids, meta = drain(sched)[f"{tag}{i}"]
        outs.append(ids)
        storage.append(meta["cached_tokens_details"]["storage"])
    return outs, storage


def prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(90)] for _ in range(n)]


@pytest.fixture(scope="module")
def reference(tiny_config_path):
    """Greedy outputs with no cache at all."""
    sched = l3_scheduler(tiny_config_path, backend="none", total=16384, radix=False)

    def outputs(ps: list[list[int]]) -> list[list[int]]:
        return run_each(sched, ps, "ref")[0]

    return outputs


def populate(config_path, path, ps, secret=None) -> tuple[bytes, tuple]:
    """Runs `ps` on a scheduler over the LMDB at `path` until every page is stored; returns the
    model's seed and the shape of a page."""
    sched = l3_scheduler(config_path, path=str(path), secret=secret, shards=1, io="threads")  # its environment is tampered with
    run_each(sched, ps, "w")
    settle(sched)
    seed = sched.cache.storage.keys.seed("")
    backend = sched.cache.storage.engine.backend
    assert all(backend.batch_exists(page_keys(seed, p, PAGE)) == PAGES for p in ps)
    shape = tuple(sched.cache.host.host_pool.page(0).shape)
    sched.close()
    return seed, shape


def storage_key(seed: bytes, key: str) -> bytes:
    """The LMDB key of a page: the model's namespace id (8 bytes) + the page key."""
    return seed[:8] + bytes.fromhex(key)


def tamper(path, edit) -> None:
    """Runs `edit(txn)` in a write transaction on the `pages` sub-database of the (single) LMDB
    shard at `path`, opened with the lmdb package directly (no scheduler has it open)."""
    env = lmdb.open(str(path / "shard-00"), max_dbs=4)
    try:
        db = env.open_db(b"pages")
        with env.begin(write=True, db=db) as txn:
            edit(txn)
    finally:
        env.close()


def test_swapped_values_in_the_lmdb_file_are_counted_and_never_served(tiny_config_path, reference, tmp_path):
    ps = prompts(21, n=4)
    seed, _ = populate(tiny_config_path, tmp_path, ps)
    keys = [page_keys(seed, p, PAGE) for p in ps]
    # pages 3.. of the first three prompts, paired at random (within a prompt and across prompts);
    # the fourth prompt is left intact
    candidates = [(i, j) for i in range(3) for j in range(3, PAGES)]
    random.Random(5).shuffle(candidates)
    pairs = [(candidates[2 * n], candidates[2 * n + 1]) for n in range(24)]

    def swap(txn) -> None:
        for (i, j), (k, m) in pairs:
            a, b = storage_key(seed, keys[i][j]), storage_key(seed, keys[k][m])
            va, vb = txn.get(a), txn.get(b)
            assert va is not None and vb is not None and va != vb and len(va) == len(vb)
            txn.put(a, vb)
            txn.put(b, va)

    tamper(tmp_path, swap)
    swapped = {page for pair in pairs for page in pair}
    first_swapped = [min([j for i, j in swapped if i == p], default=PAGES) for p in range(len(ps))]
    assert len(swapped) == 48 and first_swapped[3] == PAGES

    second = l3_scheduler(tiny_config_path, path=str(tmp_path))
    outs, storage = run_each(second, ps, "b")
    assert outs == reference(ps)
    assert storage == [f * PAGE for f in first_swapped]  # served up to the first swapped page, never past it
    stats = second.stats()["tiers"]["storage"]
    assert stats["corrupt_pages"] == len(swapped) and stats["stale_pages"] == 0
    settle(second)  # the requests' backups store the deleted pages again
    second.close()

    third = l3_scheduler(tiny_config_path, path=str(tmp_path))
    outs, storage = run_each(third, ps, "c")
    assert outs == reference(ps) and storage == [PAGES * PAGE] * len(ps)
    assert third.stats()["tiers"]["storage"]["corrupt_pages"] == 0
    third.close()


def test_with_a_secret_forged_values_are_counted_and_never_served(tiny_config_path, reference, tmp_path):
    ps = prompts(22, n=3)
    path = tmp_path / "lmdb"
    seed, shape = populate(tiny_config_path, path, ps, secret=SECRET)
    keys = [page_keys(seed, p, PAGE) for p in ps]
    secret = SECRET.encode()
    forged = {(0, 6): None, (1, 8): b"a secret of another deployment", (2, 4): "moved"}

    def forge(txn) -> None:
        donor = storage_key(seed, keys[0][1])
        page = torch.empty(shape)
        decode_into(txn.get(donor), page, donor, secret)  # a real page of the model, the wrong one here
        for (i, j), how in forged.items():
            target = storage_key(seed, keys[i][j])
            value = txn.get(donor) if how == "moved" else encode(page, target, how)
            if how is None:
                decode_into(value, torch.empty(shape), target)  # well formed: a server without a secret takes it
            txn.put(target, value)

    tamper(path, forge)
    plain_path = tmp_path / "copy"
    shutil.copytree(path, plain_path)

    sched = l3_scheduler(tiny_config_path, path=str(path), secret=SECRET)
    outs, storage = run_each(sched, ps, "s")
    assert outs == reference(ps)
    assert storage == [6 * PAGE, 8 * PAGE, 4 * PAGE]
    assert sched.stats()["tiers"]["storage"]["corrupt_pages"] == len(forged)
    settle(sched)
    sched.close()

    plain = l3_scheduler(tiny_config_path, path=str(plain_path))  # the same file, no secret: the forgeries pass
    _, storage = run_each(plain, ps, "p")
    assert storage == [PAGES * PAGE, PAGES * PAGE, 4 * PAGE]
    assert plain.stats()["tiers"]["storage"]["corrupt_pages"] == 1  # only the moved value (key binding)
    plain.close()


def test_the_secret_is_taken_from_the_flag_and_never_shown(tiny_config_path):
    from hicache.server.cli import build_parser
    from hicache.server.config import ServerConfig
    from hicache.server.flags import config_from_args
    from hicache.server.native_api import get_server_info

    args = build_parser().parse_args(["serve", "--hicache-storage-secret", SECRET])
    cc = config_from_args(HiCacheConfig, args)
    assert cc.hicache_storage_secret == SECRET and SECRET not in repr(cc)
    with pytest.raises(ValueError, match="hicache_storage_secret") as e:
        HiCacheConfig(hicache_storage_backend_extra_config={"secret": SECRET})
    assert SECRET not in str(e.value)

    from hicache.server.cli import serve_configs

    assert serve_configs(build_parser().parse_args(["serve"]))[2].hicache_storage_secret is None
    assert serve_configs(build_parser().parse_args(["serve", "--hicache-storage-secret", SECRET]))[2] == cc
    with pytest.raises(ValueError, match="at least 16 bytes"):
        l3_scheduler(tiny_config_path, backend="memory", secret="short")

    sched = l3_scheduler(tiny_config_path, backend="memory", secret=SECRET)
    stats = sched.stats()

    async def control(_):
        return SimpleNamespace(ok=True, data=stats)

    tm = SimpleNamespace(runtime_config=RuntimeConfig(model_path=str(tiny_config_path)), cache_config=cc,
                         info=SimpleNamespace(context_length=1, pid=1), kv_capacity=1, num_open_requests=0, replicas=[],
                         control=control, stats=lambda: stats, redact=lambda value: value)  # no help from redact()
    app = SimpleNamespace(state=SimpleNamespace(tm=tm, config=ServerConfig(), model_names=["m"]), version="0")
    info = asyncio.run(get_server_info(SimpleNamespace(app=app)))
    assert info["hicache_storage_secret"] == "***"
    shown = json.dumps(info, default=str)
    assert SECRET not in shown and SECRET.encode().hex() not in shown
    sched.close()
