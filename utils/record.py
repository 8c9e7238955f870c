"""The recorder a lab's notebook keeps its headline figures with, each with how it was measured and whether it can be trusted.

    rec = record.start("01_vector_add", device)          # clears this lab's earlier records
    t = timing.benchmark(lambda: torch.add(x, y, out=z))
    rec.metric("torch_gbps", t.gbps(3 * n * 4), "GB/s", label="torch.add", size={"n": n},
               peak=device.peak_bandwidth_gbps, timing=t,
               checks=[record.not_far_below(value, best_small, 10, "the best smaller size")])
    rec.figure(fig, "achieved_vs_peak")

Every figure belongs to the lab that recorded it (`results/<lab>.json`), and carries its size, unit, label, the
number of samples and their spread (interquartile range / median) and the machine's state around it
(`utils.machine`). The recorder applies the validity tests below; a figure that fails one is recorded as
**unreliable** with its reasons, printed as such, shown as such in the report and left out of any reference:

- fewer than MIN_SAMPLES samples, or a spread above MAX_SPREAD;
- a value that is not a finite number;
- a check the lab states for the figure fails (`enough`: e.g. a load level that completed no request, a p99 of
  ten requests; `not_far_below`: a throughput far below what the same run measured where it should be at least
  as high);
- the machine changed under it (`utils.machine.judge`: other processes took the CPU, the GPU's clock fell or it
  slowed itself down, another process used the GPU).

A sidecar also says how many GPUs the lab used (`gpus`: 1 on a GPU, 0 on a CPU; a lab that used several says so
with `rec.ran_on(2, topology="GPU0-GPU1 NV18")`). `make run` builds the course report from these files
(`utils.machinery.report`); `load_reference()` reads a committed reference record (`utils/reference/<name>.json`:
`h100.json` of one GPU, `h100x2.json` of two), and `find_reference()` picks the one a lab's figures are set beside.
"""
from __future__ import annotations

import datetime as _dt
import math
import os
import re
import shutil
import warnings
from dataclasses import asdict
from pathlib import Path

from utils import backend, machine
from utils.base import state
from utils.base.paths import REFERENCE_DIR, REPO_ROOT, build_dir, results_dir
from utils.stack import software_stack

__all__ = ["Recorder", "start", "size_text", "enough", "not_far_below", "percentile_needs", "load_results",
           "load_reference", "find_reference", "gpus_of", "record_gpus", "device_label", "build_dir", "results_dir",
           "MIN_SAMPLES", "MAX_SPREAD"]
_KEY = re.compile(r"^[a-z0-9_]+(\.[a-z0-9_]+)*$")
MIN_SAMPLES = 3        # repetitions (or interleaved rounds, or requests) a figure needs at least
MAX_SPREAD = 0.25      # IQR / median above this: the samples disagree too much for one number
BUSY_LOAD = 1.5        # a load average above this many per core when a lab starts: the report warns
DEFAULT_REFERENCE = "h100"   # the course's one-GPU record: CPU runs and GPUs without a record of their own
# Units where more is better / less is better (the report's "slow" and "suspicious" follow the direction).
HIGHER_IS_BETTER = {"GB/s", "TFLOP/s", "tokens/s", "req/s", "GFLOP/s"}
LOWER_IS_BETTER = {"ms", "s", "µs", "us"}


