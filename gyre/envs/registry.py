"""Every environment the runtime can train on, behind one function: ``make_env(spec, chat)``.

Two kinds:
- token environments (``TOKEN_ENVIRONMENTS``) speak their own small vocabulary and need no
  tokenizer: the synthetic ledger task, and the byte-level code task;
- chat environments (``TEXT_ENVIRONMENTS``) are :class:`~gyre.envs.text.TextEnvironment` subclasses,
  spoken in text through a checkpoint's tokenizer and chat template
  (:class:`~gyre.envs.chat_env.ChatEnvironment`, ``chat`` below): the code task on the
  shipped problem set, and reasoning-gym's procedural tasks.

To add an environment: write ``gyre/envs/<name>.py`` with a ``TextEnvironment`` (text in,
text out, tools as JSON schemas; or an ``Environment`` over tokens), its milestone judge
included, then add one line below mapping the name to a factory of an :class:`EnvSpec`.
``env.name`` in the config accepts the new name from then on (gyre/config.py reads the choices
from here).
"""

from __future__ import annotations

import dataclasses

from gyre import bounds
from gyre.envs.base import Environment
from gyre.envs.code import CodeEnv
from gyre.envs.faults import FaultyTools
from gyre.envs.ledger import LedgerEnv
from gyre.envs.text import TextEnvironment


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """Task settings (the ``env.*`` keys), plus the harness's retry budget (``agent.max_retries``),
    which the ledger task also uses as its budget of wrong commits."""

    name: str = "ledger"
    num_ops: int = 8  # ledger: K, the number of steps
    modulus: int = 10  # ledger: arithmetic modulus
    tool_latency: float = 0.0  # mean seconds a tool call takes; 0 = instant
    max_wrong: int = 2
    tool_timeout: float = 30.0  # seconds before a tool call counts as hung
    fault_rate: float = 0.0  # share of tool calls that crash or hang (gyre/envs/faults.py)
    seed: int = 0  # keys the injected faults
    tasks: str = ""  # reasoning_gym: comma-separated task names ("" = basic_arithmetic)
    max_runs: int = 8  # code: test runs before the task counts as failed
    keep_thinking: bool = False  # chat: the environment sees the model's <think> text
    enable_thinking: bool = True  # chat: the template's enable_thinking (Qwen3 hybrid models)
    problem_file: str = ""  # code: the problem set's file ("" = the shipped set)
    problem_format: str = "auto"  # code: gyre, humaneval, mbpp or auto (gyre/envs/published.py)

    def __post_init__(self):
        bounds.check(self, "env", max_wrong="agent.max_retries")


def _ledger(spec: EnvSpec) -> LedgerEnv:
    # The whole chain is listed when K <= 16, else a 16-step window.
    return LedgerEnv(num_ops=spec.num_ops, modulus=spec.modulus, latency=spec.tool_latency,
                     header_ops=min(spec.num_ops, 16), max_wrong=spec.max_wrong,
                     tool_timeout=spec.tool_timeout)  # fmt: skip


def _code_bytes(spec: EnvSpec) -> CodeEnv:
    return CodeEnv(tool_timeout=spec.tool_timeout, max_runs=spec.max_runs)


def _code(spec: EnvSpec) -> TextEnvironment:
    from gyre.envs.code_chat import CodeChatEnv

    return CodeChatEnv(
        tool_timeout=spec.tool_timeout,
        max_runs=spec.max_runs,
        problem_file=spec.problem_file,
        problem_format=spec.problem_format,
    )


def _reasoning_gym(spec: EnvSpec) -> TextEnvironment:
    from gyre.envs.reasoning_gym_env import ReasoningGymEnv  # imports reasoning-gym: slow

    return ReasoningGymEnv(spec.tasks or "basic_arithmetic", tool_timeout=spec.tool_timeout)


TOKEN_ENVIRONMENTS = {"ledger": _ledger, "code_bytes": _code_bytes}


def _calc(spec: EnvSpec) -> TextEnvironment:
    from gyre.envs.calc_chat import CalcEnv  # arithmetic with a calculator tool

    return CalcEnv(tool_timeout=spec.tool_timeout)


def _template(spec: EnvSpec) -> TextEnvironment:
    from gyre.envs.template import TemplateEnv  # the file to copy (README: add an environment)

    return TemplateEnv(tool_timeout=spec.tool_timeout)


TEXT_ENVIRONMENTS = {"code": _code, "reasoning_gym": _reasoning_gym, "template": _template,
                     "calc": _calc}  # fmt: skip
ENVIRONMENTS = TOKEN_ENVIRONMENTS | TEXT_ENVIRONMENTS


def is_chat(name: str) -> bool:
    """True for an environment spoken in chat text (it needs a tokenizer and a template)."""
    return name in TEXT_ENVIRONMENTS


def make_env(spec: EnvSpec, chat=None) -> Environment:
    """The environment named by ``spec.name``; a clear error for an unknown name.

    ``chat``: a :class:`gyre.chat.format.ChatFormat` (the checkpoint's tokenizer and template),
    required by chat environments and unused by token environments.
    """
    if spec.name not in ENVIRONMENTS:
        raise ValueError(
            f"config key 'env.name' is {spec.name!r}, not one of {sorted(ENVIRONMENTS)}"
        )
    if is_chat(spec.name):
        if chat is None:
            raise ValueError(
                f"env.name {spec.name!r} is a chat task: it needs a checkpoint with a tokenizer "
                "and a chat template (set model.hf_dir to a Qwen3 directory, or 'tiny')"
            )
        from gyre.envs.chat_env import ChatEnvironment

        env = ChatEnvironment(TEXT_ENVIRONMENTS[spec.name](spec), chat)
    else:
        env = TOKEN_ENVIRONMENTS[spec.name](spec)
    return FaultyTools(env, spec.fault_rate, spec.seed) if spec.fault_rate > 0 else env
