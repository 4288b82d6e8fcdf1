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
from gyre.envs.registry import is_chat, make_env
from gyre.errors import AlreadyFinished, Stopped
from gyre.metrics import Heartbeat, MetricsWriter, eta, progress_line, read_metrics, write_json
from gyre.model import hf_dir
from gyre.rl.builder import build_runtime, text_checkpoint
from gyre.rl.controller import Controller
from gyre.rl.progress import RoleTimeline, RunLedger
from gyre.rl.report import rl_status, summary_table, where_line, where_now
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
                 after=None):  # fmt: skip
        self.rt, self.ctrl, self.ledger, self.writer, self.log = rt, ctrl, ledger, writer, log
        self.after = after
        self.eval_outcomes = None  # per task, of the latest evaluation
        self.checkpoint_s = 0.0  # how long the latest checkpoint took (in the next row)

    async def __call__(self, record: StepRecord) -> None:
        specs = self.rt.specs
        metrics = step_metrics(record, specs.trajectory.reward)
        self.ledger.record_step(record.step, record.execution_ids, record.groups)
        # what the agent did, readable: the best, the worst and two more of the step
        write_step_transcripts(self.rt.path("executions.txt"), record.version, record.results,
                               self.rt.env.render_tokens)  # fmt: skip
        last = record.version == specs.run.steps
        if specs.eval.due(record.version, last):
            ev = specs.eval
            metrics.update(await self.ctrl.evaluate(ev.tasks, ev.seed, ev.temperature))
            self.eval_outcomes = metrics.pop("eval_outcomes")
        del metrics["step"]  # rows count steps from 1: row s is the state after step s
        metrics["last_checkpoint_seconds"] = self.checkpoint_s
        self.writer.write(record.version, metrics)
        if last or record.version % specs.run.checkpoint_every == 0 or stop_requested():
            t0 = time.time()
            self.rt.trainer.save(self.rt.checkpointer, {"next_step": record.version}, wait=True)
            self.checkpoint_s = round(time.time() - t0, 4)
        self.ctrl.timeline.save(self.rt.path("timeline.json"))
        if self.after is not None:
            self.after()
        self.log(progress_line(record.version, specs.run.steps, metrics, PROGRESS_KEYS))


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
        lambda p: rt.evaluate_now(p, sft.eval_tasks, seed + 1), log, on_step,
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
        hb.status = lambda: (f"warm start step {progress['step']}/{total}, "
                             f"{eta(hb.elapsed(), progress['step'], total)} (at most)")  # fmt: skip
        params, summary["warm_start"] = run_warm_start(
            rt, hb.say, lambda step, info: (beat(), progress.update(step=step))
        )
        rt.install(params)
        for row in summary["warm_start"].pop("history", []):
            writer.scalars("warmstart", row["step"], row)
    if specs.eval.tasks:
        timeline.set_all("eval")
        hb.status = lambda: f"evaluating {specs.eval.tasks} held-out tasks before RL"
        ev = specs.eval
        summary["eval_start"] = rt.evaluate_now(rt.trainer.params, ev.tasks, ev.seed,
                                                ev.temperature, on_call=beat)  # fmt: skip
        summary["eval_start_outcomes"] = summary["eval_start"].pop("eval_outcomes")
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
    summary: dict = {k: v for k, v in previous.items()
                     if k in ("warm_start", "eval_start", "eval_start_outcomes")}  # fmt: skip
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
            ctrl = Controller(rt, timeline=timeline, after_microbatch=after_microbatch,
                              should_stop=stop_requested, on_progress=watchdog.beat)  # fmt: skip
            if rt.resumed:  # carry-over: groups running at the kill run again
                ctrl.rollouts.restart_untrained(rt.trainer.version, ledger.trained_groups())
            where["now"] = lambda: where_now(ctrl)
            watchdog.beat()  # what came before RL has finished: the controller's time starts now
            recorder = StepRecorder(rt, ctrl, ledger, writer, hb.say, save_summary)
            rows = read_metrics(workdir)  # hand-over counts carry on from the earlier part
            ctrl.handovers.update({k[len("handover_"):]: v for k, v in (rows[-1] if rows else {})
                                   .items() if k.startswith("handover_")})  # fmt: skip
            v0, t_rl = rt.trainer.version, time.monotonic()
            hb.status = lambda: rl_status(ctrl, v0, time.monotonic() - t_rl)
            with armed():
                complete = asyncio.run(ctrl.run(recorder))
        finally:
            writer.close()
            rt.checkpointer.wait()
            timeline.save(rt.path("timeline.json"))
    if complete and is_chat(specs.env.name):  # the trained policy, in the layout it came in
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
        eval_end={k: v for k, v in last.items() if k.startswith("eval_")},
        eval_end_outcomes=recorder.eval_outcomes,
        switches=timeline.switches,
        handovers={k[len("handover_") :]: v for k, v in last.items() if k.startswith("handover_")},
        prefix_hit_rate=round(rt.proxy.prefix_hit_rate(), 4),
        finished=True,
    )
    if rt.cluster is not None:  # every cross-process move, and the pulls that made them
        summary["transfers"] = rt.cluster.transfer_stats()
    # The policy loss is ~0 by construction at the start of an on-policy step (ratio 1,
    # mean-centred advantages), so the curves show what moves: success, reward, evaluation,
    # the policy's entropy and the gradient norm.
    plots.learning_curves(rows, rt.path("learning_curves.png"),
                          ("success", "reward", "eval_success", "eval_milestones", "entropy",
                           "grad_norm"), start=summary.get("eval_start"))  # fmt: skip
    plots.role_timeline(timeline.all_spans(), rt.path("roles.png"))
    print(summary_table(summary), flush=True)
    return summary


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


def harness(specs, workdir: str) -> dict:
    """The scripted harness on the ledger task; figures to <workdir>/harness.json."""
    run = specs.run
    summary = run_scripted_harness(make_env(specs.env), specs.agent, specs.seed,
                                   run.tasks_per_step, run.samples_per_task)  # fmt: skip
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "harness.json"), "w") as f:
        json.dump(summary, f, indent=2, default=str)
    return summary


def smoke_test(specs, workdir: str) -> dict:
    """Cells, a tiny model, one forward/backward, a role move (gyre/smoke.py)."""
    return smoke.run(specs.mesh, specs.model, specs.seed, workdir)
