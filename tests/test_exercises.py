"""The exercise contract (utils.exercises) and the solution notebooks as code (utils.solutions): stubs that
keep a lab runnable, NOT DONE / PASS / a loud failure, the reference answer for later cells, progress."""
import json
import os
import re

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from utils import exercises, solutions
from utils.base.paths import REPO_ROOT
from utils.machinery import labs
from utils.exercises import ExerciseFailed, check


def notebook(*sources, tags=None):
    nb = new_notebook(cells=[new_code_cell(s, metadata={"tags": tags or []}) for s in sources])
    return nb


PY = '''def f(x):
    # TODO(9.1, 1 line): double x
    ### BEGIN SOLUTION
    return 2 * x
    ### END SOLUTION'''

KERNEL = '''import triton
import triton.language as tl


@triton.jit
def k(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    for i in range(0, 1):
        # TODO(9.2, 1 line): double x
        ### BEGIN SOLUTION
        x = x * 2
        ### END SOLUTION
    tl.store(x_ptr + offs, x, mask=offs < n)'''


def test_regions_are_found_with_their_exercise_and_kind():
    rs = solutions.regions(notebook(PY, KERNEL))
    assert [(r.exercise, r.function, r.triton) for r in rs] == [("9.1", "f", False), ("9.2", "k", True)]
    assert solutions.exercises(notebook(PY)) == {"9.1": "TODO(9.1, 1 line): double x"}


@pytest.mark.parametrize("source, message", [
    ("def f():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION", "no '# TODO"),
    ("def f():\n    # TODO(9.1): x\n    ### BEGIN SOLUTION\n    return 1", "without ### END SOLUTION"),
    ("# TODO(9.1): x\n### BEGIN SOLUTION\nx = 1\n### END SOLUTION", "not inside a function"),
    ("def f():\n    return 1\n    ### END SOLUTION", "without ### BEGIN SOLUTION"),
])
def test_malformed_regions_are_named(source, message):
    with pytest.raises(solutions.RegionError, match=message):
        solutions.regions(notebook(source), "x.ipynb")


def test_stubs_raise_in_python_and_compile_in_triton():
    nb = solutions.fill_regions(notebook(PY, KERNEL), "x", None, stubs=True)
    py, kernel = nb.cells[0].source, nb.cells[1].source
    assert "BEGIN SOLUTION" not in py + kernel and "TODO(9.1" in py and "TODO(9.2" in kernel
    assert 'raise NotImplementedError("exercise not done: 9.1' in py
    assert "pass  # exercise not done: 9.2" in kernel
    scope = {}
    exec(py, scope)
    with pytest.raises(NotImplementedError, match="exercise not done: 9.1"):
        scope["f"](1)


def test_answers_replace_regions_with_their_indentation():
    nb = solutions.fill_regions(notebook(PY, KERNEL), "x", {"9.1": "y = x + x\nreturn y", "9.2": "x = x + x"}, stubs=True)
    assert "    y = x + x\n    return y" in nb.cells[0].source
    assert "        x = x + x" in nb.cells[1].source
    with pytest.raises(ValueError, match=r"has no exercise \['9.9'\]"):
        solutions.fill_regions(notebook(PY), "x", {"9.9": "pass"}, stubs=True)


def test_grade_pass_not_done_and_wrong(build_dir, capsys):
    lab = exercises.Lab("99_demo")

    def check_double(f):
        exercises.check("f(3) == 6", f(3) == 6, "multiply by two")

    assert lab.grade("9.1", "double", check_double, lambda x: 2 * x) is True
    out = capsys.readouterr().out
    assert "PASS: f(3) == 6" in out and "PASS: exercise 9.1 (double)" in out

    def stub(x):
        raise NotImplementedError("exercise not done: 9.1, replace this line with your code, then re-run the cell")

    assert lab.grade("9.1", "double", check_double, stub) is False
    assert "NOT DONE: exercise 9.1 (double)" in capsys.readouterr().out
    with pytest.raises(ExerciseFailed, match=r"f\(3\) == 6: multiply by two"):
        lab.grade("9.1", "double", check_double, lambda x: x + 2)
    assert lab.status["9.1"] == "failed"
    # a finished, wrong answer renders as one line in IPython, with the hint
    try:
        lab.grade("9.1", "double", check_double, lambda x: 3 * x)
    except ExerciseFailed as err:
        assert err._render_traceback_() == ["ExerciseFailed: f(3) == 6: multiply by two"]


