"""The batch schema: fields, padding, metric kinds and objectives are declared once and read by
the packer, the padder, the loss and the trainer; a new per-token loss input is a field in the
schema plus a loss that reads it, and nothing else."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from strategies import branchy_execution
from worlds import small_config, train_world

from gyre.train import loss as tloss
from gyre.train.step import Trainer, TrainerSpec, split_microbatches
from gyre.trajectory import schema
from gyre.trajectory.batch import ExecutionResult, build_batch

# one xdist worker runs the module: its module fixtures are built once, not on both
pytestmark = [
    pytest.mark.xdist_group("schema"),
    pytest.mark.filterwarnings("ignore:Some donated buffers were not usable"),
]


@pytest.fixture(scope="module")
def world():
    return train_world(small_config(lr=1e-4))


def _demos(n=3):
    return [
        ExecutionResult(branchy_execution(s, n_calls=4, vocab=16, execution_id=f"d{s}"), f"d{s}")
        for s in range(n)
    ]


def test_weighted_fields_pad_with_zero_and_padding_rows_are_isolated_roots():
    for f in schema.fields():
        if f.weighted:  # context and padding carry no weight
            assert f.pad == 0, f.name
    pad = schema.empty(2, 6)
    assert list(pad) == list(schema.FIELDS)
    np.testing.assert_array_equal(pad["leave"], np.tile(np.arange(1, 7), (2, 1)))
    assert (pad["pred"] == -1).all() and (pad["w"] == 0).all()
    for name, arr in pad.items():
        assert arr.dtype == schema.FIELDS[name].dtype, name


def test_every_loss_metric_has_a_kind_and_undeclared_ones_are_refused():
    logp = jnp.full((1, 3), -1.0)
    batch = {"old_logp": logp, "adv_pos": jnp.ones((1, 3)), "adv_neg": jnp.zeros((1, 3)),
             "w": jnp.ones((1, 3)), "versions": jnp.zeros((1, 3), jnp.int32)}  # fmt: skip
    _, ppo = tloss.policy_loss(logp, logp, batch, tloss.LossSpec(), 1)
    _, sft = tloss.sft_loss(logp, logp, batch)
    for key in [*ppo, *sft]:
        assert schema.metric_kind(key) in (schema.SUM, schema.MEAN, schema.COUNT, schema.MAX)
    with pytest.raises(KeyError, match="declare it in METRICS"):
        tloss.combine_metrics([{"loss": 1.0, "surprise": 2.0}])


def test_objectives_have_a_batch_side_and_a_loss_and_unknown_ones_are_refused(world):
    specs, *_ = world
    assert set(schema.OBJECTIVES) == set(tloss.LOSSES) == {"ppo", "sft"}
    with pytest.raises(ValueError, match="objective must be one of"):
        build_batch(_demos(1), specs.trajectory, "dpo")
    with pytest.raises(ValueError, match="objective must be one of"):
        TrainerSpec(specs.model, objective="dpo")


def _is_call_end(seg: schema.Segment) -> np.ndarray:
    return np.isin(seg.nodes, seg.tree.call_end).astype(np.int32)


def _end_nll(logp, entropy, batch, spec, version_now, ref_logp):
    """Cross-entropy on the last token of each call only (w-weighted)."""
    end_w = batch["w"] * (batch["call_end"] > 0)
    loss = -jnp.sum(end_w * logp)
    return loss, {"loss": loss, "w_sum": jnp.sum(end_w), "end_nll": loss}


@pytest.mark.slow
@pytest.mark.parametrize("packing", ["tree", "flat"])
def test_a_new_per_token_input_flows_from_the_packer_to_the_loss(world, monkeypatch, packing):
    """Everything a new input needs: one Field (schema), a loss reading it and its metric's
    kind (schema METRICS, loss LOSSES), an objective naming that loss. Registered here in-test;
    in the code it is the same lines in gyre/trajectory/schema.py and gyre/train/loss.py."""
    specs, cells, graphdef, params = world
    # -1 pads, so the padder's value is told apart from a packed 0
    field = schema.Field("call_end", np.int32, -1, True, _is_call_end)
    monkeypatch.setitem(schema.FIELDS, "call_end", field)
    monkeypatch.setitem(schema.METRICS, "end_nll", schema.SUM)
    monkeypatch.setitem(
        schema.OBJECTIVES, "end_nll", schema.Objective("end_nll", schema.DEMONSTRATED)
    )
    monkeypatch.setitem(tloss.LOSSES, "end_nll", tloss.ObjectiveLoss(_end_nll))

    demos = _demos()
    traj = dataclasses.replace(specs.trajectory, max_paths=0, loss_mode="token-mean",
                               packing=packing)  # fmt: skip
    batch, report = build_batch(demos, traj, "end_nll", buckets=(1,))
    # pack: the field holds each token's value; padding positions hold the field's padding
    real = batch.exec_index >= 0
    ends = [set(np.asarray(tr.call_end).tolist()) for tr in _trees(demos, report)]
    want = [int(n in ends[e]) for e, n in zip(batch.exec_index[real], batch.node_index[real])]
    np.testing.assert_array_equal(batch.call_end[real], want)
    assert (batch.call_end[~real] == -1).all() and (batch.call_end[real] == 1).any()

    # pad: an odd row count leaves a padding row in the last micro-batch
    rows = batch.tokens.shape[0]
    if rows % 2 == 0:  # make it odd: a batch's rows may be any count
        batch = schema.PackedBatch({k: v[:-1] for k, v in batch.items()})
    mbs = split_microbatches(batch, 2)
    assert set(mbs[0].arrays) == set(schema.device_names()) and "call_end" in mbs[0].arrays
    assert (mbs[-1].arrays["call_end"][-1] == -1).all()

    # loss: the new objective's gradient = cross-entropy with the end-of-call mask applied on
    # the host, which the 'sft' objective computes from w alone
    trainer = Trainer(dataclasses.replace(specs.trainer, objective="end_nll"), cells[:1],
                      graphdef, params)  # fmt: skip
    reference = Trainer(dataclasses.replace(specs.trainer, objective="sft"), cells[:1],
                        graphdef, params)  # fmt: skip
    got, want_res = [], []
    for mb in mbs:
        masked = dict(mb.arrays, w=mb.arrays["w"] * (mb.arrays["call_end"] > 0))
        want_res.append(reference.compute_grads(cells[0], dataclasses.replace(mb, arrays=masked)))
        got.append(trainer.compute_grads(cells[0], mb))
    g_sum, w_sum = trainer.sum_grads(got), reference.sum_grads(want_res)
    for a, b in zip(jax.tree.leaves(g_sum), jax.tree.leaves(w_sum)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    metrics = tloss.combine_metrics([jax.device_get(r.metrics) for r in got])
    want_loss = tloss.combine_metrics([jax.device_get(r.metrics) for r in want_res])["loss"]
    assert metrics["end_nll"] == metrics["loss"] == pytest.approx(want_loss, rel=1e-6)
    assert metrics["end_nll"] > 0


def _trees(demos, report):
    from gyre.trajectory.tree import build_tree

    return [build_tree(demos[i].records) for i in report.used]
