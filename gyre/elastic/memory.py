"""The simulator's memory models, one strategy each (gyre/elastic/sim.py runs the events).

- :class:`NoMemory`: at most ``slots`` requests per cell, one global queue with least-loaded
  routing, a global, unlimited, free prefix cache.
- :class:`TokenPools`: a KV pool of ``kv_capacity_tokens`` per cell; affinity, FIFO admission
  whose head blocks, LRU eviction of idle contexts, hand-over by migration or re-prefill.
- :class:`EnginePools`: the real engine's pool rule (gyre/rollout/engine.py, proxy.py): one
  :class:`gyre.kvpool.KVPool` per cell, the engine's own class, keyed by execution.
- :class:`ResidentPools`: token pools with admission that keeps contexts resident
  (gyre/elastic/admission.py): no eviction, calls of admitted executions first.
- :class:`EngineResidentPools`: the engine's pool rule with the proxy's resident admission
  (the same ledger), pinned contexts evicted last.

Every strategy answers the same calls from the event loop (``route``, ``fill``, ``admitted``,
``call_done``, ``dropped``, ``handover``, ``ended``, ...), so each rule is written once.
Token counts are in simulated tokens (a replicated cost model's units).
"""

from __future__ import annotations

import collections
import math

from gyre.elastic.admission import ResidentAdmission
from gyre.elastic.policy import ROLLOUT
from gyre.elastic.simstate import ExState, Stale
from gyre.kvpool import KVPool, footprint


class NoMemory:
    """No KV limit: ``slots`` requests per cell, least-loaded routing, a free prefix cache."""

    def __init__(self, sim):
        self.sim, self.cost = sim, sim.cost
        if self.cost.slots < 1:
            raise ValueError("slots must be >= 1 without a memory model (kv_capacity_tokens 0)")

    def need(self, call) -> float:
        """KV tokens a call reserves while live."""
        return call.prompt_tokens + call.completion_tokens

    def check(self, steps) -> None:
        """Refuses a workload that could never run."""

    def capacity(self) -> float:
        """Executions a rollout cell counts as holding, for the policy."""
        return self.cost.slots

    def kv_room(self) -> dict:
        """LoadSnapshot's per-cell KV reservations and free room ({}: not tracked)."""
        return {}

    def dispatched(self, es) -> None:
        pass

    def _open(self, c) -> bool:
        return c.role == ROLLOUT and not c.switching and c.load() < self.cost.slots

    def route(self, req) -> None:
        """A new call: to the least-loaded cell with a free slot, else the global queue."""
        best = None
        for c in self.sim.cells:
            if self._open(c) and (best is None or c.load() < best.load()):
                best = c
        if best is None:
            req.cell = None
            self.sim.pending.append(req)
        else:
            self.sim._admit(best, req)

    def fill(self, c) -> None:
        """A slot may have opened on ``c``: admit from the queue."""
        pending = self.sim.pending
        while pending and self._open(c):
            req = pending.popleft()
            if not req.dead:
                self.sim._admit(c, req)

    def after_switch(self) -> None:
        pass

    def admitted(self, c, req) -> None:
        pass

    def call_done(self, c, req) -> None:
        pass

    def dropped(self, c, req) -> None:
        """A timeout removed an admitted request from ``c``."""

    def ended(self, es) -> None:
        pass

    def new_weights(self) -> None:
        pass

    def handover(self, c) -> float:
        """The cell leaves rollout: live requests go back to the front of the global queue
        (re-prefilling their context so far under ``handover_reprefill``) -> extra seconds."""
        sim = self.sim
        moved = []
        for req in sorted(c.active, key=lambda r: r.target):
            sim._detach(c, req)
            if self.cost.handover_reprefill:
                call = req.ex.ex.calls[req.call]
                req.prefill = call.prompt_tokens + call.completion_tokens - req.remaining
                req.cached = 0.0
            moved.append(req)
        if c.prefilling is not None:
            moved.append(c.prefilling)
        moved.extend(c.prefill_q)
        sim._clear(c)
        for req in reversed(moved):
            req.cell = None
            sim.pending.appendleft(req)
        for other in sorted(sim.cells, key=lambda o: o.load()):
            if other is not c:
                self.fill(other)
        return 0.0


