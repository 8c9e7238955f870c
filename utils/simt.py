"""A tiny model of one SIMT machine: wavefronts/warps of `width` lanes executing in lock-step.

It is a model, not a simulator: it knows just enough to show, on a CPU, what the lane width does to a
lane-dependent branch (both sides run, one after the other, each with part of the lanes masked off)
and to a shuffle-based reduction. Lanes are numbered inside their wavefront: lane = thread % width.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def lane_layout(threads: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(wave id, lane id) of each thread of a block of `threads` threads."""
    t = np.arange(threads)
    return t // width, t % width


@dataclass(frozen=True)
class BranchCost:
    width: int
    period: int
    passes_per_wave: float    # instruction streams issued per wavefront: 1 = converged, 2 = both sides
    lane_utilization: float   # useful lane-slots / issued lane-slots

    @property
    def relative_cost(self) -> float:
        return self.passes_per_wave


def branch(width: int, period: int, threads: int = 256) -> BranchCost:
    """`if ((threadIdx.x / period) % 2 == 0) A(); else B();` with A and B of equal length: a
    wavefront whose lanes disagree runs A with the B-lanes masked off, then B with the A-lanes masked."""
    if width < 1 or period < 1:
        raise ValueError("width and period must be >= 1")
    if threads % width:
        raise ValueError(f"threads={threads} must be a multiple of width={width}")
    take_a = (np.arange(threads) // period) % 2 == 0
    waves = take_a.reshape(-1, width)
    passes = np.where(waves.all(axis=1) | (~waves).all(axis=1), 1, 2)
    # every lane does one side's work; a divergent wavefront issues both sides for all its lanes
    return BranchCost(width, period, float(passes.mean()), float(1.0 / passes.mean()))


def shfl_down(values: np.ndarray, offset: int, width: int) -> np.ndarray:
    """`__shfl_down(v, offset)` for every lane: lane i reads lane i + offset of its own wavefront; a lane
    whose source would fall outside the wavefront keeps its own value (CUDA's and HIP's rule)."""
    v = np.asarray(values)
    lane = np.arange(v.size) % width
    src = np.arange(v.size) + offset
    out = v.copy()
    inside = lane + offset < width
    out[inside] = v[src[inside]]
    return out


def wave_sum(values, width: int, offsets) -> int:
    """The reduction kernel's result: each wavefront adds `shfl_down(v, offset)` for each offset, then
    the wavefront's lane 0 (thread % width == 0) adds its v to the total."""
    v = np.asarray(values).copy()
    if v.size % width:
        v = np.concatenate([v, np.zeros(width - v.size % width, dtype=v.dtype)])
    for offset in offsets:
        v = v + shfl_down(v, offset, width)
    return int(v[::width].sum())
