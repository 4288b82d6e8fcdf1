"""Allocation policies: pure functions of a load snapshot (docs/policies.md).

The controller and the simulator build a :class:`LoadSnapshot` at every decision point (an
execution ends, the train queue drains, an optimizer step lands, a switch completes) and call
``POLICIES[name](snapshot, params)``. The returned :class:`Allocation` names the target role
of every cell and whether the next step's batch may be dispatched now. Same snapshot, same
allocation: nothing here reads a clock, a random source or global state.

Cell 0 is the core cell: it owns the optimizer state, so it is the first to leave rollout and
the last to return.
"""

from __future__ import annotations

import dataclasses
import math

from gyre import bounds

ROLLOUT, TRAIN = "rollout", "train"


@dataclasses.dataclass(frozen=True)
class LoadSnapshot:
    """What a policy may look at. Per-cell tuples have one entry per cell (index 0 = core).

    roles: the role each cell plays or is switching into.
    dispatched / started / finished: execution counters since the run began.
    live_requests: model calls held by each cell (0 on train cells).
    train_queue_tokens: tokens trainable now (finished executions of the step being trained,
      queued or in flight); later steps' tokens wait for the optimizer step and do not count.
    rollout_capacity: executions a cell serves concurrently at its target batch.
    train_throughput: tokens/s one cell trains.
    switch_r2t_s / switch_t2r_s: seconds a rollout->train / train->rollout switch costs.
    step: index of the next step whose batch is not yet dispatched.
    weight_version: optimizer steps completed (the newest published weights).
    total_steps / next_batch: steps in the run, executions the next dispatch adds.
    trainable_tokens: tokens a train cell could take now and none has taken: the oldest
      step's full micro-batches queued, or everything it has queued once its rollout is done
      (micro-batches in flight excluded).
    rolled_out: the oldest untrained step may close: every execution it waits for has ended
      (all of its own, or with carry-over ``PolicyParams.close_share`` of its groups and the
      groups carried into it as far as they may go), so its remaining tokens gate its
      optimizer step (and, through the staleness bound, the next dispatch).
    rollout_tokens_per_s: measured rate at which rollout hands tokens to training, cluster
      wide: the tokens of every execution ended so far / the seconds since the first
      execution was admitted (0 until one has ended). With ``train_throughput`` it sizes the
      train cells ``elastic`` holds (the train work per second, in cells).
    kv_reserved_tokens / kv_free_tokens: per cell, the KV tokens resident admission reserves
      for the executions admitted there (their contexts stay between calls) and the room left
      unreserved; empty when not tracked (admission 'none'). ``elastic`` lends a rollout cell
      only if the cells that stay can take its reservations: otherwise lending it would evict
      contexts that must then be prefilled again, or preempt executions.
    timed_out: of the ``finished`` executions, those that ended at their timeout (measured;
      their share tells ``elastic`` what pausing running executions would cost).
    kv_peak_tokens: the mean peak KV reservation of the executions ended so far (the resident
      ledger's; 0 before the first ends or when not tracked). With the pools
      (``kv_reserved_tokens`` + ``kv_free_tokens``) it tells ``elastic`` whether its base
      split's rollout cells hold a whole batch resident.
    """

    roles: tuple[str, ...]
    dispatched: int
    started: int
    finished: int
    live_requests: tuple[int, ...]
    train_queue_tokens: float
    rollout_capacity: tuple[float, ...]
    train_throughput: tuple[float, ...]
    switch_r2t_s: float
    switch_t2r_s: float
    step: int = 0
    weight_version: int = 0
    total_steps: int = 1
    next_batch: int = 0
    trainable_tokens: float = 0.0
    rolled_out: bool = False
    rollout_tokens_per_s: float = 0.0
    kv_reserved_tokens: tuple[float, ...] = ()
    kv_free_tokens: tuple[float, ...] = ()
    timed_out: int = 0
    kv_peak_tokens: float = 0.0

    def __post_init__(self):
        k = len(self.roles)
        if k == 0:
            raise ValueError("LoadSnapshot.roles is empty: a run needs at least one cell")
        for name in ("live_requests", "rollout_capacity", "train_throughput"):
            if len(getattr(self, name)) != k:
                raise ValueError(
                    f"LoadSnapshot.{name} has {len(getattr(self, name))} entries, roles has {k}"
                )
        for name in ("kv_reserved_tokens", "kv_free_tokens"):
            xs = getattr(self, name)
            if len(xs) not in (0, k):
                raise ValueError(f"LoadSnapshot.{name} has {len(xs)} entries, roles has {k}")
            if not all(x >= 0 for x in xs):
                raise ValueError(f"LoadSnapshot.{name} must be >= 0, got {xs}")
        if len(self.kv_reserved_tokens) != len(self.kv_free_tokens):
            raise ValueError(
                "LoadSnapshot.kv_reserved_tokens and kv_free_tokens are given together or not "
                f"at all, got {len(self.kv_reserved_tokens)} and {len(self.kv_free_tokens)}"
            )
        if not 0 <= self.timed_out <= max(self.finished, 0):
            raise ValueError(
                f"LoadSnapshot.timed_out must be in [0, finished={self.finished}], "
                f"got {self.timed_out}"
            )
        if any(r not in (ROLLOUT, TRAIN) for r in self.roles):
            raise ValueError(f"LoadSnapshot.roles must be 'rollout' or 'train', got {self.roles}")
        if not self.kv_peak_tokens >= 0:
            raise ValueError(f"LoadSnapshot.kv_peak_tokens must be >= 0, got {self.kv_peak_tokens}")
        if not self.trainable_tokens >= 0:
            raise ValueError(
                f"LoadSnapshot.trainable_tokens must be >= 0, got {self.trainable_tokens}"
            )
        if not self.rollout_tokens_per_s >= 0:
            raise ValueError(
                f"LoadSnapshot.rollout_tokens_per_s must be >= 0, got {self.rollout_tokens_per_s}"
            )
        if not 0 <= self.finished <= self.started <= self.dispatched:
            raise ValueError(
                f"LoadSnapshot counters must satisfy 0 <= finished ({self.finished}) <= started "
                f"({self.started}) <= dispatched ({self.dispatched})"
            )

    @property
    def num_cells(self) -> int:
        return len(self.roles)

    @property
    def outstanding(self) -> int:
        """Executions dispatched and not yet finished (the rollout work still owed)."""
        return self.dispatched - self.finished

    @property
    def running(self) -> int:
        """Executions admitted and not yet finished (their contexts hold KV)."""
        return self.started - self.finished

    @property
    def timeout_share(self) -> float:
        """Share of the executions ended so far that ended at their timeout (0 before any)."""
        return self.timed_out / self.finished if self.finished > 0 else 0.0

    @property
    def staleness(self) -> int:
        """Version lag a batch dispatched now would carry: step - weight_version."""
        return self.step - self.weight_version


