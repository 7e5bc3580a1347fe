"""The softmax helpers every compiled attention shares (fast_exp.py): the vector maximum is the exact maximum, and
the shifted exponentials and their sum match numpy's."""

import numpy as np
import pytest

from specdec_core.kernels.fast_exp import exp_shifted, peak


@pytest.mark.parametrize("seed", range(3))
def test_peak_is_the_exact_maximum_at_any_length_and_position(seed):
    """Whole vectors of 16, a tail, or both; the maximum anywhere, the values past n never read."""
    rng = np.random.default_rng(seed)
    for n in [1, 2, 15, 16, 17, 31, 32, 33, 47, 64, 100, 1027]:
        scores = (rng.standard_normal(n + 5) * 7).astype(np.float32)
        scores[n:] = 1e30  # past n: must be ignored
        assert peak(scores, n) == scores[:n].max(), n
        for where in {0, n // 2, n - 1}:
            spiked = scores.copy()
            spiked[where] = 99.0
            assert peak(spiked, n) == np.float32(99.0), (n, where)


def test_peak_of_very_negative_scores_and_the_shifted_exponentials():
    scores = np.full(40, -1e30, dtype=np.float32)
    scores[37] = -5.0
    assert peak(scores, 40) == np.float32(-5.0)
    rng = np.random.default_rng(0)
    values = (rng.standard_normal(300) * 4).astype(np.float32)
    expected = np.exp(values.astype(np.float64) - values.max())
    shifted = values.copy()
    total = exp_shifted(shifted, 300, peak(values, 300))
    assert np.allclose(shifted, expected, rtol=1e-6, atol=1e-7)
    assert abs(total - expected.sum()) < 1e-4 * expected.sum()
