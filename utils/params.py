"""Checks for the values in a notebook's `parameters` cell.

A bad value stops the notebook at the cell that checks it with one line that names the parameter
and what is allowed, not with a deep traceback: `ParameterError` tells IPython to print only its
message (`_render_traceback_`), and papermill still reports the cell as failed.
"""
from __future__ import annotations

import math
import numbers
import os
from typing import Callable, Iterable

from utils import backend

# Share of the device's memory a notebook may plan to use for its own tensors; the rest is left
# to the framework's workspace, the allocator's rounding and, on a CPU, everything else running.
MEMORY_BUDGET = 0.8


class ParameterError(ValueError):
    """A notebook parameter has a value the notebook cannot run with."""

    def _render_traceback_(self):  # IPython prints these lines instead of a traceback
        return [f"ParameterError: {self}"]


def choice(name: str, value, allowed: Iterable[str]) -> str:
    allowed = list(allowed)
    if not isinstance(value, str) or value.lower() not in allowed:
        raise ParameterError(f"{name}={value!r} is not allowed; use one of {', '.join(map(repr, allowed))}")
    return value.lower()


def positive_int(name: str, value, maximum: int | None = None) -> int:
    """An integer > 0 (and <= `maximum`). Floats that are whole numbers (papermill passes `1e6` as
    1000000.0) pass; NaN, infinities, fractions, strings and booleans do not."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ParameterError(f"{name}={value!r} must be a positive whole number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ParameterError(f"{name}={value!r} must be a positive whole number, not {value}")
    if isinstance(value, float) and not value.is_integer():
        raise ParameterError(f"{name}={value!r} must be a positive whole number, not a fraction")
    if value <= 0:
        raise ParameterError(f"{name}={value!r} must be a positive whole number (> 0)")
    if maximum is not None and value > maximum:
        raise ParameterError(f"{name}={value!r} must be a positive whole number <= {maximum:,}")
    return int(value)


def non_negative(name: str, value, maximum: float | None = None) -> float:
    """A finite number >= 0 (and <= `maximum`): a duration, a tolerance."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
        raise ParameterError(f"{name}={value!r} must be a number >= 0"
                             + (f" and <= {maximum:,}" if maximum is not None else ""))
    if maximum is not None and value > maximum:
        raise ParameterError(f"{name}={value!r} must be a number >= 0 and <= {maximum:,}")
    return float(value)


def int_list(name: str, value, maximum: int | None = None) -> list[int]:
    """A non-empty list of positive whole numbers (a scalar is refused, with an example)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or not value:
        raise ParameterError(f"{name}={value!r} must be a non-empty list of positive whole numbers, "
                             f"e.g. [64, 128]")
    return [positive_int(f"{name}[{i}]", v, maximum) for i, v in enumerate(value)]


def pair(name: str, value, maximum: int | None = None) -> list[int]:
    """Two positive whole numbers, e.g. [4096, 128] (a sequence length and a head dim)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ParameterError(f"{name}={value!r} must be a pair of positive whole numbers, e.g. [4096, 128]")
    return [positive_int(f"{name}[{i}]", v, maximum) for i, v in enumerate(value)]


def milliseconds(name: str, value, maximum: float = 60_000) -> float:
    """A duration in milliseconds: finite, >= 0, at most a minute by default (a warm-up, a pause)."""
    return non_negative(name, value, maximum)


def available_memory_bytes(device) -> int | None:
    """Memory the notebook may use on `device` (a `utils.device.DeviceInfo`), or None if unknown: the
    *free* memory now, since a workshop's GPU (or CPU) is shared by other learners' kernels. On a GPU that
    is the backend's free memory (`torch.cuda.mem_get_info`, ROCm included) plus what this process's
    PyTorch already holds in its cache (it can reuse that); the total only if that fails."""
    plat = backend.get(device.backend)
    if not plat.is_gpu:
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    try:
        return plat.free_memory_bytes()
    except Exception:   # no CUDA/ROCm runtime in this process: fall back to the device's total
        return device.memory_bytes


def size(name: str, value, *, device, cpu: int, gpu: int,
         bytes_needed: Callable[[int], int] | None = None) -> int:
    """A problem size: `None` picks `gpu` on a GPU and `cpu` on a CPU; any other value must be a
    positive whole number whose working set, `bytes_needed(n)`, fits in the device's memory."""
    n = (gpu if device.is_gpu else cpu) if value is None else positive_int(name, value)
    if bytes_needed is not None:
        need = bytes_needed(n)
        have = available_memory_bytes(device)
        if have is not None and need > MEMORY_BUDGET * have:
            largest = n
            while largest > 1 and bytes_needed(largest) > MEMORY_BUDGET * have:
                largest //= 2
            raise ParameterError(
                f"{name}={n} needs {need / 2**30:.1f} GiB but {device.name} has "
                f"{have / 2**30:.1f} GiB free ({MEMORY_BUDGET:.0%} of it may be used); "
                f"use {name}={largest} or less")
    return n


def size_list(name: str, value, *, device, cpu: list[int], gpu: list[int],
              bytes_needed: Callable[[int], int] | None = None) -> list[int]:
    """A list of problem sizes: `None` picks `gpu` or `cpu`; each size is checked as `size` checks one."""
    values = (gpu if device.is_gpu else cpu) if value is None else int_list(name, value)
    return [size(name, v, device=device, cpu=1, gpu=1, bytes_needed=bytes_needed) for v in values]


# A notebook's DEVICE (the harness's table of every lab's parameters is utils/machinery/parameters.py).
DEVICE_CHOICES = backend.DEVICE_CHOICES