class TokenPools(NoMemory):
    """A KV pool per cell: each execution's context stays resident, idle, between its calls.

    A request reserves its call's final context (prompt + completion) at admission; a call goes
    to the cell holding its context if that has room, else to the cell with most room (one
    needing no eviction first), where it prefills its whole prompt; the global queue is FIFO
    and its head blocks; admitting evicts idle contexts, least recently used first.
    """

    def __init__(self, sim):
        self.sim, self.cost = sim, sim.cost
        self.tol = 1e-9 * max(self.cost.kv_capacity_tokens, 1.0)
        self.peak_sum, self.peak_n = 0.0, 0  # largest reservations of the ended executions

    def _pool_tokens(self) -> float:
        """KV tokens a cell's pool holds."""
        return self.cost.kv_capacity_tokens

    def check(self, steps) -> None:
        need = max(self.need(c) for b in steps for ex in b for c in ex.calls)
        if need > self.cost.kv_capacity_tokens:
            raise ValueError(
                f"a call needs {need} KV tokens but a cell holds "
                f"{self.cost.kv_capacity_tokens:.0f} (kv_capacity_tokens): it could never run"
            )

    def capacity(self) -> float:
        """KV pool / the mean expected peak context of the outstanding executions, each the
        larger of its own largest context so far and the mean peak of those ended."""
        cost = self.cost
        prior = self.peak_sum / self.peak_n if self.peak_n else 0.0
        sizes = [max(es.peak, prior) for es in self.sim.open_es]
        sizes = [x for x in sizes if x > 0] or [prior]
        est = sum(sizes) / len(sizes)
        cap = cost.kv_capacity_tokens / est if est > 0 else 1.0
        return min(cap, cost.slots) if cost.slots > 0 else cap

    # ---- placement --------------------------------------------------------------------
    def _open(self, c) -> bool:
        slots = self.cost.slots
        return c.role == ROLLOUT and not c.switching and (slots <= 0 or c.load() < slots)

    def _live(self, c) -> float:
        """KV tokens the live requests on ``c`` reserve."""
        return c.kv_live

    def _used(self, c) -> float:
        """KV tokens taken on ``c``: live reservations and idle contexts."""
        return c.kv_live + c.kv_idle

    def _fits(self, c, need: float, evict: bool = True) -> bool:
        used = self._live(c) if evict else self._used(c)
        return used + need <= self.cost.kv_capacity_tokens + self.tol

    def _most_room(self, need: float, exclude=None, live: bool = True):
        """The cell a request (``live``) or an idle context goes to: fits (without evicting,
        for an idle one) and has most room, one that needs no eviction first; or None."""
        best, best_key = None, None
        for c in self.sim.cells:
            if c is exclude or not (
                self._open(c) if live else c.role == ROLLOUT and not c.switching
            ):
                continue
            if not self._fits(c, need, evict=live):
                continue
            key = (
                self._fits(c, need, evict=False),
                -(self._live(c) if live else self._used(c)),
                -c.i,
            )
            if best_key is None or key > best_key:
                best, best_key = c, key
        return best

    def _pick(self, req):
        home = req.ex.cell
        if home is not None and self._open(home) and self._fits(home, req.need):
            return home
        return self._most_room(req.need, exclude=home)

    def route(self, req) -> None:
        self.sim.pending.append(req)  # FIFO: behind whatever waits already
        self.fill_all()

    def fill(self, c) -> None:
        self.fill_all()

    def after_switch(self) -> None:
        self.fill_all()

    def fill_all(self) -> None:
        """Admits from the head of the global queue while the head fits somewhere."""
        pending = self.sim.pending
        while pending:
            req = pending[0]
            if req.dead:
                pending.popleft()
                continue
            c = self._pick(req)
            if c is None:
                return
            pending.popleft()
            self.sim._admit(c, req)

    # ---- contexts -------------------------------------------------------------------------
    def _forget(self, es) -> None:
        """Drops the execution's idle context from its cell."""
        c = es.cell
        if c is not None and es in c.idle:
            c.kv_idle -= c.idle.pop(es)
        es.cell, es.held = None, 0.0

    def _reserve(self, c, es, need: float) -> None:
        """``es``'s request on ``c`` reserves ``need`` tokens (idle contexts evicted to fit)."""
        c.kv_live += need
        self._evict(c)

    def _unreserve(self, c, es, need: float) -> None:
        """``es``'s request leaves ``c`` without a context there (its reservation goes)."""
        c.kv_live -= need

    def _put_idle(self, c, key, held: float) -> bool:
        """An idle context of ``held`` tokens joins ``c`` (most recently used) -> whether it
        did (it always does here: the caller checked the room)."""
        c.idle[key] = held
        c.kv_idle += held
        return True

    def _idle_items(self, c) -> list:
        """(key, tokens) of the idle contexts on ``c``, least recently used first."""
        return list(c.idle.items())

    def _clear_cell(self, c) -> None:
        """``c`` left rollout: its pool is empty."""
        c.idle.clear()
        c.kv_live = c.kv_idle = 0.0

    def _evict(self, c) -> None:
        counters = self.sim.counters
        while c.idle and c.kv_live + c.kv_idle > self.cost.kv_capacity_tokens + self.tol:
            es, held = c.idle.popitem(last=False)
            c.kv_idle -= held
            es.cell, es.held = None, 0.0
            (es if isinstance(es, ExState) else es.owner).lost.add(c)
            counters["evictions"] += 1

    def _count_reprefill(self, c, es, reuse: float, cached: float, call) -> None:
        """A call admitted away from (or after losing) its cached context re-prefills it."""
        self.sim.counters["reprefill_tokens"] += reuse - cached

    def _leave_behind(self, es, c) -> None:
        """What happens to the execution's idle context on another cell (dropped here)."""

    def _note(self, need: float) -> None:
        """An admission's reservation (the engine's capacity estimate uses them)."""

    def admitted(self, c, req) -> None:
        """Memory at admission: reuse the context if it is here, else prefill it all."""
        es, counters = req.ex, self.sim.counters
        if req.fresh:
            call = es.ex.calls[req.call]
            reuse = call.prompt_tokens - call.new_prompt_tokens
            req.cached = reuse if es.cell is c else 0
            req.prefill = call.prompt_tokens - req.cached
            if self.cost.prefill_chunk > 0:
                req.prefill = max(req.prefill, 1)
            self._count_reprefill(c, es, reuse, req.cached, call)
            if es.cell is not None and es.cell is not c:
                counters["moved_calls"] += 1
        else:  # handed over mid-call without its KV: its context so far is all re-prefilled
            counters["reprefill_tokens"] += req.prefill
        self._leave_behind(es, c)
        self._forget(es)
        es.cell, es.held, es.peak = c, req.need, max(es.peak, req.need)
        es.home = c
        self._note(req.need)
        self._reserve(c, es, req.need)

    def _idle_tokens(self, req) -> float:
        return req.need

    def call_done(self, c, req) -> None:
        """A call finished: its context stays resident, idle, most recently used."""
        es = req.ex
        c.kv_live -= req.need
        held = self._idle_tokens(req)
        c.idle[es] = held
        c.kv_idle += held
        es.cell, es.held = c, held

    def dropped(self, c, req) -> None:
        self._unreserve(c, req.ex, req.need)
        req.ex.cell, req.ex.held = None, 0.0

    def ended(self, es) -> None:
        self._forget(es)
        self._ended_peak(es)
        self.fill_all()

    def _ended_peak(self, es) -> None:
        if es.peak > 0:
            self.peak_sum += es.peak
            self.peak_n += 1

    # ---- hand-over ----------------------------------------------------------------------
    def _dest(self, es, need: float, src, live: bool):
        """Where a context leaving ``src`` goes (None: dropped, re-prefilled later)."""
        if not self.cost.handover_migrate:
            return None
        return self._most_room(need, exclude=src, live=live)

    def _hand_idle(self, es, held: float, src) -> float:
        """Hands an idle context over (migration, where it fits) -> tokens moved."""
        counters = self.sim.counters
        es.cell, es.held = None, 0.0
        dst = self._dest(es, held, src, live=False)
        if dst is None or not self._put_idle(dst, es, held):
            counters["dropped_contexts"] += 1
            return 0.0
        es.cell, es.held = dst, held
        counters["migrated_contexts"] += 1
        counters["migrated_tokens"] += held
        return held

    def handover(self, c) -> float:
        """Every resident context leaves with the cell: by migration (live requests to the
        cell with most room, idle ones where they fit without eviction) or re-prefill."""
        sim, counters = self.sim, self.sim.counters
        migrate, moved_tokens, requeue = self.cost.handover_migrate, 0.0, []
        sim._advance(c)
        for req in sorted(c.active, key=lambda r: r.target):  # decoding: move mid-call
            sim._detach(c, req)
            es, call = req.ex, req.ex.ex.calls[req.call]
            so_far = call.prompt_tokens + call.completion_tokens - req.remaining
            self._unreserve(c, es, req.need)
            es.cell, es.held = None, 0.0
            dst = self._dest(es, req.need, c, live=True)
            if dst is None:
                req.prefill, req.cached, req.fresh = so_far, 0.0, False
                requeue.append(req)
                continue
            es.cell, es.held = dst, req.need
            self._reserve(dst, es, req.need)
            req.cell = dst
            sim._join(dst, req)
            sim._record(dst)
            moved_tokens += so_far
            counters["migrated_contexts"] += 1
            counters["migrated_tokens"] += so_far
        waiting = ([c.prefilling] if c.prefilling is not None else []) + list(c.prefill_q)
        for req in waiting:  # admitted, not decoding yet: back to the queue, context handed over
            self._unreserve(c, req.ex, req.need)
            req.ex.cell, req.ex.held = None, 0.0
            if req.fresh and req.cached > 0:
                moved_tokens += self._hand_idle(req.ex, req.cached, c)
            requeue.append(req)
        for es, held in reversed(self._idle_items(c)):  # idle, most recently used first
            moved_tokens += self._hand_idle(es, held, c)
        self._clear_cell(c)
        sim._clear(c)
        self._requeue(requeue)
        return self.cost.migrate_s(moved_tokens) if migrate else 0.0

    def _requeue(self, reqs) -> None:
        """Requests handed over without a new cell go back to the front of the queue."""
        for req in reversed(reqs):
            req.cell = None
            self.sim.pending.appendleft(req)


