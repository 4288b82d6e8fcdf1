"""The pictures a run leaves answer "did it learn, and what did the cells do" without code:
learning_curves.png is a grid of panels with labelled axes, training curves with SE bands and
held-out evaluations as points with error bars; roles.png has a title, the step ends and the
hand-overs marked."""

from __future__ import annotations

import matplotlib.collections as mcoll

from gyre import plots


def _rows(steps=4):
    return [dict(step=s, success=0.4 + 0.03 * s, success_se=0.04, reward=0.5 + 0.02 * s,
                 reward_se=0.03, partial=0.6, loss=0.01, entropy=0.8, grad_norm=1.2,
                 **({"eval_success": 0.6, "eval_success_se": 0.03, "eval_milestones": 0.7,
                     "eval_milestones_se": 0.02} if s == steps else {}))
            for s in range(1, steps + 1)]  # fmt: skip


def test_learning_curves_are_a_labelled_grid_with_evaluations_as_error_bars(tmp_path):
    start = {"eval_success": 0.45, "eval_success_se": 0.03, "eval_milestones": 0.6,
             "eval_milestones_se": 0.02}  # fmt: skip
    fig = plots.learning_curves_figure(_rows(), start, title="run")
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert len(axes) == len(plots.PANELS) and fig.axes[0].get_gridspec().nrows == 2
    for ax in axes:
        assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title()
    by_title = {ax.get_title(): ax for ax in axes}
    success = by_title["success"]
    # the held-out evaluations: points with error bars at steps 0 and 4, not a line
    (bars,) = success.containers
    assert list(bars.lines[0].get_xdata()) == [0, 4]
    assert any(isinstance(c, mcoll.PolyCollection) for c in success.collections)  # SE band
    assert [t.get_text() for t in success.get_legend().get_texts()] == [
        "training (per step)", "± 1 SE", "held-out evaluation ± 1 SE"]  # fmt: skip
    assert fig._suptitle.get_text() == "run"
    path = plots.learning_curves(_rows(), str(tmp_path / "lc.png"), start)
    assert (tmp_path / "lc.png").stat().st_size > 10_000 and path.endswith("lc.png")


def test_role_timeline_has_a_title_step_ends_and_hand_overs(tmp_path):
    spans = [(0, "eval", 0.0, 5.0), (1, "eval", 0.0, 5.0),
             (0, "rollout", 5.0, 9.0), (1, "rollout", 5.0, 7.0), (1, "switch", 7.0, 7.5),
             (1, "train", 7.5, 10.0), (0, "rollout", 9.0, 12.0)]  # fmt: skip
    assert plots.handovers(spans) == [(1, 7.0)]
    fig = plots.role_timeline_figure(spans, "what the cells did", [(1, 10.0), (2, 12.0)])
    ax = fig.axes[0]
    assert ax.get_title() == "what the cells did" and ax.get_xlabel() and ax.get_ylabel()
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert {"eval", "rollout", "train", "switch"} <= set(labels)
    assert "rollout -> train switch (live requests, if any, handed over)" in labels
    assert "end of RL step (number above)" in labels
    assert sorted(line.get_xdata()[0] for line in ax.get_lines()) == [10.0, 12.0]
    plots.role_timeline(spans, str(tmp_path / "roles.png"))
    assert (tmp_path / "roles.png").stat().st_size > 5_000
