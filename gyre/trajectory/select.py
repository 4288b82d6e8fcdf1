"""Bounded path selection: at most J root-to-leaf paths per execution, by role priority.

A path is named by the call that owns its leaf (see ``Tree.leaf_calls``) and has that call's
role. Order: main > main-summary > sub-agent > sub-agent-summary, longest first within a role,
then record order. ``max_paths = 0`` keeps every path (the uncapped ablation).
"""

from __future__ import annotations

import dataclasses

from gyre.trajectory.records import ROLES
from gyre.trajectory.tree import Tree


@dataclasses.dataclass(frozen=True)
class Selection:
    """Call indices (into the tree's calls) of the kept and the dropped paths, in priority order."""

    kept: tuple[int, ...]
    dropped: tuple[int, ...]


def path_priority(tree: Tree, call: int) -> tuple[int, int, int]:
    """Sort key of the path ending at ``call``: role rank, then longer first, then record order."""
    length = int(tree.depth[tree.call_end[call]]) + 1
    return ROLES.index(tree.call_roles[call]), -length, call


def select_paths(tree: Tree, max_paths: int) -> Selection:
    """Keeps the ``max_paths`` highest-priority leaf paths (all of them when 0)."""
    if max_paths < 0:
        raise ValueError(f"max_paths must be >= 0 (0 = uncapped), got {max_paths}")
    ranked = sorted((int(c) for c in tree.leaf_calls), key=lambda c: path_priority(tree, c))
    cut = len(ranked) if max_paths == 0 else max_paths
    return Selection(kept=tuple(ranked[:cut]), dropped=tuple(ranked[cut:]))