class EnginePools(TokenPools):
    """The real engine's pool rule (``engine_pool=(max_new_tokens, max_len)``, or
    ``(max_new_tokens, max_len, page_size)`` for a paged engine, ``rollout.kv_page``).

    Each cell's accounting is a :class:`gyre.kvpool.KVPool`, the class the engine's own pool
    is (gyre/rollout/engine.py), keyed by execution (a context left behind: its
    :class:`~gyre.elastic.simstate.Stale`), of ``kv_capacity_tokens`` rounded down to whole
    pages of ``page_size`` tokens (default 1: the engine's slot layout, a page a token). So
    the rule is the engine's, not a copy: a request reserves the pages of its footprint P +
    min(max_new_tokens, max_len - P) - 1 and fits where the live reservations leave them
    (idle contexts count as free); placing it evicts idle contexts least recently used first
    (pinned ones last under resident admission) until the pages are free
    (:meth:`KVPool.claim`); its call done, it keeps the pages of its cached length P +
    completion - 1, idle, most recently used. A call goes back to the cell that served its
    execution last when that has a slot and room, else to the cell with most free slots,
    then most room, then lowest index; a context left behind (or by an ended execution)
    stays idle until evicted or cleared; new weights clear every idle context; the policy's
    capacity is min(slots, pool / mean footprint, in whole pages, of the last 4 x slots
    admissions). The cells' ``kv_live``, ``kv_idle`` and ``idle`` mirror the pools (in whole
    pages; ``idle`` in LRU order) for readers; decisions read the pools. Token counts are
    whole: a fractional one (a scaled workload's) takes the pages of its ceiling.
    """

    def __init__(self, sim, engine_pool: tuple):
        super().__init__(sim)
        if len(engine_pool) not in (2, 3):
            raise ValueError(f"engine_pool is (max_new_tokens, max_len[, page_size]), got "
                             f"{engine_pool!r}")  # fmt: skip
        self.max_new, self.max_len = engine_pool[:2]
        self.page_size = int(engine_pool[2]) if len(engine_pool) == 3 else 1
        num_pages = math.floor(self.cost.kv_capacity_tokens / max(self.page_size, 1) + 1e-9)
        self.pools = [KVPool(num_pages, self.page_size) for _ in range(sim.k)]
        self.recent: collections.deque = collections.deque(maxlen=4 * max(self.cost.slots, 1))
        self.all_es: list = []  # every dispatched execution (eviction records)

    def need(self, call) -> float:
        return footprint(call.prompt_tokens, self.max_new, self.max_len)

    def _pool_tokens(self) -> float:
        """The engine's budget: whole pages."""
        kv = self.pools[0]
        return float(kv.num_pages * kv.page_size)

    def _pages(self, tokens: float) -> int:
        """Pages that hold ``tokens`` tokens (a fraction of a token takes a whole one)."""
        return self.pools[0].pages_for(math.ceil(tokens - 1e-9))

    def check(self, steps) -> None:
        need = max(self.need(c) for b in steps for ex in b for c in ex.calls)
        if self._pages(need) > self.pools[0].num_pages:
            raise ValueError(
                f"a call needs {need} KV tokens but a cell holds {self._pool_tokens():.0f} "
                f"(kv_capacity_tokens in whole pages of {self.page_size}): it could never run"
            )

    def capacity(self) -> float:
        cost = self.cost
        if not self.recent:
            return float(cost.slots)
        cap = self._pool_tokens() * len(self.recent) / sum(self.recent)
        return min(float(cost.slots), cap) if cost.slots > 0 else cap

    def dispatched(self, es) -> None:
        self.all_es.append(es)

    # ---- the pools --------------------------------------------------------------------
    def _sync(self, c) -> None:
        """The cell's mirror of its pool (read by tests and notebooks, never by a decision)."""
        kv = self.pools[c.i]
        order = kv.lru()
        c.idle = collections.OrderedDict((k, k.held) for k in order)
        c.kv_live = float(kv.live_pages() * kv.page_size)
        c.kv_idle = float(kv.used_pages * kv.page_size) - c.kv_live

    def _live(self, c) -> float:
        kv = self.pools[c.i]
        return float(kv.live_pages() * kv.page_size)

    def _used(self, c) -> float:
        kv = self.pools[c.i]
        return float(kv.used_pages * kv.page_size)

    def _fits(self, c, need: float, evict: bool = True) -> bool:
        """Engine.can_admit's room: pages the live reservations leave (evicting idle contexts)
        or, with ``evict`` False, free pages now."""
        kv = self.pools[c.i]
        room = kv.num_pages - kv.live_pages() if evict else kv.free_pages
        return self._pages(need) <= room

    def _pinned_on(self, c):
        """Which idle contexts on ``c`` are evicted last (None: plain LRU)."""
        return None

    def _evicted(self, c, key) -> None:
        """Engine._evict: ``key``'s idle context on ``c`` goes; its execution re-prefills."""
        self.pools[c.i].release(key)
        key.cell, key.held = None, 0.0
        (key if isinstance(key, ExState) else key.owner).lost.add(c)
        self.sim.counters["evictions"] += 1

    def _claim(self, c, key, tokens: float, idle: bool) -> None:
        """``key`` gets the pages of ``tokens`` on ``c``, evicting idle contexts (LRU, pinned
        last) until they are free (Engine._claim), and runs (or, ``idle``, waits)."""
        kv = self.pools[c.i]
        kv.claim(key, 0, self._pages(tokens) * kv.page_size,
                 lambda k: self._evicted(c, k), self._pinned_on(c))  # fmt: skip
        kv.touch(key, idle=idle)
        self._sync(c)

    def _reserve(self, c, es, need: float) -> None:
        self._claim(c, es, need, idle=False)

    def _unreserve(self, c, es, need: float) -> None:
        self.pools[c.i].release(es)
        self._sync(c)

    def _put_idle(self, c, key, held: float) -> bool:
        """An idle context arriving (a hand-over): it takes its pages, evicting idle contexts
        as the engine's import does, where the live reservations leave room; else refused."""
        if not self._fits(c, held):
            return False
        self._claim(c, key, held, idle=True)
        return True

    def _idle_items(self, c) -> list:
        return [(k, k.held) for k in self.pools[c.i].lru()]

    def _clear_cell(self, c) -> None:
        kv = self.pools[c.i]
        self.pools[c.i] = KVPool(kv.num_pages, kv.page_size)
        self._sync(c)

    def _forget(self, es) -> None:
        c = es.cell
        if c is not None and self.pools[c.i].is_idle(es):
            self.pools[c.i].release(es)
            self._sync(c)
        es.cell, es.held = None, 0.0

    # ---- placement and contexts ----------------------------------------------------------
    def _pick(self, req):  # proxy._pick: affinity, then free slots, room, index
        home = req.ex.home
        if home is not None and self._open(home) and self._fits(home, req.need):
            return home
        ok = [c for c in self.sim.cells if self._open(c) and self._fits(c, req.need)]
        if not ok:
            return None
        return max(ok, key=lambda c: (self.cost.slots - c.load(), -self._live(c), -c.i))

    def _count_reprefill(self, c, es, reuse, cached, call) -> None:
        if c in es.lost:  # the engine's count: on a cell that evicted it, bar the last token
            es.lost.discard(c)
            self.sim.counters["reprefill_tokens"] += max(
                0, min(reuse, call.prompt_tokens - 1) - cached
            )

    def _leave_behind(self, es, c) -> None:
        old = es.cell
        if old is not None and old is not c and self.pools[old.i].is_idle(es):
            # the engine leaves the context where it was, idle, until evicted
            self.pools[old.i].rename(es, Stale(old, es.held, es))
            es.cell, es.held = None, 0.0
            self._sync(old)

    def _note(self, need: float) -> None:
        self.recent.append(self._pages(need) * self.page_size)

    def _idle_tokens(self, req) -> float:
        """The slot's cached length: the last token is not fed back (within the footprint:
        a completion past max_new_tokens is not the engine's)."""
        call = req.ex.ex.calls[req.call]
        return min(call.prompt_tokens + call.completion_tokens - 1, req.need)

    def call_done(self, c, req) -> None:
        """Engine._end: the request's pages shrink to its context, idle, most recently used."""
        es, held = req.ex, self._idle_tokens(req)
        kv = self.pools[c.i]
        tokens = self._pages(held) * kv.page_size
        kv.resize(es, tokens, tokens)
        kv.touch(es, idle=True)
        es.cell, es.held = c, held
        self._sync(c)

    def ended(self, es) -> None:  # the engine keeps the context, idle, until evicted
        self._ended_peak(es)
        self.fill_all()

    def new_weights(self) -> None:
        """New weights clear every idle context (not evictions) and the eviction records."""
        for c in self.sim.cells:
            kv = self.pools[c.i]
            for key in kv.lru():
                kv.release(key)
                key.cell, key.held = None, 0.0
            self._sync(c)
        for es in self.all_es:
            es.lost.clear()


