"""Streaming a step group by group: rescaled part coefficients equal the whole step's."""

import numpy as np
import pytest

from gyre.trajectory.advantages import LOSS_MODES, normaliser_count, path_coefficients


@pytest.mark.parametrize("mode", LOSS_MODES)
def test_part_coefficients_rescale_to_step_coefficients(mode):
    rng = np.random.default_rng(0)
    lens = [rng.integers(0, 20, size=rng.integers(1, 5)) for _ in range(9)]
    lens[3] = np.zeros(2, np.int64)  # an execution with no trainable token
    whole = path_coefficients(lens, mode)
    total = normaliser_count(lens, mode)
    parts = [lens[:4], lens[4:7], lens[7:]]
    streamed = []
    for part in parts:
        scale = normaliser_count(part, mode) / total
        streamed += [c * scale for c in path_coefficients(part, mode)]
    for a, b in zip(whole, streamed):
        np.testing.assert_allclose(a, b, rtol=1e-12)


def test_normaliser_count_rejects_unknown_mode():
    with pytest.raises(ValueError, match="loss mode"):
        normaliser_count([np.ones(2)], "median")
