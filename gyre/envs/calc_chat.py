"""Arithmetic with a calculator tool: the chat task that learns on CPU (experiments/chat_quickstart.py).

A task is one expression ``a op b`` (``op`` in + - *, operands with ``digits`` digits), asked
as "What is 347 * 82?". The one tool, ``calculator(expression)``, evaluates + - * and
parentheses over integers and returns the value (an unreadable expression gets an error text:
the model may try again). The answer is the reply without a tool call, read by one stated rule
(:func:`read_answer`): the last non-empty line, an optional ``<answer>`` tag pair removed,
as an integer. One answer per task.

Reward that ranks: a right answer is 'done' (score 1); anything else is 'fail' with score 0
(one number has no intermediate results, so there is no partial credit: a right answer is
always above a wrong one). Each task has one milestone, the right answer.

Why it learns at 0.6M parameters: the tool does the arithmetic, so what a policy must learn is
to call it (the format, copying the expression), and to copy its result into the reply. A tiny
model cannot multiply 3-digit numbers in its head; its direct answers are almost always wrong.
The warm start's demonstrations (gyre/rl/demos.py, :class:`CalcExpert`) answer directly half
the time, so the supervised policy has the format but not the habit of using the tool: RL has
to learn when to call it.

Train and eval tasks differ by the parity of ``a + b``: 'train' draws pairs with an even sum,
'eval' with an odd one, so no held-out expression is a training one.
"""

from __future__ import annotations

import ast
import dataclasses
import operator
import re

import numpy as np

from gyre.envs.base import Task
from gyre.envs.text import TextEnvironment, TextStep

OPS = ("+", "-", "*")
SYSTEM_PROMPT = "Reply with the number only."
TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
QUESTION = "What is {a} {op} {b}?"
_QUESTION = re.compile(r"What is (\d+) ([-+*]) (\d+)\?")
_TAG = re.compile(r"</?answer>")
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
MAX_EXPRESSION = 64  # characters


def evaluate_expression(text: str) -> int:
    """The value of an integer expression with + - * and parentheses; ValueError otherwise.
    Pure; never evaluates anything but these operators on integer literals."""
    if not isinstance(text, str) or len(text) > MAX_EXPRESSION:
        raise ValueError(f"expected an expression of at most {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot read {text!r}") from None

    def ev(node, depth=0):
        if depth > 16:
            raise ValueError("expression nested too deeply")
        if isinstance(node, ast.Expression):
            return ev(node.body, depth + 1)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand, depth + 1)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](ev(node.left, depth + 1), ev(node.right, depth + 1))
        raise ValueError(f"only integers, + - * and parentheses are allowed in {text!r}")

    return ev(tree)


def read_answer(text: str) -> int | None:
    """The graded answer of a reply: its last non-empty line without ``<answer>`` tags, as an
    integer (None when that line is not one). Pure."""
    lines = [line.strip() for line in _TAG.sub("", text).splitlines() if line.strip()]
    if not lines:
        return None
    try:
        return int(lines[-1].replace(",", ""))
    except ValueError:
        return None


def parse_question(text: str) -> tuple[int, str, int] | None:
    """(a, op, b) of a question as :data:`QUESTION` writes it (the scripted expert's reading)."""
    m = _QUESTION.search(text)
    return None if m is None else (int(m.group(1)), m.group(2), int(m.group(3)))


@dataclasses.dataclass
class CalcState:
    task: Task
    a: int
    op: str
    b: int
    tool_calls: int = 0
    answer: int | None = None  # the graded number (None: unreadable or not given)
    answered: bool = False
    right: bool = False

    @property
    def value(self) -> int:
        return evaluate_expression(f"{self.a} {self.op} {self.b}")


