"""The environment doctor: what the GPU software stack is and whether its pieces fit (`python -m utils.clinic.doctor`).

`gather()` collects the facts of this machine (driver, PyTorch build, the GPU's architecture as the driver and as
PyTorch see it, the architectures PyTorch ships kernels for, Triton's target, the environment variables that change
them) into a `Facts` record; `load_fixture(name)` gives the same record for a machine described in
`utils/data/doctor_machines.json`. `verdict(facts)` is pure: supported, supported through a compatible ISA, not
supported, or CPU only, with the reasons and what to install. `report(facts)` is the table, `summary()` one line.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from utils import backend
from utils.base.paths import DATA_DIR

MACHINES_FILE = DATA_DIR / "doctor_machines.json"

SUPPORTED, COMPATIBLE, UNSUPPORTED, CPU_ONLY = "supported", "compatible", "not supported", "cpu only"

# Oldest NVIDIA driver each CUDA major release runs on (minor-version compatibility; NVIDIA's "CUDA
# Compatibility" guide, table "CUDA Toolkit 11.x, 12.x and 13.x driver version ranges", Linux).
MIN_DRIVER_FOR_CUDA = {11: 450, 12: 525, 13: 580}

# LLVM's generic AMDGPU targets: code compiled for the generic target runs on every listed chip (LLVM
# AMDGPU usage guide, "Generic processors"). Chips of one family share most of their ISA, which is why
# HSA_OVERRIDE_GFX_VERSION between them often works, and code built for one *specific* member is still
# not promised to run right on another.
AMD_FAMILIES = {
    "gfx9-generic": ("gfx900", "gfx902", "gfx904", "gfx906", "gfx909", "gfx90c"),
    "gfx9-4-generic": ("gfx940", "gfx941", "gfx942", "gfx950"),
    "gfx10-1-generic": ("gfx1010", "gfx1011", "gfx1012", "gfx1013"),
    "gfx10-3-generic": ("gfx1030", "gfx1031", "gfx1032", "gfx1033", "gfx1034", "gfx1035", "gfx1036"),
    "gfx11-generic": ("gfx1100", "gfx1101", "gfx1102", "gfx1103", "gfx1150", "gfx1151", "gfx1152", "gfx1153"),
    "gfx12-generic": ("gfx1200", "gfx1201"),
}

TORCH_INDEX = backend.TORCH_INDEX
_ENV_VARS = ("HSA_OVERRIDE_GFX_VERSION", "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


@dataclass(frozen=True)
class Facts:
    """What the doctor knows about one machine. Every field may be None: it was not found."""
    label: str = "this machine"
    about: str = ""                        # where the values come from (a fixture's sources)
    python: str | None = None
    torch: str | None = None               # torch.__version__
    torch_cuda: str | None = None          # torch.version.cuda: a CUDA build
    torch_hip: str | None = None           # torch.version.hip: a ROCm build
    arch_list: tuple[str, ...] = ()        # torch.cuda.get_arch_list(): the targets it ships kernels for
    torch_gpu: str | None = None           # the GPU PyTorch sees (None: it sees none)
    torch_arch: str | None = None          # its architecture as PyTorch reports it: sm_90, gfx942
    warp_size: int | None = None           # lanes per wavefront/warp PyTorch reports
    hw_gpu: str | None = None              # the GPU the driver reports (nvidia-smi, KFD, amd-smi)
    hw_arch: str | None = None             # its real architecture (nvidia-smi compute_cap, KFD gfx_target_version)
    driver: str | None = None              # NVIDIA driver version, or the amdgpu kernel driver's
    driver_cuda: str | None = None         # the newest CUDA the NVIDIA driver supports (nvidia-smi header)
    rocm: str | None = None                # the system's ROCm (amd-smi version)
    triton: str | None = None
    triton_target: str | None = None       # "cuda sm_90 32" / "hip gfx942 64"
    env: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "Facts":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown fields {sorted(unknown)} in doctor facts; known: {sorted(names)}")
        data = dict(data)
        data["arch_list"] = tuple(data.get("arch_list") or ())
        return cls(**data)


@dataclass(frozen=True)
class Verdict:
    level: str                          # SUPPORTED | COMPATIBLE | UNSUPPORTED | CPU_ONLY
    arch: str | None                    # the GPU's real architecture
    runs: str | None                    # the code it runs: the target from the arch list (or the override)
    reasons: tuple[str, ...]
    install: tuple[str, ...] = ()       # what to install or change

    def __str__(self) -> str:
        lines = [f"verdict: {self.level.upper()}" + (f" ({self.arch} runs {self.runs} code)"
                                                      if self.arch and self.runs and self.runs != self.arch else "")]
        lines += [f"  - {r}" for r in self.reasons]
        lines += [f"  fix: {i}" for i in self.install]
        return "\n".join(lines)


# --- architectures -------------------------------------------------------------------------------

def gfx_from_version(version: str) -> str:
    """HSA_OVERRIDE_GFX_VERSION's "major.minor.stepping" as a gfx name: "11.0.0" -> "gfx1100",
    "9.0.10" -> "gfx90a" (minor and stepping are one hex digit each)."""
    parts = version.strip().split(".")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"HSA_OVERRIDE_GFX_VERSION={version!r} is not major.minor.stepping (e.g. 11.0.0)")
    major, minor, step = map(int, parts)
    if minor > 15 or step > 15:
        raise ValueError(f"HSA_OVERRIDE_GFX_VERSION={version!r}: minor and stepping are single hex digits (0-15)")
    return f"gfx{major}{minor:x}{step:x}"


def gfx_from_target_version(value: int) -> str:
    """KFD's gfx_target_version (major*10000 + minor*100 + stepping) as a gfx name: 110501 -> "gfx1151"."""
    major, rest = divmod(int(value), 10000)
    minor, step = divmod(rest, 100)
    return f"gfx{major}{minor:x}{step:x}"


