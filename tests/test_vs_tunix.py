"""benchmarks/vs_tunix.py: its Gyre side, its flags, the skip without Tunix, and the engine
after Tunix's import flips flax's ``flax_always_shard_variable``."""

import json
import math
import sys

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks import vs_tunix
from gyre import mesh as gmesh
from gyre.model import decoder as gdec
from gyre.model import hf_dir
from gyre.rl.builder import build_specs

PROMPT, NEW = 8, 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(checkpoint folder, quick config, one-device cell): the benchmark's tiny model."""
    folder = str(tmp_path_factory.mktemp("vs_tunix"))
    cfg = vs_tunix.base_config(quick=True)
    (cell,) = gmesh.make_cells(1, devices=jax.devices()[:1])
    assert vs_tunix.write_checkpoint(folder, cfg, cell, seed=0) > 0
    return folder, cfg, cell


@pytest.fixture
def shard_flag():
    """Sets flax's flax_always_shard_variable for a test and restores it afterwards."""
    old = flax.config.flax_always_shard_variable
    yield lambda value: flax.config.update("flax_always_shard_variable", value)
    flax.config.update("flax_always_shard_variable", old)


def greedy_reference(folder, cfg, prompts_BxP, new):
    """Greedy tokens by the full forward of the padded row (no KV cache), one row at a time."""
    spec, state, _ = hf_dir.load(folder, build_specs(cfg).model)
    graphdef = gdec.abstract_model(spec)[0]
    t = prompts_BxP.shape[1] + new

    @jax.jit
    def next_token(tokens_1xT, at):
        model = nnx.merge(graphdef, state)
        hidden = model(tokens_1xT, jnp.arange(t)[None], jnp.full((1, t), t))
        return jnp.argmax(model.logits(hidden)[0, at])

    out = np.zeros((len(prompts_BxP), new), np.int32)
    for b, prompt in enumerate(prompts_BxP):
        row = np.zeros((1, t), np.int32)
        row[0, : prompt.size] = prompt  # causal: the padding after a position changes nothing
        for i in range(new):
            at = prompt.size + i
            row[0, at] = out[b, i] = next_token(row, at - 1)
    return out


@pytest.mark.slow
def test_gyre_side_is_greedy_and_sized_like_the_peer(setup):
    folder, cfg, cell = setup
    prompts = vs_tunix.make_prompts(2, PROMPT, cfg.model.vocab_size, seed=1)
    side = vs_tunix.GyreSide(folder, cfg, cell, 2, PROMPT, NEW)
    assert (side.spec.slots, side.spec.max_len) == (2, PROMPT + NEW)  # = Tunix's cache_size
    whole, again, first = side.run(prompts, NEW), side.run(prompts, NEW), side.run(prompts, 1)
    assert whole.tokens.shape == (2, NEW) and whole.seconds > 0
    np.testing.assert_array_equal(whole.tokens, greedy_reference(folder, cfg, prompts, NEW))
    # a fresh engine per run: the same tokens again, nothing reused from the run before
    np.testing.assert_array_equal(again.tokens, whole.tokens)
    np.testing.assert_array_equal(first.tokens, whole.tokens[:, :1])


@pytest.mark.slow
def test_engine_works_whichever_way_the_flax_flag_flips(setup, shard_flag):
    """Weights loaded under one value of flax_always_shard_variable, the engine's programs
    built under the other (Tunix's import sets it to False): same greedy tokens."""
    folder, cfg, cell = setup
    prompts = vs_tunix.make_prompts(4, PROMPT, cfg.model.vocab_size, seed=2)
    want = greedy_reference(folder, cfg, prompts, NEW)
    for before, after, batch in ((True, False, 3), (False, True, 4)):  # new batch: new programs
        shard_flag(before)
        side = vs_tunix.GyreSide(folder, cfg, cell, batch, PROMPT, NEW)
        shard_flag(after)
        np.testing.assert_array_equal(side.run(prompts[:batch], NEW).tokens, want[:batch])


