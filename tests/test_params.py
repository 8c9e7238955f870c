"""utils.params: bad notebook parameters stop with one clear line."""
import dataclasses
import re

import pytest

from utils import device as devices
from utils import backend, params
from utils.params import ParameterError

CPU = devices.cpu_info()


def gpu(recorded):
    r = recorded["h100"]
    return devices.from_properties(r["properties"], cuda=r["cuda"])


@pytest.mark.parametrize("value", [0, -3, 1.5, "10", True, None, [4]])
def test_positive_int_rejects(value):
    with pytest.raises(ParameterError, match=r"^N=.* must be a positive whole number"):
        params.positive_int("N", value)


def test_positive_int_accepts_whole_floats():
    assert params.positive_int("N", 1e6) == 1_000_000 and params.positive_int("N", 7) == 7


def test_size_defaults_by_device(recorded):
    assert params.size("N", None, device=CPU, cpu=256, gpu=8192) == 256
    assert params.size("N", None, device=gpu(recorded), cpu=256, gpu=8192) == 8192
    assert params.size("N", 1024, device=CPU, cpu=256, gpu=8192) == 1024


def no_gpu_runtime(monkeypatch):
    """As on a machine with no CUDA/ROCm runtime: a recorded GPU's free memory is unknown, its total stands in."""
    def unavailable(self):
        raise RuntimeError("no GPU runtime in this process")
    monkeypatch.setattr(backend.Backend, "free_memory_bytes", unavailable)


def test_size_that_does_not_fit_names_the_parameter_and_a_size_that_does(recorded, monkeypatch):
    no_gpu_runtime(monkeypatch)
    h100 = gpu(recorded)
    with pytest.raises(ParameterError) as err:
        params.size("ADD_N", 2**34, device=h100, cpu=1, gpu=1, bytes_needed=lambda n: 3 * n * 4)
    msg = str(err.value)
    assert msg.startswith(f"ADD_N=17179869184 needs 192.0 GiB but NVIDIA H100 80GB HBM3 has "
                          f"{h100.memory_bytes / 2**30:.1f} GiB")
    suggested = int(msg.rsplit("ADD_N=", 1)[1].split()[0])
    assert 3 * suggested * 4 <= params.MEMORY_BUDGET * h100.memory_bytes
    params.size("ADD_N", suggested, device=h100, cpu=1, gpu=1, bytes_needed=lambda n: 3 * n * 4)


def test_size_uses_free_memory_on_cpu(monkeypatch):
    monkeypatch.setattr(params, "available_memory_bytes", lambda device: 1 << 30)
    with pytest.raises(ParameterError, match="needs 3.0 GiB"):
        params.size("N", 1 << 28, device=CPU, cpu=1, gpu=1, bytes_needed=lambda n: 12 * n)


def test_unknown_memory_is_not_checked(monkeypatch):
    no_gpu_runtime(monkeypatch)
    unknown = dataclasses.replace(CPU, backend="cuda", memory_bytes=None)
    assert params.size("N", 10**12, device=unknown, cpu=1, gpu=1, bytes_needed=lambda n: n) == 10**12


def test_choice():
    assert params.choice("MODE", "Fast", ["fast", "slow"]) == "fast"
    with pytest.raises(ParameterError, match=r"MODE='medium' is not allowed; use one of 'fast', 'slow'"):
        params.choice("MODE", "medium", ["fast", "slow"])


def test_parameter_error_renders_as_one_line_in_ipython():
    err = ParameterError("N=0 must be a positive whole number (> 0)")
    assert err._render_traceback_() == ["ParameterError: N=0 must be a positive whole number (> 0)"]


@pytest.mark.parametrize("value", [-1, "5", True, None])
def test_non_negative_rejects(value):
    with pytest.raises(ParameterError, match=r"^W=.* must be a number >= 0$"):
        params.non_negative("W", value)


def test_non_negative_accepts():
    assert params.non_negative("W", 0) == 0.0 and params.non_negative("W", 2.5) == 2.5


# --- one declaration per parameter: the parameters cell, read the same way on every path in -------------

CELL = '''# Parameters
DEVICE = "auto"      # choice auto|cpu|gpu|cuda|rocm: where the lab runs
REPS = None          # count up to 10000: timed repetitions; None: 30 on a GPU
SIZES = None         # counts up to 2**20: sizes of the sweep
WARMUP_MS = 100      # milliseconds up to 60000: untimed warm-up
'''


