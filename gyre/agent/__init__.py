"""Agent harness: executions as asyncio coroutines over a ``generate`` client."""

from gyre.agent.context import AgentSettings
from gyre.agent.harness import ExecutionResult, run_executions

__all__ = ["AgentSettings", "ExecutionResult", "run_executions", "run_scripted_harness"]


def __getattr__(name):
    # Lazy: the driver imports the environments, which import gyre.agent.grammar; importing
    # it here would make `import gyre.envs.ledger` circular when it comes first.
    if name == "run_scripted_harness":
        from gyre.agent.driver import run_scripted_harness

        return run_scripted_harness
    raise AttributeError(name)
