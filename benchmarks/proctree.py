"""A server's process tree, read with psutil: its peak resident memory (`RssSampler`) and the CPU
time each part of it spent (`tree_cpu`: the HTTP process, the scheduler processes, hicache's L3
storage process), so that a benchmark can say what a configuration cost the host, not only how
long it took."""
from __future__ import annotations

import threading

import psutil

STORAGE_MODULE = "hicache.tiers.remote.process_main"
RESOURCE_TRACKER = "multiprocessing.resource_tracker"


def processes(pid: int) -> list[psutil.Process]:
    """The process `pid` and all its descendants (none if it is gone)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def tree_rss(pid: int) -> int:
    """Bytes resident in the process `pid` and all its descendants."""
    total = 0
    for p in processes(pid):
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def role(proc: psutil.Process, root: int) -> str:
    """`http` (the process started), `storage` (an L3 storage process), `other` (multiprocessing's
    resource tracker) or `scheduler` (any other descendant: scheduler processes, TP ranks)."""
    if proc.pid == root:
        return "http"
    cmdline = " ".join(proc.cmdline())
    if STORAGE_MODULE in cmdline:
        return "storage"
    return "other" if RESOURCE_TRACKER in cmdline else "scheduler"


def tree_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) spent so far by the tree's live processes, summed by `role`."""
    out: dict[str, float] = {}
    for p in processes(pid):
        try:
            t = p.cpu_times()
            name = role(p, pid)
        except psutil.NoSuchProcess:
            continue
        out[name] = out.get(name, 0.0) + t.user + t.system
    return out


def cpu_since(pid: int, before: dict[str, float]) -> dict[str, float]:
    """CPU seconds by role spent since `before` (a `tree_cpu` reading of the same tree)."""
    return {k: round(v - before.get(k, 0.0), 2) for k, v in tree_cpu(pid).items()}


class RssSampler:
    """Samples a process tree's RSS every `period` seconds in a thread; `peak` is the largest sum seen."""

    def __init__(self, pid: int, period: float = 0.5):
        self.pid, self.period, self.peak = pid, period, tree_rss(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.peak = max(self.peak, tree_rss(self.pid))

    def close(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak
