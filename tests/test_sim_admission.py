"""Resident admission: the pure ledger, its order in the simulator (calls of admitted
executions first, nothing evicted, hand-overs move reservations), and the throughput policy
against every fixed split on a tiny grid."""

import dataclasses

import pytest
from test_sim import PLAIN, all_ids, biggest_need, run_until, small_workload

from gyre.elastic.admission import ResidentAdmission
from gyre.elastic.policy import TRAIN, PolicyParams
from gyre.elastic.sim import Simulator, simulate
from gyre.elastic.workload import Call, Execution

P, C = 1000, 100


def test_ledger_admits_to_most_room_grows_and_waits():
    led = ResidentAdmission(2, 3000.0)
    assert led.admit("a", 1000.0, [0, 1]) == 0  # equal room: lowest index
    assert led.admit("b", 1500.0, [0, 1]) == 1  # most room
    assert led.admit("c", 2500.0, [0, 1]) is None  # 2000 / 1500 free: no room
    assert led.grow("a", 1800.0) and led.free(0) == pytest.approx(1200.0)
    assert led.grow("a", 500.0) and led.free(0) == pytest.approx(1200.0)  # never shrinks
    assert not led.grow("b", 3500.0) and led.free(1) == pytest.approx(1500.0)
    assert led.youngest(0) == "a" and led.keys_on(1) == ["b"]
    led.release("a")  # its peak need (1800) becomes the floor of new reservations
    assert led.floor == pytest.approx(1800.0) and led.reservation(100.0) == 1800.0
    assert led.admit("d", 100.0, [0, 1]) == 0 and led.free(0) == pytest.approx(1200.0)


def test_ledger_caps_admitted_executions_per_cell():
    led = ResidentAdmission(2, 1000.0, slots=1)
    assert led.admit("a", 100.0, [0, 1]) == 0 and led.count(0) == 1
    assert led.admit("b", 100.0, [0]) is None  # cell 0 holds its one execution
    assert led.admit("b", 100.0, [0, 1]) == 1 and not led.has_slot(1)
    assert led.move("b", [0, 1]) == 0 and led.count(0) == 2 and led.count(1) == 0  # unchecked
    led.preempt("a")
    led.release("b")
    assert led.counts == [0, 0]
    assert ResidentAdmission(1, 10.0).has_slot(0)  # slots 0: no cap


def test_ledger_moves_reservations_or_releases_them():
    led = ResidentAdmission(3, 1000.0)
    led.admit("a", 600.0, [0])
    led.admit("b", 700.0, [1])
    assert led.move("a", [0, 1, 2]) == 2 and led.cell_of("a") == 2 and led.free(0) == 1000.0
    led.admit("c", 900.0, [0])
    assert led.move("c", [0, 1, 2]) is None and not led.holds("c")  # nowhere holds 900
    assert led.free(0) == 1000.0 and led.floor == 0.0  # released without a peak
    led.preempt("b")
    assert led.free(1) == 1000.0 and not led.holds("b")


def two_calls(eid, tool, second_prompt=P + C + 100, timeout=1e9):
    return Execution(eid, 0, (Call(P, C, tool, P), Call(second_prompt, C, 0.0, 100)), timeout)


def test_calls_of_admitted_executions_go_before_new_executions():
    # One cell holding 2500 tokens: e0 and e1 are admitted (1100 each); e2's first call (1100)
    # does not fit beside them. e0's second call (1300) grows its reservation and runs, while
    # e2 waits although it queued first; without resident admission e2 goes at once, evicting
    # e0's idle context, which e0 then re-prefills.
    steps = [[two_calls("e0", 5.0), two_calls("e1", 1000.0),
              Execution("e2", 0, (Call(P, C, 0.0, P),), 1e9)]]  # fmt: skip
    cost = dataclasses.replace(PLAIN, kv_capacity_tokens=2500.0, resident_admission=True)
    r = simulate(steps, 1, "colocate", cost)
    assert r.counters["evictions"] == 0 and r.counters["reprefill_tokens"] == 0
    assert r.outcomes["e2"][1] >= r.outcomes["e0"][2] - 1e-9  # admitted once e0 has ended
    fifo = simulate(steps, 1, "colocate", dataclasses.replace(cost, resident_admission=False))
    assert fifo.outcomes["e2"][1] < fifo.outcomes["e0"][2]
    assert fifo.counters["evictions"] >= 1 and fifo.counters["reprefill_tokens"] > 0


