"""CodeChatEnv: tools, reports that never leak hidden tests, milestones, endings, bad arguments,
replies without tool calls. Tool calls that run tests use the real sandbox."""

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.envs import sandbox
from gyre.envs.base import Task
from gyre.envs.code_chat import CodeChatEnv, code_block
from gyre.envs.code_problems import load_problems, split_names
from gyre.envs.sandbox import SandboxLimits, SandboxUnavailable

PROBLEMS = load_problems()
TASK = Task("caesar", 0, ("caesar_shift",))
CAESAR = PROBLEMS["caesar_shift"]
LOWER_ONLY = (  # passes the visible example, fails the hidden tests with capitals: 2 of 6 pass
    "def caesar_shift(s, k):\n"
    "    return ''.join(chr((ord(c) - 97 + k) % 26 + 97) if c.islower() else c for c in s)\n"
)
IDENTITY = "def caesar_shift(s, k):\n    return s\n"  # fails the example; 2 hidden pass
EMPTY = "def caesar_shift(s, k):\n    return ''\n"  # fails the example; 1 hidden passes


def call(env, state, name, **arguments):
    return asyncio.run(env.call_tool(state, name, arguments))


def hidden_leaks(texts, problem, prompt):
    """Reprs of hidden inputs or expected values (not already in the prompt) found in texts."""
    found = []
    for args, expected in problem.tests:
        for value in (*args, expected):
            r = repr(value)
            if len(r) >= 5 and r not in prompt and any(r in t for t in texts):
                found.append(r)
    return found


def test_code_blocks_are_found_python_first():
    assert code_block("text ```python\na = 1\n``` and ```\nb = 2\n```") == "a = 1\n"
    assert code_block("```py\nx\n```\n```python3\ny\n```") == "y\n"
    assert code_block("```\nonly = 1\n```") == "only = 1\n"
    assert code_block("```bash\nls\n```") is None
    assert code_block("no code, or ``` unterminated\nx") is None


def test_nothing_runs_unconfined_where_the_sandbox_is_unavailable(monkeypatch):
    monkeypatch.setattr(sandbox, "isolation_available", lambda: (False, "no bwrap here"))
    with pytest.raises(SandboxUnavailable, match="no bwrap here"):
        CodeChatEnv()


@pytest.mark.sandbox
def test_tools_and_tasks_come_from_the_split():
    env = CodeChatEnv()
    assert [t["function"]["name"] for t in env.tools] == ["write_file", "run_tests", "read_file"]
    assert env.tools[0]["function"]["parameters"]["required"] == ["content"]
    train, held_out = split_names(PROBLEMS, "train"), split_names(PROBLEMS, "eval")
    tasks = env.make_tasks(7, 2 * len(train))
    names = [t.params[0] for t in tasks]
    assert sorted(names) == sorted(train * 2)  # two shuffled passes over the train problems
    assert tasks == env.make_tasks(7, 2 * len(train)) and names != [
        t.params[0] for t in env.make_tasks(8, len(names))
    ]
    assert {t.params[0] for t in env.make_tasks(7, 50, "eval")} == set(held_out)
    assert len({t.task_id for t in tasks}) == len(tasks)
    with pytest.raises(ValueError, match="split must be one of"):
        env.make_tasks(0, 3, "test")
    with pytest.raises(ValueError, match="unknown code problem 'nope'"):
        env.reset(Task("x", 0, ("nope",)))


@pytest.mark.sandbox
def test_prompt_shows_examples_but_no_hidden_test():
    env = CodeChatEnv()
    prompt = env.task_text(env.reset(TASK))
    assert "def caesar_shift(s: str, k: int) -> str:\n" in prompt and CAESAR.description in prompt
    assert "caesar_shift('abc xyz', 3) == 'def abc'" in prompt
    assert not hidden_leaks([prompt], CAESAR, "")
    assert hidden_leaks([f"got {CAESAR.tests[0][1]!r}"], CAESAR, "")  # the check itself works


@pytest.mark.sandbox
def test_write_read_run_report_only_visible_failures_and_keep_the_best_run():
    env = CodeChatEnv()
    state = env.reset(TASK)
    prompt = env.task_text(state)
    texts = [call(env, state, "read_file").text]
    assert "does not exist yet" in texts[0]
    step = call(env, state, "run_tests")
    assert step.kind == "ok" and "Nothing to test" in step.text and state.runs == 0
    step = call(env, state, "write_file", content=LOWER_ONLY)
    assert (step.kind, step.text) == ("ok", f"Wrote solution.py ({len(LOWER_ONLY)} bytes).")
    assert call(env, state, "read_file").text == f"solution.py:\n{LOWER_ONLY}"
    step = call(env, state, "run_tests")
    texts.append(step.text)
    assert step.kind == "ok" and step.text == (
        "Test run 1 of 8: examples 1/1 passed, hidden tests 2/6 passed.\n"
        "Every example passes; the failing hidden tests stay hidden."
    )
    assert env.milestones(state) == (2, 6)
    call(env, state, "write_file", content=IDENTITY)
    step = call(env, state, "run_tests")
    texts.append(step.text)
    assert step.text == (
        "Test run 2 of 8: examples 0/1 passed, hidden tests 2/6 passed.\n"
        "First failing example: caesar_shift('abc xyz', 3) returned 'abc xyz', expected 'def abc'."
    )
    call(env, state, "write_file", content=EMPTY)
    texts.append(call(env, state, "run_tests").text)
    assert "hidden tests 1/6 passed" in texts[-1]
    assert env.milestones(state) == (2, 6) and state.runs == 3  # the best single run counts
    call(env, state, "write_file", content="def caesar_shift(s, k):\n    raise KeyError(s)\n")
    texts.append(call(env, state, "run_tests").text)
    assert "caesar_shift('abc xyz', 3) raised KeyError, expected 'def abc'" in texts[-1]
    texts.append(env.summary_text(state))
    assert "2/6 hidden tests" in texts[-1] and "raise KeyError(s)" in texts[-1]
    assert not hidden_leaks(texts, CAESAR, prompt)


