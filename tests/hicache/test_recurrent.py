"""`RecurrentPolicy` (hicache/recurrent.py) through the `CacheManager`, on fake tiers: a state is
modelled as the tuple of tokens it comes after, so that a restored state that is not the state
after the request's prefix shows at once. The "runner" here continues a lease's working state
chunk by chunk and writes the snapshots its `StateSlots.targets` name, as the model does."""
from __future__ import annotations

from hicache.manager import CacheManager, Lease
from hicache.recurrent import RecurrentPolicy
from hicache.tree import RadixTree
import cache_fakes as fakes

PS = 4


class FakeStatePool:
    """A `StatePool` whose slots hold the token tuple their state comes after."""

    def __init__(self, slots: int):
        self.values: dict[int, tuple | None] = {i: None for i in range(slots)}
        self._free = list(range(slots))

    def alloc(self):
        return self._free.pop() if self._free else None

    def free(self, slot):
        assert slot not in self._free, f"state slot {slot} freed twice"
        self._free.append(slot)

    def copy(self, src, dst):
        self.values[dst] = self.values[src]

    def clear(self, slot):
        self.values[slot] = ()

    def num_free(self):
        return len(self._free)

    def capacity(self):
        return len(self.values)

    def free_slots(self):
        return list(self._free)


class Setup:
    def __init__(self, state_slots=16, device_pages=32, host_pages=64, rows=4):
        self.rows = rows
        self.alloc = fakes.FakeAllocator(device_pages, PS)
        self.host_pool = fakes.FakeHostPool(host_pages, PS)
        self.xfer = fakes.FakeTransfer({}, {}, False)
        tree = RadixTree(self.alloc, PS, "lru", host_allocator=self.host_pool.allocator)
        self.states = FakeStatePool(state_slots)
        self.table = fakes.FakeTable(rows)
        self.cache = CacheManager.build(tree, self.table, self.host_pool, self.xfer, load_back_min_tokens=1,
                                        states=RecurrentPolicy(tree, self.states))
        self.leases: list[Lease] = []

    def run(self, tokens: list[int], chunk: int = 5, new: int = 3) -> int:
        """A request of `tokens` computed in chunks of `chunk`, then `new` decode steps (tokens
        9000...), released; returns its cached prefix. Asserts its state was right all along."""
        lease = Lease("", owner=tokens)
        got = self.cache.admit(lease, self.cache.match(tokens[:-1], ""), chunk, resume_limit=len(tokens) - 1)
        assert got is not None
        self.leases.append(lease)
        seq = tokens + [9000 + i for i in range(new)]
        done = got.prefix
        while done < len(seq) - 1:
            n = min(chunk, len(tokens) - done) if done < len(tokens) else 1
            assert self.cache.grow(lease, done + n)
            self.compute(lease, seq, done, n)
            done += n
            self.cache.advance(lease, done)
            self.cache.check_integrity(self.leases, self.rows)
        self.cache.release(lease, seq[:done], len(tokens))
        self.leases.remove(lease)
        self.cache.check_integrity(self.leases, self.rows)
        return got.prefix

    def compute(self, lease: Lease, seq: list[int], start: int, n: int) -> None:
        st, values = lease.states, self.states.values
        assert values[st.working] == tuple(seq[:start]), "the working state is not the state after the prefix"
        for j, slot in st.targets(start, n, PS):
            values[slot] = tuple(seq[:start + j + 1])
        values[st.working] = tuple(seq[:start + n])


def test_turn_two_resumes_at_turn_ones_last_page_boundary():
    s = Setup()
    turn1 = list(range(1, 23))  # 22 tokens, 3 answer tokens: 24 computed
    assert s.run(turn1) == 0
    turn2 = turn1 + [9000, 9001, 9002] + [50, 51, 52, 53, 54]
    assert s.run(turn2) == 24
    assert s.run(turn1) == 20  # the same prompt again: the state before its last token's page
    assert s.cache.states.counters["restored_tokens"] == 44


def test_a_match_inside_a_node_is_cut_back_to_a_snapshot():
    s = Setup()
    a = list(range(1, 30))
    s.run(a)
    branch = a[:13] + [77] * 8  # shares 12 tokens: the node there is split off, without a snapshot
    assert s.run(branch) == 0
    assert s.run(branch[:12] + [78] * 6) == 0  # still none at 12: only at the ends requests reached
    assert s.run(a[:13] + [77] * 8 + [5]) == 20  # branch's own snapshot (its resume point)


def test_snapshots_are_evicted_when_the_pool_is_short_and_freed_with_their_nodes():
    s = Setup(state_slots=7, device_pages=64, host_pages=1)
    prompts = [[100 * k + i for i in range(1, 18)] for k in range(1, 7)]
    for p in prompts:
        s.run(p)
    stats = s.cache.states.stats()
    assert stats["snapshots_evicted"] > 0 and stats["snapshots"] <= 4  # 7 slots, 3 held by the running request
    s.cache.host.evict_device(10**9)  # no room on L2: the nodes go, and their snapshots with them
    s.cache.check_integrity([], s.rows)
    assert s.cache.states.stats()["snapshots"] == 0
    assert s.run(prompts[-1]) == 0
    assert s.cache.flush() and s.states.num_free() == 7


def test_a_snapshot_outlives_its_pages_on_l1_and_is_restored_after_a_load_back():
    """The L2 part of a match is loaded back up to its deepest snapshot only."""
    s = Setup()
    a = list(range(1, 26))
    s.run(a)  # a snapshot at 24
    longer = a + [9000, 9001, 9002] + list(range(200, 213))  # 40 tokens: a snapshot at 40
    s.run(longer, new=1)
    s.cache.poll([])
    s.cache.host.evict_device(10**9)  # L1 forgets the pages, L2 keeps them; the snapshots stay
    match = s.cache.match(longer[:33] + [7] * 4, "")  # L2 holds 32 of these, the snapshot at 24
    assert (match.device_tokens, match.host_tokens) == (0, 24)
    assert s.run(longer[:33] + [7] * 4) == 24
    assert s.run(longer + [1]) == 40
