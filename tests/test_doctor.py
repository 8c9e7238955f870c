"""The environment doctor (utils.clinic.doctor): facts as data, a pure verdict, the described machines, parsing the vendors'
tools, and a gather() that never hangs."""
import dataclasses
import json
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from utils.clinic import doctor
from utils.clinic.doctor import COMPATIBLE, CPU_ONLY, SUPPORTED, UNSUPPORTED, Facts

MACHINES = doctor.machines()


@pytest.mark.parametrize("key", list(MACHINES))
def test_described_machines_get_their_expected_verdict(key):
    facts = doctor.load_fixture(key)
    assert doctor.verdict(facts).level == MACHINES[key]["expect"]
    assert facts.label == MACHINES[key]["label"]


def test_the_five_machines_of_the_brief_are_described_and_amd_ones_say_so():
    assert {"mi300x", "rx7900xtx", "gfx1151", "h100", "cpu"} <= set(MACHINES)
    for key in ("mi300x", "rx7900xtx", "gfx1151", "gfx1151_override"):
        assert "described from public documentation" in MACHINES[key]["label"]
    assert "WRITTEN FROM PUBLIC DOCUMENTATION" in json.loads(doctor.MACHINES_FILE.read_text())["_about"]


def test_gfx1151_without_its_code_names_the_error_the_fix_and_the_override():
    v = doctor.verdict(doctor.load_fixture("gfx1151"))
    assert (v.level, v.arch, v.runs) == (UNSUPPORTED, "gfx1151", None)
    assert "invalid device function" in " ".join(v.reasons)
    assert "gfx1151 in get_arch_list()" in v.install[0]
    assert "HSA_OVERRIDE_GFX_VERSION=11.0.0" in v.install[1] and "own risk" in v.install[1]


def test_the_override_is_compatible_not_supported_and_says_why_it_can_be_wrong():
    v = doctor.verdict(doctor.load_fixture("gfx1151_override"))
    assert (v.level, v.arch, v.runs) == (COMPATIBLE, "gfx1151", "gfx1100")
    text = " ".join(v.reasons)
    assert "report gfx1100 instead of gfx1151" in text and "wrong without an error" in text


def _with(key, **changes) -> Facts:
    facts = doctor.load_fixture(key)
    return dataclasses.replace(facts, **changes)


