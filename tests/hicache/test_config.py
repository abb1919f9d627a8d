"""HiCacheConfig: L2 options, their checks, and the flags the CLI builds from them."""
from __future__ import annotations

import pytest

from hicache.config import HiCacheConfig
from hicache.runtime.engine import split_options


def test_defaults_turn_l2_on():
    cc = HiCacheConfig()
    assert cc.hierarchical_cache is None and cc.hierarchical
    assert (cc.hicache_ratio, cc.hicache_size, cc.hicache_write_policy, cc.hicache_mem_layout) == (
        2.0, 0, "write_through", "layer_first")
    assert not HiCacheConfig(disable_radix_cache=True).hierarchical  # nothing to keep in L2


def test_hierarchical_cache_is_one_tri_state_engine_option():
    _, cc = split_options({"hierarchical_cache": False})
    assert not cc.hierarchical
    assert split_options({"hierarchical_cache": True})[1].hierarchical
    with pytest.raises(ValueError, match="radix cache"):
        HiCacheConfig(hierarchical_cache=True, disable_radix_cache=True)


@pytest.mark.parametrize("old,new", [("disable_hierarchical_cache", "hierarchical_cache=False"),
                                     ("enable_hierarchical_cache", "hierarchical_cache=True"),
                                     ("disable_overlap_schedule", "overlap_schedule=False"),
                                     ("enable_decode_while_loading", "decode_while_loading=True"),
                                     ("disable_jump_forward", "jump_forward=False")])
def test_the_flag_names_as_engine_options_name_the_field(old, new):
    with pytest.raises(TypeError, match=new):
        split_options({old: True})


@pytest.mark.parametrize("kwargs,field", [
    ({"hicache_write_policy": "write_around"}, "hicache_write_policy"),
    ({"hicache_mem_layout": "page_first_direct"}, "hicache_mem_layout"),
    ({"hicache_io_backend": "dma"}, "hicache_io_backend"),
    ({"hicache_ratio": 0}, "hicache_ratio"),
    ({"hicache_size": -1}, "hicache_size"),
])
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        HiCacheConfig(**kwargs)


def test_cli_flags():
    from hicache.server.cli import build_parser
    from hicache.server.flags import config_from_args

    args = build_parser().parse_args(["serve", "--disable-hierarchical-cache", "--hicache-ratio", "10",
                                      "--hicache-write-policy", "write_back", "--hicache-mem-layout", "page_first"])
    cc = config_from_args(HiCacheConfig, args)
    assert not cc.hierarchical and cc.hicache_ratio == 10 and cc.hicache_write_policy == "write_back"
    args = build_parser().parse_args(["serve", "--hicache-size", "4", "--hicache-io-backend", "kernel"])
    cc = config_from_args(HiCacheConfig, args)
    assert cc.hierarchical and cc.hicache_size == 4 and cc.hicache_io_backend == "kernel"
    for flags, want in (([], None), (["--enable-hierarchical-cache"], True), (["--disable-hierarchical-cache"], False),
                        (["--disable-hierarchical-cache", "--enable-hierarchical-cache"], True)):
        assert config_from_args(HiCacheConfig, build_parser().parse_args(["serve", *flags])).hierarchical_cache is want


def test_the_storage_backends_are_the_registry_s():
    import inspect

    from hicache.tiers.base import STORAGE_BACKENDS
    from hicache.tiers.remote import backend_class

    with pytest.raises(ValueError, match="lmdb, redis, mooncake, memory, none"):
        HiCacheConfig(hicache_storage_backend="s3")
    for name, entry in STORAGE_BACKENDS.items():  # each backend takes the options declared for it
        params = inspect.signature(backend_class(name).__init__).parameters
        taken = {p: params[p].default for p in params if p not in ("self", "namespace", "secret")}
        assert set(taken) == set(entry.options), name
        for key, option in entry.options.items():
            if option.default is not None:
                assert taken[key] == option.default, (name, key)
        HiCacheConfig(hicache_storage_backend=name, hicache_storage_backend_extra_config={
            key: option.default for key, option in entry.options.items()})


@pytest.mark.parametrize("backend,extra,message", [
    ("lmdb", {"paht": "/tmp/l3"}, r"does not take paht \(it takes prefetch_threshold, .*, path, size_cap_gb"),
    ("redis", {"path": "/tmp/l3"}, r"backend redis\) does not take path \(it takes .*url, key_prefix"),
    ("none", {"url": "redis://x"}, r"does not take url \(it takes prefetch_threshold, .*query_grace\)"),
    ("lmdb", {"prefetch_threshold": -1}, "prefetch_threshold must be >= 0, got -1"),
    ("lmdb", {"batch_pages": 0}, "batch_pages must be >= 1"),
    ("lmdb", {"prefetch_timeout_max": "30"}, "prefetch_timeout_max must be a number, got '30'"),
    ("lmdb", {"prefetch_threshold": 1.5}, "prefetch_threshold must be an integer"),
    ("lmdb", {"sync": 1}, "sync must be true or false"),
    ("lmdb", {"size_cap_gb": 0}, "size_cap_gb must be > 0"),
    ("redis", {"max_connections": True}, "max_connections must be an integer"),
    ("memory", {"store": 3}, "store must be a string"),
])
def test_a_bad_extra_config_key_is_named(backend, extra, message):
    with pytest.raises(ValueError, match=message):
        HiCacheConfig(hicache_storage_backend=backend, hicache_storage_backend_extra_config=extra)


def test_the_extra_config_splits_into_the_cache_s_keys_and_the_backend_s():
    cc = HiCacheConfig(hicache_storage_backend="redis", hicache_storage_prefetch_policy="best_effort",
                       hicache_storage_backend_extra_config='{"prefetch_threshold": 16, "prefetch_grace": 0, '
                                                            '"url": "redis://h:1/0", "socket_timeout": 1}')
    options = cc.storage_options
    assert (options.policy, options.prefetch_threshold, options.prefetch_grace, options.batch_pages) == (
        "best_effort", 16, 0, 128)
    assert cc.backend_options == {"url": "redis://h:1/0", "socket_timeout": 1}
    with pytest.raises(ValueError, match="hicache_storage_secret"):
        HiCacheConfig(hicache_storage_backend_extra_config={"secret": "0123456789abcdef"})
