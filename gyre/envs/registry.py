"""Every environment the runtime can train on, behind one function: ``make_env(spec)``.

To add an environment: write ``gyre/envs/<name>.py`` with an :class:`~gyre.envs.base.Environment`
subclass (its milestone judge included), then add one line to ``ENVIRONMENTS`` below mapping
the name to a factory of an :class:`EnvSpec`. ``env.name`` in the config accepts the new name
from then on (gyre/config.py reads the choices from here).
"""

from __future__ import annotations

import dataclasses

from gyre.envs.base import Environment
from gyre.envs.code import CodeEnv
from gyre.envs.faults import FaultyTools
from gyre.envs.ledger import LedgerEnv


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """Task settings (``cfg.env``), plus the harness's retry budget (``agent.max_retries``),
    which the ledger task also uses as its budget of wrong commits."""

    name: str = "ledger"
    num_ops: int = 8  # ledger: K, the number of steps
    modulus: int = 10  # ledger: arithmetic modulus
    tool_latency: float = 0.0  # mean seconds a tool call takes; 0 = instant
    max_wrong: int = 2
    tool_timeout: float = 30.0  # seconds before a tool call counts as hung
    fault_rate: float = 0.0  # share of tool calls that crash or hang (gyre/envs/faults.py)
    seed: int = 0  # keys the injected faults


def _ledger(spec: EnvSpec) -> LedgerEnv:
    # The whole chain is listed when K <= 16, else a 16-step window.
    return LedgerEnv(num_ops=spec.num_ops, modulus=spec.modulus, latency=spec.tool_latency,
                     header_ops=min(spec.num_ops, 16), max_wrong=spec.max_wrong,
                     tool_timeout=spec.tool_timeout)  # fmt: skip


def _code(spec: EnvSpec) -> CodeEnv:
    return CodeEnv(tool_timeout=spec.tool_timeout)


ENVIRONMENTS = {"ledger": _ledger, "code": _code}


def make_env(spec: EnvSpec) -> Environment:
    """The environment named by ``spec.name``; a clear error for an unknown name."""
    if spec.name not in ENVIRONMENTS:
        raise ValueError(
            f"config key 'env.name' is {spec.name!r}, not one of {sorted(ENVIRONMENTS)}"
        )
    env = ENVIRONMENTS[spec.name](spec)
    return FaultyTools(env, spec.fault_rate, spec.seed) if spec.fault_rate > 0 else env
