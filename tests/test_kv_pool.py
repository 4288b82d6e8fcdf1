"""KV pool with a token budget: same completions as an unlimited pool, admission, LRU eviction."""

import asyncio
import dataclasses

import jax
import numpy as np
import pytest
from rollout_world import CELLS, SPEC, STATE  # the tiny model test_engine uses too

from gyre.rollout.engine import Engine, footprint, kv_budget_tokens, pool_budget
from gyre.rollout.proxy import Proxy
from gyre.rollout.types import GenerateRequest


@pytest.fixture(scope="module", autouse=True)
def compiled():
    """Compiles cells 0 and 1's programs once for the module (engines share them)."""
    for cell in (0, 1):
        engine(0, cell).warmup()


def engine(kv_tokens=0, cell=0):
    return Engine(dataclasses.replace(SPEC, kv_tokens=kv_tokens), CELLS[cell], STATE)


def new_proxy(ncells, kv_tokens=0):
    return Proxy([engine(kv_tokens, c) for c in range(ncells)])


def run(coro):
    return asyncio.run(coro)


def request(name, call, prompt, new):
    return GenerateRequest(name, call, np.asarray(prompt, np.int32), new, (), 1.0)


def tokens(seed, n):
    return np.random.default_rng(seed).integers(0, 64, n).astype(np.int32)


def within_budget(proxy):
    for e in proxy.engines.values():
        p = e.pool()
        assert p["resident_tokens"] <= p["reserved_tokens"] <= e.budget, (e.cell.index, p)
        for s in e.slots:  # a live request's slot never outgrows its reservation
            assert s.live is None or s.length <= s.live.reserve


async def agent(proxy, i, turns=3, new=8):
    """A multi-turn execution: call, wait on a 'tool' (event-loop ticks), append and call again."""
    prompt, outs = tokens(1000 + i, 6 + 2 * i), []
    for t in range(turns):
        out = await proxy.generate(request(f"agent{i}", t, prompt, new))
        outs.append(out)
        for _ in range(3 + 2 * i):  # tool latency: the proxy keeps pumping meanwhile
            await asyncio.sleep(0)
        prompt = np.concatenate([prompt, out.tokens, tokens(2000 + 10 * i + t, 3)])
    return outs


async def drive(proxy, coros, max_pumps=3000):
    tasks = [asyncio.create_task(c) for c in coros]
    await asyncio.sleep(0)
    for _ in range(max_pumps):
        if all(t.done() for t in tasks):
            return [t.result() for t in tasks]
        proxy.pump()
        within_budget(proxy)
        await asyncio.sleep(0)
    raise AssertionError(f"still pending after {max_pumps} pumps")


def agents_run(kv_tokens, n=6):
    proxy = new_proxy(2, kv_tokens)
    outs = run(drive(proxy, [agent(proxy, i) for i in range(n)]))
    return outs, proxy.kv_stats()


def reference(reqs, ncells=1):
    proxy = new_proxy(ncells)
    return run(drive(proxy, [proxy.generate(r) for r in reqs]))


def test_small_pool_gives_the_same_completions_as_an_unlimited_one():
    want, unlimited = agents_run(0)  # 2 cells x 256 tokens: every context stays resident
    got, small = agents_run(100)  # 2 cells x 100 tokens < the 6 executions' contexts
    for w_turns, g_turns in zip(want, got):
        for w, g in zip(w_turns, g_turns):
            np.testing.assert_array_equal(g.tokens, w.tokens)
            np.testing.assert_array_equal(g.versions, w.versions)
            # KV prefilled again instead of kept from decode differs in the last bits (other
            # op shapes), as a reused prefix does from a cold prefill (tests/test_engine.py)
            np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=0, atol=1e-5)
            assert g.finish_reason == w.finish_reason
    print("unlimited:", unlimited, "\nsmall:", small)
    assert unlimited["kv_evictions"] == unlimited["kv_reprefilled_tokens"] == 0
    assert small["kv_evictions"] > 0 and small["kv_reprefilled_tokens"] > 0
    assert small["kv_reused_tokens"] < unlimited["kv_reused_tokens"]
    assert small["kv_admissions"] == unlimited["kv_admissions"] == 18
    assert small["kv_budget_tokens"] == 200 and unlimited["kv_budget_tokens"] == 512


def test_request_waits_in_the_proxy_until_the_pool_has_room():
    a = request("a", 0, tokens(1, 20), 30)
    b = request("b", 0, tokens(2, 10), 20)
    assert footprint(a, 64) == 49 and footprint(b, 64) == 29  # 49 + 29 > 60
    want = reference([a, b])
    proxy = new_proxy(1, 60)
    seen = []  # (calls waiting in the proxy, live requests in the engine) after each pump

    async def main():
        tasks = [asyncio.create_task(proxy.generate(r)) for r in (a, b)]
        await asyncio.sleep(0)
        while not all(t.done() for t in tasks):
            proxy.pump()
            within_budget(proxy)
            seen.append((proxy.kv_stats()["kv_waiting"], proxy.engines[0].num_live))
            await asyncio.sleep(0)
        return [t.result() for t in tasks]

    got = run(main())
    # b waits in the proxy (not in the engine) while a runs, then is admitted
    # (a pump runs one device loop of up to decode_steps tokens)
    assert seen[0] == (1, 1) and seen.count((1, 1)) >= (a.max_new_tokens - 1) // SPEC.decode_steps
    assert seen[seen.count((1, 1))] == (0, 1) and seen[-1] == (0, 0)
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g.tokens, w.tokens)
        np.testing.assert_array_equal(g.logprobs, w.logprobs)
    stats = proxy.kv_stats()
    assert stats["kv_admissions"] == 2 and stats["kv_admission_wait_s"] > 0
    assert stats["kv_evictions"] == 1 and stats["kv_evicted_tokens"] == 49  # a's idle context


