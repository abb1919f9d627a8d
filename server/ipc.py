"""The wire between the HTTP process and the scheduler process: typed messages as msgpack, over
two ZMQ ipc sockets that only those two processes can use.

One ZMQ frame carries a list of messages, each `[type_name, fields]`. `fields` is
`msg.to_wire()` where the type defines it (`GenerateRequest`: its `SamplingParams` nested as
a dict), else the dataclass's fields; decoding rebuilds the dataclass with
`Cls.from_wire(fields)`, else `Cls(**fields)`. Only the types registered below cross the
socket, and never as pickle.

Nothing that arrives is trusted:
- The sockets live in a private directory (`tempfile.mkdtemp`: mode 0700, a name never used
  before) that the HTTP process removes when it exits; a scheduler whose HTTP process was killed
  removes it, and the next launch removes those left by servers that are gone (`IpcPaths`).
- Processes of the same user can still reach that directory, so both sockets speak CURVE: the HTTP
  process binds them as CURVE server with a key pair made at launch, and its ZAP handler admits
  one client key, that of the scheduler process it started (`PeerGuard`). The scheduler gets its
  keys as spawn arguments (never through a file or the environment) and checks the server's key.
  A peer without the keys fails the handshake: it is sent no frame and none of its frames is read.
  Failed handshakes are counted and logged.
- Every decoded message is checked against its dataclass's field types (`rid` a str, token ids
  ints, ...; `ipc_checks`); `unpack` raises ValueError for a frame that fails, and the loops drop it and go on.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import os
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import msgpack
import zmq
from hicache.runtime.messages import AbortRequest, GenerateRequest, TokenOutput
from hicache.server.ipc_checks import check_fields

logger = logging.getLogger("hicache.ipc")


@dataclass
class ControlRequest:
    """HTTP process -> scheduler: `kind` is "flush_cache", "stats", "start_profile" (`args`: a
    `runtime.profiler.ProfileSpec`'s fields), "stop_profile", "load_lora_adapter" (`args`:
    lora_name, lora_path), "unload_lora_adapter" (lora_name) or "shutdown"."""

    id: str
    kind: str
    args: dict = field(default_factory=dict)


@dataclass
class ControlReply:
    id: str
    ok: bool
    data: Any = None
    error: str | None = None


@dataclass
class SchedulerReady:
    """Scheduler -> HTTP process, once, after the model is loaded."""

    model_name: str
    context_length: int
    vocab_size: int
    eos_token_ids: list[int] = field(default_factory=list)
    pid: int = 0


@dataclass
class SchedulerFailed:
    """Scheduler -> HTTP process, when loading or the loop raised; the process then exits."""

    error: str


@dataclass
class StatsSnapshot:
    """Scheduler -> HTTP process: `Scheduler.stats()`, published periodically and with every
    output frame in which a request finished. `taken` is the scheduler's `time.monotonic()`."""

    data: dict
    taken: float


MESSAGE_TYPES: dict[str, type] = {
    cls.__name__: cls
    for cls in (GenerateRequest, AbortRequest, TokenOutput, ControlRequest, ControlReply,
                SchedulerReady, SchedulerFailed, StatsSnapshot)
}


# ---- codec ------------------------------------------------------------------------------------


def pack(msgs: list) -> bytes:
    """Encode dataclass messages of the registered types into one frame."""
    items = []
    for m in msgs:
        name = type(m).__name__
        if MESSAGE_TYPES.get(name) is not type(m):
            raise TypeError(f"{name} is not a registered IPC message type")
        items.append([name, m.to_wire() if hasattr(m, "to_wire") else _shallow_fields(m)])
    return msgpack.packb(items, use_bin_type=True, default=_builtin)


def _shallow_fields(m) -> dict:
    """The fields as they are: msgpack walks nested lists and dicts itself (`asdict` would copy them)."""
    return {f.name: getattr(m, f.name) for f in dataclasses.fields(m)}


