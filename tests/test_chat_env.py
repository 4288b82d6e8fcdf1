"""The chat adapter driven by the real harness: its token records equal Qwen3's template
rendered in one piece; malformed calls are observations; judging, replays and compaction."""

import asyncio
import dataclasses
import json

import numpy as np
import pytest

from gyre.agent.context import AgentSettings
from gyre.agent.harness import run_execution
from gyre.agent.scripted import ScriptedPolicy
from gyre.chat.format import ChatFormat, assistant_message
from gyre.chat.toolcalls import format_tool_call
from gyre.envs.base import Task, ToolCall
from gyre.envs.chat_env import ANSWER, CALLS, MALFORMED, RESUME, SUMMARY, ChatEnvironment
from gyre.envs.text import TextEnvironment, TextStep
from gyre.model.tiny_checkpoint import QWEN3_CHAT_TEMPLATE, train_tokenizer
from gyre.trajectory.records import validate_execution

ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                   "b": {"type": "integer"}}}}}  # fmt: skip


@dataclasses.dataclass
class AdderState:
    task: Task
    a: int
    b: int
    added: bool = False
    answered: bool = False
    wrong: int = 0
    calls: list = dataclasses.field(default_factory=list)
    flaky_left: int = 0


class AdderEnv(TextEnvironment):
    """Add two numbers with the ``add`` tool, then answer. Milestones: added, answered.

    ``flaky``: a tool that raises (an infrastructure error) ``flaky_fails`` times, then works.
    ``fraction``: what ``score`` returns (None: milestones).
    """

    name = "adder"
    system_prompt = "You are a careful agent."
    tools = (ADD_TOOL,)
    tool_timeout = 5.0

    def __init__(self, fraction=None, flaky_fails=0, max_wrong=2):
        self.fraction, self.flaky_fails, self.max_wrong = fraction, flaky_fails, max_wrong
        self.log = []  # every call_tool, across states

    def make_tasks(self, seed, n, split="train"):
        return [Task(f"add-{seed}-{i}", seed + i) for i in range(n)]

    def reset(self, task):
        return AdderState(task, 2 + task.seed % 5, 3, flaky_left=self.flaky_fails)

    def task_text(self, state):
        return f"What is {state.a} + {state.b}? Use the add tool, then answer with the number."

    async def call_tool(self, state, name, arguments):
        state.calls.append((name, arguments))
        self.log.append(name)
        if name == "flaky":
            if state.flaky_left:
                state.flaky_left -= 1
                raise RuntimeError("the tool server is down")
            return TextStep("ok", "flaky worked")
        if name != "add":
            return TextStep("ok", f"unknown tool {name!r}")
        if set(arguments) != {"a", "b"}:
            return TextStep("ok", "add needs integers a and b")
        state.added = True
        return TextStep("ok", str(arguments["a"] + arguments["b"]))

    async def answer(self, state, text):
        if str(state.a + state.b) in text:
            state.answered = True
            return TextStep("done", "Correct.")
        state.wrong += 1
        return TextStep("fail" if state.wrong >= self.max_wrong else "ok", "Wrong, try again.")

    def milestones(self, state):
        return int(state.added) + int(state.answered), 2

    def score(self, state):
        return self.fraction


@pytest.fixture(scope="module")
def chat():
    tok = train_tokenizer()
    stops = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    return ChatFormat(tok, QWEN3_CHAT_TEMPLATE, stops)


class ChatScript(ScriptedPolicy):
    """Replies ``reply(prompt_text)``: canonical tokens and the end-of-turn token."""

    def __init__(self, chat, reply):
        self.chat, self.reply = chat, reply

    def program(self, request):
        text = self.reply(self.chat.decode(request.prompt))
        return [*self.chat.encode(text).tolist(), self.chat.turn_end_id]


def run(env, client, **settings):
    cfg = AgentSettings(**{"max_calls": 20, "context_window": 4096, "max_new_tokens": 96,
                           **settings})  # fmt: skip
    (task,) = env.make_tasks(0, 1)
    res = asyncio.run(run_execution(env, task, client, cfg, "x#0"))
    if res.records:
        validate_execution(res.records, env.vocab_size)
    return res