class Recorder:
    """Writes one lab's sidecar, `results/<lab>.json`, after every change (a crash keeps what was
    recorded so far) and its figures as `results/<lab>/<name>.png`."""

    def __init__(self, lab: str, device, root: Path | None = None):
        self.lab = lab
        self.root = Path(root) if root else results_dir()
        self.path = self.root / f"{lab}.json"
        self.figure_dir = self.root / lab
        self._plat = backend.of(device) if device is not None else None
        self._marks = [machine.snapshot(self._plat)]   # the start and every figure's moment (the last: _marks[-1])
        self.data = {
            "lab": lab,
            "device": asdict(device) if device is not None else None,
            "gpus": 1 if self._plat is not None and self._plat.is_gpu else 0,   # rec.ran_on(n): several
            "software": software_stack(),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "run_id": os.environ.get("COURSE_RUN_ID"),   # set by `make run`; None in a notebook of one's own
            "state": {"start": self._marks[0]},
            "metrics": {},
            "warnings": [],
            "figures": [],
        }
        self.path.unlink(missing_ok=True)
        shutil.rmtree(self.figure_dir, ignore_errors=True)
        self._save()
        cpu = self._marks[0]["cpu"]
        if cpu["load1"] > BUSY_LOAD * cpu["cores"]:
            self.warn(f"the machine was busy when this lab started (load average {cpu['load1']} on {cpu['cores']} "
                      "cores: other programs, tests or users): its timings may be slower than this machine can do")

    def given(self, parameters: dict) -> None:
        """The parameters this run was given (papermill's, `make run -p`), beside its figures: a reference run may set
        shorter windows or another engine than the defaults."""
        if parameters:
            self.data["parameters"] = {k: v if isinstance(v, (int, float, str, bool, type(None))) else repr(v)
                                       for k, v in parameters.items()}
            self._save()

    def metric(self, key: str, value: float, unit: str, *, label: str, size: str | dict,
               peak: float | None = None, timing=None, samples: int | None = None, spread: float | None = None,
               checks: tuple | list = (), better: str | None = None, timed: bool | None = None) -> dict:
        """Record a headline figure of this lab.

        label: what it is, readable ("torch.add, float32"); size: what was measured ("N=4096" or {"N": 4096});
        peak (same unit): the report shows value / peak. timing: the `timing.Timing` it comes from (its samples,
        spread and machine window), or samples/spread given directly (e.g. a ratio's rounds, a load level's
        requests). checks: reasons from `enough(...)`/`not_far_below(...)` (None where the check passed).
        better: "higher" or "lower" when the unit does not say (the report's verdict uses it). timed: whether
        the figure depends on speed (then the machine's state is judged); by default, when it comes with a timing,
        samples or a spread, or its unit is a rate or a time. A computed error or a count is not timed."""
        if not _KEY.match(key):
            raise ValueError(f"metric key {key!r} must be lower case words joined by '_' or '.'")
        if not label or not str(label).strip():
            raise ValueError(f"metric {key!r} needs a readable label=")
        entry = {"value": float(value), "unit": unit, "label": str(label), "size": size_text(size)}
        if peak:
            entry["peak"] = float(peak)
            entry["fraction_of_peak"] = float(value) / float(peak)
        window = None
        if timing is not None:
            samples, spread, window = len(timing.samples_ms), timing.spread, timing.window
            entry["method"] = timing.clock
        if samples is not None:
            entry["samples"] = int(samples)
        if spread is not None and math.isfinite(spread):
            entry["spread"] = round(float(spread), 4)
        now = machine.snapshot(self._plat)
        window = window or {"before": self._marks[-1], "after": now}    # no timing: the span since the last figure
        if window["after"]["time"] - window["before"]["time"] < machine.MIN_WINDOW_S:
            # too short to count other programs' CPU time (a figure derived from a measurement recorded just
            # before, or a few milliseconds of timing): widen it back to the last mark that leaves enough time
            older = [m for m in self._marks if window["after"]["time"] - m["time"] >= machine.MIN_WINDOW_S]
            if older:
                window = {"before": min(older[-1], window["before"], key=lambda m: m["time"]), "after": window["after"]}
        self._marks.append(now)
        better = better or ("higher" if unit in HIGHER_IS_BETTER else "lower" if unit in LOWER_IS_BETTER else None)
        if better:
            entry["better"] = better
        if timed is None:
            timed = timing is not None or samples is not None or spread is not None or better is not None
        if timed:
            entry["state"] = window
        reasons = validity(entry, checks)
        entry["verdict"] = "unreliable" if reasons else "ok"
        if reasons:
            entry["reasons"] = reasons
            print(f"UNRELIABLE: {entry['label']} ({entry['size']}): {describe(entry)}")
        self.data["metrics"][key] = entry
        self._save()
        return entry

    def text(self, key: str) -> str:
        """A recorded figure as a learner should read it: "98.3 GB/s (5% of peak)" or "unreliable: ..."."""
        return describe(self.data["metrics"][key])

    def doubt(self, key: str) -> str | None:
        """Why a recorded figure is unreliable (its reasons, joined), or None when it passed its validity tests: what
        a plot needs to draw the point hollow (`utils.plots`)."""
        return "; ".join(self.data["metrics"][key].get("reasons") or []) or None

    def ran_on(self, gpus: int, topology: str | None = None) -> None:
        """Say that this lab used `gpus` GPUs (lab 06's ranks, one GPU each), with the link between them as
        `nvidia-smi topo -m` or amd-smi names it ("GPU0-GPU1 NV18"); the report then sets its figures beside the
        course's record of that many GPUs. On a CPU the count stays 0: its ranks are processes, not GPUs."""
        if isinstance(gpus, bool) or not hasattr(gpus, "__index__") or gpus < 1:
            raise ValueError(f"gpus={gpus!r} must be a whole number of GPUs, at least 1")
        if self._plat is not None and self._plat.is_gpu:
            self.data["gpus"] = int(gpus)
        if topology is not None:
            self.data["topology"] = str(topology).strip()
        self._save()

    def warn(self, message: str) -> None:
        """A warning about this lab's run that the report must carry (e.g. "this machine is busy")."""
        if message not in self.data["warnings"]:
            self.data["warnings"].append(message)
            self._save()
        print(f"WARNING: {message}")

    def figure(self, fig, name: str) -> Path:
        """Save a matplotlib figure for the report (the notebook still shows it inline)."""
        path = self.figure_dir / f"{name}.png"
        with state.storage_errors(path):      # a full disk names the figure's file and what to do
            self.figure_dir.mkdir(parents=True, exist_ok=True)
            fig.savefig(path, dpi=110, bbox_inches="tight")
        rel = path.relative_to(self.root).as_posix()
        if rel not in self.data["figures"]:
            self.data["figures"].append(rel)
        self.data["state"]["end"] = machine.snapshot(self._plat)
        self._save()
        return path

    def _save(self):
        state.write_json(self.path, self.data)


