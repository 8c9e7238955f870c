"""Checks for the values in a notebook's `parameters` cell.

A bad value stops the notebook at the cell that checks it with one line that names the parameter
and what is allowed, not with a deep traceback: `ParameterError` tells IPython to print only its
message (`_render_traceback_`), and papermill still reports the cell as failed.
"""
from __future__ import annotations

import difflib
import math
import numbers
import os
from dataclasses import dataclass
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


def milliseconds(name: str, value, maximum: float = 60_000) -> float:
    """A duration in milliseconds: finite, >= 0, at most a minute by default (a warm-up, a pause)."""
    return non_negative(name, value, maximum)


def available_memory_bytes(device) -> int | None:
    """Memory the notebook may use on `device` (a `utils.device.DeviceInfo`), or None if unknown: the
    *free* memory now, since a workshop's GPU (or CPU) is shared by other learners' kernels. On a GPU that
    is `torch.cuda.mem_get_info` (free memory of the current device, ROCm included) plus what this
    process's PyTorch already holds in its cache (it can reuse that); the total only if that fails."""
    if device.backend == "cpu":
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    try:
        import torch

        free, _total = torch.cuda.mem_get_info()
        cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
        return int(free) + max(int(cached), 0)
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


# --- the parameters every notebook may declare -----------------------------------------------------
# The harness checks `-p NAME VALUE` against these before any notebook starts, so a typo or a bad
# value stops `make run` at once with the parameter's name and what it allows; each notebook's own
# check cell then applies the device-dependent limits (memory). A notebook that declares a parameter
# missing here fails the tests.

@dataclass(frozen=True)
class Spec:
    kind: str                       # "choice" | "count" | "counts" | "milliseconds" | "pair"
    allowed: tuple = ()             # choices
    maximum: float | None = None
    none_ok: bool = True            # None means "pick by device"

    def validate(self, name: str, value):
        if value is None and self.none_ok:
            return None
        if self.kind == "choice":
            allowed = self.allowed() if callable(self.allowed) else self.allowed
            return choice(name, value, allowed)
        if self.kind == "count":
            return positive_int(name, value, self.maximum)
        if self.kind == "counts":
            return int_list(name, value, self.maximum)
        if self.kind == "milliseconds":
            return milliseconds(name, value, self.maximum or 60_000)
        if self.kind == "pair":
            if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or len(value) != 2:
                raise ParameterError(f"{name}={value!r} must be a pair of positive whole numbers, e.g. [4096, 128]")
            return [positive_int(f"{name}[{i}]", v, self.maximum) for i, v in enumerate(value)]
        raise ValueError(f"unknown parameter kind {self.kind!r}")

    def describe(self) -> str:
        allowed = self.allowed() if callable(self.allowed) else self.allowed
        text = {"choice": "one of " + ", ".join(map(repr, allowed)),
                "count": "a positive whole number", "counts": "a list of positive whole numbers",
                "milliseconds": "milliseconds >= 0", "pair": "a pair of positive whole numbers"}[self.kind]
        if self.maximum is not None and self.kind != "choice":
            text += f" (at most {self.maximum:,})"
        return text + (", or None (chosen by device)" if self.none_ok and self.kind != "choice" else "")


def _model_shapes():
    from .models import SHAPES

    return tuple(SHAPES)


DEVICE_CHOICES = ("auto", "cpu", "gpu", "cuda", "rocm")
SPECS: dict[str, Spec] = {
    # every lab
    "DEVICE": Spec("choice", DEVICE_CHOICES, none_ok=False),
    "REPS": Spec("count", maximum=10_000),
    "WARMUP_MS": Spec("milliseconds", maximum=60_000, none_ok=False),

    # lab 00
    "MATMUL_N": Spec("count"), "ADD_N": Spec("count"),

    # lab 01
    "MIN_N": Spec("count"), "MAX_N": Spec("count"),

    # lab 02
    "N": Spec("count"), "ITERS": Spec("count", maximum=1 << 20, none_ok=False),

    # lab 03
    "BENCH_N": Spec("counts"),

    # lab 04
    "BATCH": Spec("count"), "HEADS": Spec("count"), "NAIVE_MAX_N": Spec("count"), "SEQ_LENS": Spec("counts"),
    "HEAD_DIMS": Spec("counts", maximum=256), "HEADLINE": Spec("pair"),

    # lab 05
    "ENGINE": Spec("choice", ("auto", "vllm", "transformers"), none_ok=False),
    "RANDOM_SHAPE": Spec("choice", _model_shapes), "SERVE_MODEL": Spec("choice", ("smollm2", "random")),
    "CONCURRENCY": Spec("counts", maximum=1024), "OUTPUT_TOKENS": Spec("count", maximum=4096),
    "DECODE_TOKENS": Spec("count", maximum=4096),
    "LOAD_PERCENT": Spec("counts", maximum=1000), "LOAD_SECONDS": Spec("count", maximum=600),
    "WARMUP_SECONDS": Spec("count", maximum=300), "DATASET": Spec("choice", ("random", "prompts"), none_ok=False),
    "INPUT_TOKENS": Spec("count", maximum=8192), "SLO_TTFT_MS": Spec("milliseconds", maximum=600_000),
    "SLO_TPOT_MS": Spec("milliseconds", maximum=600_000),
    "ARRIVALS": Spec("choice", ("poisson", "bursty", "constant"), none_ok=False),

    # lab 06 (and DECODE_TOKENS, as in lab 05)
    "RANKS": Spec("count", maximum=64), "MESSAGE_SIZES": Spec("counts", maximum=1 << 34),
    "TP_SHAPE": Spec("choice", lambda: ("tiny", *_model_shapes())),

    # lab 07
    "CLINIC_MODEL": Spec("choice", ("smollm2", "random")), "NEW_TOKENS": Spec("count", maximum=512),
    "CHECK_DTYPE": Spec("choice", ("bfloat16", "float16", "float32"), none_ok=False),
}


def validate(name: str, value):
    """Check one parameter by its spec (the harness does this before running anything)."""
    if name not in SPECS:
        raise ParameterError(unknown_message(name, SPECS))
    return SPECS[name].validate(name, value)


def unknown_message(name: str, known) -> str:
    near = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return (f"{name} is not a parameter of the selected notebooks"
            + (f" (did you mean {near[0]}?)" if near else "")
            + f"; their parameters: {', '.join(sorted(known))}")
