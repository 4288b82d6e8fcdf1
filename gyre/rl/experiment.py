"""The experiments launch.py runs (``run.entry``): each takes the specs gyre/run.py built
from the config, and a workdir.

- ``rl``: supervised warm start, RL under the elastic scheduler, evaluation, plots;
- ``sft``: the supervised warm start alone, exported as a Hugging Face checkpoint;
- ``harness``: the agent harness with scripted policies on the ledger task (no model);
- ``smoke``: cells, a tiny model, one train step, a role move.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

from gyre import plots, smoke
from gyre.agent.driver import run_scripted_harness
from gyre.cache import cache_dir
from gyre.envs.chat_env import tool_metrics
from gyre.envs.registry import is_chat, make_env
from gyre.errors import AlreadyFinished, ConfigError, Stopped
from gyre.metrics import (
    Heartbeat,
    MetricsWriter,
    RunClock,
    all_infra_line,
    clock,
    eta,
    progress_line,
    read_metrics,
    steady_seconds,
    write_json,
)
from gyre.model import hf_dir
from gyre.rl.builder import build_runtime, text_checkpoint
from gyre.rl.controller import Controller
from gyre.rl.progress import RoleTimeline, RunLedger
from gyre.rl.report import eval_table, rl_status, summary_table, where_line, where_now
from gyre.rl.transcripts import write_step_transcripts
from gyre.rl.warmstart import warm_start
from gyre.rl.work import StepRecord, step_metrics
from gyre.signals import armed, stop_requested
from gyre.watchdog import Watchdog

PROGRESS_KEYS = ("reward", "success", "partial", "grad_norm", "eval_success", "role_train_frac",
                 "step_seconds")  # fmt: skip


class StepRecorder:
    """What happens after each optimizer step, in an order that makes resume exact: the
    ledger line, the evaluation, the metrics row, the checkpoint, then the time line. A kill
    anywhere in between resumes from the checkpoint before, whose resume drops the ledger line
    and the row of the step it re-runs, so no row is lost or written twice."""

    def __init__(self, rt, ctrl: Controller, ledger: RunLedger, writer: MetricsWriter, log,
                 after=None, run_clock: RunClock | None = None):  # fmt: skip
        self.rt, self.ctrl, self.ledger, self.writer, self.log = rt, ctrl, ledger, writer, log
        self.after = after
        self.run_clock = run_clock or RunClock(rt.specs.run.steps, rt.trainer.version)
        self.eval_outcomes = None  # per task, of the latest evaluation
        self.checkpoint_s = 0.0  # how long the latest checkpoint took (in the next row)
        self.infra_steps = 0  # steps in a row whose every execution was an infrastructure error

    async def __call__(self, record: StepRecord) -> None:
        specs = self.rt.specs
        self.run_clock.step_done(record.version)
        ended = round(self.ctrl.timeline.now(), 3)  # roles.png's step ends
        metrics = step_metrics(record, specs.trajectory.reward)
        metrics.update(tool_metrics(record.results))  # a chat task's tool calls
        self.ledger.record_step(record.step, record.execution_ids, record.groups)
        # what the agent did, readable: the best, the worst and two more of the step
        write_step_transcripts(self.rt.path("executions.txt"), record.version, record.results,
                               self.rt.env.render_tokens)  # fmt: skip
        last = record.version == specs.run.steps
        if specs.eval.due(record.version, last):
            ev = specs.eval
            self.run_clock.eval_started()
            metrics.update(await self.ctrl.evaluate(ev.tasks, ev.seed, ev.temperature))
            metrics["eval_seconds"] = round(self.run_clock.eval_done(), 3)
            self.eval_outcomes = metrics.pop("eval_outcomes")
        del metrics["step"]  # rows count steps from 1: row s is the state after step s
        metrics["timeline_s"] = ended
        metrics["last_checkpoint_seconds"] = self.checkpoint_s
        self.writer.write(record.version, metrics)
        if last or record.version % specs.run.checkpoint_every == 0 or stop_requested():
            t0 = time.time()
            self.rt.trainer.save(self.rt.checkpointer, {"next_step": record.version}, wait=True)
            self.checkpoint_s = round(time.time() - t0, 4)
        self.ctrl.timeline.save(self.rt.path("timeline.json"))
        if self.after is not None:
            self.after()
        line = progress_line(record.version, specs.run.steps, metrics, PROGRESS_KEYS)
        self.log(f"{line} | {self.run_clock.eta()}")
        infra = all_infra_line(record.version, record.results)  # a step that trained nothing
        self.infra_steps = self.infra_steps + 1 if infra else 0
        if infra:
            self.log(infra)
            if self.infra_steps >= specs.trainer.max_bad_steps:
                raise RuntimeError(f"{self.infra_steps} steps in a row ended every execution as "
                                   f"an infrastructure error (train.max_bad_steps="
                                   f"{specs.trainer.max_bad_steps}): {infra}")  # fmt: skip


def run_warm_start(rt, log=print, on_step=None) -> tuple[object, dict]:
    """The supervised warm start of ``rt``'s specs (cached) -> (params, info)."""
    specs, sft = rt.specs, rt.specs.sft
    seed = sft.recipe.seed
    if specs.init_dir or seed == specs.seed:
        init = rt.trainer.params  # the checkpoint, or the run seed's initial weights
    else:
        init = rt.init_params(seed)
    params, info = warm_start(
        sft, rt.cells, rt.graphdef, init, cache_dir("warmstart", sft.dir),
        # keyed by the warm start's seed: its stopping rule may read this evaluation
        lambda p: rt.evaluate_now(p, sft.eval_tasks, seed + 1), log, on_step, env=rt.env,
    )  # fmt: skip
    return params, info


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _before_rl(rt, timeline: RoleTimeline, hb: Heartbeat, writer, summary: dict,
               beat=lambda: None) -> None:  # fmt: skip
    """The warm start and the evaluation before RL (a fresh run only), on the time line;
    beat() at every warm-start step and model call (the watchdog's)."""
    specs = rt.specs
    if specs.sft.steps:
        timeline.set_all("warmstart")
        progress = {"step": 0}
        total = specs.sft.steps
        hb.status = lambda: (f"warm start step {progress['step']}/{total} (before RL), "
                             f"{eta(hb.elapsed(), progress['step'], total)} of the warm start "
                             "at most")  # fmt: skip
        params, summary["warm_start"] = run_warm_start(
            rt, hb.say, lambda step, info: (beat(), progress.update(step=step))
        )
        rt.install(params)
        for row in summary["warm_start"].pop("history", []):
            writer.scalars("warmstart", row["step"], row)
    if specs.eval.tasks:
        timeline.set_all("eval")
        calls: list[float] = []  # when each model call of the evaluation returned
        t0 = time.monotonic()
        hb.status = lambda: (f"evaluation before RL: {specs.eval.tasks} held-out tasks, "
                             f"{len(calls)} model calls, {clock(time.monotonic() - t0)} in "
                             "(the serving programs compile here; the RL steps follow)")  # fmt: skip
        ev = specs.eval

        def on_call() -> None:
            beat()
            calls.append(time.monotonic())

        summary["eval_start"] = rt.evaluate_now(rt.trainer.params, ev.tasks, ev.seed,
                                                ev.temperature, on_call=on_call)  # fmt: skip
        summary["eval_start_outcomes"] = summary["eval_start"].pop("eval_outcomes")
        # what an evaluation takes once compiled (the ETA's estimate of the ones to come)
        summary["eval_seconds"] = round(steady_seconds(calls, t0, time.monotonic()), 3)
        summary["eval_calls"] = len(calls)
        hb.say("before RL: " + ", ".join(f"{k} {v:.4g}" for k, v in summary["eval_start"].items()))


