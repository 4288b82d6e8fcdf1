"""A paged KV pool on the host: pages, per-key page tables, reference counts, LRU order.

Pure Python and numpy, no JAX, importing nothing from gyre (the lowest floor of
docs/architecture.md): the rollout engine (gyre/rollout/engine.py) keys it by slot and moves
the device pages it names; the simulator's engine-pool mode (gyre/elastic/memory.py,
``EnginePools``) keys one per cell by execution and moves nothing. The rule is written once
here:

- Memory is ``num_pages`` pages of ``page_size`` tokens. A key (a slot, an execution) holds a
  page table: the pages of its tokens 0, 1, ... in order, page ``i`` holding tokens
  ``[i * page_size, (i + 1) * page_size)``. Its footprint is ``len(table) * page_size``.
- A page is referenced by one or more tables (``refs``); it is free at zero references.
  :meth:`share` gives a key the full pages of another's prefix by reference (no copy); a page
  is only ever written by a key that holds it alone: :meth:`resize` makes every page a key
  will write its own first (copy on write: a fresh page, and the copy the caller makes on the
  device), so the last partial page of a shared prefix is copied, never the full ones.
- A request reserves the pages of its :func:`footprint` from admission to its end (so decode
  never runs out of pages); an idle key keeps the pages of its cached length.
- Eviction order: idle keys (not running) least recently used first, keys a caller pins last
  (:meth:`lru`); a key gets pages by evicting in that order until they are free
  (:meth:`claim`). Room for a new reservation: the pages the keys running something do not
  hold (:meth:`live_pages`): idle keys count as free, they are evicted on demand.

Every mutation of pages returns the device work it implies: a list of ``(source page, destination
page)`` copies, in order. Allocation failure is a ``MemoryError``: callers evict first
(:meth:`fresh_needed` says how many pages an operation takes).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Iterable

import numpy as np


def footprint(prompt_tokens: int, max_new_tokens: int, max_len: int) -> int:
    """Tokens a request's key can come to hold, so the pages it reserves from admission to its
    end: its prompt and every completion token but the last (returned, never fed back), the
    completion capped so that the sequence fits ``max_len``."""
    return prompt_tokens + min(max_new_tokens, max_len - prompt_tokens) - 1


class KVPool:
    """``num_pages`` pages of ``page_size`` tokens shared by the page tables of keys."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 0 or page_size < 1:
            raise ValueError(f"KVPool needs num_pages >= 0 and page_size >= 1, got "
                             f"{num_pages}, {page_size}")  # fmt: skip
        self.num_pages, self.page_size = int(num_pages), int(page_size)
        self.refs = np.zeros(self.num_pages, np.int32)
        # a stack (its first _nfree entries): the lowest free page is handed out first
        self._free = np.arange(self.num_pages - 1, -1, -1, dtype=np.int64)
        self._nfree = self.num_pages
        self.tables: dict[Hashable, list[int]] = {}
        self._last_used: dict[Hashable, int] = {}
        self._idle: set[Hashable] = set()
        self._clock = itertools.count()
        self.version = 0  # bumped by every change of a table (callers cache device tables)
        self._shared = False  # whether a page was ever referenced twice (share)

    # ------------------------------------------------------------------ figures

    def pages_for(self, tokens: int) -> int:
        """Pages that hold ``tokens`` tokens."""
        return -(-int(tokens) // self.page_size)

    @property
    def free_pages(self) -> int:
        return self._nfree

    @property
    def used_pages(self) -> int:
        return self.num_pages - self._nfree

    def footprint_tokens(self) -> int:
        """Tokens of memory the pool's used pages take (used pages x page_size)."""
        return self.used_pages * self.page_size

    def live_pages(self) -> int:
        """Pages the keys running something (not idle, :meth:`touch`) hold, a page shared
        counted once."""
        live = [t for k, t in self.tables.items() if k not in self._idle]
        if not self._shared:  # no page in two tables: no set needed
            return sum(map(len, live))
        return len({page for t in live for page in t})

    def is_idle(self, key: Hashable) -> bool:
        """Whether ``key`` holds pages and runs nothing (a candidate for eviction)."""
        return key in self._idle and bool(self.tables.get(key))

    def table(self, key: Hashable) -> list[int]:
        """``key``'s pages in token order (a copy; [] for an unknown key)."""
        return list(self.tables.get(key, ()))

    def pages_of(self, keys: Iterable[Hashable]) -> set[int]:
        """The distinct pages the tables of ``keys`` reference."""
        out: set[int] = set()
        for k in keys:
            out.update(self.tables.get(k, ()))
        return out

    # ------------------------------------------------------------------ pages

    def _alloc(self, n: int = 1) -> list[int]:
        if n > self._nfree:
            raise MemoryError(f"KV pool: {n} pages needed, {self._nfree} free")
        pages = self._free[self._nfree - n : self._nfree][::-1]
        self._nfree -= n
        self.refs[pages] = 1
        return pages.tolist()

    def _decref(self, pages) -> None:
        """One reference less on each of ``pages`` (distinct); pages left unreferenced are free."""
        pages = np.asarray(pages, np.int64)
        if not pages.size:
            return
        self.refs[pages] -= 1
        assert (self.refs[pages] >= 0).all(), "a page released twice"
        freed = pages[self.refs[pages] == 0][::-1]
        self._free[self._nfree : self._nfree + freed.size] = freed
        self._nfree += freed.size

    def fresh_needed(self, key: Hashable, keep: int, total: int) -> int:
        """Free pages :meth:`resize` (``key``, ``keep``, ``total``) takes."""
        table = self.tables.get(key, [])
        kept = min(len(table), self.pages_for(keep))
        cow = int(keep % self.page_size != 0 and 0 < kept == self.pages_for(keep)
                  and self.refs[table[kept - 1]] > 1)  # fmt: skip
        return max(0, self.pages_for(total) - kept) + cow

    def resize(self, key: Hashable, keep: int, total: int) -> list[tuple[int, int]]:
        """``key`` keeps its first ``keep`` tokens and gets pages for ``total`` tokens (``total``
        >= ``keep``), every page from token ``keep`` on its own: pages past ``keep`` are
        released, a shared last partial page is copied (on write), fresh pages are appended.
        -> the copies to make on the device. ``resize(key, n, n)`` truncates to n tokens."""
        if total < keep:
            raise ValueError(f"resize to {total} tokens below the {keep} kept")
        need = self.fresh_needed(key, keep, total)
        table = self.tables.setdefault(key, [])
        kept = min(len(table), self.pages_for(keep))
        self._decref(table[kept:])
        del table[kept:]
        if need > self.free_pages:
            raise MemoryError(f"KV pool: {need} pages needed, {self.free_pages} free")
        copies = []
        if 0 < kept == self.pages_for(keep) and keep % self.page_size and self.refs[table[-1]] > 1:
            old, (new,) = table[-1], self._alloc()
            self._decref([old])
            table[-1] = new
            copies.append((old, new))
        table.extend(self._alloc(max(0, self.pages_for(total) - len(table))))
        if not table:
            del self.tables[key]
        self.version += 1
        return copies

    def release(self, key: Hashable) -> None:
        """Frees ``key``'s pages (those it alone held) and forgets it."""
        self.resize(key, 0, 0)
        self._last_used.pop(key, None)
        self._idle.discard(key)

    def share(self, src: Hashable, dst: Hashable, tokens: int) -> list[tuple[int, int]]:
        """``dst`` takes ``src``'s first ``tokens`` tokens: the full pages by reference, the
        last partial page by a copy into ``dst``'s own page there (which ``dst`` must already
        hold alone, e.g. by :meth:`resize`). ``dst``'s pages replaced are released. Takes no
        free page. -> the copies to make on the device."""
        s, d = self.tables.get(src, []), self.tables.get(dst, [])
        full, part = divmod(int(tokens), self.page_size)
        if len(s) < self.pages_for(tokens) or len(d) < self.pages_for(tokens):
            raise ValueError(f"share of {tokens} tokens: source holds {len(s)} pages, "
                             f"destination {len(d)}")  # fmt: skip
        for i in range(full):
            if d[i] != s[i]:
                self.refs[s[i]] += 1
                self._shared = True
                self._decref([d[i]])
                d[i] = s[i]
        copies = []
        if part:
            if self.refs[d[full]] != 1:
                raise ValueError(f"share: destination page {d[full]} is not its own to write")
            copies.append((s[full], d[full]))
        self.version += 1
        return copies

    def rename(self, old: Hashable, new: Hashable) -> None:
        """``new`` takes over ``old``'s pages, idle state and place in the eviction order."""
        if new in self.tables or new in self._last_used:
            raise ValueError(f"rename: {new!r} is already a key")
        if old in self.tables:
            self.tables[new] = self.tables.pop(old)
        if old in self._last_used:
            self._last_used[new] = self._last_used.pop(old)
        if old in self._idle:
            self._idle.discard(old)
            self._idle.add(new)
        self.version += 1

    def claim(
        self,
        key: Hashable,
        keep: int,
        total: int,
        evict: Callable[[Hashable], None],
        pinned: Callable[[Hashable], bool] | None = None,
    ) -> list[tuple[int, int]]:
        """:meth:`resize` (``key``, ``keep``, ``total``) after evicting idle keys in
        :meth:`lru` order (``key`` itself never) until the pages it takes are free: ``evict``
        is called with each victim and must free its pages (:meth:`release`, or a
        :meth:`resize` to what it keeps). -> the copies to make on the device. Callers
        check room first (the live keys' pages leave enough); otherwise, with every idle key
        evicted, a ``MemoryError``."""
        for k in self.lru(exclude=[key], pinned=pinned):
            if self.fresh_needed(key, keep, total) <= self.free_pages:
                break
            evict(k)
        return self.resize(key, keep, total)

    # ------------------------------------------------------------------ eviction order

    def touch(self, key: Hashable, idle: bool) -> None:
        """``key`` was used now; ``idle``: it runs nothing (a candidate for eviction)."""
        self._last_used[key] = next(self._clock)
        (self._idle.add if idle else self._idle.discard)(key)

    def lru(
        self, exclude: Iterable[Hashable] = (), pinned: Callable[[Hashable], bool] | None = None
    ) -> list[Hashable]:
        """Idle keys holding pages, in eviction order: least recently used first, pinned ones
        last; ``exclude`` left out."""
        skip = set(exclude)
        keys = [k for k in self._idle if k not in skip and self.tables.get(k)]
        pin = pinned or (lambda k: False)
        return sorted(keys, key=lambda k: (pin(k), self._last_used.get(k, -1)))

    # ------------------------------------------------------------------ checks

    def check(self) -> None:
        """Asserts the invariants: every page is free xor referenced, the reference counts
        equal the tables' references, no free page twice."""
        counts = np.zeros(self.num_pages, np.int64)
        for table in self.tables.values():
            for page in table:
                counts[page] += 1
        assert (counts == self.refs).all(), "reference counts disagree with the tables"
        free = np.zeros(self.num_pages, np.int64)
        np.add.at(free, self._free[: self._nfree], 1)
        assert (free <= 1).all(), "a page is free twice"
        assert ((free == 1) == (counts == 0)).all(), "a page is both free and used, or neither"
