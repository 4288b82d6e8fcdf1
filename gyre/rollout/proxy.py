"""Model-call proxy: routes requests to rollout cells and hands live requests over.

``await proxy.generate(request)`` is the harness's only entry point. Requests wait in the proxy
(FIFO) until a rollout cell can admit the head one: a free slot and room in its KV pool for the
request's footprint, prompt + max new tokens - 1 (see gyre/rollout/engine.py: idle contexts
count as room, the cell evicts them least recently used). The cell is chosen by load (most
free slots, then most pool room, lowest index on ties), except that a call goes back to the
cell that served its execution last when that cell can admit it, so multi-turn prompts hit
that cell's cached prefix (the context its execution left there while waiting on a tool) and
only the new tokens are prefilled. A request larger than every cell's pool raises ValueError.

``release(cell, mode)`` (the controller, at a step boundary) takes a cell out of rollout and
hands every live request on it to the other rollout cells:

- 'migrate': KV rows, length, sampler state (the request identity) and pending token move
  with ``device_put`` into a free slot of another cell whose pool has room for the request's
  reservation; generation continues bit-exactly.
- 'retry': the request is cancelled and re-submitted from its exact token record (prompt +
  tokens generated so far, same execution/call ids, so sampling keys line up); the new
  prefill recomputes that KV. The response concatenates both parts.

With 'migrate' a paged cell's idle contexts (executions waiting on a tool) move too, with
their pages only, to another cell with free pages and an empty slot, where the
execution's next call goes and reuses them (``Proxy._move_contexts``); otherwise they are
dropped and re-prefilled.

A request that cannot migrate (no cell with a free slot and room, or no rollout cell left)
falls back to the retry path and waits in the proxy; ``admit(cell)`` brings a cell back.
Nothing is lost: the caller sees one uninterrupted completion. Bad input raises ValueError in
the caller.

Resident admission (``Proxy(engines, admission="resident")``, ``rollout.admission``): the
rule of :class:`gyre.elastic.admission.ResidentAdmission` (the simulator calls the same
ledger). An execution's first call admits it to the cell with most unreserved room that holds
its reservation (the call's footprint, or the mean peak footprint of the executions ended so
far if larger), a free slot, and fewer admitted executions than slots; its later calls go to that cell only, after growing the
reservation to their footprint; a call that cannot grow waits, and no new execution is
admitted to a cell where one waits. Calls of admitted executions go first (in FIFO order per
cell), then new executions (FIFO, the head blocking). The engines evict pinned contexts (of
executions admitted to that cell) last, so while the reservations fit the pool an admitted
execution's context stays resident between its calls. A cell where such a call waits and
nothing runs preempts its youngest admitted execution (the ledger's ``youngest``: its
reservation goes, its next call is a new execution's). The caller ends each execution
(:meth:`Proxy.end_execution`: the reservation goes, its peak joins the mean); an execution the
proxy never hears end of and that made no call over a whole weight version loses its
reservation at the next :meth:`Proxy.set_weights` (which clears idle contexts anyway). On
hand-over, 'migrate' moves each reservation on the cell to the open cell with most room
(``move``) and its live call with it; a live call that cannot go there is retried and its
reservation dropped, as are all of them with 'retry' or a lost cell.

Pool metrics: :meth:`Proxy.kv_stats` (cumulative counters to diff per step, and current
values) and :meth:`Proxy.capacity_contexts` (per cell, for the scheduler policy).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import itertools
import time

import numpy as np

from gyre.elastic.admission import ResidentAdmission
from gyre.errors import CellLost
from gyre.rollout.engine import footprint, request_name, validate_request
from gyre.rollout.types import (
    ADMISSIONS,
    HANDOVERS,
    GenerateRequest,
    GenerateResponse,
    ServingEngine,
)


@dataclasses.dataclass
class Call:
    """One awaited model call and the completion carried over from cancelled attempts."""

    rid: int
    request: GenerateRequest  # as the caller sent it
    future: asyncio.Future
    current: GenerateRequest  # what the engine runs now (a continuation after a retry)
    cell: int | None = None
    submitted: float = 0.0  # time.perf_counter() at generate()
    admitted: bool = False  # entered a slot (admission wait counted once per call)
    tokens: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    versions: list = dataclasses.field(default_factory=list)


class Proxy:
    """Routes calls over the engines of the rollout cells. Drive it with run() or pump()."""

    def __init__(self, engines: list[ServingEngine], admission: str = "none"):
        if not engines:
            raise ValueError("proxy needs at least one engine")
        if admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {ADMISSIONS}, got {admission!r}")
        self.engines = {e.cell.index: e for e in engines}
        for e in engines:
            e.on_admit = self._admitted
        # Resident admission: the ledger of KV reservations per cell (None: admission 'none').
        # One capacity for every cell: the smallest pool; at most as many executions admitted
        # to a cell as it has slots (each one's context needs a slot of its own to stay).
        self.admission = admission
        self.ledger = None
        if admission == "resident":
            budget = min(e.budget for e in engines)
            slots = min(e.num_live + e.free_slots() for e in engines)
            self.ledger = ResidentAdmission(max(self.engines) + 1, max(budget, 1), slots)
            for i, e in self.engines.items():
                e.pinned = functools.partial(self._pinned, i)
        self.called: set[str] = set()  # executions with a call since the last set_weights
        self.rollout = set(self.engines)
        first = engines[0]
        self.vocab_size, self.max_len = first.vocab_size, first.max_len
        self.calls: dict[int, Call] = {}
        self.waiting: collections.deque[int] = collections.deque()
        self.affinity: dict[str, int] = {}
        self.stats = collections.Counter()
        self.latest_weights = None
        self.lost: set[int] = set()  # cells whose process was lost (gyre/cluster/remote.py)
        self._rids = itertools.count()
        self._lost_taken = 0  # lost_retried counted by take_lost_retried so far
        self._wake: asyncio.Event | None = None

    # ------------------------------------------------------------------ caller side

    async def generate(self, request: GenerateRequest) -> GenerateResponse:
        """One model call; raises ValueError (naming the request) for unusable input."""
        validate_request(request, self.vocab_size, self.max_len)
        need, pool = footprint(request, self.max_len), max(e.budget for e in self.engines.values())
        if self.ledger is not None:
            pool = min(pool, int(self.ledger.capacity))
        if need > pool:
            raise ValueError(
                f"{request_name(request)}: needs {need} KV tokens (prompt + max new tokens - 1, "
                f"capped at max_len) but the largest cell KV pool holds {pool} (rollout.kv_tokens)"
            )
        rid = next(self._rids)
        future = asyncio.get_running_loop().create_future()
        self.calls[rid] = Call(rid, request, future, request, submitted=time.perf_counter())
        self.waiting.append(rid)
        self.called.add(request.execution_id)
        self._dispatch()
        self._notify()
        return await future

    # ------------------------------------------------------------------ driving

    def pump(self) -> int:
        """Dispatches waiting calls and steps every rollout engine once -> calls finished."""
        self._drop_cancelled()
        self._dispatch()
        finished = 0
        live = [self.engines[i] for i in sorted(self.rollout) if self.engines[i].num_live]
        for finish in [engine.begin_step() for engine in live]:
            for rid, response in finish():
                self._finish(rid, response)
                finished += 1
        self._dispatch()
        return finished

    def busy(self) -> bool:
        """True while some rollout engine has live work (pump would make progress)."""
        return any(self.engines[i].num_live for i in self.rollout)

    async def run(self) -> None:
        """Steps engines while there is work; sleeps on an event otherwise. Cancel to stop."""
        self._wake = asyncio.Event()
        while True:
            if self.busy():
                self.pump()
                await asyncio.sleep(0)  # let callers consume results and submit
            else:
                self._wake.clear()
                self._dispatch()
                if not self.busy():
                    await self._wake.wait()

    def _notify(self) -> None:
        if self._wake is not None:
            self._wake.set()

    # ------------------------------------------------------------------ routing

    def _pick(self, call: Call) -> int | None:
        """A rollout cell that can admit ``call.current`` now (slot and pool room), or None."""
        ok = [i for i in self.rollout if self.engines[i].can_admit(call.current)]
        if not ok:
            return None
        sticky = self.affinity.get(call.request.execution_id)
        if sticky in ok:
            return sticky
        e = self.engines
        return max(ok, key=lambda i: (e[i].free_slots(), e[i].room(), -i))

    def _admitted(self, rid: int) -> None:
        """Engine hook: ``rid`` entered a slot; the first time, its wait since generate()."""
        call = self.calls.get(rid)
        if call is not None and not call.admitted:
            call.admitted = True
            self.stats["admissions"] += 1
            self.stats["admission_wait_s"] += time.perf_counter() - call.submitted

    def _dispatch(self) -> None:
        self._recover()
        if self.ledger is not None:
            self._dispatch_resident()
        else:  # FIFO, the head blocking
            while self.waiting and (target := self._pick(self.calls[self.waiting[0]])) is not None:
                self._submit(self.calls[self.waiting.popleft()], target)
        if self._recover():  # a submit found its cell lost
            self._dispatch()

    def _submit(self, call: Call, target: int) -> None:
        self.engines[target].submit(call.current, call.rid)
        call.cell = target
        self.affinity[call.request.execution_id] = target

    # ------------------------------------------------------------------ resident admission

    def _pinned(self, cell_index: int, execution_id: str) -> bool:
        """Engine hook: whether the execution is admitted to that cell (its context stays)."""
        led = self.ledger
        return led.holds(execution_id) and led.cell_of(execution_id) == cell_index

    def _need(self, call: Call) -> int:
        return footprint(call.current, self.max_len)

    def _dispatch_resident(self) -> None:
        """Calls of admitted executions first (each on its cell, growing its reservation;
        FIFO per cell), preempting where a cell waits with nothing running; then new
        executions, FIFO, admitted to a cell with room where nothing waits."""
        led = self.ledger
        for rid in list(self.waiting):  # a reservation on a cell out of rollout goes
            eid = self.calls[rid].request.execution_id
            if led.holds(eid) and led.cell_of(eid) not in self.rollout:
                led.preempt(eid)
        while True:
            blocked: set[int] = set()
            for rid in list(self.waiting):
                call = self.calls[rid]
                eid = call.request.execution_id
                if not led.holds(eid):
                    continue
                c = led.cell_of(eid)
                if (c in blocked or not self.engines[c].can_admit(call.current)
                        or not led.grow(eid, self._need(call))):  # fmt: skip
                    blocked.add(c)
                    continue
                self.waiting.remove(rid)
                self._submit(call, c)
            stuck = [c for c in sorted(blocked) if not self.engines[c].num_live]
            if not stuck:
                break
            for c in stuck:
                self._preempt(c)
        while True:
            head = next((r for r in self.waiting
                         if not led.holds(self.calls[r].request.execution_id)), None)  # fmt: skip
            if head is None:
                return
            call = self.calls[head]
            open_ = [i for i in sorted(self.rollout) if i not in blocked
                     and self.engines[i].can_admit(call.current)]  # fmt: skip
            target = led.admit(call.request.execution_id, self._need(call), open_)
            if target is None:
                return
            self.waiting.remove(head)
            self._submit(call, target)

    def _preempt(self, cell_index: int) -> None:
        """Drops the youngest reservation on the cell; its waiting call, if any, goes to the
        front of the queue as a new execution's (its idle context is evicted when needed)."""
        eid = self.ledger.youngest(cell_index)
        self.ledger.preempt(eid)
        self.stats["preemptions"] += 1
        for rid in list(self.waiting):
            if self.calls[rid].request.execution_id == eid:
                self.waiting.remove(rid)
                self.waiting.appendleft(rid)

    def _admitted_executions(self) -> list[str]:
        if self.ledger is None:
            return []
        return [eid for i in sorted(self.engines) for eid in self.ledger.keys_on(i)]

    def _drop_reservations(self, cell_index: int) -> None:
        if self.ledger is not None:
            for eid in self.ledger.keys_on(cell_index):
                self.ledger.preempt(eid)

    def end_execution(self, execution_id: str) -> None:
        """The caller's execution ended (success, failure, timeout, error or cancellation):
        its reservation goes and its peak footprint joins the ledger's mean. Harmless for an
        unknown execution and with admission 'none'."""
        self.called.discard(execution_id)
        if self.ledger is None or not self.ledger.holds(execution_id):
            return
        self.ledger.release(execution_id)
        self._dispatch()
        self._notify()

    def admission_stats(self) -> dict:
        """Resident admission now: admitted executions, tokens reserved (sums over cells),
        calls waiting of admitted executions and of new ones; cumulative preemptions and
        reservations expired at a weight update (never ended by the caller)."""
        led = self.ledger
        held = (lambda eid: led.holds(eid)) if led is not None else (lambda eid: False)
        admitted = sum(held(self.calls[r].request.execution_id) for r in self.waiting)
        return {
            "admitted_executions": len(self._admitted_executions()),
            "reserved_tokens": float(sum(led.used)) if led is not None else 0.0,
            "waiting_admitted": admitted,
            "waiting_new": len(self.waiting) - admitted,
            "preemptions": self.stats["preemptions"],
            "expired": self.stats["expired"],
        }

    def _recover(self) -> bool:
        """Cells newly lost leave rollout; the calls live there wait again, to be retried from
        their exact token record (the tokens of the attempt in flight went with the cell; keyed
        sampling makes them again). -> whether any cell was newly lost."""
        lost = {i: e.lost_calls() for i, e in self.engines.items() if i not in self.lost}
        new = [i for i, calls in lost.items() if calls is not None]
        for index in new:
            self.lost.add(index)
            self.rollout.discard(index)
            self._drop_reservations(index)
            orphans = [rid for rid in lost[index] if rid in self.calls]
            for rid in reversed(orphans):
                self.calls[rid].cell = None
                if rid not in self.waiting:
                    self.waiting.appendleft(rid)
            self.stats["lost_retried"] += len(orphans)
        return bool(new)

    def _finish(self, rid: int, response: GenerateResponse) -> None:
        call = self.calls.pop(rid)
        full = GenerateResponse(
            np.concatenate([np.asarray(call.tokens, np.int32), response.tokens]),
            np.concatenate([np.asarray(call.logprobs, np.float32), response.logprobs]),
            np.concatenate([np.asarray(call.versions, np.int32), response.versions]),
            response.finish_reason,
        )
        self.stats["finished"] += 1
        if not call.future.done():
            call.future.set_result(full)

    def _drop_cancelled(self) -> None:
        """Calls whose caller gave up (asyncio cancellation) leave their engine."""
        for rid, call in list(self.calls.items()):
            if call.future.cancelled():
                if call.cell is not None:
                    self.engines[call.cell].cancel(rid)
                elif rid in self.waiting:
                    self.waiting.remove(rid)
                del self.calls[rid]

    # ------------------------------------------------------------------ hand-over

    def _requeue(self, call: Call, live) -> None:
        """Retry path: carry the tokens so far and continue from the exact token record."""
        call.tokens += live.tokens
        call.logprobs += live.logprobs
        call.versions += live.versions
        req = call.request
        done = len(call.tokens)
        call.current = dataclasses.replace(
            req,
            prompt=np.concatenate(
                [np.asarray(req.prompt, np.int32), np.asarray(call.tokens, np.int32)]
            ),
            max_new_tokens=req.max_new_tokens - done,
        )
        call.cell = None
        self.waiting.appendleft(call.rid)

    def release(self, cell_index: int, mode: str = "migrate") -> dict:
        """Takes a cell out of rollout, handing each live request over -> counts by path."""
        if mode not in HANDOVERS:
            raise ValueError(f"release mode must be one of {HANDOVERS}, got {mode!r}")
        if cell_index not in self.rollout:
            raise ValueError(f"cell {cell_index} is not serving rollout")
        self.rollout.discard(cell_index)
        engine = self.engines[cell_index]
        counts = collections.Counter()
        moved = self._move_reservations(cell_index, mode)
        handed = {self.calls[rid].request.execution_id for rid in engine.live_ids()}
        for rid in reversed(engine.live_ids()):  # reversed: appendleft keeps the original order
            call = self.calls[rid]
            try:
                exp = engine.export(rid)
            except CellLost:  # the rest are the lost cell's orphans (see _recover)
                break
            eid = call.request.execution_id
            if mode != "migrate" or exp.rows is None:
                target = None
            elif self.ledger is None:
                target = self._pick(call)
            else:  # where its reservation went, if that cell can take the request now
                target = moved.get(eid)
                if target is not None and not self.engines[target].can_admit(call.current):
                    target = None
            if self.ledger is not None and target is None and self.ledger.holds(eid):
                self.ledger.preempt(eid)  # retried: its context is re-prefilled, as a new one's
            if target is not None:
                self.engines[target].import_(exp)
                call.cell = target
                self.affinity[call.request.execution_id] = target
                counts["migrated"] += 1
            else:
                self._requeue(call, exp.live)
                counts["retried" if exp.rows is not None else "requeued"] += 1
        if mode == "migrate":
            self._move_contexts(engine, moved, skip=handed)
        engine.suspend()
        self.stats.update(counts)
        self._dispatch()
        self._notify()
        return dict(counts)

    def _move_contexts(self, engine, moved: dict, skip=frozenset()) -> None:
        """'migrate', a paged cell: each idle context on a cell leaving rollout moves with its
        pages (only them, Engine.export_context) to the cell its execution's reservation went to
        (resident admission), else to the rollout cell with most free pages that takes it
        (Engine.can_import_context); where none does, it is dropped (re-prefilled), as the
        slot layout's are and those of an engine in another process. Executions in ``skip``
        (their live request was just handed over: the context it left went with it) are left.
        Counted in ``stats``: contexts_migrated, contexts_dropped."""
        if not getattr(engine, "paged", False):  # the slot layout: dropped, as before paging
            return
        for eid in engine.idle_contexts():
            if eid in skip:
                continue
            exp = engine.export_context(eid)
            if self.ledger is not None:
                cands = [moved[eid]] if moved.get(eid) is not None else []
            else:
                cands = sorted(self.rollout, key=lambda i: (-self._free_pages(i), i))
            target = next((i for i in cands if hasattr(self.engines[i], "import_context")
                           and self.engines[i].can_import_context(exp)), None)  # fmt: skip
            if target is None:
                self.stats["contexts_dropped"] += 1
                continue
            self.engines[target].import_context(exp)
            self.affinity[eid] = target
            self.stats["contexts_migrated"] += 1

    def _free_pages(self, i: int) -> int:
        kv = getattr(self.engines[i], "kv", None)
        return kv.free_pages if kv is not None else 0

    def _move_reservations(self, cell_index: int, mode: str) -> dict:
        """Resident admission, a cell leaving rollout: 'migrate' moves each reservation on it
        to the open cell with most room (dropped where none has), 'retry' drops them all ->
        {execution: its new cell or None}."""
        if self.ledger is None:
            return {}
        cells = sorted(self.rollout)
        moved = {}
        for eid in self.ledger.keys_on(cell_index):
            if mode == "migrate":
                moved[eid] = self.ledger.move(eid, cells)
            else:
                self.ledger.preempt(eid)
                moved[eid] = None
        return moved

    def lose(self, cell_index: int) -> None:
        """Marks a cell lost (found so outside the proxy, e.g. by a gradient call): it leaves
        rollout and whatever was live on it is retried elsewhere."""
        engine = self.engines[cell_index]
        if engine.lost_calls() is None:
            engine.lose()
        self._dispatch()
        self._notify()

    def admit(self, cell_index: int, state=None, version: int | None = None) -> None:
        """Brings a cell (back) into rollout with the given or the latest published weights."""
        if cell_index not in self.engines:
            raise ValueError(f"unknown cell {cell_index}; known: {sorted(self.engines)}")
        if cell_index in self.rollout or cell_index in self.lost:
            return
        if state is None and self.latest_weights is not None:
            state, version = self.latest_weights
        self.engines[cell_index].resume(state, version)
        self.rollout.add(cell_index)
        self._dispatch()
        self._notify()

    def wait_ready(self, cells=None) -> None:
        """Blocks until the engines of ``cells`` (default: every rollout cell, where a
        hand-over's rows land) hold the weights and KV rows they were last given."""
        for index in sorted(set(self.rollout if cells is None else cells) - self.lost):
            self.engines[index].wait_ready()

    def take_lost_retried(self) -> int:
        """Calls of lost cells retried elsewhere since the last take."""
        total = self.stats["lost_retried"]
        count, self._lost_taken = total - self._lost_taken, total
        return count

    def set_weights(self, state, version: int) -> None:
        """Publishes a new weight version to every rollout cell (between steps)."""
        self.latest_weights = (state, version)
        for index in self.rollout:
            self.engines[index].set_weights(state, version)
        self._expire()

    def _expire(self) -> None:
        """Resident admission: a reservation whose execution made no call since the last
        weight update and has none now goes (the caller never ended it, or it waits on a
        tool longer than a whole version: its next call is then a new execution's). So a
        reservation the proxy never hears end of lasts at most two weight versions."""
        if self.ledger is not None:
            live = {c.request.execution_id for c in self.calls.values()}
            for eid in self._admitted_executions():
                if eid not in self.called and eid not in live:
                    self.ledger.preempt(eid)
                    self.stats["expired"] += 1
            self._dispatch()
            self._notify()
        self.called = set()

    def warmup(self) -> None:
        """Compiles every rollout engine's programs now (start-up), not on the first call."""
        for index in sorted(self.rollout):
            self.engines[index].warmup()

    def live_requests(self) -> tuple[int, ...]:
        """Per cell index: the model calls it holds now."""
        return tuple(self.engines[i].num_live for i in sorted(self.engines))

    def capacity_contexts(self) -> tuple[float, ...]:
        """Per cell index (every cell, in or out of rollout): requests its KV pool holds at once
        at their recent size, min(slots, budget / mean recent footprint) (Engine.capacity_contexts)."""
        return tuple(self.engines[i].capacity_contexts() for i in sorted(self.engines))

    def kv_room(self, cells=None) -> dict:
        """Per cell index in ``cells`` (default: every cell): KV tokens the resident ledger
        reserves on it and its unreserved room, and the mean peak reservation of the ended
        executions (LoadSnapshot's ``kv_reserved_tokens`` / ``kv_free_tokens`` /
        ``kv_peak_tokens``); {} with admission 'none'."""
        cells = sorted(self.engines) if cells is None else cells
        return {} if self.ledger is None else self.ledger.room(cells)

    def kv_stats(self) -> dict:
        """The KV pools in one flat dict (names ``kv_*``).

        Cumulative (never reset, summed over every cell; diff them per step): kv_evictions,
        kv_evicted_tokens, kv_reprefilled_tokens (see :class:`Engine`), kv_admissions and
        kv_admission_wait_s (calls admitted into a slot, and the seconds from generate() to
        that first admission summed over them), kv_prompt_tokens, kv_reused_tokens,
        kv_shared_tokens (copied from another slot), kv_decode_slot_steps and
        kv_decode_idle_slot_steps (the decode loops' slot-steps, and those spent idle).
        Current: kv_budget_tokens, kv_capacity_contexts (sums over rollout cells),
        kv_reserved_tokens, kv_resident_tokens, kv_resident_contexts (sums over every cell; a
        resident context is a live request's slot or an idle slot holding tokens),
        kv_resident_contexts_c{i} per cell index, kv_waiting (calls waiting in the proxy)
        and kv_queued (submitted to an engine, not yet in a slot).
        """
        engines = [self.engines[i] for i in sorted(self.engines)]
        pools = {e.cell.index: e.pool() for e in engines}
        total = lambda key: sum(p[key] for p in pools.values())
        out = {
            f"kv_{k}": sum(e.stats[k] for e in engines)
            for k in ("evictions", "evicted_tokens", "reprefilled_tokens", "prompt_tokens",
                      "reused_tokens", "shared_tokens")
        }  # fmt: skip
        # decode loops: slot-steps run, and those in which a slot had finished and sat idle
        for k in ("decode_slot_steps", "decode_idle_slot_steps"):
            out[f"kv_{k}"] = sum(e.stats[k] for e in engines)
        out["kv_admissions"] = self.stats["admissions"]
        out["kv_admission_wait_s"] = float(self.stats["admission_wait_s"])
        out["kv_budget_tokens"] = sum(pools[i]["budget_tokens"] for i in self.rollout)
        out["kv_capacity_contexts"] = float(
            sum(pools[i]["capacity_contexts"] for i in self.rollout)
        )
        for key in ("reserved_tokens", "resident_tokens", "resident_contexts", "queued"):
            out[f"kv_{key}"] = total(key)
        out["kv_waiting"] = len(self.waiting)
        for i, p in pools.items():
            out[f"kv_resident_contexts_c{i}"] = p["resident_contexts"]
        return out

    def prefix_hit_rate(self) -> float:
        """Prompt tokens served from cached KV / prompt tokens, over every engine."""
        reused = sum(e.stats["reused_tokens"] for e in self.engines.values())
        total = sum(e.stats["prompt_tokens"] for e in self.engines.values())
        return reused / max(1, total)
