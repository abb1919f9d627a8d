"""The scheduler in named parts; `Scheduler` (scheduler.py) composes them."""
from __future__ import annotations

from hicache.runtime.scheduler.scheduler import Scheduler

__all__ = ["Scheduler"]
