"""Every notebook executes: the solutions under nbval (no error, checked outputs equal to the stored ones),
the generated labs with papermill (every exercise unfinished: no error at all, each says NOT DONE, and
the lab still runs to its end with the course's reference answers), and labs/ is what solutions/ generates."""
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from conftest import ROOT, notebook_device
from grading import errors, run_notebook, stream_text
from utils import params, record, solutions
from utils.exercises import is_exercise_stub_error
from utils.params import ParameterError
from utils.machinery import harness, labs
from utils.solutions import STUB

SOLUTIONS = solutions.solution_notebooks()
# Each notebook runs once in `make test`: the solutions under nbval with their defaults, the generated labs here.
# Lab 06's lab runs as on one GPU (RANKS=1), so that both paths are run without a third execution.
ONE_RUN_PARAMETERS = {"06_multi_gpu": {"RANKS": 1}}
LABS = [solutions.LABS / s.name for s in SOLUTIONS]


def test_there_are_notebooks():
    assert [s.name for s in SOLUTIONS][:1] == ["00_environment.ipynb"]


class LabRun:
    """One generated lab, run once (a class per lab below: xdist's loadscope then gives each lab's run to either
    worker, longest first)."""
    lab: Path

    def test_runs_to_the_end_with_every_exercise_not_done(self, build_dir, tmp_path):
        """Run All on a fresh lab: no error, a NOT DONE line per exercise, and the later sections (figures,
        measurements, machine code) still ran on the course's reference answers."""
        lab = self.lab
        nb = run_notebook(lab, tmp_path, {"DEVICE": notebook_device(), **ONE_RUN_PARAMETERS.get(lab.stem, {})})
        assert errors(nb) == []
        text = stream_text(nb)
        for ex_id in solutions.exercises(solutions.read(solutions.notebook_path(lab.stem)), lab.name):
            assert f"NOT DONE: exercise {ex_id} " in text, f"exercise {ex_id} did not say NOT DONE"
        assert "PASS: exercise" not in text, "an unfinished exercise passed"
        recorded = record.load_results(build_dir / "results")[lab.stem]
        assert recorded["metrics"], "the lab recorded no headline figures"
        assert recorded["figures"], "the lab drew no figure"
        if lab.stem == "06_multi_gpu":
            # RANKS=1, what one GPU gets: the multi-rank sections say SKIP, the one-process baseline and the launcher's
            # demonstrations still run (the solution's nbval run covers the 2-rank sections)
            assert "SKIP: collectives need two ranks; RANKS=1" in text
            assert "SKIP: tensor parallelism needs two ranks; RANKS=1" in text
            assert "PASS: one process, by hand (eager): logits within 0.0001 of transformers'" in text
            assert "PASS: the failing rank's own error was shown, and no process or port of the run is left" in text
            assert "PASS: two torchrun agents formed one group of 2 ranks" in text
        if lab.stem == "05_llm_serving":
            # a real server answered, the load test measured and plotted, and the server is gone
            answer = re.search(r"answer \((\d+) tokens, first after \d+ ms, all in [\d.]+ s\): (['\"])(.+)\2", text)
            assert answer and int(answer.group(1)) > 0 and len(answer.group(3)) > 20, text[-2000:]
            assert "PASS: the server's process group is gone and its port closed" in text, text[-3000:]
            assert {"serving.transformers.throughput_c1_tokens_per_s", "serving.transformers.batching_gain"} <= set(recorded["metrics"])
            assert "05_llm_serving/load_test.png" in recorded["figures"]


for _lab in LABS:
    globals()[f"TestLab_{_lab.stem}"] = type(f"TestLab_{_lab.stem}", (LabRun,), {"lab": _lab})


def test_labs_are_up_to_date():
    assert labs.write_labs(check=True) == [], "run `make labs`"


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.stem)
def test_labs_carry_no_outputs_or_solutions(lab):
    nb = nbformat.read(lab, 4)
    for cell in nb.cells:
        assert "BEGIN SOLUTION" not in cell.source
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None
    assert nb.metadata["kernelspec"]["name"] == "python3"


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.stem)
def test_one_parameters_cell_every_parameter_known(solution):
    nb = nbformat.read(solution, 4)
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, "exactly one cell tagged 'parameters'"
    assert 'DEVICE = "auto"' in tagged[0].source
    declared = harness.declarations(solution)      # every line declares its kind and what it is (or raises)
    assert declared["DEVICE"].allowed == params.DEVICE_CHOICES
    assert all(d.help for d in declared.values())


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.stem)
def test_exercises_are_marked_and_checked_outputs_stored(solution):
    """Every lab has exercises named after it, and nbval has something to compare: every
    `# NBVAL_CHECK_OUTPUT` cell of the solution carries its stored output (`make outputs`)."""
    nb = solutions.read(solution)
    ids = list(solutions.exercises(nb, solution.name))
    number = int(solution.stem.split("_")[0])
    assert ids and all(int(i.split(".")[0]) == number for i in ids), ids
    checked = [c for c in nb.cells if harness.checked(c)]
    assert checked, "no cell is compared by nbval"
    empty = [c.source.splitlines()[1][:60] for c in checked if not c.outputs]
    assert not empty, f"checked cells without stored outputs (run `make outputs`): {empty}"
    unchecked = [c for c in nb.cells if c.cell_type == "code" and not harness.checked(c) and c.outputs]
    assert not unchecked, "only checked cells keep outputs in solutions/ (run `make outputs`)"


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.stem)
def test_exported_cells_import_on_their_own(solution):
    module = solutions.load(solution.stem)
    assert module.__file__.endswith(".py")


