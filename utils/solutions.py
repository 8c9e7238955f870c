"""The solution notebooks as code: their exercise regions, the labs made from them, their exported modules.

A solution marks what the learner writes, inside a function, under a TODO line that names the exercise:

    # TODO(3.2, about 8 lines): load the A and B tiles (masked on K), ...
    ### BEGIN SOLUTION
    ...the reference answer...
    ### END SOLUTION

`utils.machinery.labs.make_lab()` turns a solution into the learner's lab: each region becomes a stub that keeps the notebook
runnable. In a plain function the stub raises `NotImplementedError("exercise not done: ...")`; inside a
`@triton.jit` function it is `pass  # exercise not done: ...`, so the kernel still compiles and the lab's
wrapper asks `utils.exercises.unfinished(kernel)` instead. Outputs are cleared.

Cells tagged `export` hold a lab's public kernels and wrappers. `load(lab)` writes them to
`build/export/<lab>.py` and imports it, so tests (and a lab whose exercise is unfinished) reach the
reference code without copying it; `load(lab, answers={"3.2": code})` substitutes other answers into the
regions first, `load(lab, stubs=True)` gives the learner's unfinished version.
"""
from __future__ import annotations

import hashlib
import importlib.util
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import nbformat

from utils.base import state
from utils.base.paths import LABS_DIR, SOLUTIONS_DIR, build_dir

SOLUTIONS, LABS = SOLUTIONS_DIR, LABS_DIR    # solutions/ (the single source) and labs/ (made from it)
NB_VERSION = 4
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
EXPORT_TAG = "export"
_TODO = re.compile(r"#\s*TODO\((?P<id>\d+\.\d+)\b[^)]*\)")
_DEF = re.compile(r"^(?P<indent>\s*)(async\s+)?def\s+(?P<name>\w+)")
EXERCISE_NOT_DONE = "exercise not done"
STUB = f'raise NotImplementedError("{EXERCISE_NOT_DONE}: replace this line with your code, then re-run the cell")'


def stub(exercise: str, *, triton: bool = False) -> str:
    """The line that stands for an unfinished exercise: a no-op inside a Triton kernel (which must still
    compile), a raise elsewhere."""
    where = f"{EXERCISE_NOT_DONE}: {exercise}, replace this line with your code"
    if triton:
        return f"pass  # {where}"
    return f'raise NotImplementedError("{where}, then re-run the cell")'


class RegionError(ValueError):
    """A solution's exercise markers are malformed (the message names the notebook and cell)."""


@dataclass(frozen=True)
class Region:
    exercise: str        # "3.2"
    cell: int            # index of the cell
    begin: int           # line index of BEGIN in the cell
    end: int             # line index of END
    indent: str
    function: str        # the function the region is in
    triton: bool         # inside a @triton.jit function


def solution_notebooks(folder: Path = SOLUTIONS) -> list[Path]:
    return sorted(p for p in Path(folder).glob("*.ipynb") if not p.name.startswith("."))


def notebook_path(lab: str) -> Path:
    """The solution notebook of `lab`: its stem ("03_bf16_matmul") or number ("03", "3")."""
    for path in solution_notebooks():
        number = path.stem.split("_", 1)[0]
        if lab in (path.stem, number) or (lab.isdigit() and int(lab) == int(number)):
            return path
    raise ValueError(f"no solution notebook for lab {lab!r}; there are: "
                     + ", ".join(p.stem for p in solution_notebooks()))


def read(path: Path):
    return nbformat.read(path, as_version=NB_VERSION)


def _enclosing_function(lines: list[str], begin: int, indent: str) -> tuple[str, bool]:
    for i in range(begin - 1, -1, -1):
        m = _DEF.match(lines[i])
        if m and len(m.group("indent")) < len(indent):
            decorators = []
            j = i - 1
            while j >= 0 and lines[j].strip().startswith("@"):
                decorators.append(lines[j].strip())
                j -= 1
            return m.group("name"), any("triton.jit" in d or d == "@jit" for d in decorators)
    return "", False