@pytest.mark.parametrize("facts, level, words", [
    # NVIDIA
    (lambda: _with("h100", driver="535.104.05", driver_cuda="12.2"), UNSUPPORTED, "needs an NVIDIA driver >= 580"),
    (lambda: _with("h100", driver="570.86.10", driver_cuda="12.8", torch="2.7.0+cu126", torch_cuda="12.6",
                   arch_list=("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90")), SUPPORTED, "fits"),
    (lambda: _with("h100", torch="2.13.0+cpu", torch_cuda=None, arch_list=(), torch_gpu=None, torch_arch=None),
     UNSUPPORTED, "CPU build"),
    (lambda: _with("h100", torch_gpu=None, torch_arch=None, env={"CUDA_VISIBLE_DEVICES": ""}), UNSUPPORTED,
     "CUDA_VISIBLE_DEVICES=''"),
    (lambda: _with("h100", torch_gpu="NVIDIA L40S", torch_arch="sm_89", hw_arch="sm_89",
                   arch_list=("sm_80", "sm_86", "sm_90")), SUPPORTED, "sm_86 machine code runs on sm_89"),
    (lambda: _with("h100", torch_gpu="NVIDIA RTX PRO 6000", torch_arch="sm_120", hw_arch="sm_120",
                   arch_list=("sm_80", "sm_90", "compute_90")), COMPATIBLE, "compiles the compute_90 PTX"),
    (lambda: _with("h100", torch_gpu="NVIDIA B200", torch_arch="sm_100", hw_arch="sm_100",
                   arch_list=("sm_80", "sm_90")), UNSUPPORTED, "none runs on sm_100"),
    (lambda: _with("h100", torch_cuda=None, torch_hip="6.4.43482", torch="2.9.1+rocm6.4"), UNSUPPORTED,
     "ROCm build, but the GPU is NVIDIA's"),
    (lambda: _with("h100", torch_gpu=None, torch_arch=None, hw_gpu=None, hw_arch=None, driver=None,
                   driver_cuda=None), CPU_ONLY, "no NVIDIA GPU"),
    # AMD
    (lambda: _with("mi300x", torch_hip=None, torch_cuda="13.0", torch="2.11.0+cu130"), UNSUPPORTED,
     "CUDA build, but the GPU is AMD's"),
    (lambda: _with("gfx1151", env={"HSA_OVERRIDE_GFX_VERSION": "10.3.0"}, torch_arch="gfx1030"), UNSUPPORTED,
     "not of one ISA family"),
    (lambda: _with("gfx1151", env={"HSA_OVERRIDE_GFX_VERSION": "11.5.1"}), UNSUPPORTED, "ships kernels"),
    (lambda: _with("gfx1151", env={"HSA_OVERRIDE_GFX_VERSION": "9.4.2"}, torch_arch="gfx942"), UNSUPPORTED,
     "not of one ISA family"),
    (lambda: _with("gfx1151", env={"HSA_OVERRIDE_GFX_VERSION": "eleven"}), UNSUPPORTED, "not major.minor.stepping"),
    (lambda: _with("gfx1151", arch_list=doctor.load_fixture("gfx1151").arch_list + ("gfx11-generic",)), COMPATIBLE,
     "gfx11-generic code objects run"),
    (lambda: _with("mi300x", env={"HSA_OVERRIDE_GFX_VERSION": "9.4.2"}), SUPPORTED, "gfx942 machine code"),
    (lambda: _with("mi300x", torch_gpu=None, torch_arch=None, hw_gpu=None, hw_arch=None, driver=None), CPU_ONLY,
     "no AMD GPU"),
    (lambda: _with("mi300x", hw_arch="gfx90a", torch_arch="gfx90a", torch_gpu="AMD Instinct MI210",
                   arch_list=("gfx908", "gfx942")), UNSUPPORTED, "not for gfx90a"),
    (lambda: _with("cpu", torch=None), UNSUPPORTED, "not installed"),
])
def test_verdict_on_perturbed_machines(facts, level, words):
    v = doctor.verdict(facts())
    assert v.level == level, str(v)
    assert words in str(v), str(v)


