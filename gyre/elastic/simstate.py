"""The simulator's mutable records: a model call, a cell, an execution (gyre/elastic/sim.py).

Plain slotted classes: the event loop and the memory strategies (gyre/elastic/memory.py)
read and write their fields directly. Token counts are floats (fluid decode).
"""

from __future__ import annotations

import collections


class Req:
    """One model call of an execution, from its issue to its last token."""

    __slots__ = ("ex", "call", "ctx", "prefill", "new", "remaining", "target", "cell", "dead",
                 "need", "cached", "fresh")  # fmt: skip

    def __init__(self, ex, call, ctx, prefill, remaining, need=0.0, cached=0.0):
        self.ex, self.call, self.ctx = ex, call, ctx  # ctx: mean context while decoding
        self.prefill, self.remaining = prefill, remaining  # tokens still to prefill / decode
        self.new = prefill  # the call's own uncached tokens, credited as work once prefilled
        self.target, self.cell, self.dead = 0.0, None, False
        self.need = need  # KV tokens reserved while live (memory model)
        self.cached = cached  # tokens already in KV before its prefill (the attention offset)
        self.fresh = True  # a call not yet decoding: its prefill is set where it is admitted


class Cell:
    """A cell: its role, its decoding requests (fluid clock ``v``: tokens each has made), its
    prefill queue, its micro-batch when training, and its KV pool (memory model)."""

    __slots__ = ("i", "role", "switching", "pending_role", "active", "heap", "ctx_sum", "v",
                 "last_t", "prefill_q", "prefilling", "epoch", "micro", "micro_ctx", "state",
                 "since", "kv_live", "kv_idle", "idle", "loading", "load_pending", "load_seq",
                 "pf_step_s", "pf_target")  # fmt: skip

    def __init__(self, i, role, now):
        self.i, self.role, self.switching, self.pending_role = i, role, False, None
        self.active, self.heap, self.ctx_sum, self.v, self.last_t = set(), [], 0.0, 0.0, now
        self.prefill_q, self.prefilling, self.epoch, self.micro = collections.deque(), None, 0, None
        self.micro_ctx = 0.0
        self.state, self.since = (role, "idle"), now
        # Memory model: reserved by live requests, held by idle contexts (LRU, oldest first).
        self.kv_live, self.kv_idle, self.idle = 0.0, 0.0, collections.OrderedDict()
        self.loading, self.load_pending, self.load_seq = False, False, 0
        self.pf_step_s, self.pf_target = 0.0, 0.0  # mixed_chunk: the running prefill's share

    def load(self) -> int:
        """Requests the cell holds: decoding, prefilling and queued for prefill."""
        return len(self.active) + len(self.prefill_q) + (self.prefilling is not None)


class Stale:
    """engine_pool: an execution's idle context left on a cell its next call did not go to."""

    __slots__ = ("cell", "held", "owner")

    def __init__(self, cell, held, owner):
        self.cell, self.held, self.owner = cell, held, owner


class ExState:
    """One dispatched execution: its next call, its live request and its resident context."""

    __slots__ = ("ex", "start", "call", "req", "tokens", "ended", "started", "cell", "held",
                 "tok_ctx", "peak", "home", "lost", "admitted")  # fmt: skip

    def __init__(self, ex, start):
        self.ex, self.start, self.call, self.req = ex, start, 0, None
        self.tokens, self.ended, self.started = 0.0, False, False
        self.cell, self.held = None, 0.0  # memory model: the cell holding its context, tokens
        self.tok_ctx, self.peak = 0.0, 0.0  # sum of its tokens' contexts; largest reservation
        self.home, self.lost = None, set()  # engine_pool: last cell served; cells that evicted it
        self.admitted = False  # resident admission: holds a reservation on ``cell``
