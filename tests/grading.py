"""Helpers for the tests that run notebooks and grade answers (imported by the test modules)."""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from utils import grading_guard, solutions
from utils.exercises import ExerciseFailed
from utils.machinery import harness, labs


def errors(nb) -> list[tuple[str, str]]:
    """(name, value + traceback) of every error output of an executed notebook."""
    strip = lambda text: re.sub(r"\x1b\[[0-9;]*m", "", text)
    return [(o.ename, o.evalue + "\n" + strip("\n".join(o.get("traceback", []))))
            for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]


def stream_text(nb) -> str:
    """Everything the notebook printed (stdout streams), in order."""
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                   if o.output_type == "stream")


def run_notebook(notebook, tmp_path: Path, parameters: dict | None = None, **kwargs):
    """Execute a notebook (a path, or a NotebookNode written first) with papermill in the solutions'
    folder, with the course's notebook environment; returns the executed NotebookNode. Papermill's
    PapermillExecutionError propagates (the executed copy is still written)."""
    import os

    import papermill as pm

    if not isinstance(notebook, (str, Path)):
        path = tmp_path / "input.ipynb"
        nbformat.write(notebook, path)
        notebook = path
    out = tmp_path / Path(notebook).name
    env = harness.notebook_env()
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        pm.execute_notebook(str(notebook), str(out), parameters=parameters or {}, cwd=str(solutions.SOLUTIONS),
                            kernel_name="python3", progress_bar=False, execution_timeout=900, **kwargs)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return nbformat.read(out, 4)


def run_lab_with(lab: str, answers: dict, tmp_path: Path, parameters: dict | None = None):
    """The generated lab with `answers` substituted (stubs elsewhere), executed. Returns
    (executed notebook, (ename, evalue) of the error that stopped it, or None)."""
    import papermill as pm

    nb = labs.lab_with_answers(lab, answers)
    try:
        return run_notebook(nb, tmp_path, {"DEVICE": "cpu", **(parameters or {})}), None
    except pm.PapermillExecutionError as err:
        return nbformat.read(tmp_path / "input.ipynb", 4), (err.ename, err.evalue)


def compute_sanitizer():
    """compute-sanitizer (CUDA toolkit), or None."""
    found = shutil.which("compute-sanitizer") or sorted(glob.glob("/usr/local/cuda*/bin/compute-sanitizer"))
    return found if isinstance(found, str) else (found[-1] if found else None)


def run_under_memcheck(script, tmp_path):
    """`script` in a new Python under compute-sanitizer's memcheck, with PyTorch's caching allocator off (each
    tensor its own allocation, so an access past one is seen); its output, once memcheck found 0 errors."""
    import pytest
    import torch   # only the GPU tests call this

    tool = compute_sanitizer()
    if torch.version.hip or tool is None:
        pytest.skip("needs NVIDIA's compute-sanitizer (CUDA toolkit); ROCm's sanitizers are not wired in here")
    (tmp_path / "kernels.py").write_text(script)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTORCH_NO_CUDA_MEMORY_CACHING="1", PYTHONUNBUFFERED="1")
    run = subprocess.run([tool, "--tool", "memcheck", "--report-api-errors", "no", "--target-processes",
                          "application-only", sys.executable, str(tmp_path / "kernels.py")],
                         capture_output=True, text=True, env=env, timeout=480)
    out = run.stdout + run.stderr
    assert run.returncode == 0 and "ERROR SUMMARY: 0 errors" in out and "refused" in out, out[-6000:]
    return out


def replay(fn):
    """(recording, replaying), as a learner who kept the answers of an earlier grade would write them: `recording`
    answers as fn does and keeps each answer under its inputs (a tensor's or an array's by its shape); `replaying`
    answers from that table, with the last answer kept where it has none: a lookup table of the cases tried, or a
    result cached across grades (the other labs' tests use it too)."""
    table = {}
    key = lambda args, kwargs: repr([tuple(a.shape) if hasattr(a, "shape") else a for a in args]
                                    + sorted(kwargs.items()))

    def recording(*args, **kwargs):
        table[key(args, kwargs)] = out = fn(*args, **kwargs)
        return out

    def replaying(*args, **kwargs):
        return table.get(key(args, kwargs), list(table.values())[-1])
    return recording, replaying


def grades_afresh(checker, fn, monkeypatch, capsys, *extra):
    """What `checker` prints on a right answer, the same on every grade though each draws new inputs; an answer that
    replays the answers of an earlier grade fails. Two seeds fixed ($COURSE_GRADE_SEED) keep the test reproducible."""
    recording, replaying = replay(fn)
    monkeypatch.setenv(grading_guard.SEED_VAR, "1")
    checker(recording, *extra)
    printed = capsys.readouterr().out
    monkeypatch.setenv(grading_guard.SEED_VAR, "2")
    with pytest.raises(ExerciseFailed):
        checker(replaying, *extra)
    capsys.readouterr()
    checker(fn, *extra)
    assert capsys.readouterr().out == printed and "PASS" in printed
