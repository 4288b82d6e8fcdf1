"""Discrete-event cluster simulator running the same policy functions as the controller.

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
- A batch of step s is dispatched when the policy allows it; rollout cells serve every
  request regardless of version (staleness is bounded by the dispatch rule).
- When a new version is published every rollout cell pauses ``weight_load_s`` to load it
  (after the prefill it is running, if prefill pauses decode); KV stays valid.
- A cell leaving rollout hands its live requests to the global queue; they re-prefill their
  context on the next cell (``handover_reprefill``) and continue decoding where they were.
- Execution timeouts are wall-clock from the execution's first admission to a cell (not its
  dispatch); a timed-out execution trains on what it made.

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

from gyre.elastic.costs import CostModel, SimResult, shared_clock  # noqa: F401 (re-exported)
from gyre.elastic.policy import POLICIES, ROLLOUT, TRAIN, LoadSnapshot, PolicyParams
from gyre.elastic.workload import Execution

DEFAULT_PARAMS = PolicyParams()
# A request this close to its last token is done: at t ~ 1e6 s smaller time steps vanish in
# float rounding and the decode event would fire forever at the same instant.
_TOKEN_TOL = 1e-6


class _Req:
    __slots__ = ("ex", "call", "ctx", "prefill", "new", "remaining", "target", "cell", "dead",
                 "need", "cached", "fresh")  # fmt: skip

    def __init__(self, ex, call, ctx, prefill, remaining, need=0.0, cached=0.0):
        self.ex, self.call, self.ctx, self.prefill, self.remaining = (
            ex,
            call,
            ctx,
            prefill,
            remaining,
        )
        self.new = prefill  # the call's own uncached tokens, credited as work once prefilled
        self.target, self.cell, self.dead = 0.0, None, False
        self.need = need  # KV tokens reserved while live (memory model): prompt + completion
        self.cached = cached  # tokens already in KV before its prefill (the attention offset)
        self.fresh = True  # a call not yet decoding: its prefill is set where it is admitted


class _Cell:
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
        return len(self.active) + len(self.prefill_q) + (self.prefilling is not None)


class _Stale:
    """engine_pool: an execution's idle context left on a cell its next call did not go to."""

    __slots__ = ("cell", "held", "owner")

    def __init__(self, cell, held, owner):
        self.cell, self.held, self.owner = cell, held, owner


