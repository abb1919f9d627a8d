"""L3: storage backends behind one registry, and the I/O worker that moves pages between them and
the host pool.

The registry is `hicache.tiers.base.STORAGE_BACKENDS` (each backend's class and the options it
takes, torch-free data the config checks too). `make_backend(name, namespace, secret, **options)`
imports a backend's module (and its optional dependency: lmdb, redis, mooncake) only when that
backend is asked for, so `import hicache` needs neither. An option the backend does not take, or a
value of the wrong type or range, is a ValueError naming it.
"""
from __future__ import annotations

import importlib

from hicache.tiers.base import STORAGE_BACKENDS, check_storage_options


def backend_class(name: str) -> type:
    if name not in STORAGE_BACKENDS:
        raise ValueError(f"unknown storage backend {name!r}; choose one of {', '.join(STORAGE_BACKENDS)}")
    module, _, cls = STORAGE_BACKENDS[name].target.partition(":")
    return getattr(importlib.import_module(module), cls)


def make_backend(name: str, namespace: str, secret: str | bytes | None = None, **options):
    """A `tiers.base.StorageBackend`. `namespace`: hex id that prefixes every key of this model.
    `secret`: the storage secret that MACs every value (None: values are bound to their keys and
    checksummed, not authenticated); never one of the `options`, which come from the extra config."""
    return check_options(name, options)(namespace, secret=secret, **options)


def check_options(name: str, options: dict) -> type:
    """The class of backend `name`; ValueError naming any of `options` it does not take or refuses."""
    cls = backend_class(name)
    check_storage_options(f"storage backend {name!r}", options, STORAGE_BACKENDS[name].options)
    return cls
