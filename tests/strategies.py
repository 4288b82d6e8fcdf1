"""Hypothesis generators of branchy executions (retries, compactions, sub-agents, summaries).

``branchy_execution(seed, ...)`` is a plain seeded function (usable outside hypothesis);
``executions()`` and ``batches()`` are strategies built on it. A small vocabulary makes
accidental token collisions (a completion equal to existing context, duplicate calls) common,
which is what stresses the trie.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import strategies as st

from gyre.trajectory.records import make_record


def _tokens(rng, vocab: int, lo: int, hi: int) -> np.ndarray:
    return rng.integers(0, vocab, rng.integers(lo, hi + 1)).astype(np.int32)


def branchy_execution(
    seed: int,
    n_calls: int = 8,
    vocab: int = 8,
    execution_id: str = "e0",
    end_reason: str | None = None,
    max_obs: int = 3,
    max_gen: int = 4,
) -> list:
    """One execution's call records; every random choice comes from ``seed``.

    Actions per call: continue a conversation (prompt = its context + an observation),
    retry an earlier call from a random resume point, compact (a main-summary call may write
    the summary that the new main branch then holds as context), spawn a sub-agent (its own
    root, or sharing the system prefix), or repeat a call's tokens. Half of the retries sample
    the old call's next tokens again and half of the repeats copy its behaviour, each with
    the same behaviour, another version or other logprobs (see ``behaviour``); the rest draw
    logprobs and versions (0-2, per token) afresh. Parent ids are sometimes misleading (any
    earlier call) or missing: where calls generated the same tokens under different
    behaviours that may change which branch a prompt shares, never a value it trains with.
    """
    rng = np.random.default_rng(seed)
    reason = end_reason or str(rng.choice(["success", "failure", "timeout"]))
    system = _tokens(rng, vocab, 1, 4)
    task = _tokens(rng, vocab, 0, 3)
    records = []
    # conversation: [context tokens, role, last call id, summary role]
    convs = [[np.concatenate([system, task]), "main", None, "main-summary"]]

    def add(prompt, role, parent, gen=None, like=None):
        """A call; ``like=(logprobs, versions)`` gives the behaviour of its first tokens."""
        completion = _tokens(rng, vocab, 1, max_gen) if gen is None else gen
        n = completion.size
        logprobs = -rng.exponential(1.0, n).astype(np.float32)
        versions = rng.integers(0, 3, n).astype(np.int32)
        if like is not None:
            logprobs[: like[0].size], versions[: like[1].size] = like
        rec = make_record(
            prompt,
            completion,
            logprobs=logprobs,
            versions=versions,
            role=role,
            execution_id=execution_id,
            call_id=len(records),
            parent_id=parent,
            end_reason=reason,
        )
        records.append(rec)
        return rec

    def behaviour(old, part):
        """The behaviour of a retry that samples old's tokens ``part`` again: the same, or
        served by other weights (version + 1), or the same version with other logprobs."""
        lp, ver = old.logprobs[part].copy(), old.versions[part].copy()
        kind = rng.integers(3)
        if kind == 1:
            ver += 1
        elif kind == 2:
            lp -= rng.uniform(0.01, 0.5, lp.size).astype(np.float32)
        return lp, ver

    for _ in range(n_calls):
        action = rng.choice(
            ["continue", "retry", "compact", "sub", "repeat"], p=[0.5, 0.15, 0.1, 0.15, 0.1]
        )
        c = convs[rng.integers(len(convs))]
        if action == "retry" and records:
            old = records[rng.integers(len(records))]
            cut = rng.integers(0, old.completion.size)
            prompt = np.concatenate([old.prompt, old.completion[:cut]])
            if rng.random() < 0.5:  # samples old's next tokens again, then its own
                n = rng.integers(1, old.completion.size - cut + 1)
                part = slice(cut, cut + n)
                fresh = _tokens(rng, vocab, 0, max(max_gen - n, 0))
                gen = np.concatenate([old.completion[part], fresh])
                rec = add(prompt, old.role, old.parent_id, gen, behaviour(old, part))
            else:
                rec = add(prompt, old.role, old.parent_id)
        elif action == "repeat" and records:
            old = records[rng.integers(len(records))]
            like = behaviour(old, slice(None)) if rng.random() < 0.5 else None
            rec = add(old.prompt, old.role, old.parent_id, old.completion.copy(), like)
        elif action == "compact" and c[2] is not None:
            summary = _tokens(rng, vocab, 1, 3)
            if rng.random() < 0.5:  # the model writes the summary
                s = add(np.concatenate([c[0], _tokens(rng, vocab, 1, 2)]), c[3], c[2])
                summary = s.completion
            head = system if c[1] == "main" else c[0][: rng.integers(1, c[0].size + 1)]
            c[0] = np.concatenate([head, summary])
            rec = add(c[0], c[1], c[2])
        elif action == "sub" and c[2] is not None:
            if rng.random() < 0.5:
                head = system
            else:
                head = _tokens(rng, vocab, 1, 3)
            last = records[-1].completion
            ctx = np.concatenate([head, last[: rng.integers(0, last.size + 1)]])
            sub = [ctx, "sub-agent", records[-1].call_id, "sub-agent-summary"]
            convs.append(sub)
            c = sub
            rec = add(ctx, "sub-agent", c[2])
        else:
            prompt = np.concatenate([c[0], _tokens(rng, vocab, 0, max_obs)])
            rec = add(prompt, c[1], c[2])
        if action in ("continue", "compact", "sub") or (action == "retry" and rng.random() < 0.5):
            c[0] = np.concatenate([rec.prompt, rec.completion])
            c[2] = rec.call_id
    if rng.random() < 0.2 and len(records) > 1:  # misleading or missing parent ids
        i = int(rng.integers(1, len(records)))
        p = [None, int(rng.integers(0, i))][int(rng.integers(2))]
        records[i] = dataclasses.replace(records[i], parent_id=p)
    return records


def executions(max_calls: int = 10):
    """Strategy: one branchy execution (list of CallRecord)."""
    return st.builds(
        branchy_execution,
        seed=st.integers(0, 2**31 - 1),
        n_calls=st.integers(1, max_calls),
        vocab=st.sampled_from([2, 4, 16, 64]),
    )


@st.composite
def batches(draw, max_execs: int = 5, max_calls: int = 8, max_tasks: int = 2):
    """Strategy: (executions, task ids, judge scores) for one optimizer step."""
    n = draw(st.integers(1, max_execs))
    seeds = draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n))
    execs = [
        branchy_execution(
            s, n_calls=1 + s % max_calls, vocab=[4, 16, 64][s % 3], execution_id=f"e{i}"
        )
        for i, s in enumerate(seeds)
    ]
    tasks = [f"t{s % max_tasks}" for s in seeds]
    scores = [float(draw(st.floats(0.0, 0.9))) for _ in range(n)]
    return execs, tasks, scores