def test_a_cell_with_nothing_running_preempts_its_youngest_execution():
    # Both admitted at 1100 each in a 2300 pool; both come back needing 1300: neither fits
    # beside the other, so the younger (e1) is preempted and re-prefills after e0 ends.
    steps = [[two_calls("e0", 10.0), two_calls("e1", 10.0)]]
    cost = dataclasses.replace(PLAIN, kv_capacity_tokens=2300.0, resident_admission=True)
    r = simulate(steps, 1, "colocate", cost)
    assert r.end_counts == {"e0": 1, "e1": 1}
    assert r.counters["evictions"] == 1 and r.counters["reprefill_tokens"] == P + C
    assert r.outcomes["e1"][2] > r.outcomes["e0"][2]


def test_hand_over_moves_reservations_with_the_contexts():
    steps = [[two_calls(f"e{i}", 1000.0) for i in range(4)]]
    cost = dataclasses.replace(PLAIN, handover_migrate=True, switch_r2t_s=1.0,
                               kv_capacity_tokens=4 * 1300.0, resident_admission=True)  # fmt: skip
    sim = Simulator(steps, 2, "colocate", cost)
    run_until(sim, 500.0)  # two idle contexts per cell, in their tool waits
    led = sim.memory.ledger
    assert sorted(led.cell_of(es) for es in sim.open_es) == [0, 0, 1, 1]
    # The policy sees the ledger: per cell, tokens reserved and the room left.
    snap = sim._snapshot()
    assert snap.kv_reserved_tokens == tuple(led.used) and sum(led.used) > 0
    assert snap.kv_free_tokens == tuple(4 * 1300.0 - u for u in led.used)
    plain = Simulator(steps, 2, "colocate", dataclasses.replace(cost, resident_admission=False))
    assert plain._snapshot().kv_reserved_tokens == ()  # no ledger: not tracked
    sim._switch(sim.cells[1], TRAIN)
    assert [led.cell_of(es) for es in sim.open_es] == [0] * 4
    assert len(sim.cells[0].idle) == 4 and sim.counters["migrated_contexts"] == 2
    assert snap.kv_peak_tokens == 0.0  # nothing has ended yet
    r = sim.run()
    assert r.end_counts == {f"e{i}": 1 for i in range(4)}
    # ... and once executions have ended, the mean of their peak reservations (the ledger's)
    assert led.floor > 0 and sim._snapshot().kv_peak_tokens == led.floor
    assert r.counters["reprefill_tokens"] == 0 and r.counters["evictions"] == 0


@pytest.mark.parametrize("policy", ["colocate", "async", "elastic", "elastic_memory"])
@pytest.mark.parametrize("seed", [0, 1])
def test_resident_admission_keeps_the_bound_and_loses_nothing(policy, seed):
    steps = small_workload(seed, steps=2, timeout=3600.0, branching=0.2)
    cost = dataclasses.replace(
        PLAIN, kv_capacity_tokens=2.5 * biggest_need(steps), handover_migrate=bool(seed),
        switch_r2t_s=0.5, switch_t2r_s=0.2, microbatch_tokens=500, resident_admission=True,
    )  # fmt: skip
    sim = Simulator(steps, 3, policy, cost, PolicyParams(max_staleness=1))
    r = sim.run()
    assert r.makespan_s >= r.lower_bound_s * (1 - 1e-9)
    assert r.end_counts == {i: 1 for i in all_ids(steps)}
    by_id = {ex.execution_id: ex for batch in steps for ex in batch}
    for ex_id, (reason, _, _, tokens) in r.outcomes.items():
        assert reason == "success" and tokens == pytest.approx(by_id[ex_id].train_tokens)
    assert all(u == pytest.approx(0.0, abs=1e-6) for u in sim.memory.ledger.used)
    for c in sim.cells:
        assert not c.idle and c.kv_live == pytest.approx(0.0, abs=1e-6)


def equal_work_s(r, steps) -> float:
    full = sum(ex.train_tokens for batch in steps for ex in batch)
    return r.makespan_s * full / r.counters["trained_tokens"]


