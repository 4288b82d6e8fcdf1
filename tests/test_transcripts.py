"""Transcripts: the delta rule on real harness executions, branch labels, truncation, the
choice of executions per step, and the executions.txt append/read round trip."""

import asyncio
import dataclasses
import random
import re

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gyre.agent.context import AgentSettings
from gyre.agent.harness import run_execution, run_executions
from gyre.agent.scripted import GarbagePolicy, LedgerExpert, ScriptedPolicy, WrongPolicy
from gyre.chat.format import ChatFormat
from gyre.chat.toolcalls import format_tool_call
from gyre.envs import vocab as V
from gyre.envs.base import Task
from gyre.envs.chat_env import ChatEnvironment
from gyre.envs.ledger import LedgerEnv
from gyre.envs.text import TextEnvironment, TextStep
from gyre.model.tiny_checkpoint import QWEN3_CHAT_TEMPLATE, train_tokenizer
from gyre.rl.transcripts import (
    INDENT,
    call_views,
    choose_executions,
    clip,
    read_transcripts,
    render_execution,
    render_step,
    split_executions,
    write_step_transcripts,
)
from gyre.trajectory.batch import ExecutionResult
from gyre.trajectory.records import make_record

CFG = AgentSettings(max_calls=200, context_window=512, max_new_tokens=8)


def run(env, policy, n=2, seed=0, cfg=CFG):
    return asyncio.run(run_executions(env, env.make_tasks(seed, n), policy, cfg))


def angle(tokens) -> str:
    """A detokenizer whose text of a concatenation is the concatenation of the texts."""
    return "".join(f"<{int(t)}>" for t in np.asarray(tokens))


def blocks(text: str) -> list[tuple[str, str]]:
    """(label line, indented text under it) of every token-text block of a rendering."""
    out, label, body = [], None, []
    for line in text.split("\n") + ["--- end"]:
        if line.startswith(INDENT):
            body.append(line[len(INDENT) :])
            continue
        if label is not None and body:
            out.append((label, "\n".join(body)))
        label, body = line, []
    return out


def reconstruct(view, by_id) -> np.ndarray:
    """A prompt from its parent's context and the tokens the transcript shows."""
    if view.record.parent_id is None:
        return view.new_prompt
    parent = by_id[view.record.parent_id]
    return np.concatenate([parent.tokens[: view.shared], view.new_prompt])


# ---- the delta rule ------------------------------------------------------------------------


def test_linear_execution_shows_each_appended_tail_and_they_rebuild_the_final_context():
    env = LedgerEnv(num_ops=8)
    for res in run(env, LedgerExpert()):
        views = call_views(res.records)
        assert [v.relation for v in views] == ["first"] + ["extends"] * 7
        shown = np.concatenate([np.concatenate([v.new_prompt, v.record.completion]) for v in views])
        assert np.array_equal(shown, res.records[-1].tokens)
        # each tail after the first is the observation alone (OK ...), never earlier tokens
        assert all(v.new_prompt[0] == V.OK for v in views[1:])
        # the same on the rendered text: prompt and completion blocks, in order
        text = render_execution(res, angle, max_chars=10**6)
        parts = blocks(text)
        assert len(parts) == 2 * len(views)
        assert "".join(body for _, body in parts) == angle(res.records[-1].tokens)


def test_header_names_the_ending_score_milestones_calls_and_generated_tokens():
    env = LedgerEnv(num_ops=8)
    (good,) = run(env, LedgerExpert(), n=1)
    (bad,) = run(env, WrongPolicy(), n=1)
    text = render_execution(good, env.render_tokens)
    generated = sum(r.completion.size for r in good.records)
    assert text.splitlines()[0] == (
        f"### execution {good.execution_id} | task {good.task_id} | success | score 1.000 | "
        f"milestones 8/8 | 8 calls | {generated} tokens generated"
    )
    assert "--- call 3 | main | parent 2 | version 0" in text
    assert env.render_tokens(good.records[0].completion) in text  # the ledger's own names
    text = render_execution(bad, env.render_tokens)
    assert "| failure | score 0.000 |" in text.splitlines()[0]
    assert "ending detail:" in text and "WRONG" in text


