"""The learner's own copy of the labs, work/: made from labs/, never overwritten, merged with course updates; progress.

    python -m utils.machinery.learner [workspace]       copy each lab missing from work/; say which have a newer course version
    python -m utils.machinery.learner update            merge each newer course version into work/ (a backup first)
    python -m utils.machinery.learner progress [--run]  "N of M exercises done", each exercise's state and file

labs/ is generated from solutions/ and tracked; a learner's answers live in work/ (git-ignored), which no course
command overwrites: `make labs` writes labs/ only. Each notebook copied into work/ keeps the course version it
started from in work/.course/<name>.ipynb (its hash in work/.course/versions.json), the base of a 3-way merge:
`update` replaces a notebook the learner never changed and merges the others with nbdime, after a backup in
work/.backup/; a merge with conflicts leaves the learner's notebook as it was and writes the attempt beside it.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import os
import re
import sys
from pathlib import Path

import nbformat

from utils import exercises, solutions
from utils.base import state
from utils.base.paths import REPO_ROOT, build_dir, private_dir, run_environment

WORK = REPO_ROOT / "work"
# what to do when work/'s disk is full or read-only (COURSE_BUILD_DIR does not move work/); state.storage_errors
# ends the message with ", and run again"
WORK_FULL = "free some space on that disk (your notebooks in work/ and the course's in labs/ are as they were)"
# JupyterLab saves an open notebook over the file on disk (autosave; it asks first, "File Changed", when it sees
# that the file on disk is newer: "Overwrite" writes the open copy over the merge)
CLOSE_FIRST = ("Close your notebooks in JupyterLab before `make update`: one still open there can be saved over the "
               "merged file (if one was open: File > Reload Notebook from Disk; if JupyterLab says \"File Changed\", "
               "choose \"Revert\")")
CELL_TIMEOUT = 1800   # seconds one cell may run under `progress --run` (as the harness's runs)
STATES = ("passed", "failed", "not done", "changed since graded")
_GRADE = re.compile(r"""ex\.grade\(\s*["'](?P<id>\d+\.\d+)["']\s*,\s*(?:"(?P<title>[^"]*)"|'(?P<title1>[^']*)')""")


def _hash(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _base(work: Path, name: str) -> Path:
    return work / ".course" / name


def _versions_path(work: Path) -> Path:
    return work / ".course" / "versions.json"


def _versions(work: Path) -> dict:
    return state.read_json(_versions_path(work), {}, what="work/.course/versions.json", shape=dict) or {}


def _set_base(work: Path, name: str, course: Path) -> None:
    """Record `course` (a labs/ notebook) as the course version work/<name> now stands on."""
    state.write_text_atomic(_base(work, name), course.read_text(), fix=WORK_FULL)

    def change(data):
        data = data if isinstance(data, dict) else {}
        data[name] = _hash(course)
        return data

    state.update_json(_versions_path(work), change, {}, what="work/.course/versions.json", fix=WORK_FULL)


def _course_notebooks(labs: Path) -> list[Path]:
    return sorted(p for p in Path(labs).glob("*.ipynb") if not p.name.startswith("."))


def newer(labs: Path = solutions.LABS, work: Path = WORK) -> list[str]:
    """Names of the notebooks whose course version in labs/ changed since the learner's copy was made."""
    versions = _versions(work)
    return [p.name for p in _course_notebooks(labs)
            if (work / p.name).exists() and versions.get(p.name) and versions[p.name] != _hash(p)]


def workspace(labs: Path = solutions.LABS, work: Path = WORK) -> tuple[list[str], bool]:
    """Copy each notebook of labs/ that work/ lacks (recording its base); never touch one that exists. Returns
    (what it did, with each copy that cannot be read as a notebook and, per notebook, whether the course has a newer
    version; whether every missing copy was made: one a full disk stops is named, the others are still made)."""
    lines, ok = [], True
    with state.storage_errors(work, WORK_FULL):
        private_dir(work)                # 0700: another local user reads no learner's answers
    versions = _versions(work)
    for course in _course_notebooks(labs):
        mine = work / course.name
        if not mine.exists():
            try:
                _set_base(work, course.name, course)     # the record first: a copy in work/ always has one
                state.write_text_atomic(mine, course.read_text(), fix=WORK_FULL)   # whole or not at all
            except state.StorageError as err:
                ok = False
                lines.append(f"{_rel(mine)}: not made: {err}")
                continue
            lines.append(f"{_rel(mine)}: made from {_rel(course)}")
        elif unreadable := _read(mine, work)[1]:    # named with its fix (as `make progress` and `make update` do)
            lines.append(unreadable)
        elif course.name not in versions:
            if _hash(mine) == _hash(course):
                _set_base(work, course.name, course)
            else:
                lines.append(f"{_rel(mine)} has no record of the course version it came from: `make update` cannot "
                             f"merge {_rel(course)} into it (rename it, run `make workspace`, copy your answers over)")
    for name in newer(labs, work):
        lines.append(f"{_rel(labs / name)} is newer than your {_rel(work / name)}: `make update` merges it")
    return lines, ok


def next_step(labs: Path = solutions.LABS, work: Path = WORK) -> str:
    """What `make workspace` tells the learner to do next."""
    first = work / _course_notebooks(labs)[0].name
    update = "; `make update` merges the newer course versions named above" if newer(labs, work) else ""
    return f"Next: open {_rel(first)} in JupyterLab (`make lab` opens it){update}"


def update(labs: Path = solutions.LABS, work: Path = WORK) -> tuple[list[str], bool]:
    """Bring each newer course version into work/: a notebook the learner never changed is replaced; the others
    are merged (nbdime, 3-way, base = the version they started from) after a backup in work/.backup/. A merge
    with conflicts leaves the learner's notebook as it was and writes the attempt beside it. Returns (what it did,
    whether every notebook is up to date)."""
    try:
        from nbdime.merging import merge_notebooks   # optional: only `make update` needs it (pyproject's lab extra)
    except ImportError:
        return ["`make update` merges with nbdime, which is not installed: pip install -c constraints.txt nbdime"], False

    lines, ok = workspace(labs, work)
    todo = newer(labs, work)             # what workspace said about these, the lines below say instead
    lines = [line for line in lines if not any(_rel(work / name) in line for name in todo)]
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    for name in todo:
        course, mine, base = labs / name, work / name, _base(work, name)
        blocked = _update_blocked(work, mine, base)
        if blocked:                      # named with its fix; the other notebooks are still updated
            ok = False
            lines.append(blocked)
            continue
        if _hash(mine) == _hash(base):
            state.write_text_atomic(mine, course.read_text())
            _set_base(work, name, course)
            lines.append(f"{_rel(mine)}: replaced by the course's new version (you had not changed it)")
            continue
        backup = work / ".backup" / f"{Path(name).stem}-{stamp}.ipynb"
        try:                             # whole or not at all: a full disk leaves no empty backup to restore from
            state.write_text_atomic(backup, mine.read_text(), fix=WORK_FULL)
        except state.StorageError as err:
            ok = False
            lines.append(f"{_rel(mine)}: not updated, your notebook is as it was: {err}")
            continue
        read = [nbformat.read(p, as_version=solutions.NB_VERSION) for p in (base, mine, course)]
        merged, decisions = merge_notebooks(*read)
        conflicts = _conflicts(merged, decisions)
        if conflicts:
            attempt = work / f"{Path(name).stem}.merged.ipynb"
            state.write_text_atomic(attempt, _text(merged))
            ok = False
            lines.append(f"{_rel(mine)}: the course's changes conflict with yours at {', '.join(conflicts)}; your "
                         f"notebook is as it was. The merged attempt is {_rel(attempt)} (conflicts between "
                         f"'<<<<<<< local' and '>>>>>>> remote'): fix those cells, save it as {_rel(mine)}, run "
                         "`make update` again; or keep yours and copy the course's changes by hand")
            continue
        try:
            state.write_text_atomic(mine, _text(merged), fix=WORK_FULL)
        except state.StorageError as err:
            ok = False
            lines.append(f"{_rel(mine)}: not updated, your notebook is as it was (a copy: {_rel(backup)}): {err}")
            continue
        _set_base(work, name, course)
        lines.append(f"{_rel(mine)}: merged the course's new version into your answers (yours before: {_rel(backup)})")
    return lines, ok


def _update_blocked(work: Path, mine: Path, base: Path) -> str | None:
    """Why `make update` cannot merge into `mine` (a missing merge base, a notebook that cannot be read, a broken
    work/.backup), as a line naming the file and the fix; None when it can."""
    if not base.is_file():
        return (f"{_rel(mine)}: its merge base {_rel(base)} is missing, so `make update` cannot merge the course's new "
                f"version into it; rename your copy, run `make workspace` for a fresh one, and copy your answers over")
    backups = work / ".backup"
    if backups.is_symlink() or (backups.exists() and not backups.is_dir()):
        return (f"{_rel(mine)}: not updated: {_rel(backups)} is {'a link' if backups.is_symlink() else 'not a folder'},"
                f" where `make update` keeps your notebooks before a merge; remove it and run `make update` again")
    for path in (mine, base):
        unreadable = _read(path, work)[1]
        if unreadable:
            return f"{_rel(mine)}: not updated: {unreadable}"
    return None


def _read(path: Path, work: Path) -> tuple[nbformat.NotebookNode | None, str | None]:
    """(the notebook at `path`, None), or (None, a line naming it and the fix) when it cannot be read as one:
    not UTF-8, cut short, not JSON, not a notebook."""
    try:
        return nbformat.read(path, as_version=solutions.NB_VERSION), None
    except (OSError, ValueError, AttributeError, nbformat.ValidationError) as exc:
        return None, (f"{_rel(path)} cannot be read as a notebook ({type(exc).__name__}: {str(exc)[:120]}): restore "
                      f"it from {_rel(work / '.backup')} or rename it and run `make workspace` for a fresh copy")


def _conflicts(merged, decisions) -> list[str]:
    """Where a merge left something unresolved: a conflict nbdime did not settle by applying both sides, a cell
    with conflict markers, or nbdime's record of conflicts in the metadata."""
    both = ("local_then_remote", "remote_then_local")
    where = {"/".join(map(str, d.common_path)) for d in decisions if d.conflict and d.action not in both}
    where |= {f"cells/{i}" for i, cell in enumerate(merged.cells) if "<<<<<<< local" in cell.source
              or "nbdime-conflicts" in cell.get("metadata", {})}
    if "nbdime-conflicts" in merged.metadata:
        where.add("metadata")
    return sorted(where)


def _text(nb) -> str:
    return nbformat.writes(nbformat.from_dict(nb)) + "\n"


def _rel(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


# --- progress -------------------------------------------------------------------------------------

def _number(exercise: str) -> tuple[int, ...]:
    return tuple(int(part) for part in exercise.split("."))


def _titles(nb) -> dict[str, str]:
    """{exercise id: the title its ex.grade line gives} in a notebook."""
    return {m["id"]: m["title"] if m["title"] is not None else m["title1"]
            for cell in nb.cells if cell.cell_type == "code" for m in _GRADE.finditer(cell.source)}


def _short(text: str, width: int = 50) -> str:
    return text if len(text) <= width else text[: width - 1].rstrip() + "…"


def changed_since_graded(recorded: dict, functions: list[str], notebook) -> bool:
    """Whether the learner's notebook holds, for one of the exercise's functions (those holding its regions,
    else any the verdict recorded), a source other than the one graded (`recorded`: {name: source hash})."""
    if not recorded or notebook is None:
        return False
    cells = [c.source for c in notebook.cells if c.cell_type == "code"]
    names = [n for n in functions if n in recorded] or list(recorded)
    for name in names:
        now = {exercises.source_hash(s) for text in cells for s in exercises.function_sources(text, name)}
        if (now or name in functions) and recorded[name] not in now:
            return True
    return False


def run_work(work: Path = WORK, cell_timeout: float = CELL_TIMEOUT) -> list[str]:
    """Execute the learner's notebooks (work/) into build/progress-runs/, in work/ (so their verdicts are
    recorded as work's); the learner's own files are not written."""
    import papermill as pm   # heavy: only `make progress RUN=1` executes notebooks

    os.environ.update(run_environment())
    out_dir = build_dir() / "progress-runs"
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for nb in sorted(work.glob("*.ipynb")):
        if nb.name.endswith(".merged.ipynb"):
            continue
        try:
            pm.execute_notebook(str(nb), str(out_dir / nb.name), cwd=str(work), kernel_name="python3",
                                progress_bar=False, execution_timeout=cell_timeout)
        except Exception as exc:   # a wrong answer stops its lab: its verdict is already recorded
            ename = getattr(exc, "ename", None) or type(exc).__name__
            lines.append(f"{nb.stem}: stopped at {ename}: {str(getattr(exc, 'evalue', exc)).strip()[:200]}")
    return lines


def _object(value) -> dict:
    """`value` if it is a JSON object, else {} (a progress file of the wrong shape reads as no verdicts)."""
    return value if isinstance(value, dict) else {}


def progress_table(run: bool = False, work: Path = WORK, cell_timeout: float = CELL_TIMEOUT) -> str:
    """"N of M exercises done", then each exercise in numeric order: its short title, its state (passed,
    failed, not done, changed since graded) and the learner's file to open. `run`: execute work/ first."""
    head = []
    if run:
        head = run_work(work, cell_timeout)
    seen = state.read_json(exercises.progress_path(), {}, what="progress file", shape=dict) or {}
    verdicts = _object(seen.get(work.name))
    rows = []
    for path in solutions.solution_notebooks():
        nb = solutions.read(path)
        todos, titles = solutions.exercises(nb, path.name), _titles(nb)
        functions = {}
        for region in solutions.regions(nb, path.name):
            functions.setdefault(region.exercise, []).append(region.function)
        mine = work / path.name
        learner, unreadable = _read(mine, work) if mine.exists() else (None, None)
        if unreadable:                           # named with its fix; the other labs go on
            head.append(unreadable)
        graded = _object(verdicts.get(path.stem))
        for ex_id, todo in todos.items():
            entry = _object(graded.get(ex_id))
            status = entry.get("status") if entry.get("status") in STATES else "not done"
            if status in ("passed", "failed") and changed_since_graded(entry.get("answer") or {},
                                                                      functions.get(ex_id, []), learner):
                status = "changed since graded"
            title = titles.get(ex_id) or entry.get("title") or _short(re.sub(r"^TODO\([^)]*\):?\s*", "", todo))
            speed = _object(graded.get(f"{ex_id} speed"))
            note = f" (speed target: {speed.get('status')})" if speed and status == "passed" else ""
            rows.append((_number(ex_id), ex_id, _short(title), status + note, _rel(mine)))
    rows.sort()
    done = sum(1 for row in rows if row[3].startswith("passed"))
    lines = head + [f"{done} of {len(rows)} exercises done"]
    if not work.is_dir():
        lines.append(f"({_rel(work)}/ does not exist yet: `make workspace` makes your copy of the labs there)")
    width = max(len(row[2]) for row in rows)
    state_width = max(len(row[3]) for row in rows)
    lines += [f"{ex_id:>4}  {title:<{width}}  {status:<{state_width}}  {file}" for _, ex_id, title, status, file in rows]
    return "\n".join(lines)


# --- command line ---------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m utils.machinery.learner", description=__doc__.split("\n")[0])
    ap.add_argument("cmd", nargs="?", default="workspace", choices=("workspace", "update", "progress"))
    ap.add_argument("--run", action="store_true", help="progress: execute your notebooks in work/ first")
    args = ap.parse_args(argv)
    if args.cmd == "progress":
        print(progress_table(run=args.run))
        return 0
    labs, work = solutions.LABS, WORK
    try:                                  # e.g. work/.course/ on a full disk: named, with what to do
        merging = args.cmd == "update" and newer(labs, work)     # then the reminder to close them in JupyterLab
        lines, ok = update(labs, work) if args.cmd == "update" else workspace(labs, work)
    except state.StorageError as err:
        print(f"make {args.cmd} stopped: {err}", file=sys.stderr)
        return 1
    if args.cmd == "update":
        print("\n".join(lines) if lines else f"{_rel(work)}: up to date with {_rel(labs)}")
        if merging:
            print(CLOSE_FIRST)
    else:
        print("\n".join(lines or [f"{_rel(work)}: your copy of every lab, up to date with {_rel(labs)}"]))
        if ok:
            print(next_step(labs, work))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
