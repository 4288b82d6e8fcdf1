"""Resident admission in the proxy (``rollout.admission = "resident"``): the order it admits
calls in, contexts that stay resident, growth, preemption, hand-over, expiry, and the callers
that end executions (gyre/rl/rollouts.py, gyre/rl/evaluation.py).

The rule is gyre/elastic/admission.py's ledger (tests/test_sim_admission.py tests it alone and
in the simulator); these tests drive it through real engines of the tiny model.
"""

import asyncio
import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from rollout_world import CELLS, SPEC, STATE  # the tiny model test_engine uses too

from gyre.agent.context import AgentSettings
from gyre.agent.harness import run_executions
from gyre.agent.scripted import LedgerExpert
from gyre.config import default_config, validate
from gyre.envs.ledger import LedgerEnv
from gyre.errors import ConfigError
from gyre.rl import evaluation
from gyre.rollout.engine import Engine
from gyre.rollout.programs import ADMISSIONS
from gyre.rollout.proxy import Proxy
from gyre.rollout.types import GenerateRequest

# one xdist worker runs the module: its fixture compiles both cells' programs once, not twice
pytestmark = pytest.mark.xdist_group("admission")


@pytest.fixture(scope="module", autouse=True)
def compiled():
    """Compiles cells 0 and 1's programs once for the module (engines share them)."""
    for cell in (0, 1):
        Engine(SPEC, CELLS[cell], STATE).warmup()


def new_proxy(ncells, kv_tokens, admission="resident"):
    spec = dataclasses.replace(SPEC, kv_tokens=kv_tokens)  # same programs: kv is accounting
    proxy = Proxy([Engine(spec, CELLS[c], STATE) for c in range(ncells)], admission)
    proxy.order = []  # execution ids in the order their calls were submitted to an engine
    submit = proxy._submit

    def logged(call, target):
        proxy.order.append(call.request.execution_id)
        submit(call, target)

    proxy._submit = logged
    proxy.pinned_evictions = 0  # contexts of admitted executions evicted (must stay 0)
    for e in proxy.engines.values():
        evict = e._evict

        def counted(slot, keep=0, i=e.cell.index, evict=evict):
            if proxy.ledger is not None and slot.owner is not None:
                proxy.pinned_evictions += proxy._pinned(i, slot.owner)
            evict(slot, keep)

        e._evict = counted
    return proxy


def tokens(seed, n):
    return np.random.default_rng(seed).integers(0, 64, n).astype(np.int32)


def request(name, call, prompt, new):
    return GenerateRequest(name, call, np.asarray(prompt, np.int32), new, (), 1.0)


async def agent(proxy, i, turns=3, new=8, tool_ticks=None, plen=None):
    """A multi-turn execution: call, a 'tool' (event-loop ticks), append, call again; ends."""
    prompt, outs = tokens(1000 + i, 6 + 2 * i if plen is None else plen), []
    try:
        for t in range(turns):
            out = await proxy.generate(request(f"agent{i}", t, prompt, new))
            outs.append(out.tokens)
            for _ in range(3 + 2 * i if tool_ticks is None else tool_ticks):
                await asyncio.sleep(0)
            prompt = np.concatenate([prompt, out.tokens, tokens(2000 + 10 * i + t, 3)])
    finally:
        proxy.end_execution(f"agent{i}")
    return outs


async def drive(proxy, coros, max_pumps=3000):
    """Runs the coroutines (or tasks) while pumping the proxy -> their results."""
    tasks = [c if isinstance(c, asyncio.Task) else asyncio.create_task(c) for c in coros]
    for _ in range(max_pumps):
        await asyncio.sleep(0)
        if all(t.done() for t in tasks):
            return [t.result() for t in tasks]
        proxy.pump()
    raise AssertionError(f"still running after {max_pumps} pumps")


def check_pools(proxy):
    """The ledger never reserves past a cell's pool, nor the engine charges past its budget."""
    led = proxy.ledger
    for i, e in proxy.engines.items():
        assert e.pool()["reserved_tokens"] <= e.budget
        if led is not None:
            assert led.used[i] <= led.capacity + led.tol


def test_the_setting_is_checked_in_the_config_and_the_spec():
    assert default_config().rollout.admission == SPEC.admission == "none"
    for choice in ADMISSIONS:
        cfg = default_config()
        cfg.rollout.admission = choice
        validate(cfg)
    cfg = default_config()
    cfg.rollout.admission = "oracle"
    with pytest.raises(ConfigError, match="rollout.admission"):
        validate(cfg)
    with pytest.raises(ValueError, match="rollout.admission"):
        dataclasses.replace(SPEC, admission="oracle")
    with pytest.raises(ValueError, match="admission must be one of"):
        Proxy([Engine(SPEC, CELLS[0], STATE)], "oracle")


