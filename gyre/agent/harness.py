"""Runs agent executions as asyncio coroutines over any ``generate`` client, token-in/token-out.

One execution = one main agent (and any sub-agents it spawns) on one task. The context is an
int32 token array that only grows by appending the model's own completion and the
environment's observation tokens, so each prompt extends the previous one exactly. Branches:
  retry       a completion that does not parse, or a tool error, is dropped and the call is
              redone on the same context (same prompt), up to ``max_retries`` in a row;
  compaction  when the next call would not fit the window, the context restarts from the task
              prefix plus a summary, written by the env (harness) or by the model in a
              '<role>-summary' call when ``model_summary`` is set;
  sub-agent   a 'spawn' tool result runs a sub-agent on a fresh context (role 'sub-agent');
              its outcome returns to the parent as an observation.
parent_id of a call is the call that preceded it in time within its agent (for a retry, the
failed attempt; after compaction, the summary call or the last call before it) or, for a
sub-agent's first call, the spawning call.

Ending reasons: success, failure (the env said so or retries ran out), timeout (calls,
generated tokens or wall seconds), context_overflow (even the compacted context does not fit),
infra_error (model call or tool raised or hung past its limit more than ``infra_retries``
times in a row, or a harness bug). Infra errors get no score and never count as failures.
"""

from __future__ import annotations

import asyncio
import time
import traceback

import numpy as np

from gyre.agent.context import AgentSettings, CallLog, Ended
from gyre.envs.base import Environment, Task
from gyre.rollout.types import GenerateRequest
from gyre.trajectory.batch import ExecutionResult


