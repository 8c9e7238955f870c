"""Checks for the values in a notebook's `parameters` cell.

A bad value stops the notebook at the cell that checks it with one line that names the parameter
and what is allowed, not with a deep traceback: `ParameterError` tells IPython to print only its
message (`_render_traceback_`), and papermill still reports the cell as failed.
"""
from __future__ import annotations

import numbers
import os
from typing import Callable, Iterable

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


def positive_int(name: str, value) -> int:
    """An integer > 0. Floats that are whole numbers (papermill passes `1e6` as 1000000.0) pass."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ParameterError(f"{name}={value!r} must be a positive whole number")
    if isinstance(value, float) and not value.is_integer():
        raise ParameterError(f"{name}={value!r} must be a positive whole number, not a fraction")
    if value <= 0:
        raise ParameterError(f"{name}={value!r} must be a positive whole number (> 0)")
    return int(value)


def non_negative(name: str, value) -> float:
    """A number >= 0 (a duration, a tolerance)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or value < 0:
        raise ParameterError(f"{name}={value!r} must be a number >= 0")
    return float(value)


def available_memory_bytes(device) -> int | None:
    """Memory the notebook may use on `device` (a `utils.device.DeviceInfo`), or None if unknown."""
    if device.backend == "cpu":
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
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
                f"{have / 2**30:.1f} GiB ({MEMORY_BUDGET:.0%} of it may be used); "
                f"use {name}={largest} or less")
    return n
