"""The wire between the HTTP process and the scheduler process: typed messages as msgpack.

One ZMQ frame carries a list of messages, each `[type_name, fields]`. `fields` is
`msg.to_wire()` where the type defines it (`GenerateRequest`: its `SamplingParams` nested as
a dict), else `dataclasses.asdict(msg)`; decoding rebuilds the dataclass with
`Cls.from_wire(fields)`, else `Cls(**fields)`. Only the types registered below cross the
socket, and never as pickle.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgpack

from hicache.runtime.messages import AbortRequest, GenerateRequest, TokenOutput


@dataclass
class ControlRequest:
    """HTTP process -> scheduler: `kind` is "flush_cache", "stats" or "shutdown"."""

    id: str
    kind: str


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


MESSAGE_TYPES: dict[str, type] = {
    cls.__name__: cls
    for cls in (GenerateRequest, AbortRequest, TokenOutput, ControlRequest, ControlReply,
                SchedulerReady, SchedulerFailed)
}


def pack(msgs: list) -> bytes:
    """Encode dataclass messages of the registered types into one frame."""
    items = []
    for m in msgs:
        name = type(m).__name__
        if MESSAGE_TYPES.get(name) is not type(m):
            raise TypeError(f"{name} is not a registered IPC message type")
        items.append([name, m.to_wire() if hasattr(m, "to_wire") else dataclasses.asdict(m)])
    return msgpack.packb(items, use_bin_type=True, default=_builtin)


def _builtin(obj: Any) -> Any:
    """numpy / torch scalars and arrays (e.g. in stats) become Python numbers and lists."""
    for attr in ("tolist", "item"):
        fn = getattr(obj, attr, None)
        if callable(fn):
            return fn()
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    raise TypeError(f"cannot send {type(obj).__name__} over IPC")


def unpack(frame: bytes) -> list:
    """Decode one frame back into dataclass instances. Raises ValueError on anything unknown."""
    items = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    if not isinstance(items, list):
        raise ValueError("IPC frame must hold a list of messages")
    out = []
    for item in items:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[1], dict)):
            raise ValueError(f"malformed IPC message {item!r:.80}")
        cls = MESSAGE_TYPES.get(item[0])
        if cls is None:
            raise ValueError(f"unknown IPC message type {item[0]!r}")
        out.append(_rebuild(cls, item[1]))
    return out


def _rebuild(cls: type, fields: dict) -> Any:
    try:
        return cls.from_wire(fields) if hasattr(cls, "from_wire") else cls(**fields)
    except (TypeError, AttributeError) as e:
        raise ValueError(f"malformed {cls.__name__}: {e}") from None


@dataclass(frozen=True)
class IpcPaths:
    """Two one-way ipc:// endpoints: requests to the scheduler, outputs from it."""

    to_scheduler: str
    from_scheduler: str

    @classmethod
    def fresh(cls) -> IpcPaths:
        base = os.path.join(tempfile.gettempdir(), f"hicache-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        return cls(f"ipc://{base}-in", f"ipc://{base}-out")

    def cleanup(self) -> None:
        for addr in (self.to_scheduler, self.from_scheduler):
            try:
                os.unlink(addr[len("ipc://"):])
            except OSError:
                pass