@pytest.mark.slow
def test_weights_and_shardings_agree_whatever_the_flax_flag(setup, shard_flag):
    """Importing Tunix flips flax's flax_always_shard_variable; parameters fix their
    eager_sharding metadata, so trees made under either value have one structure."""
    folder, cfg, cell = setup
    shard_flag(True)
    spec, state, _ = hf_dir.load(folder, build_specs(cfg).model)
    shard_flag(False)
    target = vs_tunix.gdec.state_shardings(spec, cell, "rollout")
    assert jax.tree.structure(state) == jax.tree.structure(target)
    moved = gmesh.move(state, target)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(moved)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_skips_with_a_message_when_tunix_is_absent(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tunix", None)  # import tunix now raises ImportError
    figures = vs_tunix.main(["--quick"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and "pip install google-tunix" in lines[0]
    assert json.loads(lines[-1]) == figures and "skipped" in figures


def test_flags(monkeypatch, capsys):
    args = vs_tunix.parse_args([])
    assert (args.batches, args.prompts, args.new, args.runs) == ((1, 8, 32), (64, 512), 128, 3)
    args = vs_tunix.parse_args(["--quick", "--batches", "2,3", "--new", "5"])
    assert (args.batches, args.prompts, args.new) == ((2, 3), (32,), 5)
    assert vs_tunix.parse_args(["--decode-steps", "4"]).decode_steps == 4
    for bad, flag in (
        (["--batches", "0"], "--batches"),
        (["--prompts", "64,x"], "--prompts"),
        (["--new", "1,2"], "--new"),
        (["--runs", "-1"], "--runs"),
    ):
        with pytest.raises(SystemExit):
            vs_tunix.parse_args(bad)
        assert flag in capsys.readouterr().err
    # an engine without RolloutSpec.decode_steps: the flag is refused, naming the field
    monkeypatch.setattr(vs_tunix, "_spec_fields", lambda: {"slots", "max_len"})
    with pytest.raises(SystemExit):
        vs_tunix.parse_args(["--decode-steps", "4"])
    assert "decode_steps" in capsys.readouterr().err
    assert vs_tunix.parse_args([]).decode_steps is None  # without the flag it still runs


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_match_length_is_the_first_difference_of_the_worst_row(data):
    b, n = data.draw(st.integers(1, 5)), data.draw(st.integers(0, 9))
    a = np.array(data.draw(st.lists(st.integers(0, 3), min_size=b * n, max_size=b * n)))
    a = a.reshape(b, n).astype(np.int32)
    c = a.copy()
    cuts = data.draw(st.lists(st.integers(0, n), min_size=b, max_size=b))
    for row, cut in enumerate(cuts):
        if cut < n:
            c[row, cut] += 1  # the first difference of this row
    assert vs_tunix.match_length(a, c) == min(cuts)
    assert vs_tunix.match_length(a, a) == n
    with pytest.raises(ValueError, match="shape"):
        vs_tunix.match_length(a, a[:, :-1] if n else np.zeros((b, 1)))


def test_the_batch_one_floor_multiplies_by_every_weight_matrix_of_the_model():
    cfg = vs_tunix.base_config(quick=True)
    m = cfg.model
    _, state = gdec.abstract_model(build_specs(cfg).model)
    want = [math.prod(state["layers"][k].shape) for k in ("q", "k", "v", "o", "gate", "up", "down")]
    want += [math.prod(state["embed"].shape)]  # the head: [V, D] tied or [D, V]
    got = [math.prod(s) for s in vs_tunix.matvec_shapes(m)]
    # every layer's matrices (the stacked [L, ...] parameters hold all layers) and the head
    layers = [sum(got[i::7][: m.num_layers]) for i in range(7)]
    assert layers + [got[-1]] == want and len(got) == 7 * m.num_layers + 1
    for options in ({}, {"xla_cpu_prefer_vector_width": 512}):  # XLA's and Gyre's one-slot
        floor = vs_tunix.matvec_floor(m, runs=1, tokens=4, options=options)
        assert np.isfinite(floor) and floor > 0
