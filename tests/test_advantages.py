"""Scores, group-relative advantages, loss-mode coefficients and path selection."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import executions

from gyre.trajectory.advantages import execution_score, group_advantages, path_coefficients
from gyre.trajectory.records import ROLES, make_record
from gyre.trajectory.select import select_paths
from gyre.trajectory.tree import build_tree


def test_scores():
    assert execution_score("success", 0.3) == 1.0
    assert execution_score("timeout", 0.3) == 0.3
    assert execution_score("timeout", 0.3, reward="binary") == 0.0
    assert execution_score("success", 0.0, success_score=2.0) == 2.0
    assert execution_score("infra_error", 0.9) is None
    with pytest.raises(ValueError, match="below the success score"):
        execution_score("failure", 1.0)
    with pytest.raises(ValueError, match="reward"):
        execution_score("failure", 0.1, reward="dense")


def test_group_advantages_against_loops():
    rng = np.random.default_rng(0)
    scores = rng.random(9)
    groups = ["a", "b", "a", "c", "b", "a", "b", "b", "a"]
    for std in (False, True):
        got = group_advantages(scores, groups, std_normalize=std)
        for g in set(groups):
            idx = [i for i, x in enumerate(groups) if x == g]
            want = scores[idx] - scores[idx].mean()
            if std:
                want = want / (scores[idx].std() + 1e-6)
            np.testing.assert_allclose(got[idx], want, atol=1e-12)
    assert group_advantages([0.7], ["solo"])[0] == 0.0


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=6), min_size=1, max_size=6))
def test_coefficients_normalise_each_mode(lens):
    lens = [np.asarray(x) for x in lens]
    flat = np.concatenate(lens)
    if flat.sum() == 0:
        return
    tok = path_coefficients(lens, "token-mean")
    seq = path_coefficients(lens, "sequence-mean")
    two = path_coefficients(lens, "two-level")
    # a loss of 1 per trainable token gives 1 in every mode
    for cs in (tok, seq, two):
        assert np.isclose(sum(float(c @ n) for c, n in zip(cs, lens)), 1.0)
    assert np.allclose(np.concatenate(tok)[flat > 0], 1.0 / flat.sum())
    n_paths = (flat > 0).sum()
    for c, n in zip(seq, lens):
        assert np.allclose(c[n > 0] * n[n > 0], 1.0 / n_paths)  # each path weighs the same
    n_exec = sum(n.sum() > 0 for n in lens)
    for c, n in zip(two, lens):
        if n.sum():
            assert np.isclose(c @ n, 1.0 / n_exec)  # each execution weighs the same
            assert np.allclose(c[n > 0], 1.0 / (n_exec * n.sum()))  # token mean inside it
    assert all(np.all(c[n == 0] == 0) for cs in (tok, seq, two) for c, n in zip(cs, lens))


@settings(max_examples=40, deadline=None)
@given(executions(max_calls=12), st.integers(0, 6))
def test_selection_order_and_cap(records, cap):
    tree = build_tree(records)
    sel = select_paths(tree, cap)
    everything = list(sel.kept) + list(sel.dropped)
    assert sorted(everything) == sorted(tree.leaf_calls.tolist())
    assert len(sel.kept) == (len(everything) if cap == 0 else min(cap, len(everything)))
    keys = [
        (ROLES.index(tree.call_roles[c]), -int(tree.depth[tree.call_end[c]])) for c in everything
    ]
    assert keys == sorted(keys)  # role priority, then longest first


def test_selection_rejects_negative_cap():
    tree = build_tree([make_record([1], [2], role="main", execution_id="x", call_id=0)])
    with pytest.raises(ValueError, match="max_paths"):
        select_paths(tree, -1)
