"""Discrete-event cluster simulator running the same policy functions as the controller.

Model (every approximation is one line here, so results can be read against it):
- A rollout cell decodes its live requests together. One decode step takes
  ``a + k_b * batch + k_ctx * sum(context)`` seconds and gives every request one token, so
  between events all requests on a cell progress at the same rate (fluid, exact for this
  linear cost). A call's context is taken as prompt + completion / 2 for its whole decode.
- Prefills run one at a time per cell (FIFO) and pause that cell's decoding meanwhile.
- A cell holds at most ``slots`` requests; more wait in one global queue (least-loaded routing).
- Train cells take micro-batches of the oldest untrained step (streaming: a full micro-batch
  as soon as one is queued, any remainder once the step's rollout is done). When a step's
  tokens are all trained: optimizer step + weight publication, then weight_version += 1.
- A batch of step s is dispatched when the policy allows it; rollout cells serve every
  request regardless of version (staleness is bounded by the dispatch rule).
- A cell leaving rollout hands its live requests to the global queue; they re-prefill their
  context on the next cell (``handover_reprefill``) and continue decoding where they were.
- Execution timeouts are wall-clock from dispatch; a timed-out execution trains on what it made.

Options for modelling the real engine on one CPU (all off by default):
- ``prefill_chunk > 0``: prefill runs like the engine's fixed-shape program, in chunks (a
  partial chunk costs a whole one), at least one chunk per call (the engine always re-runs
  the last prompt token for its logits), and the prefill samples the call's first token.
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
    __slots__ = ("ex", "call", "ctx", "prefill", "new", "remaining", "target", "cell", "dead")

    def __init__(self, ex, call, ctx, prefill, remaining):
        self.ex, self.call, self.ctx, self.prefill, self.remaining = (
            ex,
            call,
            ctx,
            prefill,
            remaining,
        )
        self.new = prefill  # the call's own uncached tokens, credited as work once prefilled
        self.target, self.cell, self.dead = 0.0, None, False


class _Cell:
    __slots__ = (
        "i",
        "role",
        "switching",
        "pending_role",
        "active",
        "heap",
        "ctx_sum",
        "v",
        "last_t",
        "prefill_q",
        "prefilling",
        "epoch",
        "micro",
        "state",
        "since",
    )

    def __init__(self, i, role, now):
        self.i, self.role, self.switching, self.pending_role = i, role, False, None
        self.active, self.heap, self.ctx_sum, self.v, self.last_t = set(), [], 0.0, 0.0, now
        self.prefill_q, self.prefilling, self.epoch, self.micro = collections.deque(), None, 0, None
        self.state, self.since = (role, "idle"), now

    def load(self) -> int:
        return len(self.active) + len(self.prefill_q) + (self.prefilling is not None)


class _ExState:
    __slots__ = ("ex", "start", "call", "req", "tokens", "ended", "started")

    def __init__(self, ex, start):
        self.ex, self.start, self.call, self.req = ex, start, 0, None
        self.tokens, self.ended, self.started = 0.0, False, False


class Simulator:
    """One run of ``policy`` over ``steps`` (a list of per-step execution batches) on K cells."""

    def __init__(
        self,
        steps: list[list[Execution]],
        num_cells: int,
        policy: str,
        cost: CostModel,
        params: PolicyParams = DEFAULT_PARAMS,
    ):
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; expected one of {sorted(POLICIES)}")
        if num_cells < 1 or not steps or not all(steps):
            raise ValueError(
                f"need num_cells >= 1 and non-empty step batches, got {num_cells} cells"
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
        self.micro_sizes = collections.defaultdict(collections.deque)  # pack_by_group only

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
        d = sum(
            c.prefill_s(call.new_prompt_tokens)
            + call.tool_latency_s
            + call.completion_tokens
            * c.decode_step_s(1, call.prompt_tokens + call.completion_tokens / 2)
            for call in ex.calls
        )
        return min(d, ex.timeout_s)

    def _record(self, c: _Cell, force: bool = False) -> None:
        if c.switching:
            state = "switch"
        elif c.role == ROLLOUT:
            state = "busy" if (c.active or c.prefilling is not None) else "idle"
        else:
            state = "busy" if c.micro is not None else "idle"
        key = (c.role, state)
        if force or key != c.state:
            if self.t > c.since:
                self.timeline.append((c.i, c.since, self.t) + c.state)
            c.state, c.since = key, self.t

    # ---- policy --------------------------------------------------------------------------
    def _snapshot(self) -> LoadSnapshot:
        cost, s = self.cost, self.next_step
        return LoadSnapshot(
            roles=tuple(c.role for c in self.cells),
            dispatched=self.dispatched,
            started=self.started,
            finished=self.finished,
            live_requests=tuple(c.load() for c in self.cells),
            train_queue_tokens=self.queue[self.version] + self.inflight[self.version],
            rollout_capacity=(cost.cell_capacity or cost.slots,) * self.k,
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
        if c.role == ROLLOUT:
            self._handover(c)
        c.role, c.switching, c.pending_role = role, True, None
        self.switches += 1
        self._push(
            self.t + (self.cost.switch_r2t_s if role == TRAIN else self.cost.switch_t2r_s),
            "switch",
            c.i,
        )
        self._record(c)

    def _on_switch(self, i: int) -> None:
        c = self.cells[i]
        c.switching = False
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
            self.dispatched += 1
            self._push(self.t + ex.timeout_s, "timeout", es)
            self._on_tool(es)
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
        )
        req.new = call.new_prompt_tokens
        es.req = req
        self._route(req)

    def _route(self, req: _Req) -> None:
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
        while self.pending and c.role == ROLLOUT and not c.switching and c.load() < self.cost.slots:
            req = self.pending.popleft()
            if not req.dead:
                self._admit(c, req)

    def _admit(self, c: _Cell, req: _Req) -> None:
        req.cell = c
        if not req.ex.started:
            req.ex.started = True
            self.started += 1
        if req.prefill > 0:
            c.prefill_q.append(req)
            if c.prefilling is None:
                self._start_prefill(c)
        else:
            self._join(c, req)
        self._record(c)

    def _advance(self, c: _Cell) -> None:
        if c.prefilling is None and c.active:
            c.v += (self.t - c.last_t) / self.cost.decode_step_s(len(c.active), c.ctx_sum)
        c.last_t = self.t

    def _reschedule(self, c: _Cell) -> None:
        c.epoch += 1
        if c.prefilling is not None or not c.active:
            return
        while c.heap and (c.heap[0][2] not in c.active or c.heap[0][2].target != c.heap[0][0]):
            heapq.heappop(c.heap)
        step_s = self.cost.decode_step_s(len(c.active), c.ctx_sum)
        self._push(self.t + max(c.heap[0][0] - c.v, 0.0) * step_s, "decode", c.i, c.epoch)

    def _start_prefill(self, c: _Cell) -> None:
        self._advance(c)
        c.prefilling = c.prefill_q.popleft()
        c.epoch += 1  # decoding pauses while the prefill runs
        self._push(
            self.t + self.cost.prefill_s(c.prefilling.prefill),
            "prefill",
            c.i,
            c.prefilling,
        )

    def _on_prefill(self, i: int, req: _Req) -> None:
        c = self.cells[i]
        if c.prefilling is not req:
            return  # handed over or cancelled meanwhile
        c.prefilling, c.last_t = None, self.t
        # Only the call's own new tokens count as work; a hand-over's re-prefill is overhead.
        self.work += req.new * self.cost.prefill_per_token_s
        req.ex.tokens += req.new
        req.prefill = req.new = 0
        if self.cost.prefill_chunk > 0 and req.remaining >= 1:
            req.remaining -= 1  # the engine's prefill samples the first completion token
            req.ex.tokens += 1
        self._join(c, req)
        if c.prefill_q:
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
        while c.heap and c.heap[0][0] <= c.v + _TOKEN_TOL:
            _, _, req = heapq.heappop(c.heap)
            if req in c.active and req.target <= c.v + _TOKEN_TOL:
                self._detach(c, req)
                es = req.ex
                es.req, es.call = None, es.call + 1
                self._push(self.t + es.ex.calls[req.call].tool_latency_s, "tool", es)
        self._reschedule(c)
        self._fill(c)
        self._record(c)

    def _handover(self, c: _Cell) -> None:
        """The cell leaves rollout: live requests go back to the front of the global queue."""
        moved = []
        for req in sorted(c.active, key=lambda r: r.target):
            self._detach(c, req)
            if self.cost.handover_reprefill:
                call = req.ex.ex.calls[req.call]
                req.prefill = call.prompt_tokens + call.completion_tokens - req.remaining
            moved.append(req)
        if c.prefilling is not None:
            moved.append(c.prefilling)
        moved.extend(c.prefill_q)
        c.active, c.heap, c.ctx_sum, c.prefilling = set(), [], 0.0, None
        c.prefill_q.clear()
        c.epoch += 1
        for req in reversed(moved):
            req.cell = None
            self.pending.appendleft(req)
        for other in sorted(self.cells, key=lambda o: o.load()):
            if other is not c:
                self._fill(other)

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
                c.prefilling, c.last_t = None, self.t
                if c.prefill_q:
                    self._start_prefill(c)
                else:
                    self._reschedule(c)
            else:
                c.prefill_q.remove(req)
            if c is not None:
                self._fill(c)
                self._record(c)
        self._end(es, "timeout")

    def _end(self, es: _ExState, reason: str) -> None:
        es.ended, es.req = True, None
        self.finished += 1
        step = es.ex.step
        self.done_per_step[step] += 1
        if self.cost.pack_by_group:
            group = (step, es.ex.group)
            self.group_tokens[group] += es.tokens
            self.group_left[group] -= 1
            if self.group_left[group] == 0:
                tokens = self.group_tokens.pop(group)
                n = max(1, math.ceil(tokens / self.cost.microbatch_tokens))
                self.micro_sizes[step].extend([tokens / n] * n)
                self.queue[step] += tokens
        else:
            self.queue[step] += es.tokens
        self.outcomes[es.ex.execution_id] = (reason, es.start, self.t, es.tokens)
        self.end_counts[es.ex.execution_id] += 1
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
                self.queue[s] -= take
                self.inflight[s] += take
                c.micro = take
                self._push(
                    self.t + take * self.cost.train_per_token_s + self.cost.microbatch_s,
                    "micro",
                    c.i,
                )
                self._record(c)
        idle = not self.micro_sizes[s] and self.inflight[s] <= 1e-6
        if rollout_done and idle and (grouped or self.queue[s] <= 1e-6):
            self.queue[s] = self.inflight[s] = 0.0
            self.opt_running = True
            done = self.t + self.cost.step_overhead_s
            self.opt_spans.append((self.t, done))
            self._push(done, "opt")

    def _on_micro(self, i: int) -> None:
        c = self.cells[i]
        self.inflight[self.version] -= c.micro
        self.work += c.micro * self.cost.train_per_token_s + self.cost.microbatch_s
        c.micro = None
        self._record(c)
        if c.pending_role is not None and c.pending_role != c.role:
            self._switch(c, c.pending_role)
        self._try_train()
        self._decide()

    def _on_opt(self) -> None:
        self.opt_running = False
        self.version += 1
        self.step_end.append(self.t)
        self._try_train()
        self._decide()


def simulate(
    steps: list[list[Execution]],
    num_cells: int,
    policy: str,
    cost: CostModel,
    params: PolicyParams = DEFAULT_PARAMS,
) -> SimResult:
    """Runs one policy over the workload; see the module docstring for the model."""
    return Simulator(steps, num_cells, policy, cost, params).run()
