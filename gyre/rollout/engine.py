"""Rollout engine: one per rollout cell, a slot or paged KV cache, a KV pool, continuous batching.

The cache holds ``slots`` sequences of up to ``max_len`` tokens ({'k': L x [S, KVH, Dh, M],
'v': L x [S, KVH, M, Dh]}, gyre.model.decoder.CACHE_AXES; slots over the cell's 'data' axis
via logical 'batch', kv heads over 'model'). The jit programs of a cell
(:class:`gyre.rollout.programs.Programs`) each have one fixed shape: a prefill of one
``prefill_chunk`` for each of up to ``slots`` slots, and a decode loop of up to
``decode_steps`` tokens (:func:`~gyre.rollout.programs.loop_steps`) for every slot at once
(inactive slots write nowhere and their outputs are ignored). The engine is driven by
explicit :meth:`Engine.step` calls, so it is deterministic; the proxy drives engines from
asyncio. Between two steps requests join and leave slots, weights change
(:meth:`Engine.set_weights`) and live requests move to other cells (:meth:`Engine.export`,
:meth:`Engine.import_`, :meth:`Engine.cancel`).

Multi-turn reuse: a finished slot keeps its tokens' KV as an idle *context* of its execution
(an execution waiting on a tool keeps its context resident). A new prompt goes to the idle
slot with the longest common token prefix, the slot is rewound to that prefix and only the
suffix is prefilled (a retry resuming from an earlier point is the same rewind). Another
execution's context counts for that choice only when the new prompt extends all of it;
otherwise empty slots come first, then the least recently used context (contexts the proxy
pins, :attr:`Engine.pinned`, last).

KV pool. Each cell has a budget of ``budget`` tokens (``rollout.kv_tokens``; 0 = derived, see
:func:`pool_budget`). Its charge: a live request reserves its :func:`footprint` (prompt +
``max_new`` - 1: every token its slot can come to hold, the last sampled token is never fed
back) from admission to its end; an idle context costs its cached length. Admission rule:
a queued request enters a slot only when the live reservations plus its own fit the budget;
idle contexts are then evicted, least recently used first (pinned ones last: the proxy's
resident admission, gyre/rollout/proxy.py), until live reservations plus idle lengths fit
again. So the pool never overflows mid-decode, and a request that does not
fit waits (FIFO: in the engine's queue, or in the proxy, which submits only what
:meth:`Engine.can_admit`). A request whose footprint exceeds the whole budget is a
ValueError at submission. An evicted execution that comes back prefills again what was
lost (``reprefilled_tokens``).

The accounting is :class:`gyre.kvpool.KVPool`'s (pages, page tables, reference
counts, LRU order; slots are its keys), in whole pages. Two memories:

- The slot layout (``rollout.kv_page`` 0): memory is allocated as ``slots`` x ``max_len``
  (fixed shapes, one compile) and the pool counts a page per token, an accounting cap that
  admits and evicts the way a paged pool of that many tokens would. A prefix another slot
  serves is copied (``copy_slot``); a slot is one contiguous context.
- Paged (``rollout.kv_page`` = N > 0): memory is the pool, ``num_pages`` pages of N tokens
  ({'k': L x [N_pages, KVH, Dh, N], 'v': L x [N_pages, KVH, N, Dh]}, docs/sharding.md), its size
  from ``kv_tokens`` or device memory (:func:`paged_pool_pages`), and slots bound only
  concurrency. A live request holds the pages of its footprint from admission (so decode
  never runs out of pages), an idle context the pages of its length. The prompt a slot shares
  with another's resident context (the samples of one task, a retry that rewinds, another
  execution's prefix) is shared by reference: the full pages, with the last partial page
  copied (copy on write: a slot writes only pages it holds alone). Prefill and decode read
  each slot's pages through its page table; export/import (of a live request, or of an idle
  context: :meth:`Engine.export_context`) move its pages only.

Weight updates keep in-flight requests: KV computed by an older version stays in the cache
(standard practice); each completion token records the version whose logits sampled it.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import time
from collections.abc import Callable

import jax
import numpy as np

from gyre import kvpool
from gyre import mesh as gmesh
from gyre.kvpool import KVPool
from gyre.rollout.programs import (
    MAX_STOP_TOKENS,
    Programs,
    RolloutSpec,
    loop_steps,
    programs_for,
)
from gyre.rollout.types import GenerateRequest, GenerateResponse

# Share of each device's memory kept out of a derived KV budget (activations, compiler scratch).
KV_RESERVE = 0.1
# Evicted contexts remembered per engine (for re-prefill accounting), oldest forgotten first.
EVICTED_RECORDS = 1024


def request_name(request: GenerateRequest) -> str:
    return f"request (execution {request.execution_id!r}, call {request.call_id})"


def footprint(request: GenerateRequest, max_len: int) -> int:
    """KV tokens a request's slot can come to hold: its prompt and every completion token but the
    last (which is returned, never fed back), with the completion capped so it fits ``max_len``."""
    return kvpool.footprint(len(request.prompt), request.max_new_tokens, max_len)


def kv_budget_tokens(
    device_bytes: float, weight_bytes: float, reserve_bytes: float, bytes_per_token: float
) -> int:
    """Tokens of K/V that fit in a device's memory after the weights and a reserve (>= 0)."""
    if bytes_per_token <= 0:
        raise ValueError(f"bytes_per_token must be > 0, got {bytes_per_token}")
    return max(0, int((device_bytes - weight_bytes - reserve_bytes) // bytes_per_token))


def _shard_bytes(x) -> int:
    return math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize


def pool_budget(kv_tokens: int, cache, weights, devices) -> int:
    """A cell's KV budget in tokens, at most ``slots * max_len`` (what the cache holds).

    ``kv_tokens`` > 0: that many. 0: where every device reports its memory
    (``memory_stats()['bytes_limit']``), the tokens that fit in the smallest device after its
    shard of the rollout weights and ``KV_RESERVE`` of its memory (per device: the cache rows
    of one data shard, so x the number of data shards); on CPU (no memory figure): slots *
    max_len. The trainer's state on a cell that also trains is not subtracted.
    """
    v = cache["v"]  # L arrays [S, KVH, M, Dh] (K's hold as many bytes, positions minor)
    slots, max_len = v[0].shape[0], v[0].shape[2]
    physical = slots * max_len
    if kv_tokens > 0:
        return min(kv_tokens, physical)
    limits = [(d.memory_stats() or {}).get("bytes_limit") for d in devices]
    if not limits or any(b is None for b in limits):
        return physical
    shard = v[0].sharding.shard_shape(v[0].shape)
    per_token = 2 * sum(map(_shard_bytes, v)) // (shard[0] * shard[2])  # k, v of every layer
    weight_bytes = sum(_shard_bytes(x) for x in jax.tree.leaves(weights))
    per_device = kv_budget_tokens(min(limits), weight_bytes, KV_RESERVE * min(limits), per_token)
    return min(physical, per_device * (slots // shard[0]))


def paged_pool_pages(r: RolloutSpec, cell: gmesh.Cell, devices=None) -> int:
    """Pages of ``r.kv_page`` tokens in a paged cell's pool (a multiple of the cell's 'data'
    size, the pages' shards, and at least one per shard).

    ``r.kv_tokens`` > 0: that many tokens. 0: where every device reports its memory
    (``memory_stats()['bytes_limit']``), the tokens that fit in the smallest device after its
    shard of the rollout weights and ``KV_RESERVE`` of its memory, x the data shards; on CPU
    (no memory figure) slots * max_len, the memory of the slot layout."""
    from gyre.model import decoder as gdec

    data = cell.mesh.shape["data"]
    tokens = r.kv_tokens
    if tokens <= 0:
        devices = cell.devices if devices is None else devices
        limits = [(d.memory_stats() or {}).get("bytes_limit") for d in devices]
        if not limits or any(b is None for b in limits):
            tokens = r.slots * r.max_len
        else:
            m = r.model
            kvh = m.num_kv_heads // cell.mesh.shape["model"]
            per_token = 2 * m.num_layers * kvh * m.head_dim * np.dtype(m.dtype).itemsize
            _, abstract = gdec.abstract_model(m)
            shardings = gdec.state_shardings(m, cell, "rollout")
            weight_bytes = sum(
                math.prod(sh.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
                for x, sh in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings))
            )
            lim = min(limits)
            tokens = kv_budget_tokens(lim, weight_bytes, KV_RESERVE * lim, per_token) * data
    return max(data, tokens // r.kv_page // data * data)


def validate_request(request: GenerateRequest, vocab_size: int, max_len: int) -> np.ndarray:
    """-> the prompt as int32[P]; raises ValueError naming the request for unusable input."""
    name = request_name(request)
    prompt = np.asarray(request.prompt)
    if prompt.ndim != 1 or prompt.size == 0 or not np.issubdtype(prompt.dtype, np.integer):
        raise ValueError(f"{name}: prompt must be a non-empty 1-D integer array, got {prompt!r}")
    if prompt.size >= max_len:
        raise ValueError(
            f"{name}: prompt of {prompt.size} tokens does not fit the cache (max_len {max_len})"
        )
    bad = prompt[(prompt < 0) | (prompt >= vocab_size)]
    if bad.size:
        raise ValueError(
            f"{name}: token id {int(bad[0])} is outside the vocabulary [0, {vocab_size})"
        )
    if request.max_new_tokens < 1:
        raise ValueError(f"{name}: max_new_tokens must be >= 1, got {request.max_new_tokens}")
    if len(request.stop_tokens) > MAX_STOP_TOKENS:
        raise ValueError(
            f"{name}: {len(request.stop_tokens)} stop tokens, at most {MAX_STOP_TOKENS} "
            "(gyre/rollout/programs.py MAX_STOP_TOKENS)"
        )
    if request.temperature is not None and request.temperature < 0:
        raise ValueError(f"{name}: temperature must be >= 0, got {request.temperature}")
    return prompt.astype(np.int32)


@dataclasses.dataclass
class Live:
    """Host state of one running request (its 'sampler state' is the request identity)."""

    rid: int
    request: GenerateRequest
    prompt: np.ndarray  # int32[P]
    temperature: float
    max_new: int  # capped so that prompt + completion fits the cache
    tokens: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    versions: list = dataclasses.field(default_factory=list)

    @property
    def reserve(self) -> int:
        """Pool tokens held from admission to the end: see :func:`footprint`."""
        return self.prompt.size + self.max_new - 1

    def response(self, reason: str) -> GenerateResponse:
        return GenerateResponse(
            np.asarray(self.tokens, np.int32),
            np.asarray(self.logprobs, np.float32),
            np.asarray(self.versions, np.int32),
            reason,
        )


class Slot:
    """Host view of one cache slot: the tokens whose K/V it holds at positions 0..length-1."""

    def __init__(self, max_len: int, index: int = 0):
        self.index = index  # its row in the programs' batch, its key in the KV pool
        self.buf = np.zeros(max_len, np.int32)  # preallocated: appending a token is O(1)
        self.length = 0
        self.live: Live | None = None
        self.last_used = -1
        self.owner: str | None = None  # execution whose context the slot holds
        # Leading tokens whose K/V the current weights computed (a source for other slots'
        # prompts only up to here: see Engine._share_prefixes).
        self.clean = 0

    @property
    def held(self) -> np.ndarray:
        return self.buf[: self.length]

    def write(self, start: int, tokens: np.ndarray) -> None:
        """Records tokens whose K/V the current weights just wrote at start.."""
        self.buf[start : start + tokens.size] = tokens
        self.length = start + tokens.size
        self.clean = self.length if self.clean >= start else self.clean

    def rewind(self, length: int) -> None:
        self.length = length
        self.clean = min(self.clean, length)


@dataclasses.dataclass
class SlotExport:
    """A live request lifted out of its slot: host state plus its KV rows (source cell)."""

    live: Live
    held: np.ndarray
    rows: dict | None  # {'k': L x [1, KVH, Dh, M], 'v': L x [1, KVH, M, Dh]}; None if queued


@dataclasses.dataclass
class ContextExport:
    """An idle context lifted out of its slot: its execution, tokens, the weights version
    that computed its K/V and the K/V itself (source cell). Paged: the pages of its tokens
    and only them ({'k': L x [n, KVH, Dh, ps], 'v': L x [n, KVH, ps, Dh]}, n = its length in
    pages); the slot layout: its slot's row."""

    owner: str
    held: np.ndarray
    version: int
    rows: dict


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class Engine:
    """Continuous-batching inference of ``spec`` on one cell, over a KV pool of ``budget`` tokens.

    ``stats`` counters (cumulative, never reset; the proxy sums them over cells):
    prompt_tokens and reused_tokens (prompt tokens admitted / served from cached KV),
    generated, prefill_chunks, decode_steps, imported, admitted (requests placed in a slot from
    the queue), evictions (idle contexts dropped: to free budget for an admission or import,
    or their slot taken by another execution whose prompt does not extend them; a rewind of the
    execution's own context, new weights and a suspend are not evictions), evicted_tokens
    (cached tokens those evictions dropped) and reprefilled_tokens: when a call of an execution
    is placed on this cell after one of its contexts was evicted here, the prompt tokens (bar
    the last) that the evicted context had held and that the placement could not reuse,
    ``max(0, min(common prefix of prompt and evicted context, P - 1) - reused)``; once per
    eviction record (the latest per execution, ``EVICTED_RECORDS`` kept). A call that comes
    back on another cell counts nothing here.
    """

    def __init__(self, spec: RolloutSpec, cell: gmesh.Cell, state, version: int = 0):
        r = spec
        self.cell, self.vocab_size = cell, spec.model.vocab_size
        self.num_slots, self.max_len, self.chunk = r.slots, r.max_len, r.prefill_chunk
        # Paged memory (rollout.kv_page > 0): a pool of pages that slots hold by page tables.
        self.paged = r.kv_page > 0
        num_pages = paged_pool_pages(r, cell) if self.paged else 0
        self.temperature = float(r.temperature)
        self.decode_steps = loop_steps(r)  # tokens per decode dispatch (auto resolved)
        # Called after each program with (kind, figures): 'prefill' {seconds, rows, tokens}
        # and 'decode' {seconds, rows, steps, context_tokens} (benchmarks, calibration).
        self.on_timing: Callable[[str, dict], None] | None = None
        self.programs: Programs = programs_for(spec, cell, num_pages)
        self.weights = self._serving(state)
        self.version = version
        self._rids = itertools.count()
        self._clock = itertools.count()
        self.queue: collections.deque[Live] = collections.deque()
        self.stats = collections.Counter()
        self.recent: collections.deque[int] = collections.deque(maxlen=4 * r.slots)
        self.evicted: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()
        self.on_admit: Callable[[int], None] | None = None  # called with a rid at admission
        # Whether an execution's idle context is one to keep resident (the proxy's admission
        # ledger, gyre/rollout/proxy.py): such contexts are evicted or cut last. None: plain LRU.
        self.pinned: Callable[[str], bool] | None = None
        self.cache = self.kv = self.budget = None
        self.resume()
        if self.paged:
            self.budget = num_pages * r.kv_page
        else:
            self.budget = pool_budget(r.kv_tokens, self.cache, self.weights, cell.devices)
        self.kv = self._new_pool()

    # ------------------------------------------------------------------ lifecycle and weights

    def _new_pool(self) -> KVPool:
        """The pool's accounting: pages of ``kv_page`` tokens, or for the slot layout a page a
        token (the same rule over ``budget`` tokens; the memory stays slots x max_len)."""
        if self.paged:
            return KVPool(self.programs.num_pages, self.programs.page_size)
        return KVPool(self.budget, 1)

    def resume(self, state=None, version: int | None = None) -> None:
        """(Re)allocates an empty cache; optionally installs weights."""
        self.cache = self.programs.new_cache()
        self.slots = [Slot(self.max_len, i) for i in range(self.num_slots)]
        self.kv = self._new_pool() if self.budget is not None else None
        self._table_at = None  # (pool version, page tables) last sent to the device
        self.evicted.clear()
        if state is not None:
            self.set_weights(state, self.version if version is None else version)

    def warmup(self) -> None:
        """Compiles (or loads from the persistent cache) every program now, not on first use:
        prefill, the decode loop (or step), the slot copy.

        Runs them with every write aimed past the cache (dropped), so no slot changes.
        """
        s = self.num_slots
        idle, zero = np.full(s, self.max_len, np.int32), np.zeros(s, np.int32)
        tokens = np.zeros((s, self.chunk), np.int32)
        tab = self._tables()
        self.cache, _, _ = self.programs.prefill(
            self.weights, self.cache, tokens, idle, zero, zero, *_identity([None] * s), s, *tab
        )
        if self.decode_steps == 1:
            self.cache, _, _ = self.programs.decode(
                self.weights, self.cache, zero, idle, *_identity([None] * s), *tab
            )
        else:
            stops = np.full((s, MAX_STOP_TOKENS), -1, np.int32)
            self.cache, *_ = self.programs.decode_loop(
                self.weights, self.cache, zero, idle, zero, stops, *_identity([None] * s), False,
                *tab,
            )  # fmt: skip
        self.cache = self.programs.copy_slot(self.cache, np.int32(0), np.int32(0))

    def suspend(self) -> None:
        """Frees the cache (the cell leaves rollout). Every live request must be gone first."""
        if self.num_live:
            raise RuntimeError(
                f"cell {self.cell.index}: suspend with {self.num_live} live requests"
            )
        self.cache, self.slots, self.kv = None, [], None
        self.evicted.clear()

    def set_weights(self, state, version: int) -> None:
        """Installs new weights between steps; in-flight requests continue with them.

        Idle slots forget their cached prefixes: that K/V came from the old weights, and
        reusing it would make a later request's tokens depend on which weights served an
        unrelated earlier one. (Not evictions: every cell forgets them alike.)
        """
        self.weights = self._serving(state)
        self.version = int(version)
        for i, slot in enumerate(self.slots):
            slot.clean = 0  # K/V in the cache is the old weights'
            if slot.live is None:
                self._rewind(i, 0)
                slot.owner = None
        self.evicted.clear()

    def wait_ready(self) -> None:
        """Blocks until the weights and the KV cache are on the cell's devices."""
        jax.block_until_ready((self.weights, self.cache))

    def lost_calls(self) -> None:
        """A cell in this process is never lost (a Ray actor's can be: gyre/cluster/)."""
        return None

    def lose(self) -> None:
        raise RuntimeError(f"cell {self.cell.index} runs in this process and cannot be lost")

    def _serving(self, state):
        """The stacked parameter state -> the weights the programs read, in this cell's
        rollout layout (one dict per layer: made here once, not in every decode dispatch)."""
        return self.programs.serving_weights(gmesh.move(state, self.programs.state_sh))

    # ------------------------------------------------------------------ the KV pool

    def room(self) -> int:
        """Tokens a new request may still reserve: the budget less the reservations of live and
        queued requests, in whole pages (idle contexts count as free: they are evicted on
        demand; live pages: :meth:`KVPool.live_pages`, a page shared counted once)."""
        if self.kv is None:  # suspended
            return self.budget
        queued = sum(self.kv.pages_for(lv.reserve) for lv in self.queue)
        return (self.kv.num_pages - self.kv.live_pages() - queued) * self.kv.page_size

    def can_admit(self, request: GenerateRequest) -> bool:
        """True when ``request`` submitted now is placed at the next step (a slot and room)."""
        return self.free_slots() > 0 and footprint(request, self.max_len) <= self.room()

    def capacity_contexts(self) -> float:
        """Requests the pool holds at once at their recent size: min(slots, budget / mean
        footprint, in whole pages, of the last 4 x slots admissions on this cell); slots
        before any."""
        if not self.recent:
            return float(self.num_slots)
        return min(float(self.num_slots), self.budget * len(self.recent) / sum(self.recent))

    def pool(self) -> dict:
        """Current figures: budget, reserved (the pool's used pages in tokens: live
        reservations + idle contexts, a page shared counted once; <= budget), resident tokens
        (cached lengths, a shared prefix counted per context) and contexts (live slots + idle
        slots holding tokens), queued requests, capacity_contexts, and the pages: page_size,
        pages, pages_used (the slot layout: a page a token, its memory stays slots x max_len)."""
        live = sum(s.live is not None for s in self.slots)
        idle = sum(s.live is None and s.length > 0 for s in self.slots)
        kv = self.kv
        return {
            "budget_tokens": self.budget,
            "reserved_tokens": kv.footprint_tokens() if kv else 0,
            "resident_tokens": sum(s.length for s in self.slots),
            "resident_contexts": live + idle,
            "live_contexts": live,
            "idle_contexts": idle,
            "queued": len(self.queue),
            "capacity_contexts": self.capacity_contexts(),
            "page_size": kv.page_size if kv else 0,
            "pages": kv.num_pages if kv else 0,
            "pages_used": kv.used_pages if kv else 0,
        }

    def kv_bytes(self) -> int:
        """Device bytes of K/V the pool's used pages hold (paged; the slot layout: its whole
        cache, slots x max_len, whatever it holds)."""
        if not self.paged:
            return self.num_slots * self.programs.page_bytes
        return self.kv.used_pages * self.programs.page_bytes

    def _rewind(self, i: int, length: int) -> None:
        """Slot ``i`` keeps its first ``length`` tokens; pages past them go back to the pool."""
        self.slots[i].rewind(length)
        self.kv.resize(i, length, length)

    def _end(self, i: int) -> None:
        """Slot ``i``'s request left: its reservation shrinks to its context, idle now."""
        slot = self.slots[i]
        slot.live, slot.last_used = None, next(self._clock)
        self.kv.resize(i, slot.length, slot.length)
        self.kv.touch(i, idle=True)

    def _evict(self, slot: Slot, keep: int = 0) -> None:
        """Drops an idle context past its first ``keep`` tokens, remembering what it held."""
        if slot.owner is not None:
            self.evicted[slot.owner] = slot.held.copy()
            self.evicted.move_to_end(slot.owner)
            while len(self.evicted) > EVICTED_RECORDS:
                self.evicted.popitem(last=False)
        self.stats["evictions"] += 1
        self.stats["evicted_tokens"] += slot.length - keep
        self._rewind(slot.index, keep)
        slot.owner = None

    def _pinned(self, slot: Slot) -> bool:
        """Whether ``slot``'s idle context is one the proxy keeps resident (:attr:`pinned`)."""
        return self.pinned is not None and slot.owner is not None and self.pinned(slot.owner)

    def _claim(self, i: int, keep: int, total: int) -> None:
        """Slot ``i`` (idle, holding ``keep`` tokens) gets pages for ``total`` tokens, every
        one it will write its own: idle contexts but its own are evicted, least recently used
        first (pinned ones last, :meth:`KVPool.lru`), until the pool has the pages; a shared
        last page is copied on write."""
        self._copy_pages(self.kv.claim(i, keep, total, lambda j: self._evict(self.slots[j]),
                                       pinned=lambda j: self._pinned(self.slots[j])))  # fmt: skip

    def _copy_pages(self, copies) -> None:
        for src, dst in copies:
            self.cache = self.programs.copy_page(self.cache, np.int32(src), np.int32(dst))

    def _tables(self) -> tuple:
        """The programs' page-table argument: () for the slot layout; paged, (int32[S, P],)
        each slot's pages, entries past them the page count (writes there are dropped)."""
        if not self.paged:
            return ()
        if self._table_at is None or self._table_at[0] != self.kv.version:
            table = np.full((self.num_slots, self.programs.table_pages), self.kv.num_pages,
                            np.int32)  # fmt: skip
            for i, pages in self.kv.tables.items():
                table[i, : len(pages)] = pages
            self._table_at = (self.kv.version, table)
        return (self._table_at[1],)

    # ------------------------------------------------------------------ requests in and out

    @property
    def num_live(self) -> int:
        return len(self.queue) + sum(s.live is not None for s in self.slots)

    def free_slots(self) -> int:
        return sum(s.live is None for s in self.slots) - len(self.queue)

    def live_ids(self) -> list[int]:
        return [lv.rid for lv in self.queue] + [s.live.rid for s in self.slots if s.live]

    def submit(self, request: GenerateRequest, rid: int | None = None) -> int:
        """Queues a request (joins a slot at the first step with a slot and room for it);
        raises ValueError for bad input and for a request larger than the whole pool."""
        prompt = validate_request(request, self.vocab_size, self.max_len)
        temp = self.temperature if request.temperature is None else float(request.temperature)
        max_new = min(request.max_new_tokens, self.max_len - prompt.size)
        need = prompt.size + max_new - 1
        if need > self.budget:  # in whole pages: the budget is whole pages
            raise ValueError(
                f"{request_name(request)}: needs {need} KV tokens (prompt {prompt.size} + "
                f"{max_new} new - 1) but the KV pool of cell {self.cell.index} holds "
                f"{self.budget} (rollout.kv_tokens)"
            )
        rid = next(self._rids) if rid is None else rid
        self.queue.append(Live(rid, request, prompt, temp, max_new))
        return rid

    def _find(self, rid: int):
        for lv in self.queue:
            if lv.rid == rid:
                return None, lv
        for i, s in enumerate(self.slots):
            if s.live is not None and s.live.rid == rid:
                return i, s.live
        raise KeyError(f"cell {self.cell.index}: no live request {rid}")

    def cancel(self, rid: int) -> Live:
        """Removes a live request; returns its token record so far (the slot keeps its KV)."""
        i, lv = self._find(rid)
        if i is None:
            self.queue.remove(lv)
        else:
            self._end(i)
        return lv

    def export(self, rid: int) -> SlotExport:
        """Lifts a live request out with its KV rows (on this cell), length and sampler state.

        Paged: the rows are the pages of its context, and only them ({'k': L x [n, KVH, Dh,
        ps], 'v': L x [n, KVH, ps, Dh]}, n = its length in pages); the slot keeps its context
        idle, as the slot layout does."""
        i, lv = self._find(rid)
        if i is None:
            self.queue.remove(lv)
            return SlotExport(lv, np.zeros(0, np.int32), None)
        slot = self.slots[i]
        if self.paged:
            pages = self.kv.table(i)[: self.kv.pages_for(slot.length)]
            rows = self.programs.read_pages(self.cache, np.asarray(pages, np.int32))
        else:
            rows = self.programs.read_rows(self.cache, np.int32(i))
        self._end(i)
        return SlotExport(lv, slot.held.copy(), rows)

    def import_(self, exp: SlotExport) -> None:
        """Installs an exported request into an idle slot (its rows cross with device_put).

        It reserves its footprint like an admission (evicting idle contexts LRU); the caller
        checks :meth:`can_admit` first (RuntimeError when there is no slot or room).
        """
        if exp.rows is None:
            self.queue.append(exp.live)
            return
        lv, me = exp.live, exp.live.request.execution_id
        idle = [i for i, s in enumerate(self.slots) if s.live is None]
        if len(idle) <= len(self.queue) or lv.reserve > self.room():
            raise RuntimeError(f"cell {self.cell.index}: no free slot or KV room to import request")
        i = max(idle, key=lambda j: (self.slots[j].length == 0, not self._pinned(self.slots[j]),
                                     -self.slots[j].last_used))  # fmt: skip
        slot = self.slots[i]
        if slot.length and slot.owner != me:
            self._evict(slot)
        self._rewind(i, 0)
        self._claim(i, 0, lv.reserve)
        rows = gmesh.move(exp.rows, self.programs.rows_sh)
        if self.paged:
            n = rows["v"][0].shape[0]
            if rows["v"][0].shape[2] != self.kv.page_size or n < self.kv.pages_for(exp.held.size):
                raise ValueError(f"cell {self.cell.index}: imported rows are not "
                                 f"{self.kv.page_size}-token pages of the request's context")  # fmt: skip
            pages = np.asarray(self.kv.table(i)[:n], np.int32)
            self.cache = self.programs.write_pages(self.cache, rows, pages)
        else:
            self.cache = self.programs.write_rows(self.cache, rows, np.int32(i))
        slot.write(0, exp.held)
        slot.clean = 0  # computed on another cell, maybe by other weights: never a source
        slot.live, slot.owner, slot.last_used = lv, me, next(self._clock)
        self.kv.touch(i, idle=False)
        self.evicted.pop(me, None)
        self.stats["imported"] += 1

    def idle_contexts(self) -> list[str]:
        """Executions whose idle context a slot holds, least recently used first."""
        idle = [s for s in self.slots if s.live is None and s.owner is not None and s.length]
        return list(dict.fromkeys(s.owner for s in sorted(idle, key=lambda s: s.last_used)))

    def export_context(self, execution_id: str) -> ContextExport | None:
        """Lifts ``execution_id``'s idle context out with its K/V (paged: its pages, only
        them) -> None when no idle slot holds one. The slot forgets it (a move, not an
        eviction: nothing is recorded for re-prefill)."""
        held = [i for i, s in enumerate(self.slots)
                if s.live is None and s.owner == execution_id and s.length]  # fmt: skip
        if not held:
            return None
        i = max(held, key=lambda j: self.slots[j].last_used)
        slot = self.slots[i]
        if self.paged:
            pages = self.kv.table(i)[: self.kv.pages_for(slot.length)]
            rows = self.programs.read_pages(self.cache, np.asarray(pages, np.int32))
        else:
            rows = self.programs.read_rows(self.cache, np.int32(i))
        exp = ContextExport(execution_id, slot.held.copy(), self.version, rows)
        self._rewind(i, 0)
        slot.owner = None
        self.stats["contexts_exported"] += 1
        return exp

    def can_import_context(self, exp: ContextExport) -> bool:
        """Whether :meth:`import_context` takes ``exp`` now: the same weights version, an
        empty slot the queue does not need, and free pages for its length (a moved context
        never evicts a resident one)."""
        if self.kv is None or exp.version != self.version:
            return False
        empty = sum(s.live is None and s.length == 0 for s in self.slots)
        return (empty > len(self.queue)
                and self.kv.pages_for(exp.held.size) <= self.kv.free_pages)  # fmt: skip

    def import_context(self, exp: ContextExport) -> None:
        """Installs an exported idle context into an empty slot, idle (its execution's next
        call reuses it as if it had stayed); RuntimeError where :meth:`can_import_context`
        is False."""
        if not self.can_import_context(exp):
            raise RuntimeError(f"cell {self.cell.index}: cannot import the context of "
                               f"{exp.owner!r} (weights, slot or free pages)")  # fmt: skip
        i = next(j for j, s in enumerate(self.slots) if s.live is None and s.length == 0)
        slot, n = self.slots[i], exp.held.size
        self.kv.resize(i, 0, n)
        rows = gmesh.move(exp.rows, self.programs.rows_sh)
        if self.paged:
            pages = np.asarray(self.kv.table(i), np.int32)
            if rows["v"][0].shape[0] != pages.size or rows["v"][0].shape[2] != self.kv.page_size:
                raise ValueError(f"cell {self.cell.index}: imported rows are not the "
                                 f"{pages.size} pages of a {n}-token context")  # fmt: skip
            self.cache = self.programs.write_pages(self.cache, rows, pages)
        else:
            self.cache = self.programs.write_rows(self.cache, rows, np.int32(i))
        slot.write(0, exp.held)
        slot.clean = 0  # computed on another cell: never a source for other slots' prompts
        slot.owner, slot.last_used = exp.owner, next(self._clock)
        self.kv.touch(i, idle=True)
        self.evicted.pop(exp.owner, None)
        self.stats["contexts_imported"] += 1

    # ------------------------------------------------------------------ one step

    def _place(self, lv: Live) -> bool:
        """Admits a queued request when a slot is idle and live reservations + its own fit the
        budget -> False to wait. Slot: longest reusable prefix (another execution's context
        only when the prompt extends all of it), then empty, then least recently used. Then
        idle contexts are evicted LRU until the pool fits (see the module docstring)."""
        idle = [i for i, s in enumerate(self.slots) if s.live is None]
        need = self.kv.pages_for(lv.reserve)
        if not idle or self.kv.live_pages() + need > self.kv.num_pages:
            return False
        me = lv.request.execution_id
        best, best_key, reuse = None, None, 0
        for i in idle:
            s = self.slots[i]
            r = min(common_prefix(lv.prompt, s.held), lv.prompt.size - 1)
            lossless = s.owner == me or r == s.length
            key = (r if lossless else 0, s.length == 0, not self._pinned(s), -s.last_used)
            if best_key is None or key > best_key:
                best, best_key, reuse = i, key, r
        slot = self.slots[best]
        if slot.length > reuse and slot.owner != me:
            self._evict(slot, keep=reuse)  # another execution's context: cut to the shared prefix
        self._rewind(best, reuse)
        self._claim(best, reuse, lv.reserve)
        record = self.evicted.pop(me, None)
        if record is not None:
            lost = min(common_prefix(lv.prompt, record), lv.prompt.size - 1)
            self.stats["reprefilled_tokens"] += max(0, lost - reuse)
        slot.live, slot.owner, slot.last_used = lv, me, next(self._clock)
        self.kv.touch(best, idle=False)
        self.stats["prompt_tokens"] += lv.prompt.size
        self.stats["reused_tokens"] += reuse
        self.stats["admitted"] += 1
        self.recent.append(need * self.kv.page_size)
        if self.on_admit is not None:
            self.on_admit(lv.rid)
        return True

    def _record(self, slot: Slot, token: int, logprob: float, done: list) -> None:
        lv = slot.live
        lv.tokens.append(int(token))
        lv.logprobs.append(float(logprob))
        lv.versions.append(self.version)
        self.stats["generated"] += 1
        reason = None
        if token in lv.request.stop_tokens:
            reason = "stop"
        elif len(lv.tokens) >= lv.max_new:
            reason = "length"
        if reason is not None:
            done.append((lv.rid, lv.response(reason)))
            self._end(slot.index)

    # ------------------------------------------------------------------ prefill

    def _source(self, i: int) -> tuple[int, int]:
        """(slot, tokens) of the resident K/V that serves most of slot i's prompt (the
        current weights' only; at most P - 1 tokens, the last one is always prefilled)."""
        lv, best, best_n = self.slots[i].live, -1, 0
        for j, s in enumerate(self.slots):
            if j != i and s.clean > best_n:
                n = min(common_prefix(lv.prompt, s.held[: s.clean]), lv.prompt.size - 1)
                if n > best_n:
                    best, best_n = j, n
        return best, best_n

    def _share_prefixes(self, pending: list[int]) -> list[int]:
        """Copies resident prefixes into the prefilling slots; -> the slots to prefill now.

        A slot whose prompt shares more than it holds with another slot's resident K/V gets
        a copy of it. A slot whose prompt shares more with an earlier prefilling slot's
        prompt than that slot holds yet waits for it (the samples of one task, submitted
        together, prefill their prompt once). The first prefilling slot never waits.
        """
        ready = []
        for k, i in enumerate(pending):
            slot = self.slots[i]
            src, n = self._source(i)
            if n > slot.length:
                if self.paged:  # full pages by reference, the last partial one copied
                    self._copy_pages(self.kv.share(src, i, n))
                else:
                    self.cache = self.programs.copy_slot(self.cache, np.int32(src), np.int32(i))
                self.stats["shared_tokens"] += n - slot.length
                self.stats["reused_tokens"] += n - slot.length
                slot.write(0, slot.live.prompt[:n])
            p = slot.live.prompt
            waits = any(
                min(common_prefix(p, self.slots[j].live.prompt), p.size - 1)
                > max(slot.length, self.slots[j].length)
                for j in pending[:k]
            )
            if not waits:
                ready.append(i)
        return ready

    def _prefill_rows(self, rows: list[int], done: list) -> None:
        """One chunk for each slot in ``rows`` (distinct) in one call."""
        b = self.num_slots
        tokens_BxC = np.zeros((b, self.chunk), np.int32)
        start_B = np.full(b, self.max_len, np.int32)  # padding rows write past the cache
        slot_B, last_B = np.zeros(b, np.int32), np.zeros(b, np.int32)
        lives, pieces = [None] * b, []
        for k, i in enumerate(rows):
            slot = self.slots[i]
            piece = slot.live.prompt[slot.length : slot.length + self.chunk]
            tokens_BxC[k, : piece.size] = piece
            start_B[k], slot_B[k], last_B[k], lives[k] = slot.length, i, piece.size - 1, slot.live
            pieces.append(piece)
        t0 = time.perf_counter()
        self.cache, tok_B, lp_B = self.programs.prefill(
            self.weights,
            self.cache,
            tokens_BxC,
            start_B,
            slot_B,
            last_B,
            *_identity(lives),
            len(rows),
            *self._tables(),
        )
        self.stats["prefill_chunks"] += len(rows)
        self.stats["prefill_calls"] += 1
        ends = [
            k for k, i in enumerate(rows) if start_B[k] + pieces[k].size == lives[k].prompt.size
        ]
        if ends or self.on_timing is not None:
            tok_B, lp_B = np.asarray(tok_B), np.asarray(lp_B)  # waits for the call
        if self.on_timing is not None:
            real = sum(p.size for p in pieces)
            self.on_timing("prefill", {"seconds": time.perf_counter() - t0, "rows": len(rows),
                                       "tokens": real})  # fmt: skip
        for k, i in enumerate(rows):
            self.slots[i].write(int(start_B[k]), pieces[k])
        for k in ends:
            self._record(self.slots[rows[k]], int(tok_B[k]), float(lp_B[k]), done)

    def _prefill(self, done: list) -> None:
        """Prefills every admitted prompt to its end: rounds of one batched chunk per slot."""
        while True:
            pending = [
                i for i, s in enumerate(self.slots)
                if s.live is not None and s.length < s.live.prompt.size
            ]  # fmt: skip
            if not pending:
                return
            self._prefill_rows(self._share_prefixes(pending), done)

    # ------------------------------------------------------------------ decode

    def _decode(self, active: list[int], done: list) -> None:
        """Decodes the active slots: one step (``decode_steps`` = 1) or one device loop."""
        s = self.num_slots
        tokens_S = np.zeros(s, np.int32)
        start_S = np.full(s, self.max_len, np.int32)  # inactive rows write past the cache
        lives = [None] * s
        for i in active:
            slot = self.slots[i]
            lives[i] = slot.live
            tokens_S[i] = slot.live.tokens[-1]
            start_S[i] = slot.length
        t0 = time.perf_counter()
        if self.decode_steps == 1:
            self.cache, tok_S, lp_S = self.programs.decode(
                self.weights, self.cache, tokens_S, start_S, *_identity(lives), *self._tables()
            )
            tok_NxS, lp_NxS, steps = np.asarray(tok_S)[None], np.asarray(lp_S)[None], 1
        else:
            left_S = np.zeros(s, np.int32)
            stop_SxK = np.full((s, MAX_STOP_TOKENS), -1, np.int32)
            for i in active:
                lv = self.slots[i].live
                left_S[i] = lv.max_new - len(lv.tokens)
                stop_SxK[i, : len(lv.request.stop_tokens)] = lv.request.stop_tokens
            self.cache, tok_NxS, lp_NxS, steps = self.programs.decode_loop(
                self.weights, self.cache, tokens_S, start_S, left_S, stop_SxK,
                *_identity(lives), bool(self.queue), *self._tables(),
            )  # fmt: skip
            tok_NxS, lp_NxS, steps = np.asarray(tok_NxS), np.asarray(lp_NxS), int(steps)
        if self.on_timing is not None:
            ctx = sum(self.slots[i].length for i in active)
            self.on_timing("decode", {"seconds": time.perf_counter() - t0, "rows": len(active),
                                      "steps": steps, "context_tokens": ctx})  # fmt: skip
        self.stats["decode_steps"] += steps
        self.stats["decode_loops"] += 1
        produced = 0
        for i in active:
            slot = self.slots[i]
            n = int((tok_NxS[:steps, i] >= 0).sum())  # tokens it ran (ids >= 0; -1 = idle)
            produced += n
            fed = np.concatenate([tokens_S[i : i + 1], tok_NxS[: n - 1, i]])
            slot.write(slot.length, fed.astype(np.int32))
            for t in range(n):
                self._record(slot, int(tok_NxS[t, i]), float(lp_NxS[t, i]), done)
        # Slot-steps of the loop in which a slot had finished and sat idle.
        self.stats["decode_slot_steps"] += steps * len(active)
        self.stats["decode_idle_slot_steps"] += steps * len(active) - produced

    def step(self) -> list[tuple[int, GenerateResponse]]:
        """Admits queued requests, prefills their prompts, one decode loop (or step).

        Returns the requests finished in this step as (rid, response).
        """
        if self.cache is None:
            raise RuntimeError(f"cell {self.cell.index} is suspended")
        while self.queue and self._place(self.queue[0]):
            self.queue.popleft()
        done: list = []
        self._prefill(done)
        active = [i for i, s in enumerate(self.slots) if s.live is not None and s.live.tokens]
        if active:
            self._decode(active, done)
        return done

    def begin_step(self) -> Callable[[], list[tuple[int, GenerateResponse]]]:
        """Runs :meth:`step` -> a function returning its result (the proxy starts every cell's
        step before collecting any, so cells in other processes step at once)."""
        done = self.step()
        return lambda: done

    def run_until_done(self, max_steps: int = 100_000) -> dict[int, GenerateResponse]:
        """Steps until nothing is live (tests, benchmarks)."""
        out = {}
        for _ in range(max_steps):
            if not self.num_live:
                return out
            out.update(self.step())
        raise RuntimeError(f"cell {self.cell.index}: requests still live after {max_steps} steps")

    def prefix_hit_rate(self) -> float:
        """Prompt tokens served from cached KV / prompt tokens admitted."""
        return self.stats["reused_tokens"] / max(1, self.stats["prompt_tokens"])


def _identity(lives: list):
    """Per-row sampler inputs (exec hash, call id, temperature); zeros for empty rows."""
    n = len(lives)
    h, c, t = np.zeros(n, np.uint32), np.zeros(n, np.uint32), np.zeros(n, np.float32)
    for i, lv in enumerate(lives):
        if lv is not None:
            eh, ci = lv.request.sample_key
            h[i], c[i], t[i] = eh, ci & 0xFFFFFFFF, lv.temperature
    return h, c, t
