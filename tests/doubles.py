"""Test doubles for the harness: a policy that never stops, a client that fails on cue, and
a scripted code-task policy (the package's scripted policies are in gyre/agent/scripted.py)."""

from __future__ import annotations

import numpy as np

from gyre.agent.scripted import ScriptedPolicy
from gyre.envs import vocab as V


class RunawayPolicy(ScriptedPolicy):
    """Never emits a stop token (every completion ends by length: a parse failure)."""

    def program(self, request):
        return [V.DIGIT0 + 1] * (request.max_new_tokens + 1)


class FlakyClient:
    """Wraps a client; raises on the first ``times`` attempts at calls picked by ``fail``."""

    def __init__(self, inner, fail, times=1):
        self.inner, self.fail, self.times = inner, fail, times
        self.attempts: dict = {}

    async def generate(self, request):
        key = (request.execution_id, request.call_id)
        if self.fail(*key):
            self.attempts[key] = self.attempts.get(key, 0) + 1
            if self.attempts[key] <= self.times:
                raise RuntimeError(f"injected serving failure at {key}")
        return await self.inner.generate(request)


class CodeScriptPolicy(ScriptedPolicy):
    """Code task: the n-th turn of a context (n = stop tokens in the prompt) is ``script[n]``
    (UTF-8 text, the last entry repeats); after a compaction, turns count from the summary and
    follow ``resume``; a summary request gets ``summary``."""

    def __init__(self, script: list[str], resume: list[str] | None = None, summary="pending"):
        self.script, self.resume, self.summary = script, resume or script, summary

    def program(self, request):
        prompt = request.prompt
        marks = np.nonzero(prompt == V.ByteVocab.SUMMARY)[0]
        if prompt.size and prompt[-1] == V.ByteVocab.SUMMARY:
            text = self.summary
        else:
            script = self.resume if marks.size else self.script
            tail = prompt[marks[-1] :] if marks.size else prompt
            turn = int(np.count_nonzero(tail == V.ByteVocab.EOS))
            text = script[min(turn, len(script) - 1)]
        return [*V.ByteVocab.encode(text).tolist(), V.ByteVocab.EOS]
