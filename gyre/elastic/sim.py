"""Discrete-event cluster simulator running the same policy functions as the controller.

Structure: one event loop (:class:`Simulator`; events are small typed tuples, each type with
one handler) and the memory model as a strategy beside it (gyre/elastic/memory.py:
``NoMemory``, ``TokenPools``, ``EnginePools``, ``ResidentPools``, ``EngineResidentPools``),
chosen by the cost model and ``engine_pool``.

Model (every approximation is one line here, so results can be read against it):
- A rollout cell decodes its live requests together. One decode step takes
  ``a + k_b * batch + k_ctx * sum(context) + k_max * max(context)`` seconds (``k_max``: an
  engine that runs every slot up to the longest context, as live KV blocks do; 0 in the
  hardware projections) and gives every request one token, so between events all requests
  on a cell progress at the same rate (fluid, exact for this cost). A call's context is
  taken as prompt + completion / 2 for its whole decode.
- Prefills run one at a time per cell (FIFO) and pause that cell's decoding meanwhile.
- Prefilling n tokens after c cached ones costs n x per-token + attention n x (c + n / 2) x
  per-context-token (``CostModel.prefill_s``; quadratic in the context when nothing is cached).
- A cell holds at most ``slots`` requests; more wait in one global queue (least-loaded routing).
- Train cells take micro-batches of the oldest untrained step (streaming: a full micro-batch
  as soon as one is queued, any remainder once the step's rollout is done). When a step's
  tokens are all trained: optimizer step + weight publication, then weight_version += 1.
- A micro-batch costs fixed + tokens x per-token + (its tokens' summed context) x
  per-context-token; a token's context is its call's (prompt + completion / 2).
- The optimizer step waits for a ring all-reduce of the gradients over the n cells that
  trained the step: 2 (n - 1) / n x ``reduce_s``.
- Carry-over (``PolicyParams.close_share`` < 1, docs/policies.md): a step may close once
  that share of its own units (task groups under ``pack_by_group``, else executions) has
  ended (``close_on`` "owned": as many of the units it trains, carried-in ones included);
  its units still running then belong to the next step (at most ``max_carry`` times), and
  their tokens, those made so far included, are queued there when they end.
- A batch of step s is dispatched when the policy allows it; rollout cells serve every
  request regardless of version (staleness is bounded by the dispatch rule).
- When a new version is published every rollout cell pauses ``weight_load_s`` to load it
  (after the prefill it is running, if prefill pauses decode); KV stays valid.
- A cell leaving rollout hands its live requests to the global queue; they re-prefill their
  context on the next cell (``handover_reprefill``) and continue decoding where they were.
- Execution timeouts are wall-clock from the execution's first admission to a cell (not its
  dispatch); a timed-out execution trains on what it made.
- The policy's snapshot carries measured-equivalent figures, like the controller's: train
  throughput = a running mean (weight 0.3) of the micro-batches' tokens / seconds, attention
  included (before the first: a full micro-batch at the queued tokens' mean context);
  trainable tokens = the oldest step's full micro-batches queued (all of its queue once its
  rollout is done; per task group under ``pack_by_group``), in-flight ones excluded;
  rollout rate = tokens of the executions ended so far / seconds since the first admission.

Memory (``kv_capacity_tokens > 0``; otherwise the prefix cache is global, unlimited and free):
- A cell holds KV for ``kv_capacity_tokens`` tokens (weights and a reserve already taken out:
  ``costs.CellMemory``). Decode batch = the cell's live requests; ``slots`` 0 = no other cap.
- An execution has one resident context on one cell: its latest call's prompt + completion.
  A request reserves its call's final context (prompt + completion) when admitted (no
  preemption mid-decode); after the call that context stays resident, idle, until the next.
- Affinity: a call goes to the cell holding its execution's context if that cell has room
  (live reservations + its need <= pool), else to the cell with most room (one needing no
  eviction first); off its context's cell it prefills its whole prompt, not only the new part.
- Admission: the global queue is FIFO and the head blocks (no overtaking); a request waits
  until some cell has room.
- Eviction: admitting evicts idle resident contexts, least recently used first; an evicted
  execution's next call re-prefills its whole prompt (``counters['reprefill_tokens']``).
- A cell leaving rollout hands over every resident context, idle ones included: by KV
  migration (``handover_migrate``: to the cell with most room, idle contexts only where they
  fit without eviction; the switch lasts longer by the bytes moved / ``link_bytes_per_s``,
  and moved requests continue at once) or by re-prefill (live requests re-prefill their
  context so far on their next cell; idle contexts are dropped and re-prefilled on return).
- The policy's rollout capacity of a cell (executions) is ``cell_capacity`` if set, else the
  KV pool / the mean expected peak context of the outstanding executions, each taken as the
  larger of its own largest context so far and the mean peak of those finished (1 if none).
- ``resident_admission`` (``ResidentPools``, gyre/elastic/admission.py): instead of the FIFO
  per request, an execution is admitted to a cell only while its context can stay resident
  there: a reservation of max(its call's need, the mean peak need of the executions ended so
  far) that grows with each call on that cell (or the call waits); calls of admitted
  executions go first, and a cell where one waits admits no new execution; nothing is
  evicted; a cell with nothing running whose oldest waiting call cannot grow preempts its
  youngest execution (context dropped, counted as an eviction; it starts over as new); a
  cell leaving rollout moves each reservation with its context (migration) to the open cell
  with most room, or drops it (re-prefill).
- ``engine_pool=(max_new_tokens, max_len)``: the real engine's pool rule instead
  (gyre/rollout/engine.py, proxy.py; the CPU replay of benchmarks/sim_vs_real.py --kv-limited).
  A request reserves its footprint P + min(max_new_tokens, max_len - P) - 1, an idle context
  costs its cached length P + completion - 1; a call goes back to the cell that served its
  execution last (even if its context was evicted there) when that cell has a slot and room,
  else to the cell with most free slots, then most room, then lowest index; a context left
  behind on another cell, or by an ended execution, stays there, idle, until evicted or
  cleared; new weights clear every idle context (not evictions); the policy's capacity is
  min(slots, pool / mean footprint of the last 4 x slots admissions). Not modelled: the slot
  count capping idle contexts (a slot taken from another execution's idle context; never
  binding when the pool holds fewer contexts than slots), and a call reusing a context its
  execution left on a cell before its previous call (affinity follows the latest cell).
  ``counters['reprefill_tokens']`` counts as the engine does: a call placed on a cell that
  evicted one of its execution's contexts since the last weights, up to its prompt's last
  token (the engine keeps one record per execution and cell).
- ``engine_pool`` with ``resident_admission`` (``EngineResidentPools``): the engine's pool
  rule under the proxy's resident admission (gyre/rollout/proxy.py ``admission="resident"``),
  through the same ``ResidentAdmission`` ledger: a reservation of the call's footprint (or
  the mean peak footprint of the executions ended so far if larger), grown per call on the
  execution's own cell; at most ``slots`` admitted executions per cell; a call is placed
  where the engine could take it now (a slot, live footprints + its own within the pool) and
  the ledger has room; admitted executions' calls first, new ones FIFO with the head
  blocking, none admitted to a cell where a growth waits; a cell where a growth waits with
  nothing running (a call just done counts as nothing running: its execution's reservation
  goes only at its end) preempts its youngest (``counters['preemptions']``; its context stays,
  unpinned). Eviction takes idle contexts least recently used first, those of executions
  admitted to that cell last (``counters['pinned_evictions']``: 0 while reservations fit the
  pool), so contexts of ended, preempted or moved-away executions go first. New weights
  clear idle contexts, reservations stay; an execution with no call over a whole weight
  version and none outstanding loses its reservation then (``counters['expired']``). A
  cell leaving rollout loses its idle contexts (``dropped_contexts``) and moves each
  reservation to the rollout cell with most room (``handover_migrate``; a live call goes
  with it where that cell can take it now, else it is retried as a new execution's) or
  drops it.

Options for modelling the real engine on one CPU (all off by default):
- ``prefill_chunk > 0``: prefill runs like the engine's fixed-shape program, in chunks (a
  partial chunk costs a whole one), at least one chunk per call (the engine always re-runs
  the last prompt token for its logits), and the prefill samples the call's first token.
- ``mixed_chunk > 0``: chunked prefill alongside decode instead of pausing it: each engine
  step carries one chunk of the running prefill (its cost spread evenly over its chunks) and
  one token of every decoding request, so a step costs decode step + chunk.
- ``prefill_call_s`` / ``microbatch_s`` / ``checkpoint_s``: fixed cost per call's prefill, per
  micro-batch (a fixed-shape program) and
  per optimizer step (the checkpoint the controller saves).
- ``pack_by_group``: like the controller, a task group's tokens are queued when its last
  execution ends, cut into ceil(tokens / microbatch_tokens) micro-batches of their own.
- ``shared_cores``: every cell runs on the same processor (this CPU). Concurrent work shares
  it evenly (processor sharing): while n units (busy or switching cells, the optimizer) work,
  each goes at 1/n speed. All compute slows by the same factor, so the order of events is the
  simulated one and only the clock changes: wall dt = max(1, n) dtau (:func:`shared_clock`).
  Exact when nothing runs on the wall clock (tool latency 0, no timeout reached); otherwise
  tool waits and timeouts are taken in the unshared clock (an approximation).
"""

