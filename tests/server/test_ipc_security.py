"""The scheduler sockets trust nothing.

- Codec: a frame whose messages do not have their fields' types (a list as `rid`, strings as token
  ids, a bool as a count, msgpack extension types, garbage) is refused whole with ValueError.
- Socket directory: private (0700), removed on exit (SIGTERM while loading too), and after a SIGKILL
  of the server by its scheduler; directories of dead servers are swept at the next launch.
- A process of the same user that connects to the sockets without the keys neither receives a
  request nor gets a token into a client's response; its handshakes are refused and counted.
- Malformed frames in both directions (an in-process tokenizer manager and a spawned scheduler
  process running a fake scheduler) are dropped and counted; both loops keep serving.
- A rid already in flight, or not a string, is a 400 naming `rid`.
"""
from __future__ import annotations

import asyncio
import glob
import json
import os
import signal
import socket
import stat
import subprocess
import threading
import time
from types import SimpleNamespace

import httpx
import msgpack
import pytest
import zmq

from hicache.runtime.messages import GenerateRequest, TokenOutput
from hicache.runtime.sampling import SamplingParams
from hicache.server.ipc import DIR_PREFIX, IpcPaths, pack, sweep_stale_dirs, unpack
from server_harness import LIGHT_FLAGS, pid_alive, start_server

GREEDY = {"temperature": 0, "max_new_tokens": 16}
PROMPT = "Write one sentence about the sea."


# ---- codec ----------------------------------------------------------------------------------------


def _frame(name: str, fields: dict) -> bytes:
    return msgpack.packb([[name, fields]], use_bin_type=True)


GOOD_REQ = GenerateRequest(rid="r1", input_ids=[1, 2, 3], sampling_params=SamplingParams(max_new_tokens=4)).to_wire()
GOOD_OUT = {"rid": "r1", "new_token_ids": [5], "finish_reason": None, "meta": {}, "logprobs": None, "error": None}