def one_piece(chat, messages, gen=True):
    return chat.encode(chat.render(messages, [ADD_TOOL], add_generation_prompt=gen))


def conversation(env, res):
    """The first two messages of a run: system and the task."""
    state = env.text_env.reset(res.task)
    return [{"role": "system", "content": env.text_env.system_prompt},
            {"role": "user", "content": env.text_env.task_text(state)}]  # fmt: skip


THINK_ADD = "<think>\nI should call the tool.\n</think>\n\n" + format_tool_call(
    "add", {"a": 2, "b": 3}
)
BROKEN = (
    '<think>\nAgain.\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 2,}\n</tool_call>'
)
THINK_ANSWER = "<think>\nThe tool said 5.\n</think>\n\nThe answer is 5."


def scripted(*turns):
    """Reply with turns[n] where n counts the assistant turns already in the prompt."""
    return lambda text: turns[min(text.count("<|im_start|>assistant") - 1, len(turns) - 1)]


def test_a_tool_loop_through_the_harness_equals_the_one_piece_rendering(chat):
    env = ChatEnvironment(AdderEnv(), chat)
    res = run(env, ChatScript(chat, scripted(THINK_ADD, BROKEN, THINK_ANSWER)))
    assert res.end_reason == "success" and res.score == 1.0 and res.milestones == 2
    assert res.stats["retries"] == 0  # the malformed call was an observation, not a retry
    rec = res.records
    assert len(rec) == 3 and [r.parent_id for r in rec] == [None, 0, 1]
    messages = conversation(env, res)
    assert np.array_equal(rec[0].prompt, one_piece(chat, messages))
    messages += [assistant_message(THINK_ADD), {"role": "tool", "content": "5"}]
    assert np.array_equal(rec[1].prompt, one_piece(chat, messages))
    # The malformed call: its text stays as the turn's content; the error is a tool response.
    error = "Error: tool call 1: invalid JSON"
    assert error in chat.decode(rec[2].prompt[rec[1].prompt.size :])
    (obs_error,) = [t for t in chat.decode(rec[2].prompt).split("<tool_response>\n") if error in t]
    messages += [assistant_message(BROKEN),
                 {"role": "tool", "content": obs_error.split("\n</tool_response>")[0]}]  # fmt: skip
    assert np.array_equal(rec[2].prompt, one_piece(chat, messages))
    for a, b in zip(rec, rec[1:]):  # each prompt extends the previous one by its completion
        assert np.array_equal(b.prompt[: a.prompt.size + a.completion.size],
                              np.concatenate([a.prompt, a.completion]))  # fmt: skip


def test_a_wrong_answer_is_a_user_turn_and_the_stream_stays_exact_without_thinking(chat):
    env = ChatEnvironment(AdderEnv(), chat)
    add = format_tool_call("add", {"a": 2, "b": 3})
    res = run(env, ChatScript(chat, scripted(add, "It is 6.", "It is 5.")))
    assert res.end_reason == "success" and len(res.records) == 3
    messages = conversation(env, res) + [
        assistant_message(add), {"role": "tool", "content": "5"},
        assistant_message("It is 6."), {"role": "user", "content": "Wrong, try again."},
    ]  # fmt: skip
    assert np.array_equal(res.records[2].prompt, one_piece(chat, messages))


@pytest.mark.parametrize("fraction, expected", [(None, 0.5 * 1 / 2), (0.8, 0.5 * 0.8)])
def test_a_failed_execution_gets_the_partial_score(chat, fraction, expected):
    env = ChatEnvironment(AdderEnv(fraction=fraction), chat)
    add = format_tool_call("add", {"a": 2, "b": 3})
    res = run(env, ChatScript(chat, scripted(add, "It is 6.")), partial_scale=0.5)
    assert res.end_reason == "failure" and res.milestones == 1
    assert res.score == pytest.approx(expected)


