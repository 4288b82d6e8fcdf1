"""Allocation policies: the throughput rule, the memory waterlevel (ablation), the async split
and staleness bound, purity; and the throughput rule against fixed splits in the simulator."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.elastic.policy import (
    POLICIES,
    ROLLOUT,
    TRAIN,
    LoadSnapshot,
    PolicyParams,
    async_split,
    base_holds_batch,
    base_train_cells,
    colocate,
    elastic,
    elastic_memory,
    elastic_throughput,
)

R, T = ROLLOUT, TRAIN


def snap(
    roles,
    outstanding=0,
    queue=0.0,
    trainable=0.0,
    rolled_out=False,
    rate=0.0,
    running=None,
    live=None,
    cap=4.0,
    tp=100.0,
    step=1,
    version=1,
    total=10,
    next_batch=8,
    r2t=8.5,
    t2r=3.5,
    reserved=(),
    free=(),
    timed_out=0,
    peak=0.0,
):
    k = len(roles)
    return LoadSnapshot(
        roles=tuple(roles),
        dispatched=20 + outstanding,
        started=20 + (outstanding if running is None else running),
        finished=20,
        live_requests=tuple(live or [0] * k),
        train_queue_tokens=queue,
        rollout_capacity=(cap,) * k,
        train_throughput=(tp,) * k,
        switch_r2t_s=r2t,
        switch_t2r_s=t2r,
        step=step,
        weight_version=version,
        total_steps=total,
        next_batch=next_batch,
        trainable_tokens=trainable,
        rolled_out=rolled_out,
        rollout_tokens_per_s=rate,
        kv_reserved_tokens=tuple(reserved),
        kv_free_tokens=tuple(free),
        timed_out=timed_out,
        kv_peak_tokens=peak,
    )


BIG_QUEUE = 1e6  # 1e6 tokens / 100 tok/s per cell: far more than any switch cost


def test_core_cell_leaves_first_then_fewest_live_requests():
    # demand 2, capacity 4/cell, one cell of slack: 2 rollout cells must stay.
    s = snap([R, R, R, R], outstanding=2, queue=BIG_QUEUE, live=[3, 2, 0, 1], step=2, version=1)
    a = elastic_memory(s, PolicyParams(max_staleness=0))
    assert a.roles == (T, R, T, R)
    assert not a.dispatch


def test_slack_of_one_cell():
    p = PolicyParams(max_staleness=0)
    # 8 outstanding need 2 cells of capacity + 1 of slack: only the core may leave.
    a = elastic_memory(snap([R] * 4, outstanding=8, queue=BIG_QUEUE, step=2), p)
    assert a.roles == (T, R, R, R)
    # 9 outstanding need 3 cells + slack = all 4: nobody leaves.
    a = elastic_memory(snap([R] * 4, outstanding=9, queue=BIG_QUEUE, step=2), p)
    assert a.roles == (R,) * 4
    # Two cells of slack keep one more cell in rollout.
    a = elastic_memory(
        snap([R] * 4, outstanding=4, queue=BIG_QUEUE, step=2), dataclasses.replace(p, slack_cells=2)
    )
    assert a.roles == (T, R, R, R)


def test_switch_only_when_reclaimed_area_exceeds_round_trip_cost():
    p = PolicyParams(max_staleness=0)
    cost = 8.5 + 3.5  # seconds; one cell trains 100 tok/s, so the break-even queue is 1200
    # One execution outstanding: capacity allows two cells to leave.
    a = elastic_memory(snap([R] * 4, outstanding=1, queue=1199.0, step=2), p)
    assert a.roles == (R,) * 4
    a = elastic_memory(snap([R] * 4, outstanding=1, queue=1201.0, step=2), p)
    assert a.roles == (T, R, R, R)  # a second cell would reclaim only 1201/200 s < 12 s
    a = elastic_memory(snap([R] * 4, outstanding=1, queue=100 * cost * 2 + 1, step=2), p)
    assert a.roles == (T, T, R, R)
    # No demand left: the queue must be trained whatever the cost, so the core goes.
    a = elastic_memory(snap([R] * 4, outstanding=0, queue=10.0, step=2), p)
    assert a.roles == (T, R, R, R)


def test_cells_return_when_queue_drains_core_last():
    p = PolicyParams(max_staleness=0)
    roles = [T, T, T, R]
    # Queue not drained: the train cells stay even though demand is high.
    assert elastic_memory(snap(roles, outstanding=6, queue=50.0, step=2), p).roles == tuple(roles)
    # Drained: demand 6 needs 2 cells + slack -> two of the train cells return, core last.
    a = elastic_memory(snap(roles, outstanding=6, queue=0.0, step=2), p)
    assert a.roles == (T, R, R, R)
    a = elastic_memory(snap(roles, outstanding=9, queue=0.0, step=2), p)
    assert a.roles == (R, R, R, R)
    # Drained and no demand: nobody moves (returning reclaims nothing).
    assert elastic_memory(snap(roles, outstanding=0, queue=0.0, step=2), p).roles == tuple(roles)


def test_next_batch_counts_as_demand_when_it_may_be_dispatched():
    a = elastic_memory(
        snap([T, T, T, T], outstanding=0, queue=0.0, step=1, version=1, next_batch=8)
    )
    assert a.dispatch and a.roles == (T, R, R, R)  # 8 + 4 of slack needs 3 cells
    # Staleness 0 forbids the dispatch while step 2 waits on version 1: no demand, no return.
    a = elastic_memory(snap([T] * 4, step=2, version=1), PolicyParams(max_staleness=0))
    assert not a.dispatch and a.roles == (T,) * 4


def test_demand_never_left_without_a_rollout_cell():
    # Queue not drained (no return by the rule), yet demand exists: one cell is brought back.
    a = elastic_memory(snap([T] * 4, outstanding=3, queue=BIG_QUEUE, step=2))
    assert a.roles.count(R) >= 1 and a.roles[0] == T


# ---- the throughput rule (elastic_throughput, elastic's rule until the rate is measured) -----------------------------------------------------------
RT = 8.5 + 3.5  # a round trip; one cell trains 100 tok/s


def test_cells_leave_only_for_trainable_work_covering_the_round_trips():
    p = PolicyParams(max_staleness=0, leave_round_trips=3.0)
    busy = [5, 5, 5, 5]  # every rollout cell decodes
    # 3 round trips of one cell's training: 3600 tokens. Just under: nobody leaves.
    a = elastic_throughput(
        snap([R] * 4, outstanding=4, trainable=3 * RT * 100 - 1, live=busy, cap=8), p
    )
    assert a.roles == (R,) * 4
    a = elastic_throughput(
        snap([R] * 4, outstanding=4, trainable=3 * RT * 100 + 1, live=busy, cap=8), p
    )
    assert a.roles == (T, R, R, R)  # the core first; a second would get half of it
    a = elastic_throughput(
        snap([R] * 4, outstanding=4, trainable=2 * 3 * RT * 100 + 1, live=busy, cap=8), p
    )
    assert a.roles == (T, T, R, R)
    # Queued tokens that are not trainable yet (a partial micro-batch) move nobody.
    a = elastic_throughput(
        snap([R] * 4, outstanding=4, queue=BIG_QUEUE, trainable=0.0, live=busy, cap=8), p
    )
    assert a.roles == (R,) * 4


def test_work_that_gates_the_optimizer_step_needs_one_round_trip():
    p = PolicyParams(max_staleness=0, leave_round_trips=3.0)
    a = elastic_throughput(snap([R] * 4, outstanding=4, trainable=2 * RT * 100 + 1, rolled_out=True,
                     live=[5] * 4, cap=8), p)  # fmt: skip
    assert a.roles == (T, T, R, R)  # two cells, each with exactly one round trip: not a third
    # The oldest step has rolled out: its tokens gate the optimizer step, however few.
    a = elastic_throughput(snap([R] * 4, outstanding=4, trainable=10.0, rolled_out=True, live=[5] * 4,
                     cap=8), p)  # fmt: skip
    assert a.roles == (T, R, R, R)


def test_an_update_that_gates_everything_takes_every_cell():
    """Staleness 0 with carry-over: the oldest step has rolled out, the next batch waits for
    its update, and 10 carried executions still run. The update gates all progress, so
    every cell trains (memory does not bind and no rollout cell is kept for the carried
    executions, which wait as colocate's do); before the step has rolled out, or while a
    batch may be dispatched, memory binds as usual."""
    p = PolicyParams(max_staleness=0)
    carried = dict(outstanding=10, trainable=BIG_QUEUE, live=[3] * 4, cap=4)
    a = elastic_throughput(snap([R] * 4, rolled_out=True, step=2, version=1, **carried), p)
    assert a.roles == (T,) * 4 and not a.dispatch
    a = elastic_throughput(snap([R] * 4, rolled_out=False, step=2, version=1, **carried), p)
    assert a.roles.count(R) == 4  # 10 running need 3 cells, plus one of slack
    a = elastic_throughput(snap([R] * 4, rolled_out=True, step=1, version=1, **carried), p)
    # A batch may go out: memory binds, and only the one cell that always takes gating work
    # leaves.
    assert a.dispatch and a.roles.count(R) == 3
    a = elastic_throughput(snap([T] * 4, rolled_out=True, step=2, version=1, outstanding=10,
                                trainable=0.0, live=[0] * 4, cap=4), p)  # fmt: skip
    assert R in a.roles  # nothing left to train: the carried executions get their cells back


def test_memory_binds_the_cells_that_may_leave():
    p = PolicyParams(max_staleness=0)
    # 10 running executions, 4 per cell, one cell of slack: 3 + 1 cells must stay.
    a = elastic_throughput(
        snap([R] * 4, outstanding=10, trainable=BIG_QUEUE, live=[3] * 4, cap=4), p
    )
    assert a.roles == (R,) * 4
    # Only 6 of them admitted (running): two cells of capacity + slack stay, the core leaves.
    a = elastic_throughput(snap([R] * 4, outstanding=10, running=6, trainable=BIG_QUEUE, live=[3] * 4,
                     cap=4), p)  # fmt: skip
    assert a.roles == (T, R, R, R)


def test_train_cells_return_when_nothing_is_trainable():
    p = PolicyParams(max_staleness=0)
    roles = [T, T, T, R]
    # Something left to take: the train cells stay, whatever the demand.
    a = elastic_throughput(
        snap(roles, outstanding=9, queue=5e3, trainable=50.0, live=[0, 0, 0, 9]), p
    )
    assert a.roles == tuple(roles)
    # Nothing trainable (a partial micro-batch queued) and demand: every train cell returns.
    a = elastic_throughput(
        snap(roles, outstanding=1, queue=5e3, trainable=0.0, live=[0, 0, 0, 1]), p
    )
    assert a.roles == (R,) * 4
    # No demand: nobody returns (the optimizer step or the staleness bound holds dispatch).
    a = elastic_throughput(snap(roles, outstanding=0, queue=0.0, step=2, version=1), p)
    assert a.roles == tuple(roles) and not a.dispatch
    # No demand, queued tokens and no train cell: the core trains them whatever the cost.
    a = elastic_throughput(snap([R] * 4, outstanding=0, queue=10.0, trainable=10.0, step=2), p)
    assert a.roles[0] == T


# ---- the measured base split with lending (elastic) ------------------------------------------


def test_base_split_sizes_training_by_the_measured_rates():
    # One cell trains 100 tok/s; rollout hands over 250 tok/s: 2.5 cells -> 3.
    assert base_train_cells(snap([R] * 8, rate=250.0)) == 3
    assert base_train_cells(snap([R] * 8, rate=0.0)) == 0  # unmeasured: no base yet
    assert base_train_cells(snap([R] * 8, rate=1.0)) == 1  # at least one trains
    assert base_train_cells(snap([R] * 8, rate=1e5)) == 7  # at least one rolls out
    # Within the band the current base (the leading train cells) stays: no flapping.
    assert base_train_cells(snap([T, T, R, R, R, R, R, R], rate=250.0)) == 2
    assert base_train_cells(snap([T, T, T, T, R, R, R, R], rate=250.0)) == 3  # 4 > 2.5 x 1.2 + 1
    assert base_train_cells(snap([T, R, R, R, R, R, R, R], rate=250.0)) == 2  # 1 < 2.5 x 0.8


def test_base_split_moves_one_cell_per_decision():
    """Outside the band the base steps one cell towards ceil(x), never jumps (from no base it
    goes straight there): the rate measured under one split answers it, and a jump swings."""
    lead = lambda n: [T] * n + [R] * (8 - n)  # noqa: E731
    assert base_train_cells(snap(lead(1), rate=650.0)) == 2  # ceil(6.5) = 7, one step
    assert base_train_cells(snap(lead(7), rate=150.0)) == 6  # ceil(1.5) = 2, one step down
    assert base_train_cells(snap(lead(0), rate=650.0)) == 7  # no base yet: straight to it
    # Followed decision by decision under a fixed measured rate (x = 5.5), the base walks
    # one cell at a time into the band (4.4 <= n < 7.6) and stays there.
    roles, seen = lead(1), []
    for _ in range(8):
        roles = lead(base_train_cells(snap(roles, rate=550.0)))
        seen.append(roles.count(T))
    assert seen == [2, 3, 4, 5, 5, 5, 5, 5]


def test_elastic_holds_the_measured_split_and_uses_the_throughput_rule_before():
    p = PolicyParams(max_staleness=1, close_share=1.0)
    a = elastic(snap([R] * 4, outstanding=8, rate=150.0, live=[2] * 4), p)
    assert a.roles == (T, T, R, R)
    # Unmeasured: the throughput rule decides (here: every cell decodes).
    b = elastic_throughput(snap([R] * 4, outstanding=8, live=[2] * 4), p)
    assert elastic(snap([R] * 4, outstanding=8, live=[2] * 4), p) == b


def test_on_policy_runs_keep_the_throughput_rule_whatever_is_measured():
    """With max_staleness 0 a step trains only after its rollout: a standing split would idle
    its train cells through every rollout, so elastic time-shares every cell instead."""
    p = PolicyParams(max_staleness=0)
    for s in (snap([R] * 4, outstanding=8, rate=150.0, live=[2] * 4),
              snap([T] * 4, outstanding=0, trainable=BIG_QUEUE, rate=150.0, rolled_out=True)):  # fmt: skip
        assert elastic(s, p) == elastic_throughput(s, p)
    assert elastic(snap([R] * 4, outstanding=8, rate=150.0, live=[2] * 4), p).roles == (R,) * 4


def test_with_carry_over_elastic_pauses_only_while_executions_rarely_time_out():
    """Carry-over: while few ended executions timed out, elastic is the throughput rule (an
    update that gates the run takes every cell, pausing the next step's executions); once
    PAUSE_TIMEOUT_SHARE of them time out, pausing would cut more short and the measured base
    stays. Without carry-over the base stays whatever the timeouts."""
    carry, off = (
        PolicyParams(max_staleness=1, close_share=0.9),
        PolicyParams(max_staleness=1, close_share=1.0),
    )
    gated = dict(outstanding=8, trainable=BIG_QUEUE, rate=150.0, rolled_out=True, step=3,
                 version=1, live=[2] * 4)  # fmt: skip
    few = snap([R] * 4, timed_out=2, **gated)  # 2 of 20 ended executions timed out
    many = snap([R] * 4, timed_out=10, **gated)  # 10 of 20
    assert few.timeout_share == pytest.approx(0.1) and many.timeout_share == pytest.approx(0.5)
    assert elastic(few, carry) == elastic_throughput(few, carry)
    assert elastic(few, carry).roles == (T,) * 4  # the update gates the run: every cell
    assert elastic(many, carry) == elastic(many, off) == elastic(few, off)
    assert elastic(many, carry).roles.count(R) >= 1  # the base keeps its rollout cells


def test_with_carry_over_elastic_keeps_its_base_where_it_holds_a_batch_resident():
    """Carry-over, few timeouts: where the measured split's rollout cells hold a whole batch
    resident (their pools / the ended executions' mean peak reservation >= next_batch), the
    base stays (rolling out on every cell adds no room, pausing only costs); where they do
    not, the throughput rule takes every cell for the update that gates the run."""
    carry, off = (
        PolicyParams(max_staleness=1, close_share=0.9),
        PolicyParams(max_staleness=1, close_share=1.0),
    )
    # rate 150 / tp 100: the base trains on ceil(1.5) = 2 cells, cells 2 and 3 roll out, with
    # 500 + 500 tokens of pool each: 2000 tokens for a batch of 8.
    gated = dict(outstanding=8, trainable=BIG_QUEUE, rate=150.0, rolled_out=True, step=3,
                 version=1, live=[2] * 4, timed_out=2, next_batch=8,
                 reserved=[500.0] * 4, free=[500.0] * 4)  # fmt: skip
    holds, exact, short = (snap([R] * 4, peak=x, **gated) for x in (200.0, 250.0, 300.0))
    assert base_holds_batch(holds) and base_holds_batch(exact)  # 10 and exactly 8 contexts
    assert not base_holds_batch(short)  # 6.7 < 8
    for s in (holds, exact):
        assert elastic(s, carry) == elastic(s, off)
        assert elastic(s, carry).roles == (T, T, R, R)  # the measured split
    assert elastic(short, carry) == elastic_throughput(short, carry)
    assert elastic(short, carry).roles == (T,) * 4
    # Unmeasured: no execution ended (peak 0), no pools tracked, no batch left, one cell.
    assert not base_holds_batch(snap([R] * 4, peak=0.0, **gated))
    untracked = {**gated, "reserved": (), "free": ()}
    assert not base_holds_batch(snap([R] * 4, peak=200.0, **untracked))
    assert not base_holds_batch(snap([R] * 4, peak=200.0, **{**gated, "next_batch": 0}))
    one = {**gated, "live": [2], "reserved": [1e9], "free": [1e9]}
    assert not base_holds_batch(snap([R], peak=200.0, **one))


def test_only_idle_rollout_cells_are_lent_and_only_when_nothing_waits():
    p = PolicyParams(max_staleness=1, leave_round_trips=3.0, close_share=1.0)
    live = [0, 3, 0, 0]  # cell 1 is the base's first rollout cell; 2 and 3 are idle
    work = 3 * RT * 300 + 1  # more than 3 round trips for three train cells
    # Nothing waits for admission, no batch may be dispatched (staleness): both idle cells go.
    base = dict(outstanding=4, trainable=work, rate=50.0, live=live, step=3, version=1)
    assert elastic(snap([R] * 4, **base), p).roles == (T, R, T, T)
    # Executions waiting for admission: nobody is lent.
    assert elastic(snap([R] * 4, running=2, **base), p).roles == (T, R, R, R)
    # A batch may be dispatched: nobody is lent.
    assert elastic(snap([R] * 4, **{**base, "step": 2}), p).roles == (T, R, R, R)
    # Not enough work to repay the round trips: nobody is lent.
    assert elastic(snap([R] * 4, **{**base, "trainable": 100.0}), p).roles == (T, R, R, R)
    # A cell with live requests is never lent, and neither is the base's first rollout cell.
    busy = {**base, "live": [0, 0, 5, 0]}
    assert elastic(snap([R] * 4, **busy), p).roles == (T, R, R, T)


def test_a_cell_is_lent_only_if_the_cells_that_stay_hold_its_kv_reservations():
    """Resident admission: lending a cell hands its reserved contexts to the rollout cells that
    stay; where they lack the room, the contexts would be evicted (prefilled again) or their
    executions preempted, so the cell is not lent."""
    p = PolicyParams(max_staleness=1, leave_round_trips=3.0, close_share=1.0)
    work = 3 * RT * 300 + 1
    base = dict(outstanding=4, trainable=work, rate=50.0, step=3, version=1)
    # Cells 2 and 3 are idle and hold 500 reserved tokens each; cell 1 stays (the base's
    # first rollout cell). Room for both in cell 1: both lent.
    roomy = dict(reserved=[0, 400, 500, 500], free=[0, 1000, 100, 100])
    assert elastic(snap([R] * 4, **base, **roomy), p).roles == (T, R, T, T)
    # Room for one: cell 2 goes (its 500 fit in cells 1 and 3: 550 free); cell 3's 500 would
    # then have only cell 1's 450, so it stays.
    tight = dict(reserved=[0, 400, 500, 500], free=[0, 450, 100, 100])
    assert elastic(snap([R] * 4, **base, **tight), p).roles == (T, R, T, R)
    # No room at all: nobody is lent; untracked (empty) reservations: the rule is off.
    full = dict(reserved=[0, 400, 500, 500], free=[0, 0, 0, 0])
    assert elastic(snap([R] * 4, **base, **full), p).roles == (T, R, R, R)
    assert elastic(snap([R] * 4, **base), p).roles == (T, R, T, T)
    # A cell already lent (training, no reservations left) stays lent.
    assert elastic(snap([T, R, T, R], **base, **full), p).roles == (T, R, T, R)


def test_policy_params_bounds():
    with pytest.raises(ValueError, match="leave_round_trips"):
        PolicyParams(leave_round_trips=-1.0)
    with pytest.raises(ValueError, match="trainable_tokens"):
        LoadSnapshot((R,), 1, 1, 0, (0,), 0.0, (1.0,), (1.0,), 1.0, 1.0, trainable_tokens=-1.0)


@pytest.mark.parametrize("split", [1, 2, 3])
def test_async_keeps_a_fixed_split_with_core_training(split):
    p = PolicyParams(async_rollout_cells=split, max_staleness=1)
    shapes = [
        snap([R] * 4, outstanding=10, queue=0.0),
        snap([T, R, T, R], outstanding=0, queue=BIG_QUEUE),
        snap([T] * 4, outstanding=1, queue=5.0, step=7, version=3),
    ]
    allocs = {async_split(s, p).roles for s in shapes}
    assert allocs == {(T,) * (4 - split) + (R,) * split}


def test_async_bounds_staleness():
    for k in (0, 1, 2):
        p = PolicyParams(async_rollout_cells=2, max_staleness=k)
        for step in range(4, 9):
            a = async_split(snap([R] * 4, step=step, version=4), p)
            assert a.dispatch == (step - 4 <= k)
    # No step left to dispatch.
    assert not async_split(snap([R] * 4, step=10, version=9, total=10)).dispatch


def test_async_rejects_impossible_split():
    with pytest.raises(ValueError, match="async_rollout_cells"):
        async_split(snap([R] * 4), PolicyParams(async_rollout_cells=4))


def test_colocate_phases():
    assert colocate(snap([T] * 4, outstanding=3)).roles == (R,) * 4
    a = colocate(snap([R] * 4, outstanding=0, queue=10.0, step=2, version=1))
    assert a.roles == (T,) * 4 and not a.dispatch
    a = colocate(snap([T] * 4, outstanding=0, queue=0.0, step=2, version=2))
    assert a.dispatch and a.roles == (R,) * 4
    # Staleness 0: waiting for the optimizer step, nothing changes.
    a = colocate(snap([T] * 4, outstanding=0, queue=0.0, step=2, version=1))
    assert not a.dispatch and a.roles == (T,) * 4


def test_snapshot_validation():
    with pytest.raises(ValueError, match="live_requests"):
        LoadSnapshot((R, R), 1, 1, 0, (0,), 0.0, (1.0, 1.0), (1.0, 1.0), 1.0, 1.0)
    with pytest.raises(ValueError, match="finished"):
        LoadSnapshot((R,), 1, 1, 2, (0,), 0.0, (1.0,), (1.0,), 1.0, 1.0)
    with pytest.raises(ValueError, match="kv_reserved_tokens has 1 entries"):
        snap([R, R], reserved=[1.0], free=[1.0])
    with pytest.raises(ValueError, match="kv_free_tokens must be >= 0"):
        snap([R, R], reserved=[1.0, 1.0], free=[1.0, -1.0])
    with pytest.raises(ValueError, match="timed_out must be in"):
        snap([R, R], timed_out=21)  # 20 finished
    with pytest.raises(ValueError, match="timed_out must be in"):
        snap([R, R], timed_out=-1)
    with pytest.raises(ValueError, match="kv_peak_tokens must be >= 0"):
        snap([R, R], peak=-1.0)
    with pytest.raises(ValueError, match="given together"):
        snap([R, R], reserved=[1.0, 1.0])


snapshots = st.builds(
    lambda roles, out, q, live, cap, tp, step, lag, share, rolled, rate: snap(
        roles,
        outstanding=out,
        queue=q,
        trainable=q * share,
        rolled_out=rolled,
        rate=rate,
        live=live[: len(roles)] + [0] * (len(roles) - len(live)),
        cap=cap,
        tp=tp,
        step=step,
        version=max(step - lag, 0),
    ),
    st.lists(st.sampled_from([R, T]), min_size=2, max_size=8),
    st.integers(0, 40),
    st.sampled_from([0.0, 10.0, 1e3, 1e5, 1e7]),
    st.lists(st.integers(0, 8), max_size=8),
    st.sampled_from([1.0, 4.0, 16.0]),
    st.sampled_from([10.0, 1e3]),
    st.integers(0, 10),
    st.integers(0, 3),
    st.sampled_from([0.0, 0.5, 1.0]),
    st.booleans(),
    st.sampled_from([0.0, 50.0, 1e4]),
)


@settings(max_examples=50, deadline=None)
@given(snapshots, st.sampled_from(sorted(POLICIES)))
def test_policies_are_pure_and_well_formed(s, name):
    p = PolicyParams(async_rollout_cells=1)
    a, b = POLICIES[name](s, p), POLICIES[name](s, p)
    assert a == b
    assert len(a.roles) == s.num_cells and set(a.roles) <= {R, T}
    demand = s.outstanding + (s.next_batch if a.dispatch else 0)
    # Rollout work always has a cell, except while a step that may close trains and carried
    # executions wait (they roll out again once the step's update lands): colocate's, and
    # the throughput rule's when nothing may be dispatched before that update.
    gated = s.rolled_out and not a.dispatch
    carried_wait = gated and (
        (name == "colocate" and s.train_queue_tokens > 0)
        or (name in ("elastic", "elastic_throughput") and s.trainable_tokens > 0)
    )
    assert demand == 0 or R in a.roles or carried_wait
    assert s.train_queue_tokens == 0 or demand > 0 or T in a.roles  # so does train work
