"""The cluster section's checks, and the proxy's recovery of a lost cell's calls: what a
RemoteEngine does when its actor dies, played on in-process engines (no Ray needed; the Ray
runs are tests/test_ray_cluster.py)."""

import asyncio
import collections

import jax
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


class InProcessCluster:
    """What a RemoteEngine asks of RayCluster, over CellWorkers in this process (one per actor,
    each with its own transfer server): the worker code of a Ray actor, called directly. The
    weights come from a third transfer point standing for the core's."""

    def __init__(self, specs, workers, state):
        from gyre.cluster.remote import RayCluster
        from gyre.cluster.transfer import TransferPoint

        self.spec, self.workers, self.state = specs.cluster, workers, state
        self.core_point = TransferPoint()
        self.moves = collections.Counter()
        self.compiled = set()
        self.phase_of = RayCluster.phase_of.__get__(self)

    def call(self, cell, method, *args):
        return getattr(self.workers[self.spec.actor_of(cell)], method)(*args)

    def remote(self, cell, method, *args):
        return self.call(cell, method, *args)  # done at once: get() hands it back

    def get(self, ref, cell, phase="step", what=""):
        return ref

    def weights(self, cell, role):
        from gyre.cluster.worker import Offer

        self.moves[f"weights_{role}"] += 1
        leaves = tuple((x.shape, x.dtype.str) for x in jax.tree.leaves(self.state))
        return Offer(self.core_point.offer(self.state), leaves)


def test_kv_rows_migrate_between_two_actors_at_a_hand_over_and_tokens_continue_exactly():
    """Two actors' workers (cells 1 and 2, each its own transfer server) serve through
    RemoteEngines under the proxy; mid-generation cell 1 leaves rollout ('migrate'): its live
    requests' KV rows are offered by actor 1 and pulled by actor 2, which continues them. The
    tokens and log-probabilities equal those of one cell that never handed anything over."""
    from rollout_world import STATE, tiny_spec
    from test_proxy import run

    from gyre.cluster.remote import RemoteCell, RemoteEngine
    from gyre.cluster.worker import CellWorker
    from gyre.config import default_config
    from gyre.rollout.proxy import Proxy

    cfg = default_config()
    m = cfg.model
    m.d_model, m.num_layers, m.d_ff, m.num_heads, m.num_kv_heads, m.head_dim = 32, 2, 64, 2, 2, 16
    m.attention = "dense"
    cfg.rollout.slots, cfg.rollout.max_len, cfg.rollout.prefill_chunk = 4, 64, 16
    cfg.rollout.decode_steps = 2
    cfg.mesh.cell_size, cfg.sft.steps = 2, 0
    cfg.cluster.backend, cfg.cluster.actors = "ray", 3
    specs = build_specs(cfg)
    assert specs.rollout == tiny_spec()  # the reference's engine, exactly
    workers = {a: CellWorker(specs, "", a) for a in (1, 2)}  # (actor 0, the core: not needed)
    assert workers[1].address() != workers[2].address()
    cluster = InProcessCluster(specs, workers, STATE)
    engines = [RemoteEngine(cluster, RemoteCell(i, 2, "cpu"), specs.rollout, 0) for i in (1, 2)]
    proxy = Proxy(engines)

    reqs = [make_request(i, 6 + 9 * i, 20, 1.0) for i in range(4)]
    want = reference(reqs)
    counts, live = {}, []

    def hand_over():
        live.extend(engines[0].live_ids())
        counts.update(proxy.release(1, "migrate"))  # actor 1's cell leaves rollout

    got = run(drive(proxy, reqs, {4: hand_over}))
    assert counts == {"migrated": 2} and len(live) == 2, (counts, live)  # mid-generation
    # the rows crossed through the transfer service: offered by actor 1, pulled by actor 2
    assert cluster.moves["kv_rows"] == 2
    assert workers[1].transfer_stats()["offers"] == 2
    pulls = workers[2].transfer_stats()
    assert pulls["pulls"] == 2 + 1 and pulls["pulled_bytes"] > 0  # the rows, and its weights
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g.tokens, w.tokens)
        np.testing.assert_array_equal(g.logprobs, w.logprobs)
        assert g.finish_reason == w.finish_reason
