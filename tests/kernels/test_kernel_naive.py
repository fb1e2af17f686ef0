"""The naive oracles themselves, on cases small enough to work by hand."""

import numpy as np

from tests.kernels.naive import naive_expand, naive_lora, naive_shrink


def test_shrink_by_hand():
    x = np.array([[1.0, 2.0], [3.0, 4.0]])
    a = np.array([[[1.0, 0.0]], [[0.0, 1.0]]])  # slot 0 picks x[0], slot 1 picks x[1]
    v = naive_shrink(x, a, np.array([1, 0]), np.array([2.0, 10.0]), n_slices=1)
    np.testing.assert_array_equal(v, [[20.0], [6.0]])  # 10 * 2, 2 * 3


def test_expand_by_hand_skips_no_adapter_tokens():
    v = np.array([[1.0, 2.0], [5.0, 5.0]])
    b = [np.array([[[1.0], [1.0]], [[2.0], [0.0]]])]  # slot 0 sums v, slot 1 doubles v[0]
    base = [np.array([[100.0], [7.0]])]
    (y,) = naive_expand(v, b, base, np.array([1, -1]))
    np.testing.assert_array_equal(y, [[102.0], [7.0]])


def test_two_slices_by_hand():
    x = np.array([[1.0, 1.0]])
    a = np.array([[[1.0, 0.0], [0.0, 3.0]]])  # slice 0 row [1,0], slice 1 row [0,3]; rank 1
    b = [np.array([[[2.0]]]), np.array([[[1.0, -1.0]]])]
    y0, y1 = naive_lora(x, a, b, [np.zeros((1, 1)), np.ones((1, 2))], np.array([0]), np.array([0.5]))
    np.testing.assert_array_equal(y0, [[1.0]])  # 0.5 * 1 * 2
    np.testing.assert_array_equal(y1, [[2.5, -0.5]])  # 1 + 0.5 * 3 * [1, -1]
