"""Trajectory processor: call records -> token trees -> bounded selection -> advantages -> rows.

Pipeline entry point: :func:`gyre.trajectory.batch.build_batch`. The packed batch's fields,
the loss metrics' kinds and the objectives are declared in :mod:`gyre.trajectory.schema`.
"""

from gyre.trajectory.advantages import (
    LOSS_MODES,
    execution_score,
    group_advantages,
    path_coefficients,
)
from gyre.trajectory.batch import BatchReport, ExecutionResult, TrajectorySpec, build_batch
from gyre.trajectory.pack import (
    build_forest,
    flatten,
    pack,
    rows_for,
    split_forest,
    union_size,
)
from gyre.trajectory.records import (
    END_REASONS,
    ROLES,
    CallRecord,
    RecordError,
    make_record,
    validate_execution,
    validate_record,
)
from gyre.trajectory.schema import OBJECTIVES, Field, Objective, PackedBatch
from gyre.trajectory.select import Selection, select_paths
from gyre.trajectory.tree import Tree, build_tree

__all__ = [
    "END_REASONS",
    "LOSS_MODES",
    "OBJECTIVES",
    "ROLES",
    "BatchReport",
    "CallRecord",
    "ExecutionResult",
    "Field",
    "Objective",
    "PackedBatch",
    "RecordError",
    "Selection",
    "Tree",
    "TrajectorySpec",
    "build_batch",
    "build_forest",
    "build_tree",
    "execution_score",
    "flatten",
    "group_advantages",
    "make_record",
    "pack",
    "path_coefficients",
    "rows_for",
    "select_paths",
    "split_forest",
    "union_size",
    "validate_execution",
    "validate_record",
]
