"""Rewards that rank, for every registered task family (gyre/envs/registry.py): the answer is
read by the family's stated rule, a right answer always earns more than any wrong one, and a
right answer written inside a sentence never earns less than a wrong one.

The reward paid is the judge's (``Environment.judge`` / ``ChatEnvironment.judge``): 1 for
success, else ``partial_scale`` times the task's own score or milestone fraction."""

import asyncio
import importlib.util
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.envs.base import Task, ToolCall
from gyre.envs.registry import ENVIRONMENTS

PARTIAL = 0.5
FAMILIES = {"ledger", "code_bytes", "code", "reasoning_gym", "template", "calc"}


def test_every_registered_family_is_covered_here():
    assert set(ENVIRONMENTS) == FAMILIES, "a new family needs its ranking test in this file"


def paid(kind: str, score, milestones) -> float:
    """What ChatEnvironment.judge pays a text environment's ending (tests/test_chat_env.py)."""
    if kind == "done":
        return 1.0
    if score is not None:
        return PARTIAL * score
    done, total = milestones
    return PARTIAL * done / max(total, 1)


# ------------------------------------------------------------------------------ reasoning_gym
NUMERIC = ("basic_arithmetic", "chain_sum", "gcd", "lcm", "count_bits", "leg_counting")


@pytest.fixture(scope="module")
def rg():
    from gyre.envs.reasoning_gym_env import ReasoningGymEnv

    return ReasoningGymEnv(",".join(NUMERIC))


def _rg_paid(env, task, text):
    state = env.reset(task)
    step = asyncio.run(env.answer(state, text))
    return paid(step.kind, env.score(state), env.milestones(state)), state


def _wrong_numbers(oracle: str, draw) -> list[str]:
    """Wrong numbers, several of which contain the right digits ("740" for 74)."""
    n = int(oracle)
    delta = draw(st.integers(1, 1000)) * draw(st.sampled_from([-1, 1]))
    texts = [str(n + delta), oracle + "0", "1" + oracle, oracle + oracle[-1], f"{oracle}.5",
             f"-{oracle}", f"{n * 10}", "1" + oracle.lstrip("-")]  # fmt: skip
    return [t for t in texts if _number(t) not in (None, n)]


def _number(text: str):
    try:
        return float(text)
    except ValueError:
        return None


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_reasoning_gym_right_beats_every_wrong_number(rg, data):
    seed = data.draw(st.integers(0, 10_000))
    task = rg.make_tasks(seed, len(NUMERIC))[data.draw(st.integers(0, len(NUMERIC) - 1))]
    oracle = rg.reset(task).entry["answer"]
    right, _ = _rg_paid(rg, task, f"Reasoning...\n<answer>{oracle}</answer>")
    in_sentence, _ = _rg_paid(rg, task, f"So the result is {oracle}, I think.")
    assert right == 1.0
    for wrong in _wrong_numbers(oracle, data.draw):
        for text in (f"<answer>{wrong}</answer>", wrong, f"the answer is {wrong}"):
            got, state = _rg_paid(rg, task, text)
            assert state.answer != oracle and state.verifier_score < 1.0, (oracle, wrong)
            assert got < right and got <= in_sentence, (task.params, oracle, wrong, got)


def test_reasoning_gym_the_issue_case_740_for_74(rg):
    # basic_arithmetic's verifier pays 0.67 for "740" when 74 is right (substring overlap):
    # recorded, never paid.
    for task in rg.make_tasks(0, 60):
        state = rg.reset(task)
        if state.name == "basic_arithmetic" and len(state.entry["answer"]) >= 2:
            break
    oracle = state.entry["answer"]
    wrong, state = _rg_paid(rg, task, f"<answer>{oracle}0</answer>")
    sentence, _ = _rg_paid(rg, task, f"It comes to {oracle} apples")
    assert state.verifier_score > 0.5 and wrong == 0.0 and sentence >= wrong


# ------------------------------------------------------------------------------------ template
@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 10_000), adds=st.integers(0, 3), delta=st.integers(1, 50),
       sign=st.sampled_from([-1, 1]))  # fmt: skip
def test_template_right_total_beats_any_wrong_total(seed, adds, delta, sign):
    from gyre.envs.template import TemplateEnv

    env = TemplateEnv()
    task = env.make_tasks(seed, 1)[0]

    def run(answer_text):
        state = env.reset(task)
        for x in state.numbers[:adds]:  # the same tool calls on both sides
            asyncio.run(env.call_tool(state, "add", {"x": x}))
        step = asyncio.run(env.answer(state, answer_text))
        return paid(step.kind, env.score(state), env.milestones(state))

    total = sum(env.reset(task).numbers)
    right, wrong = run(str(total)), run(str(total + sign * delta))
    sentence = run(f"The total is {total}.")  # the rule: the whole reply is the answer
    assert right == 1.0 > wrong and sentence >= wrong


