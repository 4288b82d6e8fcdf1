"""Agent harness: executions as asyncio coroutines over a ``generate`` client."""

from gyre.agent.context import AgentSettings
from gyre.agent.driver import run_scripted_harness
from gyre.agent.harness import ExecutionResult, run_executions

__all__ = ["AgentSettings", "ExecutionResult", "run_executions", "run_scripted_harness"]
