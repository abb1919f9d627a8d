"""L3 storage: backend bandwidth, and a multi-turn workload that only L3 can hold.

    .venv/bin/python benchmarks/storage.py [--batches 4] [--skip-redis] [--mooncake] [--skip-multi-turn]
        [--conversations 16] [--turns 4] [--policy timeout] [--shape smollm2|llama-8b] [--batch-pages 128]
        [--l3-shards 1 4 8] [--host-layout page_first|layer_first] [--busy-python] [--floor-mib 1024]

1. Bandwidth: the I/O worker (`tiers/remote/worker.py`, the path the engine uses: framing, checksum,
   backend) writes and reads batches of 128 pages of the default model's shape (SmolLM2-135M,
   fp32: 30 layers x 3 KV heads x 64, page 64 tokens = 2.9 MB) from and into a host pool, for
   LMDB (a fresh environment in a temp folder, so reads come from the page cache) and Redis (a
   redis-server started here on a free port) and, with `--mooncake`, Mooncake Store (a master
   started here on free ports; writer and reader are two clients, each mounting
   `--mooncake-segment-mb`, so reads cross between them over TCP). GB/s = page bytes moved / wall
   time of the batch. `--shape llama-8b`: Llama-3.1-8B's page instead (32 layers x 8 KV heads x
   128, bf16, page 64 tokens = 8 MiB), into pinned host pools where CUDA is present, as on a GPU
   server. `--l3-shards 1 4 8`: one LMDB run per shard count (default: the backend's default).
   `--host-layout layer_first`: host pools of the layer-first layout (a page is one block per
   layer and K/V), as a GPU server's L2 by default. `--busy-python`: a thread runs pure Python
   meanwhile, as the scheduler thread does between its steps, so that the storage threads wait
   for the GIL after every call that released it. First, the floor under LMDB's writes (its commit
   writes each page through the page cache): the host's rate of writing `--floor-mib` MiB with
   `pwrite` into new pages of a file in the LMDB folder's file system, again into the pages that
   file freed, then over the cached pages. On a VM that hands freed memory back to its host, new
   pages cost a host fault each: the first rate is far below the others.
2. Multi-turn: C conversations share a system prompt; each turn appends a user message (`--turn`
   tokens of source code) and a greedy answer; each turn of every conversation is submitted at
   once. L1 holds about two final-length conversations and L2 (`hicache_ratio` 2, the default)
   holds L1's pages and as much again, so older conversations fall out of both; LMDB holds
   everything. The same
   workload runs without L3 (`hicache_storage_backend none`) and with it, in one process, and prints
   throughput, TTFT p50 and the ratios. Both parts append a JSON line to results/storage.jsonl.
"""
from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
PAGE = 64
BATCH = 128
BENCH_NS = "be0c4000000000ff"  # the namespace id (hex) of the bandwidth runs
SHAPES = {"smollm2": (30, 3, 64, torch.float32), "llama-8b": (32, 8, 128, torch.bfloat16)}  # layers, KV heads, dim


# ---- 1. bandwidth ------------------------------------------------------------------------------


class Spinner:
    """A thread running pure Python (as the scheduler thread does between its steps), counting its
    loops: `share(start, seconds)` is its rate over a span against its rate alone."""

    def __init__(self):
        self.loops, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._spin, daemon=True)
        self._thread.start()
        t0, n0 = time.perf_counter(), self.loops
        time.sleep(0.5)
        self.alone = (self.loops - n0) / (time.perf_counter() - t0)

    def _spin(self) -> None:
        while not self._stop.is_set():
            sum(range(100))
            self.loops += 1

    def share(self, loops_before: int, seconds: float) -> float:
        return (self.loops - loops_before) / seconds / self.alone

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def default_shards() -> int:
    from hicache.tiers.remote.lmdb import DEFAULT_SHARDS

    return DEFAULT_SHARDS


