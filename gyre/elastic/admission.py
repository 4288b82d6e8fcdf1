"""Admission that keeps contexts resident: a per-cell ledger of KV reservations.

Pure host-side bookkeeping, no clock and no device: the simulator's ``ResidentPools`` and
``EngineResidentPools`` (gyre/elastic/memory.py) call it, and so does the serving proxy
(gyre/rollout/proxy.py, ``rollout.admission="resident"``).

An *admitted* execution holds a reservation on one cell for its whole life, between its calls
too, so its context stays resident there while it waits on a tool. Units are KV tokens.

- A new execution is admitted (:meth:`ResidentAdmission.admit`) to the open cell with most
  free room, if that room holds ``max(need, floor)``: its first call's need, or the mean peak
  of the executions released so far if larger (the growth its context will likely need; a
  measured figure, not the execution's own peak); with ``slots`` > 0, only to a cell holding
  fewer than ``slots`` admitted executions (:meth:`count`: each resident context needs a
  slot of its own).
- A later call of an admitted execution grows its reservation to the call's need on its own
  cell (:meth:`grow`) if the room is there; otherwise the call waits. The caller serves
  these calls before any new execution, and admits no new execution to a cell where one waits.
- :meth:`move` hands a reservation over to another cell with room (a cell leaving rollout),
  or releases it when none has room (the context is dropped; the execution is new again).
- :meth:`youngest` names the last execution admitted to a cell: the one to preempt when a
  cell has nothing running and a waiting call still does not fit (otherwise it would wait
  forever, every execution there waiting to grow).
- :meth:`release` frees the reservation when the execution ends (recording its peak need).
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable


class ResidentAdmission:
    """Reservations of admitted executions per cell: ``num_cells`` pools of ``capacity``
    tokens each, and at most ``slots`` executions admitted to a cell (0: no cap; a hand-over's
    :meth:`move` does not check it). Keys are any hashable execution handle (an id string, an
    object)."""

    def __init__(self, num_cells: int, capacity: float, slots: int = 0):
        if num_cells < 1 or not capacity > 0 or slots < 0:
            raise ValueError(
                f"need num_cells >= 1, capacity > 0 and slots >= 0, got {num_cells}, "
                f"{capacity}, {slots}"
            )
        self.capacity, self.slots = float(capacity), int(slots)
        self.counts = [0] * num_cells  # executions admitted per cell
        self.tol = 1e-9 * self.capacity
        self.used = [0.0] * num_cells  # tokens reserved per cell
        self.cell: dict[Hashable, int] = {}  # key -> its cell
        self.tokens: dict[Hashable, float] = {}  # key -> tokens reserved
        self.peak: dict[Hashable, float] = {}  # key -> largest need so far
        self.order: dict[Hashable, int] = {}  # key -> admission sequence number
        self._seq = itertools.count()
        self.peak_sum, self.peak_n = 0.0, 0

    # ---- queries ----------------------------------------------------------------------------
    def holds(self, key: Hashable) -> bool:
        """Whether the execution is admitted (holds a reservation somewhere)."""
        return key in self.cell

    def cell_of(self, key: Hashable) -> int:
        return self.cell[key]

    def free(self, cell: int) -> float:
        return self.capacity - self.used[cell]

    def room(self, cells: Iterable[int]) -> dict:
        """The policy's view of the ledger for ``cells`` (LoadSnapshot's ``kv_reserved_tokens``
        and ``kv_free_tokens``): tokens reserved on each, and the unreserved room (>= 0); and
        ``kv_peak_tokens``, the mean peak need of the executions released so far (:attr:`floor`)."""
        cells = list(cells)
        return {
            "kv_reserved_tokens": tuple(max(self.used[c], 0.0) for c in cells),  # float sums
            "kv_free_tokens": tuple(max(self.free(c), 0.0) for c in cells),
            "kv_peak_tokens": self.floor,
        }

    def count(self, cell: int) -> int:
        """Executions admitted to ``cell`` now."""
        return self.counts[cell]

    def has_slot(self, cell: int) -> bool:
        """Whether ``cell`` may admit another execution (fewer than ``slots``; always with 0)."""
        return self.slots <= 0 or self.counts[cell] < self.slots

    @property
    def floor(self) -> float:
        """Mean peak need of the executions released so far (0 before the first)."""
        return self.peak_sum / self.peak_n if self.peak_n else 0.0

    def reservation(self, need: float) -> float:
        """Tokens a new execution reserves for a first call needing ``need``."""
        return max(need, self.floor)

    def keys_on(self, cell: int) -> list:
        """Executions admitted to ``cell``, oldest admission first."""
        return sorted((k for k, c in self.cell.items() if c == cell), key=self.order.__getitem__)

    def youngest(self, cell: int):
        """The execution admitted to ``cell`` last (None if none)."""
        keys = [k for k, c in self.cell.items() if c == cell]
        return max(keys, key=self.order.__getitem__) if keys else None

    # ---- changes ----------------------------------------------------------------------------
    def _place(self, key: Hashable, cell: int, tokens: float, order: int | None = None) -> None:
        self.cell[key], self.tokens[key] = cell, tokens
        self.order[key] = next(self._seq) if order is None else order
        self.used[cell] += tokens
        self.counts[cell] += 1

    def _best(self, need: float, cells: Iterable[int]) -> int | None:
        """The cell with most free room that holds ``need`` (lowest index on ties)."""
        best = None
        for c in cells:
            if self.free(c) + self.tol >= need and (best is None or self.free(c) > self.free(best)):
                best = c
        return best

    def admit(self, key: Hashable, need: float, cells: Iterable[int]) -> int | None:
        """A new execution whose first call needs ``need``: its cell among ``cells``, or None."""
        if key in self.cell:
            raise ValueError(f"execution {key!r} is already admitted")
        want = self.reservation(need)
        c = self._best(want, (i for i in cells if self.has_slot(i)))
        if c is not None:
            self._place(key, c, want)
            self.peak[key] = need
        return c

    def grow(self, key: Hashable, need: float) -> bool:
        """An admitted execution's next call needs ``need`` on its cell: True if it fits (the
        reservation grows to it; it never shrinks)."""
        c, held = self.cell[key], self.tokens[key]
        want = max(held, need)
        if self.used[c] - held + want > self.capacity + self.tol:
            return False
        self.used[c] += want - held
        self.tokens[key] = want
        self.peak[key] = max(self.peak[key], need)
        return True

    def move(self, key: Hashable, cells: Iterable[int]) -> int | None:
        """Hands the reservation over to the cell among ``cells`` with most room that holds
        it; releases it (without recording a peak) if none does. Returns the cell or None."""
        src, tokens = self.cell[key], self.tokens[key]
        dst = self._best(tokens, (c for c in cells if c != src))
        self.used[src] -= tokens
        if dst is None:
            self._drop(key)
            return None
        self.counts[src] -= 1
        self.counts[dst] += 1
        self.cell[key] = dst
        self.used[dst] += tokens
        return dst

    def preempt(self, key: Hashable) -> None:
        """Releases a reservation without recording a peak (the execution is new again)."""
        self.used[self.cell[key]] -= self.tokens[key]
        self._drop(key)

    def release(self, key: Hashable) -> None:
        """The execution ended: frees its reservation and records its peak need."""
        if key not in self.cell:
            return
        self.peak_sum += self.peak[key]
        self.peak_n += 1
        self.used[self.cell[key]] -= self.tokens[key]
        self._drop(key)

    def _drop(self, key: Hashable) -> None:
        if key in self.cell:
            self.counts[self.cell[key]] -= 1
        for d in (self.cell, self.tokens, self.peak, self.order):
            d.pop(key, None)
