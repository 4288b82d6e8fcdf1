"""The code task in chat form: write a Python function with JSON tools, judged in the sandbox.

Problems come from :mod:`gyre.envs.code_problems` (shipped, with a fixed train/eval split). The
model sees the signature, the description and 1-2 visible examples, and has three tools:
  - ``write_file(content)``: replaces solution.py (at most ``max_file_bytes`` UTF-8 bytes);
  - ``run_tests()``: runs the visible examples and the hidden tests, each in its own sandbox
    run (:func:`gyre.envs.sandbox.run_tests`). The response gives the pass counts; for the
    first failing VISIBLE example it shows the input, what came back and what was expected.
    Hidden tests are only counted (or their run's status word given): the program answering
    the examples never sees a hidden input, and nothing else of the hidden run (output,
    exception names, details) is quoted, so their inputs and expected values never reach
    the model;
  - ``read_file()``: shows solution.py.
A reply without a tool call that holds a fenced code block (the last ```python / ```py /
```python3 block, else the last untagged ``` block) is written to solution.py and tested at once,
as ``write_file`` then ``run_tests`` (a run the model asked for in its own words); a reply with
neither gets a reminder of the tools. The episode goes on ('ok') unless that run ends it.

Judge: each hidden test is a milestone, and the best single run counts (passing different tests
with different versions of the file does not add up). When every example and hidden test passes
the step is 'done'; the run numbered ``max_runs`` that does not is 'fail' (no runs are left).
Bad tool calls (unknown tool, wrong or missing arguments, a file over the size limit) are 'ok'
steps whose text says what is wrong. A sandbox that cannot start raises (an infrastructure
error, retried by the harness; the state is changed only after the run); code that times out,
runs out of memory or does not load is reported to the model and counts as a run. Where the OS
sandbox cannot run at all, constructing the environment raises SandboxUnavailable.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re

import numpy as np

from gyre.envs.base import Task
from gyre.envs.code_problems import DATA_FILE, CodeProblem, split_names
from gyre.envs.published import load_problem_set
from gyre.envs.sandbox import SandboxLimits, SandboxResult, require_isolation, run_tests
from gyre.envs.text import TextEnvironment, TextStep

SYSTEM_PROMPT = (
    "You are an expert Python programmer. Solve the task by writing solution.py with the "
    "tools: write_file(content) replaces the whole file, run_tests() runs the examples and the "
    "hidden tests and reports how many pass, read_file() shows the file. The task is solved "
    "when every test passes. A reply without a tool call that holds a ```python code block "
    "writes that block to solution.py (then call run_tests())."
)
_BLOCK = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)
_PYTHON_TAGS = ("python", "py", "python3")


def _schema(name: str, description: str, properties: dict | None = None) -> dict:
    params = {
        "type": "object",
        "properties": properties or {},
        "required": sorted(properties or {}),
    }
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": params}}  # fmt: skip


def code_block(text: str) -> str | None:
    """The code of the last ```python (or ```py / ```python3) block in text, else of the last
    untagged ``` block; None when there is neither. Pure."""
    blocks = _BLOCK.findall(text)
    tagged = [code for tag, code in blocks if tag.lower() in _PYTHON_TAGS]
    plain = [code for tag, code in blocks if not tag]
    return (tagged or plain or [None])[-1]


@dataclasses.dataclass
class CodeChatState:
    task: Task
    problem: CodeProblem
    file: str | None = None
    best: int = 0  # most hidden tests passed by one run
    runs: int = 0
    last_report: str = ""
    solved: bool = False


class CodeChatEnv(TextEnvironment):
    """See the module docstring."""

    name = "code"
    system_prompt = SYSTEM_PROMPT

    def __init__(self, limits: SandboxLimits | None = None, max_runs: int = 8,
                 max_file_bytes: int = 16384, tool_timeout: float = 30.0,
                 problem_file: str = DATA_FILE, problem_format: str = "auto"):  # fmt: skip
        require_isolation()  # never run untrusted code unconfined: refuse to start instead
        if max_runs < 1 or max_file_bytes < 1:
            raise ValueError(
                f"max_runs and max_file_bytes must be >= 1, got {max_runs}, {max_file_bytes}"
            )
        self.limits = limits or SandboxLimits()
        self.max_runs, self.max_file_bytes = max_runs, max_file_bytes
        self.tool_timeout = tool_timeout
        self.problems = load_problem_set(problem_file, problem_format)  # gyre/envs/published.py
        content = {"type": "string", "description": "the whole new content of solution.py"}
        self.tools = (
            _schema("write_file", f"Replace solution.py with content (at most "
                    f"{max_file_bytes} bytes).", {"content": content}),
            _schema("run_tests", "Run the examples and the hidden tests on solution.py; "
                    "reports how many pass."),
            _schema("read_file", "Show the current content of solution.py."),
        )  # fmt: skip

    # ---- tasks ---------------------------------------------------------------------------
    def make_tasks(self, seed: int, n: int, split: str = "train") -> list[Task]:
        """``n`` tasks from ``split``: shuffled passes over its problems (each problem appears
        n // len or one more times), keyed by ``seed``."""
        names = split_names(self.problems, split)
        rng = np.random.default_rng(seed)
        order: list[int] = []
        while len(order) < n:
            order.extend(rng.permutation(len(names)).tolist())
        return [
            Task(f"code-{split}-{seed}-{j}", seed, (names[i],)) for j, i in enumerate(order[:n])
        ]

    def reset(self, task: Task) -> CodeChatState:
        name = task.params[0] if task.params else None
        if name not in self.problems:
            raise ValueError(f"task {task.task_id!r}: unknown code problem {name!r}")
        return CodeChatState(task, self.problems[name])

    def task_text(self, state: CodeChatState) -> str:
        return state.problem.statement(self.max_runs)

    # ---- tools -----------------------------------------------------------------------------
    async def call_tool(self, state: CodeChatState, name: str, arguments: dict) -> TextStep:
        expected = {"write_file": ("content",), "run_tests": (), "read_file": ()}
        if name not in expected:
            return TextStep("ok", f"Error: unknown tool {name!r}; the tools are "
                                  "write_file(content), run_tests() and read_file().")  # fmt: skip
        if not isinstance(arguments, dict):
            return TextStep("ok", f"Error: the arguments of {name} must be a JSON object, "
                                  f"got {type(arguments).__name__}.")  # fmt: skip
        extra = sorted(map(str, set(arguments) - set(expected[name])))
        missing = [k for k in expected[name] if k not in arguments]
        if extra or missing:
            takes = ", ".join(repr(k) for k in expected[name]) or "no arguments"
            wrong = [f"missing {missing}"] * bool(missing) + [f"unexpected {extra}"] * bool(extra)
            return TextStep("ok", f"Error: {name} takes {takes}; {' and '.join(wrong)}.")
        if name == "write_file":
            content = arguments["content"]
            if not isinstance(content, str):
                return TextStep("ok", "Error: write_file's 'content' must be a string, "
                                      f"got {type(content).__name__}.")  # fmt: skip
            error = self._size_error(content)
            if error:
                return TextStep("ok", error)
            state.file = content
            return TextStep("ok", f"Wrote solution.py ({len(content.encode())} bytes).")
        if name == "read_file":
            if state.file is None:
                return TextStep("ok", "solution.py does not exist yet: write it with write_file.")
            return TextStep("ok", f"solution.py:\n{state.file}")
        if state.file is None:
            return TextStep("ok", "Nothing to test: solution.py does not exist yet; "
                                  "write it with write_file first.")  # fmt: skip
        return await self._submit(state, state.file)

    async def answer(self, state: CodeChatState, text: str) -> TextStep:
        """A reply without a tool call: its code block, if any, becomes solution.py and is
        tested at once (as write_file then run_tests); without one, a reminder of the tools."""
        code = code_block(text)
        if code is not None:
            error = self._size_error(code)
            if error:
                return TextStep("ok", error)
            return await self._submit(state, code)
        if state.file is not None:
            return TextStep("ok", "Your reply had no tool call. Call run_tests() to test "
                                  "solution.py, or write_file(content) to change it.")  # fmt: skip
        return TextStep("ok", "Your reply had no tool call and no ```python block. Write "
                              "solution.py with write_file(content), then call run_tests().")  # fmt: skip

    async def _submit(self, state: CodeChatState, source: str) -> TextStep:
        """Runs every test on ``source``; only then records the file and the run. The
        examples and the hidden tests run in two sandboxes at once: the program that answers
        the examples never holds a hidden input, so nothing it returns can carry one."""
        p = state.problem
        shown, hidden = await asyncio.gather(
            run_tests(*p.sandbox_call(source, p.examples), self.limits),
            run_tests(*p.sandbox_call(source, p.tests), self.limits))  # fmt: skip
        passed, solved, report = self._report(p, shown, hidden, state.runs + 1)
        state.file = source
        state.runs += 1
        state.best = max(state.best, passed)
        state.solved = solved
        state.last_report = report
        if solved:
            return TextStep("done", report)
        if state.runs >= self.max_runs:
            return TextStep("fail", f"{report}\nNo test runs left.")
        return TextStep("ok", report)

    def _report(self, p: CodeProblem, shown: SandboxResult, hidden: SandboxResult,
                run: int) -> tuple[int, bool, str]:  # fmt: skip
        """(hidden tests passed, whether every test passed, text for the model). Of the hidden
        run only its pass count, or its status word, reaches the text: its output, exception
        names and details are the program's and could spell out a hidden input."""
        head = f"Test run {run} of {self.max_runs}:"
        hidden_passed = hidden.passed if len(hidden.results) == len(p.tests) else 0
        hidden_text = (f"hidden tests {hidden_passed}/{len(p.tests)} passed"
                       if len(hidden.results) == len(p.tests)
                       else f"the hidden tests did not run to completion ({hidden.status})")  # fmt: skip
        if len(shown.results) != len(p.examples):  # the examples' run did not finish
            detail = f"{shown.status}: {shown.detail[:300]}"
            return hidden_passed, False, (f"{head} the examples did not run to completion "
                                          f"({detail}); {hidden_text}.")  # fmt: skip
        shown_passed = sum(r == "pass" for r in shown.results)
        counts = f"examples {shown_passed}/{len(p.examples)} passed, {hidden_text}"
        if shown_passed == len(p.examples) and hidden_passed == len(p.tests):
            return hidden_passed, True, f"{head} {counts}. All tests pass: solved."
        lines = [f"{head} {counts}."]
        for i, verdict in enumerate(shown.results):
            if verdict != "pass":
                lines.append(p.failure_text(i, verdict, shown.outputs[i]))
                break
        else:
            lines.append("Every example passes; the failing hidden tests stay hidden.")
        return hidden_passed, False, "\n".join(lines)

    def _size_error(self, content: str) -> str | None:
        size = len(content.encode())
        if size > self.max_file_bytes:
            return (f"Error: solution.py may hold at most {self.max_file_bytes} bytes, got "
                    f"{size}; nothing was written.")  # fmt: skip
        return None

    # ---- judge -----------------------------------------------------------------------------
    def milestones(self, state: CodeChatState) -> tuple[int, int]:
        return state.best, len(state.problem.tests)

    def summary_text(self, state: CodeChatState) -> str:
        file = "(not written yet)" if state.file is None else f"\n```python\n{state.file}\n```"
        last = state.last_report or "no test run yet"
        return (f"Progress so far: {state.best}/{len(state.problem.tests)} hidden tests passed in "
                f"the best run, {state.runs} of {self.max_runs} runs used.\nsolution.py: {file}\n"
                f"Last test run: {last}")  # fmt: skip


def _call(name: str, args: tuple) -> str:
    return f"{name}({', '.join(map(repr, args))})"
