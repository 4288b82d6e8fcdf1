"""Decode loops on the device and shared prefill: the loop equals one token per
dispatch bit for bit; the samples of one task prefill their prompt once; nothing recompiles as
the number of live requests changes; the loop's idle slot-steps are counted exactly."""

import dataclasses

import jax
import numpy as np
import pytest
from rollout_world import CELLS, SPEC, STATE, compiles_under_varied_load, prompt, request
from test_engine import reference_logprobs

from gyre import mesh as gmesh
from gyre.config import default_config
from gyre.errors import ConfigError
from gyre.rl.builder import build_specs
from gyre.rollout.engine import Engine
from gyre.rollout.programs import (
    AUTO_DECODE_STEPS,
    ONE_SLOT_DECODE_STEPS,
    RolloutSpec,
    compiler_options,
    kv_blocks,
    loop_steps,
    programs_for,
)

STOPS = (3, 7, 11, 13, 17, 19, 23, 29)  # 8 of 64 ids: some requests stop early


def run(requests, steps, cell=0, spec=SPEC):
    engine = Engine(dataclasses.replace(spec, decode_steps=steps), CELLS[cell], STATE)
    rids = [engine.submit(r) for r in requests]
    out = engine.run_until_done()
    return [out[r] for r in rids], engine


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
def test_loop_equals_one_token_per_dispatch_bit_for_bit(temperature):
    # 6 requests on 4 slots (two wait), mixed prompt lengths, budgets and stop tokens (the
    # last token of a free run, plus ids never drawn: the check looks at every entry)
    reqs = [request(f"e{i}", prompt(i, 3 + 9 * i), 4 + 5 * i, temperature) for i in range(6)]
    free, _ = run(reqs, 1)
    reqs = [dataclasses.replace(r, stop_tokens=(*STOPS[:7], int(f.tokens[-1])) if i % 2 else ())
            for i, (r, f) in enumerate(zip(reqs, free))]  # fmt: skip
    want, one = run(reqs, 1)
    for steps in (3, 16):
        got, loop = run(reqs, steps)
        for w, g in zip(want, got):
            np.testing.assert_array_equal(g.tokens, w.tokens)
            np.testing.assert_array_equal(g.logprobs, w.logprobs)
            assert g.finish_reason == w.finish_reason
        assert loop.stats["generated"] == one.stats["generated"]
        assert loop.stats["decode_loops"] < one.stats["decode_loops"]
    assert any(w.finish_reason == "stop" for w in want) and any(
        w.finish_reason == "length" for w in want
    )


def test_stop_and_budget_are_checked_on_the_device():
    (free,), _ = run([request("s", prompt(1, 10), 30, 0.0)], 1)
    stop = int(free.tokens[5])
    k = int(np.flatnonzero(free.tokens == stop)[0])
    (cut,), engine = run([request("s", prompt(1, 10), 30, 0.0, stop=(stop,))], 16)
    np.testing.assert_array_equal(cut.tokens, free.tokens[: k + 1])
    assert cut.finish_reason == "stop"
    # the loop ran only as far as the stop: nothing was generated past it
    assert engine.stats["decode_steps"] == k and engine.stats["generated"] == k + 1


def test_idle_slot_steps_are_counted_exactly():
    # budgets 3 and 12: after prefill each holds 1 token; one loop of 11 steps, in which the
    # first request runs 2 steps and then sits idle for 9
    reqs = [request("a", prompt(1, 6), 3, 0.0), request("b", prompt(2, 6), 12, 0.0)]
    _, engine = run(reqs, 16)
    assert engine.stats["decode_loops"] == 1 and engine.stats["decode_steps"] == 11
    assert engine.stats["decode_slot_steps"] == 22 and engine.stats["decode_idle_slot_steps"] == 9