class _Execution:
    def __init__(self, env: Environment, task: Task, client, settings: AgentSettings,
                 execution_id: str, clock):  # fmt: skip
        self.env, self.task, self.client, self.s = env, task, client, settings
        self.log = CallLog(execution_id)
        self.clock = clock
        self.t0 = clock()
        self.stats = dict(retries=0, compactions=0, sub_agents=0, infra_retries=0, max_context=0)

    # ---- guarded primitives ------------------------------------------------------------
    def _remaining_seconds(self) -> float:
        left = self.s.max_seconds - (self.clock() - self.t0)
        if left <= 0:
            raise Ended("timeout", "wall-clock budget")
        return left

    async def call(self, role: str, prompt: np.ndarray, parent: int | None):
        """One model call; returns (call_id, completion tokens, finished with a stop token)."""
        if self.log.num_calls >= self.s.max_calls:
            raise Ended("timeout", "call budget")
        if self.log.generated >= self.s.max_tokens:
            raise Ended("timeout", "token budget")
        call_id = self.log.num_calls
        budget = min(self.s.max_new_tokens, self.s.max_tokens - self.log.generated)
        req = GenerateRequest(self.log.execution_id, call_id, prompt, budget, self.env.stop_tokens)
        for attempt in range(self.s.infra_retries + 1):
            left = self._remaining_seconds()
            try:
                resp = await asyncio.wait_for(self.client.generate(req), timeout=left)
                break
            except TimeoutError:
                raise Ended("timeout", "wall-clock budget during a model call") from None
            except Exception as exc:  # the serving side failed: infrastructure, not policy
                if attempt == self.s.infra_retries:
                    raise Ended("infra_error", f"model call failed: {exc!r}") from exc
                self.stats["infra_retries"] += 1
        self.log.add(role, prompt, resp, parent, self.s.vocab_size)
        self.stats["max_context"] = max(self.stats["max_context"], prompt.size + resp.tokens.size)
        stopped = resp.finish_reason == "stop"
        return call_id, np.asarray(resp.tokens, np.int32), stopped

    async def tool(self, state, call, role: str):
        """Runs a tool with the env's time limit, retrying crashes and hangs (infra errors)."""
        for attempt in range(self.s.infra_retries + 1):
            self._remaining_seconds()
            try:
                return await asyncio.wait_for(
                    self.env.step(state, call, role), timeout=self.env.tool_timeout
                )
            except Exception as exc:  # env crash or TimeoutError (hang past the tool limit)
                if attempt == self.s.infra_retries:
                    raise Ended("infra_error", f"tool {call.name} failed: {exc!r}") from exc
                self.stats["infra_retries"] += 1

    # ---- agent loop --------------------------------------------------------------------
    def _fits(self, ctx: np.ndarray, extra: int = 0) -> bool:
        return ctx.size + extra + self.s.max_new_tokens <= self.s.context_window

    async def compact(self, role, state, prefix, ctx, last):
        """Returns (new context, last call id): task prefix + summary (+ resume tokens)."""
        self.stats["compactions"] += 1
        summary_role = f"{role}-summary"
        request = self.env.summary_request(summary_role)
        if self.s.model_summary and self._fits(ctx, request.size):
            prompt = np.concatenate([ctx, request])
            for _ in range(self.s.max_retries + 1):
                cid, comp, stopped = await self.call(summary_role, prompt, last)
                last = cid
                if stopped and self.env.parse(comp, summary_role) is not None:
                    body = comp[:-1]  # drop the stop token
                    resume = self.env.resume_obs(state, role)
                    new = np.concatenate([prefix, request, body, resume]).astype(np.int32)
                    break
                self.stats["retries"] += 1
            else:
                raise Ended("failure", f"{summary_role} did not parse after retries")
        else:  # the harness writes the summary from the environment's state
            new = np.concatenate([prefix, self.env.summary(state, role)]).astype(np.int32)
        if not self._fits(new):
            raise Ended("context_overflow", f"compacted {role} context of {new.size} tokens")
        return new, last

    async def agent(self, role, state, prefix, first_obs, parent):
        """Runs one agent to its end; returns True when it reached its goal ('done')."""
        ctx = np.concatenate([prefix, first_obs]).astype(np.int32)
        last, fails = parent, 0
        # With model summaries, compact while a summary call still fits after one more turn
        # (completion + an observation of up to max_new_tokens); a larger observation makes the
        # harness write that summary instead.
        reserve = 0
        if self.s.model_summary:
            reserve = self.env.summary_request(f"{role}-summary").size + 2 * self.s.max_new_tokens
        compacted = False  # compact at most once between two calls (no summary loops)
        while True:
            if not self._fits(ctx, 0 if compacted else reserve):
                if compacted:
                    raise Ended("context_overflow", f"{role} context of {ctx.size} tokens")
                ctx, last = await self.compact(role, state, prefix, ctx, last)
                compacted = True
                continue
            compacted = False
            cid, comp, stopped = await self.call(role, ctx, last)
            last = cid
            action = self.env.parse(comp, role) if stopped else None
            result = None if action is None else await self.tool(state, action, role)
            if result is None or result.kind == "error":  # branch: redo on the same context
                fails += 1
                self.stats["retries"] += 1
                if fails > self.s.max_retries:
                    if role == "main":
                        raise Ended("failure", "retries exhausted")
                    return False
                continue
            fails = 0
            obs = result.obs
            if result.kind == "spawn":
                self.stats["sub_agents"] += 1
                ok = await self.agent(
                    "sub-agent", result.sub_state, result.sub_prompt, np.zeros(0, np.int32), cid
                )
                obs = self.env.deliver(state, result.sub_state, ok)
            ctx = np.concatenate([ctx, comp, obs]).astype(np.int32)
            if result.kind in ("done", "fail"):
                if role == "main":
                    raise Ended("success" if result.kind == "done" else "failure", "env")
                return result.kind == "done"

    async def run(self) -> ExecutionResult:
        state = None
        try:
            try:
                state = self.env.reset(self.task)
                prefix = np.asarray(self.env.task_prompt(state), np.int32)
                first = np.asarray(self.env.initial_obs(state), np.int32)
            except Exception as exc:
                raise Ended("infra_error", f"env reset failed: {exc!r}") from exc
            if not self._fits(np.concatenate([prefix, first])):
                raise Ended("context_overflow", "the task does not fit the context window")
            await self.agent("main", state, prefix, first, None)
            raise Ended("failure", "agent returned without an ending")  # unreachable guard
        except Ended as end:
            reason, detail = end.reason, end.detail
        except Exception:  # a harness bug must not take other executions down
            reason, detail = "infra_error", traceback.format_exc(limit=3)
        done, total = self.env.milestones(state) if state is not None else (0, 0)
        score = None
        if state is not None and reason != "infra_error":
            score = self.env.judge(state, reason, self.s.partial_scale)
        stats = dict(self.stats, calls=self.log.num_calls, generated=self.log.generated,
                     detail=detail, seconds=self.clock() - self.t0)  # fmt: skip
        extra = getattr(self.env, "execution_stats", None)  # e.g. a chat task's tool calls
        if state is not None and extra is not None:
            stats.update(extra(state))
        return ExecutionResult(
            self.log.records(reason),
            self.task.task_id,
            score,
            self.log.execution_id,
            reason,
            done,
            total,
            stats,
            self.task,
        )


async def run_execution(env: Environment, task: Task, client, settings: AgentSettings,
                        execution_id: str, clock=time.monotonic) -> ExecutionResult:  # fmt: skip
    """Runs one execution of ``task`` under ``execution_id`` (which keys its sampling)."""
    return await _Execution(env, task, client, settings.for_env(env), execution_id, clock).run()


async def run_executions(env: Environment, tasks: list[Task], client, settings: AgentSettings,
                         clock=time.monotonic, on_end=None) -> list[ExecutionResult]:  # fmt: skip
    """Runs one execution per entry of ``tasks`` (repeat a task for several samples).

    Execution ids are '<task_id>#<n>' with n counting repeats of the task. Results come back
    in task order; at most ``settings.concurrency`` executions are in flight. on_end(id) is
    called as each execution ends, however it ends (the proxy's admission releases then).
    """
    settings = settings.for_env(env)
    gate = asyncio.Semaphore(settings.concurrency)
    seen: dict[str, int] = {}
    ids = []
    for task in tasks:
        n = seen.get(task.task_id, 0)
        seen[task.task_id] = n + 1
        ids.append(f"{task.task_id}#{n}")

    async def one(task, eid):
        async with gate:
            try:
                return await _Execution(env, task, client, settings, eid, clock).run()
            finally:
                if on_end is not None:
                    on_end(eid)

    return list(await asyncio.gather(*(one(t, e) for t, e in zip(tasks, ids))))
