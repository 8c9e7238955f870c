"""Every notebook executes: solutions with papermill (no error at all), labs with nbclient (the only
errors are the exercise stubs' own), and labs/ is what solutions/ generates."""
import re

import nbformat
import papermill as pm
import pytest
from nbclient import NotebookClient

from conftest import notebook_device
from utils import harness, report
from utils.exercises import is_exercise_stub_error

SOLUTIONS = harness.solution_notebooks()
LABS = [harness.LABS / s.name for s in SOLUTIONS]


def errors(nb):
    """(name, value + traceback) of every error output: a compiler error raised where a kernel calls a
    helper names the stub only in its chained traceback."""
    strip = lambda text: re.sub(r"\x1b\[[0-9;]*m", "", text)
    return [(o.ename, o.evalue + "\n" + strip("\n".join(o.get("traceback", []))))
            for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]


def test_there_are_notebooks():
    assert [s.name for s in SOLUTIONS][:1] == ["00_environment.ipynb"]


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.stem)
def test_solution_executes_with_papermill(solution, build_dir, tmp_path, monkeypatch):
    for k, v in harness.notebook_env().items():
        monkeypatch.setenv(k, v)
    out = tmp_path / solution.name
    pm.execute_notebook(str(solution), str(out), parameters={"DEVICE": notebook_device()},
                        cwd=str(solution.parent), kernel_name="python3", progress_bar=False)
    assert errors(nbformat.read(out, 4)) == []
    recorded = report.load_results(build_dir / "results")[solution.stem]
    assert recorded["metrics"], "the lab recorded no headline figures"
    if solution.stem == "05_llm_serving":
        # a real server answered, the load test measured and plotted, and the server is gone
        text = "".join(o.get("text", "") for c in nbformat.read(out, 4).cells if c.cell_type == "code"
                       for o in c.get("outputs", []))
        answer = re.search(r"answer \((\d+) tokens, first after \d+ ms\): (['\"])(.+)\2", text)
        assert answer and int(answer.group(1)) > 0 and len(answer.group(3)) > 20, text[-2000:]
        assert "PASS: the server's process group is gone and its port closed" in text
        assert {"serving.throughput_c1_tokens_per_s", "serving.batching_gain"} <= set(recorded["metrics"])
        assert "05_llm_serving/load_test.png" in recorded["figures"]


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.stem)
def test_lab_fails_only_at_its_exercises(lab, build_dir, monkeypatch):
    for k, v in harness.notebook_env().items():
        monkeypatch.setenv(k, v)
    nb = nbformat.read(lab, 4)
    NotebookClient(nb, timeout=1200, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(lab.parent)}}).execute()
    errs = errors(nb)
    assert errs, "the lab ran without any 'exercise not done' error: are its exercises stripped?"
    others = [e for e in errs if not is_exercise_stub_error(*e)]
    assert others == [], f"errors other than the exercise stubs: {others}"


def test_labs_are_up_to_date():
    assert harness.write_labs(check=True) == [], "run `make labs`"


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.stem)
def test_labs_carry_no_outputs_or_solutions(lab):
    nb = nbformat.read(lab, 4)
    for cell in nb.cells:
        assert "BEGIN SOLUTION" not in cell.source
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.stem)
def test_one_parameters_cell_with_a_device(solution):
    nb = nbformat.read(solution, 4)
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, "exactly one cell tagged 'parameters'"
    assert 'DEVICE = "auto"' in tagged[0].source
    assert any("### BEGIN SOLUTION" in c.source for c in nb.cells), "a lab needs at least one exercise"


def test_bad_parameter_stops_at_the_parameters_check_with_one_line(tmp_path, build_dir, monkeypatch):
    for k, v in harness.notebook_env().items():
        monkeypatch.setenv(k, v)
    solution = SOLUTIONS[0]
    out = tmp_path / "bad.ipynb"
    with pytest.raises(pm.PapermillExecutionError) as err:
        pm.execute_notebook(str(solution), str(out), parameters={"DEVICE": "cpu", "MATMUL_N": -5},
                            cwd=str(solution.parent), kernel_name="python3", progress_bar=False)
    assert err.value.ename == "ParameterError"
    assert err.value.evalue == "MATMUL_N=-5 must be a positive whole number (> 0)"
    failed = [o for c in nbformat.read(out, 4).cells if c.cell_type == "code"
              for o in c.get("outputs", []) if o.output_type == "error"]
    assert [o.traceback for o in failed] == [["ParameterError: MATMUL_N=-5 must be a positive whole number (> 0)"]]


def test_stub_errors_are_recognised_and_others_are_not():
    from utils.exercises import STUB

    raised = "exercise not done: replace this line with your code, then re-run the cell"
    assert is_exercise_stub_error("NotImplementedError", raised)
    assert is_exercise_stub_error("InterpreterError", f"NotImplementedError('{raised}')")
    assert is_exercise_stub_error("CompilationError", f"at 20:8:\n        {STUB}\n        ^\nunsupported AST node type: Raise")
    assert not is_exercise_stub_error("NotImplementedError", "something else")
    assert not is_exercise_stub_error("NameError", "name 'amd' is not defined")
