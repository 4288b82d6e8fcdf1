"""The simulator's engine-pool mode keeps its accounting in the engine's own KVPool
(gyre/kvpool.py): on a hand-made sequence the real engine and the simulator admit, wait and
evict alike, in the slot layout (a page a token) and paged; and the pool's rule as the
simulator calls it (claim, pinned last, rename, hand-over room)."""

import dataclasses

import numpy as np
import pytest
from rollout_world import CELLS, SPEC, STATE  # the tiny model test_engine uses too
from test_sim import PLAIN

from gyre.elastic.sim import Simulator
from gyre.elastic.simstate import ExState, Stale
from gyre.elastic.workload import Call, Execution
from gyre.kvpool import KVPool
from gyre.rollout.engine import Engine
from gyre.rollout.types import GenerateRequest

MAX_NEW, MAX_LEN, POOL = 6, SPEC.max_len, 64
# (execution, its first prompt's length, the observation its second prompt appends, the
# tool wait after its first call): the second calls come one at a time, 100 s apart.
SCRIPT = (("A", 8, 4, 100.0), ("B", 20, 3, 200.0), ("C", 36, 2, 300.0))


def prompt(first: int, n: int) -> np.ndarray:
    """A prompt whose first token no other execution's shares (no prefix reuse across them)."""
    rest = np.random.default_rng(first).integers(3, 64, n - 1)
    return np.concatenate([[first], rest]).astype(np.int32)


def run_engine(page: int):
    """The script on one engine cell -> (events, evictions, re-prefilled tokens, resident
    contexts {execution: cached tokens}, used pages). Events: ('admit' | 'evict', execution)
    in order. First calls are submitted together (FIFO), each second call alone."""
    spec = dataclasses.replace(SPEC, kv_tokens=POOL, kv_page=page)
    engine = Engine(spec, CELLS[0], STATE)
    events, owner = [], {}
    engine.on_admit = lambda rid: events.append(("admit", owner[rid]))
    evict = engine._evict
    engine._evict = lambda slot, keep=0: (events.append(("evict", slot.owner)), evict(slot, keep))

    def call(name, call_id, tokens):
        rid = engine.submit(GenerateRequest(name, call_id, tokens, MAX_NEW, (), 0.0))
        owner[rid] = name
        return rid

    def drain() -> dict:
        out = {}
        while engine.num_live:
            out.update(engine.step())
            if engine.paged:
                engine.kv.check()
        return out

    firsts = {name: prompt(i + 1, n) for i, (name, n, _, _) in enumerate(SCRIPT)}
    rids = {name: call(name, 0, p) for name, p in firsts.items()}
    done = drain()
    for i, (name, _, obs, _) in enumerate(SCRIPT):
        out = done[rids[name]]
        assert out.tokens.size == MAX_NEW  # no stop tokens: every completion is MAX_NEW long
        second = np.concatenate([firsts[name], out.tokens, prompt(10 + i, obs)]).astype(np.int32)
        call(name, 1, second)
        drain()
    resident = {s.owner: s.length for s in engine.slots if s.length}
    s = engine.stats
    return events, s["evictions"], s["reprefilled_tokens"], resident, engine.kv.used_pages


def run_sim(page: int):
    """The same script in the simulator's engine-pool mode (one cell, 4 slots)."""
    steps = [[
        Execution(name, 0, (Call(n, MAX_NEW, tool, n),
                            Call(n + MAX_NEW + obs, MAX_NEW, 0.0, obs)), 1e9)
        for name, n, obs, tool in SCRIPT
    ]]  # fmt: skip
    cost = dataclasses.replace(PLAIN, kv_capacity_tokens=float(POOL), slots=4)
    pool = (MAX_NEW, MAX_LEN) if page == 0 else (MAX_NEW, MAX_LEN, page)
    sim = Simulator(steps, 1, "colocate", cost, engine_pool=pool)
    mem, events = sim.memory, []
    name = lambda key: (key if isinstance(key, ExState) else key.owner).ex.execution_id
    evicted, admitted, ended = mem._evicted, mem.admitted, mem.ended
    mem._evicted = lambda c, key: (events.append(("evict", name(key))), evicted(c, key))
    mem.admitted = lambda c, req: (admitted(c, req), events.append(("admit", name(req.ex))))
    seen = []  # the pool as each execution ends (the cell then leaves rollout and drops it)

    def end(es):
        ended(es)
        seen.append(({name(k): held for k, held in sim.cells[0].idle.items()},
                     mem.pools[0].used_pages))  # fmt: skip

    mem.ended = end
    r = sim.run()
    assert r.end_counts == {name: 1 for name, *_ in SCRIPT}
    return events, r.counters, *seen[-1]