def test_engine_queue_waits_for_budget_too():
    e = engine(60)
    e.submit(request("a", 0, tokens(1, 20), 30))
    e.submit(request("b", 0, tokens(2, 10), 20))
    e.step()
    assert e.pool()["live_contexts"] == 1 and len(e.queue) == 1 and e.room() == 60 - 49 - 29
    assert not e.can_admit(request("c", 0, tokens(3, 2), 1))
    e.run_until_done()
    assert e.stats["admitted"] == 2


async def lru_script(call):
    """Three 15-token contexts, then follow-ups and a newcomer over a 50-token pool.

    ``await call(request)`` runs one request to its end -> its response. Returns all responses.
    """
    first = {n: request(n, 0, tokens(10 + k, 10), 6) for k, n in enumerate("ABC")}
    out = {n: await call(r) for n, r in first.items()}  # A, B, C idle: 45 tokens resident

    def follow(n):
        r = first[n]
        return request(n, 1, np.concatenate([r.prompt, out[n].tokens, [1, 2]]), 6)

    a2 = await call(follow("A"))  # footprint 23: 23 + B 15 + C 15 > 50 -> evict B (LRU)
    d = await call(request("D", 0, tokens(20, 10), 6))  # 15 + A 23 + C 15 > 50 -> evict C
    b2 = await call(follow("B"))  # 23 + A 23 + D 15 > 50 -> evict A; B's 15 tokens again
    return [*out.values(), a2, d, b2]


def engine_caller(e, log=None):
    async def call(r):
        rid = e.submit(r)
        out = e.run_until_done()[rid]
        if log is not None:
            log.append((sorted(s.owner for s in e.slots if s.length), e.stats["evictions"]))
        return out

    return call


def test_idle_contexts_are_evicted_least_recently_used():
    e, log = engine(50), []
    got = run(lru_script(engine_caller(e, log)))
    resident = [["A"], ["A", "B"], ["A", "B", "C"], ["A", "C"], ["A", "D"], ["B", "D"]]
    assert log == list(zip(resident, [0, 0, 0, 1, 2, 3]))
    assert e.stats["evicted_tokens"] == 15 + 15 + 23
    assert e.stats["reprefilled_tokens"] == 15  # B's whole evicted context, prefilled again
    assert e.stats["reused_tokens"] == 15  # A's follow-up only
    want = run(lru_script(engine_caller(engine(0))))  # unlimited: nothing evicted
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g.tokens, w.tokens)
        np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=0, atol=1e-5)


def test_slot_choice_keeps_other_contexts_until_they_are_least_recently_used():
    e, log = engine(0), []
    call = lambda r: run(engine_caller(e, log)(r))
    shared = tokens(5, 8)  # e.g. a task prompt common to several executions
    a = request("A", 0, np.concatenate([shared, tokens(6, 4)]), 4)
    call(a)
    call(request("B", 0, np.concatenate([shared, tokens(7, 4)]), 4))
    # B shares 8 tokens with A's context but would cut it: it takes an empty slot instead,
    # with a copy of A's 8 shared tokens
    assert e.stats["shared_tokens"] == e.stats["reused_tokens"] == 8
    assert log[-1] == (["A", "B"], 0)
    held_a = e.slots[0].held.copy()
    call(request("C", 0, np.concatenate([held_a, [1, 2, 3]]), 4))  # extends all of A's: reused
    assert e.stats["reused_tokens"] == 8 + 15 and log[-1] == (["B", "C"], 0)
    call(request("D", 0, tokens(8, 6), 4))
    call(request("E", 0, tokens(9, 6), 4))
    # no slot left empty: F takes the least recently used context (B's), reusing the shared part
    call(request("F", 0, np.concatenate([shared, tokens(10, 4)]), 4))
    assert log[-1] == (["C", "D", "E", "F"], 1)
    assert e.stats["reused_tokens"] == 8 + 15 + 8 and e.stats["evicted_tokens"] == 15 - 8
    assert e.stats["shared_tokens"] == 8