# ---------------------------------------------------------------------------------------- calc
@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 10_000), delta=st.integers(-10_000, 10_000),
       tool=st.booleans(), prose=st.sampled_from(["", "The product is below.\n"]))  # fmt: skip
def test_calc_right_answer_beats_any_wrong_number(seed, delta, tool, prose):
    from gyre.envs.calc_chat import CalcEnv

    env = CalcEnv()
    task = env.make_tasks(seed, 1, split="train" if seed % 2 else "eval")[0]
    a, op, b = task.params

    def run(answer_text):
        state = env.reset(task)
        if tool:  # the same tool call on both sides
            asyncio.run(env.call_tool(state, "calculator", {"expression": f"{a} {op} {b}"}))
        step = asyncio.run(env.answer(state, prose + answer_text))
        return paid(step.kind, env.score(state), env.milestones(state))

    right = env.reset(task).value  # the rule: the reply's last line, read as an integer
    assert run(str(right)) == 1.0
    if delta:
        assert run(str(right + delta)) < 1.0


# -------------------------------------------------------------------------------------- ledger
@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**31 - 2), plan=st.lists(
    st.tuples(st.integers(1, 4), st.integers(0, 9)), max_size=8))  # fmt: skip
def test_ledger_right_commits_never_earn_less_than_wrong_ones(seed, plan):
    from gyre.envs.ledger import LedgerEnv

    env = LedgerEnv(num_ops=4, modulus=10, max_wrong=2)
    task = Task("t", seed)

    def run(commits):
        state = env.reset(task)
        kind = "ok"
        for i, d in commits:
            kind = asyncio.run(env.step(state, ToolCall("commit", (i, d)), "main")).kind
            if kind in ("done", "fail"):
                break
        end = "success" if kind == "done" else "failure"
        return env.judge(state, end, PARTIAL)

    values = env.reset(task).values
    corrected = [(i, int(values[i - 1])) for i, _ in plan]
    assert run(corrected) >= run(plan)
    every = [(i, int(values[i - 1])) for i in range(1, 5)]
    assert run(every) == 1.0
    if any(d != values[i - 1] for i, d in plan):
        assert run(plan) < 1.0 or len({i for i, d in plan if d == values[i - 1]}) == 4


# ---------------------------------------------------------------------------------- code tasks
def _mutants_module():
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks", "mutants.py")
    spec = importlib.util.spec_from_file_location("gyre_bench_mutants", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _wrong_versions(solution: str, name: str) -> list[str]:
    mutants = _mutants_module().mutants
    return [source for _, source in mutants(solution)][:6] + [
        f"def {name}(*args):\n    return None\n"
    ]


@pytest.mark.sandbox
def test_code_chat_reference_beats_its_mutants_and_prose_does_not_hurt():
    from gyre.envs.code_chat import CodeChatEnv

    env = CodeChatEnv()
    rng = np.random.default_rng(0)
    names = sorted(env.problems)
    for name in rng.choice(names, 4, replace=False):
        p = env.problems[name]

        def run(text, name=name):
            state = env.reset(Task("t", 0, (name,)))
            step = asyncio.run(env.answer(state, text))
            return paid(step.kind, env.score(state), env.milestones(state))

        right = run(f"```python\n{p.solution}```")
        prose = run(
            f"Here is my solution, it handles every case:\n```python\n{p.solution}```\nDone."
        )
        assert right == prose == 1.0
        for wrong in _wrong_versions(p.solution, p.name):
            got = run(f"```python\n{wrong}```")
            assert (
                got <= right
            )  # a mutant that fails a hidden test earns less (benchmarks/mutants.py)
        assert run(f"```python\ndef {p.name}(*a):\n    return None\n```") < right


@pytest.mark.sandbox
def test_code_bytes_reference_beats_a_wrong_one():
    from gyre.envs.code import PROBLEMS, CodeEnv

    env = CodeEnv()
    for name, (_, _, _tests, solution) in PROBLEMS.items():

        def run(source, name=name):
            state = env.reset(Task("t", 0, (name,)))
            asyncio.run(env.step(state, ToolCall("write_file", (source,)), "main"))
            step = asyncio.run(env.step(state, ToolCall("run_tests"), "main"))
            end = "success" if step.kind == "done" else "failure"
            return env.judge(state, end, PARTIAL)

        assert run(solution) == 1.0
        assert run(f"def {name}(*args):\n    return None\n") < 1.0
        for wrong in _wrong_versions(solution, name)[:3]:
            assert run(wrong) <= 1.0