def test_judge_contract(chat):
    env = ChatEnvironment(AdderEnv(fraction=0.8), chat)
    state = env.reset(Task("t", 0))
    assert env.judge(state, "success", 0.5) == 1.0
    assert env.judge(state, "infra_error", 0.5) is None
    assert env.judge(state, "timeout", 0.5) == pytest.approx(0.4)
    with pytest.raises(ValueError, match="partial_scale"):
        env.judge(state, "failure", 1.0)
    env.text_env.fraction = 1.5
    with pytest.raises(ValueError, match="adder: score\\(\\) returned 1.5"):
        env.judge(state, "failure", 0.5)


def test_an_infra_error_mid_turn_replays_the_calls_that_ran(chat):
    env = ChatEnvironment(AdderEnv(flaky_fails=1), chat)
    two = format_tool_call("add", {"a": 2, "b": 3}) + "\n" + format_tool_call("flaky", {})
    res = run(env, ChatScript(chat, scripted(two, "5")))
    assert res.end_reason == "success" and res.stats["infra_retries"] == 1
    assert env.text_env.log == ["add", "flaky", "flaky"]  # add ran once, not on the retry
    obs = chat.decode(res.records[1].prompt[res.records[0].prompt.size :])
    assert obs.count("<tool_response>") == 2 and "5" in obs and "flaky worked" in obs


def test_replay_runs_each_call_once(chat):
    env = ChatEnvironment(AdderEnv(flaky_fails=1), chat)
    state = env.reset(Task("t", 0))
    call = ToolCall(CALLS, (ToolCall("add", ('{"a": 2, "b": 3}',)), ToolCall("flaky", ("{}",))))
    with pytest.raises(RuntimeError, match="down"):
        asyncio.run(env.step(state, call, "main"))
    result = asyncio.run(env.step(state, call, "main"))
    assert result.kind == "ok" and [n for n, _ in state.inner.calls] == ["add", "flaky", "flaky"]
    assert state.partial is None


def test_parse(chat):
    env = ChatEnvironment(AdderEnv(), chat)

    def comp(text, stop=True):
        body = chat.encode(text).tolist()
        return np.asarray(body + [chat.turn_end_id] if stop else body, np.int32)

    add = format_tool_call("add", {"a": 2, "b": 3})
    assert env.parse(comp(add), "main") == ToolCall("add", ('{"a": 2, "b": 3}',))
    assert env.parse(comp(add, stop=False), "main") is None
    assert env.parse(comp("<think>\nhm\n</think>\n\n5"), "main") == ToolCall(ANSWER, ("5",))
    keep = ChatEnvironment(AdderEnv(), ChatFormat(chat.tokenizer, QWEN3_CHAT_TEMPLATE,
                                                  chat.stop_ids, keep_thinking=True))  # fmt: skip
    assert keep.parse(comp("<think>\nhm\n</think>\n\n5"), "main").args == (
        "<think>\nhm\n</think>\n\n5",
    )
    two = env.parse(comp(add + "\n" + add), "main")
    assert two.name == CALLS and len(two.args) == 2
    bad = env.parse(comp(format_tool_call(ANSWER, {"text": "5"})), "main")
    assert bad == ToolCall(MALFORMED, ("unknown tool '<answer>'",))
    assert env.parse(comp("<tool_call>\n{"), "main").name == MALFORMED
    assert env.parse(comp("<think>\nx\n</think>\n\nDone so far."), "main-summary") == ToolCall(
        SUMMARY, ("Done so far.",)
    )
    assert env.parse(comp("x"), "sub-agent") is None
    assert env.vocab_size == chat.vocab_size and env.stop_tokens == chat.stop_ids
    assert env.tool_timeout == 5.0


