"""utils.simt: the SIMT model that stands in for a GPU in lab 02."""
import numpy as np
import pytest

from utils import simt

PORTABLE = {32: [16, 8, 4, 2, 1], 64: [32, 16, 8, 4, 2, 1]}


def test_lane_layout():
    wave, lane = simt.lane_layout(256, 64)
    assert (wave[100], lane[100]) == (1, 36) and wave.max() == 3
    wave, lane = simt.lane_layout(256, 32)
    assert (wave[100], lane[100]) == (3, 4) and wave.max() == 7


@pytest.mark.parametrize("width", [32, 64])
def test_branch_cost_is_two_passes_below_the_width_and_one_from_it(width):
    for period in (1, 2, 4, 8, 16, 32, 64, 128):
        cost = simt.branch(width, period)
        expected = 2.0 if period < width else 1.0
        assert cost.relative_cost == expected, (width, period)
        assert cost.lane_utilization == pytest.approx(1 / expected)


def test_branch_rejects_partial_waves():
    with pytest.raises(ValueError, match="multiple of width"):
        simt.branch(64, 1, threads=96)


def test_shuffle_down_stays_inside_the_wavefront():
    v = np.arange(8)
    assert simt.shfl_down(v, 2, 4).tolist() == [2, 3, 2, 3, 6, 7, 6, 7]   # lanes 2,3 of each wave keep theirs
    assert simt.shfl_down(v, 1, 8).tolist() == [1, 2, 3, 4, 5, 6, 7, 7]


def test_the_32_lane_reduction_is_right_at_32_and_wrong_at_64():
    values = np.arange(4096) % 7
    exact = int(values.sum())
    assert simt.wave_sum(values, 32, [16, 8, 4, 2, 1]) == exact
    wrong = simt.wave_sum(values, 64, [16, 8, 4, 2, 1])
    # lane 0 of each 64-lane wave only gathers lanes 0..31: exactly the upper halves are lost
    upper_halves = int(values.reshape(-1, 64)[:, 32:].sum())
    assert wrong == exact - upper_halves and wrong < exact


@pytest.mark.parametrize("width", [32, 64])
def test_the_portable_reduction_is_right_at_both_widths(width):
    values = np.random.default_rng(0).integers(0, 100, 1000)   # not a multiple of the width: padded
    assert simt.wave_sum(values, width, PORTABLE[width]) == int(values.sum())
