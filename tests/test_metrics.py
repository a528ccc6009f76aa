import math

import pytest

from tpu_helpers.metrics import accuracy, majority_rate, matthews_correlation


def test_mcc_matches_the_formula():
    y = [1, 1, 1, 1, 0, 0, 0, 1, 0, 1]
    p = [1, 0, 1, 1, 0, 1, 0, 1, 0, 1]
    tp, tn, fp, fn = 5, 3, 1, 1
    expected = (tp * tn - fp * fn) / math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    assert matthews_correlation(y, p) == pytest.approx(expected)
    assert matthews_correlation(y, [1 - x for x in y]) == pytest.approx(-1.0)


def test_weights_remove_rows():
    y, p = [1, 0, 1], [1, 0, 0]
    assert accuracy(y, p, [1, 1, 0]) == 1.0
    assert matthews_correlation(y, p, [1, 1, 0]) == 1.0
    assert accuracy(y, p) == pytest.approx(2 / 3)


def test_majority_rate():
    assert majority_rate([1, 1, 1, 0]) == 0.75
