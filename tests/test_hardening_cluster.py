"""A cluster never hides a lost cell: a late or dead core ends the run with its one line
(no handler that carries on without a cell swallows it), and an actor that cannot start is
named with what it asked for; each phase of a call (start-up, load, compile, transfer, step)
has its own deadline, and a missed one is named. A fake Ray stands in: no processes are
started."""

import collections
import dataclasses
import json
import os
import subprocess
import sys
import types

import pytest

from gyre.cluster import remote
from gyre.cluster.spec import PHASES, ClusterSpec
from gyre.errors import CellLost

STATUS = {"budget": 64, "stats": {}, "live_ids": [7], "num_live": 1, "free_slots": 3,
          "room": 32, "capacity": 1.0, "pool": {}}  # fmt: skip


class GetTimeoutError(Exception):
    pass


class FakeRay:
    """ray.get answers STATUS, or times out for the actors in ``late``. A call on an actor in
    ``slow`` takes that many (simulated) seconds: it times out when its deadline is shorter."""

    exceptions = types.SimpleNamespace(GetTimeoutError=GetTimeoutError, RayTaskError=KeyError,
                                       RayActorError=LookupError, ActorDiedError=LookupError)  # fmt: skip

    def __init__(self):
        self.late, self.killed, self.slow = set(), [], {}

    def get(self, ref, timeout=None):
        actor, what = ref
        if actor in self.late or self.slow.get(actor, 0.0) > timeout:
            raise GetTimeoutError(f"actor {actor} did not answer")
        if what == "info":
            return {"platform": "cpu"}
        if what == "status":
            return {"version": 0, "step": 0, "microbatches_done": 0, "resumed": False}
        return ([], [], STATUS) if what == "step" else {} if what == "load" else STATUS

    def kill(self, actor, no_restart=True):
        self.killed.append(actor.index)

    # what RayCluster's start uses: a running instance, no GPUs, actors made by name
    def is_initialized(self):
        return True

    def cluster_resources(self):
        return {"CPU": 2.0}

    def remote(self, cls):
        return types.SimpleNamespace(options=lambda name, **kw: types.SimpleNamespace(
            remote=lambda *a: FakeActor(int(name.rsplit("-", 1)[1]))))  # fmt: skip

    def shutdown(self):
        pass


class FakeActor:
    def __init__(self, index):
        self.index = index
        self.call = types.SimpleNamespace(remote=lambda method, *a: (index, method))
        self.info = types.SimpleNamespace(remote=lambda: (index, "info"))


def _cluster(actors=2, **deadlines):
    c = object.__new__(remote.RayCluster)
    c.ray, c.spec = FakeRay(), ClusterSpec(backend="ray", actors=actors, **deadlines)
    c.actors = [FakeActor(i) for i in range(actors)]
    c.dead, c.moves, c.started, c.compiled = set(), collections.Counter(), False, set()
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


def _calls(cluster):
    """Calls on cell 1, by the phase each is in: an engine's first resume, warm-up and step
    compile; weights arriving are a transfer; a second step is a step; a checkpoint call a
    load."""
    held = {}
    return [("compile", lambda: held.setdefault("e", _engine(cluster, 1))),
            ("compile", lambda: held["e"].warmup()),
            ("compile", lambda: held["e"].step()),
            ("transfer", lambda: held["e"].set_weights(None, 1)),
            ("step", lambda: held["e"].step()),
            ("step", lambda: held["e"].submit(object(), 9)),
            ("load", lambda: cluster.call(1, "load"))]  # fmt: skip


@pytest.mark.parametrize("phase", [p for p in PHASES if p != "startup"])
def test_a_short_deadline_trips_only_in_its_phase_naming_it(phase, caplog):
    """Every call on cell 1 takes 5 s; only ``phase``'s deadline is 1 s. The calls of the other
    phases pass; the first call of ``phase`` loses the cell with a line naming the phase and
    its key. (Compiles come first: once they are done, a 1 s compile deadline trips nothing.)"""
    cluster = _cluster(**{f"{phase}_timeout_s": 1.0} if phase != "compile" else {})
    cluster.ray.slow[1] = 5.0
    calls = _calls(cluster)
    first = next(i for i, (p, _) in enumerate(calls) if p == phase)
    with caplog.at_level("WARNING", logger="gyre.cluster.remote"):
        for i, (p, call) in enumerate(calls):
            if phase == "compile" and i == 3:  # compiled; the rest must not trip it
                assert not cluster.dead
                cluster.spec = dataclasses.replace(cluster.spec, compile_timeout_s=1.0)
            try:
                call()
            except CellLost:
                pass
            if phase != "compile":
                assert (1 in cluster.dead) == (i >= first), (i, p)  # lost exactly there
                if i == first:
                    break
    if phase == "compile":
        assert not cluster.dead and not caplog.records
        cluster = _cluster(compile_timeout_s=1.0)
        cluster.ray.slow[1] = 5.0
        with caplog.at_level("WARNING", logger="gyre.cluster.remote"):
            with pytest.raises(CellLost):
                _calls(cluster)[0][1]()  # the engine's first resume compiles
    lost = [r.getMessage() for r in caplog.records if "lost" in r.getMessage()]
    assert len(lost) == 1, lost
    assert f"a {phase} call" in lost[0] and f"cluster.{phase}_timeout_s" in lost[0], lost[0]
    assert "took over 1 s" in lost[0] and "\n" not in lost[0]


