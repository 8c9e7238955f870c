"""The learner's work/ (utils/machinery/learner.py): a solved, saved copy survives `make labs`; a course update is
merged into it (answer kept, backup written) or, untouched, replaced; a conflict leaves it as it was; `make test`
never reads work/; `make progress` says "N of M", in numeric order, passed / failed / not done / changed."""
import errno
import json
import os
import re
import shutil
import stat
from pathlib import Path

import nbformat
import pytest

from conftest import ROOT
from utils import exercises, solutions
from utils.graders import lab00 as graders
from utils.machinery import labs as course_labs
from utils.machinery import learner

LAB00, LAB01 = "00_environment.ipynb", "01_vector_add.ipynb"


def region_code(lab: str) -> dict[str, str]:
    """{exercise: the solution's code in its region} of `lab`."""
    nb = solutions.read(solutions.notebook_path(lab))
    return {r.exercise: "\n".join(nb.cells[r.cell].source.split("\n")[r.begin + 1:r.end])
            for r in solutions.regions(nb)}


def answer_in(path: Path, exercise: str, code: str) -> None:
    """Write `code` over exercise's stub in the notebook at `path` and save it, as a learner does in JupyterLab
    (with an output and an execution count)."""
    nb = nbformat.read(path, as_version=4)
    cell = next(c for c in nb.cells if f"exercise not done: {exercise}," in c.source)
    cell.source = "\n".join(f"{line[:len(line) - len(line.lstrip())]}{code}" if f"exercise not done: {exercise},"
                            in line else line for line in cell.source.split("\n"))
    cell.execution_count = 3
    cell.outputs = [nbformat.v4.new_output("stream", text="ran\n")]
    nbformat.write(nb, path)


def course_update(path: Path, words: str) -> None:
    """A course update of the labs/ notebook at `path`: its first cell's text changes and a cell is added."""
    nb = nbformat.read(path, as_version=4)
    nb.cells[0].source += f"\n\n{words}"
    nb.cells.append(nbformat.v4.new_markdown_cell(f"A new closing note: {words}"))
    path.write_text(nbformat.writes(nb) + "\n")


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    """A checkout-like folder: labs/ (lab 00 and 01, as generated) and work/, made by `workspace`; `make labs`
    (labs.write_labs) pointed at its labs/."""
    (tmp_path / "labs").mkdir()
    for name in (LAB00, LAB01):
        shutil.copyfile(solutions.LABS / name, tmp_path / "labs" / name)
    monkeypatch.setattr(course_labs, "LABS", tmp_path / "labs")
    lines, ok = learner.workspace(tmp_path / "labs", tmp_path / "work")
    assert ok and lines == [f"{tmp_path / 'work' / n}: made from {tmp_path / 'labs' / n}" for n in (LAB00, LAB01)]
    return tmp_path / "labs", tmp_path / "work"


@pytest.fixture
def make(checkout, monkeypatch, capsys):
    """`make workspace` / `make update` (learner.main) on the checkout's labs/ and work/: (exit status, what it
    printed, stdout and stderr together)."""
    labs, work = checkout
    monkeypatch.setattr(learner, "WORK", work)
    monkeypatch.setattr(solutions, "LABS", labs)

    def run(cmd):
        status = learner.main([cmd])
        out = capsys.readouterr()
        return status, out.out + out.err
    return run


def full_disk(monkeypatch, times=None):
    """work/'s disk is full as each file is flushed (the first `times` flushes only, if given)."""
    fsync, calls = os.fsync, []

    def full(fd):
        calls.append(fd)
        if times is not None and len(calls) > times:
            return fsync(fd)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)


def test_a_solved_saved_copy_survives_make_labs_and_workspace(checkout):
    labs, work = checkout
    answer = region_code("00")["0.1"].strip()
    answer_in(work / LAB00, "0.1", answer)
    (work / "my_notes.ipynb").write_text((work / LAB00).read_text())
    saved = (work / LAB00).read_bytes()
    (labs / LAB00).write_text("stale")       # labs/ out of date: `make labs` rewrites it
    course_labs.write_labs()
    assert (labs / LAB00).read_text() == course_labs.lab_text(solutions.notebook_path("00"))
    assert (work / LAB00).read_bytes() == saved and (work / "my_notes.ipynb").exists()
    assert answer in (work / LAB00).read_text()
    # labs/ regenerated as the course shipped it: `workspace` copies the labs work/ lacks, leaves lab 00 alone
    said, ok = learner.workspace(labs, work)
    assert ok and not [line for line in said if LAB00 in line] and (work / LAB00).read_bytes() == saved
    assert len(said) == len(solutions.solution_notebooks()) - 2 and all(": made from " in line for line in said)


