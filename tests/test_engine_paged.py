"""The paged KV cache (rollout.kv_page > 0): tokens and logprobs equal the slot layout's,
rows stay batch-invariant bit for bit, prompts are shared by reference (bytes measured),
hand-over moves only a request's pages, and nothing recompiles as page counts change."""

import asyncio
import dataclasses

import numpy as np
import pytest
from rollout_world import CELLS, SPEC, STATE, compiles_under_varied_load, prompt, request
from test_engine import reference_logprobs

from gyre.rollout.engine import Engine, paged_pool_pages
from gyre.rollout.proxy import Proxy

PAGE = 16
PAGED = dataclasses.replace(SPEC, kv_page=PAGE)
# the slot layout reading its cache in live blocks of 128 (at most max_len, 64 here): the
# arithmetic of the paged cache, which reads blocks of 128 entries (4 pages here), bit for bit
SLOTS = dataclasses.replace(SPEC, kv_block=128)


def run(requests, spec=PAGED, cell=0, check=True):
    engine = Engine(spec, CELLS[cell], STATE)
    rids = [engine.submit(r) for r in requests]
    out = {}
    while engine.num_live:
        out.update(engine.step())
        if engine.paged and check:
            engine.kv.check()
    return [out[r] for r in rids], engine


MIXED = [request(f"p{i}", prompt(60 + i, 3 + 9 * i), 6 + 4 * i, t)
         for i, t in enumerate((0.0, 1.0, 0.7, 1.0, 0.0, 1.0))]  # fmt: skip


def test_paged_equals_the_slot_layout_bit_for_bit_and_the_full_forward():
    paged, engine = run(MIXED)  # 6 requests on 4 slots: two wait, pages are reused
    slots, _ = run(MIXED, SLOTS)
    dense, _ = run(MIXED, SPEC)  # today's default (dense decode, prefill blocks of 128)
    for req, p, s, d in zip(MIXED, paged, slots, dense):
        np.testing.assert_array_equal(p.tokens, s.tokens)
        np.testing.assert_array_equal(p.logprobs, s.logprobs)
        np.testing.assert_array_equal(p.tokens, d.tokens)
        np.testing.assert_allclose(p.logprobs, d.logprobs, rtol=0, atol=1e-5)
        np.testing.assert_allclose(p.logprobs, reference_logprobs(req, p.tokens), atol=1e-4)
    pool = engine.pool()
    assert pool["page_size"] == PAGE and pool["pages"] == 16  # 4 x 64 tokens: the slots' memory
    # idle contexts keep whole pages of their length only
    held = sum(-(-s.length // PAGE) for s in engine.slots)
    assert pool["pages_used"] == held and engine.kv_bytes() == held * engine.programs.page_bytes


@pytest.mark.slow
def test_paged_rows_are_batch_invariant_the_loop_equals_one_step_and_pages_change_nothing():
    one, _ = run(MIXED, dataclasses.replace(PAGED, decode_steps=1))
    loop, _ = run(MIXED, dataclasses.replace(PAGED, decode_steps=16))
    alone, _ = run(MIXED[3:4], cell=1)  # another cell, slot and batch
    # pages of 32: blocks of 2 pages, not 4, and the same arithmetic, bit for bit
    wide, _ = run(MIXED, dataclasses.replace(PAGED, kv_page=32))
    for w, g, p in zip(one, loop, wide):
        np.testing.assert_array_equal(g.tokens, w.tokens)
        np.testing.assert_array_equal(g.logprobs, w.logprobs)
        np.testing.assert_array_equal(p.tokens, w.tokens)
        np.testing.assert_array_equal(p.logprobs, w.logprobs)
    np.testing.assert_array_equal(alone[0].tokens, one[3].tokens)
    np.testing.assert_array_equal(alone[0].logprobs, one[3].logprobs)


def test_a_pool_smaller_than_the_slots_evicts_and_still_agrees():
    small = dataclasses.replace(PAGED, kv_tokens=96)  # 6 pages for 4 slots of 64 tokens
    head = prompt(7, 20)
    reqs = [request(f"s{i}", np.concatenate([head, prompt(8 + i, 5)]), 8, 1.0) for i in range(6)]
    got, engine = run(reqs, small)
    want, _ = run(reqs, SLOTS)
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g.tokens, w.tokens)
        np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=0, atol=1e-5)
    assert engine.budget == 96 and engine.stats["evictions"] > 0
    assert engine.stats["shared_tokens"] > 0  # the common head, by reference


