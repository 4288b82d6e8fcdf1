"""The template environment (gyre/envs/template.py, the file README's "How to add an
environment" says to copy) runs as is: registered, its splits disjoint, and an execution
through the chat adapter and the harness succeeds, fails, and earns partial credit."""

from __future__ import annotations

import asyncio

import pytest

from gyre.agent.context import AgentSettings
from gyre.agent.harness import run_execution
from gyre.agent.scripted import ScriptedPolicy
from gyre.chat.format import ChatFormat
from gyre.chat.toolcalls import format_tool_call
from gyre.envs.registry import ENVIRONMENTS, EnvSpec, is_chat, make_env
from gyre.envs.template import TemplateEnv
from gyre.model.tiny_checkpoint import QWEN3_CHAT_TEMPLATE, train_tokenizer
from gyre.trajectory.records import validate_execution


@pytest.fixture(scope="module")
def chat():
    tok = train_tokenizer()
    stops = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    return ChatFormat(tok, QWEN3_CHAT_TEMPLATE, stops)


class Adder(ScriptedPolicy):
    """Calls add for the first ``adds`` numbers of the task, then answers their sum (+ ``off``)."""

    def __init__(self, chat, numbers, adds, off=0):
        self.chat, self.numbers, self.adds, self.off = chat, numbers, adds, off

    def program(self, request):
        turn = self.chat.decode(request.prompt).count("<|im_start|>assistant") - 1
        if turn < self.adds:
            text = format_tool_call("add", {"x": self.numbers[turn]})
        else:
            text = str(sum(self.numbers) + self.off)
        return [*self.chat.encode(text).tolist(), self.chat.turn_end_id]


def run(chat, adds, off=0):
    env = make_env(EnvSpec(name="template"), chat)
    (task,) = env.make_tasks(0, 1)
    numbers = TemplateEnv().reset(task).numbers
    settings = AgentSettings(max_calls=8, context_window=4096, max_new_tokens=64)
    res = asyncio.run(run_execution(env, task, Adder(chat, numbers, adds, off), settings, "t#0"))
    validate_execution(res.records, env.vocab_size)
    return res


def test_it_is_registered_as_a_chat_task():
    assert "template" in ENVIRONMENTS and is_chat("template")


def test_splits_are_disjoint_and_seeded():
    env = TemplateEnv()
    train = {t.seed for t in env.make_tasks(0, 50)}
    held_out = {t.seed for t in env.make_tasks(0, 50, split="eval")}
    assert not train & held_out and len(train) == 50
    assert env.make_tasks(3, 4) == env.make_tasks(3, 4)


def test_an_execution_succeeds_fails_and_earns_partial_credit(chat):
    good = run(chat, adds=3)
    assert good.end_reason == "success" and good.milestones == good.num_milestones == 3
    wrong = run(chat, adds=1, off=1)
    assert wrong.end_reason == "failure" and wrong.milestones == 1
    assert 0 < wrong.score < good.score
