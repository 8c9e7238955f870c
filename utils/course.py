"""One call that starts a lab: its parameters checked against its own declaration, the device, the report, the grader.

    dev, rec, ex = course.start("03_bf16_matmul", globals())

`start` reads the lab's `parameters` cell (the one declaration of each parameter: `utils.params.declarations`), so
the same value is refused the same way whether it came from the harness, from papermill or from an edit in
JupyterLab. It refuses a name papermill injected that the lab does not declare (with the nearest one), sets the
course's run environment where the kernel lacks it (course.env: its caches in the private build folder), picks the
device, switches Triton to its interpreter on a CPU before Triton is imported, and starts the lab's recorder
(`utils.record`) and grader (`utils.exercises`).
"""
from __future__ import annotations

import ast
import os
import re

import nbformat

from utils import device as devices
from utils import exercises, params, record, solutions
from utils.base.paths import LABS_DIR, run_environment

_PARAMETER_NAME = re.compile(r"[A-Z][A-Z0-9_]*")
PAPERMILL_HEADER = "# Parameters"     # the first line of the cell papermill injects after the parameters cell


def parameters_cell(notebook) -> str:
    """The source of a notebook's cell tagged `parameters` (a notebook path or a node)."""
    nb = nbformat.read(notebook, as_version=4) if not hasattr(notebook, "cells") else notebook
    cells = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    if len(cells) != 1:
        raise ValueError(f"{getattr(notebook, 'name', 'the notebook')}: {len(cells)} cells tagged 'parameters' (one "
                         "is the declaration of the lab's parameters)")
    return cells[0].source


def declared(lab: str) -> dict[str, params.Declared]:
    """The lab's parameters as its parameters cell declares them (the solution's; a learner's copy of the labs
    without solutions/ reads labs/)."""
    try:
        path = solutions.notebook_path(lab)
    except ValueError:
        path = LABS_DIR / f"{lab}.ipynb"
    return params.declarations(parameters_cell(path), where=f"{path.name}'s parameters cell")


def injected_names(scope: dict) -> list[str]:
    """Names assigned by the last cell papermill injected into this kernel (none outside papermill)."""
    for source in reversed(scope.get("In") or []):
        if source.splitlines()[:1] == [PAPERMILL_HEADER]:
            return [t.id for node in ast.parse(source).body if isinstance(node, ast.Assign)
                    for t in node.targets if isinstance(t, ast.Name)]
    return []


def check_parameters(lab: str, scope: dict) -> None:
    """Check every declared parameter's value in `scope` (a notebook's globals) and write back the normalised
    value; an unknown injected name or a bad value raises ParameterError naming it and what it allows."""
    known = declared(lab)
    for name in injected_names(scope):
        if _PARAMETER_NAME.fullmatch(name) and name not in known:
            raise params.ParameterError(params.unknown_message(name, known))
    for name, declaration in known.items():
        if name not in scope:
            raise params.ParameterError(f"{name} is not set: run the parameters cell first")
        scope[name] = declaration.check(scope[name])


def start(lab: str, scope: dict):
    """Start lab `lab` from its notebook: returns (device, recorder, grader)."""
    check_parameters(lab, scope)
    for name, value in run_environment().items():   # a kernel started outside make: the course's private caches
        os.environ.setdefault(name, value)           # (torch.compile's is /tmp/torchinductor_$USER otherwise)
    dev = devices.detect(scope["DEVICE"])
    if not dev.is_gpu:
        os.environ["TRITON_INTERPRET"] = "1"   # Triton kernels run on CPU tensors, in NumPy (before triton is imported)
    rec = record.start(lab, dev)
    rec.given({name: scope[name] for name in injected_names(scope) if name in declared(lab)})
    ex = exercises.Lab(lab)                 # grades the exercises; an unfinished one prints NOT DONE
    return dev, rec, ex
