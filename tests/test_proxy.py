"""Model-call proxy: routing and lossless, exact hand-over of live requests between cells."""

import asyncio
import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from rollout_world import CELLS, SPEC, STATE  # the tiny model test_engine uses too

from gyre.rollout.engine import Engine
from gyre.rollout.proxy import Proxy
from gyre.rollout.types import HANDOVERS, GenerateRequest


def make_request(i, prompt_len, new, temperature=1.0, stop=()):
    prompt = np.random.default_rng(i).integers(0, 64, prompt_len).astype(np.int32)
    return GenerateRequest(f"exec{i}", i, prompt, new, tuple(stop), temperature)


def new_proxy(cells, kv_tokens=0):
    spec = dataclasses.replace(SPEC, kv_tokens=kv_tokens)  # same programs: kv is accounting
    return Proxy([Engine(spec, c, STATE) for c in cells])


async def drive(proxy, requests, actions=None, max_pumps=500):
    """Submits all requests, pumps; actions[k]() runs before pump k (a step boundary)."""
    tasks = [asyncio.create_task(proxy.generate(r)) for r in requests]
    await asyncio.sleep(0)
    for k in range(max_pumps):
        if all(t.done() for t in tasks):
            return [t.result() for t in tasks]
        if actions and k in actions:
            actions[k]()
        proxy.pump()
        await asyncio.sleep(0)
    raise AssertionError(f"requests still pending after {max_pumps} pumps")


def run(coro):
    return asyncio.run(coro)


def reference(requests):
    """Every request on one cell, no hand-over."""
    return run(drive(new_proxy(CELLS[:1]), requests))


def test_migration_mid_generation_is_exact():
    reqs = [make_request(i, 6 + 9 * i, 20, 1.0) for i in range(4)]
    want = reference(reqs)
    proxy = new_proxy(CELLS[:2])
    counts = {}
    got = run(drive(proxy, reqs, {4: lambda: counts.update(proxy.release(0, "migrate"))}))
    assert counts == {"migrated": 2}  # routed 2 + 2; cell 1 has room for both
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g.tokens, w.tokens)
        np.testing.assert_array_equal(g.logprobs, w.logprobs)
        assert g.finish_reason == w.finish_reason


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cancel_and_retry_continues_the_completion(temperature):
    reqs = [make_request(10 + i, 5 + 11 * i, 20, temperature) for i in range(4)]
    want = reference(reqs)
    proxy = new_proxy(CELLS[:2])
    counts = {}
    got = run(drive(proxy, reqs, {5: lambda: counts.update(proxy.release(0, "retry"))}))
    assert counts == {"retried": 2}
    drift = max(float(np.abs(g.logprobs - w.logprobs).max()) for w, g in zip(want, got))
    print(f"retry logprob drift at temperature {temperature}: {drift:.2e}")
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g.tokens, w.tokens)  # temp 1: keys line up too
    assert drift < 1e-4


def test_no_rollout_cell_left_requests_wait_then_finish():
    reqs = [make_request(20 + i, 7, 6, 0.0) for i in range(3)]
    want = reference(reqs)
    proxy = new_proxy(CELLS[:2])
    actions = {
        2: lambda: proxy.release(0, "migrate"),
        3: lambda: proxy.release(1, "migrate"),  # nothing left: everything waits
        6: lambda: proxy.admit(0),
    }
    got = run(drive(proxy, reqs, actions))
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g.tokens, w.tokens)
    assert proxy.stats["finished"] == 3 and not proxy.calls


def test_bad_input_raises_in_the_caller_and_others_finish():
    async def main():
        proxy = new_proxy(CELLS[:1])
        runner = asyncio.create_task(proxy.run())
        good = asyncio.create_task(proxy.generate(make_request(30, 8, 5)))
        with pytest.raises(ValueError, match="exec31.*does not fit"):
            await proxy.generate(make_request(31, 80, 5))
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await proxy.generate(GenerateRequest("x", 0, np.array([3, -1], np.int32), 5))
        out = await good
        runner.cancel()
        return out

    assert run(main()).tokens.size == 5