def family(gfx: str) -> str | None:
    """The LLVM generic target whose family `gfx` belongs to, or None."""
    return next((name for name, members in AMD_FAMILIES.items() if gfx in members), None)


def _sm(arch: str) -> tuple[int, int] | None:
    m = re.fullmatch(r"(?:sm|compute)_(\d+)(\d)[af]?", arch)
    return (int(m.group(1)), int(m.group(2))) if m else None


def runnable_target(arch: str, arch_list) -> str | None:
    """The entry of `arch_list` (a PyTorch build's `get_arch_list()`) whose code a GPU of architecture
    `arch` can run, or None.

    NVIDIA: its own `sm_XY` (or `sm_XYa`, arch-specific, which runs on exactly XY); else machine code of the same
    major with a lower minor (`sm_86` code runs on `sm_89`; arch-specific builds never run on another); else PTX (`compute_XY`) of an older or equal
    architecture, which the driver compiles at first use. AMD: its own `gfxNNNN`, or the generic target of
    its family (`gfx11-generic`); machine code for another chip is not run (HSA_OVERRIDE_GFX_VERSION can
    force it: see `verdict`)."""
    targets = list(arch_list)
    if arch.startswith("gfx"):
        if arch in targets:
            return arch
        fam = family(arch)
        return fam if fam in targets else None
    mine = _sm(arch)
    if mine is None:
        raise ValueError(f"unknown architecture {arch!r}: expected sm_XY or gfxNNNN")
    if arch in targets:
        return arch
    if f"{arch}a" in targets:              # arch-specific features: runs on exactly this architecture
        return f"{arch}a"
    sass = [t for t in targets if t.startswith("sm_") and _sm(t) and not t[-1].isalpha()
            and _sm(t)[0] == mine[0] and _sm(t) <= mine]
    if sass:
        return max(sass, key=_sm)
    ptx = [t for t in targets if t.startswith("compute_") and _sm(t) and not t[-1].isalpha() and _sm(t) <= mine]
    return max(ptx, key=_sm) if ptx else None


# --- the verdict ---------------------------------------------------------------------------------

def _vendor(arch: str | None) -> str | None:
    plat = backend.for_arch(arch)
    return plat.vendor if plat else None


def _install_torch(kind: str) -> str:
    return backend.get(kind).install_torch


def verdict(facts: Facts, *, runnable=runnable_target) -> Verdict:
    """Whether this stack can run the course's GPU code, and why. Pure: it reads only `facts`. `runnable(arch,
    arch_list)` picks the build's entry a GPU runs (lab 07 passes the learner's, exercise 7.1)."""
    if not facts.torch:
        return Verdict(UNSUPPORTED, facts.hw_arch, None, ("PyTorch is not installed",),
                       ("make run (installs the course), or pip install torch",))
    hw_vendor = _vendor(facts.hw_arch) or (facts.hw_gpu and ("AMD" if "AMD" in facts.hw_gpu.upper()
                                                           or "RADEON" in facts.hw_gpu.upper() else "NVIDIA"))
    if not facts.torch_cuda and not facts.torch_hip:
        if facts.hw_gpu:
            kind = (backend.for_vendor(hw_vendor) or backend.CUDA).name
            return Verdict(UNSUPPORTED, facts.hw_arch, None,
                           (f"the driver reports {facts.hw_gpu}, but PyTorch {facts.torch} is a CPU build: "
                            "it cannot use any GPU",), (_install_torch(kind),))
        return Verdict(CPU_ONLY, None, None,
                       (f"no GPU here; PyTorch {facts.torch} runs on the CPU: the labs use small sizes and "
                        "Triton's interpreter, and compile AMD and NVIDIA machine code ahead of time",))
    if facts.torch_cuda:
        return _verdict_cuda(facts, hw_vendor, runnable)
    return _verdict_rocm(facts, hw_vendor, runnable)


def _verdict_cuda(facts: Facts, hw_vendor, runnable) -> Verdict:
    cuda_major = int(str(facts.torch_cuda).split(".")[0])
    need = MIN_DRIVER_FOR_CUDA.get(cuda_major)
    reasons, install = [], []
    if hw_vendor == "AMD":
        return Verdict(UNSUPPORTED, facts.hw_arch, None,
                       (f"PyTorch {facts.torch} is a CUDA build, but the GPU is AMD's {facts.hw_gpu or facts.hw_arch}",),
                       (_install_torch("rocm"),))
    driver_major = int(facts.driver.split(".")[0]) if facts.driver and facts.driver.split(".")[0].isdigit() else None
    if need and driver_major is not None and driver_major < need:
        return Verdict(UNSUPPORTED, facts.hw_arch, None,
                       (f"PyTorch's CUDA {facts.torch_cuda} needs an NVIDIA driver >= {need}; this one is "
                        f"{facts.driver} (it supports CUDA up to {facts.driver_cuda or 'an older release'})",),
                       (f"update the NVIDIA driver to >= {need}", "or install a PyTorch built for the CUDA "
                        f"{facts.driver_cuda or 'release'} the driver supports ({TORCH_INDEX}/cuXYZ)"))
    arch = facts.torch_arch or facts.hw_arch
    if not facts.torch_gpu:
        if not facts.hw_gpu:
            return Verdict(CPU_ONLY, None, None, (f"PyTorch {facts.torch} is a CUDA build, but there is no NVIDIA GPU "
                                                 "here (nvidia-smi finds none): the labs run on the CPU",))
        hidden = {k: v for k, v in facts.env.items() if k == "CUDA_VISIBLE_DEVICES"}
        return Verdict(UNSUPPORTED, facts.hw_arch, None,
                       (f"the driver reports {facts.hw_gpu}, but PyTorch sees no GPU"
                        + (f" (CUDA_VISIBLE_DEVICES={hidden['CUDA_VISIBLE_DEVICES']!r})" if hidden else ""),),
                       ("unset CUDA_VISIBLE_DEVICES or name the GPU's index", "check `nvidia-smi` and the driver install"))
    target = runnable(arch, facts.arch_list)
    if need and facts.driver:
        reasons.append(f"driver {facts.driver} fits PyTorch's CUDA {facts.torch_cuda} (needs >= {need})")
    if target is None:
        return Verdict(UNSUPPORTED, arch, None,
                       (*reasons, f"PyTorch {facts.torch} ships kernels for {' '.join(facts.arch_list)}: "
                        f"none runs on {arch} (no {arch} machine code, no older PTX)"),
                       (f"a PyTorch build whose get_arch_list() has {arch} (a newer CUDA build: {TORCH_INDEX}/cu130)",))
    if target == arch:
        return Verdict(SUPPORTED, arch, target, (*reasons, f"PyTorch ships {arch} machine code"))
    if target.startswith("sm_"):
        return Verdict(SUPPORTED, arch, target, (*reasons, f"{target} machine code runs on {arch} (same major "
                                                 "architecture, binary compatible)"))
    return Verdict(COMPATIBLE, arch, target,
                   (*reasons, f"no {arch} machine code: the driver compiles the {target} PTX at first use "
                    "(a slow first run; kernels tuned for an older GPU)"),
                   (f"for native kernels: a PyTorch build with {arch} in get_arch_list()",))