CLOSE_ON = ("own", "owned")  # PolicyParams.close_on


@dataclasses.dataclass(frozen=True)
class PolicyParams:
    """async_rollout_cells: the fixed async split (0 = half); max_staleness: bound on
    step - weight_version at dispatch (colocate always uses 0); slack_cells: spare rollout
    cells the elastic policies keep beyond the work they size rollout by; leave_round_trips:
    elastic: a cell leaves rollout only for trainable work that keeps every train cell busy
    for this many switch round trips (rollout -> train -> rollout).

    Carry-over (steps that do not wait for their stragglers; the controller and the simulator
    alike; on by default, docs/policies.md): close_share: a step may close (train and apply
    its update) once this share of its task groups has finished; 1.0 = every group (off: an
    on-policy run that must resume token for token sets it, as the quick starts do, see
    docs/exactness.md). Groups still running carry over into
    the next step with the tokens they made so far; max_carry: how many steps a group may be
    carried (a step waits for carried groups that reached it), so a token is trained at most
    ``max_staleness + max_carry`` versions after the weights that sampled it. The last step
    of a run waits for everything. close_on: which finished groups count towards the share:
    "own" (those the step dispatched) or "owned" (every group the step trains, carried-in
    ones included: a step then closes on whatever has finished of its pool, and groups
    carried in, already part-way through, no longer wait behind a fresh batch's fastest)."""

    async_rollout_cells: int = 0
    max_staleness: int = 1
    slack_cells: int = 1
    leave_round_trips: float = bounds.knob(3.0, bounds.Bound(0))
    close_share: float = bounds.knob(0.9, bounds.Bound(0, 1, lo_open=True))
    max_carry: int = bounds.knob(1, bounds.Bound(1))
    close_on: str = "owned"

    def __post_init__(self):
        bounds.check(self, "scheduler")
        if self.close_on not in CLOSE_ON:
            raise ValueError(f"scheduler.close_on must be one of {CLOSE_ON}, got {self.close_on!r}")

    def close_need(self, units: int, last: bool) -> int:
        """Finished units (task groups, or the simulator's executions; its own, or under
        close_on "owned" every one it trains) a step waits for before it may close, of
        ``units`` of its own: all for the run's last step (nothing follows to carry into),
        else ceil(close_share x units) (all when carry-over is off)."""
        return units if last else math.ceil(self.close_share * units - 1e-9)


