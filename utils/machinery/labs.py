"""labs/ from solutions/: the learner's notebooks (exercise regions -> stubs, outputs cleared), the course's
notebook metadata, and build/export/<lab>.py for every lab (`make labs`, `make export`)."""
from __future__ import annotations

from pathlib import Path

import nbformat

from utils.base import state
from utils.solutions import (EXPORT_TAG, LABS, NB_VERSION, export_dir, export_source, fill_regions, notebook_path,
                             read, solution_notebooks)


# Every course notebook's notebook-level metadata: the kernel, and the language as ipykernel reports it
# (all its fields), so that JupyterLab has nothing to add when a kernel starts and opening a notebook does
# not mark it changed. The Python version is the course's CI interpreter; the course's Jupyter settings
# (jupyter/jupyter_server_config.py) hand it to the browser as the learner's own Python.
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
LANGUAGE_INFO = {"codemirror_mode": {"name": "ipython", "version": 3}, "file_extension": ".py",
                 "mimetype": "text/x-python", "name": "python", "nbconvert_exporter": "python",
                 "pygments_lexer": "ipython3", "version": "3.11.7"}


def set_course_metadata(nb):
    """Give `nb` (a NotebookNode) the course's kernelspec and language_info; other metadata is kept."""
    nb.metadata["kernelspec"] = nbformat.from_dict(KERNELSPEC)
    nb.metadata["language_info"] = nbformat.from_dict(LANGUAGE_INFO)
    return nb


def write_solution_metadata(paths: list[Path] | None = None) -> list[Path]:
    """Give the solution notebooks the course's notebook-level metadata (kernelspec, language_info),
    changing nothing else; returns the notebooks rewritten. For the lead: run once after a merge
    (`python -c "from utils.machinery import labs; print(labs.write_solution_metadata())"`), then
    `make labs`."""
    changed = []
    for path in paths or solution_notebooks():
        text = Path(path).read_text()
        new = nbformat.writes(set_course_metadata(nbformat.reads(text, as_version=NB_VERSION))) + "\n"
        if new != text:
            state.write_text_atomic(Path(path), new)
            changed.append(Path(path))
    return changed


# --- the learner's lab ---------------------------------------------------------------------------

def make_lab(solution: Path):
    """The lab notebook for one solution notebook (a NotebookNode, not written), with the course's
    notebook metadata."""
    nb = set_course_metadata(fill_regions(read(solution), solution.name, None, stubs=True))
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
        cell.metadata.pop("execution", None)
        cell.metadata.pop("papermill", None)
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
                state.write_text_atomic(target, text)
    for extra in sorted(LABS.glob("*.ipynb")):
        if extra.name not in expected:
            stale.append(f"labs/{extra.name} has no solutions/{extra.name}")
            if not check:
                extra.unlink()
    return stale


def lab_with_answers(lab: str, answers: dict) -> "nbformat.NotebookNode":
    """The generated lab of `lab` with `answers` in some regions and stubs in the others: what a learner
    who wrote exactly these answers has (for the grader tests)."""
    path = notebook_path(lab)
    nb = fill_regions(read(path), path.name, answers, stubs=True)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    return nb


def write_exports() -> list[Path]:
    """build/export/<lab>.py for every lab with exported cells (for learners and instructors to import)."""
    written = []
    for path in solution_notebooks():
        if any(EXPORT_TAG in c.metadata.get("tags", []) for c in read(path).cells):
            written.append(state.write_text_atomic(export_dir() / f"{path.stem}.py", export_source(path.stem)))
    return written