def validity(entry: dict, checks=()) -> list[str]:
    """Why `entry` cannot be trusted as a measurement ([] if it can): the recorder's tests and the lab's."""
    reasons = [r for r in checks if r]
    if not math.isfinite(entry["value"]):
        reasons.append(f"the value is {entry['value']}")
    n = entry.get("samples")
    if n is not None and n < MIN_SAMPLES:
        reasons.append(f"only {n} sample{'s' if n != 1 else ''} (needs {MIN_SAMPLES})")
    if entry.get("spread", 0) > MAX_SPREAD:
        reasons.append(f"spread {entry['spread']:.0%} (IQR/median) above {MAX_SPREAD:.0%}")
    window = entry.get("state") or {}
    reasons += machine.judge(window.get("before"), window.get("after"))
    return reasons


def timing_problems(timing) -> list[str]:
    """Why one ``utils.timing.Timing`` cannot be trusted as a point of a plot ([] if it can): the recorder's tests."""
    return validity({"value": timing.median_ms, "samples": len(timing.samples_ms), "spread": timing.spread,
                     "state": timing.window})


def describe(entry: dict) -> str:
    """"98.3 GB/s (5% of peak; median of 50, spread 3%)" or "unreliable (0.0655 GB/s): why"."""
    value = f"{entry['value']:,.4g} {entry['unit']}"
    if entry.get("verdict") == "unreliable":
        return f"unreliable ({value}): {'; '.join(entry.get('reasons', []))}"
    how = []
    if "fraction_of_peak" in entry:
        how.append(f"{entry['fraction_of_peak']:.0%} of peak")
    if "samples" in entry:
        how.append(f"n={entry['samples']}" + (f", spread {entry['spread']:.0%}" if "spread" in entry else ""))
    return value + (f" ({'; '.join(how)})" if how else "")