# The slot layout's decisions, by hand (pool 64, footprint P + 6 - 1, idle P + 6 - 1):
# A1 (13) and B1 (25) are admitted; C1 (41) waits: the live reservations leave 26. A1 and B1
# end idle; C1 is admitted, evicting A then B (LRU). A2 (23) fits the 23 free pages; B2 (34)
# evicts C; C2 (49) evicts A then B.
SLOT_EVENTS = [("admit", "A"), ("admit", "B"), ("evict", "A"), ("evict", "B"), ("admit", "C"),
               ("admit", "A"), ("evict", "C"), ("admit", "B"),
               ("evict", "A"), ("evict", "B"), ("admit", "C")]  # fmt: skip


# Paged (4 pages of 16): A1, B1 take 1 + 2 pages and C1 (3) waits as above; C idle holds 3
# pages, so A2 (2 pages) evicts C, B2 (3) evicts A, C2 (4) evicts B.
PAGED_EVENTS = [("admit", "A"), ("admit", "B"), ("evict", "A"), ("evict", "B"), ("admit", "C"),
                ("evict", "C"), ("admit", "A"), ("evict", "A"), ("admit", "B"),
                ("evict", "B"), ("admit", "C")]  # fmt: skip


@pytest.mark.parametrize("page", [0, 16])
def test_the_simulator_and_the_engine_admit_and_evict_alike(page):
    """Page 0: the slot layout (the pool counts a page a token); 16: the paged engine of 4
    pages, whose footprints are whole pages."""
    events, evictions, reprefilled, resident, used = run_engine(page)
    sim_events, counters, sim_resident, sim_used = run_sim(page)
    assert sim_events == events == (SLOT_EVENTS if page == 0 else PAGED_EVENTS)
    assert counters["evictions"] == evictions == 5
    assert sim_resident == resident == {"C": 44 + MAX_NEW - 1}  # C2's cached length
    assert sim_used == used
    # Re-prefilled tokens: the engine counts its evicted context, P + completion - 1 (its last
    # token never fed back); the simulator counts the previous call's P + completion, one
    # more per re-prefill (the three second calls), as its docstring says.
    assert counters["reprefill_tokens"] == reprefilled + 3
    assert reprefilled == (8 + 5) + (20 + 5) + (36 + 5)


# ---- the pool's rule as the simulator calls it ------------------------------------------------


def test_claim_evicts_lru_pinned_last_and_rename_keeps_the_order():
    kv = KVPool(10, 1)
    for key, n in (("a", 3), ("b", 3), ("c", 3)):
        kv.resize(key, 0, n)
        kv.touch(key, idle=True)
    kv.rename("b", "b'")  # a context left behind keeps its place in the order
    assert kv.lru() == ["a", "b'", "c"] and kv.is_idle("b'") and not kv.is_idle("b")
    gone = []
    evict = lambda k: (gone.append(k), kv.release(k))
    kv.claim("d", 0, 5, evict, pinned=lambda k: k == "a")  # 1 free: two go, "a" last
    assert gone == ["b'", "c"] and kv.free_pages == 2
    assert kv.live_pages() == 5 and kv.lru() == ["a"]  # "d" is not idle: live
    with pytest.raises(MemoryError):  # more than the live reservations leave: "a" goes too
        kv.claim("e", 0, 6, evict)
    assert gone[-1] == "a"
    kv.check()


def test_a_context_handed_over_evicts_idle_ones_or_is_refused():
    """A context arriving at a cell (hand-over) takes free pages, else evicts idle contexts
    LRU as the engine's import does, and is refused where the live reservations leave too
    little room; left behind, a context becomes a Stale key in its place."""
    steps = [[Execution(f"e{i}", 0, (Call(10, 5, 0.0, 10),), 1e9) for i in range(4)]]
    cost = dataclasses.replace(PLAIN, kv_capacity_tokens=40.0, slots=4)
    sim = Simulator(steps, 2, "colocate", cost, engine_pool=(5, 64))
    mem, c, other = sim.memory, sim.cells[0], sim.cells[1]
    es = [ExState(ex, 0.0) for ex in steps[0]]
    for e in es[:2]:
        assert mem._put_idle(c, e, 14)
        e.cell, e.held = c, 14
    mem._sync(c)
    assert list(c.idle) == es[:2] and c.kv_idle == 28 and mem.pools[0].free_pages == 12
    assert mem._put_idle(c, es[2], 20)  # evicts e0 (LRU)
    assert mem.pools[0].lru() == [es[1], es[2]] and sim.counters["evictions"] == 1
    assert es[0].cell is None and c in es[0].lost
    mem._reserve(c, es[3], 19)  # a live reservation: evicts e1 (LRU), 1 page left free
    assert c.kv_live == 19 and sim.counters["evictions"] == 2
    assert not mem._put_idle(c, ExState(steps[0][0], 0.0), 22)  # 40 - 19 live < 22: refused
    es[2].cell, es[2].held = c, 20
    mem._leave_behind(es[2], other)  # its next call went to the other cell
    (stale,) = mem.pools[0].lru()
    assert isinstance(stale, Stale) and stale.owner is es[2] and es[2].cell is None
    mem.pools[0].check()