def _verdict_rocm(facts: Facts, hw_vendor, runnable) -> Verdict:
    if hw_vendor == "NVIDIA":
        return Verdict(UNSUPPORTED, facts.hw_arch, None,
                       (f"PyTorch {facts.torch} is a ROCm build, but the GPU is NVIDIA's {facts.hw_gpu or facts.hw_arch}",),
                       (_install_torch("cuda"),))
    real = facts.hw_arch or facts.torch_arch
    override = facts.env.get("HSA_OVERRIDE_GFX_VERSION")
    reasons = []
    if facts.driver:
        reasons.append(f"amdgpu driver {facts.driver}" + (f", system ROCm {facts.rocm}" if facts.rocm else "")
                       + f"; PyTorch carries its own ROCm (HIP {facts.torch_hip}) libraries, so the kernel "
                         "driver is what must know the GPU")
    if not facts.torch_gpu and not override:
        if not facts.hw_gpu and not real:
            return Verdict(CPU_ONLY, None, None, (f"PyTorch {facts.torch} is a ROCm build, but there is no AMD GPU "
                                                 "here: the labs run on the CPU",))
    if real is None:
        return Verdict(UNSUPPORTED, None, None, (*reasons, "no AMD GPU architecture found (no KFD node, PyTorch sees no GPU)"),
                       ("check that the amdgpu driver is loaded (/dev/kfd exists) and the user is in the render group",))
    if override:
        try:
            forced = gfx_from_version(override)
        except ValueError as err:
            return Verdict(UNSUPPORTED, real, None, (*reasons, str(err)), ("unset HSA_OVERRIDE_GFX_VERSION",))
        if forced != real:
            how = (f"HSA_OVERRIDE_GFX_VERSION={override} makes the ROCm runtime report {forced} instead of {real}, "
                   f"so {forced} machine code is loaded and run on the {real}")
            if forced not in facts.arch_list:
                return Verdict(UNSUPPORTED, real, forced, (*reasons, how, f"but PyTorch ships no {forced} code either "
                               f"(it has {' '.join(facts.arch_list)})"), ("unset HSA_OVERRIDE_GFX_VERSION",
                               f"a PyTorch build with {real} in get_arch_list()"))
            if family(forced) != family(real) or family(real) is None:
                return Verdict(UNSUPPORTED, real, forced,
                               (*reasons, how, f"{forced} and {real} are not of one ISA family: expect faults, "
                                "hangs or garbage"), ("unset HSA_OVERRIDE_GFX_VERSION",
                                                      f"a PyTorch build with {real} in get_arch_list()"))
            return Verdict(COMPATIBLE, real, forced,
                           (*reasons, how, f"both are {family(real)} chips, so most kernels work; but the compiler "
                            f"built that code for {forced}'s exact ISA, hardware bugs and limits (instructions, "
                            f"workarounds, tuning) and nothing checks that it fits a {real}: results can be wrong "
                            "without an error. Compare against a CPU reference (the divergence finder) before "
                            "trusting it"),
                           (f"for native kernels: a PyTorch build with {real} in get_arch_list()",))
    if facts.torch_arch and facts.torch_arch != real:
        reasons.append(f"PyTorch reports {facts.torch_arch} for a {real}")
    target = runnable(real, facts.arch_list)
    if target == real:
        lanes = f", {facts.warp_size}-lane wavefronts" if facts.warp_size else ""
        return Verdict(SUPPORTED, real, real, (*reasons, f"PyTorch ships {real} machine code{lanes}"))
    if target:
        return Verdict(COMPATIBLE, real, target, (*reasons, f"no {real} machine code, but {target} code objects run "
                                                  "on every chip of the family (LLVM generic target)"),
                       (f"for tuned kernels: a PyTorch build with {real} in get_arch_list()",))
    fam = family(real)
    sibling = next((t for t in facts.arch_list if fam and family(t) == fam), None)
    detail = [f"PyTorch {facts.torch} ships kernels for {' '.join(facts.arch_list)}: not for {real}; its first "
              "GPU kernel fails with 'HIP error: invalid device function' (the model loads, then fails)"]
    fixes = [f"a PyTorch build with {real} in get_arch_list() (PyTorch's ROCm builds added gfx950, gfx1150 and "
             "gfx1151 to their target list: a newer ROCm wheel, or AMD's own ROCm wheels for the chip)"]
    if sibling:
        major, minor, step = int(sibling[3:-2]), int(sibling[-2], 16), int(sibling[-1], 16)
        fixes.append(f"at your own risk: HSA_OVERRIDE_GFX_VERSION={major}.{minor}.{step} runs the {sibling} code "
                     f"(same {fam} family; see the compatible-ISA verdict for why it can give wrong results)")
    return Verdict(UNSUPPORTED, real, None, (*reasons, *detail), tuple(fixes))


