"""The code task: write a Python function against hidden tests, in a real sandbox.

Byte-level tokens (``vocab.ByteVocab``). A turn is UTF-8 text ending with EOS:
  ``write_file\\n<the whole solution.py>``   replaces the solution file;
  ``run_tests``                            runs the hidden tests in the sandbox.
Observations are short texts ("[wrote 42 bytes]", "[tests 3/5 passed]": counts only). Each hidden test
is a milestone; the judge counts the best single run (passing different tests with different
versions of the file does not add up). More than ``max_runs`` test runs end in failure.
Sandbox failures caused by the code (timeout, memory, load errors) are observations; a sandbox
that cannot start raises, which the harness treats as an infrastructure error. Where the OS
sandbox (bubblewrap) cannot run at all, constructing CodeEnv raises SandboxUnavailable.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from gyre.envs.base import Environment, StepResult, Task, ToolCall
from gyre.envs.sandbox import SandboxLimits, SandboxResult, require_isolation, run_tests
from gyre.envs.vocab import ByteVocab as B

PROBLEMS = {
    "add": ("add(a, b)", "returns a + b",
            [((1, 2), 3), ((-4, 4), 0), ((10, 5), 15)],
            "def add(a, b):\n    return a + b\n"),
    "reverse_words": ("reverse_words(s)", "returns the words of s in reverse order, joined by one space",
                      [(("a b c",), "c b a"), (("hello",), "hello"), (("x  y",), "y x")],
                      "def reverse_words(s):\n    return ' '.join(s.split()[::-1])\n"),
    "is_prime": ("is_prime(n)", "returns True when the integer n is prime",
                 [((2,), True), ((1,), False), ((97,), True), ((91,), False), ((0,), False)],
                 "def is_prime(n):\n    return n > 1 and all(n % d for d in range(2, int(n**0.5) + 1))\n"),
    "fizz": ("fizz(n)", "returns 'Fizz' if 3 divides n, 'Buzz' if 5 does, 'FizzBuzz' if both, else str(n)",
             [((3,), "Fizz"), ((10,), "Buzz"), ((30,), "FizzBuzz"), ((7,), "7")],
             "def fizz(n):\n    return ('Fizz' * (n % 3 == 0) + 'Buzz' * (n % 5 == 0)) or str(n)\n"),
}  # fmt: skip


def text_tokens(text: str) -> np.ndarray:
    return B.encode(text)


@dataclasses.dataclass
class CodeState:
    task: Task
    problem: str
    file: str | None = None
    best: int = 0
    runs: int = 0
    last: SandboxResult | None = None


class CodeEnv(Environment):
    """See the module docstring."""

    vocab_size = B.SIZE
    stop_tokens = (B.EOS,)

    def render_tokens(self, tokens):
        tokens = np.asarray(tokens)
        text = B.decode(tokens)
        return text if text is not None else " ".join(str(int(t)) for t in tokens)

    def __init__(self, limits: SandboxLimits | None = None, max_runs: int = 8,
                 max_file_bytes: int = 4096, tool_timeout: float = 30.0):  # fmt: skip
        require_isolation()  # never run untrusted code unconfined: refuse to start instead
        self.limits = limits or SandboxLimits()
        self.max_runs, self.max_file_bytes = max_runs, max_file_bytes
        self.tool_timeout = tool_timeout

    def make_tasks(self, seed: int, n: int, split: str = "train") -> list[Task]:
        del split  # held-out tasks come from held-out seeds (gyre/rl/evaluation.py)
        names = sorted(PROBLEMS)
        picks = np.random.default_rng(seed).integers(len(names), size=n)
        return [Task(f"code-{seed}-{j}", int(p), (names[p],)) for j, p in enumerate(picks)]

    def reset(self, task: Task) -> CodeState:
        problem = task.params[0] if task.params else sorted(PROBLEMS)[task.seed % len(PROBLEMS)]
        if problem not in PROBLEMS:
            raise ValueError(f"unknown code problem {problem!r}")
        return CodeState(task, problem)

    def task_prompt(self, state):
        sig, what, _, _ = PROBLEMS[state.problem]
        text = (f"Task: in solution.py write a Python function {sig} that {what}.\n"
                "Reply 'write_file' + newline + the whole file, or 'run_tests'.\n")  # fmt: skip
        return np.concatenate([[B.BOS], text_tokens(text)]).astype(np.int32)

    def initial_obs(self, state):
        return np.zeros(0, np.int32)

    def milestones(self, state):
        return state.best, len(PROBLEMS[state.problem][2])

    def parse(self, completion, role):
        completion = np.asarray(completion)
        if completion.size == 0 or completion[-1] != B.EOS or (completion[:-1] >= 256).any():
            return None
        text = B.decode(completion[:-1])
        if text is None:
            return None
        if role == "main-summary":
            return ToolCall("summary")
        if role != "main":
            return None  # no sub-agents in this task
        if text == "run_tests":
            return ToolCall("run_tests")
        if text.startswith("write_file\n"):
            return ToolCall("write_file", (text[len("write_file\n") :],))
        return None

    async def step(self, state, call: ToolCall, role: str) -> StepResult:
        if call.name == "write_file":
            (content,) = call.args
            if len(content.encode()) > self.max_file_bytes:
                return StepResult("error", text_tokens("[file too large]\n"))
            state.file = content
            return StepResult("ok", text_tokens(f"\n[wrote {len(content.encode())} bytes]\n"))
        if call.name != "run_tests" or state.file is None:
            return StepResult("error", text_tokens("[nothing to test]\n"))
        _, _, tests, _ = PROBLEMS[state.problem]
        fn = PROBLEMS[state.problem][0].split("(")[0]
        result = await run_tests(state.file, fn, tests, self.limits)
        state.runs += 1
        state.last = result
        state.best = max(state.best, result.passed)
        obs = text_tokens(f"\n{self._report(result, len(tests))}\n")
        if result.passed == len(tests):
            return StepResult("done", obs)
        return StepResult("fail" if state.runs >= self.max_runs else "ok", obs)

    @staticmethod
    def _report(result: SandboxResult, n: int) -> str:
        """Counts and the status word only: the tests are hidden, and anything the program
        controls (its output, an exception's name, the order of verdicts) could carry their
        inputs back to the model."""
        if result.status != "ok":
            return f"[tests not run: {result.status}]"
        return f"[tests {result.passed}/{n} passed]"

    def deliver(self, state, sub_state, succeeded):
        return np.zeros(0, np.int32)

    def summary(self, state, role):
        last = (
            "" if state.last is None else self._report(state.last, len(PROBLEMS[state.problem][2]))
        )
        text = f"[summary] solution.py:\n{state.file or ''}\n{last}\n"
        return np.concatenate([[B.SUMMARY], text_tokens(text)]).astype(np.int32)

    def summary_request(self, role):
        return np.asarray([B.SUMMARY], np.int32)

    def resume_obs(self, state, role):
        return text_tokens(f"\nsolution.py:\n{state.file or ''}\n")
