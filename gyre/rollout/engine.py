"""Rollout engine: one per rollout cell, a slot KV cache and continuous batching.

The cache holds ``slots`` sequences of up to ``max_len`` tokens ({'k','v'}: [L, S, M, KVH, Dh],
slots over the cell's 'data' axis via logical 'batch', kv heads over 'model'). Two jit
programs per cell (see :class:`gyre.rollout.programs.Programs`), each with one fixed shape: a prefill of one
``prefill_chunk`` for one slot, and a decode step of one token for every slot at once
(inactive slots write nowhere and their outputs are ignored). The engine is driven by
explicit :meth:`Engine.step` calls, so it is deterministic; the proxy drives engines from
asyncio. Between two steps requests join and leave slots, weights change
(:meth:`Engine.set_weights`) and live requests move to other cells (:meth:`Engine.export`,
:meth:`Engine.import_`, :meth:`Engine.cancel`).

Multi-turn reuse: a finished slot keeps its tokens' KV (LRU). A new prompt goes to the idle
slot with the longest common token prefix, the slot is rewound to that prefix and only the
suffix is prefilled (a retry resuming from an earlier point is the same rewind).

Weight updates keep in-flight requests: KV computed by an older version stays in the cache
(standard practice); each completion token records the version whose logits sampled it.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools

import numpy as np

from gyre import mesh as gmesh
from gyre.rollout.programs import Programs, RolloutSpec, programs_for
from gyre.rollout.types import GenerateRequest, GenerateResponse


def validate_request(request: GenerateRequest, vocab_size: int, max_len: int) -> np.ndarray:
    """-> the prompt as int32[P]; raises ValueError naming the request for unusable input."""
    name = f"request (execution {request.execution_id!r}, call {request.call_id})"
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

    def response(self, reason: str) -> GenerateResponse:
        return GenerateResponse(
            np.asarray(self.tokens, np.int32),
            np.asarray(self.logprobs, np.float32),
            np.asarray(self.versions, np.int32),
            reason,
        )


class Slot:
    """Host view of one cache slot: the tokens whose K/V it holds at positions 0..length-1."""

    def __init__(self, max_len: int):
        self.buf = np.zeros(max_len, np.int32)  # preallocated: appending a token is O(1)
        self.length = 0
        self.live: Live | None = None
        self.last_used = -1

    @property
    def held(self) -> np.ndarray:
        return self.buf[: self.length]

    def write(self, start: int, tokens: np.ndarray) -> None:
        self.buf[start : start + tokens.size] = tokens
        self.length = start + tokens.size


@dataclasses.dataclass
class SlotExport:
    """A live request lifted out of its slot: host state plus its KV rows (source cell)."""

    live: Live
    held: np.ndarray
    rows: dict | None  # {'k','v'}: [L, 1, M, KVH, Dh]; None for a request still queued


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class Engine:
    """Continuous-batching inference of ``spec`` on one cell."""

    def __init__(self, spec: RolloutSpec, cell: gmesh.Cell, state, version: int = 0):
        r = spec
        self.cell, self.vocab_size = cell, spec.model.vocab_size
        self.num_slots, self.max_len, self.chunk = r.slots, r.max_len, r.prefill_chunk
        self.temperature = float(r.temperature)
        self.programs: Programs = programs_for(spec, cell)
        self.state = gmesh.move(state, self.programs.state_sh)
        self.version = version
        self._rids = itertools.count()
        self._clock = itertools.count()
        self.queue: collections.deque[Live] = collections.deque()
        self.stats = collections.Counter()
        self.cache = None
        self.resume()

    # ------------------------------------------------------------------ lifecycle and weights

    def resume(self, state=None, version: int | None = None) -> None:
        """(Re)allocates an empty cache; optionally installs weights."""
        self.cache = self.programs.new_cache()
        self.slots = [Slot(self.max_len) for _ in range(self.num_slots)]
        if state is not None:
            self.set_weights(state, self.version if version is None else version)

    def warmup(self) -> None:
        """Compiles (or loads from the persistent cache) both programs now, not on first use.

        Runs them with every write aimed past the cache (dropped), so no slot changes.
        """
        beyond = np.array([self.max_len], np.int32)
        zero = np.zeros(1, np.int32)
        tokens = np.zeros((1, self.chunk), np.int32)
        self.cache, _, _ = self.programs.prefill(
            self.state, self.cache, tokens, beyond, zero, zero, *_identity([None])
        )
        s = self.num_slots
        idle = np.full(s, self.max_len, np.int32)
        self.cache, _, _ = self.programs.decode(
            self.state, self.cache, np.zeros(s, np.int32), idle, *_identity([None] * s)
        )

    def suspend(self) -> None:
        """Frees the cache (the cell leaves rollout). Every live request must be gone first."""
        if self.num_live:
            raise RuntimeError(
                f"cell {self.cell.index}: suspend with {self.num_live} live requests"
            )
        self.cache, self.slots = None, []

    def set_weights(self, state, version: int) -> None:
        """Installs new weights between steps; in-flight requests continue with them.

        Idle slots forget their cached prefixes: that K/V came from the old weights, and
        reusing it would make a later request's tokens depend on which weights served an
        unrelated earlier one.
        """
        self.state = gmesh.move(state, self.programs.state_sh)
        self.version = int(version)
        for slot in self.slots:
            if slot.live is None:
                slot.length = 0

    # ------------------------------------------------------------------ requests in and out

    @property
    def num_live(self) -> int:
        return len(self.queue) + sum(s.live is not None for s in self.slots)

    def free_slots(self) -> int:
        return sum(s.live is None for s in self.slots) - len(self.queue)

    def live_ids(self) -> list[int]:
        return [lv.rid for lv in self.queue] + [s.live.rid for s in self.slots if s.live]

    def submit(self, request: GenerateRequest, rid: int | None = None) -> int:
        """Queues a request (joins a slot at the next step); raises ValueError for bad input."""
        prompt = validate_request(request, self.vocab_size, self.max_len)
        temp = self.temperature if request.temperature is None else float(request.temperature)
        max_new = min(request.max_new_tokens, self.max_len - prompt.size)
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
            self.slots[i].live = None
        return lv

    def export(self, rid: int) -> SlotExport:
        """Lifts a live request out with its KV rows (on this cell), length and sampler state."""
        i, lv = self._find(rid)
        if i is None:
            self.queue.remove(lv)
            return SlotExport(lv, np.zeros(0, np.int32), None)
        rows = self.programs.read_rows(self.cache, np.int32(i))
        self.slots[i].live = None
        return SlotExport(lv, self.slots[i].held.copy(), rows)

    def import_(self, exp: SlotExport) -> None:
        """Installs an exported request into an idle slot (its rows cross with device_put)."""
        if exp.rows is None:
            self.queue.append(exp.live)
            return
        idle = [i for i, s in enumerate(self.slots) if s.live is None]
        if len(idle) <= len(self.queue):
            raise RuntimeError(f"cell {self.cell.index}: no free slot to import request")
        i = min(idle, key=lambda j: self.slots[j].last_used)
        rows = gmesh.move(exp.rows, self.programs.rows_sh)
        self.cache = self.programs.write_rows(self.cache, rows, np.int32(i))
        slot = self.slots[i]
        slot.write(0, exp.held)
        slot.live, slot.last_used = exp.live, next(self._clock)
        self.stats["imported"] += 1

    # ------------------------------------------------------------------ one step

    def _place(self, lv: Live) -> bool:
        """Puts a queued request into the idle slot sharing its longest prefix (LRU on ties)."""
        best, best_key = None, None
        for i, s in enumerate(self.slots):
            if s.live is None:
                reuse = min(common_prefix(lv.prompt, s.held), lv.prompt.size - 1)
                key = (reuse, -s.last_used)
                if best_key is None or key > best_key:
                    best, best_key = i, key
        if best is None:
            return False
        reuse = best_key[0]
        slot = self.slots[best]
        slot.length, slot.live, slot.last_used = reuse, lv, next(self._clock)  # rewind
        self.stats["prompt_tokens"] += lv.prompt.size
        self.stats["reused_tokens"] += reuse
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
            slot.live = None
            slot.last_used = next(self._clock)

    def _prefill_one(self, slot_index: int, done: list) -> None:
        slot, lv = self.slots[slot_index], self.slots[slot_index].live
        start = slot.length
        piece = lv.prompt[start : start + self.chunk]
        tokens_1xC = np.zeros((1, self.chunk), np.int32)
        tokens_1xC[0, : piece.size] = piece
        self.cache, tok, lp = self.programs.prefill(
            self.state,
            self.cache,
            tokens_1xC,
            np.array([start], np.int32),
            np.array([slot_index], np.int32),
            np.array([piece.size - 1], np.int32),
            *_identity([lv]),
        )
        slot.write(start, piece)
        self.stats["prefill_chunks"] += 1
        if slot.length == lv.prompt.size:
            self._record(slot, int(tok[0]), float(lp[0]), done)

    def _decode(self, active: list[int], done: list) -> None:
        s = self.num_slots
        tokens_S = np.zeros(s, np.int32)
        start_S = np.full(s, self.max_len, np.int32)  # inactive rows write past the cache
        lives = [None] * s
        for i in active:
            slot = self.slots[i]
            lives[i] = slot.live
            tokens_S[i] = slot.live.tokens[-1]
            start_S[i] = slot.length
        self.cache, tok_S, lp_S = self.programs.decode(
            self.state, self.cache, tokens_S, start_S, *_identity(lives)
        )
        tok_S, lp_S = np.asarray(tok_S), np.asarray(lp_S)
        self.stats["decode_steps"] += 1
        for i in active:
            slot = self.slots[i]
            slot.write(slot.length, tokens_S[i : i + 1])
            self._record(slot, int(tok_S[i]), float(lp_S[i]), done)

    def step(self) -> list[tuple[int, GenerateResponse]]:
        """Admits queued requests, one prefill chunk per prefilling slot, one decode step.

        Returns the requests finished in this step as (rid, response).
        """
        if self.cache is None:
            raise RuntimeError(f"cell {self.cell.index} is suspended")
        while self.queue and self._place(self.queue[0]):
            self.queue.popleft()
        done: list = []
        for i, slot in enumerate(self.slots):
            if slot.live is not None and slot.length < slot.live.prompt.size:
                self._prefill_one(i, done)
        active = [i for i, s in enumerate(self.slots) if s.live is not None and s.live.tokens]
        if active:
            self._decode(active, done)
        return done

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