def enough(count: int, needed: int, what: str) -> str | None:
    """A check: `count` of `what` is at least `needed` (None) or the reason it is not."""
    if count >= needed:
        return None
    return f"{'no' if count == 0 else f'only {count}'} {what} (needs {needed})"


def not_far_below(value: float, other: float, factor: float, what: str) -> str | None:
    """A check: `value` is not more than `factor` times below `other`, which the same run measured where the
    quantity should be at least as high (`what` names it). None when it is not."""
    if not (math.isfinite(value) and math.isfinite(other)) or value * factor >= other:
        return None
    return f"{other / value:,.0f}x below {what} ({other:,.4g}) in the same run"


def percentile_needs(q: float) -> int:
    """Samples a q-th percentile needs before it means something: p50 2, p90 10, p99 100."""
    return max(2, math.ceil(100 / (100 - q) - 1e-9))


def size_text(size: str | dict) -> str:
    """The canonical text of a metric's size: {"N": 4096, "D": 128} -> "N=4096, D=128"."""
    if isinstance(size, dict) and size:
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
        if not isinstance(data, dict):
            continue
        wrong = _sidecar_shape_error(data)
        if wrong:
            warnings.warn(f"results sidecar {p} has the wrong shape ({wrong}); left out (its lab's next run rewrites "
                          "it)", stacklevel=2)
            continue
        found[p.stem] = data
    return found


def _sidecar_shape_error(data: dict) -> str | None:
    """What is of the wrong shape in a sidecar (edited by hand, or another program's), or None."""
    metrics = data.get("metrics", {})
    if not isinstance(metrics, dict) or not all(isinstance(m, dict) for m in metrics.values()):
        return "'metrics' is not an object of objects"
    for key in ("figures", "warnings"):
        if not isinstance(data.get(key, []), list):
            return f"{key!r} is not a list"
    return None


def load_reference(name: str = "h100") -> dict | None:
    """A committed reference record ({"device", "arch", "labs": {lab: {"metrics": ...}}}); a corrupt one raises
    CorruptStateError naming the file."""
    return state.read_json(REFERENCE_DIR / f"{name}.json", None, what="reference record", on_corrupt="raise", shape=dict)


def record_source(reference: dict | None, lab: str, stem: str = "h100") -> str:
    """Which run a reference record's figures of ``lab`` come from, for a sentence that quotes them: "the course's
    H100 record (utils/reference/h100.json: run 20261126-... of 2026-11-26, commit 8b0197c)". Printed at run time, so
    an executed copy names the record as it stood when it ran, never passes it off as its own run."""
    entry = ((reference or {}).get("labs") or {}).get(lab) or {}
    run = ", ".join(filter(None, [f"run {entry['run_id']}" if entry.get("run_id") else None,
                                  f"of {entry['date']}" if entry.get("date") else None,
                                  f"commit {str(entry['commit'])[:7]}" if entry.get("commit") else None]))
    gpu = (device_label((reference or {}).get("device"), record_gpus(reference or {})) or stem).replace("NVIDIA ", "")
    return f"the course's {gpu} record ({reference_path(stem)}{': ' + run if run else ''})"


def beside_record(rec: "Recorder", key: str, reference: dict | None, lab: str) -> str:
    """One figure of this run beside the record's: "this run: <value (share of peak)>; the record: <value ...>"."""
    mine = rec.data["metrics"].get(key)
    theirs = reference_metrics(reference, lab).get(key)
    this = f"this run: {describe(mine)}" if mine else "this run: not measured"
    return f"{this}; the record: {describe(theirs)}" if theirs else f"{this}; the record: none"


