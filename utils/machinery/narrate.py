"""What `make run` says while a lab runs (where it is; when it is slower than usual), and the kernel noise it mutes."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import threading
import time
from pathlib import Path
from typing import Callable

import nbformat
import zmq
from jupyter_client import AsyncKernelManager

from utils.base.paths import REPO_ROOT

INTERVAL_VAR = "COURSE_NARRATE_SECONDS"   # seconds between two "where it is" lines; 0 turns them off
DEFAULT_INTERVAL = 25.0
SLOWER = 2.0            # "slower than usual": past twice the recorded seconds, and two intervals over them
BUSY = 1.25             # a load average over 1.25 x the cores: more work waits than the cores run
DURATIONS = REPO_ROOT / "docs" / "instructor.md"   # its table's "CPU run (s)" column: a CPU run's usual seconds
SECTION_CHARS = 48


class QuietKernelManager(AsyncKernelManager):
    """The kernel manager of the course's runs. Its connection is encrypted (CurveZMQ keys from the manager,
    which ipykernel's kernelspec accepts), so ipykernel has no "running over TCP without encryption" warning to
    print; and it sends no SIGINT to a kernel it shuts down (jupyter_client interrupts every kernel before its
    shutdown request: one that lands while the kernel answers a message prints "KeyboardInterrupt caught in
    kernel"). A kernel still busy at shutdown gets SIGTERM a few seconds later instead."""

    def __init__(self, **kwargs):
        if zmq.has("curve"):            # a libzmq without CurveZMQ keeps plain TCP, and its true warning
            kwargs.setdefault("transport_encryption", "auto")
        super().__init__(**kwargs)

    async def _async_interrupt_kernel(self) -> None:
        if self.shutting_down:          # set by shutdown_kernel just before it interrupts
            return
        await super()._async_interrupt_kernel()


def interval() -> float:
    """Seconds between two narration lines: COURSE_NARRATE_SECONDS, else 25; 0 (or less) means none."""
    raw = os.environ.get(INTERVAL_VAR, "").strip()
    try:
        value = float(raw) if raw else DEFAULT_INTERVAL
    except ValueError:
        return DEFAULT_INTERVAL
    return value if value == value and value != float("inf") else DEFAULT_INTERVAL


def clock(seconds: float) -> str:
    """45 s, 2 min 10 s, 1 h 05 min."""
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


@dataclasses.dataclass(frozen=True)
class Usual:
    """How long a lab usually runs, and where that figure comes from ("in its last ok run on cpu (run ...)")."""
    seconds: float
    source: str


def recorded_cpu_seconds(path: Path = DURATIONS) -> dict[str, float]:
    """{"05": 82.1, ...}: the "CPU run (s)" column of the durations table in docs/instructor.md (empty if the
    file or the column is missing)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return {}
    column, out = None, {}
    for line in lines:
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.lstrip().startswith("|") else []
        if not cells:
            column = None
        elif any(c.lower().startswith("cpu run") for c in cells):
            column = next(i for i, c in enumerate(cells) if c.lower().startswith("cpu run"))
        elif column is not None and len(cells) > column:
            number = re.match(r"\d+(\.\d+)?", cells[column])
            lab = re.match(r"(\d\d)\b", cells[0])
            if number and lab:
                out[lab.group(1)] = float(number.group(0))
    return out


def usual_seconds(status: dict, device: str) -> dict[str, Usual]:
    """Per lab, its usual seconds on `device`: its last successful run on the same device (build/status.json,
    read before this run overwrites it), else, for a CPU run, the course's recorded CPU figure."""
    run = status.get("run") if isinstance(status.get("run"), dict) else {}
    out = {}
    for lab, entry in (status.get("labs") or {}).items():
        if not isinstance(entry, dict) or entry.get("status") != "ok":
            continue
        seconds = entry.get("seconds")
        ran_on = entry.get("device") or (run.get("device") if entry.get("run_id") == run.get("id") else None)
        if isinstance(seconds, (int, float)) and seconds > 0 and ran_on == device:
            out[lab] = Usual(float(seconds), f"in its last ok run on {device} (run {entry.get('run_id', '?')})")
    if device == "cpu":
        for prefix, seconds in recorded_cpu_seconds().items():
            for lab in _labs_with_prefix(prefix, out):
                out[lab] = Usual(seconds, "on the course's 2-core CPU machine (docs/instructor.md)")
    return out


def _labs_with_prefix(prefix: str, known: dict) -> list[str]:
    solutions = REPO_ROOT / "solutions"
    return [p.stem for p in solutions.glob(f"{prefix}_*.ipynb") if p.stem not in known]


def machine_load() -> tuple[float, int]:
    """(1-minute load average, cores this process may use)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    return load, cores


def slow_note(lab: str, elapsed: float, usual: Usual, load: float, cores: int) -> str:
    """The one line that says a lab is slower than usual, and why it may be."""
    head = f"  {lab} is slower than usual: {clock(elapsed)} so far, {clock(usual.seconds)} {usual.source}; "
    if load > BUSY * cores:
        why = (f"the machine is busy (load average {load:.1f} on {cores} cores: other runs, tests or users share "
               "them), so every cell takes longer; it is still running")
    else:
        why = (f"the machine is not busy (load average {load:.1f} on {cores} cores): the cell named above may be "
               "waiting (a server starting, a lock, the network)")
    return head + why


def sections(notebook: Path) -> tuple[dict[str, tuple[int, str]], int]:
    """({cell id: (its number among the code cells, the last markdown heading before it)}, code cells)."""
    nb = nbformat.read(notebook, as_version=4)
    where, section, n = {}, "", 0
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            headings = [line for line in cell.source.splitlines() if re.match(r"#{1,6}\s", line)]
            if headings:
                section = headings[-1].lstrip("#").strip().rstrip("#").strip()
        elif cell.cell_type == "code":
            n += 1
            if cell.get("id"):
                where[cell.id] = (n, section)
    return where, n


def short(text: str, chars: int = SECTION_CHARS) -> str:
    return text if len(text) <= chars else text[:chars - 1].rstrip() + "…"


class Narrator:
    """While a lab runs, says every `every` seconds (COURSE_NARRATE_SECONDS) where it is, through `say`
    (tqdm.write, which keeps the bar whole): the lab, the section, the cell out of the code cells, the time so
    far; and once, when the lab runs much longer than `usual`, that it is slower than usual and why it may be.
    A lab that ends within `every` seconds says nothing. Give `cell_started` to papermill as nbclient's
    `on_cell_start` hook."""

    def __init__(self, say: Callable[[str], object], every: float | None = None,
                 load: Callable[[], tuple[float, int]] = machine_load):
        self.say, self.every, self.load = say, interval() if every is None else every, load
        self._lock = threading.Lock()
        self._where: dict[str, tuple[int, str]] = {}
        self._total = 0
        self._cell: tuple[int | None, str] | None = None
        self._cell_started = self._started = time.monotonic()

    def cell_started(self, cell=None, cell_index=None, **_) -> None:
        if cell is None or cell.get("cell_type") != "code":
            return
        with self._lock:
            self._cell = self._where.get(cell.get("id"), (None, self._cell[1] if self._cell else ""))
            self._cell_started = time.monotonic()

    @contextlib.contextmanager
    def lab(self, notebook: Path, usual: Usual | None = None):
        """Narrate the lab `notebook` while the block runs it."""
        try:
            self._where, self._total = sections(notebook)
        except Exception:   # nbformat raises many kinds for a broken file; the run itself will say what is wrong
            self._where, self._total = {}, 0
        self._cell, self._started = None, time.monotonic()
        stop = threading.Event()
        thread = None
        if self.every > 0:
            thread = threading.Thread(target=self._narrate, args=(Path(notebook).stem, usual, stop), daemon=True,
                                      name="narrate")
            thread.start()
        try:
            yield self
        finally:
            stop.set()
            if thread is not None:
                thread.join(timeout=5)

    def line(self, lab: str) -> str:
        now = time.monotonic()
        with self._lock:
            cell, cell_started = self._cell, self._cell_started
        if cell is None:
            return f"  {lab}  starting its kernel  {clock(now - self._started)}"
        number, section = cell
        where = f"cell {number}/{self._total}" if number else "a cell"
        if now - cell_started >= self.every:
            where += f" (for {clock(now - cell_started)})"
        return "  ".join(["", lab, *([f"§ {short(section)}"] if section else []), where, clock(now - self._started)])

    def _narrate(self, lab: str, usual: Usual | None, stop: threading.Event) -> None:
        noted = False
        while not stop.wait(self.every):
            self.say(self.line(lab))
            elapsed = time.monotonic() - self._started
            if usual and not noted and elapsed > max(SLOWER * usual.seconds, usual.seconds + 2 * self.every):
                self.say(slow_note(lab, elapsed, usual, *self.load()))
                noted = True
