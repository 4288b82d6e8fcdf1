"""Checkpoints: a resumed run (on another cell layout) continues like the uninterrupted one."""

import jax
import numpy as np
import pytest
from test_train_step import step_batch
from worlds import small_config

from gyre.mesh import make_cells
from gyre.model import decoder
from gyre.rl.builder import build_specs
from gyre.train.checkpoint import Checkpointer
from gyre.train.step import Trainer, TrainingDiverged

pytestmark = pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _run(trainer, specs, cells, steps):
    return [trainer.train_step(cells, *step_batch(specs, s)).metrics["loss"] for s in steps]


@pytest.mark.slow
def test_resume_on_another_layout_matches_the_uninterrupted_run(tmp_path):
    specs = build_specs(small_config())
    cells = make_cells(2)[:2]  # two train cells of 2 devices
    graphdef, params = decoder.init_sharded(specs.model, 0, cells[0], "train")
    straight = Trainer(specs.trainer, cells, graphdef, params)
    want = _run(straight, specs, cells, range(4))

    first = Trainer(specs.trainer, cells, graphdef, params)
    got = _run(first, specs, cells, range(2))
    ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=2)
    first.save(ckpt, {"note": "half-way", "queue": [1, 2]})  # asynchronous
    ckpt.wait()

    other = make_cells(1)[:1]  # one cell of 1 device: another count and size
    resumed, meta = Trainer.restore(specs.trainer, other, graphdef, ckpt)
    assert meta == {"note": "half-way", "queue": [1, 2]}
    assert (resumed.step, resumed.version) == (2, 2)
    assert resumed.microbatches_done == first.microbatches_done == 4
    np.testing.assert_array_equal(jax.random.key_data(resumed.rng), jax.random.key_data(first.rng))
    for a, b in zip(_leaves(resumed.params), _leaves(first.params)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(_leaves(resumed.opt_state), _leaves(first.opt_state)):
        np.testing.assert_array_equal(a, b)
    assert jax.tree.leaves(resumed.params)[0].sharding.mesh == other[0].mesh
    got += _run(resumed, specs, other, range(2, 4))
    # same losses; only the reduction order of the new layout may differ in the last bits
    np.testing.assert_allclose(got, want, rtol=2e-6)
    for a, b in zip(_leaves(resumed.params), _leaves(straight.params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    ckpt.close()


@pytest.mark.slow
def test_divergence_leaves_the_last_good_checkpoint_intact(tmp_path):
    cfg = small_config()
    cfg.train.max_bad_steps = 2
    specs = build_specs(cfg)
    cells = make_cells(2)[:1]
    graphdef, params = decoder.init_sharded(specs.model, 1, cells[0], "train")
    trainer = Trainer(specs.trainer, cells, graphdef, params)
    ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=1)
    trainer.train_step(cells, *step_batch(specs, 0))
    trainer.save(ckpt)
    good = _leaves(trainer.params)
    bad, names = step_batch(specs, 1)
    bad.adv_pos[...] = np.where(bad.w > 0, np.inf, 0.0)  # non-finite advantages
    with pytest.raises(TrainingDiverged):
        for _ in range(3):
            if trainer.train_step(cells, bad, names).applied:
                trainer.save(ckpt)
    assert ckpt.all_steps() == [1]
    restored, _ = Trainer.restore(specs.trainer, cells, graphdef, ckpt)
    for a, b in zip(_leaves(restored.params), good):
        np.testing.assert_array_equal(a, b)
    ckpt.close()


def test_restore_without_checkpoint_is_a_clear_error(tmp_path):
    specs = build_specs(small_config())
    cells = make_cells(2)[:1]
    graphdef, _ = decoder.abstract_model(specs.model)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        Trainer.restore(specs.trainer, cells, graphdef, Checkpointer(str(tmp_path / "none")))


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncate_arrays", "break_metadata"])
def test_an_unreadable_newest_checkpoint_is_skipped_with_a_warning(tmp_path, caplog, damage):
    specs = build_specs(small_config())
    cells = make_cells(2)[:1]
    graphdef, params = decoder.init_sharded(specs.model, 2, cells[0], "train")
    trainer = Trainer(specs.trainer, cells, graphdef, params)
    ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=2)
    trainer.train_step(cells, *step_batch(specs, 0))
    trainer.save(ckpt, wait=True)
    good = _leaves(trainer.params)
    trainer.train_step(cells, *step_batch(specs, 1))
    trainer.save(ckpt, wait=True)
    assert ckpt.all_steps() == [1, 2]
    newest = tmp_path / "ckpt" / "2"
    files = sorted(p for p in newest.rglob("*") if p.is_file())
    if damage == "truncate_arrays":  # every array file cut short, as a kill mid-copy would
        targets = [p for p in files if "params" in p.parts and p.stat().st_size > 0]
    else:  # the metadata files are garbage
        targets = [p for p in files if "meta" in p.parts or p.name.endswith("metadata")]
    assert targets, files
    for p in targets:
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 3])
    with caplog.at_level("WARNING", logger="gyre.train.checkpoint"):
        restored, _ = Trainer.restore(
            specs.trainer, cells, graphdef, Checkpointer(str(tmp_path / "ckpt"))
        )
    assert restored.step == 1
    for a, b in zip(_leaves(restored.params), good):
        np.testing.assert_array_equal(a, b)
    # ours only: orbax may warn too on a loaded machine ("Waiting for previous save ...")
    (line,) = [r.getMessage() for r in caplog.records if r.name == "gyre.train.checkpoint"]
    assert "checkpoint 2" in line and "unreadable" in line and "resuming from step 1" in line
    ckpt.close()
