"""The course harness: execute the solutions, generate the labs.

    python -m utils.harness run [--device auto|cpu|cuda|rocm] [NOTEBOOK ...]
    python -m utils.harness labs [--check]

`run` executes every solution notebook with papermill into `build/executed/`, one after the other
with a progress bar; a failing notebook is recorded in `build/status.json` and the rest still run;
then the report is built, and the exit status is 1 if any notebook failed.
`labs` writes `labs/` from `solutions/`: solution regions replaced by the exercise stub (nbgrader's
ClearSolutions), outputs and execution counts cleared. `--check` only compares, for the tests.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import nbformat

from . import report
from .exercises import STUB

SOLUTIONS = report.REPO_ROOT / "solutions"
LABS = report.REPO_ROOT / "labs"
NB_VERSION = 4


def solution_notebooks(folder: Path = SOLUTIONS) -> list[Path]:
    return sorted(p for p in folder.glob("*.ipynb") if not p.name.startswith("."))


def notebook_env() -> dict[str, str]:
    """Environment for executing notebooks: offline hub, no progress bars on stderr (they break
    nbval's comparisons), config and caches inside the build folder."""
    build = report.build_dir()
    env = {
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
        "HF_HOME": str(build / "cache" / "huggingface"),
        "MPLCONFIGDIR": str(build / "cache" / "matplotlib"),
        "TRITON_CACHE_DIR": str(build / "cache" / "triton"),
        "COURSE_BUILD_DIR": str(build),
    }
    return {k: os.environ.get(k, v) for k, v in env.items()}


# --- labs from solutions -------------------------------------------------------------------------

def make_lab(solution: Path):
    """The lab notebook for one solution notebook (a NotebookNode, not written)."""
    from nbconvert.preprocessors import ClearOutputPreprocessor
    from nbgrader.preprocessors import ClearSolutions

    nb = nbformat.read(solution, as_version=NB_VERSION)
    clear = ClearSolutions(code_stub={"python": STUB}, enforce_metadata=False,
                           begin_solution_delimeter="### BEGIN SOLUTION",
                           end_solution_delimeter="### END SOLUTION")
    nb, _ = clear.preprocess(nb, {})
    nb, _ = ClearOutputPreprocessor().preprocess(nb, {})
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
    # papermill / nbclient bookkeeping does not belong in a learner's notebook
    nb.metadata.pop("papermill", None)
    return nb


def lab_text(solution: Path) -> str:
    return nbformat.writes(make_lab(solution)) + "\n"


def write_labs(check: bool = False) -> list[str]:
    """Write labs/ (or, with check=True, list what is out of date without writing)."""
    stale = []
    expected = {s.name: lab_text(s) for s in solution_notebooks()}
    for name, text in expected.items():
        target = LABS / name
        if not target.exists() or target.read_text() != text:
            stale.append(f"labs/{name} differs from what solutions/{name} generates")
            if not check:
                LABS.mkdir(exist_ok=True)
                target.write_text(text)
    for extra in sorted(LABS.glob("*.ipynb")):
        if extra.name not in expected:
            stale.append(f"labs/{extra.name} has no solutions/{extra.name}")
            if not check:
                extra.unlink()
    return stale


# --- executing the course -----------------------------------------------------------------------

def run_notebooks(notebooks: list[Path], device: str = "auto", parameters: dict | None = None) -> dict:
    """Execute `notebooks` with papermill into build/executed/; return {lab: status}."""
    import papermill as pm
    from tqdm.auto import tqdm

    build = report.build_dir()
    executed = build / "executed"
    executed.mkdir(parents=True, exist_ok=True)
    status_file = build / "status.json"
    status = json.loads(status_file.read_text()) if status_file.exists() else {}
    os.environ.update(notebook_env())
    params = {"DEVICE": device, **(parameters or {})}
    bar = tqdm(notebooks, desc="labs", unit="notebook", file=sys.stdout)
    for nb in bar:
        bar.set_postfix_str(nb.stem)
        out = executed / nb.name
        entry = {"executed": os.path.relpath(out, build.parent), "parameters": params}
        try:
            pm.execute_notebook(str(nb), str(out), parameters=params, cwd=str(nb.parent),
                                kernel_name="python3", progress_bar=False, log_output=False)
            entry["status"] = "ok"
        except Exception as exc:  # a failing lab must not stop the others
            entry["status"] = "failed"
            entry["error"] = _short_error(exc)
            bar.write(f"FAILED {nb.name}: {entry['error']} (see {entry['executed']})")
        status[nb.stem] = entry
        status_file.write_text(json.dumps(status, indent=2) + "\n")
    return status


def _short_error(exc: Exception) -> str:
    ename, evalue = getattr(exc, "ename", None), getattr(exc, "evalue", None)
    text = f"{ename}: {evalue}" if ename else f"{type(exc).__name__}: {exc}"
    line = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return line[:300]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m utils.harness", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="execute the solutions and build the report")
    run.add_argument("--device", default=os.environ.get("COURSE_DEVICE") or "auto")
    run.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                     help="a parameter for every notebook (VALUE is read as JSON if it parses)")
    run.add_argument("notebooks", nargs="*", type=Path)
    labs = sub.add_parser("labs", help="generate labs/ from solutions/")
    labs.add_argument("--check", action="store_true", help="only report labs that are out of date")
    args = ap.parse_args(argv)

    if args.cmd == "labs":
        stale = write_labs(check=args.check)
        for line in stale:
            print(line)
        if args.check and stale:
            print("run `make labs` to regenerate labs/ from solutions/")
            return 1
        print(f"labs/: {len(solution_notebooks())} notebooks {'checked' if args.check else 'written'}")
        return 0

    params = {}
    for name, value in args.parameter:
        try:
            params[name] = json.loads(value)
        except json.JSONDecodeError:
            params[name] = value
    notebooks = [p.resolve() for p in args.notebooks] or solution_notebooks()
    status = run_notebooks(notebooks, device=args.device, parameters=params)
    path = report.build_report()
    failed = [lab for lab in (nb.stem for nb in notebooks) if status[lab]["status"] == "failed"]
    print(f"report: {os.path.relpath(path)} ({len(notebooks) - len(failed)} of {len(notebooks)} labs ran)")
    if failed:
        print("failed: " + ", ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