def run_agents(mode, kv_tokens, plens, first_alone=False):
    """Multi-turn agents on one cell -> (proxy, their completions); with ``first_alone`` the
    first runs to its end before the others start (its peak is then the ledger's floor)."""
    proxy = new_proxy(1, kv_tokens, mode)

    async def main():
        agents = [agent(proxy, i, plen=p) for i, p in enumerate(plens)]
        head = await drive(proxy, agents[:1]) if first_alone else []
        return head + await drive(proxy, agents[len(head) :])

    outs = asyncio.run(main())
    check_pools(proxy)
    return proxy, outs


def same_tokens(a, b):
    for x, y in zip(a, b, strict=True):
        for u, v in zip(x, y, strict=True):
            np.testing.assert_array_equal(u, v)


def test_cold_start_preempts_but_never_evicts_an_admitted_context():
    """Five agents at once, before any has ended (floor 0): each reserves only its first call,
    so they cannot all grow and the youngest are preempted; no admitted execution's context is
    ever evicted, and every call samples the same tokens (keyed by execution, call, position)."""
    plens = [6 + 2 * i for i in range(5)]
    none, want = run_agents("none", 64, plens)
    resident, got = run_agents("resident", 64, plens)
    assert none.kv_stats()["kv_reprefilled_tokens"] > 0
    assert resident.stats["preemptions"] > 0 and resident.pinned_evictions == 0
    assert resident.stats["admissions"] == none.stats["admissions"] == 15
    same_tokens(want, got)
    end = resident.admission_stats()
    assert end["admitted_executions"] == 0 and end["reserved_tokens"] == 0


def test_with_a_measured_floor_contexts_stay_resident():
    """Once an execution has ended, new ones reserve its peak (the ledger's floor): here two fit
    the pool at once and never wait to grow, so none is preempted or prefilled again, while
    without admission the same agents evict each other's contexts."""
    plens = [8] * 6  # footprints 15, 26, 37: floor 37 after the first, two per 80 tokens
    none, want = run_agents("none", 80, plens, first_alone=True)
    resident, got = run_agents("resident", 80, plens, first_alone=True)
    assert none.kv_stats()["kv_reprefilled_tokens"] > 0
    stats = resident.kv_stats()
    assert stats["kv_reprefilled_tokens"] == 0 and resident.pinned_evictions == 0
    assert stats["kv_evictions"] > 0  # only the contexts of ended executions
    assert resident.stats["preemptions"] == 0 and resident.ledger.floor == 37
    same_tokens(want, got)


def test_a_cell_admits_no_more_executions_than_it_has_slots():
    """Six short agents on one cell of 4 slots whose pool would hold them all: only 4 are
    admitted at once (each context needs a slot of its own to stay resident)."""
    proxy = new_proxy(1, 256)
    peak = []

    async def watch():
        while True:
            peak.append(proxy.admission_stats()["admitted_executions"])
            await asyncio.sleep(0)

    async def main():
        watcher = asyncio.create_task(watch())
        out = await drive(proxy, [agent(proxy, i, turns=2, new=4, plen=4) for i in range(6)])
        watcher.cancel()
        return out

    asyncio.run(main())
    assert max(peak) == proxy.engines[0].num_slots == 4
    assert proxy.pinned_evictions == 0 and proxy.kv_stats()["kv_reprefilled_tokens"] == 0


def test_calls_of_admitted_executions_go_before_new_executions():
    """A's second call arrives after B's first, which waits for room: with admission A's call
    goes first (A holds the room); without, B takes the room A's context held."""

    async def script(proxy):
        a0 = request("A", 0, tokens(1, 19), 2)  # footprint 20
        out = await drive(proxy, [proxy.generate(a0)])
        b = asyncio.create_task(proxy.generate(request("B", 0, tokens(2, 20), 6)))  # 25
        await asyncio.sleep(0)
        proxy.pump()
        a1 = np.concatenate([a0.prompt, out[0].tokens, tokens(3, 3)])  # 24 tokens: footprint 29
        await drive(proxy, [proxy.generate(request("A", 1, a1, 6))])
        proxy.end_execution("A")
        await drive(proxy, [b])
        proxy.end_execution("B")

    orders = {}
    for mode in ("none", "resident"):
        proxy = new_proxy(1, 40, mode)
        asyncio.run(script(proxy))
        check_pools(proxy)
        orders[mode] = proxy.order
    assert orders["resident"] == ["A", "A", "B"]
    assert orders["none"] == ["A", "B", "A"]