# --- gathering the facts of this machine ---------------------------------------------------------

def _run(cmd: list[str], timeout: float = 10) -> str:
    """stdout of a tool, or "" (missing, failed, timed out): never raises, never hangs."""
    if shutil.which(cmd[0]) is None:
        return ""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout if done.returncode == 0 else ""


def parse_nvidia_smi(query: str, header: str = "") -> dict:
    """`nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader` (first GPU) and the
    plain `nvidia-smi` header (its "CUDA Version: X.Y")."""
    out = {}
    line = next((l for l in query.splitlines() if l.strip()), "")
    parts = [p.strip() for p in line.split(",")]
    if len(parts) >= 3:
        out["hw_gpu"], out["driver"] = parts[0], parts[1]
        if re.fullmatch(r"\d+\.\d+", parts[2]):
            major, minor = parts[2].split(".")
            out["hw_arch"] = f"sm_{major}{minor}"
    m = re.search(r"CUDA Version:\s*([\d.]+)", header)
    if m:
        out["driver_cuda"] = m.group(1)
    return out


def parse_amd_smi_version(text: str) -> dict:
    """`amd-smi version`: "AMDSMI Tool: ... | AMDSMI Library version: ... | ROCm version: 6.4.1 | amdgpu version: 6.12.12"."""
    out = {}
    for key, name in (("rocm", r"ROCm version"), ("driver", r"amdgpu version")):
        m = re.search(name + r":\s*([^|\s]+)", text)
        if m and m.group(1) != "N/A":
            out[key] = m.group(1)
    return out


def parse_rocm_smi_driver(text: str) -> str | None:
    """`rocm-smi --showdriverversion`: the "Driver version: X" line (rocm-smi exits 0 even on errors)."""
    m = re.search(r"Driver version:\s*(\S+)", text)
    return m.group(1) if m else None


def kfd_gpus(root: str | Path = "/sys/class/kfd/kfd/topology/nodes") -> list[str]:
    """The gfx names of the GPU nodes of the AMD kernel driver's topology (CPU nodes have version 0).
    This is the chip's real target, whatever HSA_OVERRIDE_GFX_VERSION makes the runtime report."""
    found = []
    for props in sorted(Path(root).glob("*/properties")):
        try:
            m = re.search(r"^gfx_target_version\s+(\d+)", props.read_text(), re.MULTILINE)
        except OSError:
            continue
        if m and int(m.group(1)):
            found.append(gfx_from_target_version(int(m.group(1))))
    return found


def gather() -> Facts:
    """The facts of this machine. Tools that are missing, fail or hang (10 s) leave their fields empty."""
    f: dict = {"python": platform.python_version(),
               "env": {k: os.environ[k] for k in _ENV_VARS if k in os.environ}}
    try:
        import torch

        f["torch"] = torch.__version__
        f["torch_cuda"] = torch.version.cuda
        f["torch_hip"] = str(torch.version.hip) if torch.version.hip else None
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            f["arch_list"] = tuple(torch.cuda.get_arch_list())
            f["torch_gpu"] = props.name
            f["torch_arch"] = backend.this_torch_build().arch_of(props)
            f["warp_size"] = getattr(props, "warp_size", None)
        elif torch.version.cuda or torch.version.hip:
            f["arch_list"] = tuple(torch.cuda.get_arch_list())
    except ImportError:
        pass
    nv = parse_nvidia_smi(_run(["nvidia-smi", "--query-gpu=name,driver_version,compute_cap", "--format=csv,noheader"]),
                          _run(["nvidia-smi"]))
    f.update(nv)
    if not nv:
        amd = parse_amd_smi_version(_run(["amd-smi", "version"]))
        f.update(amd)
        try:
            f["driver"] = Path("/sys/module/amdgpu/version").read_text().strip() or f.get("driver")
        except OSError:
            f["driver"] = f.get("driver") or parse_rocm_smi_driver(_run(["rocm-smi", "--showdriverversion"]))
        gpus = kfd_gpus()
        if gpus:
            f["hw_arch"] = gpus[0]
            f["hw_gpu"] = f"AMD GPU ({gpus[0]}, kernel driver topology)"
    try:
        import triton

        f["triton"] = triton.__version__
        try:
            target = triton.runtime.driver.active.get_current_target()
            arch = target.arch if isinstance(target.arch, str) else f"sm_{target.arch}"
            f["triton_target"] = f"{target.backend} {arch} {target.warp_size}"
        except Exception:   # no GPU driver: the interpreter and ahead-of-time compilation only
            f["triton_target"] = None
    except ImportError:
        pass
    return Facts(**{k: v for k, v in f.items() if v is not None})