@dataclasses.dataclass(frozen=True)
class Allocation:
    """roles: target role per cell; dispatch: the next step's batch may be dispatched now."""

    roles: tuple[str, ...]
    reason: str
    dispatch: bool = False


def _may_dispatch(snap: LoadSnapshot, max_staleness: int) -> bool:
    return snap.step < snap.total_steps and snap.staleness <= max_staleness


def colocate(snap: LoadSnapshot, params: PolicyParams = PolicyParams()) -> Allocation:
    """All cells roll out a step's batch, then all cells train on it (staleness 0). With
    carry-over the step trains once it may close (``rolled_out``); its carried executions
    wait through the training and roll out beside the next step's batch."""
    k = snap.num_cells
    if _may_dispatch(snap, 0):  # the last update has landed (queued tokens are carried ones)
        return Allocation((ROLLOUT,) * k, f"dispatch step {snap.step}: all cells roll out", True)
    if snap.outstanding > 0 and not (snap.rolled_out and snap.train_queue_tokens > 0):
        return Allocation((ROLLOUT,) * k, f"{snap.outstanding} executions outstanding")
    if snap.train_queue_tokens > 0:
        return Allocation((TRAIN,) * k, "rollout done: all cells train")
    return Allocation(snap.roles, "waiting for the optimizer step")


def async_split(snap: LoadSnapshot, params: PolicyParams = PolicyParams()) -> Allocation:
    """A fixed split: the first K - R cells (the core among them) train, the rest roll out.

    The rollout of step s + 1 overlaps the training of step s; a batch is dispatched only
    while step - weight_version <= max_staleness.
    """
    k = snap.num_cells
    r = params.async_rollout_cells or k // 2
    if not 1 <= r <= k - 1:
        raise ValueError(
            f"PolicyParams.async_rollout_cells must be in [1, {k - 1}] for {k} cells, got {r}"
        )
    roles = (TRAIN,) * (k - r) + (ROLLOUT,) * r
    dispatch = _may_dispatch(snap, params.max_staleness)
    return Allocation(roles, f"fixed split {k - r} train / {r} rollout", dispatch)


def _demand(snap: LoadSnapshot, params: PolicyParams) -> tuple[bool, int, float]:
    """(whether a batch may be dispatched now, executions rollout owes: the outstanding ones
    plus that batch, the capacity ``slack_cells`` spare rollout cells hold)."""
    dispatch = _may_dispatch(snap, params.max_staleness)
    demand = snap.outstanding + (snap.next_batch if dispatch else 0)
    return dispatch, demand, params.slack_cells * max(snap.rollout_capacity)


def _no_starved_role(snap: LoadSnapshot, roles: list, demand: int, moved_out, moved_in) -> None:
    """Demand never lacks a rollout cell (the last cell returns), and queued tokens with no
    demand left never lack a train cell (the core goes), whatever the switch costs: nothing
    else would ever serve them."""
    if demand > 0 and ROLLOUT not in roles:
        roles[-1] = ROLLOUT
        moved_in.append(len(roles) - 1)
    if snap.train_queue_tokens > 0 and demand == 0 and TRAIN not in roles:
        roles[0] = TRAIN
        moved_out.append(0)


def _capacity(snap: LoadSnapshot, cells) -> float:
    return sum(snap.rollout_capacity[i] for i in cells)