@pytest.mark.parametrize("arch, archs, want", [
    ("sm_90", ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"], "sm_90"),
    ("sm_89", ["sm_80", "sm_86", "sm_90"], "sm_86"),
    ("sm_86", ["sm_80", "sm_90"], "sm_80"),
    ("sm_90", ["sm_80", "sm_86", "compute_86"], "compute_86"),
    ("sm_120", ["sm_90", "sm_100", "compute_90", "compute_100"], "compute_100"),
    ("sm_100", ["sm_90a", "sm_80"], None),
    ("sm_90", ["sm_90a"], "sm_90a"),
    ("sm_89", ["sm_80", "sm_90a"], "sm_80"),
    ("sm_75", ["sm_80", "compute_80"], None),
    ("gfx942", ["gfx90a", "gfx942"], "gfx942"),
    ("gfx1151", ["gfx1100", "gfx1101"], None),
    ("gfx1151", ["gfx1100", "gfx11-generic"], "gfx11-generic"),
    ("gfx90a", ["gfx908", "gfx942", "gfx9-generic"], None),
])
def test_runnable_target(arch, archs, want):
    assert doctor.runnable_target(arch, archs) == want


def test_runnable_target_rejects_an_unknown_architecture():
    with pytest.raises(ValueError, match="expected sm_XY or gfxNNNN"):
        doctor.runnable_target("ampere", ["sm_80"])


@pytest.mark.parametrize("version, gfx", [("11.0.0", "gfx1100"), ("9.0.10", "gfx90a"), ("9.4.2", "gfx942"),
                                          ("11.5.1", "gfx1151"), ("10.3.0", "gfx1030")])
def test_override_versions_and_kfd_target_versions_name_the_same_chips(version, gfx):
    assert doctor.gfx_from_version(version) == gfx
    major, minor, step = map(int, version.split("."))
    assert doctor.gfx_from_target_version(major * 10000 + minor * 100 + step) == gfx


@pytest.mark.parametrize("bad", ["11.0", "11.0.x", "9.0.16", "", "1.2.3.4"])
def test_bad_override_versions_are_refused(bad):
    with pytest.raises(ValueError, match="HSA_OVERRIDE_GFX_VERSION"):
        doctor.gfx_from_version(bad)


def test_parsing_the_vendor_tools():
    nv = doctor.parse_nvidia_smi("NVIDIA H100 80GB HBM3, 580.95.05, 9.0\n",
                                 "| NVIDIA-SMI 580.95.05   Driver Version: 580.95.05   CUDA Version: 13.0 |")
    assert nv == {"hw_gpu": "NVIDIA H100 80GB HBM3", "driver": "580.95.05", "hw_arch": "sm_90", "driver_cuda": "13.0"}
    assert doctor.parse_nvidia_smi("", "") == {}
    line = ("AMDSMI Tool: 26.0.2+39589fda | AMDSMI Library version: 26.0.2 | ROCm version: 7.0.2 | "
            "amdgpu version: 6.14.14 | amd_hsmp version: N/A")
    assert doctor.parse_amd_smi_version(line) == {"rocm": "7.0.2", "driver": "6.14.14"}
    assert doctor.parse_amd_smi_version("AMDSMI Tool: 24.7.1 | AMDSMI Library version: 24.7.2.0 | ROCm version: N/A") == {}
    smi = "==== ROCm System Management Interface ====\n==== Version of System Component ====\nDriver version: 6.8.5\n"
    assert doctor.parse_rocm_smi_driver(smi) == "6.8.5"
    assert doctor.parse_rocm_smi_driver("ERROR: no GPU") is None


def test_kfd_topology_gives_the_real_chip(tmp_path):
    for node, text in (("0", "cpu_cores_count 16\nsimd_count 0\ngfx_target_version 0\n"),
                       ("1", "cpu_cores_count 0\nsimd_count 80\ngfx_target_version 110501\n"),
                       ("2", "gfx_target_version 90402\n")):
        (tmp_path / node).mkdir()
        (tmp_path / node / "properties").write_text(text)
    assert doctor.kfd_gpus(tmp_path) == ["gfx1151", "gfx942"]
    assert doctor.kfd_gpus(tmp_path / "missing") == []


def test_a_tool_that_hangs_or_fails_gives_nothing_quickly():
    start = time.monotonic()
    assert doctor._run([sys.executable, "-c", "import time; time.sleep(30)"], timeout=0.5) == ""
    assert time.monotonic() - start < 10
    assert doctor._run([sys.executable, "-c", "raise SystemExit(3)"]) == ""
    assert doctor._run(["no-such-tool-here"]) == ""


def test_gather_on_this_machine_is_consistent_with_pytorch():
    import torch

    facts = doctor.gather()
    assert facts.torch == torch.__version__ and facts.python
    level = doctor.verdict(facts).level
    if torch.cuda.is_available():
        assert level in (SUPPORTED, COMPATIBLE)
        assert facts.torch_arch and facts.arch_list
    else:
        assert level in (CPU_ONLY, UNSUPPORTED)
    assert doctor.summary(facts).startswith(f"doctor: {level.upper()}: ")
    assert "\n" not in doctor.summary(facts)


def test_facts_round_trip_through_json_and_refuse_unknown_fields():
    facts = doctor.load_fixture("gfx1151_override")
    assert Facts.from_json(json.loads(json.dumps(facts.to_json()))) == facts
    with pytest.raises(ValueError, match="unknown fields"):
        Facts.from_json({"torch": "2.13.0", "gpu_arch": "gfx942"})
    with pytest.raises(KeyError, match="known:"):
        doctor.load_fixture("mi999")


@pytest.mark.parametrize("machine, code, words", [("gfx1151", 1, "verdict: NOT SUPPORTED"),
                                                  ("h100", 0, "verdict: SUPPORTED"),
                                                  ("gfx1151_override", 0, "verdict: COMPATIBLE (gfx1151 runs gfx1100 code)")])
def test_the_command_line(machine, code, words):
    run = subprocess.run([sys.executable, "-m", "utils.clinic.doctor", "--machine", machine], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == code, run.stderr
    assert words in run.stdout
    as_json = subprocess.run([sys.executable, "-m", "utils.clinic.doctor", "--machine", machine, "--json"], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
    assert Facts.from_json(json.loads(as_json.stdout)) == doctor.load_fixture(machine)
