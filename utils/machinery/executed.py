"""Executed copies of the solutions (docs/executed/, made on a GPU by .ci/gpu-reference): write, stamp, check.

A learner without a GPU opens `docs/executed/<lab>.ipynb` to see real GPU outputs and plots. Each copy
records in its notebook metadata (`course_executed`) the commit, software, device ("2x NVIDIA H100 80GB HBM3" for
a lab run on two GPUs), GPU count and date it came from and a hash of its solution's source cells; `stale()` compares
that hash with today's solution, so the report (and `python -m utils.machinery.executed check`) says when a copy is
older than its solution. Huge outputs are left out of a copy (with a line saying so) to keep the repository small.

    python -m utils.machinery.executed copy build/executed/*.ipynb     # after `make run` on a GPU
    python -m utils.machinery.executed check                            # which copies are missing or stale
    python -m utils.machinery.executed prose                            # a prose-only change: copies take it
                                                                        # (and each its note on older record lines)
"""
from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat

from utils.base import state
from utils.base.paths import REPO_ROOT, SOLUTIONS_DIR as SOLUTIONS
from utils.record import describe as describe_figure, device_label, gpus_of, reference_path, reference_records
from utils.stack import software_stack

COPIES = REPO_ROOT / "docs" / "executed"
KEY = "course_executed"
NOTE_ID = "course-record-note"    # the cell that says which record lines of a copy predate its own run's figures
MAX_TEXT_BYTES = 64 * 1024        # one output's text
MAX_IMAGE_BYTES = 512 * 1024      # one image (base64)
MAX_COPY_BYTES = 4 * 2**20        # a whole copy, after stripping


def source_hash(nb) -> str:
    """SHA-256 of a notebook's code and markdown sources, in order (papermill's injected parameters and
    outputs do not count), so an executed copy and its solution hash alike until the solution changes."""
    h = hashlib.sha256()
    for cell in nb.cells:
        if "injected-parameters" in cell.get("metadata", {}).get("tags", []) or cell.get("id") == NOTE_ID:
            continue
        h.update(cell.cell_type.encode() + b"\0" + cell.source.encode() + b"\0")
    return h.hexdigest()


def code_hash(nb) -> str:
    """SHA-256 of a notebook's code sources alone, in order (papermill's injected parameters left out): equal for an
    executed copy and its solution while only the solution's prose changed."""
    h = hashlib.sha256()
    for cell in nb.cells:
        if cell.cell_type == "code" and "injected-parameters" not in cell.get("metadata", {}).get("tags", []):
            h.update(cell.source.encode() + b"\0")
    return h.hexdigest()