def test_kv_stats_counters_and_capacity():
    proxy = new_proxy(1, 50)
    assert proxy.capacity_contexts() == (4.0,)  # nothing admitted yet: slots

    async def call(r):
        task = asyncio.create_task(proxy.generate(r))
        while not task.done():
            proxy.pump()
            await asyncio.sleep(0)
        return task.result()

    run(lru_script(call))
    stats = proxy.kv_stats()
    assert all(k.startswith("kv_") and isinstance(v, int | float) for k, v in stats.items())
    footprints = [15, 15, 15, 23, 15, 23]
    capacity = 50 / (sum(footprints) / 6)
    assert stats == pytest.approx({
        "kv_evictions": 3, "kv_evicted_tokens": 53, "kv_reprefilled_tokens": 15,
        "kv_prompt_tokens": 10 * 4 + 18 * 2, "kv_reused_tokens": 15,
        "kv_admissions": 6, "kv_admission_wait_s": stats["kv_admission_wait_s"],
        "kv_budget_tokens": 50, "kv_capacity_contexts": capacity,
        "kv_reserved_tokens": 23 + 15, "kv_resident_tokens": 23 + 15, "kv_resident_contexts": 2,
        "kv_queued": 0, "kv_waiting": 0, "kv_resident_contexts_c0": 2, "kv_shared_tokens": 0,
        "kv_decode_slot_steps": stats["kv_decode_slot_steps"],
        "kv_decode_idle_slot_steps": stats["kv_decode_idle_slot_steps"],
    })  # fmt: skip
    assert 0 <= stats["kv_decode_idle_slot_steps"] < stats["kv_decode_slot_steps"]
    assert 0 < stats["kv_admission_wait_s"] < 60
    assert proxy.capacity_contexts() == pytest.approx((capacity,))
    # a cell out of rollout keeps its estimate (the policy weighs bringing it back) but its
    # pool leaves the current totals
    proxy.release(0)
    after = proxy.kv_stats()
    assert after["kv_budget_tokens"] == 0 and after["kv_resident_contexts_c0"] == 0
    assert after["kv_evictions"] == 3 and proxy.capacity_contexts() == pytest.approx((capacity,))


def test_oversize_request_is_a_clear_error():
    e = engine(32)
    with pytest.raises(ValueError, match=r"'big'.*needs 39 KV tokens.*holds 32"):
        e.submit(request("big", 0, tokens(1, 20), 20))
    rid = e.submit(request("edge", 0, tokens(1, 20), 13))  # footprint exactly 32: fits
    assert e.run_until_done()[rid].tokens.size == 13

    async def main():
        proxy = new_proxy(1, 32)
        with pytest.raises(ValueError, match=r"'big'.*needs 39 KV tokens.*holds 32"):
            await proxy.generate(request("big", 0, tokens(1, 20), 20))
        assert not proxy.calls and not proxy.waiting

    run(main())


@pytest.mark.parametrize("kv, path", [(60, "retried"), (100, "migrated")])
def test_migration_respects_the_destination_pool(kv, path):
    reqs = [request(f"m{i}", 0, tokens(30 + i, 20), 30) for i in range(2)]  # footprint 49 each
    want = reference(reqs)
    proxy, counts = new_proxy(2, kv), {}

    async def main():
        tasks = [asyncio.create_task(proxy.generate(r)) for r in reqs]
        await asyncio.sleep(0)
        for k in range(500):
            if all(t.done() for t in tasks):
                return [t.result() for t in tasks]
            if k == 4:  # one request per cell: cell 1 has room for m0's 49 tokens only at 100
                counts.update(proxy.release(0, "migrate"))
            proxy.pump()
            within_budget(proxy)
            await asyncio.sleep(0)

    got = run(main())
    assert counts == {path: 1}
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g.tokens, w.tokens)
        np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=0, atol=1e-4)


def test_budget_helper_and_derived_budget():
    assert kv_budget_tokens(1000, 300, 100, 4) == 150
    assert kv_budget_tokens(1000, 900, 200, 4) == 0  # nothing left: never negative
    with pytest.raises(ValueError):
        kv_budget_tokens(1000, 0, 0, 0)
    e = engine()
    assert e.budget == 4 * 64  # CPU reports no memory: slots * max_len
    assert pool_budget(1000, e.cache, e.weights, CELLS[0].devices) == 256  # capped: allocated
    assert pool_budget(100, e.cache, e.weights, CELLS[0].devices) == 100

    class Device:  # reports its memory, as an accelerator does
        def __init__(self, limit):
            self.limit = limit

        def memory_stats(self):
            return {"bytes_limit": self.limit}

    # per device: 2 of the 4 slots (slots over 'data' = 2), one token's k and v rows in f32
    per_token = 2 * SPEC.model.num_layers * SPEC.model.num_kv_heads * SPEC.model.head_dim * 4
    weights = sum(x.nbytes for x in jax.tree.leaves(e.weights))  # replicated: whole on each
    limit = int((weights + 40 * per_token) / 0.9) + 1  # 40 tokens left after a 10% reserve
    assert pool_budget(0, e.cache, e.weights, [Device(limit), Device(2 * limit)]) == 2 * 40
    assert pool_budget(0, e.cache, e.weights, [Device(10**12)] * 2) == 256
    with pytest.raises(ValueError, match="kv_tokens"):
        dataclasses.replace(SPEC, kv_tokens=-1)