class ResidentPools(TokenPools):
    """Token pools with resident admission (``CostModel.resident_admission``).

    An execution is admitted to one cell with a reservation (:class:`ResidentAdmission`) and
    its context stays there, never evicted, until it ends; each later call grows the
    reservation on that cell or waits. Waiting calls of admitted executions go first (a cell
    where one waits admits no new execution); new executions wait in FIFO order, the head
    blocking. A cell with nothing running whose oldest waiting call cannot grow preempts its
    youngest execution (its context is dropped, its next call starts over as a new one). A
    cell leaving rollout moves each reservation, with its context, to the open cell with most
    room (``handover_migrate``), or drops it.
    """

    def __init__(self, sim, *pool):
        super().__init__(sim, *pool)
        self.ledger = ResidentAdmission(sim.k, self._pool_tokens(), self._slots())
        self.waiting: collections.deque = collections.deque()  # calls of admitted executions
        self.moving: dict = {}  # during a hand-over: execution -> its new cell index or None

    def _slots(self) -> int:
        """Executions a cell admits at most (0: no cap)."""
        return 0

    def kv_room(self) -> dict:
        return self.ledger.room(range(self.sim.k))

    def _can_place(self, c, req) -> bool:
        """Whether ``c`` can take the request now (beside the ledger's own room)."""
        return self._open(c)

    def route(self, req) -> None:
        (self.waiting if self.ledger.holds(req.ex) else self.sim.pending).append(req)
        self.fill_all()

    def fill_all(self) -> None:
        sim, led, cells = self.sim, self.ledger, self.sim.cells
        blocked: set = set()
        while True:
            blocked, kept = set(), collections.deque()
            while self.waiting:
                req = self.waiting.popleft()
                if req.dead:
                    continue
                c = cells[led.cell_of(req.ex)]
                if c.i in blocked or not self._can_place(c, req) or not led.grow(req.ex, req.need):
                    blocked.add(c.i)
                    kept.append(req)
                    continue
                sim._admit(c, req)
            self.waiting = kept
            stuck = [
                cells[i] for i in sorted(blocked) if self._open(cells[i]) and not cells[i].load()
            ]
            if not stuck:
                break
            for c in stuck:
                self._preempt(c)
        pending = sim.pending
        while pending:
            req = pending[0]
            if req.dead:
                pending.popleft()
                continue
            open_ = [c.i for c in cells if c.i not in blocked and self._can_place(c, req)]
            i = led.admit(req.ex, req.need, open_)
            if i is None:
                return
            pending.popleft()
            sim._admit(cells[i], req)

    def _preempt(self, c) -> None:
        """Frees the youngest reservation on ``c``: its idle context is dropped and its
        waiting call, if any, starts over as a new execution."""
        es = self.ledger.youngest(c.i)
        self.ledger.preempt(es)
        self.sim.counters["preemptions"] += 1
        if es.cell is c and es in c.idle:
            self._forget(es)
            self.sim.counters["evictions"] += 1
        self._unadmitted()

    def _unadmitted(self) -> None:
        """Waiting calls whose execution lost its reservation go to the front of the queue."""
        lost = [r for r in self.waiting if not self.ledger.holds(r.ex)]
        if lost:
            self.waiting = collections.deque(r for r in self.waiting if self.ledger.holds(r.ex))
            for req in reversed(lost):
                self.sim.pending.appendleft(req)

    def _dest(self, es, need: float, src, live: bool):
        i = self.moving.get(es)
        return None if i is None else self.sim.cells[i]

    def _requeue(self, reqs) -> None:
        for req in reversed(reqs):
            req.cell = None
            (self.waiting if self.ledger.holds(req.ex) else self.sim.pending).appendleft(req)

    def _receivers(self, c) -> list[int]:
        """Cells a reservation leaving ``c`` may move to."""
        return [o.i for o in self.sim.cells if o is not c and self._open(o)]

    def handover(self, c) -> float:
        cells = self._receivers(c)
        self.moving = {}
        for es in self.ledger.keys_on(c.i):
            if self.cost.handover_migrate:
                self.moving[es] = self.ledger.move(es, cells)
            else:
                self.ledger.preempt(es)
        extra = super().handover(c)
        self.moving = {}
        self._unadmitted()
        return extra

    def ended(self, es) -> None:
        self.ledger.release(es)
        super().ended(es)