def test_a_waiting_growth_blocks_new_executions_then_preempts_the_youngest():
    async def script(proxy):
        led = proxy.ledger
        first = {n: request(n, 0, tokens(ord(n), 12), 4) for n in "AB"}  # footprint 15 each
        outs = await drive(proxy, [proxy.generate(r) for r in first.values()])
        assert [led.cell_of(n) for n in "AB"] == [0, 0] and led.used[0] == 30
        # B calls again (grows to 25: 40 reserved); A's next call needs 30: 15 + 30 + 25 > 48
        b1 = np.concatenate([first["B"].prompt, outs[1].tokens, tokens(5, 2)])
        b_task = asyncio.create_task(proxy.generate(request("B", 1, b1, 8)))  # 25
        await asyncio.sleep(0)
        proxy.pump()
        a1 = np.concatenate([first["A"].prompt, outs[0].tokens, tokens(6, 11)])  # 27 tokens
        a_task = asyncio.create_task(proxy.generate(request("A", 1, a1, 4)))
        c_task = asyncio.create_task(proxy.generate(request("C", 0, tokens(7, 4), 4)))  # 7
        await asyncio.sleep(0)
        proxy.pump()
        # C would fit the ledger's room (48 - 40 = 8 >= 7) but A waits on this cell
        assert proxy.order == ["A", "B", "B"] and not c_task.done()
        assert proxy.admission_stats()["waiting_admitted"] == 1
        await drive(proxy, [b_task])
        # B's call is done and nothing runs: A still cannot grow, so the youngest (B) goes
        await drive(proxy, [a_task])
        assert proxy.stats["preemptions"] == 1 and not led.holds("B")
        assert proxy.order[3:] == ["A", "C"] and led.used[0] == 30 + 7
        for n in "ABC":
            proxy.end_execution(n)
        await drive(proxy, [c_task])

    proxy = new_proxy(1, 48)
    asyncio.run(script(proxy))
    check_pools(proxy)
    assert proxy.order == ["A", "B", "B", "A", "C"]
    assert proxy.admission_stats()["admitted_executions"] == 0


def test_a_request_larger_than_the_pool_still_raises():
    async def main():
        proxy = new_proxy(2, 30)
        with pytest.raises(ValueError, match="largest cell KV pool holds 30"):
            await proxy.generate(request("big", 0, tokens(0, 30), 4))

    asyncio.run(main())


@pytest.mark.parametrize("mode", ["migrate", "retry"])
def test_hand_over_moves_or_drops_the_reservation_and_stays_exact(mode):
    reqs = [request(f"h{i}", 0, tokens(40 + i, 10 + 3 * i), 20) for i in range(2)]
    ref = new_proxy(1, 0, "none")
    want = asyncio.run(drive(ref, [ref.generate(r) for r in reqs]))

    async def script(proxy):
        led = proxy.ledger
        tasks = [asyncio.create_task(proxy.generate(r)) for r in reqs]
        await asyncio.sleep(0)
        proxy.pump()
        assert [led.cell_of(r.execution_id) for r in reqs] == [0, 1]  # most room, then index
        counts = proxy.release(0, mode)
        if mode == "migrate":
            assert counts == {"migrated": 1} and led.cell_of("h0") == 1
            assert led.used == [0.0, 29.0 + 32.0]  # footprints 10 + 20 - 1, 13 + 20 - 1
            assert led.youngest(1) == "h1"  # moved: h0 keeps its place in admission order
            # What the scheduler policy reads (LoadSnapshot's kv_reserved / kv_free_tokens)
            assert proxy.kv_room() == {
                "kv_reserved_tokens": (0.0, 61.0),
                "kv_free_tokens": (100.0, 39.0),
                "kv_peak_tokens": 0.0,  # no execution has ended yet
            }
            assert proxy.kv_room([1]) == {"kv_reserved_tokens": (61.0,),
                                          "kv_free_tokens": (39.0,), "kv_peak_tokens": 0.0}  # fmt: skip
        else:  # dropped, then admitted anew (the only open cell): now the youngest
            assert counts == {"retried": 1} and led.youngest(1) == "h0"
        out = await drive(proxy, tasks)
        assert led.cell_of("h0") == 1  # admitted anew after the retry
        return out

    assert new_proxy(2, 100, "none").kv_room() == {}  # not tracked without the ledger
    proxy = new_proxy(2, 100)
    got = asyncio.run(script(proxy))
    check_pools(proxy)
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g.tokens, w.tokens)
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-4)