def test_with_the_default_deadlines_slow_calls_pass_and_a_late_core_names_its_phase():
    cluster = _cluster()
    cluster.ray.slow[1] = 5.0  # well inside every default deadline
    for _, call in _calls(cluster):
        call()
    assert not cluster.dead
    cluster = _cluster(load_timeout_s=1.0)
    cluster.ray.slow[0] = 5.0  # the core's checkpoint read is late: the run ends, saying so
    with pytest.raises(remote.CoreLost, match=r"a load call \(load\) took over 1 s "
                       r"\(cluster.load_timeout_s\).*core cell"):  # fmt: skip
        cluster.call(0, "load")


def test_a_slow_start_trips_the_startup_deadline_naming_it():
    ray = FakeRay()
    ray.slow[1] = 5.0
    actors = [FakeActor(0), FakeActor(1)]
    assert len(remote.wait_started(ray, actors, {}, 10.0)) == 2  # inside its deadline
    with pytest.raises(remote.ActorStartError, match=r"actor 1 .*not started within 1 s "
                       r"\(cluster.startup_timeout_s\)"):  # fmt: skip
        remote.wait_started(ray, actors, {}, 1.0)


def test_phase_deadlines_are_config_keys_refused_when_not_positive():
    import experiments.quickstart as quickstart
    from gyre.config import ConfigError, validate

    cfg = quickstart.get_config("tiny")
    for phase in PHASES:
        assert cfg.cluster[f"{phase}_timeout_s"] > 0
        assert ClusterSpec().deadline(phase) == cfg.cluster[f"{phase}_timeout_s"]
    cfg.cluster.compile_timeout_s = 0.0
    with pytest.raises(ConfigError, match="cluster.compile_timeout_s"):
        validate(cfg)
    with pytest.raises(ValueError, match="cluster.step_timeout_s"):
        ClusterSpec(step_timeout_s=-1.0)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The driver's side of a Ray run up to a built runtime (actors, trainer and engine handles),
# with the fake Ray; then which JAX backends the driver has initialised, and its platforms.
DRIVER = """
import json, os, sys
sys.path[:0] = [{root!r}, os.path.join({root!r}, "tests")]
import test_hardening_cluster as t
sys.modules["ray"] = t.FakeRay()
import experiments.quickstart as quickstart
from gyre import run
from gyre.rl import experiment
cfg = quickstart.get_config("tiny")
cfg.cluster.backend, cfg.mesh.cell_size = "ray", 4
built = experiment.build_runtime

def probe(specs, workdir, params=None):
    built(specs, workdir, params)
    import jax
    from jax._src import xla_bridge
    print("DRIVER", json.dumps({{"backends": sorted(xla_bridge._backends),
                                "platforms": jax.config.jax_platforms}}), flush=True)
    os._exit(0)

experiment.build_runtime = probe
run.main(cfg, {workdir!r})
"""


def test_the_driver_of_a_ray_run_initialises_no_jax_backend(tmp_path):
    """Validation, the workdir, the checkpointer and the actors' handles: none initialises a
    backend in the driver (on a GPU head node one would take device memory beside the actors),
    and the driver is pinned to the CPU platform for anything later."""
    code = DRIVER.format(root=ROOT, workdir=str(tmp_path / "run"))
    out = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    lines = [x for x in out.stdout.splitlines() if x.startswith("DRIVER ")]
    assert out.returncode == 0 and lines, out.stderr[-2000:]
    driver = json.loads(lines[0].split(" ", 1)[1])
    assert driver == {"backends": [], "platforms": "cpu"}, driver
