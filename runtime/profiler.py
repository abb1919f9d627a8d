"""The scheduler's torch profiler, as SGLang's `/start_profile` and `/stop_profile` drive it.

`start` arms it: after `start_step` more scheduler steps it begins recording (CPU ops and, on CUDA,
kernels and copies on every stream), and after `num_steps` recorded steps (or at `stop`) it writes
a Chrome trace, `<output_dir>/<prefix>-<time>.trace.json.gz`, readable by Perfetto or
chrome://tracing. One profile at a time; the scheduler runs each step within `step()`.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import NamedTuple

import torch

logger = logging.getLogger(__name__)

ACTIVITIES = {"CPU": torch.profiler.ProfilerActivity.CPU, "GPU": torch.profiler.ProfilerActivity.CUDA}


class ProfileSpec(NamedTuple):
    output_dir: str
    num_steps: int | None = None  # None: until stop()
    start_step: int = 0  # steps to let pass before recording
    activities: tuple[str, ...] = ("CPU", "GPU")
    prefix: str = "hicache"
    with_stack: bool = False
    record_shapes: bool = False


class StepProfiler:
    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.spec: ProfileSpec | None = None
        self._prof = None
        self._wait = 0
        self._recorded = 0
        self.traces: list[str] = []  # paths written, newest last

    def active(self) -> bool:
        return self.spec is not None

    def start(self, spec: ProfileSpec) -> None:
        """Arms a profile; ValueError naming the field for a bad one, or when one is armed already."""
        if self.spec is not None:
            raise ValueError("a profile is already running: POST /stop_profile first")
        unknown = [a for a in spec.activities if a not in ACTIVITIES]
        if unknown:
            raise ValueError(f"activities: {unknown} not supported; use {sorted(ACTIVITIES)}")
        if spec.num_steps is not None and spec.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {spec.num_steps}")
        if spec.start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {spec.start_step}")
        if not spec.output_dir or not os.path.isabs(spec.output_dir):
            raise ValueError(f"output_dir must be an absolute path, got {spec.output_dir!r}")
        os.makedirs(spec.output_dir, mode=0o700, exist_ok=True)
        self.spec, self._wait, self._recorded = spec, spec.start_step, 0
        if self._wait == 0:
            self._begin()

    @contextlib.contextmanager
    def step(self):
        """Around one scheduler step: a `scheduler_step` span in the trace while recording; counts
        the step towards `start_step` and `num_steps`."""
        if self._prof is None:
            yield
        else:
            with torch.profiler.record_function("scheduler_step"):
                yield
        self._after_step()

    def _after_step(self) -> None:
        if self.spec is None:
            return
        if self._prof is None:
            self._wait -= 1
            if self._wait <= 0:
                self._begin()
            return
        self._recorded += 1
        if self.spec.num_steps is not None and self._recorded >= self.spec.num_steps:
            self.stop()

    def stop(self) -> str | None:
        """Ends the profile and writes its trace; the path (None if it recorded nothing). ValueError
        when none is running."""
        if self.spec is None:
            raise ValueError("no profile is running: POST /start_profile first")
        spec, prof, self.spec, self._prof = self.spec, self._prof, None, None
        if prof is None:
            return None
        prof.stop()
        path = os.path.join(spec.output_dir, f"{spec.prefix}-{time.time():.0f}-{os.getpid()}.trace.json.gz")
        prof.export_chrome_trace(path)
        self.traces.append(path)
        logger.info("profile of %d steps written to %s", self._recorded, path)
        return path

    def _begin(self) -> None:
        spec = self.spec
        activities = [ACTIVITIES[a] for a in spec.activities if a == "CPU" or self.cuda]
        self._prof = torch.profiler.profile(activities=activities, with_stack=spec.with_stack,
                                            record_shapes=spec.record_shapes)
        self._prof.start()