def test_model_written_summary_compacts_to_a_well_formed_chat(chat):
    env = ChatEnvironment(AdderEnv(), chat)
    add = format_tool_call("add", {"a": 2, "b": 3})
    summary = "I called add(2, 3) and got 5."

    def reply(text):
        if text.endswith(env.summary_request_text + "<|im_end|>\n<|im_start|>assistant\n"):
            return summary
        return "The answer is 5." if "<tool_response>" in text or summary in text else add

    state = env.reset(env.make_tasks(0, 1)[0])
    prefix, request = env.task_prompt(state), env.summary_request("main-summary")
    turn = chat.encode(add).size + 1 + chat.tool_responses(["5"]).size
    m = 96  # max_new_tokens: compact after the first turn, while the summary call still fits
    window = prefix.size + request.size + 3 * m + turn // 2
    res = run(env, ChatScript(chat, reply), context_window=window, model_summary=True)
    assert res.end_reason == "success" and res.stats["compactions"] == 1
    roles = [r.role for r in res.records]
    assert roles == ["main", "main-summary", "main"]
    base = conversation(env, res)
    ask = {"role": "user", "content": env.summary_request_text}
    messages = base + [assistant_message(add), {"role": "tool", "content": "5"},
                       {"role": "assistant", "content": ""}, ask]  # fmt: skip
    assert np.array_equal(res.records[1].prompt, one_piece(chat, messages))
    resume = RESUME.replace("{summary}", "Progress so far: 1/2 milestones.")
    messages = base + [{"role": "assistant", "content": ""}, ask,
                       {"role": "assistant", "content": summary},
                       {"role": "user", "content": resume}]  # fmt: skip
    assert np.array_equal(res.records[2].prompt, one_piece(chat, messages))


def test_harness_written_summary_is_a_user_turn(chat):
    env = ChatEnvironment(AdderEnv(), chat)
    add = format_tool_call("add", {"a": 2, "b": 3})
    state = env.reset(env.make_tasks(0, 1)[0])
    prefix = env.task_prompt(state)
    turn = chat.encode(add).size + 1 + chat.tool_responses(["5"]).size
    written = env.summary(state, "main").size  # "0/2" here, "1/2" then: as many tokens
    assert written < turn
    window = prefix.size + 96 + written  # the second call does not fit; the summary does
    res = run(env, ChatScript(chat, scripted(add, "5")), context_window=window)
    assert res.end_reason == "success" and res.stats["compactions"] == 1
    messages = conversation(env, res) + [
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "Progress so far: 1/2 milestones."},
    ]
    assert np.array_equal(res.records[1].prompt, one_piece(chat, messages))


def test_a_raising_tool_beyond_the_retries_is_an_infra_error_without_score(chat):
    env = ChatEnvironment(AdderEnv(flaky_fails=10), chat)
    res = run(env, ChatScript(chat, scripted(format_tool_call("flaky", {}))))
    assert res.end_reason == "infra_error" and res.score is None


def test_unknown_tool_and_bad_arguments_reach_the_text_env(chat):
    env = ChatEnvironment(AdderEnv(), chat)
    state = env.reset(Task("t", 0))
    call = env.parse(np.append(chat.encode(format_tool_call("mul", {"x": 1})), chat.turn_end_id),
                     "main")  # fmt: skip
    result = asyncio.run(env.step(state, call, "main"))
    assert result.kind == "ok" and "unknown tool 'mul'" in chat.decode(result.obs)
    assert state.inner.calls == [("mul", {"x": 1})] and json.loads(call.args[0]) == {"x": 1}


# ---- the calculator task (gyre/envs/calc_chat.py) and its demonstrator -----------------------


def test_tool_calls_and_malformed_turns_are_counted_in_the_execution_stats(chat):
    env = ChatEnvironment(AdderEnv(), chat)
    res = run(env, ChatScript(chat, scripted(THINK_ADD, BROKEN, THINK_ANSWER)))
    assert res.stats["tool_calls"] == 1 and res.stats["malformed_calls"] == 1
    from gyre.envs.chat_env import tool_metrics

    m = tool_metrics([res, res], "eval_")
    assert m == {"eval_tool_calls": 2, "eval_tool_use": 1.0, "eval_malformed_calls": 2}
    assert tool_metrics([]) == {}


def test_calculator_evaluates_integer_arithmetic_only():
    from gyre.envs.calc_chat import evaluate_expression

    assert evaluate_expression("347 * 82") == 28454
    assert evaluate_expression(" (12 - 30) * -2 + 1") == 37
    for bad in ("2 ** 8", "1 / 2", "__import__('os')", "x", "1.5 + 1", "", "1 +", "9" * 70):
        with pytest.raises(ValueError):
            evaluate_expression(bad)


