"""L3: storage backends behind one registry, and the I/O worker that moves pages between them and
the host pool.

`make_backend(name, namespace, secret, **options)` imports a backend's module (and its optional
dependency: lmdb, redis, mooncake) only when that backend is asked for, so `import hicache` needs neither.
Unknown options are a ValueError naming them.
"""
from __future__ import annotations

import importlib
import inspect

BACKENDS = {  # name -> "module:class"
    "lmdb": "hicache.tiers.remote.lmdb:LmdbBackend",
    "redis": "hicache.tiers.remote.redis:RedisBackend",
    "memory": "hicache.tiers.remote.memory:MemoryBackend",
    "mooncake": "hicache.tiers.remote.mooncake:MooncakeBackend",
}


def backend_class(name: str) -> type:
    if name not in BACKENDS:
        raise ValueError(f"unknown storage backend {name!r}; choose one of {', '.join(BACKENDS)}")
    module, _, cls = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def make_backend(name: str, namespace: str, secret: str | bytes | None = None, **options):
    """A `tiers.base.StorageBackend`. `namespace`: hex id that prefixes every key of this model.
    `secret`: the storage secret that MACs every value (None: values are bound to their keys and
    checksummed, not authenticated); never one of the `options`, which come from the extra config."""
    return check_options(name, options)(namespace, secret=secret, **options)


def check_options(name: str, options: dict) -> type:
    """The class of backend `name`; ValueError naming any of `options` it does not take."""
    cls = backend_class(name)
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "namespace", "secret"}
    unknown = set(options) - accepted
    if unknown:
        raise ValueError(f"storage backend {name!r} does not take {', '.join(sorted(unknown))} "
                         f"(it takes {', '.join(sorted(accepted)) or 'no options'})")
    return cls
