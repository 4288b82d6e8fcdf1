"""ReasoningGymEnv on two real reasoning-gym tasks: deterministic disjoint splits, answer
extraction, the verifier's right / wrong / partial scores, and clear errors."""

import asyncio
import dataclasses

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from gyre.envs.base import Task
from gyre.envs.reasoning_gym_env import SPLIT_SEEDS, ReasoningGymEnv, dataset_names, extract_answer

NAMES = ("basic_arithmetic", "chain_sum")


def answer(env, state, text):
    return asyncio.run(env.answer(state, text))


@pytest.fixture(scope="module")
def env():
    return ReasoningGymEnv(",".join(NAMES))


def test_both_task_names_exist_in_the_installed_package():
    assert set(NAMES) <= set(dataset_names()) and len(dataset_names()) > 50


def test_make_tasks_is_deterministic_cycles_names_and_splits_by_disjoint_seeds(env):
    tasks = env.make_tasks(3, 40)
    assert tasks == env.make_tasks(3, 40) and tasks != env.make_tasks(4, 40)
    assert [t.params[0] for t in tasks[:4]] == [*NAMES, *NAMES]
    held_out = env.make_tasks(3, 40, "eval")
    assert all(0 <= t.seed < 2**31 for t in tasks) and all(
        2**31 <= t.seed < 2**32 for t in held_out
    )
    assert SPLIT_SEEDS["train"][1] <= SPLIT_SEEDS["eval"][0]
    # A task is a pure function of (name, seed): a fresh environment regenerates the same text.
    again = ReasoningGymEnv(list(NAMES))
    texts = [env.task_text(env.reset(t)) for t in tasks[:6]]
    assert texts == [again.task_text(again.reset(t)) for t in tasks[:6]]
    assert texts[0].startswith("Calculate") and "arithmetic problem" in texts[1]
    assert len(set(texts)) == 6
    with pytest.raises(ValueError, match="split must be one of"):
        env.make_tasks(0, 2, "test")
    with pytest.raises(ValueError, match="'leg_counting' is not one of"):
        env.reset(Task("x", 5, ("leg_counting",)))


def test_a_right_answer_is_done_with_score_one(env):
    for task in env.make_tasks(11, 4, "eval"):
        state = env.reset(task)
        assert env.score(state) is None and env.milestones(state) == (0, 1)
        step = answer(env, state, f"Let me think.\n<answer> {state.entry['answer']} </answer>")
        assert step.kind == "done" and env.score(state) == 1.0 and env.milestones(state) == (1, 1)


def test_a_wrong_answer_fails_with_score_zero(env):
    state = env.reset(env.make_tasks(12, 1)[0])
    wrong = str(int(state.entry["answer"]) + 1)
    step = answer(
        env, state, f"<answer>{state.entry['answer']}</answer> no wait\n<answer>{wrong}</answer>"
    )
    assert step.kind == "fail" and state.answer == wrong
    assert env.score(state) == 0.0 and env.milestones(state) == (0, 1)


def test_a_verifier_fraction_is_recorded_but_never_paid(env):
    # basic_arithmetic's verifier pays an answer that contains the right one by the length
    # ratio; that ratio would rank "740" (for 74) above "74 apples": it is recorded, not paid.
    state = env.reset(env.make_tasks(13, 1)[0])
    assert state.name == "basic_arithmetic"
    right = state.entry["answer"]
    step = answer(env, state, f"so it is\n{right} apples")  # no tags: the last line is graded
    assert step.kind == "fail" and state.answer == f"{right} apples"
    assert state.verifier_score == pytest.approx(len(right) / len(f"{right} apples"))
    assert env.score(state) == 0.0 and env.milestones(state) == (0, 1)
    # chain_sum's verifier tolerates a trailing '.0': its own judgement, not string equality.
    state = env.reset(env.make_tasks(13, 2)[1])
    assert state.name == "chain_sum"
    assert answer(env, state, f"<answer>{state.entry['answer']}.0</answer>").kind == "done"


def test_a_verifier_that_fails_or_misbehaves_scores_zero(env):
    class Raising:
        def score_answer(self, answer, entry):
            raise TypeError("cannot parse")

    class NotANumber:
        def score_answer(self, answer, entry):
            return float("nan")

    base = env.reset(env.make_tasks(14, 1)[0])
    state = dataclasses.replace(base, dataset=Raising())
    assert answer(env, state, "<answer>1</answer>").kind == "fail"
    assert env.score(state) == 0.0 and state.score_error == "TypeError: cannot parse"
    state = dataclasses.replace(base, dataset=NotANumber())
    assert answer(env, state, "<answer>1</answer>").kind == "fail" and env.score(state) == 0.0


def test_tool_calls_are_answered_with_a_note(env):
    state = env.reset(env.make_tasks(15, 1)[0])
    step = asyncio.run(env.call_tool(state, "calculator", {"x": 1}))
    assert step.kind == "ok" and "no tools" in step.text and env.tools == ()
    assert "<answer>" in env.system_prompt and "last non-empty line" in env.system_prompt


def test_unknown_names_and_bad_settings_give_one_clear_error():
    with pytest.raises(ValueError) as info:
        ReasoningGymEnv("basic_arithmetc, no_such_task")
    text = str(info.value)
    assert "['basic_arithmetc', 'no_such_task']" in text and "did you mean basic_arithmetic" in text
    assert "Valid names include" in text and f"({len(dataset_names())} in all" in text
    with pytest.raises(ValueError, match="unknown reasoning-gym task name"):
        ReasoningGymEnv("chain_sum", {"chian_sum": {}})
    with pytest.raises(ValueError, match="'chain_sum' with settings {'bogus': 1}"):
        ReasoningGymEnv("chain_sum", {"chain_sum": {"bogus": 1}})
    with pytest.raises(ValueError, match=r"\['seed'\] are set per task"):
        ReasoningGymEnv("chain_sum", {"chain_sum": {"seed": 1}})
    with pytest.raises(ValueError, match="must be non-empty names"):
        ReasoningGymEnv("")


def test_settings_reach_the_generator():
    env = ReasoningGymEnv(
        ["chain_sum"],
        {"chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}},
    )
    for task in env.make_tasks(0, 5):
        assert env.reset(task).entry["metadata"]["num_terms"] == 2


def test_answer_extraction_rules():
    assert extract_answer("a <answer>1</answer> b <answer> 2 \n</answer> c") == "2"
    assert extract_answer("thinking...\n<answer>\nmulti\nline\n</answer>") == "multi\nline"
    assert extract_answer("cut off <answer> 42") == "42"
    assert extract_answer("first\n  last line  \n\n") == "last line"
    assert extract_answer("") == "" and extract_answer("\n \n") == ""


@settings(max_examples=200, deadline=None)
@given(prefix=st.text(max_size=40), answer=st.text(max_size=20))
def test_the_last_tagged_answer_is_graded_whatever_surrounds_it(prefix, answer):
    assume(not any(tag in prefix + answer for tag in ("<answer>", "</answer>")))
    assert extract_answer(f"{prefix}<answer>{answer}</answer>\nok") == answer.strip()