@pytest.mark.sandbox
def test_all_tests_passing_is_done_and_running_out_of_runs_is_fail():
    env = CodeChatEnv(max_runs=2)
    state = env.reset(TASK)
    call(env, state, "write_file", content=CAESAR.solution)
    step = call(env, state, "run_tests")
    assert step.kind == "done" and "All tests pass" in step.text
    assert env.milestones(state) == (6, 6) and state.solved

    state = env.reset(TASK)
    call(env, state, "write_file", content=LOWER_ONLY)
    assert call(env, state, "run_tests").kind == "ok"
    step = call(env, state, "run_tests")
    assert step.kind == "fail" and step.text.endswith("No test runs left.")
    assert env.milestones(state) == (2, 6) and not state.solved


@pytest.mark.sandbox
def test_code_that_hangs_or_does_not_load_is_reported_and_counts_as_a_run():
    env = CodeChatEnv(limits=SandboxLimits(wall_seconds=0.5))
    state = env.reset(TASK)
    call(env, state, "write_file", content="def caesar_shift(s, k):\n    while True: pass\n")
    step = call(env, state, "run_tests")
    assert (
        step.kind == "ok"
        and "did not run to completion (timeout: killed after 0.5 s wall)" in step.text
    )
    call(env, state, "write_file", content="def caesar_shift(s, k:\n")
    step = call(env, state, "run_tests")
    assert (
        "did not run to completion (error: could not load the solution: SyntaxError)" in step.text
    )
    assert state.runs == 2 and env.milestones(state) == (0, 6)


@pytest.mark.sandbox
def test_bad_tool_calls_say_what_is_wrong_and_change_nothing():
    env = CodeChatEnv(max_file_bytes=64)
    state = env.reset(TASK)
    cases = [
        ("delete_file", {}, "Error: unknown tool 'delete_file'; the tools are write_file(content)"),
        ("write_file", {}, "Error: write_file takes 'content'; missing ['content']."),
        ("write_file", {"content": "x", "mode": "a"}, "Error: write_file takes 'content'; unexpected ['mode']."),
        ("write_file", {"content": 42}, "Error: write_file's 'content' must be a string, got int."),
        ("write_file", {"content": "#" * 65}, "Error: solution.py may hold at most 64 bytes, got 65"),
        ("run_tests", {"verbose": True}, "Error: run_tests takes no arguments; unexpected ['verbose']."),
        ("read_file", {"path": "x"}, "Error: read_file takes no arguments; unexpected ['path']."),
    ]  # fmt: skip
    for name, arguments, message in cases:
        step = asyncio.run(env.call_tool(state, name, arguments))
        assert step.kind == "ok" and step.text.startswith(message), (name, step.text)
    step = asyncio.run(env.call_tool(state, "write_file", ["not", "a", "dict"]))
    assert step.text == "Error: the arguments of write_file must be a JSON object, got list."
    assert (state.file, state.runs) == (None, 0)


@pytest.mark.sandbox
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(["write_file", "read_file", "run_tests", "", "x" * 3]),
    arguments=st.dictionaries(
        st.text(max_size=8),
        st.none() | st.integers() | st.text(max_size=80),
        min_size=1,
        max_size=3,
    )
    | st.lists(st.integers(), max_size=2),
)
def test_any_arguments_give_an_ok_step_never_an_exception(name, arguments):
    env = CodeChatEnv(max_file_bytes=64)
    state = env.reset(TASK)
    if name == "run_tests" and arguments == {}:
        return  # a real test run: covered above
    step = asyncio.run(env.call_tool(state, name, arguments))
    assert step.kind == "ok" and step.text and state.runs == 0
    valid = (
        name == "write_file" and isinstance(arguments, dict) and set(arguments) == {"content"}
        and isinstance(arguments["content"], str) and len(arguments["content"].encode()) <= 64
    )  # fmt: skip
    assert state.file == (arguments["content"] if valid else None)


@pytest.mark.sandbox
def test_a_reply_without_a_tool_call_writes_and_tests_its_code_block():
    env = CodeChatEnv(max_file_bytes=512)
    state = env.reset(TASK)
    answer = lambda text: asyncio.run(env.answer(state, text))  # noqa: E731
    step = answer("I am not sure.")
    assert step.kind == "ok" and "no ```python block" in step.text and state.file is None
    assert "at most 512 bytes" in answer("```\n" + "#" * 600 + "\n```").text
    assert state.file is None and state.runs == 0
    step = answer(f"Try:\n```python\n{LOWER_ONLY}```")
    assert step.kind == "ok" and state.file == LOWER_ONLY and state.runs == 1
    assert "Call run_tests() to test solution.py" in answer("All done!").text
    step = answer(f"Here it is:\n```python\n{CAESAR.solution}```\nDone.")
    assert step.kind == "done" and state.file == CAESAR.solution and state.runs == 2
