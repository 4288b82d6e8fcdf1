"""Smoke test of the foundation: cells, a tiny model, one train step, a role move.

python launch.py --config=experiments/smoke.py --workdir=workdirs/smoke
"""

from gyre.config import default_config


def get_config(arg=None):
    del arg
    c = default_config()
    c.name = "smoke"
    c.run.entry = "smoke"
    c.mesh.cell_size = 2
    return c