def regions(nb, name: str = "notebook") -> list[Region]:
    """Every exercise region of a solution notebook, in order. Raises RegionError if a marker is
    unpaired, has no TODO(<id>) line above it, or is not inside a function."""
    found = []
    for c, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or (BEGIN not in cell.source and END not in cell.source):
            continue
        lines = cell.source.split("\n")
        last_end = -1
        i = 0
        while i < len(lines):
            if lines[i].strip() == BEGIN:
                try:
                    j = next(k for k in range(i + 1, len(lines)) if lines[k].strip() in (BEGIN, END))
                except StopIteration:
                    raise RegionError(f"{name} cell {c}: {BEGIN} without {END}") from None
                if lines[j].strip() != END:
                    raise RegionError(f"{name} cell {c}: {BEGIN} inside another region")
                todo = [m for k in range(last_end + 1, i) if (m := _TODO.search(lines[k]))]
                if not todo:
                    raise RegionError(f"{name} cell {c}: the region at line {i + 1} has no '# TODO(<lab>.<n>, ...)' "
                                      "line above it naming its exercise")
                indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
                function, triton = _enclosing_function(lines, i, indent)
                if not function:
                    raise RegionError(f"{name} cell {c}: the region at line {i + 1} is not inside a function "
                                      "(a stub at the top of a cell would stop Run All)")
                found.append(Region(todo[-1].group("id"), c, i, j, indent, function, triton))
                last_end = i = j
            elif lines[i].strip() == END:
                raise RegionError(f"{name} cell {c}: {END} without {BEGIN}")
            i += 1
    return found


def exercises(nb, name: str = "notebook") -> dict[str, str]:
    """{exercise id: the text of its TODO line}, in order."""
    out = {}
    for r in regions(nb, name):
        lines = nb.cells[r.cell].source.split("\n")
        todo = next(line for line in reversed(lines[: r.begin]) if _TODO.search(line))
        out.setdefault(r.exercise, todo.strip().lstrip("#").strip())
    return out


def fill_regions(nb, name: str, answers: dict | None, stubs: bool):
    """A copy of `nb` whose regions hold `answers[id]` (a string, or a list for an exercise of several
    regions), else the stub (stubs=True), else the solution, with the markers removed."""
    nb = nbformat.from_dict(nb)
    answers = dict(answers or {})
    per_cell: dict[int, list[Region]] = {}
    all_regions = regions(nb, name)
    for r in all_regions:
        per_cell.setdefault(r.cell, []).append(r)
    unknown = set(answers) - {r.exercise for r in all_regions}
    if unknown:
        raise ValueError(f"{name} has no exercise {sorted(unknown)}; it has {sorted({r.exercise for r in all_regions})}")
    used = {k: 0 for k in answers}
    for c, rs in per_cell.items():
        lines = nb.cells[c].source.split("\n")
        for r in reversed(rs):
            if r.exercise in answers:
                given = answers[r.exercise]
                code = given[-1 - used[r.exercise]] if isinstance(given, (list, tuple)) else given
                used[r.exercise] += 1
                body = textwrap.indent(textwrap.dedent(code).strip("\n"), r.indent).split("\n")
            elif stubs:
                body = [r.indent + stub(r.exercise, triton=r.triton)]
            else:
                body = lines[r.begin + 1:r.end]
            lines[r.begin:r.end + 1] = body
        nb.cells[c].source = "\n".join(lines)
    return nb


# --- exported modules ----------------------------------------------------------------------------

def export_source(lab: str, answers: dict | None = None, stubs: bool = False) -> str:
    """The Python source of `lab`'s cells tagged `export`, regions filled as `fill_regions` does."""
    path = notebook_path(lab)
    nb = fill_regions(read(path), path.name, answers, stubs)
    cells = [c for c in nb.cells if c.cell_type == "code" and EXPORT_TAG in c.metadata.get("tags", [])]
    if not cells:
        raise ValueError(f"{path.name} has no cell tagged {EXPORT_TAG!r}")
    header = (f'"""Generated from solutions/{path.name} (cells tagged {EXPORT_TAG!r}) by utils.solutions: '
              'do not edit; edit the notebook."""\n')
    body = "\n\n\n".join(_without_magics(c.source) for c in cells)
    return header + body + "\n"


def _without_magics(source: str) -> str:
    return "\n".join(line for line in source.split("\n") if not line.lstrip().startswith(("%", "!")))


def export_dir() -> Path:
    return build_dir() / "export"


def load(lab: str, answers: dict | None = None, stubs: bool = False):
    """Import `lab`'s exported cells as a module (written under build/export/ first; a real file, so
    that Triton and tracebacks can read the kernels' source). Each distinct set of answers is its own
    module, imported once per process."""
    source = export_source(lab, answers, stubs)
    stem = notebook_path(lab).stem
    digest = hashlib.sha256(source.encode()).hexdigest()[:12]
    name = f"course_export_{stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    path = export_dir() / f"{name}.py"
    if not path.exists() or path.read_text() != source:
        state.write_text_atomic(path, source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    module.__course_as_loaded__ = dict(vars(module))    # what a grade checks it against (utils.grading_guard)
    return module