def _builtin(obj: Any) -> Any:
    """numpy / torch scalars and arrays (e.g. in stats) become Python numbers and lists."""
    for attr in ("tolist", "item"):
        fn = getattr(obj, attr, None)
        if callable(fn):
            return fn()
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    raise TypeError(f"cannot send {type(obj).__name__} over IPC")


def unpack(frame: bytes) -> list:
    """Decode one frame back into checked dataclass instances. Raises ValueError for anything
    unknown or malformed (the whole frame is refused)."""
    try:
        items = msgpack.unpackb(frame, raw=False, strict_map_key=False, ext_hook=_no_ext)
    except Exception as e:  # msgpack raises several kinds for garbage
        raise ValueError(f"undecodable IPC frame: {type(e).__name__}: {e}") from None
    if not isinstance(items, list):
        raise ValueError("IPC frame must hold a list of messages")
    out = []
    for item in items:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[1], dict)):
            raise ValueError(f"malformed IPC message {item!r:.80}")
        cls = MESSAGE_TYPES.get(item[0]) if isinstance(item[0], str) else None
        if cls is None:
            raise ValueError(f"unknown IPC message type {item[0]!r:.80}")
        out.append(_rebuild(cls, item[1]))
    return out


def _no_ext(code: int, _data: bytes):
    raise ValueError(f"msgpack extension type {code} is not accepted")


def _rebuild(cls: type, fields: dict) -> Any:
    try:
        msg = cls.from_wire(fields) if hasattr(cls, "from_wire") else cls(**fields)
    except (TypeError, AttributeError, ValueError) as e:
        raise ValueError(f"malformed {cls.__name__}: {e}") from None
    check_fields(msg)
    return msg


# ---- the socket directory -----------------------------------------------------------------------

DIR_PREFIX = "hicache-ipc-"
_MAX_IPC_PATH = 100  # sockaddr_un holds 108 bytes with the terminating NUL; leave some room


