"""The ETA says what was measured, on a fake clock: none before one step has finished here,
within 30% of the time actually left from the end of step 2 on (a run shaped like the quick
start: the first step and the evaluation before RL hold the compiles, steps vary by a third,
a final evaluation), never rising within a step, and as good after a resume. The RL status
line names its phase."""

from __future__ import annotations

import re
import types

import pytest

from gyre.metrics import RunClock, steady_seconds
from gyre.rl.report import rl_status

# The quick start's shape, measured (tests/test_quickstart.py's run on 2 cores): the first
# step 45 s (compiles), then 16-22 s; the evaluation before RL 40 s of which ~25 s compile,
# the final one 16 s.
STEPS = [45.0, 17.0, 16.0, 16.7, 21.1, 21.9, 19.1, 15.3, 15.9, 13.3]
FINAL_EVAL = 16.0


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def eval_before(clock: FakeClock) -> float:
    """An evaluation of 1,000 model calls: 24 s of compiles, then calls at a steady rate
    for 16 s -> the steady_seconds estimate of the next one."""
    t0 = clock.t
    calls = [t0 + 24.0 + 16.0 * (i + 1) / 1000 for i in range(1000)]
    clock.t = calls[-1]
    return steady_seconds(calls, t0, clock.t)


def run(rc: RunClock, clock: FakeClock, steps, errors: list, first: int):
    """Drives ``rc`` through ``steps`` (seconds each) and the final evaluation, recording
    (step, relative error) at each step's end and at points within it, and checking that the
    ETA never rises within a step."""
    actual_end = clock.t + sum(steps) + FINAL_EVAL
    rc.start()
    for k, seconds in enumerate(steps, start=first + 1):
        begin, previous = clock.t, None
        for frac in (0.25, 0.5, 0.75, 1.0, 1.3):  # 1.3: a step slower than the estimate
            clock.t = begin + min(frac, 1.0) * seconds if frac <= 1.0 else clock.t
            left = rc.remaining()
            if k == first + 1:
                assert left is None, "no ETA before one step has finished in this process"
            elif previous is not None:
                assert left <= previous + 1e-9, f"the ETA rose within step {k}"
            previous = left
            if frac == 1.0:
                break
        rc.step_done(k)
        left, actual = rc.remaining(), actual_end - clock.t
        errors.append((k, (left - actual) / actual))
    rc.eval_started()
    for frac in (0.25, 0.5, 0.75):
        clock.t += 0.25 * FINAL_EVAL
        left, actual = rc.remaining(), actual_end - clock.t
        errors.append((f"eval {frac}", (left - actual) / actual))
    clock.t = actual_end
    assert rc.eval_done() == pytest.approx(FINAL_EVAL)
    assert rc.remaining() == 0.0


def test_eta_within_30_percent_from_the_end_of_step_2():
    clock = FakeClock()
    eval_s = eval_before(clock)
    assert eval_s == pytest.approx(16.0, rel=0.05)  # the compiles left out
    rc = RunClock(10, 0, lambda v: v == 10, eval_s, clock=clock)
    errors: list = []
    run(rc, clock, STEPS, errors, first=0)
    late = [(k, e) for k, e in errors if not isinstance(k, int) or k >= 2]
    assert all(abs(e) <= 0.30 for _, e in late), late


def test_eta_after_a_resume_measures_again_and_keeps_the_evaluation_estimate():
    clock = FakeClock()
    clock.t = 1000.0  # another process: nothing measured before counts
    rc = RunClock(10, 2, lambda v: v == 10, 16.0, clock=clock)  # eval_s from summary.json
    assert rc.remaining() is None and rc.eta() == "ETA ?"
    errors: list = []
    run(rc, clock, [30.0] + STEPS[3:], errors, first=2)  # the first step here compiles again
    # from the end of the second step measured in this process on
    late = [(k, e) for k, e in errors if not isinstance(k, int) or k >= 4]
    assert all(abs(e) <= 0.30 for _, e in late), late


def test_evaluations_during_rl_are_timed_apart_from_the_steps():
    clock = FakeClock()
    rc = RunClock(4, 0, lambda v: v % 2 == 0, 5.0, clock=clock)
    rc.start()
    for k in range(1, 5):
        clock.t += 10.0
        rc.step_done(k)
        if k % 2 == 0:
            assert rc.remaining() == pytest.approx((4 - k) * 10.0 + 5.0 * (4 - k) / 2 + 5.0)
            rc.eval_started()
            clock.t += 5.0
            rc.eval_done()
    assert rc.intervals == [10.0] * 4 and rc.remaining() == 0.0


def _ctrl(steps=10, works=()):
    specs = types.SimpleNamespace(
        run=types.SimpleNamespace(steps=steps, executions_per_step=128),
        eval=types.SimpleNamespace(tasks=256),
    )
    return types.SimpleNamespace(specs=specs, roles=["rollout"] * 3 + ["train"],
                                 steps={w.step: w for w in works})  # fmt: skip


def _work(step, finished, trained, queued):
    return types.SimpleNamespace(step=step, results=[0] * finished, grads=[0] * trained,
                                 queue=[0] * queued)  # fmt: skip


def test_the_status_line_names_its_phase_and_counts_per_step():
    clock = FakeClock()
    rc = RunClock(10, 0, lambda v: v == 10, 16.0, clock=clock)
    rc.start()
    ctrl = _ctrl(works=[_work(0, 57, 3, 5)])
    line = rl_status(ctrl, rc)
    assert line.startswith("RL step 1/10 (the first in this process") and "ETA once" in line
    assert not re.search(r"ETA \d", line)
    assert "this step: 57/128 executions finished, 3 of 8 micro-batches" in line
    for k in range(1, 11):
        clock.t += 20.0
        rc.step_done(k)
        ctrl.steps = {k: _work(k, 10, 0, 0)} if k < 10 else {}
        if k == 3:
            line = rl_status(ctrl, rc)
            assert line.startswith("RL step 4/10: this step: 10/128") and "ETA 2:36" in line
    rc.eval_started()
    clock.t += 4.0
    line = rl_status(ctrl, rc)
    assert line.startswith("final evaluation after step 10/10: 256 held-out tasks, 0:04 in")
    assert line.endswith("ETA 0:12")


def test_an_evaluation_slower_than_measured_is_read_from_its_call_rate():
    """The final evaluation takes 40 s where 16 s were measured (a loaded machine): once a
    tenth of the expected calls have returned, what is left comes from their rate, so the
    ETA does not sit at 0:00 while it runs."""
    clock = FakeClock()
    rc = RunClock(1, 1, lambda v: v == 1, 16.0, clock=clock, eval_calls=1000)
    rc.start()
    rc.eval_started()
    errors = []
    for k in range(1, 1000):  # calls at a steady 25 per second
        clock.t = k / 25.0
        rc.tick()
        if k % 100 == 0:
            errors.append((rc.remaining() - (40.0 - clock.t)) / (40.0 - clock.t))
    assert all(abs(e) < 0.05 for e in errors), errors
    rc.tick()  # more calls than expected: a little left, never 0:00 before it ends
    assert 0 < rc.remaining() < 1.0