def test_a_parameters_cell_declares_kind_limit_and_help():
    declared = params.declarations(CELL)
    assert list(declared) == ["DEVICE", "REPS", "SIZES", "WARMUP_MS"]
    assert declared["REPS"].maximum == 10_000 and declared["SIZES"].maximum == 2**20
    assert declared["DEVICE"].allowed == ("auto", "cpu", "gpu", "cuda", "rocm") and not declared["DEVICE"].none_ok
    assert declared["REPS"].none_ok and declared["REPS"].help.startswith("timed repetitions")
    assert declared["REPS"].check(1e3) == 1000 and declared["REPS"].check(None) is None


@pytest.mark.parametrize("line, says", [
    ("REPS = None", "line 1: not `NAME = default  # kind"),
    ("REPS = None  # how many", "line 1: not `NAME = default  # kind"),
    ("REPS = None  # number: how many", "a kind from choice, count"),
    ("REPS = None  # count < 5: how many", "the limit must read `up to N`"),
    ("MODE = 'a'  # choice: which", "a choice lists what it allows"),
    ("REPS = 0  # count: how many", "REPS=0 must be a positive whole number"),
])
def test_a_parameter_without_a_proper_declaration_is_named(line, says):
    with pytest.raises((ValueError, ParameterError), match=re.escape(says)):
        params.declarations(line)


BAD = [("REPS", 10**9, "REPS=1000000000 must be a positive whole number <= 10,000"),
       ("REPS", float("nan"), "REPS=nan must be a positive whole number, not nan"),
       ("REPS", float("-inf"), "REPS=-inf must be a positive whole number, not -inf"),
       ("REPS", -3, "REPS=-3 must be a positive whole number (> 0)"),
       ("REPS", "30", "REPS='30' must be a positive whole number"),
       ("SIZES", 64, "SIZES=64 must be a non-empty list"),
       ("DEVICE", "tpu", "DEVICE='tpu' is not allowed; use one of 'auto'"),
       ("WARMUP_MS", float("inf"), "WARMUP_MS=inf must be a number >= 0")]


@pytest.mark.parametrize("name, value, says", BAD, ids=[f"{n}={v!r}" for n, v, _ in BAD])
def test_the_same_bad_value_is_refused_alike_by_the_harness_and_in_the_notebook(name, value, says, tmp_path,
                                                                                monkeypatch):
    """The harness (`make run -p`) and `course.start` in the kernel (papermill, JupyterLab) read one declaration."""
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    from utils import course
    from utils.machinery import harness

    notebook = tmp_path / "99_lab.ipynb"
    nbformat.write(new_notebook(cells=[new_code_cell(CELL, metadata={"tags": ["parameters"]})]), notebook)
    with pytest.raises(ParameterError, match=re.escape(says)):
        harness.plan_parameters([notebook], {name: value})
    monkeypatch.setattr(course, "declared", lambda lab: params.declarations(CELL))
    scope = {"DEVICE": "cpu", "REPS": None, "SIZES": None, "WARMUP_MS": 100, name: value}
    with pytest.raises(ParameterError, match=re.escape(says)):
        course.check_parameters("99_lab", scope)


def test_a_name_papermill_injected_that_the_lab_does_not_declare_is_refused_with_the_nearest(monkeypatch):
    from utils import course

    monkeypatch.setattr(course, "declared", lambda lab: params.declarations(CELL))
    scope = {"DEVICE": "cpu", "REPS": None, "SIZES": None, "WARMUP_MS": 100, "REP": 5, "VECTOR_KERNEL": "x",
             "In": ["", CELL, "# Parameters\nDEVICE = \"cpu\"\nREP = 5\n", "dev, rec, ex = course.start(...)"]}
    with pytest.raises(ParameterError, match=r"REP is not a parameter of this lab \(did you mean REPS\?\)"):
        course.check_parameters("99_lab", scope)
    scope["In"] = ["", CELL, "VECTOR_KERNEL = 'x'"]     # a learner's own constant, run before: not a parameter
    course.check_parameters("99_lab", scope)
    assert scope["REPS"] is None