# --- fixtures ------------------------------------------------------------------------------------

def machines() -> dict:
    """The described machines of `utils/data/doctor_machines.json`: {key: {"label", "about", "expect", "facts"}}."""
    data = json.loads(MACHINES_FILE.read_text())
    data.pop("_about", None)
    return data


def load_fixture(key: str) -> Facts:
    table = machines()
    if key not in table:
        raise KeyError(f"no machine {key!r} in {MACHINES_FILE.name}; known: {', '.join(table)}")
    entry = table[key]
    return Facts.from_json({"label": entry["label"], "about": entry.get("about", ""), **entry["facts"]})


# --- output --------------------------------------------------------------------------------------

def rows(facts: Facts) -> list[tuple[str, str]]:
    """(what, value) rows of the doctor's table."""
    build = (f"CUDA {facts.torch_cuda}" if facts.torch_cuda else f"ROCm/HIP {facts.torch_hip}" if facts.torch_hip
             else "CPU only")
    triton = (f"{facts.triton}, target {facts.triton_target}" if facts.triton_target
              else f"{facts.triton}, no GPU target (interpreter / ahead-of-time only)" if facts.triton else "not installed")
    out = [
        ("machine", facts.label),
        ("GPU (driver)", f"{facts.hw_gpu or 'none found'}" + (f", {facts.hw_arch}" if facts.hw_arch else "")),
        ("driver", (facts.driver or "none found") + (f" (CUDA <= {facts.driver_cuda})" if facts.driver_cuda else "")
         + (f", ROCm {facts.rocm}" if facts.rocm else "")),
        ("PyTorch", f"{facts.torch or 'not installed'} ({build})" if facts.torch else "not installed"),
        ("GPU (PyTorch)", f"{facts.torch_gpu}, {facts.torch_arch}" + (f", {facts.warp_size} lanes" if facts.warp_size else "")
         if facts.torch_gpu else "none"),
        ("kernels for", " ".join(facts.arch_list) or "-"),
        ("Triton", triton),
    ]
    arch = facts.torch_arch or facts.hw_arch
    if backend.for_arch(arch):
        dialect = backend.fp8_dialect_of(arch)
        out.append(("FP8 dialect", {"ocp": "OCP (float8_e4m3fn, float8_e5m2)", "fnuz": "FNUZ (float8_e4m3fnuz, float8_e5m2fnuz)"}
                    .get(dialect, "none: no FP8 matrix units the course knows of") + f" on {arch} (lab 03, section 8)"))
    if facts.env:
        out.append(("environment", " ".join(f"{k}={v}" for k, v in sorted(facts.env.items()))))
    return out


def report(facts: Facts, result: Verdict | None = None) -> str:
    result = result or verdict(facts)
    width = max(len(k) for k, _ in rows(facts))
    lines = [f"{k:>{width}}: {v}" for k, v in rows(facts)]
    return "\n".join(lines + [str(result)])


def summary(facts: Facts | None = None) -> str:
    """One line for lab 00: the verdict, the GPU and what its code is."""
    facts = facts or gather()
    v = verdict(facts)
    what = (f"{facts.torch_gpu or facts.hw_gpu or 'no GPU'}" + (f" ({v.arch}" + (f", runs {v.runs} code" if v.runs and v.runs != v.arch else "") + ")" if v.arch else ""))
    first = v.install[0] if v.level not in (SUPPORTED, CPU_ONLY) and v.install else ""
    return f"doctor: {v.level.upper()}: {what}, PyTorch {facts.torch}" + (f"; fix: {first}" if first else "")


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m utils.clinic.doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--machine", help=f"a described machine instead of this one ({', '.join(machines())})")
    parser.add_argument("--json", action="store_true", help="print the facts as JSON (to describe a machine)")
    args = parser.parse_args(argv)
    facts = load_fixture(args.machine) if args.machine else gather()
    if args.json:
        print(json.dumps(facts.to_json(), indent=2))
        return 0
    print(report(facts))
    return 0 if verdict(facts).level != UNSUPPORTED else 1


if __name__ == "__main__":
    raise SystemExit(main())