def test_work_is_private_and_its_copies_whole(checkout, monkeypatch):
    """work/ is 0700 (a second local user reads no answers; a looser work/ of ours is tightened), and a copy that
    fails (a full disk) leaves no half-written notebook behind."""
    labs, work = checkout
    assert stat.S_IMODE(work.stat().st_mode) == 0o700
    work.chmod(0o755)
    (work / LAB01).unlink()

    full_disk(monkeypatch)                          # the disk fills as the copy is flushed
    said, ok = learner.workspace(labs, work)
    monkeypatch.undo()
    assert not ok and said[0].startswith(f"{work / LAB01}: not made: cannot write") and "No space left" in said[0]
    assert stat.S_IMODE(work.stat().st_mode) == 0o700
    assert not (work / LAB01).exists() and not list(work.rglob(".*.tmp"))
    assert learner.workspace(labs, work) == ([f"{work / LAB01}: made from {labs / LAB01}"], True)


def test_workspace_on_a_full_disk_names_the_file_says_what_to_do_and_copies_the_others(make, checkout, monkeypatch):
    """work/'s disk is full as `make workspace` copies lab 00: a line naming it and the fix that fits work/ (not
    COURSE_BUILD_DIR, which does not move work/), lab 01 still copied, a non-zero exit, no traceback; work/ itself
    cannot be made: `make workspace stopped`, with the same fix."""
    labs, work = checkout
    (work / LAB00).unlink()
    (work / LAB01).unlink()
    full_disk(monkeypatch, times=1)
    status, said = make("workspace")
    line = next(line for line in said.splitlines() if LAB00 in line)
    assert status == 1 and "Traceback" not in said and line.startswith(f"{work / LAB00}: not made: cannot write ")
    assert "its disk is full" in line and "free some space on that disk" in line and "COURSE_BUILD_DIR" not in said
    assert "the course's in labs/ are as they were" in line
    assert not (work / LAB00).exists() and (work / LAB01).read_bytes() == (labs / LAB01).read_bytes()
    assert f"{work / LAB01}: made from {labs / LAB01}" in said and "Next:" not in said

    shutil.rmtree(work)
    mkdir = os.mkdir

    def full(path, *args):
        if Path(path) == work:
            raise OSError(errno.ENOSPC, "No space left on device")
        return mkdir(path, *args)

    monkeypatch.setattr(os, "mkdir", full)
    status, said = make("workspace")
    assert status == 1 and said.startswith(f"make workspace stopped: cannot write {work}: its disk is full")
    assert "free some space on that disk" in said and "COURSE_BUILD_DIR" not in said and "Traceback" not in said


@pytest.mark.parametrize("broken", [b'{"cells": [', b"[]", b'{"nbformat": 4, "nbformat_minor": 5}'],
                         ids=["truncated", "not a notebook", "no cells"])
def test_workspace_names_a_broken_copy_with_the_fix(make, checkout, broken):
    """A copy in work/ that cannot be read as a notebook is named by `make workspace`, with the fix `make progress`
    and `make update` give; it is left as it was, and the other lab is still made."""
    labs, work = checkout
    (work / LAB00).write_bytes(broken)
    (work / LAB01).unlink()
    status, said = make("workspace")
    line = next(line for line in said.splitlines() if LAB00 in line)
    assert status == 0 and line.startswith(f"{work / LAB00} cannot be read as a notebook (")
    assert f"restore it from {work / '.backup'} or rename it and run `make workspace`" in line
    assert (work / LAB00).read_bytes() == broken and f"{work / LAB01}: made from {labs / LAB01}" in said


def test_workspace_says_what_to_do_next_and_update_to_close_the_notebooks_first(make, checkout):
    labs, work = checkout
    status, said = make("workspace")
    assert status == 0 and said.splitlines() == [
        f"{work}: your copy of every lab, up to date with {labs}",
        f"Next: open {work / LAB00} in JupyterLab (`make lab` opens it)"]
    course_update(labs / LAB01, "updated in lab 01")
    status, said = make("workspace")
    assert status == 0 and said.splitlines()[-1].endswith("; `make update` merges the newer course versions named above")
    status, said = make("update")
    assert status == 0 and f"{work / LAB01}: replaced by the course's new version" in said
    assert said.splitlines()[-1] == learner.CLOSE_FIRST and "Close your notebooks in JupyterLab before `make update`" \
        in learner.CLOSE_FIRST and "saved over the merged file" in learner.CLOSE_FIRST
    status, said = make("update")                 # nothing to merge: no reminder
    assert status == 0 and said.strip() == f"{work}: up to date with {labs}"