def elastic_memory(snap: LoadSnapshot, params: PolicyParams = PolicyParams()) -> Allocation:
    """Waterlevel rule sized by memory (the previous ``elastic``, kept as an ablation).

    demand = outstanding executions (+ the next batch if it may be dispatched now).
    Leave: rollout cells in the order core first, then fewest live requests; one leaves while
    the capacity left behind minus ``slack_cells`` of capacity still covers the demand, and
    only if the idle area it reclaims (cell-seconds of queued train work it would do, queue /
    (train throughput with it)) exceeds the round-trip switch cost.
    Return: once the train queue has drained, train cells (core last) return while rollout
    capacity minus slack falls short of the demand. Demand never lacks a rollout cell, and a
    queue with no demand left never lacks a train cell.
    """
    k = snap.num_cells
    dispatch, demand, slack = _demand(snap, params)
    roles = list(snap.roles)
    rollout = [i for i in range(k) if roles[i] == ROLLOUT]

    def covered(cells) -> bool:
        return demand == 0 or _capacity(snap, cells) - slack >= demand

    moved_out, moved_in = [], []
    queue = snap.train_queue_tokens
    if queue > 0:
        train_tp = sum(snap.train_throughput[i] for i in range(k) if roles[i] == TRAIN)
        round_trip = snap.switch_r2t_s + snap.switch_t2r_s
        order = sorted(rollout, key=lambda i: (i != 0, snap.live_requests[i], i))
        for i in order:
            rest = [j for j in rollout if j != i]
            reclaimed_s = queue / (train_tp + snap.train_throughput[i])
            if not covered(rest) or reclaimed_s <= round_trip:
                continue
            roles[i], rollout, train_tp = TRAIN, rest, train_tp + snap.train_throughput[i]
            moved_out.append(i)
    else:
        # Core last: the highest index returns first.
        for i in sorted((i for i in range(k) if roles[i] == TRAIN), reverse=True):
            if covered(rollout):
                break
            roles[i] = ROLLOUT
            rollout.append(i)
            moved_in.append(i)
    _no_starved_role(snap, roles, demand, moved_out, moved_in)
    need = math.ceil(demand / max(snap.rollout_capacity)) if demand else 0
    reason = f"demand {demand} (~{need} cells) + slack {params.slack_cells}"
    if moved_out:
        reason += f"; cells {moved_out} leave rollout (queue {queue:.0f} tokens)"
    if moved_in:
        reason += f"; cells {moved_in} return to rollout"
    return Allocation(tuple(roles), reason, dispatch)


def elastic_throughput(snap: LoadSnapshot, params: PolicyParams = PolicyParams()) -> Allocation:
    """Throughput rule (issue 33's first pass, kept as an ablation; ``elastic`` uses it until
    the rollout rate is measured): every cell decodes unless trainable work claims it.

    Leave: rollout cells in the order core first, then fewest live requests, leave while the
    trainable tokens keep every train cell (this one included) busy for more than
    ``leave_round_trips`` switch round trips, ``trainable / sum(train throughput) > L *
    (r2t + t2r)``; once the oldest step has rolled out its tokens gate the optimizer step, so
    one round trip suffices and one cell always trains them. Memory binds too: the rollout
    cells left behind must hold the running executions' contexts plus ``slack_cells`` of
    capacity (while there is demand).
    Gated: once the oldest step has rolled out and no batch may be dispatched before its
    update (staleness 0 with carry-over), the update gates all progress: memory does not
    bind, and executions still running (carried over) wait for it without a rollout cell,
    as colocate's do.
    Return: with nothing trainable left to take and rollout demand (outstanding executions or
    a batch that may be dispatched), every train cell returns (one mid micro-batch finishes
    it first). Demand never lacks a rollout cell (unless gated), and queued tokens with no
    demand left never lack a train cell.
    """
    k = snap.num_cells
    dispatch, demand, slack = _demand(snap, params)
    roles = list(snap.roles)
    rollout = [i for i in range(k) if roles[i] == ROLLOUT]
    work = snap.trainable_tokens
    round_trip = snap.switch_r2t_s + snap.switch_t2r_s
    # Work that gates the optimizer step (the oldest step has rolled out) needs only to repay
    # one round trip per cell.
    need_s = round_trip * (1.0 if snap.rolled_out else params.leave_round_trips)
    # Contexts that must stay resident: the running executions, or those a dispatch adds.
    # Not once the oldest step has rolled out while no batch may be dispatched before its
    # update (staleness 0 with carry-over): the update gates everything then, and the
    # executions still running are carried over and wait for it, as colocate's do (measured
    # with carry-over, close share 0.9, at KV 0.7 / share 0.45: 0.93 -> 1.05 of colocate).
    gated = snap.rolled_out and not dispatch
    hold = min(demand, max(snap.running, 1)) if demand and not gated else 0

    def holds(cells) -> bool:
        return hold == 0 or _capacity(snap, cells) - slack >= hold

    moved_out, moved_in = [], []
    train_tp = sum(snap.train_throughput[i] for i in range(k) if roles[i] == TRAIN)
    if work > 0:
        order = sorted(rollout, key=lambda i: (i != 0, snap.live_requests[i], i))
        for i in order:
            rest = [j for j in rollout if j != i]
            busy_s = work / (train_tp + snap.train_throughput[i])
            first = snap.rolled_out and train_tp == 0  # the optimizer step waits on it
            if not first and (busy_s <= need_s or not holds(rest)):
                continue
            roles[i], rollout, train_tp = TRAIN, rest, train_tp + snap.train_throughput[i]
            moved_out.append(i)
    elif demand > 0:
        for i in sorted((i for i in range(k) if roles[i] == TRAIN), reverse=True):
            roles[i] = ROLLOUT
            rollout.append(i)
            moved_in.append(i)
    # While the update gates everything, carried executions do not claim a rollout cell.
    _no_starved_role(snap, roles, 0 if gated and work > 0 else demand, moved_out, moved_in)
    reason = f"demand {demand}, trainable {work:.0f} tokens"
    if moved_out:
        reason += f"; cells {moved_out} leave rollout"
    if moved_in:
        reason += f"; cells {moved_in} return to rollout"
    return Allocation(tuple(roles), reason, dispatch)