def test_every_prompt_is_its_parents_shared_prefix_plus_the_shown_tokens():
    # retries, sub-agents and compactions together: the shown tokens never lose information
    env = LedgerEnv(num_ops=30, header_ops=4)
    cfg = AgentSettings(max_calls=400, context_window=64, max_new_tokens=8)
    policy = GarbagePolicy(LedgerExpert(delegate_prob=0.3, seed=2), period=3)
    relations = set()
    for res in run(env, policy, n=3, cfg=cfg):
        by_id = {r.call_id: r for r in res.records}
        for view in call_views(res.records):
            relations.add(view.relation)
            assert np.array_equal(reconstruct(view, by_id), view.record.prompt)
            if view.relation in ("retry", "new-agent", "restart"):  # not an extension
                parent = by_id[view.record.parent_id]
                assert view.shared < parent.tokens.size
    assert relations == {"first", "extends", "retry", "new-agent", "restart"}


class AddEnv(TextEnvironment):
    """Add 2 + 3 with the ``add`` tool, then answer (answer-only milestones)."""

    name = "add"
    system_prompt = "You are a careful agent."
    tools = ({"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}},)  # fmt: skip

    def make_tasks(self, seed, n, split="train"):
        return [Task(f"add-{i}", seed + i) for i in range(n)]

    def reset(self, task):
        return {"answered": False}

    def task_text(self, state):
        return "What is 2 + 3?\nUse the add tool, then answer."

    async def call_tool(self, state, name, arguments):
        return TextStep("ok", str(arguments.get("a", 0) + arguments.get("b", 0)))

    async def answer(self, state, text):
        state["answered"] = "5" in text
        return TextStep("done" if state["answered"] else "ok", "Correct." if state["answered"]
                        else "Wrong, try again.")  # fmt: skip

    def milestones(self, state):
        return int(state["answered"]), 1


class ChatTurns(ScriptedPolicy):
    """The n-th assistant turn of a context is turns[n], then the end-of-turn token."""

    def __init__(self, chat, turns):
        self.chat, self.turns = chat, turns

    def program(self, request):
        n = self.chat.decode(request.prompt).count("<|im_start|>assistant") - 1
        text = self.turns[min(n, len(self.turns) - 1)]
        return [*self.chat.encode(text).tolist(), self.chat.turn_end_id]


def test_a_chat_execution_reads_as_the_exact_chat_text_turn_by_turn():
    tok = train_tokenizer()
    stops = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    chat = ChatFormat(tok, QWEN3_CHAT_TEMPLATE, stops)
    env = ChatEnvironment(AddEnv(), chat)
    turns = [format_tool_call("add", {"a": 2, "b": 3}), "It is 6.", "<think>\nsum\n</think>\n\n5"]
    cfg = AgentSettings(max_calls=10, context_window=4096, max_new_tokens=64)
    res = asyncio.run(run_execution(env, env.make_tasks(0, 1)[0], ChatTurns(chat, turns), cfg,
                                    "add-0#0"))  # fmt: skip
    assert res.end_reason == "success" and len(res.records) == 3
    text = render_execution(res, env.render_tokens, max_chars=10**6)
    parts = blocks(text)
    assert "".join(body for _, body in parts) == chat.decode(res.records[-1].tokens)
    assert parts[1][1].startswith("<tool_call>\n") and "<tool_response>\n5\n" in parts[2][1]
    assert (
        parts[4][0] == f"prompt: +{res.records[2].prompt.size - res.records[1].tokens.size} "
        "tokens after call 1's context:"
    )
    assert "<|im_start|>user\nWrong, try again.<|im_end|>" in parts[4][1]
    assert parts[5][1].endswith("5<|im_end|>") and "What is 2 + 3?\nUse" in parts[0][1]


# ---- branches are labelled -----------------------------------------------------------------


def test_retries_are_labelled_and_show_no_new_prompt():
    env = LedgerEnv(num_ops=8)
    res = next(r for r in run(env, GarbagePolicy(LedgerExpert(), period=2)) if r.stats["retries"])
    text = render_execution(res, env.render_tokens)
    garbage = [r for r in res.records if r.completion.tolist() == list(GarbagePolicy.GARBAGE)]
    assert f"branches: retries {res.stats['retries']}" in text
    for bad in garbage:
        (retry,) = [r for r in res.records if r.parent_id == bad.call_id]
        label = (f"RETRY of call {bad.call_id}: the same prompt ({retry.prompt.size} tokens); "
                 f"call {bad.call_id}'s completion was dropped")  # fmt: skip
        section = text.split(f"--- call {retry.call_id} |")[1].split("\n--- call")[0]
        assert section.splitlines()[1] == label
        assert section.splitlines()[2] == f"completion ({retry.completion.size} tokens):"


def test_compactions_and_sub_agents_are_labelled_with_the_part_that_differs():
    env = LedgerEnv(num_ops=30, header_ops=4)
    cfg = AgentSettings(max_calls=400, context_window=64, max_new_tokens=8)
    (res,) = run(env, LedgerExpert(), n=1, cfg=cfg)
    assert res.stats["compactions"] > 0
    prefix = env.task_prompt(env.reset(res.task))
    restarts = [v for v in call_views(res.records) if v.relation == "restart"]
    assert len(restarts) == res.stats["compactions"]
    text = render_execution(res, env.render_tokens)
    for v in restarts:
        # only the task prefix (and, after an earlier compaction, the summary head) is shared
        assert prefix.size <= v.shared < prefix.size + 6
        assert v.record.prompt[prefix.size] == V.SUMMARY
        assert (f"RESTART (not an extension of call {v.record.parent_id}'s context, e.g. a "
                f"compaction): {v.record.prompt.size} tokens, the first {v.shared} shared; the "
                f"{v.new_prompt.size} that differ:") in text  # fmt: skip
    policy = LedgerExpert(delegate_prob=0.5, seed=1)
    res = next(r for r in run(LedgerEnv(num_ops=8), policy) if r.stats["sub_agents"])
    subs = [v for v in call_views(res.records) if v.relation == "new-agent"]
    assert len(subs) == res.stats["sub_agents"]
    text = render_execution(res, V.decode)
    for v in subs:
        assert v.record.role == "sub-agent" and v.new_prompt[0] == V.SUB  # only BOS shared
        assert f"NEW CONTEXT (sub-agent, started by call {v.record.parent_id}): " in text


def test_a_record_whose_parent_is_missing_is_shown_whole_and_says_so():
    recs = [make_record([1, 2], [3], role="main", execution_id="e", call_id=0),
            make_record([1, 2, 3, 4], [5], role="main", execution_id="e", call_id=1,
                        parent_id=7)]  # fmt: skip
    views = call_views(recs)
    assert views[1].relation == "orphan" and views[1].new_prompt.tolist() == [1, 2, 3, 4]
    text = render_execution(ExecutionResult(recs, "t", 0.5), angle)
    assert "parent call 7 is not among the records" in text


# ---- truncation ----------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300), st.integers(0, 320))
def test_clip_keeps_head_and_tail_and_counts_what_it_cut(text, keep):
    out = clip(text, keep)
    if len(text) <= keep:
        assert out == text
        return
    m = re.fullmatch(r"(.*)\n\[\.\.\. (\d+) characters cut \.\.\.\]\n(.*)", out, re.S)
    head, cut, tail = m.group(1), int(m.group(2)), m.group(3)
    assert cut == len(text) - keep and len(head) + len(tail) == keep
    assert text.startswith(head) and text.endswith(tail) and abs(len(head) - len(tail)) <= 1


def test_long_calls_are_cut_in_the_middle_within_the_bound_per_call():
    long_prompt, long_completion = list(range(400)), list(range(1000, 1300))
    recs = [make_record(long_prompt, long_completion, role="main", execution_id="e", call_id=0),
            make_record(long_prompt + long_completion + [7], [8], role="main", execution_id="e",
                        call_id=1, parent_id=0)]  # fmt: skip
    res = ExecutionResult(recs, "t", 1.0)
    max_chars = 300
    text = render_execution(res, angle, max_chars=max_chars)
    parts = blocks(text)
    cut = lambda body: re.sub(r"\n\[\.\.\. \d+ characters cut \.\.\.\]\n", "", body)
    p0, c0 = cut(parts[0][1]), cut(parts[1][1])
    assert len(p0) + len(c0) == max_chars and len(p0) == len(c0)  # both long: half each
    full_p = angle(long_prompt)
    assert f"[... {len(full_p) - len(p0)} characters cut ...]" in parts[0][1]
    assert full_p.startswith(p0[: len(p0) // 2]) and full_p.endswith(p0[-(len(p0) // 2) :])
    # call 1: a short new prompt and completion are shown whole
    assert parts[2] == ("prompt: +1 tokens after call 0's context:", "<7>")
    assert parts[3][1] == "<8>"
    # a short prompt leaves its unused half to a long completion
    recs = [make_record([5], long_completion, role="main", execution_id="e", call_id=0)]
    parts = blocks(render_execution(ExecutionResult(recs, "t", 1.0), angle, max_chars=max_chars))
    assert parts[0][1] == "<5>" and len(cut(parts[1][1])) == max_chars - 3
    with pytest.raises(ValueError, match="max_chars"):
        render_execution(res, angle, max_chars=1)


def test_many_calls_show_the_first_and_last_with_a_count_of_the_rest():
    env = LedgerEnv(num_ops=8)
    (res,) = run(env, LedgerExpert(), n=1)
    text = render_execution(res, env.render_tokens, max_calls=5)
    shown = [int(m) for m in re.findall(r"^--- call (\d+) ", text, re.M)]
    assert shown == [0, 1, 2, 6, 7] and "[... 3 calls not shown ...]" in text


# ---- choice of executions per step -----------------------------------------------------------


def fake(eid: str, score) -> ExecutionResult:
    rec = make_record([1], [2], role="main", execution_id=eid, call_id=0)
    end = "infra_error" if score is None else ("success" if score == 1.0 else "failure")
    return ExecutionResult([rec], eid.split("#")[0], score, end_reason=end)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from([None, 0.0, 0.25, 0.5, 1.0]), min_size=1, max_size=12),
       st.integers(1, 6), st.randoms(use_true_random=False))  # fmt: skip
# a tie between t1#1 and t1#10 (one id a prefix of the other) goes to the first id
@example([None, 0.0, *[None] * 8, 0.0], 1, random.Random(0))
def test_choice_is_best_worst_then_by_id_whatever_the_order(scores, n, rnd):
    results = [fake(f"t{k % 3}#{k}", s) for k, s in enumerate(scores)]
    chosen = choose_executions(results, n)
    ids = [(results[i].execution_id, why) for i, why in chosen]
    shuffled = results[:]
    rnd.shuffle(shuffled)
    assert [(shuffled[i].execution_id, w) for i, w in choose_executions(shuffled, n)] == ids
    # reference: sort by the rule directly
    scored = sorted((r for r in results if r.score is not None), key=lambda r: r.execution_id)
    expect = []
    if scored:
        # ties go to the first execution id (scored is in id order, min keeps the first)
        best = min(scored, key=lambda r: -r.score)
        expect.append((best.execution_id, "highest score"))
        rest = [r for r in scored if r is not best]
        if rest and n > 1:
            expect.append((min(rest, key=lambda r: r.score).execution_id, "lowest score"))
    seen = {e for e, _ in expect}
    expect += [
        (r.execution_id, "first by execution id")
        for r in sorted(results, key=lambda r: r.execution_id)
        if r.execution_id not in seen
    ]
    assert ids == expect[:n]
    assert len(ids) == min(n, len(results))


def test_a_step_shows_success_and_failure_and_says_why_each_was_chosen():
    env = LedgerEnv(num_ops=8)
    results = run(env, LedgerExpert(), n=3) + run(env, WrongPolicy(), n=2, seed=5)
    random.Random(0).shuffle(results)
    text = render_step(7, results, env.render_tokens, max_executions=3)
    lines = text.splitlines()
    assert lines[0] == "=== step 7 ===" and lines[-1] == "=== end of step 7 ==="
    assert lines[1].startswith("5 executions (failure 2, success 3); showing 3: ")
    executions = split_executions(text)
    assert len(executions) == 3
    assert "[highest score]" in executions[0] and "| success | score 1.000 |" in executions[0]
    assert "[lowest score]" in executions[1] and "| failure | score 0.000 |" in executions[1]
    assert "[first by execution id]" in executions[2]
    assert render_step(7, results[::-1], env.render_tokens, max_executions=3) == text


# ---- the file ------------------------------------------------------------------------------


def test_append_and_read_round_trip_skips_a_cut_block_and_keeps_the_later_repeat(tmp_path):
    env = LedgerEnv(num_ops=8)
    path = str(tmp_path / "executions.txt")
    step1, step2 = run(env, LedgerExpert(), n=2), run(env, WrongPolicy(), n=2, seed=3)
    write_step_transcripts(path, 1, step1, env.render_tokens)
    write_step_transcripts(path, 2, step2, env.render_tokens, max_executions=1)
    got = read_transcripts(path)
    assert list(got) == [1, 2]
    assert got[1] == render_step(1, step1, env.render_tokens).split("\n", 1)[1].rsplit(
        "\n\n=== end", 1)[0]  # fmt: skip
    assert len(split_executions(got[1])) == 2 and len(split_executions(got[2])) == 1
    # a kill in the middle of writing step 3: its block is cut (mid-line, mid-character)
    block = render_step(3, step1, env.render_tokens).encode()
    with open(path, "ab") as f:
        f.write(block[: len(block) // 2] + "é".encode()[:1])
    assert list(read_transcripts(path)) == [1, 2]
    # the resumed run redoes step 3 (and a step 2 whose text differs): the later block wins
    write_step_transcripts(path, 3, step2, env.render_tokens, max_executions=2)
    write_step_transcripts(path, 2, step1, env.render_tokens, max_executions=2)
    got = read_transcripts(path)
    assert list(got) == [1, 2, 3]
    assert "| success |" in got[2] and "| failure |" in got[3]
    assert "=== step" not in got[3] and got[3].startswith("2 executions")


def test_token_text_cannot_forge_markers_or_execution_headers(tmp_path):
    nasty = lambda t: "x\n=== end of step 1 ===\n=== step 9 ===\r\n### execution forged\u2028y"
    results = [fake("a#0", 1.0), fake("b#0", 0.0)]
    path = str(tmp_path / "executions.txt")
    write_step_transcripts(path, 1, results, nasty)
    got = read_transcripts(path)
    assert list(got) == [1]
    assert [e.splitlines()[0].split(" [")[0] for e in split_executions(got[1])] == [
        "### execution a#0", "### execution b#0"]  # fmt: skip
    assert nasty(None).split("\n")[1] in got[1]  # the text is kept, only indented


def test_bad_input_is_named(tmp_path):
    path = str(tmp_path / "executions.txt")
    good = [fake("a#0", 1.0)]
    with pytest.raises(TypeError, match="ExecutionResult"):
        render_execution({"records": []}, angle)
    with pytest.raises(TypeError, match=r"results\[1\] is a dict"):
        write_step_transcripts(path, 1, good + [{}], angle)
    for step in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="step must be an int >= 0"):
            write_step_transcripts(path, step, good, angle)
    with pytest.raises(ValueError, match="max_executions must be >= 1"):
        write_step_transcripts(path, 1, good, angle, max_executions=0)
    with pytest.raises(FileNotFoundError):
        read_transcripts(str(tmp_path / "missing.txt"))
    assert not (tmp_path / "executions.txt").exists()  # nothing written on bad input


def test_a_step_without_executions_and_an_execution_without_calls(tmp_path):
    path = str(tmp_path / "executions.txt")
    write_step_transcripts(path, 4, [], angle)
    assert read_transcripts(path) == {4: "0 executions"}
    empty = ExecutionResult([], "t", None, execution_id="t#0", end_reason="infra_error",
                            stats={"detail": "env reset failed"})  # fmt: skip
    text = render_execution(empty, angle)
    assert "score none (infrastructure error)" in text and "(no model calls)" in text
    assert "ending detail: env reset failed" in text
    long = dataclasses.replace(empty, stats={"detail": "Traceback\n  line 3"})
    assert f"ending detail:\n{INDENT}Traceback\n{INDENT}  line 3" in render_execution(long, angle)
