"""The cluster section of the config, as the builder hands it to the runtime."""

from __future__ import annotations

import dataclasses

from gyre import bounds

BACKENDS = ("local", "ray")


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """backend: 'local' (every cell in this process) or 'ray' (``actors`` processes of
    ``cells_per_actor`` cells each; actor 0 holds the core cell, index 0). address: Ray's
    ``ray.init`` address ("" = start a local instance). transfer_timeout_s: the deadline of
    every cross-process array move; past it the source's cell is declared lost."""

    backend: str = "local"
    address: str = ""
    actors: int = 2
    cells_per_actor: int = 1
    transfer_timeout_s: float = 120.0

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"ClusterSpec.backend must be one of {BACKENDS}, got {self.backend!r}")
        bounds.check(self, "cluster")

    @property
    def num_cells(self) -> int:
        return self.actors * self.cells_per_actor

    def actor_of(self, cell: int) -> int:
        """The actor that owns cell index ``cell``."""
        return cell // self.cells_per_actor

    def cells_of(self, actor: int) -> list[int]:
        """The cell indices actor ``actor`` owns."""
        return list(range(actor * self.cells_per_actor, (actor + 1) * self.cells_per_actor))
