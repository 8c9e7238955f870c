"""The recorder a lab's notebook keeps its headline figures with: results/<lab>.json and its plots.

    rec = record.start("00_environment", device)       # clears this lab's earlier records
    rec.metric("environment.add_gbps", 2950.0, "GB/s", peak=device.peak_bandwidth_gbps, size={"n": 1 << 28})
    rec.figure(fig, "achieved_vs_peak")

`make run` builds the course report from these files (`utils.machinery.report`); `load_reference()`
reads a committed GPU reference record (`utils/reference/<gpu>.json`).
"""
from __future__ import annotations

import datetime as _dt
import os
import re
import shutil
from dataclasses import asdict
from pathlib import Path

from utils.base import state
from utils.base.paths import REFERENCE_DIR, build_dir, results_dir
from utils.stack import software_stack

__all__ = ["Recorder", "start", "size_text", "load_results", "load_reference", "build_dir", "results_dir"]
_KEY = re.compile(r"^[a-z0-9_]+(\.[a-z0-9_]+)+$")


class Recorder:
    """Writes one lab's sidecar, `results/<lab>.json`, after every change (a crash keeps what was
    recorded so far) and its figures as `results/<lab>/<name>.png`."""

    def __init__(self, lab: str, device, root: Path | None = None):
        self.lab = lab
        self.root = Path(root) if root else results_dir()
        self.path = self.root / f"{lab}.json"
        self.figure_dir = self.root / lab
        self.data = {
            "lab": lab,
            "device": asdict(device) if device is not None else None,
            "software": software_stack(),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "run_id": os.environ.get("COURSE_RUN_ID"),   # set by `make run`; None in a notebook of one's own
            "metrics": {},
            "figures": [],
        }
        self.path.unlink(missing_ok=True)
        shutil.rmtree(self.figure_dir, ignore_errors=True)
        self._save()

    def metric(self, key: str, value: float, unit: str, *, peak: float | None = None,
               label: str | None = None, size: str | dict | None = None) -> dict:
        """Record a headline figure; `peak` (same unit) makes the report show value / peak. `size` says
        what was measured ("N=4096, D=128" or {"N": 4096, "D": 128}): the report sets a reference figure
        beside this one only when both were measured at the same size."""
        if not _KEY.match(key):
            raise ValueError(f"metric key {key!r} must look like 'lab_topic.figure' (lower case, dots)")
        entry = {"value": float(value), "unit": unit}
        if size is not None:
            entry["size"] = size_text(size)
        if peak:
            entry["peak"] = float(peak)
            entry["fraction_of_peak"] = float(value) / float(peak)
        if label:
            entry["label"] = label
        self.data["metrics"][key] = entry
        self._save()
        return entry

    def figure(self, fig, name: str) -> Path:
        """Save a matplotlib figure for the report (the notebook still shows it inline)."""
        path = self.figure_dir / f"{name}.png"
        with state.storage_errors(path):      # a full disk names the figure's file and what to do
            self.figure_dir.mkdir(parents=True, exist_ok=True)
            fig.savefig(path, dpi=110, bbox_inches="tight")
        rel = path.relative_to(self.root).as_posix()
        if rel not in self.data["figures"]:
            self.data["figures"].append(rel)
        self._save()
        return path

    def _save(self):
        state.write_json(self.path, self.data)


def size_text(size: str | dict) -> str:
    """The canonical text of a metric's size: {"N": 4096, "D": 128} -> "N=4096, D=128"."""
    if isinstance(size, dict):
        return ", ".join(f"{k}={v}" for k, v in size.items())
    if not isinstance(size, str) or not size.strip():
        raise ValueError(f"size={size!r} must be a non-empty string or a dict such as {{'N': 4096}}")
    return size.strip()


def start(lab: str, device, root: Path | None = None) -> Recorder:
    return Recorder(lab, device, root)


def load_results(root: Path | None = None) -> dict[str, dict]:
    """Every lab's sidecar; a corrupt one is named in a warning and left out."""
    root = Path(root) if root else results_dir()
    found = {}
    for p in sorted(root.glob("*.json")):
        data = state.read_json(p, None, what="results sidecar", shape=dict)
        if isinstance(data, dict):
            found[p.stem] = data
    return found


def load_reference(name: str = "h100") -> dict | None:
    """A committed reference record; a corrupt one raises CorruptStateError naming the file."""
    return state.read_json(REFERENCE_DIR / f"{name}.json", None, what="reference record", on_corrupt="raise", shape=dict)
