"""The one error type that names a config key, shared by the config and the parts below it.

It lives apart from :mod:`gyre.config` so that a part (mesh, engine, trainer) can say which key
makes its spec unusable without importing the config module.
"""


class ConfigError(ValueError):
    """A config that cannot run; the message names the offending key."""


class AlreadyFinished(Exception):
    """A relaunched run whose workdir holds every step already: nothing is run or rewritten."""


class Stopped(Exception):
    """A run stopped on request (SIGINT/SIGTERM) at a step boundary, checkpointed there."""


class CellLost(RuntimeError):
    """A cell's process is gone (or a move from it outlived its deadline): gyre/cluster/remote.py.
    The controller goes on without it; losing the core cell (index 0) ends the run."""

    def __init__(self, cell: int, why: str):
        super().__init__(f"cell {cell} lost: {why}")
        self.cell = cell

    def __reduce__(self):
        return (CellLost, (self.cell, str(self).split(": ", 1)[-1]))