def test_a_waiting_request_ends_the_loop_when_a_slot_frees():
    # 4 slots busy, a fifth waits: the loop returns as soon as the shortest request ends
    reqs = [request(f"r{i}", prompt(i, 6), 3 if i == 0 else 30, 0.0) for i in range(5)]
    engine = Engine(dataclasses.replace(SPEC, decode_steps=16), CELLS[0], STATE)
    for r in reqs:
        engine.submit(r)
    done = engine.step()  # prefill 4 + a loop that stops when r0 ends (2 steps)
    assert [engine.slots[i].live is None for i in range(4)].count(True) == 1 and len(done) == 1
    assert engine.stats["decode_steps"] == 2 and len(engine.queue) == 1
    engine.step()  # r4 is admitted at once
    assert not engine.queue


def test_samples_of_one_task_prefill_their_prompt_once():
    shared = prompt(3, 40)  # 3 chunks of 16
    reqs = [request(f"sample{i}", shared, 6, 1.0) for i in range(4)]
    alone = [run([r], 16)[0][0] for r in reqs]
    got, engine = run(reqs, 16)
    # the leader prefills 3 chunks; each follower copies 39 tokens and prefills the last one
    assert engine.stats["prefill_chunks"] == 3 + 3
    assert engine.stats["shared_tokens"] == 3 * 39
    for a, g in zip(alone, got):
        np.testing.assert_array_equal(g.tokens, a.tokens)
        np.testing.assert_allclose(g.logprobs, a.logprobs, rtol=0, atol=1e-5)
    assert len({tuple(g.tokens) for g in got}) > 1  # keyed per execution: samples differ


def test_a_resident_prefix_of_a_live_request_is_reused():
    head = prompt(4, 20)
    first = request("first", head, 40, 0.0)
    engine = Engine(dataclasses.replace(SPEC, decode_steps=2), CELLS[0], STATE)
    engine.submit(first)
    engine.step()  # first is live and holds its prompt
    second = request("second", np.concatenate([head, prompt(5, 5)]), 4, 0.0)
    rid = engine.submit(second)
    out = engine.run_until_done()
    assert engine.stats["shared_tokens"] == 20
    alone = run([second], 2)[0][0]
    np.testing.assert_array_equal(out[rid].tokens, alone.tokens)


def test_new_weights_make_resident_prefixes_unusable_as_sources():
    import jax

    head = prompt(6, 20)
    engine = Engine(dataclasses.replace(SPEC, decode_steps=2), CELLS[0], STATE)
    engine.submit(request("old", head, 40, 0.0))
    engine.step()
    engine.set_weights(jax.tree.map(lambda x: x * 1.05, STATE), 1)
    engine.submit(request("new", np.concatenate([head, [1, 2]]), 3, 0.0))
    engine.run_until_done()
    assert engine.stats["shared_tokens"] == 0  # the live request's K/V is the old weights'


@pytest.mark.slow
@pytest.mark.parametrize("kv_block", [0, 24])  # dense, live blocks (their count is data)
def test_nothing_recompiles_as_the_number_of_live_requests_changes(kv_block):
    spec = dataclasses.replace(SPEC, decode_steps=4, kv_block=kv_block)
    engine = Engine(spec, CELLS[2], STATE)
    compiles = compiles_under_varied_load(engine)
    assert engine.stats["shared_tokens"] > 0
    assert compiles == 0, f"{compiles} compilations after warmup"


def test_too_many_stop_tokens_is_refused_by_name():
    engine = Engine(SPEC, CELLS[0], STATE)
    with pytest.raises(ValueError, match="9 stop tokens, at most 8"):
        engine.submit(request("x", prompt(1, 4), 3, stop=tuple(range(9))))


WIDE = {"xla_cpu_prefer_vector_width": 512}