def test_update_merges_a_course_change_into_the_answer_and_replaces_an_untouched_copy(checkout):
    labs, work = checkout
    answer = region_code("00")["0.1"].strip()
    answer_in(work / LAB00, "0.1", answer)
    course_update(labs / LAB00, "updated in lab 00")
    course_update(labs / LAB01, "updated in lab 01")
    said, ok = learner.workspace(labs, work)
    assert ok and f"{labs / LAB00} is newer than your {work / LAB00}: `make update` merges it" in said
    assert learner.newer(labs, work) == [LAB00, LAB01]

    lines, ok = learner.update(labs, work)
    assert ok, lines
    merged = nbformat.read(work / LAB00, as_version=4)
    text = "\n".join(c.source for c in merged.cells)
    assert answer in text and "exercise not done: 0.1," not in text           # the learner's answer
    assert "updated in lab 00" in merged.cells[0].source                     # the course's change
    assert merged.cells[-1].source == "A new closing note: updated in lab 00"
    assert any(c.get("outputs") for c in merged.cells if c.cell_type == "code")   # the learner's outputs
    backups = list((work / ".backup").glob("00_environment-*.ipynb"))
    assert len(backups) == 1 and "exercise not done: 0.1," not in backups[0].read_text()
    assert (work / LAB01).read_bytes() == (labs / LAB01).read_bytes()         # untouched: replaced
    assert not list((work / ".backup").glob("01_*"))
    assert any("replaced by the course's new version" in line for line in lines)
    assert learner.newer(labs, work) == [] and learner.update(labs, work) == ([], True)


def test_a_conflicting_update_leaves_the_learners_notebook_as_it_was(checkout):
    labs, work = checkout
    answer_in(work / LAB00, "0.1", "return 2 * m * n * k")
    answer_in(labs / LAB00, "0.1", "raise NotImplementedError('the course changed this line')")
    mine = (work / LAB00).read_bytes()
    lines, ok = learner.update(labs, work)
    assert not ok and (work / LAB00).read_bytes() == mine
    attempt = work / "00_environment.merged.ipynb"
    assert attempt.exists() and "<<<<<<< local" in attempt.read_text()
    assert any("conflict" in line and str(attempt) in line for line in lines), lines
    assert learner.newer(labs, work) == [LAB00]                               # still to merge


def test_make_test_never_reads_work():
    """The learner's work/ is theirs: no test reads the checkout's work/ (they use a temporary one)."""
    for path in sorted((ROOT / "tests").glob("*.py")):
        source = path.read_text()
        assert "learner." + "WORK" not in source and not re.search(r"ROOT\s*/\s*[\"']work[\"']", source), path.name
    assert "work" not in (ROOT / "Makefile").read_text().split("\ntest:")[1].split("\n\n")[0]


def test_progress_says_n_of_m_in_numeric_order_with_each_state(build_dir, tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)                   # verdicts are recorded per folder the notebook runs in: work
    right = region_code("00")
    answers = {"0.1": right["0.1"], "0.2": "return 0", "0.3": right["0.3"]}
    mine = solutions.load("00", answers=answers)
    lab = exercises.Lab("00_environment")
    assert lab.grade("0.1", "count", graders.check_matmul_flops, mine.matmul_flops)
    with pytest.raises(exercises.ExerciseFailed):
        lab.grade("0.2", "bytes", graders.check_add_bytes, mine.add_bytes)
    rate = mine.rate
    assert lab.grade("0.3", "rate", lambda: graders.check_rate(rate))      # a lambda grades what it calls
    exercises.Lab("05_llm_serving").grade("5.5", "paged", lambda: None)
    # the saved notebook: 0.1 and 0.2 as graded, 0.3 edited since
    edited = dict(answers, **{"0.3": right["0.3"] + "  # tried something"})
    nbformat.write(course_labs.lab_with_answers("00", edited), work / LAB00)

    table = learner.progress_table(work=work)
    lines = table.split("\n")
    total = sum(len(solutions.exercises(solutions.read(p))) for p in solutions.solution_notebooks())
    assert lines[0] == f"2 of {total} exercises done"
    rows = {line.split()[0]: line for line in lines[1:]}
    assert list(rows) == sorted(rows, key=lambda e: tuple(map(int, e.split("."))))
    assert list(rows).index("5.4") < list(rows).index("5.5") and len(rows) == total

    def state(ex):
        return next(s for s in ("changed since graded", "passed", "failed", "not done") if f"  {s}" in rows[ex])
    assert [state(e) for e in ("0.1", "0.2", "0.3", "0.4", "5.5")] == [
        "passed", "failed", "changed since graded", "not done", "passed"]
    assert "count a matmul's operations" in rows["0.1"] and rows["0.1"].endswith("00_environment.ipynb")
    assert "paged decode attention" in rows["5.5"] and rows["5.5"].rstrip().endswith("05_llm_serving.ipynb")


