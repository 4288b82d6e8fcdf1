"""reasoning-gym tasks as a text environment: one question, one answer, the task's own verifier.

Any of reasoning-gym's procedural datasets (``reasoning_gym.factory.DATASETS``: 'basic_arithmetic',
'chain_sum', 'word_sorting', ...) can be chosen by name, one or several (tasks then cycle over
the names), with optional per-name dataset settings. A task is one generated entry: dataset
``name`` built with ``seed=task.seed, size=1`` and its entry 0, so a task is a pure function of
(name, seed, settings). Splits use disjoint seeds: 'train' draws seeds in [0, 2**31), 'eval'
in [2**31, 2**32).

No tools. The model's reply (thinking stripped) is its answer, extracted by one stated rule
(:func:`extract_answer`; the system prompt says so): the text inside the last
``<answer>...</answer>`` pair (an unclosed ``<answer>`` takes the rest of the reply), else the
last non-empty line, stripped.

Reward that ranks: the dataset's own ``score_answer`` judges the extracted answer, and only its
verdict "right" (a score of exactly 1.0) counts: the task is 'done' with score 1; any other
answer ends in 'fail' with score 0. reasoning-gym's verifiers also pay fractions that are not
partial correctness: the default ``score_answer`` (basic_arithmetic, gcd, lcm, count_bits, ...,
and chain_sum through its decimal fallback) pays len(oracle)/len(answer) whenever the oracle is
a substring of the answer, so "740" for 74 would earn 0.67, more than the right answer in a
sentence (0.13). Paying such fractions would rank a wrong answer above a right one, so a
fraction is recorded (``ReasoningGymState.verifier_score``, for reading) and never paid: the
family has no partial credit (no intermediate results to count), and a right answer (1.0) is
always above any wrong one (0.0). A verifier that raises on the model's text scores 0 (recorded
in the state). One answer per task.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from gyre.envs.base import Task
from gyre.envs.text import TextEnvironment, TextStep

SPLIT_SEEDS = {"train": (0, 2**31), "eval": (2**31, 2**32)}  # [lo, hi): disjoint item seeds
SYSTEM_PROMPT = (
    "Solve the problem in the user's message. Think as much as you need, then give your final "
    "answer inside <answer> and </answer> tags, for example <answer>42</answer>, in exactly the "
    "form the problem asks for. Only the text inside the last <answer></answer> pair is graded; "
    "without the tags, the last non-empty line of your reply is graded."
)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_RESERVED = ("seed", "size")  # set per task by the environment


def dataset_names() -> list[str]:
    """Every dataset name the installed reasoning-gym registers, sorted."""
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def extract_answer(text: str) -> str:
    """The graded part of a reply (see the module docstring). Pure."""
    found = _ANSWER.findall(text)
    if found:
        return found[-1].strip()
    if "<answer>" in text:
        return text.rsplit("<answer>", 1)[1].strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def rank_score(verifier_score: float) -> float:
    """What a verifier's score pays: 1.0 for its verdict "right" (exactly 1.0), else 0.0, so a
    string-overlap fraction never lifts a wrong answer above a right one (module docstring)."""
    return 1.0 if verifier_score == 1.0 else 0.0


def _check_names(names: Sequence[str]) -> None:
    valid = dataset_names()
    unknown = [n for n in names if n not in valid]
    if unknown:
        close = sorted({c for n in unknown for c in difflib.get_close_matches(n, valid, 3)})
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ValueError(
            f"unknown reasoning-gym task name(s) {unknown}{hint} Valid names include "
            f"{', '.join(valid[:8])}, ... ({len(valid)} in all: reasoning_gym.factory.DATASETS)"
        )


@functools.lru_cache(maxsize=4096)
def _generate(name: str, seed: int, settings_json: str) -> tuple[Any, dict]:
    """(dataset, entry 0) for one task; cached because every task is sampled several times."""
    from reasoning_gym import create_dataset

    dataset = create_dataset(name, seed=seed, size=1, **json.loads(settings_json))
    return dataset, dataset[0]


@dataclasses.dataclass
class ReasoningGymState:
    task: Task
    name: str
    dataset: Any  # the reasoning-gym dataset (its score_answer grades the entry)
    entry: dict  # 'question', 'answer', 'metadata'
    answer: str | None = None  # the extracted answer, once given
    score_value: float | None = None  # what is paid: 1.0 for a right answer, else 0.0
    verifier_score: float | None = None  # the verifier's own fraction, recorded, never paid
    score_error: str | None = None  # why the verifier failed on the answer, if it did


class ReasoningGymEnv(TextEnvironment):
    """See the module docstring.

    tasks: dataset names, as a sequence or one comma-separated string;
    settings: optional {name: {config key: value}} passed to ``create_dataset`` for that name
    (e.g. ``{"chain_sum": {"min_terms": 2, "max_terms": 3}}``); checked when constructed.
    """

    name = "reasoning_gym"
    system_prompt = SYSTEM_PROMPT
    tools = ()

    def __init__(self, tasks: str | Sequence[str] = ("basic_arithmetic",),
                 settings: Mapping[str, Mapping[str, Any]] | None = None,
                 tool_timeout: float = 30.0):  # fmt: skip
        names = [n.strip() for n in tasks.split(",")] if isinstance(tasks, str) else list(tasks)
        if not names or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"reasoning-gym tasks must be non-empty names, got {tasks!r}")
        _check_names(names)
        settings = dict(settings or {})
        _check_names(list(settings))
        self.names = tuple(dict.fromkeys(names))  # de-duplicated, in order
        self.tool_timeout = tool_timeout
        self._settings: dict[str, str] = {}
        for name in self.names:
            kwargs = dict(settings.get(name, {}))
            bad = [k for k in kwargs if k in _RESERVED]
            if bad:
                raise ValueError(f"reasoning-gym settings for {name!r}: {bad} are set per task")
            self._settings[name] = json.dumps(kwargs, sort_keys=True)
            try:  # fail now, naming the task, rather than at the first reset
                _generate(name, 0, self._settings[name])
            except Exception as exc:
                raise ValueError(
                    f"reasoning-gym task {name!r} with settings {kwargs}: {exc}"
                ) from exc

    # ---- tasks ---------------------------------------------------------------------------
    def make_tasks(self, seed: int, n: int, split: str = "train") -> list[Task]:
        """``n`` tasks cycling over the names, each with its own item seed from ``split``'s
        range, keyed by ``seed``."""
        if split not in SPLIT_SEEDS:
            raise ValueError(f"split must be one of {tuple(SPLIT_SEEDS)}, got {split!r}")
        lo, hi = SPLIT_SEEDS[split]
        seeds = np.random.default_rng(seed).integers(lo, hi, size=n, dtype=np.int64)
        return [
            Task(f"rg-{split}-{seed}-{j}", int(s), (self.names[j % len(self.names)],))
            for j, s in enumerate(seeds)
        ]

    def reset(self, task: Task) -> ReasoningGymState:
        name = task.params[0] if task.params else None
        if name not in self._settings:
            raise ValueError(
                f"task {task.task_id!r}: reasoning-gym task {name!r} is not one of {self.names}"
            )
        dataset, entry = _generate(name, task.seed, self._settings[name])
        return ReasoningGymState(task, name, dataset, entry)

    def task_text(self, state: ReasoningGymState) -> str:
        return state.entry["question"]

    # ---- turns ---------------------------------------------------------------------------
    async def call_tool(self, state, name: str, arguments: dict) -> TextStep:
        return TextStep("ok", f"Error: this task has no tools ({name!r} does not exist). "
                              "Reply with your final answer inside <answer></answer>.")  # fmt: skip

    async def answer(self, state: ReasoningGymState, text: str) -> TextStep:
        answer = extract_answer(text)
        try:
            raw = float(state.dataset.score_answer(answer, state.entry))
        except Exception as exc:  # the verifier's own failure on odd text: no credit
            raw, state.score_error = 0.0, f"{type(exc).__name__}: {exc}"
        raw = min(1.0, max(0.0, raw)) if math.isfinite(raw) else 0.0
        score = rank_score(raw)
        state.answer, state.verifier_score, state.score_value = answer, raw, score
        kind = "done" if score == 1.0 else "fail"
        return TextStep(kind, f"Answer {answer!r} graded {'right' if score else 'wrong'}.")

    # ---- judge ---------------------------------------------------------------------------
    def milestones(self, state: ReasoningGymState) -> tuple[int, int]:
        return int(state.score_value == 1.0), 1

    def score(self, state: ReasoningGymState) -> float | None:
        """1.0 for a right answer, 0.0 for any other; None before any answer."""
        return state.score_value

    def summary_text(self, state: ReasoningGymState) -> str:
        return "No answer given yet: reply with your final answer inside <answer></answer>."