def rl(specs, workdir: str, after_microbatch=None) -> dict:
    """Runs (or resumes) one RL experiment in ``workdir`` and returns its summary.

    after_microbatch: a hook called with the micro-batch count (tests kill the run, or one of
    its Ray actors, with it). A relaunch of a finished run raises
    AlreadyFinished and leaves the workdir as it is.
    """
    t0 = time.time()
    rt = build_runtime(specs, workdir)
    try:
        return _rl(rt, t0, after_microbatch)
    finally:
        rt.close()


def _rl(rt, t0: float, after_microbatch) -> dict:
    specs, workdir = rt.specs, rt.workdir
    steps = specs.run.steps
    if rt.resumed and rt.trainer.version >= steps:
        raise AlreadyFinished(
            f"{workdir} already holds all {steps} steps of this run; its outputs are left as "
            f"they are (raise run.steps to train on, or use another workdir)"
        )
    ledger = RunLedger(workdir)
    previous = _read_json(rt.path("summary.json")) if rt.resumed else {}
    if rt.resumed:
        ledger.truncate(rt.trainer.version)
    timeline = RoleTimeline.load(rt.path("timeline.json"), len(rt.cells))
    kept = ("warm_start", "eval_start", "eval_start_outcomes", "eval_seconds", "eval_calls")
    summary: dict = {k: v for k, v in previous.items() if k in kept}
    summary.update(name=specs.name, scheduler=specs.run.scheduler_policy, cells=len(rt.cells),
                   eval_temperature=specs.eval.temperature)  # fmt: skip

    def save_summary() -> None:
        """The summary so far (a kill keeps what came before RL, and the time spent)."""
        wall = round(previous.get("wall_seconds", 0.0) + time.time() - t0, 1)
        write_json(rt.path("summary.json"), dict(summary, wall_seconds=wall, finished=False))

    writer = MetricsWriter(workdir)
    where = {"now": lambda: "before RL (warm start or evaluation)"}
    watchdog = Watchdog(specs.run.watchdog_s, lambda: where["now"](),
                        error_path=rt.path("error.txt"))  # fmt: skip
    with Heartbeat() as hb, watchdog:
        hb.say(where_line(rt, workdir))
        if rt.resumed:
            hb.say(f"resuming after step {rt.trainer.version}/{steps} from the checkpoint in "
                   f"{rt.checkpointer.directory}")  # fmt: skip
        try:
            if rt.trainer.version == 0:
                _before_rl(rt, timeline, hb, writer, summary, watchdog.beat)
                if "eval_start" in summary:
                    writer.scalars("", 0, summary["eval_start"])  # the curves' step 0
                save_summary()
            run_clock = RunClock(steps, rt.trainer.version, lambda v: specs.eval.due(v, v == steps),
                                 summary.get("eval_seconds"),
                                 eval_calls=summary.get("eval_calls", 0))  # fmt: skip

            def on_progress() -> None:  # a model call, execution or micro-batch finished
                watchdog.beat()
                run_clock.tick()

            ctrl = Controller(rt, timeline=timeline, after_microbatch=after_microbatch,
                              should_stop=stop_requested, on_progress=on_progress)  # fmt: skip
            if rt.resumed:  # carry-over: groups running at the kill run again
                ctrl.rollouts.restart_untrained(rt.trainer.version, ledger.trained_groups())
            where["now"] = lambda: where_now(ctrl)
            watchdog.beat()  # what came before RL has finished: the controller's time starts now
            recorder = StepRecorder(rt, ctrl, ledger, writer, hb.say, save_summary, run_clock)
            rows = read_metrics(workdir)  # hand-over counts carry on from the earlier part
            ctrl.handovers.update({k[len("handover_"):]: v for k, v in (rows[-1] if rows else {})
                                   .items() if k.startswith("handover_")})  # fmt: skip
            run_clock.start()
            hb.status = lambda: rl_status(ctrl, run_clock)
            with armed():
                complete = asyncio.run(ctrl.run(recorder))
        finally:
            writer.close()
            rt.checkpointer.wait()
            timeline.save(rt.path("timeline.json"))
        if complete and is_chat(specs.env.name):  # the trained policy, in the layout it came in
            hb.status = lambda: f"exporting the trained policy to {rt.path('hf')}"
            hb.say(hb.status())
            export_checkpoint(rt, rt.final_params())
    if not complete:
        raise Stopped(f"stopped on request after step {rt.trainer.version}/{steps}, "
                      f"checkpointed: relaunch the same command to continue {workdir}")  # fmt: skip
    rows = read_metrics(workdir)
    last = rows[-1] if rows else {}
    summary.update(
        steps=len(rows),
        final_version=rt.trainer.version,
        wall_seconds=round(previous.get("wall_seconds", 0.0) + time.time() - t0, 1),
        reward_first=rows[0]["reward"] if rows else None,
        reward_last=last.get("reward"),
        eval_end={k: v for k, v in last.items() if k.startswith("eval_") and k != "eval_seconds"},
        eval_end_outcomes=recorder.eval_outcomes,
        switches=timeline.switches,
        handovers={k[len("handover_") :]: v for k, v in last.items() if k.startswith("handover_")},
        prefix_hit_rate=round(rt.proxy.prefix_hit_rate(), 4),
        finished=True,
    )
    if rt.cluster is not None:  # every cross-process move, and the pulls that made them
        summary["transfers"] = rt.cluster.transfer_stats()
    draw_pictures(rt.path(""), rows, summary, timeline.all_spans())
    print(summary_table(summary), flush=True)
    return summary