def page_cache_floor(folder: str, mib: int) -> dict:
    """GB/s of `pwrite` into a new file (`new`), a new file again (`new_again`: the pages the first
    freed) and over the cached file (`overwrite`), 4 MiB at a time."""
    block, path, out = os.urandom(4 << 20), Path(folder) / "floor.bin", {}
    blocks = max(mib // 4, 1)
    for name in ("new", "new_again", "overwrite"):
        if name != "overwrite":
            path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        start = time.perf_counter()
        for i in range(blocks):
            os.pwrite(fd, block, i * len(block))
        out[name] = blocks * len(block) / (time.perf_counter() - start) / 1e9
        os.close(fd)
    path.unlink()
    return out


def storage_engine(io: str, backend_name: str, backend_options: dict, pool, batch_pages: int):
    """The engine's L3 I/O over `pool`: `StorageProcess` (io "process") or `StorageWorker`."""
    from hicache.tiers.remote import make_backend
    from hicache.tiers.remote.process import StorageProcess
    from hicache.tiers.remote.worker import StorageWorker

    if io == "process":
        return StorageProcess(backend_name, BENCH_NS, None, backend_options, pool, batch_pages)
    return StorageWorker(make_backend(backend_name, BENCH_NS, **backend_options), pool, batch_pages)


def bandwidth(backend_name: str, backend_options: dict, batches: int, shape: str = "smollm2",
              batch_pages: int = BATCH, layout: str = "page_first", busy: bool = False, io: str = "process") -> dict:
    from hicache.pagekey import namespace_seed, page_keys
    from hicache.tiers.host.pool import HostKVPool

    layers, heads, dim, dtype = SHAPES[shape]
    tokens = batch_pages * PAGE
    pin = torch.cuda.is_available()
    src = HostKVPool(tokens, PAGE, layers, heads, dim, dtype, layout, pin=pin, shared=io == "process")
    dst = HostKVPool(tokens, PAGE, layers, heads, dim, dtype, layout, pin=pin, shared=io == "process")
    src.buffer.view(torch.uint8).copy_(torch.randint(0, 256, src.buffer.view(torch.uint8).shape, dtype=torch.uint8))
    dst.buffer.zero_()
    page_bytes = src.bytes_per_token() * PAGE
    worker = storage_engine(io, backend_name, backend_options, src, batch_pages)
    reader = storage_engine(io, backend_name, backend_options, dst, batch_pages)
    slots = src.allocator.alloc(tokens)
    into = dst.allocator.alloc(tokens)
    spinner = Spinner() if busy else None
    write_s, read_s, write_share, read_share = [], [], [], []
    for b in range(batches):
        keys = page_keys(namespace_seed("bench", b, time.time()), list(range(tokens)), PAGE)
        for op, engine, at, times, shares in ((worker.backup, worker, slots, write_s, write_share),
                                              (reader.fetch, reader, into, read_s, read_share)):
            loops = spinner.loops if spinner else 0
            times.append(_timed(engine, op, keys, at))
            if spinner:
                shares.append(spinner.share(loops, times[-1]))
        assert torch.equal(dst.buffer.view(torch.uint8), src.buffer.view(torch.uint8)), "read back different bytes"
        dst.buffer.zero_()
    if spinner:
        spinner.stop()
    shards = backend_options.get("shards", default_shards()) if backend_name == "lmdb" else 0
    worker.close()
    reader.close()
    src.close()
    dst.close()
    nbytes = batch_pages * page_bytes
    return {"backend": backend_name, "label": backend_name + (f" x{shards}" if shards else ""), "shards": shards,
            "shape": shape, "page_bytes": page_bytes, "batch_pages": batch_pages, "layout": layout, "busy": busy,
            "io": io, "batches": batches, "pinned": pin, "write_s": write_s, "read_s": read_s,
            "write_gbps": nbytes / statistics.median(write_s) / 1e9,
            "read_gbps": nbytes / statistics.median(read_s) / 1e9,
            "busy_share_write": statistics.median(write_share) if busy else None,
            "busy_share_read": statistics.median(read_share) if busy else None}


def mooncake_bandwidth(args) -> dict:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from mooncake_proc import MooncakeMaster  # the tests' launcher of a local master

    with tempfile.TemporaryDirectory(prefix="hicache-bench-mooncake-") as folder:
        master = MooncakeMaster(Path(folder))
        master.start()
        try:
            layers, heads, dim, dtype = SHAPES[args.shape]
            batch_mb = args.batch_pages * 2 * layers * heads * dim * PAGE * dtype.itemsize >> 20
            options = {**master.options, "global_segment_mb": args.mooncake_segment_mb,
                       "local_buffer_mb": max(1024, 2 * batch_mb)}  # a batch's reads land in this buffer
            return bandwidth("mooncake", options, args.batches, args.shape, args.batch_pages)
        finally:
            master.stop()


def _timed(worker, op, keys, slots) -> float:
    t0 = time.perf_counter()
    op(keys, slots)
    while True:
        worker.wait(1.0)
        done = worker.poll()
        if done:
            assert done[0].ok and done[0].pages == len(keys), done
            return time.perf_counter() - t0


def start_redis() -> tuple[subprocess.Popen, str]:
    import socket

    import redis

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(100):
        try:
            redis.Redis.from_url(url).ping()
            return proc, url
        except redis.ConnectionError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


# ---- 2. multi-turn -------------------------------------------------------------------------------


def workload(tokenizer, args) -> tuple[list[int], list[list[list[int]]]]:
    text = "\n\n".join(inspect.getsource(m) for m in (json.decoder, threading, inspect, argparse, asyncio.tasks))
    ids = tokenizer(text)["input_ids"]
    need = args.system + args.conversations * args.turns * args.turn
    assert len(ids) >= need, f"corpus of {len(ids)} tokens < {need}"
    at = iter(range(args.system, need, args.turn))
    turns = [[ids[p:p + args.turn] for p in (next(at) for _ in range(args.turns))] for _ in range(args.conversations)]
    return ids[:args.system], turns


async def _one(engine, ids: list[int], params: dict) -> tuple[float, dict]:
    t0, ttft, last = time.perf_counter(), None, None
    async for chunk in engine.async_generate(input_ids=ids, sampling_params=params):
        if ttft is None and chunk["output_ids"]:
            ttft = time.perf_counter() - t0
        last = chunk
    return ttft, last


def converse(engine, system, turns, args) -> dict:
    params = {"temperature": 0, "max_new_tokens": args.new, "ignore_eos": True}
    answers = [[] for _ in turns]
    ttfts, tokens, cached = [], 0, {"device": 0, "host": 0, "storage": 0}
    prompt_tokens = 0
    t0 = time.perf_counter()
    for t in range(args.turns):
        prompts = []
        for c, conv in enumerate(turns):
            ids = list(system)
            for j in range(t):
                ids += conv[j] + answers[c][j]
            prompts.append(ids + conv[t])

        async def turn():
            return await asyncio.gather(*(_one(engine, p, params) for p in prompts))

        for c, (ttft, last) in enumerate(asyncio.run(turn())):
            answers[c].append(last["output_ids"])
            ttfts.append(ttft)
            meta = last["meta_info"]
            tokens += meta["prompt_tokens"] + meta["completion_tokens"]
            prompt_tokens += meta["prompt_tokens"]
            for tier, n in meta["cached_tokens_details"].items():
                cached[tier] += n
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "tokens_per_s": tokens / seconds, "ttft_p50_s": statistics.median(ttfts),
            "prompt_tokens": prompt_tokens, "cached": cached, "answers": answers}