@pytest.mark.parametrize("train_scale", [1.0, 8.0])
@pytest.mark.parametrize("contexts", [3.0, 12.0])
def test_elastic_is_within_2_percent_of_every_fixed_split_on_a_tiny_grid(train_scale, contexts):
    """A fixed split is a special case of an elastic policy: on a tiny grid (KV pool x
    training cost), elastic's equal-work time is within 2% of every split's or better."""
    steps = small_workload(seed=4, steps=4, timeout=3600.0)
    cost = dataclasses.replace(
        PLAIN, kv_capacity_tokens=contexts * biggest_need(steps), handover_migrate=True,
        train_per_token_s=PLAIN.train_per_token_s * train_scale, switch_r2t_s=0.5,
        switch_t2r_s=0.2, microbatch_tokens=500, resident_admission=True,
    )  # fmt: skip
    e = equal_work_s(simulate(steps, 4, "elastic", cost, PolicyParams(max_staleness=1)), steps)
    best = min(
        equal_work_s(
            simulate(steps, 4, "async", cost, PolicyParams(async_rollout_cells=r, max_staleness=1)),
            steps,
        )
        for r in (1, 2, 3)
    )
    assert e <= best * 1.02


# ---- resident admission with the real engine's pool rule (engine_pool) -----------------------
# The tiny task's shape: prompt 21, 12 new tokens, max_len 256, so a first call's footprint is
# 21 + 12 - 1 = 32 and a pool of 96 holds three; its idle context is 21 + 12 - 1 = 32 too.
POOL = (12, 256)  # engine_pool = (max_new_tokens, max_len)


def engine_cost(pool=96.0, slots=8, **kw):
    kw = {"resident_admission": True, **kw}
    return dataclasses.replace(PLAIN, kv_capacity_tokens=pool, slots=slots, **kw)


def tiny_two_calls(eid, tool, observation):
    """call 1: prompt 21 (footprint 32); call 2: its context (33) + ``observation`` new."""
    p2 = 21 + 12 + observation
    return Execution(eid, 0, (Call(21, 12, tool, 21), Call(p2, 12, 0.0, observation)), 1e9)


def test_engine_pool_admission_replays_the_proxy_by_hand():
    """One cell, pool 96, 2 slots. e0 and e1 are admitted (32 each); e2 (32) would fit the
    pool but the cell holds 2 admitted executions (slots). After their tool waits e0 grows to
    43 + 12 - 1 = 54 (54 + 32 <= 96) and runs; e1's growth to 54 waits (108 > 96) while e0
    runs. When e0's last call is done the cell runs nothing and e1 still cannot grow (e0's
    reservation goes only when its caller ends it): the cell preempts its youngest, e1, as
    the proxy does (its context stays, unpinned). e1 comes back as a new execution needing 54
    of the 42 free and waits for e0's end (the floor becomes e0's peak, 54); placing it keeps
    its own context and evicts e0's ended one (54 + 54 > 96), the one eviction. e2 then
    needs max(32, 54) = 54 of the 42 left: it waits for e1's end, and then fits beside e1's
    idle context (32 + 54 <= 96)."""
    steps = [[tiny_two_calls("e0", 5.0, 10), tiny_two_calls("e1", 5.05, 10),
              Execution("e2", 0, (Call(21, 12, 0.0, 21),), 1e9)]]  # fmt: skip
    r = simulate(steps, 1, "colocate", engine_cost(slots=2), engine_pool=POOL)
    assert r.end_counts == {"e0": 1, "e1": 1, "e2": 1}
    c = r.counters
    assert (c["evictions"], c["pinned_evictions"], c["reprefill_tokens"]) == (1, 0, 0)
    assert c["preemptions"] == 1
    o = r.outcomes
    assert o["e1"][2] > o["e0"][2] and o["e2"][1] >= o["e1"][2] - 1e-9  # e2 once e1 ended
    # Without admission (and the slot cap of admitted executions) the engine's rule places e2
    # at once (3 x 32 = 96).
    fifo = simulate(steps, 1, "colocate", engine_cost(resident_admission=False),
                    engine_pool=POOL)  # fmt: skip
    assert fifo.outcomes["e2"][1] == 0.0


def test_engine_pool_admission_preempts_the_youngest_and_evicts_it_unpinned():
    """Pool 96: e0 and e1 admitted at 32 each; each second call needs 63 + 12 - 1 = 74. At
    t=5 e0 cannot grow (74 + 32 > 96) with nothing running: the cell preempts its youngest,
    e1 (in its tool wait; its context stays, unpinned), and placing e0 evicts it (74 + 32).
    e1 comes back as a new execution needing 74 and waits for e0's end (the floor is then
    74); placing it evicts e0's ended context. e1 re-prefills its lost context: 21 + 12 = 33
    tokens (the simulator's count: the previous call's prompt + completion)."""
    steps = [[tiny_two_calls("e0", 5.0, 30), tiny_two_calls("e1", 6.0, 30)]]
    sim = Simulator(steps, 1, "colocate", engine_cost(), engine_pool=POOL)
    r = sim.run()
    c = r.counters
    assert (c["preemptions"], c["evictions"], c["pinned_evictions"]) == (1, 2, 0)
    assert c["reprefill_tokens"] == 33
    assert r.outcomes["e1"][2] > r.outcomes["e0"][2]
    assert sim.memory.ledger.floor == pytest.approx(74.0)


