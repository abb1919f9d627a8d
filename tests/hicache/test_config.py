"""HiCacheConfig: L2 options, their checks, and the flags the CLI builds from them."""
from __future__ import annotations

import pytest

from hicache.config import HiCacheConfig
from hicache.runtime.engine import split_options


def test_defaults_turn_l2_on():
    cc = HiCacheConfig()
    assert cc.enable_hierarchical_cache and cc.hierarchical
    assert (cc.hicache_ratio, cc.hicache_size, cc.hicache_write_policy, cc.hicache_mem_layout) == (
        2.0, 0, "write_through", "layer_first")
    assert not HiCacheConfig(disable_radix_cache=True).hierarchical  # nothing to keep in L2


def test_disable_hierarchical_cache_is_an_engine_option():
    _, cc = split_options({"disable_hierarchical_cache": True})
    assert cc.enable_hierarchical_cache is False and not cc.hierarchical
    _, cc = split_options({"enable_hierarchical_cache": False})
    assert not cc.hierarchical


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