@dataclass(frozen=True)
class IpcPaths:
    """Two one-way ipc:// endpoints in a private directory: requests to the scheduler, outputs from it."""

    directory: str
    to_scheduler: str
    from_scheduler: str

    @classmethod
    def fresh(cls) -> IpcPaths:
        """A new directory, mode 0700, named after this process (`hicache-ipc-<pid>-<random>`); first
        removes those of servers that are gone."""
        sweep_stale_dirs()
        directory = tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-")
        if len(os.path.join(directory, "out")) > _MAX_IPC_PATH:
            shutil.rmtree(directory, ignore_errors=True)
            directory = tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-", dir="/tmp")  # TMPDIR too long
        return cls(directory, f"ipc://{directory}/in", f"ipc://{directory}/out")

    def cleanup(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def sweep_stale_dirs(base: str | None = None) -> list[str]:
    """Remove socket directories that servers killed before they could clean up left behind: ours
    (same owner), named `hicache-ipc-<pid>-...`, whose pid no longer runs and whose request socket
    accepts no connection (a server in another pid namespace sharing /tmp keeps its directory).
    Returns what it removed."""
    base = base or tempfile.gettempdir()
    removed = []
    try:
        entries = list(os.scandir(base))
    except OSError:
        return removed
    for entry in entries:
        pid = _owner_pid(entry)
        if pid is not None and not _pid_running(pid) and not _listening(os.path.join(entry.path, "in")):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


def _owner_pid(entry: os.DirEntry) -> int | None:
    if not entry.name.startswith(DIR_PREFIX):
        return None
    pid = entry.name[len(DIR_PREFIX):].split("-", 1)[0]
    try:
        st = entry.stat(follow_symlinks=False)
    except OSError:
        return None
    if not (pid.isdigit() and entry.is_dir(follow_symlinks=False) and st.st_uid == os.getuid()):
        return None
    return int(pid)


def _listening(path: str) -> bool:
    """Does a process accept connections on the unix socket `path`? (Unsure counts as yes.)"""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(path)
        except (ConnectionRefusedError, FileNotFoundError, NotADirectoryError):
            return False
        except OSError:
            return True
    return True


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---- CURVE --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SchedulerKeys:
    """What one scheduler process needs to connect (z85): the HTTP process's public key and its own
    key pair, made for that process only."""

    server_public: bytes
    public: bytes
    secret: bytes = field(repr=False)

    @classmethod
    def fresh(cls, server_public: bytes) -> SchedulerKeys:
        public, secret = zmq.curve_keypair()
        return cls(server_public, public, secret)


def require_curve() -> None:
    if not zmq.has("curve"):
        raise RuntimeError("this pyzmq / libzmq has no CURVE support (libsodium): the scheduler sockets cannot "
                           "be authenticated; install a pyzmq wheel (they bundle libsodium)")


def curve_client(sock: zmq.Socket, keys: SchedulerKeys) -> None:
    """Set before connect: the handshake fails unless the peer holds the server's secret key."""
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret


_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
REJECT_LOG_INTERVAL_S = 10.0


class PeerGuard:
    """The HTTP process's gate on the sockets it binds: CURVE server keys, a ZAP handler that admits
    only the current scheduler's key, and a monitor per socket that counts failed handshakes (logged
    at most every REJECT_LOG_INTERVAL_S). Runs on the event loop of the asyncio context `ctx`."""

    def __init__(self, ctx, on_reject: Callable[[], None] | None = None) -> None:
        from zmq.auth.asyncio import AsyncioAuthenticator

        require_curve()
        self.ctx = ctx
        self.public, self._secret = zmq.curve_keypair()
        self.allowed: bytes | None = None
        self.rejected = 0
        self.on_reject = on_reject
        self._auth = AsyncioAuthenticator(ctx, log=logging.getLogger("hicache.ipc.zap"))
        self._monitors: list[tuple[zmq.Socket, Any, asyncio.Task]] = []
        self._last_log = 0.0

    def start(self) -> None:
        self._auth.start()
        self._auth.configure_curve_callback("*", credentials_provider=self)

    def admit(self) -> SchedulerKeys:
        """Keys for a new scheduler process; from now on only its key is admitted."""
        keys = SchedulerKeys.fresh(self.public)
        self.allowed = keys.public
        return keys

    def callback(self, _domain: str, client_key: bytes) -> bool:
        """ZAP: is this the current scheduler's public key?"""
        return self.allowed is not None and hmac.compare_digest(client_key, self.allowed)

    def bind(self, sock: zmq.Socket, addr: str) -> None:
        sock.curve_server = True
        sock.curve_publickey = self.public
        sock.curve_secretkey = self._secret
        sock.bind(addr)
        monitor_addr = f"inproc://hicache-ipc-monitor-{id(sock)}"
        sock.monitor(monitor_addr, _HANDSHAKE_FAILED)
        mon = self.ctx.socket(zmq.PAIR)
        mon.connect(monitor_addr)
        self._monitors.append((sock, mon, asyncio.create_task(self._watch(mon, addr))))

    async def _watch(self, mon, addr: str) -> None:
        from zmq.utils.monitor import parse_monitor_message

        while True:
            event = parse_monitor_message(await mon.recv_multipart())
            self._reject(addr, event)

    def _reject(self, addr: str, event: dict) -> None:
        self.rejected += 1
        if self.on_reject is not None:
            self.on_reject()
        now = time.monotonic()
        if now - self._last_log >= REJECT_LOG_INTERVAL_S:
            self._last_log = now
            logger.warning("refused a peer on %s: %s; %d refused so far. Only the scheduler process this server "
                           "started holds the keys: another process is trying these sockets",
                           addr, _describe_event(event), self.rejected)

    def close(self) -> None:
        for sock, mon, task in self._monitors:
            task.cancel()
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass
            mon.close(0)
        self._monitors.clear()
        self._auth.stop()


def _describe_event(event: dict) -> str:
    kind, value = event.get("event"), event.get("value")
    if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"key not admitted (ZAP status {value})"
    try:
        return f"handshake failed ({zmq.Event(value).name})"
    except ValueError:
        return f"handshake failed ({value})"