@pytest.mark.parametrize("migrate", [True, False])
def test_engine_pool_hand_over_moves_reservations_and_loses_idle_contexts(migrate):
    """2 cells of 96, four executions: admitted to the cell with most room in turn (e0, e2 on
    cell 0; e1, e3 on cell 1), idle in their 1000 s tool waits when cell 1 leaves rollout.
    Its idle contexts are lost; with migration e1's reservation (32) moves to cell 0 (32 free)
    and e3's finds no room (dropped); with re-prefill both are dropped."""
    steps = [[tiny_two_calls(f"e{i}", 1000.0, 10) for i in range(4)]]
    cost = engine_cost(handover_migrate=migrate, switch_r2t_s=1.0)
    sim = Simulator(steps, 2, "colocate", cost, engine_pool=POOL)
    run_until(sim, 500.0)
    led = {es.ex.execution_id: es for es in sim.open_es}
    assert [sim.memory.ledger.cell_of(led[f"e{i}"]) for i in range(4)] == [0, 1, 0, 1]
    sim._switch(sim.cells[1], TRAIN)
    held = {e: sim.memory.ledger.cell_of(es) for e, es in led.items()
            if sim.memory.ledger.holds(es)}  # fmt: skip
    assert held == ({"e0": 0, "e1": 0, "e2": 0} if migrate else {"e0": 0, "e2": 0})
    assert sim.counters["dropped_contexts"] == 2 and sim.counters["migrated_contexts"] == 0
    assert set(sim.cells[0].idle) == {led["e0"], led["e2"]}
    r = sim.run()
    assert r.end_counts == {f"e{i}": 1 for i in range(4)}
    assert r.counters["pinned_evictions"] == 0


def test_engine_pool_reservation_expires_after_a_version_without_a_call():
    """New weights clear idle contexts but keep reservations; an execution with no call over a
    whole weight version (and none outstanding) loses its reservation at the next one."""
    steps = [[tiny_two_calls("e0", 1000.0, 10)]]
    sim = Simulator(steps, 1, "colocate", engine_cost(), engine_pool=POOL)
    run_until(sim, 500.0)  # in its tool wait, its call made in this version
    (es,) = sim.open_es
    sim.memory.new_weights()
    assert sim.memory.ledger.holds(es) and not sim.cells[0].idle
    sim.memory.new_weights()  # a whole version without a call
    assert not sim.memory.ledger.holds(es) and sim.counters["expired"] == 1
    assert sim.run().end_counts == {"e0": 1}


@pytest.mark.parametrize("policy", ["colocate", "elastic"])
@pytest.mark.parametrize("seed,contexts", [(0, 1.5), (1, 1.5), (2, 1.5)])
def test_engine_pool_admission_never_evicts_an_admitted_context(policy, seed, contexts):
    """While the reservations fit the pool (the ledger's capacity is the pool), no context of
    an execution admitted to that cell is evicted, and nothing is lost."""
    steps = small_workload(seed, steps=2, timeout=3600.0, branching=0.2)
    max_new = max(c.completion_tokens for b in steps for ex in b for c in ex.calls)
    biggest = max(c.prompt_tokens + max_new - 1 for b in steps for ex in b for c in ex.calls)
    cost = engine_cost(
        pool=contexts * biggest, slots=4, handover_migrate=bool(seed % 2),
        switch_r2t_s=0.5, switch_t2r_s=0.2, microbatch_tokens=500,
    )  # fmt: skip
    sim = Simulator(steps, 3, policy, cost, PolicyParams(max_staleness=1),
                    engine_pool=(max_new, 10**6))  # fmt: skip
    r = sim.run()
    assert r.counters["pinned_evictions"] == 0 and r.counters["evictions"] > 0
    assert r.end_counts == {i: 1 for i in all_ids(steps)}
    assert all(u == pytest.approx(0.0, abs=1e-6) for u in sim.memory.ledger.used)
    assert all(n == 0 for n in sim.memory.ledger.counts)