# Relative noise of the measured train throughput (a running mean over micro-batches whose
# contexts differ) that the base split ignores: it keeps its train cells while they are
# within this band of the measured need, so that it does not flap between two splits.
BASE_BAND = 0.2


def _train_need(snap: LoadSnapshot) -> float:
    """Train cells training must run to keep pace with rollout, measured:
    rollout_tokens_per_s / mean train_throughput (0 while either is unmeasured)."""
    tp = sum(snap.train_throughput) / snap.num_cells
    return snap.rollout_tokens_per_s / tp if snap.rollout_tokens_per_s > 0 and tp > 0 else 0.0


def base_holds_batch(snap: LoadSnapshot) -> bool:
    """Whether the rollout cells of the measured split (the last K - ceil(need) cells, see
    :func:`base_train_cells`) hold a whole batch resident: their KV pools over the mean peak
    reservation of the executions ended so far >= ``next_batch``. False while unmeasured (no
    execution has ended, no pools tracked, no batch left) or with one cell."""
    k, x = snap.num_cells, _train_need(snap)
    if k < 2 or x <= 0 or snap.kv_peak_tokens <= 0 or not snap.kv_free_tokens:
        return False
    n = min(max(math.ceil(x - 1e-9), 1), k - 1)
    pools = sum(snap.kv_reserved_tokens[i] + snap.kv_free_tokens[i] for i in range(n, k))
    return snap.next_batch > 0 and pools / snap.kv_peak_tokens >= snap.next_batch


def base_train_cells(snap: LoadSnapshot) -> int:
    """Train cells the measured figures call for, in [1, K - 1]; 0 while either figure is
    unmeasured or with one cell. Need x = rollout_tokens_per_s / mean train_throughput (the
    cells training must run to keep pace with rollout). The current base n (the leading train
    cells) stays while ``x (1 - BASE_BAND) <= n < x (1 + BASE_BAND) + 1``; otherwise it moves
    one cell towards ceil(x) (from no base, straight to it).

    Why one cell: the rollout rate is measured under the current split and answers it (fewer
    rollout cells, fewer tokens per second), so a jump to ceil(x) can overshoot and the next
    decision jump back (measured in the simulator: the base swinging between 5 and 7 train
    cells of 8 where training dominates). A cell at a time lets the rate settle under each."""
    k = snap.num_cells
    x = _train_need(snap)
    if k < 2 or x <= 0:
        return 0
    n = next((i for i, r in enumerate(snap.roles) if r != TRAIN), k)
    if not x * (1 - BASE_BAND) <= n < x * (1 + BASE_BAND) + 1:
        target = math.ceil(x - 1e-9)
        n = target if n == 0 else min(max(target, n - 1), n + 1)
    return min(max(n, 1), k - 1)


def _room_for(snap: LoadSnapshot, i: int, staying) -> bool:
    """Whether the KV reservations on cell ``i`` fit in the free room of ``staying`` (always
    true when the snapshot does not track reservations). Each lend is checked on its own, not
    against the room earlier lends of the same decision take: measured, the stricter check
    lent less and lost 1% (the paper table's 122B row) and 2% (KV 0.7 / share 0.05, six
    seeds), gaining nothing elsewhere; a reservation that finds no room is dropped and its
    execution admitted again later."""
    if not snap.kv_reserved_tokens:
        return True
    return snap.kv_reserved_tokens[i] <= sum(snap.kv_free_tokens[j] for j in staying)


