"""Imported first by tests/conftest.py, before anything loads torch: OpenMP's threads wait
passively (`OMP_WAIT_POLICY=PASSIVE`, unless set already) in the test process and the servers it
starts. Spinning at every barrier, they slow each other many times over whenever another process
holds a core (a server and its scheduler under test, a neighbour on a shared machine); sleeping,
they cost a wake-up per parallel region, which the default model's operations dwarf."""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
