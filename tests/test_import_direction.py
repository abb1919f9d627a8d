"""Imports flow one way between the rooms (docs/design.md). Walks every module's imports (AST)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOMS = {  # folder -> import-name prefix
    "hicache": "hicache", "runtime": "hicache.runtime", "tiers": "hicache.tiers",
    "kernels": "hicache.kernels", "server": "hicache.server", "lang": "hicache.lang",
}
ALLOWED = {  # room -> rooms of ours it may import (besides itself)
    "hicache": {"hicache.tiers.base"},
    "hicache.tiers.base": set(),
    "hicache.tiers.gpu": {"hicache.tiers.base", "hicache.kernels"},
    "hicache.tiers.host": {"hicache.tiers.base", "hicache.kernels"},
    "hicache.tiers.remote": {"hicache.tiers.base", "hicache.kernels.cpu_io", "hicache.tiers.host.pool"},
    "hicache.kernels": set(),
    "hicache.runtime": {"hicache", "hicache.tiers", "hicache.kernels"},
    "hicache.server": {"hicache.runtime", "hicache"},
    "hicache.lang": {"hicache.runtime.engine"},  # the Engine; the server only over HTTP
}
LAZY_REEXPORTS = {"hicache.runtime.engine"}  # hicache/__init__.py's lazy `Engine`


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    parts[0] = ROOMS[parts[0]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def room_of(mod: str) -> str:
    for room in sorted(ALLOWED, key=len, reverse=True):
        if mod == room or mod.startswith(room + "."):
            return room
    raise AssertionError(f"{mod} is in no room")


def imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "import_module":
            if node.args and isinstance(node.args[0], ast.Constant):
                names.add(node.args[0].value)
    return {n for n in names if n == "hicache" or n.startswith("hicache.")}


def allowed(src_room: str, target: str) -> bool:
    if room_of(target) == src_room:
        return True
    for ok in ALLOWED[src_room]:
        if ok == "hicache":
            if room_of(target) == "hicache":
                return True
        elif target == ok or target.startswith(ok + "."):
            return True
    return False


def test_imports_flow_one_way():
    bad = []
    for folder in ROOMS:
        for path in (ROOT / folder).rglob("*.py"):
            mod = module_name(path)
            src = room_of(mod)
            for target in imported(path) - LAZY_REEXPORTS:
                if not allowed(src, target):
                    bad.append(f"{mod} imports {target}")
    assert not bad, "import direction broken:\n" + "\n".join(sorted(bad))


def test_checker_catches_a_bad_import():
    assert not allowed("hicache", "hicache.runtime.engine")
    assert not allowed("hicache.tiers.remote", "hicache.kernels.attention")
    assert allowed("hicache.tiers.remote", "hicache.kernels.cpu_io")
    assert allowed("hicache.runtime", "hicache.tree")
    assert allowed("hicache.tiers.gpu", "hicache.kernels.attention")
    assert not allowed("hicache.lang", "hicache.runtime.scheduler")
    assert not allowed("hicache.lang", "hicache.server.tokenizer_manager")


SCHEDULING = (*sorted(str(p.relative_to(ROOT)) for p in (ROOT / "runtime/scheduler").glob("*.py")), "runtime/policy.py")
CACHE_SURFACE = {"hicache.manager"}  # what the scheduling modules may import from the cache room
CACHE_INTERNALS = (".host", ".controller", ".tree", ".allocator", ".req_table", ".storage", ".windows", ".decider",
                   ".transfer")


def cache_imports(path: Path) -> set[str]:
    return {n for n in imported(path) if room_of(n) in ("hicache", "hicache.tiers.base")
            or n.startswith("hicache.tiers")}


def test_scheduler_reaches_the_cache_through_the_manager_only():
    """The scheduler, its overlap loop and its policy import nothing of the cache room but the
    manager, and touch none of the manager's parts (host transfers, tree, allocator, table, L3, window policy)."""
    for rel in SCHEDULING:
        path = ROOT / rel
        assert cache_imports(path) <= CACHE_SURFACE, f"{rel} imports {cache_imports(path) - CACHE_SURFACE}"
        reached = [f"{rel}:{node.lineno} .{node.attr}" for node in ast.walk(ast.parse(path.read_text()))
                   if isinstance(node, ast.Attribute) and "." + node.attr in CACHE_INTERNALS]
        assert not reached, "the scheduler reaches past the cache manager:\n" + "\n".join(reached)


def test_surface_checker_catches_a_reach():
    source = "from hicache.tree import RadixTree\nx = sched.cache.host.transfer\n"
    tree = ast.parse(source)
    assert any(isinstance(n, ast.Attribute) and "." + n.attr in CACHE_INTERNALS for n in ast.walk(tree))
    assert room_of("hicache.tree") == "hicache" and "hicache.tree" not in CACHE_SURFACE