def test_wrong_shaped_progress_and_an_unreadable_copy_are_named_not_tracebacks(build_dir, tmp_path, monkeypatch):
    """A progress file of the wrong shape does not stop grading (its part starts again, the file named) nor
    `make progress`; a notebook in work/ that is not UTF-8 is named with the fix, and the other labs still count."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    exercises.progress_path().parent.mkdir(parents=True, exist_ok=True)
    exercises.progress_path().write_text(json.dumps({"work": ["not", "an", "object"], "labs": {"00_environment": 3}}))
    assert "of" in learner.progress_table(work=work).splitlines()[0]          # read as no verdicts
    with pytest.warns(UserWarning, match=r"progress.json: its 'work' entry is not a JSON object"):
        assert exercises.Lab("00_environment").grade("0.1", "count", lambda: None)
    saved = json.loads(exercises.progress_path().read_text())
    assert saved["work"]["00_environment"]["0.1"]["status"] == "passed" and saved["labs"] == {"00_environment": 3}
    (work / LAB01).write_bytes(b"\xff\xfe not a notebook")
    lines = learner.progress_table(work=work).splitlines()
    assert any(LAB01 in line and "cannot be read as a notebook" in line and "make workspace" in line for line in lines)
    assert any(line.startswith("1 of ") for line in lines)


@pytest.mark.parametrize("fault", ["missing base", "unreadable copy", "dangling backup link"])
def test_an_update_that_cannot_merge_one_lab_names_it_and_updates_the_others(checkout, fault):
    labs, work = checkout
    answer_in(work / LAB00, "0.1", region_code("00")["0.1"].strip())
    answer_in(work / LAB01, "1.1", "return 0")
    course_update(labs / LAB00, "updated in lab 00")
    course_update(labs / LAB01, "updated in lab 01")
    if fault == "missing base":
        (work / ".course" / LAB00).unlink()
        words = "merge base"
    elif fault == "unreadable copy":
        (work / LAB00).write_bytes(b"\xff\xfe not a notebook")
        words = "cannot be read as a notebook"
    else:
        (work / ".backup").symlink_to(work / "gone")
        words = "is a link"
    lines, ok = learner.update(labs, work)
    assert not ok and any(LAB00 in line and words in line for line in lines), lines
    if fault != "dangling backup link":      # the other lab is merged; with no backup folder nothing is
        assert any(LAB01 in line and "merged" in line for line in lines), lines
        assert "updated in lab 01" in (work / LAB01).read_text()


def test_update_on_a_full_disk_leaves_no_empty_backup_and_says_what_to_do(checkout, monkeypatch):
    """work/'s disk fills during `make update`: no 0-byte backup to "restore" from, the learner's notebook as it was,
    a message naming the file and the fix (not COURSE_BUILD_DIR, which does not move work/); then it works."""
    labs, work = checkout
    answer_in(work / LAB00, "0.1", region_code("00")["0.1"].strip())
    mine = (work / LAB00).read_bytes()
    course_update(labs / LAB00, "updated in lab 00")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    said, ok = learner.update(labs, work)
    monkeypatch.undo()
    line = next(line for line in said if LAB00 in line)
    assert not ok and "not updated, your notebook is as it was" in line and "its disk is full" in line
    assert "free some space on that disk" in line and "COURSE_BUILD_DIR" not in line
    assert (work / LAB00).read_bytes() == mine
    assert not list((work / ".backup").glob("*")) and not list(work.rglob(".*.tmp"))
    said, ok = learner.update(labs, work)
    assert ok and any(f"{work / LAB00}: merged" in line for line in said)