def draw_pictures(workdir: str, rows: list[dict], summary: dict, spans) -> None:
    """learning_curves.png and roles.png of a run (``spans``: its role time line)."""
    name, steps = summary.get("name", "run"), len(rows)
    plots.learning_curves(rows, os.path.join(workdir, "learning_curves.png"),
                          start=summary.get("eval_start"),
                          title=f"{name}: {steps} RL steps; training per step (mean ± SE over its "
                          "executions), held-out evaluations as points ± SE")  # fmt: skip
    ends = [(r["step"], r["timeline_s"]) for r in rows if "timeline_s" in r]
    plots.role_timeline(spans, os.path.join(workdir, "roles.png"),
                        title=f"{name}: what each cell did ({summary.get('scheduler', '?')} "
                        f"scheduler, {summary.get('switches', 0)} role switches)",
                        step_ends=ends)  # fmt: skip


def export_checkpoint(rt, params) -> str:
    """Writes ``params`` to <workdir>/hf: a Hugging Face Qwen3 directory (with the starting
    checkpoint's tokenizer and chat template when it had them; it opens in transformers)."""
    specs, path = rt.specs, rt.path("hf")
    hf_dir.save(path, params, specs.model, text_checkpoint(specs))
    return path


def sft(specs, workdir: str) -> dict:
    """The warm start alone, exported as a Hugging Face checkpoint in <workdir>/hf (a run
    starts from it with --config.model.hf_dir=<workdir>/hf)."""
    rt = build_runtime(specs, workdir)
    try:
        params, info = run_warm_start(rt)
    finally:
        rt.checkpointer.close()
    export_checkpoint(rt, params)
    info["eval"] = rt.evaluate_now(params, max(specs.eval.tasks, 16), specs.seed)
    del info["eval"]["eval_outcomes"]
    print(f"warm start exported to {rt.path('hf')}: {json.dumps(info)}", flush=True)
    return info


