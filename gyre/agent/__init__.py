"""Agent harness: executions as asyncio coroutines over a ``generate`` client.

``gyre.agent.driver.run_scripted_harness`` runs the harness with scripted policies (no model).
"""

from gyre.agent.context import AgentSettings
from gyre.agent.harness import run_execution, run_executions
from gyre.trajectory.batch import ExecutionResult

__all__ = ["AgentSettings", "ExecutionResult", "run_execution", "run_executions"]
