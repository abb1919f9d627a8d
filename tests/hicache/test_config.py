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