MALFORMED = {
    "rid is a list": _frame("GenerateRequest", {**GOOD_REQ, "rid": ["a", "b"]}),
    "rid is an int": _frame("AbortRequest", {"rid": 7}),
    "input id is a str": _frame("GenerateRequest", {**GOOD_REQ, "input_ids": [1, "2"]}),
    "input ids not a list": _frame("GenerateRequest", {**GOOD_REQ, "input_ids": "123"}),
    "sampling value wrong type": _frame("GenerateRequest", {**GOOD_REQ, "sampling_params": {
        **GOOD_REQ["sampling_params"], "temperature": "hot"}}),
    "stop not strings": _frame("GenerateRequest", {**GOOD_REQ, "sampling_params": {
        **GOOD_REQ["sampling_params"], "stop": [1]}}),
    "bool as count": _frame("GenerateRequest", {**GOOD_REQ, "top_logprobs_num": True}),
    "output rid is a list": _frame("TokenOutput", {**GOOD_OUT, "rid": ["r1"]}),
    "output id is a float": _frame("TokenOutput", {**GOOD_OUT, "new_token_ids": [1.5]}),
    "finish reason a str": _frame("TokenOutput", {**GOOD_OUT, "finish_reason": "stop"}),
    "control kind an int": _frame("ControlRequest", {"id": "c", "kind": 3}),
    "snapshot data a list": _frame("StatsSnapshot", {"data": [], "taken": 1.0}),
    "message type not a str": msgpack.packb([[["TokenOutput"], GOOD_OUT]]),
    "extension type": msgpack.packb([["TokenOutput", {**GOOD_OUT, "meta": {"x": msgpack.ExtType(1, b"z")}}]]),
    "garbage": b"\xc1\xff\x00garbage",
    "truncated": _frame("TokenOutput", GOOD_OUT)[:-3],
    "one bad message spoils the frame": msgpack.packb([["TokenOutput", GOOD_OUT], ["AbortRequest", {"rid": None}]]),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_frames_are_refused(name):
    with pytest.raises(ValueError):
        unpack(MALFORMED[name])


def test_well_formed_frames_still_decode():
    (req,) = unpack(_frame("GenerateRequest", GOOD_REQ))
    assert req.rid == "r1" and req.input_ids == [1, 2, 3] and req.sampling_params.max_new_tokens == 4
    logprobs = [[-0.1, [[5, -0.1]]]]
    (out,) = unpack(_frame("TokenOutput", {**GOOD_OUT, "meta": {"prompt_tokens": 3}, "logprobs": logprobs}))
    assert out.meta == {"prompt_tokens": 3}
    # ints where a float is declared are fine (JSON and msgpack keep 1 an int)
    (req,) = unpack(_frame("GenerateRequest", {**GOOD_REQ, "sampling_params": {
        **GOOD_REQ["sampling_params"], "temperature": 1}}))
    assert req.sampling_params.temperature == 1


# ---- socket directory --------------------------------------------------------------------------------


def test_socket_directory_is_private_and_new(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    a, b = IpcPaths.fresh(), IpcPaths.fresh()
    try:
        assert a.directory != b.directory
        for p in (a, b):
            st = os.stat(p.directory)
            assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
            assert p.to_scheduler == f"ipc://{p.directory}/in" and p.from_scheduler == f"ipc://{p.directory}/out"
    finally:
        a.cleanup()
        b.cleanup()
    assert not os.path.exists(a.directory) and not os.path.exists(b.directory)


def test_sweep_removes_only_directories_of_dead_servers(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f"{DIR_PREFIX}{dead.pid}-abc"
    live = tmp_path / f"{DIR_PREFIX}{os.getpid()}-abc"
    listening = tmp_path / f"{DIR_PREFIX}{dead.pid}-def"  # a server in another pid namespace, say
    other = tmp_path / "hicache-server-123.log"
    for d in (stale, live, listening):
        d.mkdir()
    for d in (stale, live):
        (d / "in").write_bytes(b"")
    other.write_text("log")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server_sock:
        server_sock.bind(str(listening / "in"))
        server_sock.listen()
        assert sweep_stale_dirs(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and live.exists() and listening.exists() and other.exists()


def socket_dirs(pid: int) -> list[str]:
    return glob.glob(f"/tmp/{DIR_PREFIX}{pid}-*")


@pytest.mark.model
def test_real_server_socket_directory_lifecycle():
    """0700 while serving; removed by the scheduler when the server is SIGKILLed; a stale one is swept."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"/tmp/{DIR_PREFIX}{dead.pid}-stale"
    os.makedirs(stale, mode=0o700, exist_ok=True)
    handle = start_server(*LIGHT_FLAGS)
    try:
        assert not os.path.exists(stale), "the stale directory of a dead server was not swept"
        (d,) = socket_dirs(handle.proc.pid)
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700 and sorted(os.listdir(d)) == ["in", "out"]
        os.kill(handle.proc.pid, signal.SIGKILL)
        handle.proc.wait(10)
        deadline = time.monotonic() + 15
        while (pid_alive(handle.scheduler_pid) or os.path.exists(d)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not pid_alive(handle.scheduler_pid) and not os.path.exists(d)
    finally:
        if handle.proc.poll() is None:
            handle.stop()


@pytest.mark.model
def test_sigterm_while_loading_removes_the_socket_directory():
    import sys

    from server_harness import free_port

    proc = subprocess.Popen([sys.executable, "-m", "hicache.server.cli", "serve", "--port", str(free_port()),
                             *LIGHT_FLAGS], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not socket_dirs(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert socket_dirs(proc.pid), "no socket directory appeared"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not socket_dirs(proc.pid)


# ---- an intruder on the real server's sockets ------------------------------------------------------


class Intruder:
    """Same user, no keys: pulls on the request socket, pushes forged outputs on the output socket,
    each with no security and with CURVE keys of its own."""

    def __init__(self, directory: str, rid: str) -> None:
        self.ctx = zmq.Context()
        self.pullers, self.pushers = [], []
        for curve in (False, True):
            pull = self._socket(zmq.PULL, curve)
            pull.connect(f"ipc://{directory}/in")
            push = self._socket(zmq.PUSH, curve)
            push.connect(f"ipc://{directory}/out")
            self.pullers.append(pull)
            self.pushers.append(push)
        forged = [TokenOutput(rid=rid, new_token_ids=[13, 13, 13], meta={"prompt_tokens": 1}),
                  TokenOutput(rid=rid, new_token_ids=[0], finish_reason={"type": "stop"}, error=None)]
        self.frames = [pack(forged), msgpack.packb([["TokenOutput", {**GOOD_OUT, "rid": ["x"]}]])]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._flood, daemon=True)

    def _socket(self, kind: int, curve: bool) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.linger = 0
        sock.sndhwm = 10
        if curve:
            sock.curve_serverkey = zmq.curve_keypair()[0]  # the server's key is not on disk: a guess
            sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        return sock

    def _flood(self) -> None:
        while not self.stop.is_set():
            for push in self.pushers:
                for frame in self.frames:
                    try:
                        push.send(frame, zmq.NOBLOCK)
                    except zmq.Again:
                        pass
            time.sleep(0.01)

    def stolen(self) -> list[bytes]:
        got = []
        for pull in self.pullers:
            while pull.poll(0):
                got.append(pull.recv())
        return got

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.ctx.destroy(0)


def stream_text(url: str, rid: str, sampling: dict = GREEDY, started: threading.Event | None = None,
                ) -> tuple[str, list[int]]:
    body = {"text": PROMPT, "rid": rid, "stream": True, "sampling_params": sampling}
    last = None
    with httpx.stream("POST", url + "/generate", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                last = json.loads(line[len("data: "):])
                if started is not None:
                    started.set()
    assert "error" not in last, last
    return last["text"], last["output_ids"]


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.mark.model
def test_intruder_without_keys_gets_no_request_and_injects_no_token(server):
    reference = stream_text(server.url, "reference-rid")
    (directory,) = socket_dirs(server.proc.pid)
    intruder = Intruder(directory, rid="victim-rid")
    intruder.thread.start()
    try:
        time.sleep(0.5)  # let its connections be refused a few times
        for i in range(3):
            assert stream_text(server.url, "victim-rid") == reference, i
        stolen = intruder.stolen()
    finally:
        intruder.close()
    assert stolen == [], "a process without the keys received requests"
    assert metric(server.url, "hicache_ipc_rejected_handshakes_total") > 0
    assert metric(server.url, "hicache_ipc_dropped_frames_total") == 0  # nothing it sent was even read
    assert "refused a peer on ipc://" in server.log.read_text()
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


# ---- rids at the edge ------------------------------------------------------------------------------


@pytest.mark.model
def test_duplicate_rid_in_flight_is_a_400_and_the_first_request_is_unaffected(server):
    long = {**GREEDY, "max_new_tokens": 96, "ignore_eos": True}
    reference = stream_text(server.url, "dup-reference", long)
    result, started = {}, threading.Event()
    t = threading.Thread(target=lambda: result.setdefault("first", stream_text(server.url, "dup-rid", long, started)))
    t.start()
    assert started.wait(60)
    dups = [httpx.post(server.url + "/generate", json={"text": "other", "rid": "dup-rid", **extra,
                                                       "sampling_params": GREEDY}, timeout=60)
            for extra in ({}, {"stream": True})]
    t.join(60)
    assert result["first"] == reference
    for r in dups:
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "rid" and err["code"] == "duplicate_rid" and "dup-rid" in err["message"], err
    assert stream_text(server.url, "dup-rid") == stream_text(server.url, "dup-reference")  # the rid is free again


@pytest.mark.model
@pytest.mark.parametrize("rid", [["a", "b"], 7, {"x": 1}])
def test_non_string_rid_is_a_400(server, rid):
    r = httpx.post(server.url + "/generate", json={"text": "hi", "rid": rid, "sampling_params": GREEDY}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "rid", r.text


# ---- malformed frames through both loops (a fake scheduler in a real scheduler process) -----------

POISON = 666  # a prompt starting with it makes the fake scheduler send malformed outputs first


class FakeScheduler:
    """Just enough of `Scheduler` for the scheduler process: one token per step, ids 100, 101, ...;
    a POISON prompt first gets two steps of malformed outputs (a list as rid, then a str as token id)."""

    model_name = "fake"
    context_length = 512
    model_config = SimpleNamespace(vocab_size=49152, eos_token_ids=[])

    def __init__(self) -> None:
        self.reqs: dict[str, list] = {}  # rid -> [request, tokens sent, malformed steps to come]
        self.pending: list[TokenOutput] = []

    def warm_up(self) -> None:
        pass

    def check_health(self) -> None:  # no ranks to lose
        pass

    def has_work(self) -> bool:
        return bool(self.reqs or self.pending)

    def add_request(self, req: GenerateRequest) -> None:
        self.reqs[req.rid] = [req, 0, 2 if req.input_ids[0] == POISON else 0]

    def abort(self, rid: str) -> None:
        if self.reqs.pop(rid, None) is not None:
            self.pending.append(TokenOutput(rid=rid, new_token_ids=[], finish_reason={"type": "abort"}))

    def step(self) -> list[TokenOutput]:
        outs, self.pending = self.pending, []
        for rid, entry in list(self.reqs.items()):
            req, done, poison = entry
            if poison:
                entry[2] -= 1
                return [TokenOutput(rid=[rid], new_token_ids=[1])] if poison == 2 else [
                    TokenOutput(rid=rid, new_token_ids=["x"])]
            last = done + 1 == req.sampling_params.max_new_tokens
            meta = {"prompt_tokens": len(req.input_ids), "completion_tokens": done + 1}
            outs.append(TokenOutput(rid=rid, new_token_ids=[100 + done],
                                    finish_reason={"type": "length"} if last else None, meta=meta))
            entry[1] = done + 1
            if last:
                del self.reqs[rid]
        return outs

    def stats(self) -> dict:
        return {"running": len(self.reqs), "queued": 0, "tiers": {"device": {"capacity_tokens": 4096}}}

    def flush_cache(self) -> bool:
        return True

    def close(self) -> None:
        pass


def make_fake_scheduler(_runtime_config, _cache_config) -> FakeScheduler:
    return FakeScheduler()


async def _run(tm, rid: str, ids: list[int], n: int = 5) -> list[int]:
    req = GenerateRequest(rid=rid, input_ids=ids, sampling_params=SamplingParams(max_new_tokens=n))
    out = []
    async for chunk in tm.generate(req):
        assert chunk.error is None, chunk.error
        out = chunk.output_ids
    return out


async def _exercise_loops() -> dict:
    from hicache.config import HiCacheConfig
    from hicache.runtime.config import RuntimeConfig
    from hicache.server.protocol import APIError
    from hicache.server.tokenizer_manager import TokenizerManager

    tm = TokenizerManager(RuntimeConfig(), HiCacheConfig(), factory="test_ipc_security:make_fake_scheduler",
                          warm_up=False)
    try:
        await tm.start(120)
        expected = [100, 101, 102, 103, 104]
        assert await _run(tm, "plain", [1, 2]) == expected
        # the scheduler sends a list as rid and a str as token id first: the API drops both frames
        assert await _run(tm, "poisoned", [POISON, 2]) == expected
        # the API sends the scheduler garbage, a list as rid, a str as token id
        for frame in (b"\xc1garbage", MALFORMED["rid is a list"], MALFORMED["input id is a str"]):
            tm.replicas[0]._send_sock.send(frame)
        assert await _run(tm, "after", [3]) == expected
        first = asyncio.create_task(_run(tm, "twin", [1], 20))
        await asyncio.sleep(0)  # it runs up to its first wait: registered and sent
        with pytest.raises(APIError) as dup:
            await _run(tm, "twin", [1])
        assert await first == list(range(100, 120))
        await asyncio.sleep(0.6)  # a periodic snapshot
        return {"api_dropped": tm.metrics.registry.get_sample_value("hicache_ipc_dropped_frames_total"),
                "stats": tm.stats(), "alive": tm.alive, "dup": dup.value}
    finally:
        await tm.shutdown()


def test_malformed_frames_in_both_directions_do_not_stop_the_loops():
    got = asyncio.run(_exercise_loops())
    assert got["alive"]
    assert got["api_dropped"] == 2
    assert got["stats"]["ipc_dropped_frames"] == 3
    assert got["dup"].status == 400 and got["dup"].param == "rid"
