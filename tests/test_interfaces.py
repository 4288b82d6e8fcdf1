"""The declared interfaces hold for both of their implementations.

The controller sees the trainer and the cells only through gyre/rl/interfaces.py, and the proxy
sees each engine through ``ServingEngine`` (gyre/rollout/types.py). Each has an in-process and
a Ray implementation; a member one of them lacks would only show on the path that uses it.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

from gyre.cluster.remote import RemoteCell, RemoteEngine, RemoteTrainer
from gyre.mesh import Cell
from gyre.rl import interfaces
from gyre.rollout.engine import Engine
from gyre.rollout.types import ServingEngine
from gyre.train.step import Trainer


def _members(protocol) -> set[str]:
    """Methods, properties and annotated attributes the protocol body declares."""
    names = set(getattr(protocol, "__annotations__", {}))
    names |= {n for n, v in vars(protocol).items()
              if not n.startswith("_") and (callable(v) or isinstance(v, property))}  # fmt: skip
    return names


def _assigned(cls) -> set[str]:
    """``self.<name>`` targets assigned in any method of ``cls`` (instance attributes)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    out = set()
    for node in ast.walk(tree):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else ([node.target] if isinstance(node, ast.AnnAssign | ast.AugAssign) else [])
        )
        for t in targets:
            for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                if isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name):
                    if el.value.id == "self":
                        out.add(el.attr)
    return out


def _has(cls, name: str) -> bool:
    fields = getattr(cls, "__dataclass_fields__", {})
    return hasattr(cls, name) or name in fields or name in _assigned(cls)


@pytest.mark.parametrize(
    "protocol, implementations",
    [
        (ServingEngine, (Engine, RemoteEngine)),
        (interfaces.Trainer, (Trainer, RemoteTrainer)),
        (interfaces.Cell, (Cell, RemoteCell)),
    ],
)
def test_every_implementation_has_every_declared_member(protocol, implementations):
    members = _members(protocol)
    assert members, f"{protocol.__name__} declares nothing: the test would be vacuous"
    missing = [f"{cls.__name__}.{name}" for cls in implementations for name in sorted(members)
               if not _has(cls, name)]  # fmt: skip
    assert not missing, missing


def test_a_missing_member_is_found():
    class Partial:
        def __init__(self):
            self.version = 0

    assert _has(Partial, "version") and not _has(Partial, "compute_grads")
