"""The tier contract is declared: every method the cache brain (hicache/) calls on a tier object is
a member of its protocol in tiers/base.py, and the concrete tiers and the tensor-parallel
stand-ins implement every member of theirs (as methods of their own, not through `__getattr__`),
taking the protocol's parameters under the protocol's names."""
from __future__ import annotations

import ast
import inspect
import typing
from pathlib import Path

import pytest

from hicache.runtime.tp_fanout import JournaledReqTable, StorageFanout, TransferFanout
from hicache.tiers import base
from hicache.tiers.gpu.allocator import WindowedAllocator
from hicache.tiers.gpu.pool import DeviceKVPool
from hicache.tiers.gpu.req_table import ReqToTokenTable
from hicache.tiers.gpu.state import RecurrentStatePool
from hicache.tiers.host.pool import HostKVPool, LockedAllocator
from hicache.tiers.host.transfer import HostTransferEngine
from hicache.tiers.remote.lmdb import LmdbBackend
from hicache.tiers.remote.memory import MemoryBackend
from hicache.tiers.remote.mooncake import MooncakeBackend
from hicache.tiers.remote.process import StorageProcess
from hicache.tiers.remote.redis import RedisBackend
from hicache.tiers.remote.worker import StorageWorker

BRAIN = Path(__file__).resolve().parents[2] / "hicache"

# how the cache brain names the tier objects it holds (attributes, parameters, local aliases)
TIER_NAMES = {"transfer": base.TransferEngine, "engine": base.StorageEngine,
              "allocator": base.WindowedPageAllocator, "host_allocator": base.PageAllocator,
              "req_table": base.RequestTable, "host_pool": base.HostPool, "state_pool": base.StatePool}
PROTOCOLS = {name: getattr(base, name) for name in dir(base)
             if isinstance(getattr(base, name), type) and getattr(getattr(base, name), "_is_protocol", False)}

IMPLEMENTATIONS = [
    (base.TransferEngine, HostTransferEngine), (base.TransferEngine, TransferFanout),
    (base.StorageEngine, StorageWorker), (base.StorageEngine, StorageProcess), (base.StorageEngine, StorageFanout),
    (base.PageAllocator, base.PagedAllocator), (base.PageAllocator, LockedAllocator),
    (base.WindowedPageAllocator, WindowedAllocator),
    (base.RequestTable, ReqToTokenTable), (base.RequestTable, JournaledReqTable),
    (base.HostPool, HostKVPool), (base.DevicePool, DeviceKVPool), (base.StatePool, RecurrentStatePool),
    *((base.StorageBackend, b) for b in (LmdbBackend, MemoryBackend, RedisBackend, MooncakeBackend)),
]


def members(protocol: type) -> dict[str, object]:
    """A protocol's methods, its own and its protocol bases'."""
    out = {}
    for cls in reversed(protocol.__mro__):
        if cls in (object, typing.Protocol, typing.Generic) or not getattr(cls, "_is_protocol", False):
            continue
        out.update({k: v for k, v in vars(cls).items() if inspect.isfunction(v) and not k.startswith("_")})
    return out


def _tier_of(node: ast.AST, aliases: dict[str, type]) -> type | None:
    if isinstance(node, ast.Attribute) and node.attr in TIER_NAMES:
        return TIER_NAMES[node.attr]
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    return None


def _aliases(fn: ast.FunctionDef) -> dict[str, type]:
    """Names that stand for a tier object in `fn`: parameters annotated with a protocol or named as
    the brain names tiers, and locals assigned from a tier attribute."""
    out = {}
    for arg in fn.args.args + fn.args.kwonlyargs:
        note = ast.unparse(arg.annotation) if arg.annotation is not None else ""
        proto = next((p for name, p in PROTOCOLS.items() if name in note.split(" | ")), None)
        if proto is not None or arg.arg in TIER_NAMES:
            out[arg.arg] = proto or TIER_NAMES[arg.arg]
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            tier = _tier_of(node.value, {})
            if tier is not None:
                out[node.targets[0].id] = tier
    return out


def brain_calls() -> list[tuple[str, type, str, str]]:
    """(file:line, protocol, method, how) for every call the brain makes on a tier object; `how` is
    "call" or "getattr" (a probe for an optional method)."""
    found = []
    for path in sorted(BRAIN.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for fn in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            aliases = _aliases(fn)
            for node in ast.walk(fn):
                where = f"{path.relative_to(BRAIN.parent)}:{getattr(node, 'lineno', 0)}"
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                    tier = _tier_of(node.func.value, aliases)
                    if tier is not None:
                        found.append((where, tier, node.func.attr, "call"))
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                        and node.args and _tier_of(node.args[0], aliases) is not None):
                    found.append((where, _tier_of(node.args[0], aliases), ast.unparse(node.args[1]), "getattr"))
    return found


def test_the_brain_calls_only_declared_tier_methods():
    calls = brain_calls()
    assert {(p, m) for _, p, m, _ in calls} >= {(base.TransferEngine, "start_loads"), (base.TransferEngine, "wait_layer"),
                                                (base.TransferEngine, "ordered_after"), (base.StorageEngine, "fetch")}
    probes = [f"{w}: {how} {p.__name__}.{m}" for w, p, m, how in calls if how == "getattr"]
    assert not probes, "the brain probes tiers for optional methods:\n" + "\n".join(probes)
    undeclared = sorted({f"{w}: {p.__name__}.{m}" for w, p, m, _ in calls if m not in members(p)})
    assert not undeclared, "called on a tier but not declared in tiers/base.py:\n" + "\n".join(undeclared)


def test_the_checker_sees_an_undeclared_call_and_a_probe():
    source = ("def f(self, allocator: PageAllocator):\n    a = self.tree.allocator\n    a.defrag()\n"
              "    allocator.compact()\n    getattr(self.transfer, 'prefetch_layers', None)\n")
    fn = ast.parse(source).body[0]
    aliases = _aliases(fn)
    calls = [(_tier_of(n.func.value, aliases), n.func.attr) for n in ast.walk(fn)
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
    assert (base.WindowedPageAllocator, "defrag") in calls and (base.PageAllocator, "compact") in calls
    assert "defrag" not in members(base.WindowedPageAllocator) and "free_window" in members(base.WindowedPageAllocator)
    assert "alloc" in members(base.WindowedPageAllocator)  # inherited from PageAllocator


@pytest.mark.parametrize("protocol,cls", IMPLEMENTATIONS, ids=[f"{c.__name__}" for _, c in IMPLEMENTATIONS])
def test_tiers_and_stand_ins_implement_their_protocol(protocol, cls):
    assert "__getattr__" not in vars(cls), f"{cls.__name__} forwards unknown calls"
    for name, declared in members(protocol).items():
        impl = getattr(cls, name, None)
        assert callable(impl), f"{cls.__name__} lacks {protocol.__name__}.{name}"
        want = [p for p in inspect.signature(declared).parameters if p != "self"]
        got = [p for p in inspect.signature(impl).parameters if p != "self"]
        assert got[:len(want)] == want, f"{cls.__name__}.{name}{tuple(got)} does not take {tuple(want)}"
