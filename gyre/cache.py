"""Where caches shared by every workdir live: compiled programs (XLA) and warm starts.

Both are keyed by what they depend on (XLA by the program, a warm start by the hash of its
recipe), so one folder serves every experiment: a second run with the same warm start starts
RL at once. The folder is ``$GYRE_CACHE_DIR`` or ``~/.cache/gyre``; ``mesh.cache_dir`` and
``sft.dir`` move one kind elsewhere.
"""

from __future__ import annotations

import os


def cache_path(kind: str, configured: str = "") -> str:
    """``configured`` if set, else <cache root>/<kind>; creates nothing."""
    root = os.environ.get("GYRE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                            "gyre")  # fmt: skip
    return configured or os.path.join(root, kind)


def cache_dir(kind: str, configured: str = "") -> str:
    """:func:`cache_path`, created."""
    path = cache_path(kind, configured)
    os.makedirs(path, exist_ok=True)
    return path