class CalcEnv(TextEnvironment):
    """See the module docstring. ``digits``: operands have 1..``digits`` digits (at least
    10**(digits-1) when ``min_digits`` is ``digits``)."""

    name = "calc"
    system_prompt = SYSTEM_PROMPT
    tools = (TOOL,)

    def __init__(self, digits: int = 3, min_digits: int = 2, tool_timeout: float = 30.0):
        if not 1 <= min_digits <= digits <= 9:
            raise ValueError(f"need 1 <= min_digits <= digits <= 9, got {min_digits}, {digits}")
        self.lo, self.hi = 10 ** (min_digits - 1), 10**digits  # operands in [lo, hi)
        self.tool_timeout = tool_timeout

    def make_tasks(self, seed: int, n: int, split: str = "train") -> list[Task]:
        """``n`` tasks keyed by ``seed``: 'train' pairs have an even a + b, 'eval' an odd one."""
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        rng = np.random.default_rng([seed, split == "eval"])
        tasks = []
        for j in range(n):
            a, b = (int(x) for x in rng.integers(self.lo, self.hi, size=2))
            if (a + b) % 2 != (split == "eval"):
                b = b + 1 if b + 1 < self.hi else b - 1
            op = OPS[int(rng.integers(len(OPS)))]
            tasks.append(Task(f"calc-{split}-{seed}-{j}", seed, (a, op, b)))
        return tasks

    def reset(self, task: Task) -> CalcState:
        a, op, b = task.params
        if op not in OPS:
            raise ValueError(f"task {task.task_id!r}: unknown operator {op!r}")
        return CalcState(task, int(a), op, int(b))

    def task_text(self, state: CalcState) -> str:
        return QUESTION.format(a=state.a, op=state.op, b=state.b)

    async def call_tool(self, state: CalcState, name: str, arguments: dict) -> TextStep:
        state.tool_calls += 1
        if name != "calculator":
            return TextStep("ok", f"Error: unknown tool {name!r}; the tool is "
                                  "calculator(expression).")  # fmt: skip
        expression = arguments.get("expression") if isinstance(arguments, dict) else None
        if not isinstance(expression, str) or set(arguments) != {"expression"}:
            return TextStep("ok", "Error: calculator takes one argument, 'expression' (a string).")
        try:
            return TextStep("ok", str(evaluate_expression(expression)))
        except ValueError as exc:
            return TextStep("ok", f"Error: {exc}")

    async def answer(self, state: CalcState, text: str) -> TextStep:
        state.answer, state.answered = read_answer(text), True
        state.right = state.answer is not None and state.answer == state.value
        return TextStep("done" if state.right else "fail", "Right." if state.right else "Wrong.")

    def milestones(self, state: CalcState) -> tuple[int, int]:
        return int(state.right), 1

    def score(self, state: CalcState) -> float | None:
        return float(state.right) if state.answered else None

    def summary_text(self, state: CalcState) -> str:
        return "No answer yet: reply with the number only."


# ---- the warm start's initial checkpoint: a random init with a tokenizer that knows the task --


def tokenizer_corpus(n: int = 100, seed: int = 5) -> list[str]:
    """Text for training the task's tokenizer: the built-in corpus of
    gyre/model/tiny_checkpoint.py plus ``n`` task prompts rendered by Qwen3's chat template and
    their calculator calls, so the fixed system turn (the tool schema) is a few long tokens."""
    from gyre.chat.format import compile_template
    from gyre.chat.toolcalls import format_tool_call
    from gyre.model.tiny_checkpoint import QWEN3_CHAT_TEMPLATE, _builtin_corpus

    template, env, texts = compile_template(QWEN3_CHAT_TEMPLATE), CalcEnv(), []
    for task in env.make_tasks(seed, n):
        state = env.reset(task)
        messages = [{"role": "system", "content": env.system_prompt},
                    {"role": "user", "content": env.task_text(state)}]  # fmt: skip
        texts.append(template.render(messages=messages, tools=list(env.tools),
                                     add_generation_prompt=True, enable_thinking=True))  # fmt: skip
        texts.append(format_tool_call("calculator", {"expression": env.task_text(state)[8:-1]}))
    return _builtin_corpus() + texts


def init_checkpoint(root: str, spec, seed: int = 0) -> str:
    """A Qwen3 directory under ``root`` for the warm start to begin from (written once, named
    by what it depends on): random weights of ``spec`` (a ``gyre.model.decoder.ModelSpec``)
    from ``seed`` and a ``spec.vocab_size``-token tokenizer trained on
    :func:`tokenizer_corpus`, with Qwen3's chat template. Its prompts are about half as long
    as with the generic tiny tokenizer (158 tokens instead of 297)."""
    from gyre.model.tiny_checkpoint import cached_tiny_qwen3

    return cached_tiny_qwen3(root, spec, seed, corpus=tokenizer_corpus())