def test_a_kernel_that_still_holds_its_stub_is_not_done_without_running_it(build_dir, capsys, tmp_path):
    source = solutions.fill_regions(notebook(KERNEL), "x", None, stubs=True).cells[0].source
    path = tmp_path / "kern.py"
    path.write_text(source)
    import importlib.util

    spec = importlib.util.spec_from_file_location("kern_stub", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert exercises.unfinished(mod.k)
    ran = []
    assert exercises.Lab("99_demo").grade("9.2", "double in a kernel", lambda: ran.append(1), uses=[mod.k]) is False
    assert not ran and "NOT DONE: exercise 9.2" in capsys.readouterr().out


def test_answer_hands_the_reference_to_later_cells_when_not_done(build_dir, capsys):
    lab = exercises.Lab("00_environment")
    mine = lambda m, n, k: 0
    lab.status["0.1"] = "not done"
    got = lab.answer("0.1", mine, "matmul_flops")
    assert got is not mine and got(2, 3, 4) == 48
    out = capsys.readouterr().out
    assert "NOTE: exercise 0.1 is not done" in out and "course's reference `matmul_flops`" in out
    lab.status["0.1"] = "passed"
    assert lab.answer("0.1", mine, "matmul_flops") is mine


def test_speed_is_reported_never_asserted(build_dir, capsys):
    lab = exercises.Lab("99_demo")
    lab.titles["9.3"] = "faster"
    assert lab.speed("9.3", 2900.0, 3000.0, "GB/s") is False
    assert lab.speed("9.3", 3100.0, 3000.0, "GB/s") is True
    assert lab.speed("9.3", None, 3000.0, "GB/s", reason="the interpreter") is None
    out = capsys.readouterr().out
    assert "NOT met" in out and ": met" in out and "not measured here (the interpreter)" in out


def test_progress_is_recorded_per_folder(build_dir, tmp_path, monkeypatch):
    (tmp_path / "labs").mkdir()
    monkeypatch.chdir(tmp_path / "labs")
    lab = exercises.Lab("00_environment")
    lab.grade("0.1", "count", lambda: None)
    data = json.loads((build_dir / "progress.json").read_text())
    assert data["labs"]["00_environment"]["0.1"]["status"] == "passed"


def test_load_exports_modules_with_answers_and_stubs(build_dir):
    ref = solutions.load("00")
    assert ref.matmul_flops(2, 3, 4) == 48
    wrong = solutions.load("00_environment", answers={"0.1": "return m * n * k"})
    assert wrong.matmul_flops(2, 3, 4) == 24 and wrong is not ref
    assert solutions.load("00", answers={"0.1": "return m * n * k"}) is wrong       # imported once
    stub = solutions.load("0", stubs=True)
    with pytest.raises(NotImplementedError, match="exercise not done: 0.1"):
        stub.matmul_flops(1, 1, 1)
    assert os.path.basename(os.path.dirname(ref.__file__)) == "export"
    assert os.path.basename(ref.__file__).startswith("course_export_00_environment_")
    with pytest.raises(ValueError, match="no solution notebook for lab '42'"):
        solutions.load("42")


def test_lab_with_answers_is_the_generated_lab_plus_those_answers():
    nb = labs.lab_with_answers("00", {"0.2": "return 3 * n * itemsize"})
    text = "\n".join(c.source for c in nb.cells)
    assert "return 3 * n * itemsize" in text and 'raise NotImplementedError("exercise not done: 0.1' in text
    assert all(c.outputs == [] for c in nb.cells if c.cell_type == "code")
    assert isinstance(nb, nbformat.NotebookNode)


def test_an_exception_in_the_learners_code_is_a_hint_never_a_traceback(build_dir):
    lab = exercises.Lab("99_demo")

    def check_shape(f):
        check("f(ones(3)) has 3 elements", len(f([1, 1, 1])) == 3, "keep the input's shape")

    def slip(x):
        return x[5]                       # an index slip: IndexError inside the learner's code

    with pytest.raises(ExerciseFailed, match=r"exercise 9\.3 \(shape\): your code raised IndexError: list index "
                                             r"out of range.*check the shapes, dtypes and devices") as err:
        lab.grade("9.3", "shape", check_shape, slip)
    assert lab.status["9.3"] == "failed" and isinstance(err.value.__cause__, IndexError)


def test_a_kernel_answered_with_the_stub_line_left_beside_it_is_graded_not_called_not_done():
    """A right 1.2 with `pass  # exercise not done` left below it was NOT DONE ("write what you already wrote")."""
    nb = solutions.read(solutions.notebook_path("01"))
    region = next(r for r in solutions.regions(nb, "01") if r.exercise == "1.2")
    answer = "\n".join(nb.cells[region.cell].source.split("\n")[region.begin + 1:region.end])
    left = solutions.load("01", answers={"1.2": answer + "\n" + region.indent + solutions.stub("1.2", triton=True)})
    assert not exercises.unfinished(left.add_kernel)
    assert exercises.unfinished(solutions.load("01", stubs=True).add_kernel)
    commented = solutions.load("01", answers={"1.2": region.indent + "# I will do this later\n" + region.indent
                                              + solutions.stub("1.2", triton=True)})
    assert exercises.unfinished(commented.add_kernel)          # a comment is not an answer


# --- graded apart (utils.grading_guard): the answer cannot reach the course's answers, nor patch the graders -------

def _notebook_function(source: str, name: str, **globals_):
    """A function defined as a notebook cell defines it (its module is __main__), with `globals_` in its namespace."""
    namespace = {"__name__": "__main__", **globals_}
    exec(compile(source, "<cell>", "exec"), namespace)
    return namespace[name]


def _decode_q4_1():
    import numpy as np

    return _notebook_function(
        "def dequantize_q4_1(b):\n"
        "    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)\n"
        "    m = b[:, 2:4].copy().view(np.float16).astype(np.float32)\n"
        "    q = b[:, 4:]\n"
        "    w = np.concatenate([q & 15, q >> 4], axis=1).astype(np.float32)\n"
        "    return (w * d + m).astype(np.float32)\n", "dequantize_q4_1", np=np)


def test_an_answer_written_in_the_notebook_passes_apart(build_dir):
    from utils.graders.lab08 import check_dequantize_q4_1

    assert exercises.Lab("08_quantized_inference").grade("8.1", "Q4_1", check_dequantize_q4_1, _decode_q4_1())


@pytest.mark.parametrize("how", ["solutions.load", "ex.reference", "a reference kept from before"])
def test_an_answer_that_calls_the_course_reference_fails_and_is_not_recorded_as_passed(build_dir, how, capsys):
    from utils.graders.lab08 import check_dequantize_q4_1

    ex = exercises.Lab("08_quantized_inference")
    kept = solutions.load("08")                       # a learner's earlier cell: ref = ex.reference
    body = {"solutions.load": "solutions.load('08').dequantize_q4_1(b)", "ex.reference": "ex.reference.dequantize_q4_1(b)",
            "a reference kept from before": "kept.dequantize_q4_1(b)"}[how]
    cheat = _notebook_function(f"def dequantize_q4_1(b):\n    return {body}\n", "dequantize_q4_1",
                               solutions=solutions, ex=ex, kept=kept)
    with pytest.raises(ExerciseFailed, match="called the course's own answers or graders"):
        ex.grade("8.1", "Q4_1", check_dequantize_q4_1, cheat)
    assert "PASS" not in capsys.readouterr().out.replace("line(s) that read as a pass left out", "")
    progress = json.loads(exercises.progress_path().read_text())
    assert all(e.get("status") != "passed" for section in progress.values() for lab in section.values()
               for e in lab.values())


def test_a_patched_grader_or_torch_function_is_refused(build_dir, monkeypatch):
    import torch

    from utils.graders import lab08

    ex = exercises.Lab("08_quantized_inference")
    lenient = _notebook_function("def check_dequantize_q4_1(f):\n    pass\n", "check_dequantize_q4_1")
    with pytest.raises(ExerciseFailed, match="not utils.graders' own"):
        ex.grade("8.1", "Q4_1", lenient, _decode_q4_1())
    real = _notebook_function("g = lambda f: check_dequantize_q4_1(f)\n", "g",
                              check_dequantize_q4_1=lab08.check_dequantize_q4_1)
    assert ex.grade("8.1", "Q4_1", real, _decode_q4_1())           # a lambda in the grading cell, as labs 01 and 03 write
    rebound = _notebook_function("g = lambda f: check_dequantize_q4_1(f)\n", "g", check_dequantize_q4_1=lenient)
    with pytest.raises(ExerciseFailed, match="not utils.graders' own"):
        ex.grade("8.1", "Q4_1", rebound, _decode_q4_1())
    monkeypatch.setattr(lab08, "check", _notebook_function("def check(name, ok, hint):\n    pass\n", "check"))
    with pytest.raises(ExerciseFailed, match="lab08.check was replaced"):
        ex.grade("8.1", "Q4_1", lab08.check_dequantize_q4_1, _decode_q4_1())
    monkeypatch.undo()
    monkeypatch.setattr(torch, "allclose", lambda *a, **k: True)
    with pytest.raises(ExerciseFailed, match="torch.allclose was replaced"):
        ex.grade("8.1", "Q4_1", lab08.check_dequantize_q4_1, _decode_q4_1())


def test_an_answer_that_never_returns_fails_as_too_slow(build_dir, monkeypatch):
    from utils.graders.lab08 import check_dequantize_q4_1

    monkeypatch.setenv("COURSE_GRADE_TIMEOUT", "1")
    forever = _notebook_function("def dequantize_q4_1(b):\n    while True:\n        pass\n", "dequantize_q4_1")
    with pytest.raises(ExerciseFailed, match="too slow or never returned"):
        exercises.Lab("08_quantized_inference").grade("8.1", "Q4_1", check_dequantize_q4_1, forever)


def test_no_line_that_reads_as_a_pass_stands_above_a_failure_and_the_seed_is_named(build_dir, capsys, monkeypatch):
    import numpy as np

    from utils.graders.lab08 import check_dequantize_q4_1

    wrong = _notebook_function("def dequantize_q4_1(b):\n    print('PASS: my own check')\n"
                               "    return np.zeros((len(b), 32), np.float32)\n", "dequantize_q4_1", np=np)
    monkeypatch.setenv("COURSE_GRADE_SEED", "1234")
    with pytest.raises(ExerciseFailed, match="seed 1234.*COURSE_GRADE_SEED=1234"):
        exercises.Lab("08_quantized_inference").grade("8.1", "Q4_1", check_dequantize_q4_1, wrong)
    out = capsys.readouterr().out
    assert "PASS" not in out.replace("line(s) that read as a pass left out", "") and "left out" in out


def test_fresh_seeds_differ_and_changed_inputs_are_named():
    import numpy as np

    from utils import grading_guard

    assert len({grading_guard.fresh_seed() for _ in range(4)}) > 1
    a, b = np.arange(4.0), np.arange(3.0)
    _, changed = grading_guard.changed_inputs((a, b), lambda x, y: x.__iadd__(1), names=["x", "y"])
    assert changed == ["x"]


def test_a_lambda_that_names_itself_is_graded_not_a_recursion(build_dir, capsys):
    """Issue 46's independent answers: `add = lambda x, y: torch.add(x, y)` names `add` (an attribute) and the
    answer's hashes looked it up as itself for ever; it is graded like any answer."""
    lab = exercises.Lab("99_demo")

    def check_double(f):
        exercises.check("f(3) == 6", f(3) == 6, "multiply by two")

    f = _notebook_function("import operator\nf = lambda x: operator.mul(x, 2) if f else f\n", "f")
    assert lab.grade("9.1", "double", check_double, f) is True


def test_a_wrapper_that_never_launches_the_exercise_kernel_fails(build_dir, capsys, tmp_path):
    """A wrapper that computes the answer some other way (torch) while the kernel holds any non-stub line is not
    the kernel graded: the grade names the kernel that never ran; the same wrapper launching it passes."""
    import torch

    path = tmp_path / "kernel_mod.py"
    path.write_text(KERNEL)
    import importlib.util

    spec = importlib.util.spec_from_file_location("kernel_mod", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    lab = exercises.Lab("99_demo")

    def check_double(f):
        x = torch.arange(8.0)
        exercises.check("doubled", torch.equal(f(x.clone()), 2 * x), "multiply by two")

    def launches(x):
        mod.k[(1,)](x, x.numel(), BLOCK=8)
        return x

    assert lab.grade("9.2", "double", check_double, launches, uses=[mod.k]) is True
    with pytest.raises(ExerciseFailed, match="k never ran during the grade: the exercise is the kernel"):
        lab.grade("9.2", "double", check_double, lambda x: x * 2, uses=[mod.k])
    assert lab.status["9.2"] == "failed"


def test_a_grader_table_or_a_course_function_changed_from_the_notebook_is_refused(build_dir, monkeypatch):
    """Issue 46's independent answers: a grader's table shortened (in place too), one of utils.grading_guard's or
    utils.simt's functions rebound, the course's reference module patched: the grade is refused, named; once
    undone the same answer passes."""
    import utils.graders.lab08 as g
    from utils import grading_guard, simt
    from utils.graders.lab08 import check_dequantize_q4_1

    ex, answer = exercises.Lab("08_quantized_inference"), _decode_q4_1()
    patches = [("utils.graders.lab08.GEMV_CASES", lambda: monkeypatch.setattr(g, "GEMV_CASES", g.GEMV_CASES[:1])),
               ("utils.grading_guard.fresh_seed", lambda: monkeypatch.setattr(grading_guard, "fresh_seed", lambda: 1)),
               ("utils.simt.run_kernel", lambda: monkeypatch.setattr(simt, "run_kernel", lambda *a, **k: None)),
               ("utils.solutions.load('08').dequantize_q4_1",
                lambda: monkeypatch.setattr(solutions.load("08"), "dequantize_q4_1", answer))]
    for what, patch in patches:
        patch()
        with pytest.raises(ExerciseFailed, match=re.escape(what) + " was changed.*restart the kernel"):
            ex.grade("8.1", "Q4_1", check_dequantize_q4_1, answer)
        monkeypatch.undo()
    kept = list(g.GEMV_CASES)
    g.GEMV_CASES[:] = kept[:1]                         # in place
    try:
        with pytest.raises(ExerciseFailed, match="GEMV_CASES was changed"):
            ex.grade("8.1", "Q4_1", check_dequantize_q4_1, answer)
    finally:
        g.GEMV_CASES[:] = kept
    assert ex.grade("8.1", "Q4_1", check_dequantize_q4_1, answer) is True


def test_a_lab_function_sealed_for_an_exercise_may_be_run_by_its_grader_not_by_the_answer(build_dir):
    """Lab 01's 1.3 asks for q's strides; gpt2_qkv makes q: its grader runs it, an answer that runs it to read the
    strides off is reaching for the answer."""
    lab = exercises.Lab("99_demo")
    make = _notebook_function("def make(n):\n    return list(range(n))\n", "make")

    def check_len(f, make):
        exercises.check("len", f(4) == len(make(4)), "count them")

    honest = _notebook_function("def f(n):\n    return n\n", "f")
    peeks = _notebook_function("def f(n):\n    return len(make(n))\n", "f", make=make)
    assert lab.grade("9.1", "count", check_len, honest, make, sealed=[make]) is True
    with pytest.raises(ExerciseFailed, match="the lab's make"):
        lab.grade("9.1", "count", check_len, peeks, make, sealed=[make])


def test_an_answer_that_swallows_the_time_limit_is_stopped_and_recorded_failed(build_dir, tmp_path):
    """An answer looping around `except BaseException: pass` swallows every TimeLimit: after a few the grade records
    the failure, says why on stderr and ends the process (a notebook's kernel restarts) instead of hanging."""
    import subprocess
    import sys

    script = tmp_path / "swallow.py"
    script.write_text(
        "import time\nfrom utils import exercises\nfrom utils.graders.lab08 import check_dequantize_q4_1\n"
        "def dequantize_q4_1(b):\n    while True:\n        try:\n            time.sleep(0.2)\n"
        "        except BaseException:\n            pass\n"
        "exercises.Lab('08_quantized_inference').grade('8.1', 'Q4_1', check_dequantize_q4_1, dequantize_q4_1)\n")
    env = {**os.environ, "COURSE_BUILD_DIR": str(build_dir), "COURSE_GRADE_TIMEOUT": "1",
           "PYTHONPATH": str(REPO_ROOT)}
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 70 and "swallowed that 3 times" in run.stderr, (run.returncode, run.stderr[-500:])
    progress = json.loads(exercises.progress_path().read_text())
    assert any(e.get("status") == "failed" for section in progress.values() for lab in section.values()
               for e in lab.values())


@pytest.mark.parametrize("how", ["patches numpy while it runs", "patched math before the grade",
                                 "calls the course's decoder", "calls gguf's decoder"])
def test_an_answer_that_patches_a_library_or_calls_what_computes_the_answer_fails(build_dir, how, monkeypatch):
    """Issue 46's independent answers: numpy.array_equal replaced by the answer itself, math.isclose replaced in an
    earlier cell, and 8.1 answered with utils.blocks.dequantize or gguf's own dequantizer (what the grader checks
    against): each fails, named, and is not recorded as passed."""
    import math

    import numpy as np

    from utils import blocks
    from utils.graders.lab08 import check_dequantize_q4_1

    ex = exercises.Lab("08_quantized_inference")
    zeros = "    return np.zeros((len(b), 32), np.float32)\n"
    body = {"patches numpy while it runs": "    np.array_equal = lambda *a, **k: True\n" + zeros,
            "patched math before the grade": "    return dec(b)\n",
            "calls the course's decoder": "    return blocks.dequantize(b, 'Q4_1')\n",
            "calls gguf's decoder": "    import gguf.quants\n    return gguf.quants.dequantize(b, gguf.GGMLQuantizationType.Q4_1)"
                                    ".reshape(len(b), 32)\n"}[how]
    answer = _notebook_function("def dequantize_q4_1(b):\n" + body, "dequantize_q4_1", np=np, blocks=blocks,
                                dec=_decode_q4_1())
    if how == "patched math before the grade":
        monkeypatch.setattr(math, "isclose", _notebook_function("f = lambda *a, **k: True\n", "f"))
    if how == "patches numpy while it runs":
        monkeypatch.setattr(np, "array_equal", np.array_equal)      # put back after the test
    want = {"patches numpy while it runs": "numpy.array_equal was replaced while the answer ran",
            "patched math before the grade": "math.isclose was replaced",
            "calls the course's decoder": r"utils\.blocks\.(dequantize|decode)",
            "calls gguf's decoder": r"gguf\.quants"}[how]
    with pytest.raises(ExerciseFailed, match=want):
        ex.grade("8.1", "Q4_1", check_dequantize_q4_1, answer)
    assert ex.status["8.1"] == "failed"


FRAME_CHEATS = {
    "sys._getframe": "import sys\n    f = sys._getframe(1)\n",
    "inspect.currentframe": "import inspect\n    f = inspect.currentframe().f_back\n",
    "inspect.stack": "import inspect\n    f = inspect.stack()[1].frame\n",
    "a traceback's frame": "try:\n        raise ValueError\n    except ValueError as e:\n        f = e.__traceback__.tb_frame\n",
    "every thread's frames": "import sys, threading\n    f = sys._current_frames()[threading.get_ident()]\n",
    "the garbage collector": "import gc\n    f = [o for o in gc.get_objects() if type(o).__name__ == 'frame'][:1] or [None]\n    f = f[0]\n",
}


@pytest.mark.parametrize("how", FRAME_CHEATS, ids=list(FRAME_CHEATS))
def test_an_answer_that_reads_the_graders_frames_fails(build_dir, how, capsys):
    """Exercise 4.1's grader holds the measured peak in a local while it calls the prediction: an answer that climbs
    the call stack to it (by any way of taking a frame) fails with that reason, and is not recorded as passed."""
    from utils.graders.lab04 import check_prediction

    ex = exercises.Lab("04_flash_attention")
    body = FRAME_CHEATS[how]
    cheat = _notebook_function(
        f"def predict_peak_bytes(batch, heads, n):\n    {body}"
        "    while f is not None:\n"
        "        if 'got' in f.f_locals and 'kb' in f.f_locals:\n"
        "            return f.f_locals['got'] * f.f_locals['kb'] * f.f_locals['kh']\n"
        "        if 'got' in f.f_locals:\n"
        "            return f.f_locals['got']\n"
        "        f = f.f_back\n"
        "    return 4 * 3 * batch * heads * n * n\n", "predict_peak_bytes")
    measured = [(1, 2, n, 7 * 2 * n * n + 12345) for n in (64, 128)]     # no formula of B, H, N gives these
    with pytest.raises(ExerciseFailed, match="grader's frames"):
        ex.grade("4.1", "peak", check_prediction, cheat, measured)
    assert "PASS" not in capsys.readouterr().out.replace("line(s) that read as a pass left out", "")


def test_a_right_prediction_that_uses_inspect_and_warnings_honestly_still_passes(build_dir):
    """Code that takes no frame passes: inspect.signature, a warning, a namedtuple (which asks sys._getframe for its
    module from the collections module, not the answer's)."""
    from utils.graders.lab04 import check_prediction

    honest = _notebook_function(
        "def predict_peak_bytes(batch, heads, n):\n"
        "    import collections, inspect, warnings\n"
        "    Shape = collections.namedtuple('Shape', 'b h n')\n"
        "    s = Shape(batch, heads, n)\n"
        "    assert list(inspect.signature(predict_peak_bytes).parameters) == ['batch', 'heads', 'n']\n"
        "    with warnings.catch_warnings():\n"
        "        warnings.simplefilter('ignore')\n"
        "        warnings.warn('a warning from the answer')\n"
        "    return 7 * s.b * s.h * s.n * s.n\n", "predict_peak_bytes")
    measured = [(1, 2, n, 7 * 2 * n * n) for n in (64, 128)]
    assert exercises.Lab("04_flash_attention").grade("4.1", "peak", check_prediction, honest, measured)
