"""A notebook's parameters: declared once, in its `parameters` cell, and checked the same way on every path in.

Each line of the cell declares one parameter: its default, its kind and limit, and what it is for,

    REPS = None          # count up to 10000: timed repetitions; None: 50 on a GPU, 10 on a CPU
    DEVICE = "auto"      # choice auto|cpu|gpu|cuda|rocm: where the lab runs

(kinds: ``choice a|b|c``, ``count``, ``counts`` (a list), ``pair``, ``milliseconds``; ``up to N`` a maximum (papermill's own reader
takes these lines too); ``None`` is
allowed where it is the default). `declarations` reads them; the harness checks ``-p NAME VALUE`` against them
before anything runs, and ``utils.course.start`` checks the values the lab got (from papermill, the harness or an
edit in JupyterLab) against the same lines. A bad value stops the notebook with one line that names the parameter
and what is allowed, not with a deep traceback: `ParameterError` tells IPython to print only its message
(`_render_traceback_`), and papermill still reports the cell as failed.
"""
from __future__ import annotations

import ast
import difflib
import math
import numbers
import os
import re
from dataclasses import dataclass
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


# A notebook's DEVICE.
DEVICE_CHOICES = backend.DEVICE_CHOICES


# --- declarations: the parameters cell, read ------------------------------------------------------

KINDS = ("choice", "count", "counts", "milliseconds", "pair")
_LINE = re.compile(r"^(?P<name>[A-Z][A-Z0-9_]*)\s*=\s*(?P<default>[^#]+?)\s*#\s*(?P<kind>[a-z]+)(?P<limit>[^:]*):\s*"
                   r"(?P<help>.+)$")
_MAXIMUM = re.compile(r"^up to\s+(?P<base>[\d_]+)(\s*\*\*\s*(?P<exp>\d+))?$")


@dataclass(frozen=True)
class Declared:
    """One line of a parameters cell: a parameter's default, kind, limit and help."""
    name: str
    default: object
    kind: str
    help: str
    allowed: tuple = ()              # choice
    maximum: int | None = None

    @property
    def none_ok(self) -> bool:       # None means "chosen by the device" where it is the default
        return self.default is None

    def check(self, value):
        """The value, normalised (1e6 -> 1000000), or ParameterError naming the parameter and what it allows."""
        name = self.name
        if value is None and self.none_ok:
            return None
        if self.kind == "choice":
            return choice(name, value, self.allowed)
        if self.kind == "count":
            return positive_int(name, value, self.maximum)
        if self.kind == "counts":
            return int_list(name, value, self.maximum)
        if self.kind == "milliseconds":
            return milliseconds(name, value, self.maximum or 60_000)
        return pair(name, value, self.maximum)

    def describe(self) -> str:
        text = {"choice": "one of " + ", ".join(map(repr, self.allowed)),
                "count": "a positive whole number", "counts": "a list of positive whole numbers",
                "milliseconds": "milliseconds >= 0", "pair": "a pair of positive whole numbers"}[self.kind]
        if self.maximum is not None and self.kind != "choice":
            text += f" (at most {self.maximum:,})"
        return text + (", or None (chosen by device)" if self.none_ok else "")


def declarations(source: str, where: str = "the parameters cell") -> dict[str, Declared]:
    """{name: Declared} of a parameters cell's source. A line that assigns a parameter without a declaration
    comment (`# kind[ up to N]: help`) is an error naming the line: every parameter says what it takes."""
    found = {}
    for number, line in enumerate(source.splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        m = _LINE.match(stripped)
        if not m or m.group("kind") not in KINDS:
            raise ValueError(f"{where}, line {number}: not `NAME = default  # kind[ up to N]: what it is` with a kind "
                             f"from {', '.join(KINDS)}: {stripped!r}")
        limit, kind = m.group("limit").strip(), m.group("kind")
        allowed, maximum = (), None
        if kind == "choice":
            allowed = tuple(a.strip() for a in limit.split("|") if a.strip())
            if not allowed:
                raise ValueError(f"{where}, line {number}: a choice lists what it allows: `choice a|b|c: ...`")
        elif limit:
            mm = _MAXIMUM.match(limit)
            if not mm:
                raise ValueError(f"{where}, line {number}: the limit must read `up to N` or `up to 2**K`, not {limit!r}")
            maximum = int(mm.group("base").replace("_", "")) ** int(mm.group("exp") or 1)
        default = ast.literal_eval(m.group("default").strip())
        declared = Declared(m.group("name"), default, kind, m.group("help").strip(), allowed, maximum)
        declared.check(default)      # a default the declaration itself refuses is the author's mistake
        found[declared.name] = declared
    return found


def unknown_message(name: str, known, where: str = "this lab") -> str:
    """An unknown parameter, with the nearest known one."""
    near = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return (f"{name} is not a parameter of {where}" + (f" (did you mean {near[0]}?)" if near else "")
            + f"; the parameters declared: {', '.join(sorted(known))}")