from __future__ import annotations

import collections
import heapq
import math
from typing import NamedTuple

from gyre.elastic.costs import CostModel, SimResult, shared_clock  # noqa: F401 (re-exported)
from gyre.elastic.memory import (
    EnginePools,
    EngineResidentPools,
    NoMemory,
    ResidentPools,
    TokenPools,
)
from gyre.elastic.policy import POLICIES, ROLLOUT, TRAIN, LoadSnapshot, PolicyParams
from gyre.elastic.simstate import Cell, ExState, Req
from gyre.elastic.workload import Execution

DEFAULT_PARAMS = PolicyParams()
# A request this close to its last token is done: at t ~ 1e6 s smaller time steps vanish in
# float rounding and the decode event would fire forever at the same instant.
_TOKEN_TOL = 1e-6
_TPS_WEIGHT = 0.3  # the controller's running-mean weight (gyre/rl/measure.py)
_COUNTERS = ("evictions", "reprefill_tokens", "migrated_contexts", "migrated_tokens",
             "dropped_contexts", "moved_calls", "preemptions", "expired",
             "pinned_evictions", "carried")  # fmt: skip


# ---- events: (time, seq, event) on one heap, each type with one handler -------------------
class Decode(NamedTuple):
    """The cell's next request may have made its last token (stale if ``epoch`` moved on)."""

    cell: int
    epoch: int


