"""`Scheduler.warm_up`, the request a server runs before it reports ready: it caches nothing,
counts in no statistic and leaves later requests' outputs (sampled ones too) as without it."""
from __future__ import annotations

import pytest

from test_hicache_l2 import GREEDY, drain, request, tiny_scheduler


def footprint(sched) -> tuple:
    cache = sched.cache
    return (sched.stats(), cache.tree.total_tokens(), cache.allocator.num_free_tokens(), cache.req_table.num_free(),
            cache.host.host_stats())


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page_size", [1, 16])
def test_warm_up_caches_nothing_and_counts_nothing(tiny_config_path, page_size, overlap):
    sched = tiny_scheduler(tiny_config_path, total=512, overlap=overlap, page_size=page_size)
    before = footprint(sched)
    sched.warm_up(prompt_tokens=40, new_tokens=9)  # whole pages of prompt and of output at either size
    sched.check_integrity()
    assert footprint(sched) == before
    assert not sched.has_work()


def test_later_requests_run_as_without_it(tiny_config_path):
    runs = []
    for warm in (False, True):
        sched = tiny_scheduler(tiny_config_path, total=512, page_size=16)
        if warm:
            sched.warm_up()
        for i, params in enumerate([{"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True},
                                    dict(GREEDY, max_new_tokens=12)]):
            sched.add_request(request(f"r{i}", [(7 * j + i) % 50 + 3 for j in range(40)], params))
        runs.append(drain(sched))
    assert runs[0] == runs[1]
    assert all(len(ids) == 12 for ids, _, _ in runs[1].values())
