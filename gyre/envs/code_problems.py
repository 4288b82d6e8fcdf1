"""The code task's problem set: small Python functions with visible examples and hidden tests.

The set ships in ``gyre/envs/data/code_problems.json``: ``{"format": 1, "problems": [...]}``,
each problem an object with exactly these fields:
  - ``name``: the function's name (a Python identifier, unique in the set);
  - ``signature``: ``name(arg: type, ...) -> type``, shown to the model;
  - ``description``: one paragraph saying what the function returns;
  - ``examples``: 1-2 visible tests, shown in the prompt and reported in detail when they fail;
  - ``tests``: at least 4 hidden tests, never shown (only how many pass);
  - ``solution``: a reference solution that defines the function (it passes every test).
A test is ``{"args": [positional arguments], "expected": value}``, all JSON values. The sandbox's
judge compares type and value (``type(got) is type(expected) and got == expected`` after a JSON
round trip: tuples become lists, dict keys strings, and 1 != 1.0 != True).

Published sets (HumanEval- and MBPP-style JSONL, gyre/envs/published.py) load into the same
:class:`CodeProblem` with ``kind == "assert"``: their tests are the set's own asserts, run in the
sandbox and counted outside it. How strong the shipped set's hidden tests are is measured by
``benchmarks/mutants.py`` (simple mutants of the reference solutions that pass every hidden test;
tests/test_code_set_strength.py keeps it at most 1%, and checks that no held-out problem is
the inverse of a training one).

Split: a problem is held out for evaluation when the first 8 hex digits of
``sha256("gyre-code-split/" + name)`` read as an integer are divisible by 5 (about 20%), else it is
for training. The rule depends on the name alone, so adding problems never moves old ones.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import keyword
import os
import secrets

DATA_FILE = os.path.join(os.path.dirname(__file__), "data", "code_problems.json")
FORMAT = 1
SPLITS = ("train", "eval")
EVAL_MODULUS = 5  # one problem in EVAL_MODULUS (by hash) is held out
FIELDS = ("name", "signature", "description", "examples", "tests", "solution")
MIN_TESTS = 4
MAX_EXAMPLES = 2


class ProblemSetError(ValueError):
    """A malformed problem file: the message names the file, the problem and the field."""


ASSERT_FUNCTION = "__gyre_assert__"  # the judge's harness function appended to solution.py


@dataclasses.dataclass(frozen=True)
class CodeProblem:
    """One problem, of one of two kinds of test:

    - ``kind == "call"`` (the project's format): examples / tests are ((args, expected), ...)
      with args a tuple of JSON values; only the inputs enter the sandbox, the judge compares
      the returned values outside it (gyre/envs/sandbox.py);
    - ``kind == "assert"`` (published sets, gyre/envs/published.py): examples / tests are
      Python sources, each one of the set's own asserts (with what it needs around it), run
      inside the sandbox after ``setup`` against the program's names; a test passes when it
      runs to the end, which the judge counts outside. The asserts themselves are in the
      sandbox, so a program written to subvert them (an object equal to everything, a patched
      builtin, forged result lines that read the run's token) can: this is the published
      sets' own model of a test, weaker than the call tests' outside comparison.

    ``key``: the problem's id in its set ('' = ``name``); ``origin``: where it came from (file,
    line, the set's own id); ``split_name``: a split the set fixes ('' = the hash rule);
    ``prompt``: a published set's own statement text (shown as is; '' = built from the fields).
    """

    name: str
    signature: str
    description: str
    examples: tuple
    tests: tuple
    solution: str
    kind: str = "call"
    setup: str = ""
    key: str = ""
    origin: str = ""
    split_name: str = ""
    prompt: str = ""
    shown: tuple = ()  # assert kind: the examples as the model reads them

    @property
    def split(self) -> str:
        return self.split_name or split_of(self.key or self.name)

    # ---- what the model reads --------------------------------------------------------------
    def example_text(self, i: int) -> str:
        """Example ``i`` as the prompt shows it."""
        if self.kind == "assert":
            return self.shown[i] if i < len(self.shown) else self.examples[i]
        args, expected = self.examples[i]
        return f"{_call(self.name, args)} == {expected!r}"

    def statement(self, max_runs: int) -> str:
        """The task's first user message."""
        examples = "\n".join(self.example_text(i) for i in range(len(self.examples)))
        if self.kind == "assert":
            head = self.prompt or f"def {self.signature}:\n\n{self.description}"
            shown = f"Examples:\n{examples}\n\n" if examples else ""
            return (
                f"Write this Python function in solution.py:\n\n{head.rstrip()}\n\n{shown}"
                f"Hidden tests are asserts on {self.name} like these. You have at most "
                f"{max_runs} test runs."
            )
        return (
            f"Write this Python function in solution.py:\n\ndef {self.signature}:\n\n"
            f"{self.description}\n\nExamples:\n{examples}\n\nHidden tests call it on other "
            "inputs and compare the returned value exactly, type included (return lists, not "
            f"tuples). You have at most {max_runs} test runs."
        )

    def failure_text(self, i: int, verdict: str, output) -> str:
        """What the report says of failing example ``i`` (its verdict and returned value)."""
        if self.kind == "assert":
            what = (
                "failed"
                if verdict == "error:AssertionError"
                else (
                    f"raised {verdict[len('error:') :]}"
                    if verdict.startswith("error:")
                    else "failed"
                )
            )
            return f"First failing example: {self.example_text(i)}  {what}."
        args, expected = self.examples[i]
        got = (f"raised {verdict[len('error:'):]}" if verdict.startswith("error:")
               else f"returned {output!r}")  # fmt: skip
        return f"First failing example: {_call(self.name, args)} {got}, expected {expected!r}."

    # ---- what the sandbox runs -------------------------------------------------------------
    def sandbox_call(self, source: str, tests) -> tuple[str, str, list]:
        """(source, function, [(args, expected), ...]) for :func:`gyre.envs.sandbox.run_tests`.

        Call tests go as they are. Assert tests: the judge's harness is appended to the
        program (after it, so the program's names are the asserts' names) and test ``i`` is
        the call ``__gyre_assert__(i, token)``, which runs ``setup`` and assert source ``i``
        in a fresh copy of the program's globals and returns ``token``, a fresh random string
        per run: a test passes when that token comes back, so printing a constant never does.
        """
        tests = list(tests)
        if self.kind != "assert":
            return source, self.name, tests
        token = secrets.token_hex(16)
        harness = ASSERT_HARNESS.format(fn=ASSERT_FUNCTION, setup=repr(self.setup),
                                        tests=repr(tuple(tests)))  # fmt: skip
        return (f"{source}\n{harness}", ASSERT_FUNCTION,
                [((i, token), token) for i in range(len(tests))])  # fmt: skip


ASSERT_HARNESS = """

# ---- appended by the judge: runs the set's own asserts (gyre/envs/code_problems.py) ----
def {fn}(__i, __token, __setup={setup}, __tests={tests}):
    __ns = dict(globals())
    exec(compile(__setup, "<setup>", "exec"), __ns)
    exec(compile(__tests[__i], "<test %d>" % __i, "exec"), __ns)
    return __token
"""


def _call(name: str, args: tuple) -> str:
    return f"{name}({', '.join(map(repr, args))})"


def split_of(name: str) -> str:
    """'eval' for the held-out ~20% of names (stable hash, see the module docstring), else 'train'."""
    digest = hashlib.sha256(f"gyre-code-split/{name}".encode()).hexdigest()
    return "eval" if int(digest[:8], 16) % EVAL_MODULUS == 0 else "train"


def _tests(value, where: str, field: str, lo: int, hi: int | None) -> tuple:
    count = f"{lo} to {hi}" if hi is not None else f"at least {lo}"
    if not isinstance(value, list) or len(value) < lo or (hi is not None and len(value) > hi):
        got = f"{len(value)} entries" if isinstance(value, list) else type(value).__name__
        raise ProblemSetError(
            f"{where}: field {field!r} must be a list of {count} tests, got {got}"
        )
    out = []
    for i, test in enumerate(value):
        at = f"{where}: field {field!r}[{i}]"
        if not isinstance(test, dict) or set(test) != {"args", "expected"}:
            keys = sorted(test) if isinstance(test, dict) else type(test).__name__
            raise ProblemSetError(
                f"{at} must be an object with keys 'args' and 'expected', got {keys}"
            )
        if not isinstance(test["args"], list):
            raise ProblemSetError(f"{at}.args must be a list of positional arguments")
        out.append((tuple(test["args"]), test["expected"]))
    return tuple(out)


def _problem(entry, index: int, source: str) -> CodeProblem:
    name = entry.get("name") if isinstance(entry, dict) else None
    where = f"{source}: problem {index}" + (f" ({name!r})" if isinstance(name, str) else "")
    if not isinstance(entry, dict):
        raise ProblemSetError(f"{where} must be an object, got {type(entry).__name__}")
    missing = [f for f in FIELDS if f not in entry]
    unknown = sorted(set(entry) - set(FIELDS))
    if missing or unknown:
        raise ProblemSetError(f"{where}: missing fields {missing}, unknown fields {unknown}")
    for field in ("name", "signature", "description", "solution"):
        if not isinstance(entry[field], str) or not entry[field].strip():
            raise ProblemSetError(f"{where}: field {field!r} must be a non-empty string")
    if not name.isidentifier() or keyword.iskeyword(name):
        raise ProblemSetError(f"{where}: field 'name' must be a Python identifier, got {name!r}")
    if not entry["signature"].startswith(f"{name}(") or ")" not in entry["signature"]:
        raise ProblemSetError(f"{where}: field 'signature' must start with '{name}(' and close it")
    try:  # syntax only: the solution is never executed here
        compile(entry["solution"], f"<{name} solution>", "exec")
    except SyntaxError as exc:
        raise ProblemSetError(f"{where}: field 'solution' does not compile: {exc}") from None
    if f"def {name}(" not in entry["solution"]:
        raise ProblemSetError(f"{where}: field 'solution' must define 'def {name}('")
    return CodeProblem(
        name=name,
        signature=entry["signature"],
        description=" ".join(entry["description"].split()),
        examples=_tests(entry["examples"], where, "examples", 1, MAX_EXAMPLES),
        tests=_tests(entry["tests"], where, "tests", MIN_TESTS, None),
        solution=entry["solution"],
    )


def parse_problems(data, source: str = "code_problems.json") -> dict[str, CodeProblem]:
    """Validates a loaded problem file; {name: problem}. ``source`` names it in errors."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ProblemSetError(f"{source}: must be an object with 'format': {FORMAT}")
    entries = data.get("problems")
    if not isinstance(entries, list) or not entries:
        raise ProblemSetError(f"{source}: field 'problems' must be a non-empty list")
    problems: dict[str, CodeProblem] = {}
    for i, entry in enumerate(entries):
        problem = _problem(entry, i, source)
        if problem.name in problems:
            raise ProblemSetError(f"{source}: problem {i}: duplicate name {problem.name!r}")
        problems[problem.name] = problem
    return problems


@functools.cache
def load_problems(path: str = DATA_FILE) -> dict[str, CodeProblem]:
    """The problem set in ``path`` (the shipped one by default), validated; cached per path."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise ProblemSetError(f"{path}: not valid JSON: {exc}") from None
    return parse_problems(data, path)


def split_names(problems: dict[str, CodeProblem], split: str) -> list[str]:
    """The sorted names of ``split`` ('train' or 'eval')."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return sorted(key for key, p in problems.items() if p.split == split)
