"""What the controller (gyre/rl/controller.py) needs of the parts it schedules.

Each part has two implementations, one in this process and one in Ray actors
(gyre/cluster/remote.py); the controller sees only these declarations. The serving side's
per-engine interface is :class:`gyre.rollout.types.ServingEngine`, reached through the proxy.
"""

from __future__ import annotations

from typing import Protocol


class Trainer(Protocol):
    """Gradients on any train cell, the update on the core cell
    (:class:`gyre.train.step.Trainer`, ``RemoteTrainer``)."""

    version: int  # optimizer steps applied: the version of the newest weights
    microbatches_done: int

    @property
    def params(self):
        """The newest weights (what the engines are given)."""

    def compute_grads(self, cell, mb):
        """One micro-batch's gradient on ``cell`` -> GradResult; raises CellLost when the
        cell's process is gone."""

    def apply_parts(self, parts: list, counts: list[float]):
        """The update from a step's (part, GradResult) pairs, each part rescaled from its
        own loss normaliser ``counts[part]`` to the step's -> StepOutcome."""


class Cell(Protocol):
    """A slice of the devices (:class:`gyre.mesh.Cell`, ``RemoteCell``)."""

    index: int  # 0 = the core cell