def test_eight_samples_of_a_1024_token_prompt_hold_it_once():
    page, p = 64, 1024
    spec = dataclasses.replace(SPEC, slots=8, max_len=p + page, prefill_chunk=128, kv_page=page,
                               decode_steps=1)  # fmt: skip
    shared = prompt(11, p)
    reqs = [request(f"sample{i}", shared, 1, 1.0) for i in range(8)]
    engine = Engine(spec, CELLS[0], STATE)
    rids = [engine.submit(r) for r in reqs]
    done = dict(engine.step())  # admits all eight and prefills: one computes the prompt
    used = engine.kv.used_pages
    bytes_per_page = engine.programs.page_bytes
    # each sample holds 16 pages; the 15 full pages of its first 1023 tokens (the last token
    # is always prefilled, so its page is copied on write) are held once, by reference
    refs = engine.kv.refs
    assert (refs == 8).sum() == p // page - 1 and used == 16 + 7 * 1
    assert engine.kv_bytes() == used * bytes_per_page
    one_copy = 8 * (p // page) * bytes_per_page  # without sharing: eight copies
    print(f"KV bytes: {engine.kv_bytes()} shared vs {one_copy} copied")
    assert engine.kv_bytes() < one_copy / 5
    assert engine.stats["shared_tokens"] == 7 * (p - 1)
    out = {**done, **engine.run_until_done()}
    alone, _ = run(reqs[5:6], spec, check=False)
    np.testing.assert_array_equal(out[rids[5]].tokens, alone[0].tokens)
    np.testing.assert_allclose(out[rids[5]].logprobs, alone[0].logprobs, rtol=0, atol=1e-5)


def test_hand_over_moves_only_the_request_s_pages():
    req = request("h", prompt(21, 30), 20, 1.0)
    (want,), _ = run([req])
    src = Engine(PAGED, CELLS[0], STATE)
    src.submit(req)
    for _ in range(3):  # prefill and a few decode loops
        src.step()
    length = next(s.length for s in src.slots if s.live is not None)
    exp = src.export(src.live_ids()[0])
    n = -(-length // PAGE)
    assert exp.rows["k"][0].shape == (n, 2, 16, PAGE) and exp.rows["v"][0].shape == (n, 2, PAGE, 16)
    moved = sum(x.nbytes for x in exp.rows["k"] + exp.rows["v"])
    assert moved == n * src.programs.page_bytes  # the context's pages, no more
    dst = Engine(PAGED, CELLS[1], STATE)
    dst.submit(request("other", prompt(22, 9), 3))  # pages already in use there
    dst.step()
    dst.import_(exp)
    dst.kv.check()
    out = dst.run_until_done()
    got = out[exp.live.rid]
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.logprobs, want.logprobs)


def test_an_idle_context_moves_with_its_pages_only():
    first = request("ctx", prompt(41, 37), 9, 1.0)
    (out0,), ref = run([first])  # the reference: the context stays on its cell
    follow = request("ctx", np.concatenate([first.prompt, out0.tokens, prompt(42, 6)]), 7,
                     1.0, call=1)  # fmt: skip
    ref.submit(follow)
    want = ref.run_until_done()[1]
    src = Engine(PAGED, CELLS[0], STATE)
    src.submit(first)
    src.run_until_done()
    length = next(s.length for s in src.slots if s.owner == "ctx")
    assert src.export_context("nobody") is None
    exp = src.export_context("ctx")
    n = -(-length // PAGE)
    assert exp.held.size == length and exp.rows["v"][0].shape == (n, 2, PAGE, 16)
    moved = sum(x.nbytes for x in exp.rows["k"] + exp.rows["v"])
    assert moved == n * src.programs.page_bytes  # the context's pages, no more
    assert src.kv.used_pages == 0 and src.stats["evictions"] == 0  # a move, not an eviction
    src.kv.check()
    dst = Engine(PAGED, CELLS[1], STATE)
    dst.submit(request("other", prompt(43, 20), 3))  # pages already in use there
    dst.run_until_done()
    used = dst.kv.used_pages
    assert dst.can_import_context(exp)
    dst.import_context(exp)
    dst.kv.check()
    assert dst.kv.used_pages == used + n and dst.pool()["idle_contexts"] == 2
    rid = dst.submit(follow)
    got = dst.run_until_done()[rid]
    assert dst.stats["reused_tokens"] == length  # the moved context served its prompt
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.logprobs, want.logprobs)
    stale = src.export_context("ctx")
    assert stale is None  # gone from the source
    dst.set_weights(STATE, 1)
    again = Engine(PAGED, CELLS[2], STATE)
    again.submit(first)
    again.run_until_done()
    old = again.export_context("ctx")
    assert not dst.can_import_context(old)  # K/V of other weights: never installed


def test_proxy_migrates_paged_requests_exactly():
    reqs = [request(f"m{i}", prompt(30 + i, 20), 30) for i in range(3)]
    proxy = Proxy([Engine(PAGED, CELLS[c], STATE) for c in range(2)])
    counts = {}

    async def main():
        tasks = [asyncio.create_task(proxy.generate(r)) for r in reqs]
        await asyncio.sleep(0)
        for k in range(500):
            if all(t.done() for t in tasks):
                return [t.result() for t in tasks]
            if k == 4:
                counts.update(proxy.release(0, "migrate"))
            proxy.pump()
            await asyncio.sleep(0)

    got = asyncio.run(main())
    want, _ = run(reqs)
    assert counts.get("migrated", 0) >= 1
    assert proxy.stats["contexts_migrated"] + proxy.stats["contexts_dropped"] == 0  # none idle
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g.tokens, w.tokens)
        np.testing.assert_array_equal(g.logprobs, w.logprobs)


