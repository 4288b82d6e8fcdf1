"""Cells and role layouts on 8 fake devices: bit-exact moves, clear errors."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gyre import mesh
from gyre.config import ConfigError

LOGICAL = {"embed": ("vocab", "embed"), "mlp": ("embed", "mlp"), "norm": (None,)}


def _tree(seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    return {
        "embed": jax.random.normal(k[0], (16, 8)),
        "mlp": jax.random.normal(k[1], (8, 32)),
        "norm": jax.random.normal(k[2], (8,)),
    }


def test_cells_are_equal_disjoint_slices():
    cells = mesh.make_cells(cell_size=2)
    assert len(cells) == 4
    seen = [d.id for c in cells for d in c.devices]
    assert sorted(seen) == list(range(8))
    assert all(c.mesh.axis_names == mesh.AXES and c.mesh.devices.shape == (2, 1) for c in cells)
    cells = mesh.make_cells(cell_size=4, model_parallel=2)
    assert [c.mesh.devices.shape for c in cells] == [(2, 2), (2, 2)]


def test_indivisible_cell_size_is_clear():
    with pytest.raises(ConfigError, match="mesh.cell_size"):
        mesh.make_cells(cell_size=3)
    with pytest.raises(ConfigError, match="mesh.model_parallel"):
        mesh.make_cells(cell_size=2, model_parallel=4)


def test_indivisible_array_layout_is_clear():
    cell = mesh.make_cells(cell_size=4)[0]
    with pytest.raises(ConfigError, match=r"\['embed'\]: dimension 6 is not divisible"):
        mesh.tree_shardings(
            cell, "train", {"embed": ("vocab", "embed")}, {"embed": jnp.zeros((4, 6))}
        )


def test_role_rules_differ():
    cell = mesh.make_cells(cell_size=4, model_parallel=2)[0]
    train = mesh.sharding_for(cell, "train", ("embed", "mlp"))
    roll = mesh.sharding_for(cell, "rollout", ("embed", "mlp"))
    assert train.spec == jax.sharding.PartitionSpec("data", "model")
    assert roll.spec == jax.sharding.PartitionSpec(None, "model")
    with pytest.raises(ValueError, match="no rule"):
        mesh.logical_to_spec(("bogus",), "train")


@pytest.mark.parametrize("cell_size,mp", [(2, 1), (2, 2), (4, 2)])
def test_moves_are_bit_exact_between_every_cell_and_role(cell_size, mp):
    cells = mesh.make_cells(cell_size, mp)
    host = jax.tree.map(np.asarray, _tree())
    layouts = list(itertools.product(cells, mesh.ROLES))
    src_cell, src_role = layouts[0]
    current = mesh.move(host, mesh.tree_shardings(src_cell, src_role, LOGICAL, host))
    for (c1, r1), (c2, r2) in itertools.product(layouts, layouts):
        a = mesh.move(current, mesh.tree_shardings(c1, r1, LOGICAL, host))
        b = mesh.move(a, mesh.tree_shardings(c2, r2, LOGICAL, host))
        for name in host:
            assert b[name].sharding.device_set == set(c2.devices)
            np.testing.assert_array_equal(np.asarray(b[name]), host[name])


def test_compilation_cache_dir(tmp_path):
    old = jax.config.jax_compilation_cache_dir
    try:
        path = mesh.enable_compilation_cache(str(tmp_path))
        assert jax.config.jax_compilation_cache_dir == path
    finally:
        jax.config.update("jax_compilation_cache_dir", old)