def test_a_lost_or_never_ended_execution_cannot_hold_room_forever():
    """An execution the proxy never hears end of keeps its reservation while it still calls,
    and loses it once a whole weight version passes without a call from it."""

    async def script(proxy):
        await drive(proxy, [proxy.generate(request("ghost", 0, tokens(9, 10), 4))])
        await drive(proxy, [proxy.generate(request("alive", 0, tokens(8, 10), 4))])
        led = proxy.ledger
        proxy.set_weights(STATE, 1)  # both called in this version: both kept
        assert led.holds("ghost") and led.holds("alive")
        await drive(proxy, [proxy.generate(request("alive", 1, tokens(8, 16), 4))])
        proxy.set_weights(STATE, 2)  # ghost made no call in version 1: it goes
        assert not led.holds("ghost") and led.holds("alive")
        assert proxy.stats["expired"] == 1 and led.floor == 0  # an expiry records no peak
        proxy.end_execution("alive")
        assert not led.holds("alive") and led.floor == 19  # its peak footprint: 16 + 4 - 1
        proxy.end_execution("never-seen")  # harmless

    asyncio.run(script(new_proxy(1, 64)))


def test_evaluation_ends_each_execution_and_runs_as_the_harness_does():
    """evaluation.run_ended = harness.run_executions (same ids, same results) and tells the
    client, through the Temperature and Notifying wrappers, as each execution ends."""

    class Recorder:
        def __init__(self):
            self.inner, self.events = LedgerExpert(), []

        async def generate(self, req):
            self.events.append(("call", req.execution_id))
            return await self.inner.generate(req)

        def end_execution(self, eid):
            self.events.append(("end", eid))

    env, cfg = LedgerEnv(), AgentSettings(max_calls=200, context_window=512, max_new_tokens=8)
    tasks = env.make_tasks(0, 3)
    tasks = tasks + tasks[:1]  # a repeated task: ids '<task>#0' and '<task>#1'
    want = asyncio.run(run_executions(env, tasks, LedgerExpert(), cfg))
    rec = Recorder()
    client = evaluation.Temperature(evaluation.Notifying(rec, lambda: None), 0.0)
    got = asyncio.run(evaluation.run_ended(env, tasks, client, cfg))
    assert [r.execution_id for r in got] == [r.execution_id for r in want]
    assert [r.end_reason for r in got] == [r.end_reason for r in want]
    ends = [e for kind, e in rec.events if kind == "end"]
    assert sorted(ends) == sorted(r.execution_id for r in want)  # each once
    for eid in ends:  # after its last call
        last_call = max(k for k, ev in enumerate(rec.events) if ev == ("call", eid))
        assert rec.events.index(("end", eid)) > last_call
    evaluation.end_execution(object(), "x")  # a client without end_execution: nothing


class Admission(RuleBasedStateMachine):
    """Random multi-turn executions, pumps, hand-overs, admits and weight updates over 2
    cells with small pools: nothing is lost, nothing overflows, nobody deadlocks, and every
    call samples what it samples alone."""

    def __init__(self):
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.proxy = new_proxy(2, 48)
        self.tasks, self.specs = [], []

    def spin(self):
        for _ in range(3):
            self.loop.run_until_complete(asyncio.sleep(0))

    @initialize(n=st.integers(2, 5))
    def start_some(self, n):
        for k in range(n):
            self.start(2, 4, 1, 6 + k)

    @rule(turns=st.integers(1, 3), new=st.integers(1, 8), ticks=st.integers(0, 6),
          plen=st.integers(2, 10))  # fmt: skip
    def start(self, turns, new, ticks, plen):
        i = len(self.tasks)
        self.specs.append((i, turns, new, ticks, plen))
        self.tasks.append(self.loop.create_task(agent(self.proxy, i, turns, new, ticks, plen)))
        self.spin()

    @rule(times=st.integers(1, 6))
    def pump(self, times):
        for _ in range(times):
            self.proxy.pump()
            self.spin()

    @rule(cell=st.integers(0, 1), mode=st.sampled_from(["migrate", "retry"]))
    def release(self, cell, mode):
        if cell in self.proxy.rollout:
            self.proxy.release(cell, mode)

    @rule(cell=st.integers(0, 1))
    def admit(self, cell):
        self.proxy.admit(cell)

    @rule()
    def new_weights(self):
        self.proxy.set_weights(STATE, 0)

    @invariant()
    def within_pools(self):
        check_pools(self.proxy)

    def teardown(self):
        for cell in (0, 1):
            self.proxy.admit(cell)
        for _ in range(3000):
            if all(t.done() for t in self.tasks):
                break
            self.proxy.pump()
            self.spin()
        assert all(t.done() for t in self.tasks), "an execution never finished (deadlock?)"
        assert self.proxy.admission_stats()["admitted_executions"] == 0
        assert self.proxy.ledger.used == pytest.approx([0.0, 0.0])
        ref = new_proxy(1, 0, "none")
        want = self.loop.run_until_complete(drive(ref, [agent(ref, *spec) for spec in self.specs]))
        for w, t in zip(want, self.tasks):
            for x, y in zip(w, t.result()):
                np.testing.assert_array_equal(y, x)
        self.loop.close()


TestAdmission = Admission.TestCase
TestAdmission.settings = settings(
    max_examples=15, stateful_step_count=10, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip
