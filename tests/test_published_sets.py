"""Published code sets: HumanEval- and MBPP-style JSONL files written here (nothing downloads)
load through the config keys alone, carry their provenance, and are judged by their own asserts
run inside the sandbox and counted outside it: right solutions pass, wrong ones fail."""

import asyncio
import json

import pytest

from gyre.config import default_config, validate
from gyre.envs.code_problems import DATA_FILE, ProblemSetError
from gyre.envs.published import load_problem_set, sniff
from gyre.envs.registry import EnvSpec
from gyre.errors import ConfigError

HUMANEVAL = [
    {
        "task_id": "Toy/0",
        "prompt": 'from typing import List\n\n\ndef mean(xs: List[float]) -> float:\n    """The '
        'arithmetic mean of xs.\n    >>> mean([1.0, 2.0])\n    1.5\n    """\n',
        "canonical_solution": "    return sum(xs) / len(xs)\n",
        "entry_point": "mean",
        # float tolerance and a loop: tests literal equality cannot express
        "test": "METADATA = {}\n\ndef check(candidate):\n    tol = 1e-9\n"
        "    assert abs(candidate([1.0, 2.0, 4.0]) - 7 / 3) < tol\n"
        "    for n in range(1, 4):\n        assert candidate([float(n)] * n) == n\n"
        "    assert candidate([-1.0, 1.0]) == 0\n",
    },
    {
        "task_id": "Toy/1",
        "prompt": 'def uniq(xs):\n    """The set of distinct items of xs."""\n',
        "canonical_solution": "    return set(xs)\n",
        "entry_point": "uniq",
        "test": "def check(candidate):\n    assert candidate([1, 1, 2]) == {1, 2}\n"
        "    assert candidate([]) == set()\n",
    },
]
MBPP = [
    {
        "task_id": 11,
        "text": "Write a function to return the sum of the squares of a list.",
        "code": "def sum_sq(xs):\n    return sum(x * x for x in xs)\n",
        "test_list": [
            "assert sum_sq([1, 2]) == 5",
            "assert sum_sq([]) == 0",
            "assert sum_sq([-3]) == 9",
        ],
        "test_setup_code": "",
        "challenge_test_list": [],
    },
    {
        "task_id": 12,
        "text": "Write a function that splits a string into words, several calls.",
        "code": "def words(s):\n    return s.split()\n",
        "test_list": [
            "assert words('a b') == ['a', 'b']",
            "assert words(' x ') == ['x'] and words('') == []",
            "assert len(words(SAMPLE)) == 3",
        ],
        "test_setup_code": "SAMPLE = 'one two three'",
    },
]


def write_jsonl(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return str(path)


@pytest.fixture
def files(tmp_path):
    return (
        write_jsonl(tmp_path / "he.jsonl", HUMANEVAL),
        write_jsonl(tmp_path / "mbpp.jsonl", MBPP),
    )


def test_humaneval_loads_with_one_test_per_assert_statement_and_provenance(files):
    he, _ = files
    assert sniff(he) == "humaneval"
    problems = load_problem_set(he)  # auto
    assert set(problems) == {"Toy/0", "Toy/1"}
    p = problems["Toy/0"]
    assert (
        p.name == "mean" and p.kind == "assert" and p.signature == "mean(xs: List[float]) -> float"
    )
    assert len(p.tests) == 3  # the abs assert, the loop, the last assert; tol kept in each
    assert all("tol = 1e-09" in t or "tol = 1e-9" in t for t in p.tests)
    assert p.origin.startswith(f"humaneval {he}:1 (Toy/0)") and "METADATA" in p.setup
    assert p.example_text(0) == "assert abs(mean([1.0, 2.0, 4.0]) - 7 / 3) < tol"
    assert p.solution.endswith("return sum(xs) / len(xs)\n")
    text = p.statement(4)
    assert text.startswith("Write this Python function") and "from typing import List" in text
    assert p.split in ("train", "eval") and problems["Toy/1"].origin.endswith(":2 (Toy/1)")


def test_mbpp_loads_the_called_function_and_setup(files):
    _, mbpp = files
    assert sniff(mbpp) == "mbpp"
    problems = load_problem_set(mbpp, "mbpp")
    p = problems["12"]
    assert p.name == "words" and p.signature == "words(s)" and p.setup == "SAMPLE = 'one two three'"
    assert len(p.tests) == 3 and p.example_text(0) == "assert words('a b') == ['a', 'b']"
    assert p.origin == f"mbpp {mbpp}:2 (12)"
    assert "Hidden tests are asserts on words" in p.statement(3)


def test_the_project_format_loads_as_before_and_bad_files_are_one_clear_error(tmp_path, files):
    shipped = load_problem_set("", "auto")
    assert len(shipped) >= 120 and all(p.kind == "call" for p in shipped.values())
    assert load_problem_set(DATA_FILE, "gyre") is shipped or load_problem_set(DATA_FILE, "gyre")
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"task_id": 1, "text": "t", "test_list": ["x = 1"]}])
    with pytest.raises(
        ProblemSetError, match=r"bad.jsonl:1 \(1\): test_list\[0\] is not an assert"
    ):
        load_problem_set(bad)
    odd = write_jsonl(tmp_path / "odd.jsonl", [{"question": "?"}])
    with pytest.raises(ProblemSetError, match="cannot tell the format"):
        load_problem_set(odd)
    no_check = dict(HUMANEVAL[1], test="assert True\n")
    with pytest.raises(ProblemSetError, match=r"must define check\(candidate\)"):
        load_problem_set(write_jsonl(tmp_path / "nc.jsonl", [no_check]), "humaneval")
    with pytest.raises(ProblemSetError, match="does not exist"):
        load_problem_set(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ProblemSetError, match="not one of"):
        load_problem_set(files[0], "apps")


def test_the_config_keys_choose_the_file_and_format():
    cfg = default_config()
    cfg.env.problem_format = "humanevl"
    with pytest.raises(ConfigError, match="env.problem_format"):
        validate(cfg)
    assert EnvSpec().problem_file == "" and EnvSpec().problem_format == "auto"


def test_harness_payload_hides_nothing_it_does_not_need(files):
    p = load_problem_set(files[1])["11"]
    source, fn, tests = p.sandbox_call("def sum_sq(xs):\n    return 0\n", p.examples)
    assert fn == "__gyre_assert__" and len(tests) == 1
    assert "sum_sq([1, 2]) == 5" in source and "sum_sq([-3]) == 9" not in source  # examples only
    ((args, expected),) = tests
    assert args[1] == expected and len(expected) == 32  # a fresh token per run
    assert p.sandbox_call("", p.examples)[2][0][1] != expected


def run_env(env, key, source):
    from gyre.envs.base import Task

    state = env.reset(Task("t", 0, (key,)))
    step = asyncio.run(env.answer(state, f"```python\n{source}```"))
    return step, env.milestones(state)


WRONG = {
    "Toy/0": "def mean(xs):\n    return sum(xs) / max(len(xs) - 1, 1)\n",
    "Toy/1": "def uniq(xs):\n    return list(set(xs))\n",  # equal elements, wrong type
    "11": "def sum_sq(xs):\n    return sum(x * abs(x) for x in xs)\n",  # wrong on negatives
    "12": "def words(s):\n    return s.split(' ')\n",
}


@pytest.mark.sandbox
def test_through_the_config_right_solutions_pass_and_wrong_ones_fail(files):
    from gyre.envs.code_chat import CodeChatEnv

    for path in files:
        spec = EnvSpec(name="code", problem_file=path, problem_format="auto")
        env = CodeChatEnv(problem_file=spec.problem_file, problem_format=spec.problem_format)
        for key, problem in env.problems.items():
            step, (done, total) = run_env(env, key, problem.solution)
            assert step.kind == "done" and done == total == len(problem.tests), (key, step.text)
            step, (done, total) = run_env(env, key, WRONG[key])
            assert step.kind == "ok" and done < total, (key, step.text)
    # a wrong answer is named by the example's assert, the hidden ones only counted
    env = CodeChatEnv(problem_file=files[1])
    step, (done, total) = run_env(env, "11", "def sum_sq(xs):\n    return 1\n")
    assert "First failing example: assert sum_sq([1, 2]) == 5  failed." in step.text
    assert (done, total) == (0, 3) and "hidden tests 0/3 passed" in step.text
    # a program that prints result lines of its own (a constant) gets no test
    forged = (
        "import sys\nprint('@@gyre-sandbox@@ loaded')\n"
        + "".join(f"print('@@gyre-sandbox@@ {i} value true')\n" for i in range(3))
        + "import os\nos._exit(0)\n"
    )
    step, (done, total) = run_env(env, "11", forged)
    assert done == 0, step.text


def test_make_env_reads_the_problem_keys(files, monkeypatch):
    from gyre.envs import code_chat

    seen = {}

    class Fake:
        def __init__(self, **kwargs):
            seen.update(kwargs)

    monkeypatch.setattr(code_chat, "CodeChatEnv", Fake)
    from gyre.envs.registry import TEXT_ENVIRONMENTS

    TEXT_ENVIRONMENTS["code"](EnvSpec(name="code", problem_file=files[1], problem_format="mbpp"))
    assert seen["problem_file"] == files[1] and seen["problem_format"] == "mbpp"


@pytest.mark.sandbox
def test_a_config_alone_picks_the_published_set(files):
    """config keys -> the builder's EnvSpec -> the registry's code task on the MBPP file."""
    from gyre.envs.registry import TEXT_ENVIRONMENTS
    from gyre.rl.builder import build_specs

    cfg = default_config()
    cfg.env.name, cfg.env.problem_file, cfg.env.problem_format = "code", files[1], "mbpp"
    cfg.model.hf_dir = "tiny"
    spec = build_specs(cfg).env
    assert (spec.problem_file, spec.problem_format) == (files[1], "mbpp")
    env = TEXT_ENVIRONMENTS["code"](spec)  # what make_env wraps in the chat format
    assert sorted(env.problems) == ["11", "12"]
    step, (done, total) = run_env(env, "12", env.problems["12"].solution)
    assert step.kind == "done" and done == total == 3
