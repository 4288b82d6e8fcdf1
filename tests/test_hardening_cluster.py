"""A cluster never hides a lost cell: a late or dead core ends the run with its one line
(no handler that carries on without a cell swallows it), and an actor that cannot start is
named with what it asked for. A fake Ray stands in: no processes are started."""

import collections
import types

import pytest

from gyre.cluster import remote
from gyre.cluster.spec import ClusterSpec
from gyre.errors import CellLost

STATUS = {"budget": 64, "stats": {}, "live_ids": [7], "num_live": 1, "free_slots": 3,
          "room": 32, "capacity": 1.0, "pool": {}}  # fmt: skip


class GetTimeoutError(Exception):
    pass


class FakeRay:
    """ray.get answers STATUS, or times out for the actors in ``late``."""

    exceptions = types.SimpleNamespace(GetTimeoutError=GetTimeoutError, RayTaskError=KeyError,
                                       RayActorError=LookupError, ActorDiedError=LookupError)  # fmt: skip

    def __init__(self):
        self.late, self.killed = set(), []

    def get(self, ref, timeout=None):
        actor, what = ref
        if actor in self.late:
            raise GetTimeoutError(f"actor {actor} did not answer")
        return {"platform": "cpu"} if what == "info" else STATUS

    def kill(self, actor, no_restart=True):
        self.killed.append(actor.index)


class FakeActor:
    def __init__(self, index):
        self.index = index
        self.call = types.SimpleNamespace(remote=lambda method, *a: (index, method))
        self.info = types.SimpleNamespace(remote=lambda: (index, "info"))


def _cluster(actors=2):
    c = object.__new__(remote.RayCluster)
    c.ray, c.spec, c.timeout = FakeRay(), ClusterSpec(backend="ray", actors=actors), 1.0
    c.actors = [FakeActor(i) for i in range(actors)]
    c.dead, c.moves, c.started = set(), collections.Counter(), False
    c.core = c.actors[0]
    return c


def _engine(cluster, cell):
    spec = types.SimpleNamespace(model=types.SimpleNamespace(vocab_size=16), max_len=64)
    return remote.RemoteEngine(cluster, remote.RemoteCell(cell, 1, "cpu"), spec, 0)


def test_a_late_core_during_a_rollout_call_ends_the_run_with_its_line():
    cluster = _cluster()
    core = _engine(cluster, 0)
    cluster.ray.late.add(0)  # the core misses its deadline during a rollout call
    with pytest.raises(Exception) as e:
        core.submit(object(), 8)
    assert not isinstance(e.value, CellLost) and not core.lost  # nobody can swallow it
    line = str(e.value)
    assert "core cell" in line and "relaunch" in line and "\n" not in line
    with pytest.raises(Exception, match="core cell"):  # nor in a step
        core.begin_step()()


def test_a_late_other_cell_is_lost_with_a_warning_and_its_calls_retried(caplog):
    cluster = _cluster()
    other = _engine(cluster, 1)
    cluster.ray.late.add(1)
    with caplog.at_level("WARNING", logger="gyre.cluster.remote"):
        other.submit(object(), 8)
    assert other.lost and other.lost_calls() == [7, 8] and cluster.dead == {1}
    assert "cell 1 lost" in caplog.text and "continues on fewer cells" in caplog.text


def test_an_actor_that_cannot_start_is_named_with_its_request():
    ray = FakeRay()
    ray.late.add(1)
    actors = [FakeActor(0), FakeActor(1)]
    with pytest.raises(RuntimeError) as e:
        remote.wait_started(ray, actors, {"num_gpus": 4}, 5.0)
    line = str(e.value)
    assert "actor 1" in line and remote.actor_name(1) in line and "'num_gpus': 4" in line
    assert "cell 0" not in line and "relaunch" not in line