class _ExState:
    __slots__ = ("ex", "start", "call", "req", "tokens", "ended", "started", "cell", "held",
                 "tok_ctx", "peak", "home", "lost")  # fmt: skip

    def __init__(self, ex, start):
        self.ex, self.start, self.call, self.req = ex, start, 0, None
        self.tokens, self.ended, self.started = 0.0, False, False
        self.cell, self.held = None, 0.0  # memory model: the cell holding its context, tokens
        self.tok_ctx, self.peak = 0.0, 0.0  # sum of its tokens' contexts; largest reservation
        self.home, self.lost = None, set()  # engine_pool: last cell served; cells that evicted it


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
        self.mem, self.mixed = cost.memory, cost.mixed_chunk > 0
        if not self.mem and cost.slots < 1:
            raise ValueError("slots must be >= 1 without a memory model (kv_capacity_tokens 0)")
        if cost.handover_migrate and not (
            self.mem and cost.link_bytes_per_s > 0 and cost.kv_bytes_per_token > 0
        ):
            raise ValueError(
                "handover_migrate needs kv_capacity_tokens, kv_bytes_per_token and "
                "link_bytes_per_s > 0"
            )
        self.engine = engine_pool if self.mem else None
        self.recent: collections.deque = collections.deque(maxlen=4 * max(cost.slots, 1))
        if self.mem:
            need = max(self._need(c) for b in steps for ex in b for c in ex.calls)
            if need > cost.kv_capacity_tokens:
                raise ValueError(
                    f"a call needs {need} KV tokens but a cell holds "
                    f"{cost.kv_capacity_tokens:.0f} (kv_capacity_tokens): it could never run"
                )
        self.steps, self.k, self.name, self.cost, self.params = (
            steps,
            num_cells,
            policy,
            cost,
            params,
        )
        self.policy = POLICIES[policy]
        self.t, self.events, self.seq = 0.0, [], 0
        self.cells = [_Cell(i, ROLLOUT, 0.0) for i in range(num_cells)]
        self.pending: collections.deque = collections.deque()
        self.queue, self.inflight = collections.defaultdict(float), collections.defaultdict(float)
        self.queue_ctx = collections.defaultdict(float)  # summed contexts of the queued tokens
        self.step_cells = collections.defaultdict(set)  # cells that trained each step
        self.done_per_step = collections.Counter()
        self.version = self.next_step = self.dispatched = self.started = self.finished = 0
        self.opt_running, self.switches, self.work = False, 0, 0.0
        self.outcomes, self.end_counts, self.timeline, self.step_end = (
            {},
            collections.Counter(),
            [],
            [],
        )
        self.opt_spans: list[tuple[float, float]] = []  # (start, end) of optimizer steps
        self.group_left = collections.Counter((ex.step, ex.group) for b in steps for ex in b)
        self.group_tokens = collections.defaultdict(float)
        self.group_ctx = collections.defaultdict(float)
        self.micro_sizes = collections.defaultdict(collections.deque)  # pack_by_group only
        self.counters = collections.Counter()
        self.peak_sum, self.peak_n = 0.0, 0
        self.open_es: set = set()  # dispatched executions not yet ended
        self.all_es: list = []  # engine_pool: every dispatched execution (eviction records)
        self.decode_time = self.batch_time = 0.0
        self.kv_tol = 1e-9 * max(cost.kv_capacity_tokens, 1.0)

    def _need(self, call) -> float:
        """KV tokens a call reserves while live: the engine's footprint under engine_pool."""
        if self.engine is None:
            return call.prompt_tokens + call.completion_tokens
        max_new, max_len = self.engine
        p = call.prompt_tokens
        return p + min(max_new, max_len - p) - 1

    # ---- event plumbing -------------------------------------------------------------------
    def _push(self, at: float, kind: str, *args) -> None:
        heapq.heappush(self.events, (at, self.seq, kind, args))
        self.seq += 1

    def run(self) -> SimResult:
        self._decide()
        while self.version < len(self.steps):
            if not self.events:
                raise RuntimeError(
                    f"simulator stalled at t={self.t:.1f}s under policy {self.name!r}: version "
                    f"{self.version}, roles {[c.role for c in self.cells]}, {len(self.pending)} waiting"
                )
            self.t, _, kind, args = heapq.heappop(self.events)
            getattr(self, "_on_" + kind)(*args)
        for c in self.cells:
            self._record(c, force=True)
        longest = max(self._fastest(ex) for batch in self.steps for ex in batch)
        if self.cost.shared_cores:
            self._share_cores()
        counters = {
            k: float(self.counters[k])
            for k in (
                "evictions",
                "reprefill_tokens",
                "migrated_contexts",
                "migrated_tokens",
                "dropped_contexts",
                "moved_calls",
            )  # fmt: skip
        }
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

    def _record(self, c: _Cell, force: bool = False) -> None:
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
        cost = self.cost
        if cost.cell_capacity > 0:
            return cost.cell_capacity
        if not self.mem:
            return cost.slots
        if self.engine is not None:  # the engine's capacity_contexts
            if not self.recent:
                return float(cost.slots)
            cap = cost.kv_capacity_tokens * len(self.recent) / sum(self.recent)
            return min(float(cost.slots), cap) if cost.slots > 0 else cap
        prior = self.peak_sum / self.peak_n if self.peak_n else 0.0
        sizes = [max(es.peak, prior) for es in self.open_es]
        sizes = [x for x in sizes if x > 0] or [prior]
        est = sum(sizes) / len(sizes)
        cap = cost.kv_capacity_tokens / est if est > 0 else 1.0
        return min(cap, cost.slots) if cost.slots > 0 else cap

    def _snapshot(self) -> LoadSnapshot:
        cost, s = self.cost, self.next_step
        return LoadSnapshot(
            roles=tuple(c.role for c in self.cells),
            dispatched=self.dispatched,
            started=self.started,
            finished=self.finished,
            live_requests=tuple(c.load() for c in self.cells),
            train_queue_tokens=self.queue[self.version] + self.inflight[self.version],
            rollout_capacity=(self._capacity(),) * self.k,
            train_throughput=(cost.train_tokens_per_s(),) * self.k,
            switch_r2t_s=cost.switch_r2t_s,
            switch_t2r_s=cost.switch_t2r_s,
            step=s,
            weight_version=self.version,
            total_steps=len(self.steps),
            next_batch=len(self.steps[s]) if s < len(self.steps) else 0,
        )

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

    def _switch(self, c: _Cell, role: str) -> None:
        extra = self._handover(c) if c.role == ROLLOUT else 0.0
        c.role, c.switching, c.pending_role = role, True, None
        self.switches += 1
        self._push(
            self.t + (self.cost.switch_r2t_s if role == TRAIN else self.cost.switch_t2r_s) + extra,
            "switch",
            c.i,
        )
        self._record(c)
        if self.mem:
            self._fill_all()

    def _on_switch(self, i: int) -> None:
        c = self.cells[i]
        c.switching = False
        c.last_t = self.t
        self._record(c)
        if c.pending_role is not None and c.pending_role != c.role:
            self._switch(c, c.pending_role)
        elif c.role == ROLLOUT:
            self._fill(c)
        else:
            self._try_train()
        self._decide()

    def _dispatch(self) -> None:
        for ex in self.steps[self.next_step]:
            es = _ExState(ex, self.t)
            if self.engine is not None:
                self.all_es.append(es)
            self.dispatched += 1
            self.open_es.add(es)
            self._on_tool(es)  # its timeout starts when its first call is admitted
        self.next_step += 1

    # ---- rollout -------------------------------------------------------------------------
    def _on_tool(self, es: _ExState) -> None:
        """The previous call's tool wait is over: issue the next call or end the execution."""
        if es.ended:
            return
        if es.call >= len(es.ex.calls):
            self._end(es, "success")
            return
        call = es.ex.calls[es.call]
        chunked = self.cost.prefill_chunk > 0  # the engine always prefills >= 1 token
        req = _Req(
            es,
            es.call,
            call.prompt_tokens + call.completion_tokens / 2,
            max(call.new_prompt_tokens, 1) if chunked else call.new_prompt_tokens,
            float(call.completion_tokens),
            need=self._need(call),
            cached=call.prompt_tokens - call.new_prompt_tokens,
        )
        req.new = call.new_prompt_tokens
        es.req = req
        self._route(req)

    def _route(self, req: _Req) -> None:
        if self.mem:  # FIFO: behind whatever waits already
            self.pending.append(req)
            self._fill_all()
            return
        best = None
        for c in self.cells:
            if c.role == ROLLOUT and not c.switching and c.load() < self.cost.slots:
                if best is None or c.load() < best.load():
                    best = c
        if best is None:
            req.cell = None
            self.pending.append(req)
        else:
            self._admit(best, req)

    def _fill(self, c: _Cell) -> None:
        if self.mem:
            self._fill_all()
            return
        while self.pending and c.role == ROLLOUT and not c.switching and c.load() < self.cost.slots:
            req = self.pending.popleft()
            if not req.dead:
                self._admit(c, req)

    # ---- memory model --------------------------------------------------------------------
    def _open(self, c: _Cell) -> bool:
        slots = self.cost.slots
        return c.role == ROLLOUT and not c.switching and (slots <= 0 or c.load() < slots)

    def _fits(self, c: _Cell, need: float, evict: bool = True) -> bool:
        used = c.kv_live + (0.0 if evict else c.kv_idle)
        return used + need <= self.cost.kv_capacity_tokens + self.kv_tol

    def _most_room(self, need: float, exclude=None, live: bool = True):
        """The cell a request (``live``) or an idle context goes to: fits (without evicting,
        for an idle one) and has most room, one that needs no eviction first; or None."""
        best, best_key = None, None
        for c in self.cells:
            if c is exclude or not (
                self._open(c) if live else c.role == ROLLOUT and not c.switching
            ):
                continue
            if not self._fits(c, need, evict=live):
                continue
            key = (
                self._fits(c, need, evict=False),
                -c.kv_live - (0.0 if live else c.kv_idle),
                -c.i,
            )
            if best_key is None or key > best_key:
                best, best_key = c, key
        return best

    def _pick(self, req: _Req):
        if self.engine is not None:  # proxy._pick: affinity, then free slots, room, index
            home = req.ex.home
            if home is not None and self._open(home) and self._fits(home, req.need):
                return home
            ok = [c for c in self.cells if self._open(c) and self._fits(c, req.need)]
            if not ok:
                return None
            return max(ok, key=lambda c: (self.cost.slots - c.load(), -c.kv_live, -c.i))
        home = req.ex.cell
        if home is not None and self._open(home) and self._fits(home, req.need):
            return home
        return self._most_room(req.need, exclude=home)

    def _fill_all(self) -> None:
        """Admits from the head of the global queue while the head fits somewhere."""
        while self.pending:
            req = self.pending[0]
            if req.dead:
                self.pending.popleft()
                continue
            c = self._pick(req)
            if c is None:
                return
            self.pending.popleft()
            self._admit(c, req)

    def _forget(self, es: _ExState) -> None:
        """Drops the execution's idle context from its cell."""
        c = es.cell
        if c is not None and es in c.idle:
            c.kv_idle -= c.idle.pop(es)
        es.cell, es.held = None, 0.0

    def _evict(self, c: _Cell) -> None:
        while c.idle and c.kv_live + c.kv_idle > self.cost.kv_capacity_tokens + self.kv_tol:
            es, held = c.idle.popitem(last=False)
            c.kv_idle -= held
            es.cell, es.held = None, 0.0
            (es if isinstance(es, _ExState) else es.owner).lost.add(c)
            self.counters["evictions"] += 1

    def _clear_idle(self) -> None:
        """engine_pool: new weights clear every idle context (not evictions)."""
        for c in self.cells:
            for es in c.idle:
                es.cell, es.held = None, 0.0
            c.idle.clear()
            c.kv_idle = 0.0
        for es in self.all_es:  # and the cells' eviction records (re-prefill accounting)
            es.lost.clear()

    def _reserve(self, c: _Cell, req: _Req) -> None:
        """Memory at admission: reuse the context if it is here, else prefill it all."""
        es = req.ex
        if req.fresh:
            call = es.ex.calls[req.call]
            reuse = call.prompt_tokens - call.new_prompt_tokens
            req.cached = reuse if es.cell is c else 0
            req.prefill = call.prompt_tokens - req.cached
            if self.cost.prefill_chunk > 0:
                req.prefill = max(req.prefill, 1)
            if self.engine is None:
                self.counters["reprefill_tokens"] += reuse - req.cached
            elif c in es.lost:  # the engine's count: on a cell that evicted it, bar the last
                es.lost.discard(c)
                self.counters["reprefill_tokens"] += max(
                    0, min(reuse, call.prompt_tokens - 1) - req.cached
                )
            if es.cell is not None and es.cell is not c:
                self.counters["moved_calls"] += 1
        else:  # handed over mid-call without its KV: its context so far is all re-prefilled
            self.counters["reprefill_tokens"] += req.prefill
        if (
            self.engine is not None
            and es.cell is not None
            and es.cell is not c
            and es in es.cell.idle
        ):
            old = es.cell  # the engine leaves the context where it was, idle, until evicted
            stale = _Stale(old, es.held, es)
            old.idle = collections.OrderedDict(
                (stale if k is es else k, v) for k, v in old.idle.items()
            )
            es.cell, es.held = None, 0.0
        self._forget(es)
        es.cell, es.held, es.peak = c, req.need, max(es.peak, req.need)
        es.home = c
        if self.engine is not None:
            self.recent.append(req.need)
        c.kv_live += req.need
        self._evict(c)

    def _to_idle(self, c: _Cell, req: _Req) -> None:
        """A call finished: its context stays resident, idle, most recently used."""
        es = req.ex
        c.kv_live -= req.need
        held = req.need
        if self.engine is not None:  # the slot's cached length: the last token is not fed back
            call = es.ex.calls[req.call]
            held = call.prompt_tokens + call.completion_tokens - 1
        c.idle[es] = held
        c.kv_idle += held
        es.cell, es.held = c, held

    def _hand_idle(self, es: _ExState, held: float, src: _Cell) -> float:
        """Hands an idle context over (migration, where it fits) -> tokens moved."""
        es.cell, es.held = None, 0.0
        dst = self._most_room(held, exclude=src, live=False) if self.cost.handover_migrate else None
        if dst is None:
            self.counters["dropped_contexts"] += 1
            return 0.0
        dst.idle[es] = held
        dst.kv_idle += held
        es.cell, es.held = dst, held
        self.counters["migrated_contexts"] += 1
        self.counters["migrated_tokens"] += held
        return held

    # ---- a rollout cell's progress -------------------------------------------------------
    def _admit(self, c: _Cell, req: _Req) -> None:
        req.cell = c
        es = req.ex
        if not es.started:
            es.started, es.start = True, self.t
            self.started += 1
            self._push(self.t + es.ex.timeout_s, "timeout", es)
        if self.mem:
            self._reserve(c, req)
        if req.prefill > 0:
            c.prefill_q.append(req)
            if c.prefilling is None and not c.loading:
                self._start_prefill(c)
        else:
            req.fresh = False
            self._join(c, req)
        self._record(c)

    def _step_s(self, c: _Cell) -> float:
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

    def _advance(self, c: _Cell) -> None:
        step = self._step_s(c)
        dt = self.t - c.last_t
        if step > 0 and dt > 0:
            c.v += dt / step
            if c.active:
                self.decode_time += dt
                self.batch_time += len(c.active) * dt
        c.last_t = self.t

    def _reschedule(self, c: _Cell) -> None:
        c.epoch += 1
        step = self._step_s(c)
        if step <= 0:
            return
        while c.heap and (c.heap[0][2] not in c.active or c.heap[0][2].target != c.heap[0][0]):
            heapq.heappop(c.heap)
        nxt = c.heap[0][0] if c.heap else math.inf
        if c.prefilling is not None:
            nxt = min(nxt, c.pf_target)
        self._push(self.t + max(nxt - c.v, 0.0) * step, "decode", c.i, c.epoch)

    def _start_prefill(self, c: _Cell) -> None:
        self._advance(c)
        req = c.prefilling = c.prefill_q.popleft()
        seconds = self.cost.prefill_s(req.prefill, req.cached)
        if not self.mixed:
            c.epoch += 1  # decoding pauses while the prefill runs
            self._push(self.t + seconds, "prefill", c.i, req)
            return
        if seconds <= 0:
            self._finish_prefill(c)
            return
        chunks = max(1, math.ceil(req.prefill / self.cost.mixed_chunk - 1e-9))
        c.pf_step_s, c.pf_target = seconds / chunks, c.v + chunks
        self._reschedule(c)

    def _on_prefill(self, i: int, req: _Req) -> None:
        c = self.cells[i]
        if c.prefilling is not req:
            return  # handed over or cancelled meanwhile
        self._finish_prefill(c)

    def _finish_prefill(self, c: _Cell) -> None:
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

    def _join(self, c: _Cell, req: _Req) -> None:
        self._advance(c)
        c.active.add(req)
        c.ctx_sum += req.ctx
        req.target = c.v + req.remaining
        heapq.heappush(c.heap, (req.target, self.seq, req))
        self.seq += 1
        self._reschedule(c)

    def _detach(self, c: _Cell, req: _Req) -> None:
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

    def _on_decode(self, i: int, epoch: int) -> None:
        c = self.cells[i]
        if epoch != c.epoch:
            return
        self._advance(c)
        if self.mixed and c.prefilling is not None and c.v >= c.pf_target - _TOKEN_TOL:
            self._finish_prefill(c)  # mixed_chunk: the prefill's last chunk ran
        while c.heap and c.heap[0][0] <= c.v + _TOKEN_TOL:
            _, _, req = heapq.heappop(c.heap)
            if req in c.active and req.target <= c.v + _TOKEN_TOL:
                self._detach(c, req)
                if self.mem:
                    self._to_idle(c, req)
                es = req.ex
                es.req, es.call = None, es.call + 1
                self._push(self.t + es.ex.calls[req.call].tool_latency_s, "tool", es)
        self._reschedule(c)
        self._fill(c)
        self._record(c)

    # ---- new weights ---------------------------------------------------------------------
    def _start_load(self, c: _Cell) -> None:
        if c.prefilling is not None and not self.mixed:
            c.load_pending = True  # after the running prefill (an engine step boundary)
            return
        self._advance(c)
        c.load_pending, c.loading = False, True
        c.load_seq += 1
        c.epoch += 1
        self._push(self.t + self.cost.weight_load_s, "loaded", c.i, c.load_seq)
        self._record(c)

    def _on_loaded(self, i: int, seq: int) -> None:
        c = self.cells[i]
        if seq != c.load_seq or not c.loading:
            return
        c.loading, c.last_t = False, self.t
        if c.prefilling is None and c.prefill_q:
            self._start_prefill(c)
        else:
            self._reschedule(c)
        self._record(c)

    # ---- hand-over -----------------------------------------------------------------------
    def _clear(self, c: _Cell) -> None:
        c.active, c.heap, c.ctx_sum, c.prefilling, c.pf_step_s = set(), [], 0.0, None, 0.0
        c.prefill_q.clear()
        c.loading = c.load_pending = False
        c.load_seq += 1
        c.epoch += 1

    def _handover(self, c: _Cell) -> float:
        """The cell leaves rollout: live requests go back to the front of the global queue
        (memory model: resident contexts are handed over too) -> extra switch seconds."""
        if self.mem:
            return self._handover_memory(c)
        moved = []
        for req in sorted(c.active, key=lambda r: r.target):
            self._detach(c, req)
            if self.cost.handover_reprefill:
                call = req.ex.ex.calls[req.call]
                req.prefill = call.prompt_tokens + call.completion_tokens - req.remaining
                req.cached = 0.0
            moved.append(req)
        if c.prefilling is not None:
            moved.append(c.prefilling)
        moved.extend(c.prefill_q)
        self._clear(c)
        for req in reversed(moved):
            req.cell = None
            self.pending.appendleft(req)
        for other in sorted(self.cells, key=lambda o: o.load()):
            if other is not c:
                self._fill(other)
        return 0.0

    def _handover_memory(self, c: _Cell) -> float:
        migrate, moved_tokens, requeue = self.cost.handover_migrate, 0.0, []
        self._advance(c)
        for req in sorted(c.active, key=lambda r: r.target):  # decoding: move mid-call
            self._detach(c, req)
            es, call = req.ex, req.ex.ex.calls[req.call]
            so_far = call.prompt_tokens + call.completion_tokens - req.remaining
            c.kv_live -= req.need
            es.cell, es.held = None, 0.0
            dst = self._most_room(req.need, exclude=c) if migrate else None
            if dst is None:
                req.prefill, req.cached, req.fresh = so_far, 0.0, False
                requeue.append(req)
                continue
            dst.kv_live += req.need
            es.cell, es.held = dst, req.need
            self._evict(dst)
            req.cell = dst
            self._join(dst, req)
            self._record(dst)
            moved_tokens += so_far
            self.counters["migrated_contexts"] += 1
            self.counters["migrated_tokens"] += so_far
        waiting = ([c.prefilling] if c.prefilling is not None else []) + list(c.prefill_q)
        for req in waiting:  # admitted, not decoding yet: back to the queue, context handed over
            c.kv_live -= req.need
            req.ex.cell, req.ex.held = None, 0.0
            if req.fresh and req.cached > 0:
                moved_tokens += self._hand_idle(req.ex, req.cached, c)
            requeue.append(req)
        for es, held in reversed(list(c.idle.items())):  # idle, most recently used first
            moved_tokens += self._hand_idle(es, held, c)
        c.idle.clear()
        c.kv_live = c.kv_idle = 0.0
        self._clear(c)
        for req in reversed(requeue):
            req.cell = None
            self.pending.appendleft(req)
        return self.cost.migrate_s(moved_tokens) if migrate else 0.0

    # ---- execution end -------------------------------------------------------------------
    def _on_timeout(self, es: _ExState) -> None:
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
                if c.load_pending:
                    self._start_load(c)
                elif c.prefill_q and not c.loading:
                    self._start_prefill(c)
                else:
                    self._reschedule(c)
            else:
                c.prefill_q.remove(req)
            if c is not None:
                if self.mem:
                    c.kv_live -= req.need
                    es.cell, es.held = None, 0.0
                self._fill(c)
                self._record(c)
        self._end(es, "timeout")

    def _end(self, es: _ExState, reason: str) -> None:
        es.ended, es.req = True, None
        self.open_es.discard(es)
        if self.mem and self.engine is None:  # the engine keeps it, idle, until evicted
            self._forget(es)
        if es.peak > 0:
            self.peak_sum += es.peak
            self.peak_n += 1
        self.finished += 1
        step = es.ex.step
        self.done_per_step[step] += 1
        if self.cost.pack_by_group:
            group = (step, es.ex.group)
            self.group_tokens[group] += es.tokens
            self.group_ctx[group] += es.tok_ctx
            self.group_left[group] -= 1
            if self.group_left[group] == 0:
                tokens = self.group_tokens.pop(group)
                n = max(1, math.ceil(tokens / self.cost.microbatch_tokens))
                self.micro_sizes[step].extend([tokens / n] * n)
                self.queue[step] += tokens
                self.queue_ctx[step] += self.group_ctx.pop(group)
        else:
            self.queue[step] += es.tokens
            self.queue_ctx[step] += es.tok_ctx
        self.outcomes[es.ex.execution_id] = (reason, es.start, self.t, es.tokens)
        self.end_counts[es.ex.execution_id] += 1
        if self.mem:
            self._fill_all()
        self._try_train()
        self._decide()

    # ---- training ------------------------------------------------------------------------
    def _try_train(self) -> None:
        s = self.version
        if self.opt_running or s >= len(self.steps):
            return
        rollout_done = self.done_per_step[s] == len(self.steps[s])
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
                self._push(self.t + self.cost.train_s(take, take_ctx), "micro", c.i)
                self._record(c)
        idle = not self.micro_sizes[s] and self.inflight[s] <= 1e-6
        if rollout_done and idle and (grouped or self.queue[s] <= 1e-6):
            self.queue[s] = self.inflight[s] = self.queue_ctx[s] = 0.0
            self.opt_running = True
            reduce = self.cost.allreduce_s(len(self.step_cells.pop(s, ())))
            done = self.t + reduce + self.cost.step_overhead_s
            self.opt_spans.append((self.t, done))
            self._push(done, "opt")

    def _on_micro(self, i: int) -> None:
        c = self.cells[i]
        self.inflight[self.version] -= c.micro
        self.work += self.cost.train_s(c.micro, c.micro_ctx)
        c.micro, c.micro_ctx = None, 0.0
        self._record(c)
        if c.pending_role is not None and c.pending_role != c.role:
            self._switch(c, c.pending_role)
        self._try_train()
        self._decide()

    def _on_opt(self) -> None:
        self.opt_running = False
        self.version += 1
        self.step_end.append(self.t)
        if self.engine is not None:
            self._clear_idle()
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