def take_prose(copy: Path, solution: Path) -> bool:
    """Give the executed copy `copy` its solution's markdown when only the prose changed (the code cells are the
    ones it ran, in order): the copy's code cells and outputs stay, the stamp keeps the commit it was executed at and
    adds the commit its prose comes from (`prose_commit`). Returns False, changing nothing, when the code differs
    (the copy is then stale until a GPU run) or the prose is already the solution's."""
    nb, sol = nbformat.read(copy, as_version=4), nbformat.read(solution, as_version=4)
    stamp = nb.metadata.get(KEY) or {}
    if code_hash(nb) != code_hash(sol) or stamp.get("solution_sha256") == source_hash(sol):
        return False
    ran = {c.get("id"): (i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code"}
    cells = []
    for cell in sol.cells:
        if cell.cell_type != "code":
            cells.append(cell)
            continue
        i, done = ran[cell.get("id")]
        cells.append(done)
        after = nb.cells[i + 1] if i + 1 < len(nb.cells) else None
        if after is not None and "injected-parameters" in after.get("metadata", {}).get("tags", []):
            cells.append(after)
    nb.cells = cells
    nb.metadata[KEY] = {**stamp, "solution_sha256": source_hash(sol), "prose_commit": commit(),
                        "prose_date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    state.write_text_atomic(copy, nbformat.writes(nb) + "\n")
    return True


def git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def commit() -> str | None:
    """The commit a run came from: $COURSE_COMMIT where the checkout has no .git (the GPU machine gets a copy of
    the working tree; .ci/gpu-reference's caller names the commit it sent), else git's HEAD."""
    return os.environ.get("COURSE_COMMIT") or git("rev-parse", "HEAD")


def uncommitted_changes() -> bool | None:
    """Whether solutions/ or utils/ differ from the commit; None where git cannot tell: no .git, or a $COURSE_COMMIT
    that is not git's HEAD here (the GPU machine's copy of the tree can sit in a repository of its own)."""
    named = os.environ.get("COURSE_COMMIT")
    if named and git("rev-parse", "HEAD") != named:
        return None
    status = git("status", "--porcelain", "--", "solutions", "utils")
    return None if status is None else bool(status)


def _strip(output, limits: dict) -> object:
    """An output small enough for the copy, or a note saying what was left out."""
    size = len(json.dumps(output))
    if output.get("output_type") in ("display_data", "execute_result"):
        data = output.get("data", {})
        big = [k for k, v in data.items() if len(json.dumps(v)) > (
            limits["image"] if k.startswith("image/") else limits["text"])]
        if not big:
            return output
        output = nbformat.from_dict(dict(output))
        output["data"] = {k: v for k, v in data.items() if k not in big}
        output["data"].setdefault("text/plain", "")
        output["data"]["text/plain"] += f"\n[{', '.join(big)} of {size // 1024} KiB left out of this copy]"
        return output
    if size > limits["text"]:
        text = output.get("text", "") if output.get("output_type") == "stream" else ""
        return nbformat.v4.new_output("stream", name="stdout", text=text[: limits["text"] // 2]
                                      + f"\n[... {size // 1024} KiB of output left out of this copy]\n")
    return output


def make_copy(executed: Path, out_dir: Path = COPIES, *, solution: Path | None = None,
              device: str | None = None, limits: dict | None = None) -> Path:
    """Write `executed` (a notebook `make run` executed) to `out_dir` with its outputs (huge ones left out)
    and the `course_executed` stamp; returns the copy's path. The device is the results sidecar's (or `device`, for
    a run without one), named "2x <GPU>" when the sidecar says the lab used two GPUs."""
    limits = {"text": MAX_TEXT_BYTES, "image": MAX_IMAGE_BYTES, **(limits or {})}
    executed = Path(executed)
    solution = Path(solution) if solution else SOLUTIONS / executed.name
    nb = nbformat.read(executed, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = [_strip(o, limits) for o in cell.outputs]
    results = state.read_json(Path(executed).parent.parent / "results" / f"{executed.stem}.json", {},
                              what="results sidecar", shape=dict) or {}
    gpus = gpus_of(results) if results.get("device") else (1 if device else None)
    nb.metadata[KEY] = {
        "solution": f"solutions/{solution.name}",
        "solution_sha256": source_hash(nbformat.read(solution, as_version=4)),
        "commit": commit(),
        "uncommitted_changes": uncommitted_changes(),
        "device": device_label(device or (results.get("device") or {}).get("name"), gpus),
        "gpus": gpus,
        "software": results.get("software") or software_stack(),
        "run_id": results.get("run_id"),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    text = nbformat.writes(nb) + "\n"
    if len(text.encode()) > MAX_COPY_BYTES:
        raise ValueError(f"{executed.name}: the copy would be {len(text) // 2**20} MiB (limit "
                         f"{MAX_COPY_BYTES // 2**20} MiB); lower the output limits")
    return state.write_text_atomic(Path(out_dir) / executed.name, text)


def _prints_a_record(nb) -> bool:
    """Whether any output of the copy quotes a reference record (a line naming utils/reference/...)."""
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            text = out.get("text") or (out.get("data") or {}).get("text/plain") or (out.get("data") or {}).get(
                "text/markdown") or ""
            if "utils/reference/" in ("".join(text) if isinstance(text, list) else text):
                return True
    return False


def record_note(nb, lab: str, records: dict[str, dict] | None = None) -> str | None:
    """The note a copy needs when a reference record now holds the copy's own run: the record lines it printed
    quote the record as it stood before that run was merged in, so the note names the record's figures now."""
    run = (nb.metadata.get(KEY) or {}).get("run_id")
    if not run or not _prints_a_record(nb):
        return None
    for stem, data in (records if records is not None else reference_records()).items():
        entry = (data.get("labs") or {}).get(lab) or {}
        if entry.get("run_id") != run:
            continue
        size = lambda m: ", ".join(f"{k} {v}" for k, v in (m.get("size") or {}).items()) if isinstance(
            m.get("size"), dict) else str(m.get("size") or "")
        rows = "\n".join(f"| {(m.get('label') or key).replace('|', '/')} | {size(m).replace('|', '/')} | "
                         f"{describe_figure(m).replace('|', '/')} |"
                         for key, m in sorted((entry.get("metrics") or {}).items()))
        return (f"**About the record lines in this copy.** This copy is run `{run}`, and `{reference_path(stem)}` "
                f"now holds this run's own figures. A line below that quotes the course's record shows the record as "
                f"it stood *before* this run was merged into it (it names that earlier run where it can); the record "
                f"today:\n\n| figure | size | the record ({reference_path(stem)}) |\n|---|---|---|\n{rows}")
    return None


def add_record_note(copy: Path, lab: str | None = None, records: dict[str, dict] | None = None) -> bool:
    """Put (or refresh) the record note as the copy's second cell; remove a note that no longer applies. Returns
    whether the file changed."""
    nb = nbformat.read(copy, as_version=4)
    cells = [c for c in nb.cells if c.get("id") != NOTE_ID]
    note = record_note(nb, lab or copy.stem, records)
    if note:
        cell = nbformat.v4.new_markdown_cell(note)
        cell["id"] = NOTE_ID
        cells.insert(1, cell)
    if [c.source for c in cells] == [c.source for c in nb.cells]:
        return False
    nb.cells = cells
    state.write_text_atomic(copy, nbformat.writes(nb) + "\n")
    return True


def stale(out_dir: Path = COPIES, solutions_dir: Path = SOLUTIONS) -> dict[str, str]:
    """{lab: why} for every solution whose executed copy is missing, unstamped or older than it."""
    found = {}
    for solution in sorted(Path(solutions_dir).glob("*.ipynb")):
        copy = Path(out_dir) / solution.name
        if not copy.exists():
            found[solution.stem] = "no executed copy yet"
            continue
        stamp = nbformat.read(copy, as_version=4).metadata.get(KEY)
        if not stamp:
            found[solution.stem] = "the copy has no course_executed stamp"
        elif stamp.get("solution_sha256") != source_hash(nbformat.read(solution, as_version=4)):
            found[solution.stem] = (f"older than its solution (executed at commit {str(stamp.get('commit'))[:10]} "
                                    f"on {stamp.get('date', '?')[:10]}; the solution changed since)")
    return found


def describe(out_dir: Path = COPIES, solutions_dir: Path = SOLUTIONS) -> list[str]:
    """One line per lab for the report: where its GPU copy is, what it came from, and whether it is current."""
    why = stale(out_dir, solutions_dir)
    lines = []
    for solution in sorted(Path(solutions_dir).glob("*.ipynb")):
        copy = Path(out_dir) / solution.name
        rel = copy.relative_to(REPO_ROOT) if copy.is_relative_to(REPO_ROOT) else copy
        if solution.stem in why and not copy.exists():
            lines.append(f"- {solution.stem}: {why[solution.stem]}")
            continue
        stamp = nbformat.read(copy, as_version=4).metadata.get(KEY) or {}
        origin = (f"{stamp.get('device', '?')}, commit {str(stamp.get('commit'))[:10]}, {stamp.get('date', '?')[:10]}, "
                  f"torch {stamp.get('software', {}).get('torch', '?')}"
                  + (f"; prose from commit {str(stamp['prose_commit'])[:10]}" if stamp.get("prose_commit") else ""))
        lines.append(f"- {solution.stem}: `{rel}` ({origin})"
                     + (f" — **{why[solution.stem]}**" if solution.stem in why else " — current"))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m utils.machinery.executed", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    cp = sub.add_parser("copy", help="stamp executed notebooks and write them to docs/executed/")
    cp.add_argument("notebooks", nargs="+", type=Path)
    cp.add_argument("--out", type=Path, default=COPIES)
    cp.add_argument("--device", help="the GPU's name, if the results sidecars are missing")
    sub.add_parser("check", help="list the copies that are missing or older than their solutions (exit 1)")
    sub.add_parser("prose", help="give each copy whose code is its solution's the solution's new markdown")
    args = ap.parse_args(argv)
    if args.cmd == "copy":
        for nb in args.notebooks:
            print(make_copy(nb, args.out, device=args.device))
        return 0
    if args.cmd == "prose":
        for solution in sorted(SOLUTIONS.glob("*.ipynb")):
            if (COPIES / solution.name).exists() and take_prose(COPIES / solution.name, solution):
                print(f"{COPIES / solution.name}: prose from {solution} (its code cells unchanged)")
        for copy in sorted(COPIES.glob("*.ipynb")):
            if add_record_note(copy):
                print(f"{copy}: its note on the record lines it printed before the record held its run")
        return 0
    for line in describe():
        print(line)
    return 1 if stale() else 0


if __name__ == "__main__":
    sys.exit(main())
