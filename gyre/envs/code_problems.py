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

DATA_FILE = os.path.join(os.path.dirname(__file__), "data", "code_problems.json")
FORMAT = 1
SPLITS = ("train", "eval")
EVAL_MODULUS = 5  # one problem in EVAL_MODULUS (by hash) is held out
FIELDS = ("name", "signature", "description", "examples", "tests", "solution")
MIN_TESTS = 4
MAX_EXAMPLES = 2


class ProblemSetError(ValueError):
    """A malformed problem file: the message names the file, the problem and the field."""


@dataclasses.dataclass(frozen=True)
class CodeProblem:
    """One problem. examples / tests: ((args, expected), ...) with args a tuple of JSON values."""

    name: str
    signature: str
    description: str
    examples: tuple[tuple[tuple, object], ...]
    tests: tuple[tuple[tuple, object], ...]
    solution: str

    @property
    def split(self) -> str:
        return split_of(self.name)


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
    return sorted(name for name in problems if split_of(name) == split)