@pytest.mark.parametrize(
    "width,slots,platform,want",
    [
        (-1, 1, "cpu", WIDE),  # auto: one slot's decode dots are matrix-vector products
        (-1, 4, "cpu", {}),  # auto: library kernels from two rows on, XLA's default
        (0, 1, "cpu", {}),
        (256, 4, "cpu", {"xla_cpu_prefer_vector_width": 256}),
        (512, 1, "gpu", {}),  # accelerators get no CPU options
    ],
)
def test_compiler_options_follow_the_vector_width_setting(width, slots, platform, want):
    spec = dataclasses.replace(SPEC, slots=slots, cpu_vector_width=width)
    assert compiler_options(spec, platform) == want


def test_a_vector_width_xla_does_not_know_is_refused_by_name():
    with pytest.raises(ValueError, match="rollout.cpu_vector_width"):
        dataclasses.replace(SPEC, cpu_vector_width=384)
    assert RolloutSpec(SPEC.model).cpu_vector_width == -1


@pytest.mark.slow
def test_one_slot_cell_decodes_with_wide_vectors_exactly():
    # One slot (auto: 512-bit vectors) against XLA's default width and the full forward: the
    # width may reorder float sums, never change what is computed.
    (cell,) = gmesh.make_cells(1, devices=jax.devices()[:1])
    spec = dataclasses.replace(SPEC, slots=1, decode_steps=8)
    assert programs_for(spec, cell).compiler_options == WIDE
    reqs = [request(f"w{i}", prompt(40 + i, 5 + 6 * i), 14, t) for i, t in enumerate((0.0, 1.0))]
    outs = {}
    for width in (-1, 0):
        engine = Engine(dataclasses.replace(spec, cpu_vector_width=width), cell, STATE)
        rids = [engine.submit(r) for r in reqs]
        done = engine.run_until_done()
        outs[width] = [done[r] for r in rids]
    for req, wide, plain in zip(reqs, outs[-1], outs[0]):
        np.testing.assert_array_equal(wide.tokens, plain.tokens)
        np.testing.assert_allclose(wide.logprobs, plain.logprobs, atol=1e-5)
        np.testing.assert_allclose(wide.logprobs, reference_logprobs(req, wide.tokens), atol=1e-4)
        assert wide.tokens.size == 14


@pytest.mark.parametrize(
    "steps,slots,want",
    [
        (-1, 1, ONE_SLOT_DECODE_STEPS),  # auto: a one-slot loop never idles a slot
        (-1, 2, AUTO_DECODE_STEPS),
        (-1, 16, AUTO_DECODE_STEPS),
        (5, 1, 5),  # an explicit value holds for every cell
        (1, 4, 1),
    ],
)
def test_loop_steps_follow_the_setting_and_slots(steps, slots, want):
    assert loop_steps(dataclasses.replace(SPEC, decode_steps=steps, slots=slots)) == want


def test_zero_decode_steps_is_refused_by_name():
    with pytest.raises(ValueError, match="rollout.decode_steps must be -1"):
        dataclasses.replace(SPEC, decode_steps=0)
    cfg = default_config()
    cfg.rollout.decode_steps = 0
    with pytest.raises(ConfigError, match="rollout.decode_steps"):
        build_specs(cfg)


@pytest.mark.slow
def test_one_slot_auto_loop_decodes_a_call_in_two_dispatches_exactly():
    # Auto on a one-slot cell: 64 tokens a loop, so a 100-token call (the prefill samples the
    # first) decodes in 2 loops, idle 0, bit for bit as one token per dispatch (99 loops).
    (cell,) = gmesh.make_cells(1, devices=jax.devices()[:1])
    spec = dataclasses.replace(SPEC, slots=1, max_len=128)
    req = request("a", prompt(90, 9), 100, 1.0)
    outs = {}
    for steps in (1, -1):
        engine = Engine(dataclasses.replace(spec, decode_steps=steps), cell, STATE)
        rid = engine.submit(req)
        outs[steps] = engine.run_until_done()[rid], engine
    (one, one_engine), (auto, auto_engine) = outs[1], outs[-1]
    np.testing.assert_array_equal(auto.tokens, one.tokens)
    np.testing.assert_array_equal(auto.logprobs, one.logprobs)
    assert auto.tokens.size == 100 and auto_engine.decode_steps == ONE_SLOT_DECODE_STEPS
    assert (auto_engine.stats["decode_loops"], one_engine.stats["decode_loops"]) == (2, 99)
    assert auto_engine.stats["decode_idle_slot_steps"] == 0


