"""The cluster section's checks, and the proxy's recovery of a lost cell's calls: what a
RemoteEngine does when its actor dies, played on in-process engines (no Ray needed; the Ray
runs are tests/test_ray_cluster.py)."""

import asyncio

import numpy as np
import pytest
from rollout_world import CELLS
from test_proxy import drive, make_request, new_proxy, reference

import experiments.quickstart as quickstart
from gyre.cluster.spec import ClusterSpec
from gyre.config import ConfigError, validate
from gyre.rl.builder import build_specs


def test_cluster_spec_and_config_reject_bad_values():
    with pytest.raises(ValueError, match="backend"):
        ClusterSpec(backend="slurm")
    with pytest.raises(ValueError, match="actors must be >= 1"):
        ClusterSpec(backend="ray", actors=0)
    assert ClusterSpec(actors=3, cells_per_actor=2).cells_of(1) == [2, 3]
    cfg = quickstart.get_config("tiny")
    cfg.cluster.backend = "mpi"
    with pytest.raises(ConfigError, match="cluster.backend"):
        validate(cfg)
    cfg = quickstart.get_config("tiny")
    cfg.cluster.backend, cfg.sft.steps = "ray", 10
    with pytest.raises(ConfigError, match="sft.steps=0"):
        build_specs(cfg)
    cfg.sft.steps, cfg.cluster.transfer_timeout_s = 0, 0.0
    with pytest.raises(ConfigError, match="cluster.transfer_timeout_s"):
        validate(cfg)


@pytest.mark.slow
def test_a_lost_cells_calls_finish_on_the_others_with_the_same_tokens():
    """The proxy's side of a lost actor: the calls live there are retried from their record
    elsewhere; keyed sampling makes the same tokens (the lost attempt's tokens are remade)."""
    reqs = [make_request(40 + i, 6 + 7 * i, 24, 1.0) for i in range(6)]
    want = reference(reqs)
    proxy = new_proxy(CELLS[:2])
    lost, orphans = proxy.engines[1], []

    def lose():  # what RemoteEngine does when a call finds its actor dead
        assert lost.num_live, "nothing live on the cell: the test would be vacuous"
        orphans.extend(lost.live_ids())
        lost.lost_calls = lambda: orphans

    got = asyncio.run(drive(proxy, reqs, {3: lose}))
    assert proxy.lost == {1} and 1 not in proxy.rollout
    assert proxy.stats["lost_retried"] == len(orphans) > 0
    assert proxy.take_lost_retried() == len(orphans) and proxy.take_lost_retried() == 0
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g.tokens, w.tokens)
        assert g.finish_reason == w.finish_reason