def gpus_of(result: dict | None) -> int:
    """How many GPUs a lab's sidecar says it used: its `gpus`, or for a sidecar from before the field, 1 on a GPU
    and 0 on a CPU (or with no device)."""
    gpus = (result or {}).get("gpus")
    if isinstance(gpus, int) and not isinstance(gpus, bool) and gpus >= 0:
        return gpus
    device = (result or {}).get("device") or {}
    return 1 if device and device.get("backend") != "cpu" else 0


def record_gpus(reference: dict) -> int:
    """How many GPUs a reference record's run used: its `gpus`, 1 when absent (the records from before the field)."""
    gpus = reference.get("gpus", 1)
    return gpus if isinstance(gpus, int) and not isinstance(gpus, bool) and gpus >= 1 else 1


def device_label(name: str | None, gpus: int | None) -> str | None:
    """A device as the report and the executed copies name it: "2x NVIDIA H100 80GB HBM3" for two, the plain name
    for one (or none)."""
    return f"{gpus}x {name}" if name and gpus and gpus > 1 else name


def reference_path(stem: str) -> str:
    """Where a reference record is, as a reader finds it: "utils/reference/h100x2.json"."""
    path = REFERENCE_DIR / f"{stem}.json"
    return path.relative_to(REPO_ROOT).as_posix() if path.is_relative_to(REPO_ROOT) else str(path)


def reference_records() -> dict[str, dict]:
    """Every reference record in REFERENCE_DIR by its file's stem (format 2 only: other JSON files there, such as
    h100_attention_profile.json, are not records); a file that is not JSON raises as in `load_reference`."""
    found = {}
    for path in sorted(REFERENCE_DIR.glob("*.json")):
        data = state.read_json(path, None, what="reference record", on_corrupt="raise")
        if isinstance(data, dict) and data.get("format") == 2 and isinstance(data.get("labs"), dict):
            found[path.stem] = data
    return found


def find_reference(device_name: str | None, gpus: int, *,
                   lab: str | None = None) -> tuple[dict | None, str, str | None]:
    """(the reference record a run's figures are set beside, its file's stem such as "h100x2", a note or None).

    The course's record of the same GPU (`device_name`) at the same GPU count; else of the same GPU at the nearest
    other count; else the course's one-GPU record (h100.json). Each fallback comes with a one-sentence note saying
    what was used instead. A CPU run (`gpus` 0, or no device name) gets h100.json and no note: CPU figures are
    judged by fraction of peak. `lab`: only records holding figures of that lab count, besides h100.json (a 2-GPU
    record may hold lab 06 alone: another lab of the same GPU is not set beside it)."""
    if not device_name or gpus < 1:
        return load_reference(DEFAULT_REFERENCE), DEFAULT_REFERENCE, None
    records = reference_records()
    same_gpu = {stem: r for stem, r in records.items() if r.get("device") == device_name
                and (lab is None or lab in r["labs"] or stem == DEFAULT_REFERENCE)}
    exact = [stem for stem, r in same_gpu.items() if record_gpus(r) == gpus]
    if exact:
        return same_gpu[exact[0]], exact[0], None
    if same_gpu:      # the nearest count; between two as near, the smaller
        stem = min(same_gpu, key=lambda s: (abs(record_gpus(same_gpu[s]) - gpus), record_gpus(same_gpu[s]), s))
        used, found = same_gpu[stem], stem
    else:
        used, found = records.get(DEFAULT_REFERENCE) or load_reference(DEFAULT_REFERENCE), DEFAULT_REFERENCE
    missing = f"no {gpus}-GPU record of {device_name}"
    if used is None:
        return None, found, f"{missing} and no {reference_path(found)}: nothing to compare with"
    other = "" if used.get("device") == device_name else f" of {used.get('device')}"
    return used, found, (f"{missing}: compared with the course's {record_gpus(used)}-GPU record{other} "
                         f"({reference_path(found)})")


def reference_metrics(reference: dict | None, lab: str) -> dict:
    """The reference's figures of one lab ({} when it has none)."""
    return ((reference or {}).get("labs") or {}).get(lab, {}).get("metrics", {})