# max_len 64 = 24 + 24 + 16: the third block is clamped inside the cache
LIVE = dataclasses.replace(SPEC, kv_block=24)


@pytest.mark.slow
def test_live_kv_blocks_decode_exactly():
    # Decode attention over the live blocks only: the loop equals one token per dispatch bit
    # for bit, logprobs equal the full forward, and a request's tokens and logprobs do not
    # depend on which requests (longer or shorter) share its loop, slot or cell.
    assert kv_blocks(LIVE) == (24, 24) and kv_blocks(SPEC) == (128, 0)
    reqs = [request(f"l{i}", prompt(60 + i, 3 + 11 * i), 6 + 4 * i, t)
            for i, t in enumerate((0.0, 1.0, 0.7, 1.0, 0.0))]  # fmt: skip
    one, _ = run(reqs, 1, spec=LIVE)
    loop, _ = run(reqs, 16, spec=LIVE)
    for req, w, g in zip(reqs, one, loop):
        np.testing.assert_array_equal(g.tokens, w.tokens)
        np.testing.assert_array_equal(g.logprobs, w.logprobs)
        np.testing.assert_allclose(g.logprobs, reference_logprobs(req, g.tokens), atol=1e-4)
    alone, _ = run(reqs[:1], 16, cell=1, spec=LIVE)
    np.testing.assert_array_equal(alone[0].tokens, loop[0].tokens)
    np.testing.assert_array_equal(alone[0].logprobs, loop[0].logprobs)


@pytest.mark.parametrize(
    "kv_block,max_len,want",
    [
        (-1, 64, (128, 0)),  # auto: live prefill always; dense decode below 8 blocks
        (-1, 1023, (128, 0)),
        (-1, 1024, (128, 128)),
        (-1, 4096, (128, 128)),
        (0, 4096, (0, 0)),
        (32, 64, (32, 32)),
    ],
)
def test_kv_blocks_follow_the_setting_and_max_len(kv_block, max_len, want):
    assert kv_blocks(dataclasses.replace(SPEC, kv_block=kv_block, max_len=max_len)) == want


def test_a_negative_kv_block_is_refused_by_name():
    with pytest.raises(ValueError, match="rollout.kv_block"):
        dataclasses.replace(SPEC, kv_block=-2)


@pytest.mark.slow
def test_one_slot_cell_decodes_by_live_blocks_exactly():
    # One slot (the multiply-and-sum fold) with live blocks: the loop equals one token per
    # dispatch bit for bit and the logprobs equal the full forward.
    (cell,) = gmesh.make_cells(1, devices=jax.devices()[:1])
    spec = dataclasses.replace(LIVE, slots=1)
    reqs = [request(f"o{i}", prompt(80 + i, 9 + 20 * i), 14, t) for i, t in enumerate((0.0, 1.0))]
    outs = {}
    for steps in (1, 8):
        engine = Engine(dataclasses.replace(spec, decode_steps=steps), cell, STATE)
        rids = [engine.submit(r) for r in reqs]
        done = engine.run_until_done()
        outs[steps] = [done[r] for r in rids]
    for req, one, loop in zip(reqs, outs[1], outs[8]):
        np.testing.assert_array_equal(loop.tokens, one.tokens)
        np.testing.assert_array_equal(loop.logprobs, one.logprobs)
        np.testing.assert_allclose(loop.logprobs, reference_logprobs(req, loop.tokens), atol=1e-4)
        assert loop.tokens.size == 14