def test_calc_answer_rule():
    from gyre.envs.calc_chat import read_answer

    assert read_answer("28454") == 28454
    assert read_answer("Let me see.\n<answer>-12</answer>\n") == -12
    assert read_answer("1,234") == 1234
    assert read_answer("28454 is it") is None and read_answer("") is None


def test_calc_splits_are_disjoint_and_seeded():
    from gyre.envs.calc_chat import CalcEnv

    env = CalcEnv()
    train, held = env.make_tasks(3, 300), env.make_tasks(3, 300, "eval")
    assert all((a + b) % 2 == 0 for a, _, b in (t.params for t in train))
    assert all((a + b) % 2 == 1 for a, _, b in (t.params for t in held))
    assert [t.params for t in train] == [t.params for t in env.make_tasks(3, 300)]
    assert {op for _, op, _ in (t.params for t in train)} == {"+", "-", "*"}
    assert all(10 <= a < 1000 and 10 <= b < 1000 for a, _, b in (t.params for t in train))


def test_calc_right_answer_ranks_above_every_wrong_one():
    from gyre.envs.calc_chat import CalcEnv

    env = CalcEnv()
    for task in env.make_tasks(0, 50):
        right = env.reset(task).value
        scores = {}
        for reply in (str(right), str(right + 1), str(right * 10), f"{right} or so", "no idea",
                      str(right)[:-1] or "0", f"<answer>{right}</answer>"):  # fmt: skip
            state = env.reset(task)
            step = asyncio.run(env.answer(state, reply))
            scores[reply] = (step.kind, env.score(state), env.milestones(state))
        assert scores[str(right)] == ("done", 1.0, (1, 1))
        assert scores[f"<answer>{right}</answer>"] == ("done", 1.0, (1, 1))
        wrong = [v for k, v in scores.items() if k not in (str(right), f"<answer>{right}</answer>")]
        assert all(v == ("fail", 0.0, (0, 1)) for v in wrong)


def test_calc_expert_demonstrations_call_the_tool_about_half_the_time(chat):
    from gyre.envs.calc_chat import CalcEnv
    from gyre.rl.demos import chat_demo_executions

    env = ChatEnvironment(CalcEnv(), chat)
    demos = chat_demo_executions(env, seed=1, n=40, direct_prob=0.5, context_window=1024)
    calls = [len(d.records) for d in demos]
    assert all(d.end_reason == "success" for d in demos) and set(calls) == {1, 2}
    assert 10 <= calls.count(2) <= 30  # with the tool: a call, then the copied result
    tool = next(d for d in demos if len(d.records) == 2)
    text = chat.decode(tool.records[0].completion)
    a, op, b = tool.task.params
    assert text == format_tool_call("calculator", {"expression": f"{a} {op} {b}"}) + "<|im_end|>"
    for d in demos:
        validate_execution(d.records, env.vocab_size)
        assert all(m.shape == r.completion.shape and m.min() == 1.0
                   for m, r in zip(d.loss_masks, d.records))  # fmt: skip
    never = chat_demo_executions(env, seed=1, n=8, direct_prob=0.0, context_window=1024)
    assert all(len(d.records) == 2 for d in never)


def test_calc_demonstrations_pack_for_the_warm_start_and_key_its_cache(chat):
    import experiments.chat_quickstart as chat_quickstart
    from gyre.envs.calc_chat import CalcEnv
    from gyre.rl.builder import build_specs
    from gyre.rl.warmstart import demo_batch, fingerprint

    recipe = build_specs(chat_quickstart.get_config()).sft.recipe
    env = ChatEnvironment(CalcEnv(), chat)
    batch = demo_batch(recipe, seed=0, n=6, env=env)
    assert float(np.asarray(batch.w).sum()) > 0
    with pytest.raises(ValueError, match="needs the run's chat environment"):
        demo_batch(recipe, seed=0, n=6)
    # the tokenizer that makes the demonstrations' tokens is part of the cache key
    assert fingerprint(recipe, env) != fingerprint(recipe)