# With carry-over, ``elastic`` is the throughput rule while fewer than this share of the
# executions ended so far timed out (and its base split could not hold a batch resident).
# Measured (BENCHMARKS.md, issue 33's sixth pass): where 2-12% time out the rule completed
# more executions per hour than the best split at every KV <= 0.7 point of the regimes map;
# on the 2.4T row, where 64% do, it completed 19% fewer (78% cut short: paused executions'
# clocks keep running) and the measured base ties.
PAUSE_TIMEOUT_SHARE = 0.25


def elastic(snap: LoadSnapshot, params: PolicyParams = PolicyParams()) -> Allocation:
    """A measured base split, and idle rollout cells lent to training.

    Base: the first ``base_train_cells`` cells (the core among them) train, so that training
    keeps pace with the rate at which rollout hands it tokens, both measured; the rest roll
    out. Until the rate is measured (no execution has ended), and always when steps may not
    overlap (``max_staleness`` 0: a step trains only once its rollout is done, so a standing
    split would idle its train cells through every rollout), and with carry-over while
    fewer than ``PAUSE_TIMEOUT_SHARE`` of the ended executions timed out and the base's
    rollout cells could not hold a batch resident (:func:`base_holds_batch`), the
    throughput rule decides.
    Lend: a rollout cell with no live request goes to training while no execution waits for
    admission (none dispatched and not started, no batch about to be dispatched) and the
    trainable tokens keep the train cells, it included, busy for more than
    ``leave_round_trips`` switch round trips (one once the oldest step has rolled out); a
    lent cell stays lent while trainable work is left and nothing waits, then returns. Cell
    n, the base's first rollout cell, is never lent, and a cell is lent only if the rollout
    cells that stay have free room for its KV reservations (when the snapshot tracks them).
    Only a cell with no live request is lent, to a role with work waiting: the policy is the
    base split plus work the split would leave undone, at the cost of the switches and of
    handing over the lent cell's idle contexts.
    """
    k = snap.num_cells
    # With carry-over, while executions rarely run into their timeout, the throughput rule
    # decides: it gives every cell to an update that gates the run, pausing the next step's
    # executions, which is cheap only while their clocks have time to spare. Not where the
    # base's rollout cells hold a whole batch resident: rolling out on every cell then adds
    # no room for contexts, and pausing them for the update only costs (measured at KV 2.0:
    # the rule 0.97 / 1.00 of the best split at shares 0.05 / 0.2, the base 1.04 / 1.09).
    pause_ok = (params.close_share < 1 and snap.timeout_share < PAUSE_TIMEOUT_SHARE
                and not base_holds_batch(snap))  # fmt: skip
    n = base_train_cells(snap) if params.max_staleness > 0 and not pause_ok else 0
    if n == 0:
        return elastic_throughput(snap, params)
    dispatch = _may_dispatch(snap, params.max_staleness)
    roles = [TRAIN] * n + [ROLLOUT] * (k - n)
    waiting = snap.dispatched > snap.started or (dispatch and snap.next_batch > 0)
    work, lent = snap.trainable_tokens, []
    if work > 0 and not waiting:
        round_trip = snap.switch_r2t_s + snap.switch_t2r_s
        need_s = round_trip * (1.0 if snap.rolled_out else params.leave_round_trips)
        train_tp = sum(snap.train_throughput[:n])
        # Cell n (the base's first rollout cell) is never lent: it always rolls out, and it
        # marks where the base ends in the roles the next snapshot carries.
        for i in range(n + 1, k):
            if snap.live_requests[i]:
                continue
            if snap.roles[i] == ROLLOUT:
                staying = [j for j in range(n, k) if j != i and roles[j] == ROLLOUT]
                if not _room_for(snap, i, staying):
                    continue
            if snap.roles[i] == TRAIN or work / (train_tp + snap.train_throughput[i]) > need_s:
                roles[i] = TRAIN
                train_tp += snap.train_throughput[i]
                lent.append(i)
    reason = f"measured split {n} train / {k - n} rollout"
    if lent:
        reason += f"; idle cells {lent} lent to training ({work:.0f} tokens trainable)"
    return Allocation(tuple(roles), reason, dispatch)


POLICIES = {
    "colocate": colocate,
    "async": async_split,
    "elastic": elastic,
    "elastic_throughput": elastic_throughput,
    "elastic_memory": elastic_memory,
}