class EngineResidentPools(ResidentPools, EnginePools):
    """The real engine's pool rule with the proxy's resident admission (``engine_pool`` and
    ``resident_admission``; gyre/rollout/proxy.py ``admission="resident"``).

    The ledger is :class:`ResidentAdmission` (the proxy's rule, not a copy) over cells of
    the pool's tokens (``kv_capacity_tokens`` in whole pages, the engine's budget) with at
    most ``slots`` admitted executions each; a reservation is
    the call's footprint P + min(max_new_tokens, max_len - P) - 1 (or the mean peak of the
    executions ended so far if larger), grown per call on the execution's own cell. A call
    is placed where the engine can take it now (a free slot, live footprints + its own within
    the pool) and the ledger has room; calls of admitted executions go first (a cell where
    one waits admits no new execution), new executions FIFO with the head blocking; a cell
    where a growth waits with nothing running preempts its youngest execution (its context
    stays, idle and unpinned; counted in ``preemptions``, not as an eviction). The pool
    evicts idle contexts least recently used first, those of executions admitted to that
    cell (pinned) last (``pinned_evictions`` counts those; none while the reservations fit
    the pool; :meth:`KVPool.lru` with the ledger as ``pinned``): contexts of ended, preempted
    or moved-away executions go first, and count as evictions. New weights clear every idle context (reservations stay), and an execution
    that made no call over a whole weight version and has none outstanding loses its
    reservation then (``expired``). A cell leaving rollout loses its idle contexts
    (``dropped_contexts``); its reservations move to the rollout cell with most room
    (``handover_migrate``, a live call with its reservation where that cell can take it now,
    else the call is retried as a new execution's) or are dropped (re-prefill).
    """

    def __init__(self, sim, engine_pool: tuple):
        super().__init__(sim, engine_pool)
        self.called: set = set()  # executions with a call since the last new weights

    def _slots(self) -> int:
        return max(self.cost.slots, 0)

    def _can_place(self, c, req) -> bool:  # Engine.can_admit: a free slot and pool room
        return self._open(c) and self._fits(c, req.need)

    def _receivers(self, c) -> list[int]:  # the proxy's rollout cells
        return [o.i for o in self.sim.cells if o is not c and o.role == ROLLOUT and not o.switching]

    def _pinned(self, key, c) -> bool:
        led = self.ledger
        return isinstance(key, ExState) and led.holds(key) and led.cell_of(key) == c.i

    def route(self, req) -> None:
        self.called.add(req.ex)
        super().route(req)

    def _pinned_on(self, c):
        """Engine.pinned (the proxy's ledger): contexts of executions admitted to ``c``."""
        return lambda key: self._pinned(key, c)

    def _evicted(self, c, key) -> None:
        self.sim.counters["pinned_evictions"] += self._pinned(key, c)
        super()._evicted(c, key)

    def _preempt(self, c) -> None:
        """Frees the youngest reservation on ``c``; its context stays there, idle, unpinned."""
        self.ledger.preempt(self.ledger.youngest(c.i))
        self.sim.counters["preemptions"] += 1
        self._unadmitted()

    def _dest(self, es, need: float, src, live: bool):
        dst = super()._dest(es, need, src, live)
        if live and dst is not None and not (self._open(dst) and self._fits(dst, need)):
            dst = None  # the proxy retries a live call its reservation's cell cannot take now
        if live and dst is None and self.ledger.holds(es):
            self.ledger.preempt(es)
        return dst

    def _hand_idle(self, es, held: float, src) -> float:
        """Only a placed call's cached prefix moves with it; idle contexts are lost."""
        if isinstance(es, ExState) and es.req is not None and es.req.cell is src:
            return super()._hand_idle(es, held, src)
        es.cell, es.held = None, 0.0
        self.sim.counters["dropped_contexts"] += 1
        return 0.0

    def new_weights(self) -> None:
        """Idle contexts go (reservations stay); those of executions with no call since the
        last weights and none outstanding expire (Proxy._expire)."""
        super().new_weights()
        led = self.ledger
        for es in [k for i in range(self.sim.k) for k in led.keys_on(i)]:
            if es not in self.called and es.req is None:
                led.preempt(es)
                self.sim.counters["expired"] += 1
        self.called = set()
        self._unadmitted()
        self.fill_all()