class Prefilled(NamedTuple):
    """A prefill that pauses decoding is over (stale if the request left the cell)."""

    cell: int
    req: Req


class ToolDone(NamedTuple):
    """The tool wait after a call is over: the execution issues its next call or ends."""

    es: ExState


class Timeout(NamedTuple):
    es: ExState


class Switched(NamedTuple):
    cell: int


class MicroDone(NamedTuple):
    cell: int


class OptDone(NamedTuple):
    """The optimizer step is published: weight_version += 1."""


class Loaded(NamedTuple):
    """A rollout cell finished loading new weights (stale unless ``seq`` is its latest)."""

    cell: int
    seq: int


class Simulator:
    """One run of ``policy`` over ``steps`` (a list of per-step execution batches) on K cells."""

    def __init__(
        self,
        steps: list[list[Execution]],
        num_cells: int,
        policy: str,
        cost: CostModel,
        params: PolicyParams = DEFAULT_PARAMS,
        engine_pool: tuple[int, int] | None = None,
    ):
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; expected one of {sorted(POLICIES)}")
        if num_cells < 1 or not steps or not all(steps):
            raise ValueError(
                f"need num_cells >= 1 and non-empty step batches, got {num_cells} cells"
            )
        if cost.handover_migrate and not (
            cost.memory and cost.link_bytes_per_s > 0 and cost.kv_bytes_per_token > 0
        ):
            raise ValueError(
                "handover_migrate needs kv_capacity_tokens, kv_bytes_per_token and "
                "link_bytes_per_s > 0"
            )
        self.steps, self.k, self.name, self.cost, self.params = (
            steps,
            num_cells,
            policy,
            cost,
            params,
        )
        self.mixed = cost.mixed_chunk > 0
        if not cost.memory:
            self.memory = NoMemory(self)
        elif engine_pool is not None:
            pools = EngineResidentPools if cost.resident_admission else EnginePools
            self.memory = pools(self, engine_pool)
        elif cost.resident_admission:
            self.memory = ResidentPools(self)
        else:
            self.memory = TokenPools(self)
        self.memory.check(steps)
        self.policy = POLICIES[policy]
        self.t, self.events, self.seq = 0.0, [], 0
        self.handlers = {
            Decode: self._on_decode,
            Prefilled: self._on_prefill,
            ToolDone: self._on_tool,
            Timeout: self._on_timeout,
            Switched: self._on_switch,
            MicroDone: self._on_micro,
            OptDone: self._on_opt,
            Loaded: self._on_loaded,
        }
        self.cells = [Cell(i, ROLLOUT, 0.0) for i in range(num_cells)]
        self.pending: collections.deque = collections.deque()
        self.queue, self.inflight = collections.defaultdict(float), collections.defaultdict(float)
        self.queue_ctx = collections.defaultdict(float)  # summed contexts of the queued tokens
        self.step_cells = collections.defaultdict(set)  # cells that trained each step
        self.version = self.next_step = self.dispatched = self.started = self.finished = 0
        self.opt_running, self.switches, self.work = False, 0, 0.0
        self.outcomes, self.end_counts, self.timeline, self.step_end = (
            {},
            collections.Counter(),
            [],
            [],
        )
        self.opt_spans: list[tuple[float, float]] = []  # (start, end) of optimizer steps
        # Carry-over units (a task group under pack_by_group, else one execution): the step
        # whose optimizer step trains each (its own until carried), its executions not yet
        # ended, how often it was carried, and per step the units it owns not yet complete.
        units = [(self._unit(ex), ex.step) for b in steps for ex in b]
        self.unit_left = collections.Counter(u for u, _ in units)
        self.unit_owner = {u: s for u, s in units}
        self.unit_carried = collections.Counter()
        self.open_units = collections.defaultdict(set)
        for u, s in units:
            self.open_units[s].add(u)
        self.n_units = {s: len(self.open_units[s]) for s in range(len(steps))}
        self.units_done = collections.Counter()  # by dispatch step: units complete
        self.units_trained = collections.Counter()  # by owner step: units complete
        self.trained_by: dict[str, int] = {}  # execution id -> the step that trained it
        self.group_tokens = collections.defaultdict(float)
        self.group_ctx = collections.defaultdict(float)
        self.micro_sizes = collections.defaultdict(collections.deque)  # pack_by_group only
        self.counters = collections.Counter()
        self.open_es: set = set()  # dispatched executions not yet ended
        self.decode_time = self.batch_time = 0.0
        self.train_tps: float | None = None  # measured tokens/s per train cell
        self.ended_tokens, self.first_start = 0.0, None  # the measured rollout rate

    def _unit(self, ex: Execution) -> tuple:
        """What carries over as one: the task group when groups are packed together (the
        controller's unit), else the execution."""
        return (ex.step, ex.group if self.cost.pack_by_group else ex.execution_id)

    def _need(self, call) -> float:
        """KV tokens a call reserves while live (the engine's footprint under engine_pool)."""
        return self.memory.need(call)

    # ---- event plumbing -------------------------------------------------------------------
    def _push(self, at: float, event) -> None:
        heapq.heappush(self.events, (at, self.seq, event))
        self.seq += 1

    def _pop(self) -> None:
        """Advances the clock to the next event and handles it."""
        self.t, _, event = heapq.heappop(self.events)
        self.handlers[type(event)](event)

    def run(self) -> SimResult:
        self._decide()
        while self.version < len(self.steps):
            if not self.events:
                raise RuntimeError(
                    f"simulator stalled at t={self.t:.1f}s under policy {self.name!r}: version "
                    f"{self.version}, roles {[c.role for c in self.cells]}, {len(self.pending)} waiting"
                )
            self._pop()
        for c in self.cells:
            self._record(c, force=True)
        longest = max(self._fastest(ex) for batch in self.steps for ex in batch)
        if self.cost.shared_cores:
            self._share_cores()
        counters = {k: float(self.counters[k]) for k in _COUNTERS}
        counters["mean_decode_batch"] = (
            self.batch_time / self.decode_time if self.decode_time else 0.0
        )
        counters["trained_tokens"] = float(sum(o[3] for o in self.outcomes.values()))
        return SimResult(
            self.name,
            self.t,
            self.outcomes,
            self.timeline,
            self.work,
            longest,
            self.k,
            self.switches,
            dict(self.end_counts),
            self.step_end,
            counters,
        )

    def _share_cores(self) -> None:
        """Re-times the run as if every cell ran on one shared processor (processor sharing)."""
        busy = [(t0, t1) for _, t0, t1, _, state in self.timeline if state != "idle"]
        wall = shared_clock(busy + self.opt_spans)
        self.timeline = [(c, wall(t0), wall(t1), r, st) for c, t0, t1, r, st in self.timeline]
        self.outcomes = {
            k: (why, wall(t0), wall(t1), tok) for k, (why, t0, t1, tok) in self.outcomes.items()
        }
        self.step_end = [wall(t) for t in self.step_end]
        self.t = wall(self.t)

    def _fastest(self, ex: Execution) -> float:
        c = self.cost

        def call_s(call) -> float:  # alone on a cell: its context is the longest one
            ctx = call.prompt_tokens + call.completion_tokens / 2  # the mean while decoding
            return (
                c.prefill_s(call.new_prompt_tokens, call.prompt_tokens - call.new_prompt_tokens)
                + call.tool_latency_s
                + call.completion_tokens * c.decode_step_s(1, ctx, ctx)
            )

        d = sum(call_s(call) for call in ex.calls)
        return min(d, ex.timeout_s)

    def _record(self, c: Cell, force: bool = False) -> None:
        if c.switching:
            state = "switch"
        elif c.role == ROLLOUT:
            busy = c.active or c.prefilling is not None or c.loading
            state = "busy" if busy else "idle"
        else:
            state = "busy" if c.micro is not None else "idle"
        key = (c.role, state)
        if force or key != c.state:
            if self.t > c.since:
                self.timeline.append((c.i, c.since, self.t) + c.state)
            c.state, c.since = key, self.t

    # ---- policy --------------------------------------------------------------------------
    def _capacity(self) -> float:
        """Executions a rollout cell counts as holding, for the policy (see the docstring)."""
        if self.cost.cell_capacity > 0:
            return self.cost.cell_capacity
        return self.memory.capacity()

    def _snapshot(self) -> LoadSnapshot:
        cost, s, v = self.cost, self.next_step, self.version
        trainable, rolled_out = self._trainable()
        return LoadSnapshot(
            roles=tuple(c.role for c in self.cells),
            dispatched=self.dispatched,
            started=self.started,
            finished=self.finished,
            live_requests=tuple(c.load() for c in self.cells),
            train_queue_tokens=self.queue[v] + self.inflight[v],
            rollout_capacity=(self._capacity(),) * self.k,
            train_throughput=(self._train_tps(),) * self.k,
            switch_r2t_s=cost.switch_r2t_s,
            switch_t2r_s=cost.switch_t2r_s,
            step=s,
            weight_version=self.version,
            total_steps=len(self.steps),
            next_batch=len(self.steps[s]) if s < len(self.steps) else 0,
            trainable_tokens=trainable,
            rolled_out=rolled_out,
            rollout_tokens_per_s=self._rollout_tps(),
            timed_out=self.counters["timed_out"],
            **self.memory.kv_room(),
        )

    def _rollout_tps(self) -> float:
        """Tokens of the executions ended so far / seconds since the first admission."""
        if self.first_start is None or self.t <= self.first_start:
            return 0.0
        return self.ended_tokens / (self.t - self.first_start)

    def _trainable(self) -> tuple[float, bool]:
        """(tokens of the oldest step a train cell could take now, its rollout is done)."""
        v = self.version
        if v >= len(self.steps):
            return 0.0, False
        rolled_out = self._closable(v)
        if self.cost.pack_by_group:
            return float(sum(self.micro_sizes[v])), rolled_out
        q, size = self.queue[v], self.cost.microbatch_tokens
        if rolled_out or q <= 1e-6:
            return max(q, 0.0), rolled_out
        return math.floor(q / size + 1e-9) * size, rolled_out

    def _train_tps(self) -> float:
        """Tokens/s a cell trains, as the controller measures it: a running mean (weight
        0.3) over the micro-batches trained, attention included; before the first, a full
        micro-batch at the mean context of the tokens queued."""
        if self.train_tps is not None:
            return self.train_tps
        q = self.queue[self.version]
        return self.cost.train_tokens_per_s(self.queue_ctx[self.version] / q if q > 0 else 0.0)

    def _decide(self) -> None:
        for _ in range(len(self.steps) + 2):
            alloc = self.policy(self._snapshot(), self.params)
            if len(alloc.roles) != self.k:
                raise ValueError(
                    f"policy {self.name!r} returned {len(alloc.roles)} roles for {self.k} cells"
                )
            for c, want in zip(self.cells, alloc.roles):
                if c.switching or (c.role == TRAIN and c.micro is not None and want != c.role):
                    c.pending_role = want if want != c.role else None
                elif want != c.role:
                    self._switch(c, want)
                else:
                    c.pending_role = None
            if not alloc.dispatch:
                return
            self._dispatch()

    def _switch(self, c: Cell, role: str) -> None:
        extra = self.memory.handover(c) if c.role == ROLLOUT else 0.0
        c.role, c.switching, c.pending_role = role, True, None
        self.switches += 1
        self._push(
            self.t + (self.cost.switch_r2t_s if role == TRAIN else self.cost.switch_t2r_s) + extra,
            Switched(c.i),
        )
        self._record(c)
        self.memory.after_switch()

    def _on_switch(self, ev: Switched) -> None:
        c = self.cells[ev.cell]
        c.switching = False
        c.last_t = self.t
        self._record(c)
        if c.pending_role is not None and c.pending_role != c.role:
            self._switch(c, c.pending_role)
        elif c.role == ROLLOUT:
            self.memory.fill(c)
        else:
            self._try_train()
        self._decide()

    def _dispatch(self) -> None:
        for ex in self.steps[self.next_step]:
            es = ExState(ex, self.t)
            self.memory.dispatched(es)
            self.dispatched += 1
            self.open_es.add(es)
            self._next_call(es)  # its timeout starts when its first call is admitted
        self.next_step += 1

    # ---- rollout -------------------------------------------------------------------------
    def _on_tool(self, ev: ToolDone) -> None:
        self._next_call(ev.es)

    def _next_call(self, es: ExState) -> None:
        """The previous call's tool wait is over: issue the next call or end the execution."""
        if es.ended:
            return
        if es.call >= len(es.ex.calls):
            self._end(es, "success")
            return
        call = es.ex.calls[es.call]
        chunked = self.cost.prefill_chunk > 0  # the engine always prefills >= 1 token
        req = Req(
            es,
            es.call,
            call.prompt_tokens + call.completion_tokens / 2,
            max(call.new_prompt_tokens, 1) if chunked else call.new_prompt_tokens,
            float(call.completion_tokens),
            need=self.memory.need(call),
            cached=call.prompt_tokens - call.new_prompt_tokens,
        )
        req.new = call.new_prompt_tokens
        es.req = req
        self.memory.route(req)

    def _admit(self, c: Cell, req: Req) -> None:
        """Places an admitted request on cell ``c`` (the memory model chose the cell)."""
        req.cell = c
        es = req.ex
        if not es.started:
            es.started, es.start = True, self.t
            if self.first_start is None:
                self.first_start = self.t
            self.started += 1
            self._push(self.t + es.ex.timeout_s, Timeout(es))
        self.memory.admitted(c, req)
        if req.prefill > 0:
            c.prefill_q.append(req)
            if c.prefilling is None and not c.loading:
                self._start_prefill(c)
        else:
            req.fresh = False
            self._join(c, req)
        self._record(c)

    def _step_s(self, c: Cell) -> float:
        """Seconds of one engine step on the cell now; 0 while nothing decodes."""
        if c.loading or (c.prefilling is not None and not self.mixed):
            return 0.0
        if not c.active:
            step = 0.0
        elif self.cost.decode_per_max_ctx_token_s:  # the longest live context, looked up
            step = self.cost.decode_step_s(len(c.active), c.ctx_sum, max(r.ctx for r in c.active))
        else:
            step = self.cost.decode_step_s(len(c.active), c.ctx_sum)
        return step + (c.pf_step_s if c.prefilling is not None else 0.0)

    def _advance(self, c: Cell) -> None:
        step = self._step_s(c)
        dt = self.t - c.last_t
        if step > 0 and dt > 0:
            c.v += dt / step
            if c.active:
                self.decode_time += dt
                self.batch_time += len(c.active) * dt
        c.last_t = self.t

    def _reschedule(self, c: Cell) -> None:
        c.epoch += 1
        step = self._step_s(c)
        if step <= 0:
            return
        while c.heap and (c.heap[0][2] not in c.active or c.heap[0][2].target != c.heap[0][0]):
            heapq.heappop(c.heap)
        nxt = c.heap[0][0] if c.heap else math.inf
        if c.prefilling is not None:
            nxt = min(nxt, c.pf_target)
        self._push(self.t + max(nxt - c.v, 0.0) * step, Decode(c.i, c.epoch))

    def _start_prefill(self, c: Cell) -> None:
        self._advance(c)
        req = c.prefilling = c.prefill_q.popleft()
        seconds = self.cost.prefill_s(req.prefill, req.cached)
        if not self.mixed:
            c.epoch += 1  # decoding pauses while the prefill runs
            self._push(self.t + seconds, Prefilled(c.i, req))
            return
        if seconds <= 0:
            self._finish_prefill(c)
            return
        chunks = max(1, math.ceil(req.prefill / self.cost.mixed_chunk - 1e-9))
        c.pf_step_s, c.pf_target = seconds / chunks, c.v + chunks
        self._reschedule(c)

    def _on_prefill(self, ev: Prefilled) -> None:
        c = self.cells[ev.cell]
        if c.prefilling is not ev.req:
            return  # handed over or cancelled meanwhile
        self._finish_prefill(c)

    def _next_prefill(self, c: Cell) -> None:
        """The cell's prefill slot is free: load pending weights, or start the next prefill."""
        if c.load_pending:
            self._start_load(c)
        elif c.prefill_q and not c.loading:
            self._start_prefill(c)
        else:
            self._reschedule(c)

    def _finish_prefill(self, c: Cell) -> None:
        self._advance(c)
        req = c.prefilling
        c.prefilling, c.pf_step_s = None, 0.0
        # Only the call's own new tokens count as work; any re-prefill is overhead.
        es = req.ex
        call = es.ex.calls[req.call]
        at = call.prompt_tokens - req.new / 2  # mean context of the new tokens
        self.work += req.new * (
            self.cost.prefill_per_token_s
            + self.cost.prefill_per_ctx_token_s * (call.prompt_tokens - req.new + req.new / 2)
        )
        es.tokens += req.new
        es.tok_ctx += req.new * at
        req.prefill = req.new = 0
        req.cached, req.fresh = 0.0, False
        if self.cost.prefill_chunk > 0 and req.remaining >= 1:
            req.remaining -= 1  # the engine's prefill samples the first completion token
            es.tokens += 1
            es.tok_ctx += req.ctx
        self._join(c, req)
        if c.load_pending:
            self._start_load(c)
        elif c.prefill_q and not c.loading:
            self._start_prefill(c)
        self._record(c)

    def _join(self, c: Cell, req: Req) -> None:
        self._advance(c)
        c.active.add(req)
        c.ctx_sum += req.ctx
        req.target = c.v + req.remaining
        heapq.heappush(c.heap, (req.target, self.seq, req))
        self.seq += 1
        self._reschedule(c)

    def _detach(self, c: Cell, req: Req) -> None:
        """Removes a decoding request, crediting the tokens it produced so far."""
        self._advance(c)
        left = max(req.target - c.v, 0.0)
        done = req.remaining - left
        self.work += done * self.cost.min_token_work_s(req.ctx)
        req.ex.tokens += done
        req.ex.tok_ctx += done * req.ctx
        req.remaining = left
        c.active.discard(req)
        c.ctx_sum -= req.ctx
        if not c.active:
            c.ctx_sum = 0.0  # no float drift across many joins and leaves

    def _on_decode(self, ev: Decode) -> None:
        c = self.cells[ev.cell]
        if ev.epoch != c.epoch:
            return
        self._advance(c)
        if self.mixed and c.prefilling is not None and c.v >= c.pf_target - _TOKEN_TOL:
            self._finish_prefill(c)  # mixed_chunk: the prefill's last chunk ran
        while c.heap and c.heap[0][0] <= c.v + _TOKEN_TOL:
            _, _, req = heapq.heappop(c.heap)
            if req in c.active and req.target <= c.v + _TOKEN_TOL:
                self._detach(c, req)
                self.memory.call_done(c, req)
                es = req.ex
                es.req, es.call = None, es.call + 1
                self._push(self.t + es.ex.calls[req.call].tool_latency_s, ToolDone(es))
        self._reschedule(c)
        self.memory.fill(c)
        self._record(c)

    # ---- new weights ---------------------------------------------------------------------
    def _start_load(self, c: Cell) -> None:
        if c.prefilling is not None and not self.mixed:
            c.load_pending = True  # after the running prefill (an engine step boundary)
            return
        self._advance(c)
        c.load_pending, c.loading = False, True
        c.load_seq += 1
        c.epoch += 1
        self._push(self.t + self.cost.weight_load_s, Loaded(c.i, c.load_seq))
        self._record(c)

    def _on_loaded(self, ev: Loaded) -> None:
        c = self.cells[ev.cell]
        if ev.seq != c.load_seq or not c.loading:
            return
        c.loading, c.last_t = False, self.t
        if c.prefilling is None and c.prefill_q:
            self._start_prefill(c)
        else:
            self._reschedule(c)
        self._record(c)

    def _clear(self, c: Cell) -> None:
        """Empties a cell leaving rollout (the memory model has handed its requests over)."""
        c.active, c.heap, c.ctx_sum, c.prefilling, c.pf_step_s = set(), [], 0.0, None, 0.0
        c.prefill_q.clear()
        c.loading = c.load_pending = False
        c.load_seq += 1
        c.epoch += 1

    # ---- execution end -------------------------------------------------------------------
    def _on_timeout(self, ev: Timeout) -> None:
        es = ev.es
        if es.ended:
            return
        req = es.req
        if req is not None:
            c = req.cell
            if c is None:
                req.dead = True  # still in the global queue; dropped when reached
            elif req in c.active:
                self._detach(c, req)
                self._reschedule(c)
            elif c.prefilling is req:
                self._advance(c)
                c.prefilling, c.pf_step_s = None, 0.0
                self._next_prefill(c)
            else:
                c.prefill_q.remove(req)
            if c is not None:
                self.memory.dropped(c, req)
                self.memory.fill(c)
                self._record(c)
        self._end(es, "timeout")

    def _end(self, es: ExState, reason: str) -> None:
        es.ended, es.req = True, None
        self.open_es.discard(es)
        self.finished += 1
        step = es.ex.step
        unit = self._unit(es.ex)
        owner = self.unit_owner[unit]  # the step that trains it (later than ``step`` if carried)
        self.trained_by[es.ex.execution_id] = owner
        self.unit_left[unit] -= 1
        if self.cost.pack_by_group:
            self.group_tokens[unit] += es.tokens
            self.group_ctx[unit] += es.tok_ctx
            if self.unit_left[unit] == 0:
                tokens = self.group_tokens.pop(unit)
                n = max(1, math.ceil(tokens / self.cost.microbatch_tokens))
                self.micro_sizes[owner].extend([tokens / n] * n)
                self.queue[owner] += tokens
                self.queue_ctx[owner] += self.group_ctx.pop(unit)
        else:
            self.queue[owner] += es.tokens
            self.queue_ctx[owner] += es.tok_ctx
        if self.unit_left[unit] == 0:
            self.open_units[owner].discard(unit)
            self.units_done[step] += 1
            self.units_trained[owner] += 1
        self.outcomes[es.ex.execution_id] = (reason, es.start, self.t, es.tokens)
        self.counters["timed_out"] += reason == "timeout"
        self.ended_tokens += es.tokens
        self.end_counts[es.ex.execution_id] += 1
        self.memory.ended(es)
        self._try_train()
        self._decide()

    # ---- carry-over ----------------------------------------------------------------------
    def _closable(self, v: int) -> bool:
        """Step ``v`` may close: ``close_share`` of its own units (under close_on "owned":
        as many of the units it trains, carried-in ones included) have completed and every
        open unit it owns may still be carried (the last step waits for everything)."""
        if v == len(self.steps) - 1:
            return not self.open_units[v]
        done = self.units_trained[v] if self.params.close_on == "owned" else self.units_done[v]
        if done < self.params.close_need(self.n_units[v], last=False):
            return False
        return all(self.unit_carried[u] < self.params.max_carry for u in self.open_units[v])

    def _carry(self, v: int) -> None:
        """Step ``v`` closes: its open units carry over into step v + 1 (their tokens so far
        and those still to come are trained there)."""
        for u in self.open_units.pop(v, ()):
            self.unit_owner[u] = v + 1
            self.unit_carried[u] += 1
            self.open_units[v + 1].add(u)
            self.counters["carried"] += 1

    # ---- training ------------------------------------------------------------------------
    def _try_train(self) -> None:
        s = self.version
        if self.opt_running or s >= len(self.steps):
            return
        rollout_done = self._closable(s)
        size = self.cost.microbatch_tokens
        grouped = self.cost.pack_by_group
        for c in self.cells:
            q = self.queue[s]
            if grouped and not self.micro_sizes[s]:
                break
            if not grouped and (q <= 1e-6 or (q < size and not rollout_done)):
                break
            if c.role == TRAIN and not c.switching and c.micro is None and c.pending_role is None:
                if grouped:
                    take = self.micro_sizes[s].popleft()
                else:
                    take = q if q - size < 1e-6 else size
                take_ctx = min(take * self.queue_ctx[s] / q, self.queue_ctx[s]) if q > 0 else 0.0
                self.queue[s] -= take
                self.queue_ctx[s] -= take_ctx
                self.inflight[s] += take
                c.micro, c.micro_ctx = take, take_ctx
                self.step_cells[s].add(c.i)
                self._push(self.t + self.cost.train_s(take, take_ctx), MicroDone(c.i))
                self._record(c)
        idle = not self.micro_sizes[s] and self.inflight[s] <= 1e-6
        if rollout_done and idle and (grouped or self.queue[s] <= 1e-6):
            self._carry(s)
            self.queue[s] = self.inflight[s] = self.queue_ctx[s] = 0.0
            self.opt_running = True
            reduce = self.cost.allreduce_s(len(self.step_cells.pop(s, ())))
            done = self.t + reduce + self.cost.step_overhead_s
            self.opt_spans.append((self.t, done))
            self._push(done, OptDone())

    def _on_micro(self, ev: MicroDone) -> None:
        c = self.cells[ev.cell]
        self.inflight[self.version] -= c.micro
        seconds = self.cost.train_s(c.micro, c.micro_ctx)
        self.work += seconds
        if seconds > 0:  # the controller's running mean of measured micro-batches
            rate = c.micro / seconds
            old = self.train_tps
            self.train_tps = rate if old is None else (1 - _TPS_WEIGHT) * old + _TPS_WEIGHT * rate
        c.micro, c.micro_ctx = None, 0.0
        self._record(c)
        if c.pending_role is not None and c.pending_role != c.role:
            self._switch(c, c.pending_role)
        self._try_train()
        self._decide()

    def _on_opt(self, ev: OptDone) -> None:
        self.opt_running = False
        self.version += 1
        self.step_end.append(self.t)
        self.memory.new_weights()
        if self.cost.weight_load_s > 0:
            for c in self.cells:
                if c.role == ROLLOUT and not c.switching:
                    self._start_load(c)
        self._try_train()
        self._decide()


def simulate(
    steps: list[list[Execution]],
    num_cells: int,
    policy: str,
    cost: CostModel,
    params: PolicyParams = DEFAULT_PARAMS,
    engine_pool: tuple[int, int] | None = None,
) -> SimResult:
    """Runs one policy over the workload; see the module docstring for the model."""
    return Simulator(steps, num_cells, policy, cost, params, engine_pool).run()