def test_release_moves_idle_contexts_and_the_next_call_reuses_them():
    proxy = Proxy([Engine(PAGED, CELLS[c], STATE) for c in range(2)])
    firsts = [request(f"e{i}", prompt(50 + i, 12 + 5 * i), 5) for i in range(3)]

    async def serve(reqs):
        tasks = [asyncio.create_task(proxy.generate(r)) for r in reqs]
        await asyncio.sleep(0)
        for _ in range(500):
            if all(t.done() for t in tasks):
                return [t.result() for t in tasks]
            proxy.pump()
            await asyncio.sleep(0)
        raise AssertionError("calls still live after 500 pumps")

    outs = asyncio.run(serve(firsts))
    gone = [r for r in firsts if proxy.affinity[r.execution_id] == 0]
    proxy.release(0, "migrate")  # the executions are between calls: their contexts are idle
    follows = [request(r.execution_id, np.concatenate([r.prompt, o.tokens, prompt(60, 4)]), 4,
                       call=1) for r, o in zip(firsts, outs)]  # fmt: skip
    reused = proxy.engines[1].stats["reused_tokens"]
    asyncio.run(serve(follows))
    assert gone and proxy.stats["contexts_migrated"] == len(gone)
    assert proxy.engines[1].stats["contexts_imported"] == len(gone)
    # every follow-up call reused its whole previous context, the moved ones included
    assert proxy.engines[1].stats["reused_tokens"] - reused == sum(
        r.prompt.size + 5 - 1 for r in firsts
    )


@pytest.mark.slow
def test_nothing_recompiles_as_live_requests_and_page_counts_change():
    spec = dataclasses.replace(PAGED, decode_steps=4, kv_tokens=160)  # 10 pages: evictions
    engine = Engine(spec, CELLS[2], STATE)

    def rewind(engine):  # into a shared page
        engine.submit(request("g0", prompt(99, 30)[:21], 4, call=1))
        engine.run_until_done()

    compiles = compiles_under_varied_load(engine, rewind)
    assert engine.stats["shared_tokens"] > 0 and engine.stats["evictions"] > 0
    assert compiles == 0, f"{compiles} compilations after warmup"


def test_page_count_from_kv_tokens_memory_or_slots():
    assert paged_pool_pages(PAGED, CELLS[0]) == 4 * 64 // PAGE  # CPU: the slot layout's memory
    assert paged_pool_pages(dataclasses.replace(PAGED, kv_tokens=100), CELLS[0]) == 6  # whole
    # pages, a multiple of the cell's 2 data shards

    class Device:
        def memory_stats(self):
            return {"bytes_limit": 10**9}

    big = paged_pool_pages(PAGED, CELLS[0], [Device(), Device()])
    per_token = 2 * 2 * 2 * 16 * 4  # k and v, 2 layers, 2 kv heads, head dim 16, float32
    assert big % 2 == 0 and abs(big * PAGE - 2 * 0.9e9 / per_token) < 0.01 * big * PAGE
    with pytest.raises(ValueError, match="multiple of rollout.kv_page"):
        dataclasses.replace(SPEC, kv_page=24)