def test_run_loop_serves_concurrent_callers_and_prefers_the_same_cell():
    async def main():
        proxy = new_proxy(CELLS[:2])
        proxy.warmup()
        runner = asyncio.create_task(proxy.run())
        first = make_request(40, 12, 6, 0.0)
        out1 = await proxy.generate(first)
        follow = GenerateRequest(
            "exec40", 41, np.concatenate([first.prompt, out1.tokens, [1, 2]]), 6, (), 0.0
        )
        others = [proxy.generate(make_request(50 + i, 4, 3)) for i in range(5)]
        await asyncio.gather(proxy.generate(follow), *others)
        runner.cancel()
        return proxy

    proxy = run(main())
    assert proxy.stats["finished"] == 7
    assert proxy.prefix_hit_rate() > 0.3  # the follow-up hit its own cell's cached prefix


class HandOver(RuleBasedStateMachine):
    """Random submits, pumps, releases and admits over 4 cells of 2 devices (8 devices)."""

    kv_tokens = 0  # each cell's KV pool (0: slots * max_len)

    def __init__(self):
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.proxy = new_proxy(CELLS, self.kv_tokens)
        self.requests, self.tasks = [], []

    def spin(self):
        for _ in range(2):
            self.loop.run_until_complete(asyncio.sleep(0))

    @initialize(lengths=st.lists(st.integers(1, 40), min_size=2, max_size=10))
    def start_some(self, lengths):
        for n in lengths:
            self.submit(n, 8, False)
        self.proxy.pump()

    @rule(prompt_len=st.integers(1, 40), new=st.integers(1, 10), stop=st.booleans())
    def submit(self, prompt_len, new, stop):
        i = len(self.requests)
        req = make_request(100 + i, prompt_len, new, 0.0, stop=(7,) if stop else ())
        self.requests.append(req)
        self.tasks.append(self.loop.create_task(self.proxy.generate(req)))
        self.spin()

    @rule(times=st.integers(1, 4))
    def pump(self, times):
        for _ in range(times):
            self.proxy.pump()
        self.spin()

    @rule(cell=st.integers(0, 3), mode=st.sampled_from(HANDOVERS))
    def release(self, cell, mode):
        if cell in self.proxy.rollout:
            self.proxy.release(cell, mode)

    @rule(cell=st.integers(0, 3))
    def admit(self, cell):
        self.proxy.admit(cell)

    @invariant()
    def nothing_lost_or_duplicated(self):
        done = sum(t.done() for t in self.tasks)
        assert self.proxy.stats["finished"] == done
        assert len(self.proxy.calls) + done == len(self.tasks)

    @invariant()
    def pools_within_budget(self):
        for e in self.proxy.engines.values():
            assert e.pool()["reserved_tokens"] <= e.budget

    def teardown(self):
        for cell in range(len(CELLS)):
            self.proxy.admit(cell)
        for _ in range(200):
            if all(t.done() for t in self.tasks):
                break
            self.proxy.pump()
            self.spin()
        assert all(t.done() for t in self.tasks), "a request was lost"
        if self.requests:
            want = reference(self.requests)
            for req, w, t in zip(self.requests, want, self.tasks):
                got = t.result()
                np.testing.assert_array_equal(got.tokens, w.tokens, err_msg=req.execution_id)
                np.testing.assert_allclose(got.logprobs, w.logprobs, atol=1e-4)
        self.loop.close()


TestHandOver = HandOver.TestCase
TestHandOver.settings = settings(
    max_examples=25,
    stateful_step_count=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class HandOverTightPool(HandOver):
    """The same over pools of 60 tokens (requests reserve up to 49): admission waits and
    evictions interleave with hand-overs."""

    kv_tokens = 60


TestHandOverTightPool = HandOverTightPool.TestCase
TestHandOverTightPool.settings = settings(
    max_examples=20,
    stateful_step_count=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
