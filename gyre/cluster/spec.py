"""The cluster section of the config, as the builder hands it to the runtime."""

from __future__ import annotations

import dataclasses

from gyre import bounds

BACKENDS = ("local", "ray")
# The phases a call to an actor is in, each with its own deadline (cluster.<phase>_timeout_s).
PHASES = ("startup", "load", "compile", "transfer", "step")
_POSITIVE = bounds.Bound(0, lo_open=True)


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """backend: 'local' (every cell in this process) or 'ray' (``actors`` processes of
    ``cells_per_actor`` cells each; actor 0 holds the core cell, index 0). address: Ray's
    ``ray.init`` address ("" = start a local instance).

    Deadlines, one per phase of a call to an actor (past one, the call's cell is declared lost,
    or the run ends if it is the core's, with a line naming the phase and its key):
    startup_timeout_s: an actor's start (process, devices, transfer server);
    load_timeout_s: reading or writing a checkpoint (actor 0's initial weights, a save);
    compile_timeout_s: the first call of each program on a cell (an engine's first resume,
    warm-up and step, a cell's first gradient, the first update), which compiles it or loads
    it from the persistent cache;
    transfer_timeout_s: a cross-process array move (weights, gradients, KV rows);
    step_timeout_s: every other call (an engine step, a gradient, an update, a submit).
    """

    backend: str = "local"
    address: str = ""
    actors: int = 2
    cells_per_actor: int = 1
    transfer_timeout_s: float = 120.0
    startup_timeout_s: float = bounds.knob(300.0, _POSITIVE)
    load_timeout_s: float = bounds.knob(600.0, _POSITIVE)
    compile_timeout_s: float = bounds.knob(600.0, _POSITIVE)
    step_timeout_s: float = bounds.knob(120.0, _POSITIVE)

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"ClusterSpec.backend must be one of {BACKENDS}, got {self.backend!r}")
        bounds.check(self, "cluster")

    def deadline(self, phase: str) -> float:
        """The deadline of a call in ``phase`` (one of :data:`PHASES`), in seconds."""
        return getattr(self, f"{phase}_timeout_s")

    @property
    def num_cells(self) -> int:
        return self.actors * self.cells_per_actor

    def actor_of(self, cell: int) -> int:
        """The actor that owns cell index ``cell``."""
        return cell // self.cells_per_actor

    def cells_of(self, actor: int) -> list[int]:
        """The cell indices actor ``actor`` owns."""
        return list(range(actor * self.cells_per_actor, (actor + 1) * self.cells_per_actor))
