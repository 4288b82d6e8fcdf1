"""Rollout engine: exact logprobs, identity-keyed sampling, prefix reuse, weight updates."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from oracles import token_logprobs
from rollout_world import CELLS, GRAPHDEF, SPEC, STATE

from gyre import mesh as gmesh
from gyre.rollout import sampler
from gyre.rollout.engine import Engine, common_prefix
from gyre.rollout.types import GenerateRequest


def make_request(i, prompt_len, new, temperature=1.0, stop=(), seed=0):
    prompt = np.random.default_rng(seed * 1000 + i).integers(0, 64, prompt_len).astype(np.int32)
    return GenerateRequest(f"exec{i}", i, prompt, new, tuple(stop), temperature)


def run_alone(cell, requests, state=STATE, spec=SPEC):
    engine = Engine(spec, cell, state)
    rids = [engine.submit(r) for r in requests]
    out = engine.run_until_done()
    return [out[r] for r in rids], engine


@jax.jit
def full_forward_logits(state, tokens_1xT):
    """Trainer-style forward: decoder __call__ on a causal row (leave = T), then the head."""
    model = nnx.merge(GRAPHDEF, state)
    t = tokens_1xT.shape[1]
    hidden = model(tokens_1xT, jnp.arange(t)[None], jnp.full((1, t), t))
    return model.logits(hidden)


def reference_logprobs(request, tokens, state=STATE):
    """Logprobs of ``tokens`` after ``request.prompt`` by the full forward (one padded shape)."""
    full = np.concatenate([request.prompt, tokens])
    t = full.size
    padded = np.zeros((1, SPEC.max_len), np.int32)
    padded[0, :t] = full  # causal: the padding after t changes nothing before it
    logits = np.asarray(full_forward_logits(state, padded))[0]
    p = request.prompt.size
    return token_logprobs(logits[p - 1 : t - 1], tokens, request.temperature)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_equal_full_forward(temperature):
    reqs = [make_request(i, 5 + 7 * i, 12, temperature) for i in range(5)]  # 5 > 4 slots
    outs, _ = run_alone(CELLS[0], reqs)
    for req, out in zip(reqs, outs):
        assert out.tokens.size == 12 and out.finish_reason == "length"
        np.testing.assert_allclose(out.logprobs, reference_logprobs(req, out.tokens), atol=1e-4)
        assert (out.versions == 0).all()
    if temperature == 0.0:  # greedy picks the argmax: its logprob is the row maximum
        assert all((out.logprobs > np.log(1 / 64)).all() for out in outs)


def test_sampling_independent_of_slot_batch_and_cell():
    target = make_request(7, 20, 15, 1.0)
    alone, _ = run_alone(CELLS[0], [target])
    crowd = [make_request(i, 3 + i, 9, 1.0, seed=1) for i in range(3)]
    together, _ = run_alone(CELLS[1], crowd + [target])  # other slot, batch and cell
    np.testing.assert_array_equal(alone[0].tokens, together[-1].tokens)
    np.testing.assert_array_equal(alone[0].logprobs, together[-1].logprobs)
    other = make_request(8, 20, 15, 1.0)  # another identity draws other tokens
    other = GenerateRequest(other.execution_id, 8, target.prompt, 15, (), 1.0)
    assert not np.array_equal(run_alone(CELLS[0], [other])[0][0].tokens, alone[0].tokens)


def test_stop_token_and_cache_capacity():
    req = make_request(1, 10, 40, 0.0)
    first, _ = run_alone(CELLS[0], [req])
    stop = int(first[0].tokens[3])
    cut = GenerateRequest(req.execution_id, req.call_id, req.prompt, 40, (stop,), 0.0)
    out, _ = run_alone(CELLS[0], [cut])
    k = int(np.flatnonzero(first[0].tokens == stop)[0])
    np.testing.assert_array_equal(out[0].tokens, first[0].tokens[: k + 1])
    assert out[0].finish_reason == "stop"
    long = make_request(2, 60, 40, 0.0)  # 60 + 40 > max_len 64: capped at the cache
    out, _ = run_alone(CELLS[0], [long])
    assert out[0].tokens.size == 4 and out[0].finish_reason == "length"


def test_bad_input_is_a_clear_error_and_engine_keeps_serving():
    engine = Engine(SPEC, CELLS[0], STATE)
    good = engine.submit(make_request(0, 6, 5))
    with pytest.raises(ValueError, match="exec1.*does not fit the cache"):
        engine.submit(make_request(1, 64, 5))
    bad_vocab = GenerateRequest("exec2", 2, np.array([1, 64], np.int32), 5)
    with pytest.raises(ValueError, match="exec2.*outside the vocabulary"):
        engine.submit(bad_vocab)
    assert engine.run_until_done()[good].tokens.size == 5


def test_prefix_reuse_matches_cold_prefill_and_rewinds():
    first = make_request(3, 21, 10, 1.0)
    warm = Engine(SPEC, CELLS[0], STATE)
    warm.submit(first)
    turn1 = warm.run_until_done()[0]
    warm.warmup()  # compiles ahead of use; must not touch any slot's cached tokens
    observation = np.array([5, 9, 11], np.int32)
    prompt2 = np.concatenate([first.prompt, turn1.tokens, observation])
    second = GenerateRequest("exec3", 4, prompt2, 10, (), 1.0)
    rid = warm.submit(second)
    out_warm = warm.run_until_done()[rid]
    assert warm.stats["reused_tokens"] == first.prompt.size + turn1.tokens.size - 1
    out_cold, cold = run_alone(CELLS[0], [second])
    assert cold.stats["reused_tokens"] == 0
    np.testing.assert_array_equal(out_warm.tokens, out_cold[0].tokens)
    np.testing.assert_allclose(out_warm.logprobs, out_cold[0].logprobs, atol=1e-5)
    # a retry resuming from an earlier point of the same slot rewinds it
    retry = GenerateRequest("exec3", 5, prompt2[:25], 6, (), 1.0)
    rid = warm.submit(retry)
    out_retry = warm.run_until_done()[rid]
    assert warm.stats["reused_tokens"] == first.prompt.size + turn1.tokens.size - 1 + 24
    np.testing.assert_array_equal(out_retry.tokens, run_alone(CELLS[0], [retry])[0][0].tokens)
    assert 0 < warm.prefix_hit_rate() < 1


def test_set_weights_mid_request_keeps_it_and_records_versions():
    req = make_request(4, 9, 12, 1.0)
    plain, _ = run_alone(CELLS[0], [req])
    new_state = jax.tree.map(lambda x: x * 1.05, STATE)
    engine = Engine(SPEC, CELLS[0], STATE)
    engine.submit(req)
    for _ in range(4):  # prefill + first decodes at version 0
        engine.step()
    engine.set_weights(new_state, 1)
    out = engine.run_until_done()[0]
    n0 = int((out.versions == 0).sum())
    assert out.tokens.size == 12 and 0 < n0 < 12
    assert (out.versions[:n0] == 0).all() and (out.versions[n0:] == 1).all()
    np.testing.assert_array_equal(out.tokens[:n0], plain[0].tokens[:n0])
    assert not np.allclose(out.logprobs[n0:], plain[0].logprobs[n0:])


def test_common_prefix():
    a = np.array([1, 2, 3, 4])
    assert common_prefix(a, np.array([1, 2, 9])) == 2
    assert common_prefix(a, a[:3]) == 3
    assert common_prefix(a, np.zeros(0, np.int64)) == 0


@pytest.mark.slow
@pytest.mark.parametrize("kv_block", [0, 24])  # dense; live blocks (gyre/rollout/programs.py)
def test_model_parallel_cell_shards_kv_heads_and_agrees(kv_block):
    (mp_cell,) = gmesh.make_cells(2, model_parallel=2, devices=jax.devices()[6:])
    req = make_request(5, 13, 8, 1.0)
    spec = dataclasses.replace(SPEC, kv_block=kv_block)
    dp_out, dp = run_alone(CELLS[0], [req], spec=spec)
    mp_out, mp = run_alone(mp_cell, [req], spec=spec)
    k_dp, k_mp = dp.cache["k"][0], mp.cache["k"][0]  # one layer's K [S, KVH, Dh, M]
    v_dp, v_mp = dp.cache["v"][0], mp.cache["v"][0]  # and V [S, KVH, M, Dh]
    assert len(dp.cache["k"]) == 2 and k_dp.shape == (4, 2, 16, 64)
    assert k_dp.sharding.shard_shape(k_dp.shape) == (2, 2, 16, 64)  # slots over data
    assert k_mp.sharding.shard_shape(k_mp.shape) == (4, 1, 16, 64)  # kv heads over model
    assert v_dp.sharding.shard_shape(v_dp.shape) == (2, 2, 64, 16)
    assert v_mp.sharding.shard_shape(v_mp.shape) == (4, 1, 64, 16)
    rows = mp.programs.read_rows(mp.cache, np.int32(0))  # one slot, as a migration reads it
    assert rows["k"][0].sharding.shard_shape(rows["k"][0].shape) == (1, 1, 16, 64)
    assert rows["v"][0].sharding.shard_shape(rows["v"][0].shape) == (1, 1, 64, 16)
    np.testing.assert_array_equal(rows["k"][0][0], k_mp[0])
    np.testing.assert_array_equal(mp_out[0].tokens, dp_out[0].tokens)
    np.testing.assert_allclose(mp_out[0].logprobs, dp_out[0].logprobs, atol=1e-5)


SAMPLE = jax.jit(sampler.sample, static_argnums=3)


def test_sampler_top_p_greedy_and_row_independence():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]] * 3, np.float32))
    keys = sampler.token_keys(sampler.base_key(0), np.arange(3), np.zeros(3), np.full(3, 9))
    temp = np.array([1.0, 1.0, 0.0], np.float32)
    tok, lp = SAMPLE(logits, keys, temp, 0.7)  # nucleus {0, 1}: renormalised 5/8, 3/8
    assert set(np.asarray(tok[:2]).tolist()) <= {0, 1} and int(tok[2]) == 0
    want = np.log(np.where(np.asarray(tok[:2]) == 0, 5 / 8, 3 / 8))
    np.testing.assert_allclose(lp[:2], want, rtol=1e-5)
    np.testing.assert_allclose(lp[2], np.log(0.5), rtol=1e-5)  # greedy: temperature-1 logprob
    draws = [SAMPLE(logits[:1], keys[i : i + 1], temp[:1], 1.0) for i in range(2)]
    full_tok, full_lp = SAMPLE(logits, keys, temp, 1.0)
    for i, (t, lp1) in enumerate(draws):  # a row samples the same alone or in a batch
        assert int(t[0]) == int(full_tok[i]) and float(lp1[0]) == float(full_lp[i])


def test_new_weights_never_reuse_a_prefix_cached_under_old_weights():
    req = make_request(6, 20, 8, 1.0)
    new_state = jax.tree.map(lambda x: x * 1.05, STATE)
    engine = Engine(SPEC, CELLS[0], STATE)
    engine.submit(req)
    engine.run_until_done()
    engine.set_weights(new_state, 1)
    again = GenerateRequest(req.execution_id, 7, req.prompt, 8, (), 1.0)
    rid = engine.submit(again)
    out = engine.run_until_done()[rid]
    fresh, _ = run_alone(CELLS[0], [again], new_state)
    assert engine.stats["reused_tokens"] == 0
    np.testing.assert_array_equal(out.tokens, fresh[0].tokens)
    np.testing.assert_allclose(out.logprobs, fresh[0].logprobs, atol=1e-5)