class _Counting:
    """An environment that counts its tool calls and its ended executions (for the status
    line); everything else is the wrapped environment's."""

    def __init__(self, env):
        self.env, self.tool_calls, self.ended = env, 0, 0

    def __getattr__(self, name):
        return getattr(self.env, name)

    async def step(self, state, call, role):
        self.tool_calls += 1
        return await self.env.step(state, call, role)

    def judge(self, *args, **kwargs):
        self.ended += 1
        return self.env.judge(*args, **kwargs)


def harness(specs, workdir: str) -> dict:
    """The scripted harness on the ledger task; figures to <workdir>/harness.json."""
    run = specs.run
    env = _Counting(make_env(specs.env))
    total = run.tasks_per_step * run.samples_per_task
    status = lambda: (f"scripted harness on {specs.env.name} (K = {specs.env.num_ops}): "
                      f"{env.ended}/{total} executions ended, {env.tool_calls} tool calls")  # fmt: skip
    with Heartbeat(status=status) as hb:
        hb.say(f"{specs.name}: {total} executions of scripted policies (no model); a status line "
               "every 10 s")  # fmt: skip
        summary = run_scripted_harness(env, specs.agent, specs.seed, run.tasks_per_step,
                                       run.samples_per_task)  # fmt: skip
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "harness.json"), "w") as f:
        json.dump(summary, f, indent=2, default=str)
    return summary


