"""A template environment to copy when adding a task: it runs as is.

    cp gyre/envs/template.py gyre/envs/mytask.py      # then rename the class and ``name``
    # and register it in gyre/envs/registry.py: a factory from the EnvSpec, one dict entry
    #     def _mytask(spec): return MyTaskEnv(tool_timeout=spec.tool_timeout)
    #     TEXT_ENVIRONMENTS = {..., "mytask": _mytask}
    python launch.py --config=experiments/qwen3_code.py:tiny --workdir=workdirs/mytask \
        --config.env.name=mytask

This one is registered as ``template`` (``_template`` in the registry), so
``--config.env.name=template`` trains on it. The task: add up a list of numbers with an
``add`` tool and give the total as the answer. What each part is for:

- ``make_tasks(seed, n, split)``: the tasks, keyed by seed; the ``eval`` split must be
  disjoint from ``train`` (held-out evaluation draws from it);
- ``reset(task)``: a fresh mutable state per execution (never shared between executions);
- ``task_text(state)``: the first user message; ``system_prompt`` and ``tools`` (JSON
  schemas, rendered by the checkpoint's chat template) are class attributes;
- ``call_tool(state, name, arguments)``: one tool call -> ``TextStep('ok', text)`` whose text
  the model sees (bad arguments are an 'ok' step saying what was wrong, so the model can
  correct itself; raise only for an infrastructure failure: the harness retries those);
- ``answer(state, text)``: the model replied without a tool call -> 'done' (success) or
  'fail' (or 'ok' with a hint: the model gets another turn);
- ``milestones(state)``: (reached, total), the partial credit of an unfinished execution;
  ``score(state)`` may return a task's own fraction in [0, 1] instead.
"""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np

from gyre.envs.base import Task
from gyre.envs.text import TextEnvironment, TextStep


@dataclasses.dataclass
class _State:
    numbers: list[int]
    total: int = 0  # what the add tool has summed so far
    added: int = 0  # numbers added (the milestones)


class TemplateEnv(TextEnvironment):
    """Sum a list of numbers with an ``add`` tool, then answer the total."""

    name = "template"
    system_prompt = "You add numbers with the add tool, then reply with the total alone."
    tools = (
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Adds x to the running total and returns the new total.",
                "parameters": {
                    "type": "object",
                    "properties": {"x": {"type": "integer"}},
                    "required": ["x"],
                },
            },
        },
    )

    def __init__(self, count: int = 3, tool_timeout: float = 30.0):
        self.count, self.tool_timeout = count, tool_timeout

    def make_tasks(self, seed: int, n: int, split: str = "train") -> list[Task]:
        # disjoint splits: a task's seed is even for train, odd for eval
        base = zlib.crc32(f"{split}:{seed}".encode())
        return [Task(f"{self.name}-{split}-{seed}-{i}", 2 * (base + i) + (split == "eval"))
                for i in range(n)]  # fmt: skip

    def reset(self, task: Task) -> _State:
        rng = np.random.default_rng(task.seed)
        return _State([int(x) for x in rng.integers(1, 20, self.count)])

    def task_text(self, state: _State) -> str:
        return f"Add up these numbers: {', '.join(map(str, state.numbers))}."

    async def call_tool(self, state: _State, name: str, arguments: dict) -> TextStep:
        if name != "add":
            return TextStep("ok", f"unknown tool {name!r}; the tool is 'add'")
        x = arguments.get("x")
        if not isinstance(x, int):
            return TextStep("ok", "add takes one integer argument x")
        state.total += x
        if state.added < len(state.numbers) and x == state.numbers[state.added]:
            state.added += 1
        return TextStep("ok", str(state.total))

    async def answer(self, state: _State, text: str) -> TextStep:
        ok = text.strip() == str(sum(state.numbers))
        return TextStep("done" if ok else "fail", "correct" if ok else "wrong total")

    def milestones(self, state: _State) -> tuple[int, int]:
        return state.added, len(state.numbers)
