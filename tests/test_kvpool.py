"""The host-side paged KV pool (gyre/kvpool.py): no page leaked or written while shared,
reference counts equal the tables, footprint = used pages x page size, and every key reads
back exactly the tokens it was given through its page table (shared prefixes included)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gyre.kvpool import KVPool


class Memory:
    """The pool plus a model of the device: page contents, and each key's logical tokens."""

    def __init__(self, num_pages, page_size):
        self.pool = KVPool(num_pages, page_size)
        self.pages = np.full((num_pages, page_size), -1, np.int64)
        self.tokens: dict[int, list[int]] = {}
        self.next_value = 0

    def apply(self, copies):
        for src, dst in copies:
            self.pages[dst] = self.pages[src]

    def write(self, key, start, end):
        """Writes fresh values at tokens [start, end) of key (only to pages it holds alone)."""
        ps, table = self.pool.page_size, self.pool.tables.get(key, [])
        for t in range(start, end):
            page = table[t // ps]
            assert self.pool.refs[page] == 1, f"write to shared page {page}"
            self.pages[page, t % ps] = self.next_value
            self.tokens[key].append(self.next_value)
            self.next_value += 1

    def read(self, key):
        ps, table = self.pool.page_size, self.pool.tables.get(key, [])
        n = len(self.tokens.get(key, []))
        return [int(self.pages[table[t // ps], t % ps]) for t in range(n)]

    def check(self):
        p = self.pool
        p.check()
        assert p.footprint_tokens() == p.used_pages * p.page_size
        assert p.used_pages + p.free_pages == p.num_pages
        assert p.used_pages == len(p.pages_of(p.tables))  # no page used but unreferenced
        for key, toks in self.tokens.items():
            assert len(p.tables.get(key, [])) >= p.pages_for(len(toks))
            assert self.read(key) == toks, f"key {key} reads other tokens"


ops = st.lists(
    st.tuples(st.sampled_from(["grow", "rewind", "share", "release"]),
              st.integers(0, 4), st.integers(0, 4), st.integers(0, 40), st.integers(0, 40)),
    max_size=40,
)  # fmt: skip


@given(ops=ops, page_size=st.integers(1, 5), num_pages=st.integers(1, 40))
def test_random_operations_keep_every_invariant(ops, page_size, num_pages):
    m = Memory(num_pages, page_size)
    pool = m.pool
    for op, a, b, x, y in ops:
        toks = m.tokens.setdefault(a, [])
        try:
            if op == "grow":  # append y tokens (an admission's prefill and decode)
                keep = len(toks)
                need = pool.fresh_needed(a, keep, keep + y)
                if need > pool.free_pages:
                    with pytest.raises(MemoryError):
                        pool.resize(a, keep, keep + y)
                    del toks[pool.pages_for(keep) * page_size :]  # truncation happened
                    continue
                m.apply(pool.resize(a, keep, keep + y))
                m.write(a, keep, keep + y)
            elif op == "rewind":  # keep x tokens, then write y new ones (a retry)
                keep = min(x, len(toks))
                if pool.fresh_needed(a, keep, keep + y) > pool.free_pages:
                    continue
                m.apply(pool.resize(a, keep, keep + y))
                del toks[keep:]
                m.write(a, keep, keep + y)
            elif op == "share" and a != b:  # b takes a's first x tokens, then writes y more
                n = min(x, len(toks))
                # releasing b frees only the pages no other key shares
                own = sum(int(pool.refs[p] == 1) for p in pool.tables.get(b, []))
                if pool.fresh_needed(b, 0, n + y) > pool.free_pages + own:
                    continue
                pool.release(b)
                m.tokens[b] = []
                m.apply(pool.resize(b, 0, n + y))
                before = pool.free_pages
                m.apply(pool.share(a, b, n))
                assert pool.free_pages >= before  # sharing never takes a page
                m.tokens[b] = list(toks[:n])
                m.write(b, n, n + y)
            elif op == "release":
                pool.release(a)
                m.tokens[a] = []
        finally:
            m.check()
    for key in list(m.tokens):
        pool.release(key)
    assert pool.used_pages == 0 and (pool.refs == 0).all()  # nothing leaked


def test_prefix_shared_by_reference_last_partial_page_copied():
    pool = KVPool(16, 4)
    pool.resize("leader", 0, 10)  # pages 0, 1, 2
    assert pool.table("leader") == [0, 1, 2] and pool.footprint_tokens() == 12
    for i in range(3):  # three samples of a 10-token prompt, 6 tokens of completion each
        pool.resize(f"s{i}", 0, 16)
        copies = pool.share("leader", f"s{i}", 10)
        table = pool.table(f"s{i}")
        assert table[:2] == [0, 1] and copies == [(2, table[2])]
    assert list(pool.refs[:3]) == [4, 4, 1]
    assert pool.used_pages == 3 + 3 * 2  # the prompt's full pages once; own pages per sample
    # a sample rewound into a shared full page copies that page before writing (on write)
    assert pool.fresh_needed("s0", 6, 8) == 1
    copies = pool.resize("s0", 6, 8)
    assert copies == [(1, pool.table("s0")[1])] and pool.refs[1] == 3
    pool.release("leader")
    assert pool.refs[0] == 3 and pool.refs[2] == 0  # what others hold stays
    pool.check()


def test_lru_order_idle_keys_pinned_last():
    pool = KVPool(8, 2)
    for k in "abcd":
        pool.resize(k, 0, 2)
        pool.touch(k, idle=True)
    pool.touch("b", idle=False)  # runs: never a candidate
    pool.touch("a", idle=True)  # used again: now most recent
    assert pool.lru() == ["c", "d", "a"]
    assert pool.lru(pinned=lambda k: k == "c") == ["d", "a", "c"]
    assert pool.lru(exclude=["d"]) == ["c", "a"]
    pool.release("c")
    assert pool.lru() == ["d", "a"]


def test_allocation_past_the_pool_is_a_memory_error():
    pool = KVPool(2, 4)
    pool.resize("a", 0, 8)
    assert pool.fresh_needed("b", 0, 1) == 1 and pool.free_pages == 0
    with pytest.raises(MemoryError):
        pool.resize("b", 0, 1)
    pool.check()
