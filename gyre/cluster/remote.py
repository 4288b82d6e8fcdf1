"""Cells as Ray actors: the same controller, proxy and policy over handles to other processes.

``--config.cluster.backend=ray`` starts ``cluster.actors`` actors (or joins a running cluster
at ``cluster.address``). Each is one single-process JAX owning ``cluster.cells_per_actor``
cells of ``mesh.cell_size`` devices (a :class:`~gyre.cluster.worker.CellWorker`); actor 0
holds the core cell and the optimizer. The driver keeps the controller's one asyncio loop and
talks to the actors through two handles with the in-process interfaces:

- :class:`RemoteEngine` is what the proxy sees of a rollout cell (submit, step, export,
  import_, weights, pool figures). Every call returns the engine's new status, so the
  proxy's routing reads a mirror that is exact (the engine changes only on the driver's
  calls). ``begin_step`` lets every rollout actor run its step at once.
- :class:`RemoteTrainer` is what the controller sees of the trainer (version, gradients,
  the update, checkpoints). Weights are named by version (:class:`WeightsRef`); they move
  core -> cell only when a cell needs them.

Every cross-process array move goes through the transfer service (gyre/cluster/transfer.py).
Every call to an actor has a deadline the driver enforces, by its phase (:meth:`RayCluster.
phase_of`; ``cluster.<phase>_timeout_s``): startup (an actor's start), load (a checkpoint read
or written), compile (a program's first call on a cell), transfer (an array move) and step
(any other call). A call that finds its actor dead, or one past its deadline, loses the cell
(a line names the phase and its key): the actor is ended, its live model
calls are retried on the other rollout cells from their exact token records, a micro-batch it
was computing is queued again, and the run continues on fewer cells (the controller's
``proxy.lost``). Losing the core cell ends the run with one line; a relaunch resumes from the
last checkpoint.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os

import jax

from gyre.cluster.spec import PHASES
from gyre.errors import CellLost
from gyre.rollout.engine import footprint
from gyre.train.step import GradResult

log = logging.getLogger(__name__)


class CoreLost(RuntimeError):
    """The core cell's actor (the optimizer) is lost or late: the run ends with this one line.
    Not a CellLost, so no handler that carries on without a cell (the proxy's, the
    controller's, an inert RemoteEngine) can swallow it."""


class ActorStartError(RuntimeError):
    """An actor that could not start (placement, devices): names it and what it asked for."""


@dataclasses.dataclass(frozen=True)
class WeightsRef:
    """The core's weights of one version (the remote trainer's ``params``)."""

    version: int


@dataclasses.dataclass(frozen=True)
class RemoteCell:
    """A cell in an actor: its index (0 = core), device count and platform."""

    index: int
    size: int
    platform: str


def _ray():
    try:
        import ray
    except ImportError as e:  # an optional extra
        raise ImportError(
            "cluster.backend=ray needs Ray: pip install -r requirements-ray.txt"
        ) from e
    return ray


def _actor_class(ray):
    class CellActor:
        """A Ray actor holding one CellWorker (gyre/cluster/worker.py)."""

        def __init__(self, specs, workdir: str, actor: int, devices: int, cache_dir: str,
                     make_trainer):  # fmt: skip
            jax.config.update("jax_num_cpu_devices", devices)  # CPU only; before any backend
            import warnings

            warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
            if cache_dir:
                from gyre.mesh import enable_compilation_cache

                enable_compilation_cache(cache_dir)
            from gyre.cluster.worker import CellWorker

            self.worker = CellWorker(specs, workdir, actor, ray.util.get_node_ip_address(),
                                     make_trainer)  # fmt: skip
            self.platform = jax.devices()[0].platform

        def call(self, method: str, *args):
            return getattr(self.worker, method)(*args)

        def info(self) -> dict:
            return {"platform": self.platform, "address": self.worker.address()}

    return ray.remote(CellActor)


# The phase of a call by its method; the first call of a COMPILING method on a cell is in
# 'compile' (it compiles that cell's program, or loads it from the persistent cache).
LOAD_CALLS = frozenset({"load", "save", "close"})
TRANSFER_CALLS = frozenset({"offer_weights", "offer_grads", "take_grads", "host_params",
                            "export", "import_", "set_weights", "resume"})  # fmt: skip
COMPILING = frozenset({"resume", "warmup", "step", "compute_grads", "apply_parts"})


def keep_driver_off_accelerators() -> bool:
    """Pins this process (the driver) to JAX's CPU platform when no backend is initialised
    yet -> whether it did. The actors own the accelerators; the driver needs none (it holds
    handles and host data), and a backend it initialised on a GPU head node would take device
    memory beside them. Process-local: the actors, started by Ray, are not affected."""
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():  # e.g. a test's in-process run: leave it
        return False
    jax.config.update("jax_platforms", "cpu")
    return True


def actor_name(actor: int) -> str:
    """The Ray name of actor ``actor`` (``ray.get_actor(actor_name(1))`` finds it)."""
    return f"gyre-cell-actor-{actor}"


class RayCluster:
    """The actors of one run and the driver's side of every call to them. ``make_trainer``:
    how actor 0 builds the trainer (:class:`~gyre.cluster.worker.CellWorker`)."""

    def __init__(self, specs, workdir: str, make_trainer):
        ray = self.ray = _ray()
        keep_driver_off_accelerators()
        cl = self.spec = specs.cluster
        self.compiled: set[tuple[int, str]] = set()  # (cell, method) called once already
        self.started = not ray.is_initialized()
        if self.started:
            env = {"XLA_FLAGS": _without_device_count(os.environ.get("XLA_FLAGS", ""))}
            ray.init(address=cl.address or None, include_dashboard=False, logging_level="ERROR",
                     log_to_driver=False, runtime_env={"env_vars": env})  # fmt: skip
        gpus = ray.cluster_resources().get("GPU", 0)
        devices = cl.cells_per_actor * specs.mesh.cell_size
        opts = {"num_gpus": devices} if gpus else {"num_cpus": 0}
        cache = jax.config.jax_compilation_cache_dir or ""
        cls = _actor_class(ray)
        self.actors = [cls.options(name=actor_name(a), max_restarts=0, **opts)
                       .remote(specs, workdir, a, devices, cache, make_trainer if a == 0 else None)
                       for a in range(cl.actors)]  # fmt: skip
        self.dead: set[int] = set()  # actor indices
        self.moves = collections.Counter()  # cross-process moves the driver ordered, by kind
        try:
            infos = wait_started(ray, self.actors, opts, cl.startup_timeout_s)
            self.core = self.actors[0]
            self.call(0, "load")  # the trainer, under the load deadline
        except BaseException:
            for actor in self.actors:  # nothing of a run that could not start stays up
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:  # noqa: BLE001 - never started
                    pass
            if self.started:
                ray.shutdown()
            raise
        self.platform = infos[0]["platform"]

    # ------------------------------------------------------------------ calls

    def actor_of(self, cell: int):
        return self.actors[self.spec.actor_of(cell)]

    def remote(self, cell: int, method: str, *args):
        """Starts ``method`` on cell ``cell``'s worker -> an object ref (see :meth:`get`)."""
        a = self.spec.actor_of(cell)
        if a in self.dead:
            raise CellLost(cell, "its actor was lost earlier")
        return self.actors[a].call.remote(method, *args)

    def phase_of(self, cell: int, method: str) -> str:
        """The phase of a call of ``method`` on cell ``cell`` (one of PHASES, each with its
        deadline); counts a first call, so ask once per call."""
        if method in LOAD_CALLS:
            return "load"
        if method in COMPILING and (cell, method) not in self.compiled:
            self.compiled.add((cell, method))
            return "compile"
        return "transfer" if method in TRANSFER_CALLS else "step"

    def get(self, ref, cell: int, phase: str = "step", what: str = ""):
        """The result of ``ref``, a call on (or a transfer from) cell ``cell`` in ``phase``
        (``what``: its method, for the message); raises CellLost (CoreLost for the core's)
        when that cell's actor is dead or the call outlives its phase's deadline, and the
        call's own exception otherwise (one line, as in-process)."""
        assert phase in PHASES, phase
        ray = self.ray
        timeout = self.spec.deadline(phase)
        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.RayTaskError as e:
            if not self.alive(cell):
                raise self.lose(cell, "its actor died during a call") from None
            cause = getattr(e, "cause", None)
            raise (cause if isinstance(cause, BaseException) else e) from None
        except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError):
            raise self.lose(cell, "its actor died") from None
        except ray.exceptions.GetTimeoutError:
            call = f" ({what})" if what else ""
            raise self.lose(cell, f"a {phase} call{call} took over {timeout:g} s "
                                  f"(cluster.{phase}_timeout_s)") from None  # fmt: skip

    def call(self, cell: int, method: str, *args):
        ref = self.remote(cell, method, *args)
        return self.get(ref, cell, self.phase_of(cell, method), method)

    def alive(self, cell: int) -> bool:
        a = self.spec.actor_of(cell)
        if a in self.dead:
            return False
        try:
            self.ray.get(self.actors[a].info.remote(), timeout=self.spec.step_timeout_s)
            return True
        except Exception:  # noqa: BLE001 - any failure to answer is a dead actor
            return False

    def lose(self, cell: int, why: str) -> CellLost | CoreLost:
        """Ends cell ``cell``'s actor (every cell it holds is lost) -> the error to raise (the
        core's: CoreLost, which ends the run)."""
        a = self.spec.actor_of(cell)
        if a == 0:
            return CoreLost(f"cell {cell} lost: {why}; it holds the core cell (the optimizer): "
                            "relaunch the same command to resume from the last checkpoint")  # fmt: skip
        if a not in self.dead:
            self.dead.add(a)
            log.warning("cell %d lost: %s; the run continues on fewer cells", cell, why)
            try:
                self.ray.kill(self.actors[a], no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        return CellLost(cell, why)

    # ------------------------------------------------------------------ moves

    def weights(self, cell: int, role: str):
        """What ``cell`` installs ``role`` weights from: None on the core's own actor (an
        in-process move there), else the core's offer of them."""
        if self.spec.actor_of(cell) == 0:
            return None
        self.moves[f"weights_{role}"] += 1
        return self.call(0, "offer_weights", role)

    def host_params(self):
        return self.call(0, "host_params")

    def transfer_stats(self) -> dict:
        """Pulls done by every live actor, and the moves the driver ordered (equal when every
        cross-process move went through the transfer service)."""
        pulls = collections.Counter()
        for a in range(len(self.actors)):
            if a not in self.dead:  # (a lost actor's pulls are lost with it)
                try:
                    cell = self.spec.cells_of(a)[0]
                    pulls.update(self.call(cell, "transfer_stats"))
                except CellLost:
                    pass
        return {"moves": dict(self.moves), "moves_total": sum(self.moves.values()),
                "pulls": pulls.get("pulls", 0), "pulled_bytes": pulls.get("pulled_bytes", 0),
                "lost_actors": sorted(self.dead)}  # fmt: skip

    def close(self) -> None:
        for a, actor in enumerate(self.actors):
            if a not in self.dead:
                try:
                    self.ray.get(actor.call.remote("close"), timeout=self.spec.load_timeout_s)
                except Exception:  # noqa: BLE001 - closing: report nothing more
                    pass
                self.ray.kill(actor, no_restart=True)
        if self.started:
            self.ray.shutdown()


def wait_started(ray, actors, request: dict, timeout: float) -> list[dict]:
    """Every actor's info once it has started -> [info]; an actor that cannot (no placement
    for its resource request, no devices, a failing constructor) is an ActorStartError naming
    it and its request, not a lost cell 0."""
    refs = [a.info.remote() for a in actors]
    infos = []
    for i, ref in enumerate(refs):
        try:
            infos.append(ray.get(ref, timeout=timeout))
        except Exception as e:  # noqa: BLE001 - any failure to start, named below
            cause = getattr(e, "cause", None) or e
            why = (str(cause).strip().splitlines() or [type(cause).__name__])[-1][:300]
            if isinstance(e, ray.exceptions.GetTimeoutError):
                why = f"not started within {timeout:g} s (cluster.startup_timeout_s): {why}"
            raise ActorStartError(f"actor {i} ({actor_name(i)}) could not start, asking for "
                                  f"{request}: {why}") from None  # fmt: skip
    return infos


def _without_device_count(flags: str) -> str:
    """XLA_FLAGS minus a forced host device count (each actor sets its own)."""
    return " ".join(f for f in flags.split() if "xla_force_host_platform_device_count" not in f)


_DEAD_POOL = {"budget_tokens": 0, "reserved_tokens": 0, "resident_tokens": 0,
              "resident_contexts": 0, "live_contexts": 0, "idle_contexts": 0, "queued": 0,
              "capacity_contexts": 0.0}  # fmt: skip


class RemoteEngine:
    """The proxy's view of a rollout cell in an actor (the in-process Engine's interface).

    Reads come from the status every call returns. When the actor is lost, the engine turns
    inert (no slots, no room) and ``orphans`` holds the call ids that were live there; the
    proxy retries them elsewhere (gyre/rollout/proxy.py).
    """

    def __init__(self, cluster: RayCluster, cell: RemoteCell, spec, version: int):
        self.cluster, self.cell = cluster, cell
        self.vocab_size, self.max_len = spec.model.vocab_size, spec.max_len
        self.on_admit = None
        self.weights = self.cache = None  # on the actor
        self.lost, self.orphans = False, []
        self.stats: dict = {}
        self._status = self._call("resume", cluster.weights(cell.index, "rollout"), version)
        self.budget = self._status["budget"]

    def _call(self, method: str, *args):
        out = self.cluster.call(self.cell.index, method, self.cell.index, *args)
        self._mirror(out if method not in ("step", "export") else out[-1])
        return out

    def _mirror(self, status: dict) -> None:
        self._status = status
        self.stats = collections.Counter(status["stats"])

    def _lose(self, extra=()) -> None:
        if not self.lost:
            self.lost = True
            self.orphans = [*self._status["live_ids"], *extra]
            self._status = dict(self._status, num_live=0, free_slots=0, room=0, live_ids=[],
                                capacity=0.0, pool=_DEAD_POOL)  # fmt: skip

    def lose(self) -> None:
        """Found lost elsewhere (a gradient call on the same actor)."""
        self._lose()

    def lost_calls(self) -> list[int] | None:
        return list(self.orphans) if self.lost else None

    def wait_ready(self) -> None:
        """Every actor call returns once its work is done: nothing to wait for here."""

    def _guarded(self, method: str, *args, extra=()):
        """A call that turns this engine inert (instead of raising) when its actor is lost."""
        if self.lost:
            return None
        try:
            return self._call(method, *args)
        except CellLost:
            self._lose(extra)
            return None

    # ------------------------------------------------------------------ the mirror

    @property
    def num_live(self) -> int:
        return self._status["num_live"]

    def free_slots(self) -> int:
        return self._status["free_slots"]

    def room(self) -> int:
        return self._status["room"]

    def live_ids(self) -> list[int]:
        return list(self._status["live_ids"])

    def can_admit(self, request) -> bool:
        return self.free_slots() > 0 and footprint(request, self.max_len) <= self.room()

    def capacity_contexts(self) -> float:
        return self._status["capacity"]

    def pool(self) -> dict:
        return dict(self._status["pool"])

    def prefix_hit_rate(self) -> float:
        return self.stats.get("reused_tokens", 0) / max(1, self.stats.get("prompt_tokens", 0))

    # ------------------------------------------------------------------ calls

    def submit(self, request, rid: int) -> int:
        self._guarded("submit", request, rid, extra=(rid,))
        return rid

    def begin_step(self):
        """Starts this cell's step on its actor -> finish() -> [(rid, response)] (every rollout
        actor steps at once; the proxy collects in cell order)."""
        if self.lost:
            return lambda: []
        cl, i = self.cluster, self.cell.index
        try:
            ref = cl.remote(i, "step", i)
        except CellLost:
            self._lose()
            return lambda: []
        phase = cl.phase_of(i, "step")

        def finish():
            try:
                done, admitted, status = cl.get(ref, i, phase, "step")
            except CellLost:
                self._lose()
                return []
            self._mirror(status)
            if self.on_admit is not None:
                for rid in admitted:
                    self.on_admit(rid)
            return done

        return finish

    def step(self):
        return self.begin_step()()

    def cancel(self, rid: int) -> None:
        self._guarded("cancel", rid)

    def export(self, rid: int):
        """Raises CellLost when the actor is gone (the proxy then retries what was live)."""
        if self.lost:
            raise CellLost(self.cell.index, "lost earlier")
        try:
            exp, _ = self._call("export", rid)
        except CellLost:
            self._lose()
            raise
        if exp.rows is not None:
            self.cluster.moves["kv_rows"] += 1
        return exp

    def import_(self, exp) -> None:
        # lost here: the request is this engine's orphan (its partial tokens went with the rows)
        self._guarded("import_", exp, extra=(exp.live.rid,))

    def suspend(self) -> None:
        self._guarded("suspend")

    def resume(self, state: WeightsRef, version: int) -> None:
        """Back into rollout with the core's current weights (``state`` names their version)."""
        if not self.lost:
            self._guarded("resume", self.cluster.weights(self.cell.index, "rollout"), version)

    def set_weights(self, state, version: int) -> None:
        if self.lost:
            return
        self._guarded("set_weights", self.cluster.weights(self.cell.index, "rollout"), version)

    def warmup(self) -> None:
        self._guarded("warmup")


class RemoteTrainer:
    """The controller's view of the trainer on actor 0 (the in-process Trainer's interface):
    version counters mirrored here, ``params`` a :class:`WeightsRef`, gradients held in the
    actors and pulled to the core as soon as they are computed."""

    def __init__(self, cluster: RayCluster):
        self.cluster = cluster
        self._mirror(cluster.call(0, "status"))
        self.train_versions: dict[int, int] = {}  # cell -> weights version it holds for 'train'

    def _mirror(self, status: dict) -> None:
        self.version, self.step = status["version"], status["step"]
        self.microbatches_done = status["microbatches_done"]
        self.resumed = status["resumed"]

    @property
    def params(self) -> WeightsRef:
        return WeightsRef(self.version)

    def compute_grads(self, cell, mb) -> GradResult:
        """Raises CellLost when ``cell``'s actor is lost (the controller queues ``mb`` again)."""
        cl, i = self.cluster, cell.index
        offer = None
        if cl.spec.actor_of(i) != 0 and self.train_versions.get(i) != self.version:
            offer = cl.weights(i, "train")
        key, metrics, ids = cl.call(i, "compute_grads", i, mb, self.version, offer)
        self.train_versions[i] = self.version
        if cl.spec.actor_of(i) != 0:  # to the core now: a later loss of cell i loses nothing
            grads = cl.call(i, "offer_grads", key)
            cl.moves["grads"] += 1
            try:
                cl.call(0, "take_grads", key, grads)
            except CellLost as e:
                if e.cell == 0 or cl.alive(i):
                    raise
                raise cl.lose(i, "its gradient transfer failed") from None
        self.microbatches_done += 1
        return GradResult(key, metrics, i, ids)

    def apply_parts(self, parts, counts):
        rows = [(part, r.grads, r.metrics, r.cell_index, r.exec_ids) for part, r in parts]
        outcome, status = self.cluster.call(0, "apply_parts", rows, counts)
        done = self.microbatches_done
        self._mirror(status)
        self.microbatches_done = done  # the core counts only its own
        return outcome

    def save(self, checkpointer, metadata: dict | None = None, wait: bool = False) -> None:
        self.cluster.call(0, "save", metadata or {}, self.microbatches_done, wait)