def multi_turn(args) -> dict:
    from hicache import Engine

    out, answers = {}, {}
    for name in ("none", "lmdb"):
        folder = tempfile.mkdtemp(prefix="hicache-bench-l3-")
        extra = {"path": folder} if name == "lmdb" else None
        engine = Engine(max_total_tokens=args.l1_tokens, page_size=PAGE, hicache_storage_backend=name,
                        hicache_storage_backend_extra_config=extra, hicache_storage_prefetch_policy=args.policy)
        system, turns = workload(engine.tokenizer, args)
        res = converse(engine, system, turns, args)
        res["storage"] = engine.get_stats()["tiers"]["storage"]
        engine.shutdown()
        shutil.rmtree(folder, ignore_errors=True)
        answers[name] = res.pop("answers")
        out[name] = res
        print(f"  L3 {name:5s}: {res['seconds']:.1f} s, {res['tokens_per_s']:.1f} tok/s, "
              f"TTFT p50 {res['ttft_p50_s'] * 1e3:.0f} ms, cached {res['cached']} of {res['prompt_tokens']}")
    assert answers["none"] == answers["lmdb"], "L3 changed a greedy answer"
    out["throughput_ratio"] = out["lmdb"]["tokens_per_s"] / out["none"]["tokens_per_s"]
    out["ttft_p50_ratio"] = out["none"]["ttft_p50_s"] / out["lmdb"]["ttft_p50_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--skip-redis", action="store_true")
    ap.add_argument("--skip-multi-turn", action="store_true")
    ap.add_argument("--mooncake", action="store_true", help="also Mooncake Store (needs mooncake-transfer-engine)")
    ap.add_argument("--mooncake-segment-mb", type=int, default=4096, help="memory each Mooncake client mounts")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system", type=int, default=64)
    ap.add_argument("--turn", type=int, default=128)
    ap.add_argument("--new", type=int, default=8)
    ap.add_argument("--l1-tokens", type=int, default=1536)
    ap.add_argument("--policy", default="timeout", help="hicache_storage_prefetch_policy of the L3 run")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2", help="the page of the bandwidth runs")
    ap.add_argument("--batch-pages", type=int, default=BATCH)
    ap.add_argument("--lmdb-dir", default=None, help="folder for the bandwidth run's LMDB (default: a temp folder)")
    ap.add_argument("--host-layout", choices=["page_first", "layer_first"], default="page_first")
    ap.add_argument("--busy-python", action="store_true",
                    help="a thread runs pure Python during the bandwidth runs (as the scheduler thread does)")
    ap.add_argument("--io", choices=["process", "threads"], default="process",
                    help="where the L3 I/O runs: a storage process (the server's default) or threads of this one")
    ap.add_argument("--l3-shards", type=int, nargs="+", default=[None],
                    help="LMDB shard counts to measure, one run each (default: the backend's default)")
    ap.add_argument("--floor-mib", type=int, default=1024, help="MiB written by the page-cache floor (0: skip it)")
    args = ap.parse_args()
    record = {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "bandwidth": []}
    if args.floor_mib:
        with tempfile.TemporaryDirectory(prefix="hicache-bench-floor-", dir=args.lmdb_dir) as folder:
            record["page_cache_floor_gbps"] = floor = page_cache_floor(folder, args.floor_mib)
        print("page cache floor (pwrite GB/s): " + ", ".join(f"{k} {v:.2f}" for k, v in floor.items()))
    for shards in args.l3_shards:
        with tempfile.TemporaryDirectory(prefix="hicache-bench-lmdb-", dir=args.lmdb_dir) as folder:
            options = {"path": folder} if shards is None else {"path": folder, "shards": shards}
            record["bandwidth"].append(bandwidth("lmdb", options, args.batches, args.shape, args.batch_pages,
                                                 args.host_layout, args.busy_python, args.io))
    if not args.skip_redis:
        proc, url = start_redis()
        try:
            record["bandwidth"].append(bandwidth("redis", {"url": url, "socket_timeout": 60.0}, args.batches,
                                                 args.shape, args.batch_pages, io=args.io))
        finally:
            proc.kill()
            proc.wait()
    if args.mooncake:
        record["bandwidth"].append(mooncake_bandwidth(args))
    for b in record["bandwidth"]:
        busy = "" if b["busy_share_write"] is None else (
            f"; the Python thread beside them ran at {b['busy_share_write']:.2f}x / {b['busy_share_read']:.2f}x "
            "of its rate alone")
        print(f"{b['label']:10s} write {b['write_gbps']:.2f} GB/s, read {b['read_gbps']:.2f} GB/s "
              f"({b['batch_pages']} pages of {b['page_bytes'] / 2**20:.2f} MiB a batch, {b['io']}){busy}")
    if not args.skip_multi_turn:
        record["multi_turn"] = multi_turn(args)
        mt = record["multi_turn"]
        print(f"multi-turn with L3 vs without: throughput {mt['throughput_ratio']:.2f}x, "
              f"TTFT p50 {mt['ttft_p50_ratio']:.2f}x better")
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "storage.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