def smoke_test(specs, workdir: str) -> dict:
    """Cells, a tiny model, one forward/backward, a role move (gyre/smoke.py)."""
    now = {"phase": "starting"}
    with Heartbeat(status=lambda: f"smoke: {now['phase']}") as hb:
        hb.say(f"{specs.name}: cells, a tiny model, one forward/backward, a role move")

        def phase(name: str) -> None:
            now["phase"] = name
            hb.say(f"smoke: {name}")

        return smoke.run(specs.mesh, specs.model, specs.seed, workdir, phase)


def evaluate(specs, workdir: str) -> dict:
    """``launch.py --mode=eval``: the held-out evaluation of the latest checkpoint in
    ``workdir`` (or, when it holds none, of ``model.hf_dir``: e.g. a run's exported hf/), with
    the run's evaluation settings, printed as the end-of-run table (against the run's
    evaluation before RL when the workdir has one). run.main writes it to <workdir>/eval.json."""
    ev = specs.eval
    if not ev.tasks:
        raise ConfigError("config key 'eval.tasks' is 0: nothing to evaluate (set it, e.g. "
                          "--config.eval.tasks=256)")  # fmt: skip
    rt = build_runtime(specs, workdir)
    try:
        if rt.resumed:
            what = f"the checkpoint after step {rt.trainer.version} in {rt.checkpointer.directory}"
        else:
            what = f"the weights in {specs.init_dir}" if specs.init_dir else "the initial weights"
        calls, t0 = [0], time.monotonic()
        status = lambda: (f"evaluating {what}: {ev.tasks} held-out tasks, {calls[0]} model "
                          f"calls, {clock(time.monotonic() - t0)} in")  # fmt: skip
        with Heartbeat(status=status) as hb:
            hb.say(f"evaluating {what} on {ev.tasks} held-out tasks "
                   f"({'greedy' if not ev.temperature else f'temperature {ev.temperature:g}'})")  # fmt: skip
            result = rt.evaluate_now(rt.trainer.params, ev.tasks, ev.seed, ev.temperature,
                                     on_call=lambda: calls.__setitem__(0, calls[0] + 1))  # fmt: skip
    finally:
        rt.close()
    run = _read_json(rt.path("summary.json"))
    summary = {k: v for k, v in run.items() if k in ("eval_start", "eval_start_outcomes")}
    summary.update(name=specs.name, evaluated=what, version=rt.trainer.version,
                   eval_temperature=ev.temperature, eval_end_outcomes=result.pop("eval_outcomes"),
                   eval_end=result, wall_seconds=round(time.monotonic() - t0, 1))  # fmt: skip
    print(eval_table(summary), flush=True)
    return summary