def test_nbval_bites_when_a_checked_output_changes(tmp_path):
    """Change one stored output of a checked cell: nbval must fail that cell (and pass the rest)."""
    solution = solutions.notebook_path("00")
    nb = solutions.read(solution)
    cell = next(c for c in nb.cells if harness.checked(c) and any(o.get("text") for o in c.outputs))
    out = next(o for o in cell.outputs if o.get("text"))
    out.text = out.text.replace("PASS", "PASS (changed)", 1)
    copy = solution.parent / f".nbval-bites-{tmp_path.name}.ipynb"   # in solutions/, so the notebook's paths hold
    nbformat.write(nb, copy)
    try:
        run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--nbval-lax",
                              "--nbval-sanitize-with", str(ROOT / "tests" / "nbval_sanitize.cfg"), str(copy)],
                             cwd=ROOT, capture_output=True, text=True, timeout=600)
    finally:
        copy.unlink()
    assert run.returncode == 1, run.stdout[-3000:]
    assert re.search(r"\b1 failed\b", run.stdout) and "PASS (changed)" in run.stdout, run.stdout[-3000:]


def test_bad_parameter_stops_at_the_parameters_check_with_one_line(tmp_path, build_dir):
    import papermill as pm

    with pytest.raises(pm.PapermillExecutionError) as err:
        run_notebook(SOLUTIONS[0], tmp_path, {"DEVICE": "cpu", "MATMUL_N": -5})
    assert err.value.ename == "ParameterError"
    assert err.value.evalue == "MATMUL_N=-5 must be a positive whole number (> 0)"
    failed = [o for c in nbformat.read(tmp_path / SOLUTIONS[0].name, 4).cells if c.cell_type == "code"
              for o in c.get("outputs", []) if o.output_type == "error"]
    assert [o.traceback for o in failed] == [["ParameterError: MATMUL_N=-5 must be a positive whole number (> 0)"]]


@pytest.mark.parametrize("given, says", [
    ({"REP": 5}, "REP is not a parameter of this lab (did you mean REPS?)"),
    ({"REPS": 10**9}, "REPS=1000000000 must be a positive whole number <= 10,000"),
], ids=["unknown name", "over the maximum"])
def test_papermill_gets_the_labs_own_limits_in_its_first_cell(tmp_path, build_dir, given, says):
    """papermill passes any name and value; the lab's first cell after the parameters refuses them by name."""
    import papermill as pm

    with pytest.raises(pm.PapermillExecutionError) as err:
        run_notebook(SOLUTIONS[0], tmp_path, {"DEVICE": "cpu", **given})
    assert err.value.ename == "ParameterError" and err.value.evalue.startswith(says)


def test_stub_errors_are_recognised_and_others_are_not():
    raised = "exercise not done: replace this line with your code, then re-run the cell"
    assert is_exercise_stub_error("NotImplementedError", raised)
    assert is_exercise_stub_error("InterpreterError", f"NotImplementedError('{raised}')")
    assert is_exercise_stub_error("CompilationError", f"at 20:8:\n        {STUB}\n        ^\nunsupported AST node type: Raise")
    assert not is_exercise_stub_error("NotImplementedError", "something else")
    assert not is_exercise_stub_error("NameError", "name 'amd' is not defined")


BAD_VALUE = {"count": -1, "counts": 7, "milliseconds": float("nan"), "choice": "bogus", "pair": [1]}


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.stem)
def test_every_parameter_rejects_a_bad_value_by_name_in_the_check_cell(solution, build_dir, monkeypatch):
    """A learner who edits the parameters cell by hand (no harness in between): the cell that checks the
    parameters stops each bad value with a ParameterError that names it; nothing else runs first."""
    nb = solutions.read(solution)
    i = next(k for k, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    check_cell = next(c for c in nb.cells[i + 1:] if c.cell_type == "code")
    monkeypatch.setenv("COURSE_DEVICE", "cpu")
    for name in harness.declared_parameters(solution):
        if name == "DEVICE":
            continue
        bad = BAD_VALUE[harness.declarations(solution)[name].kind]
        scope = {}
        with monkeypatch.context() as m:
            m.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "0"))
            exec(compile(nb.cells[i].source, "parameters", "exec"), scope)
            scope[name] = bad
            scope["DEVICE"] = "cpu"
            with pytest.raises(ParameterError) as err:
                exec(compile(check_cell.source, "check", "exec"), scope)
        assert str(err.value).startswith(f"{name}=") or f"{name}[" in str(err.value), (name, str(err.value))
