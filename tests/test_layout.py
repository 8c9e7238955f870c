"""utils/ shows its architecture: the layers import only downwards, with no circles and no imports hidden in functions;
every module is listed where a reader looks (utils/__init__.py, the README); the run environment is one file."""
import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from utils import backend
from utils.base import paths

UTILS = ROOT / "utils"
# layer of each part of utils/ (a module may import its own layer or a lower one; lab families may import each other
# in the order of the labs: multigpu, clinic and quant build on llm)
LAYERS = {"base": 0, "kit": 1, "llm": 2, "multigpu": 3, "clinic": 3, "quant": 3, "graders": 4, "machinery": 5}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part_of(module: str) -> str:
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 2 and pieces[1] in LAYERS else "kit"


def course_imports(path: Path):
    """(imported utils module, line, inside a function?) for every import of the course's own modules."""
    tree = ast.parse(path.read_text())
    inner = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f)}
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: relative import (the course imports utils.X by name)"
            base = node.module or ""
            names = [f"{base}.{a.name}" if (UTILS.parent / f"{base}.{a.name}".replace(".", "/")).with_suffix(".py")
                     .exists() or (UTILS.parent / f"{base}.{a.name}".replace(".", "/")).is_dir() else base
                     for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            if name == "utils" or name.startswith("utils."):
                yield name, node.lineno, id(node) in inner


MODULES = sorted(p for p in UTILS.rglob("*.py") if "__pycache__" not in p.parts)


def test_imports_run_downwards_with_no_circle_and_none_hidden_in_functions():
    graph, problems = {}, []
    for path in MODULES:
        me = module_name(path)
        for target, line, late in course_imports(path):
            graph.setdefault(me, set()).add(target)
            where = f"{path.relative_to(ROOT)}:{line} imports {target}"
            if late:
                problems.append(where + " inside a function")
            if target != "utils" and LAYERS[part_of(target)] > LAYERS[part_of(me)]:
                problems.append(where + f": {part_of(me)} may not import {part_of(target)} (upwards)")
            if me.startswith("utils.base") and not target.startswith("utils.base"):
                problems.append(where + ": utils/base imports nothing else of the course")
    assert not problems, "\n".join(problems)

    def reach(start, node, seen):
        for nxt in graph.get(node, ()):
            if nxt == start:
                return True
            if nxt not in seen:
                seen.add(nxt)
                if reach(start, nxt, seen):
                    return True
        return False
    assert [m for m in graph if reach(m, m, set())] == []


def test_every_module_has_a_docstring_and_is_listed_for_readers():
    listing = (UTILS / "__init__.py").read_text()
    readme = (ROOT / "README.md").read_text()
    for path in MODULES:
        assert ast.get_docstring(ast.parse(path.read_text())), f"{path.relative_to(ROOT)} has no docstring"
        if path.name == "__init__.py":
            continue
        assert re.search(rf"\b{path.stem}\b", listing), f"utils/__init__.py does not list {path.stem}"
        assert f"`{path.name}`" in readme, f"the README's utils/ table does not list {path.name}"


def test_the_shared_import_circles_tool_agrees():
    tool = ROOT.parent / "shared" / "tools" / "import-circles"
    if not tool.exists():
        pytest.skip(f"{tool} is not beside this checkout")
    out = subprocess.run([sys.executable, str(tool), str(UTILS)], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip().endswith("0 circles, 0 function-level imports of sibling modules"), out.stdout


# --- the vendor as a record ---------------------------------------------------------------------------------

def test_every_gpu_backend_record_is_complete():
    for plat in backend.GPUS:
        assert plat.is_gpu and plat.vendor and plat.runtime and plat.compiler and plat.source_suffix
        assert plat.lane_group in ("wavefront", "warp") and plat.unit in ("CUs", "SMs")
        assert plat.triton_targets and plat.topology_commands and plat.torch_version and plat.install_torch
        assert all(name.startswith(plat.arch_prefix) for name in plat.triton_targets)
    assert backend.DEVICE_CHOICES == ("auto", "cpu", "gpu", "cuda", "rocm")
    assert not backend.CPU.is_gpu and backend.CPU.torch_device == "cpu"


@pytest.mark.parametrize("props, versions, name, arch", [
    ({"name": "AMD Instinct MI300X", "gcnArchName": "gfx942:sramecc+:xnack-"}, {"hip": "6.4"}, "rocm", "gfx942"),
    ({"name": "NVIDIA H100", "major": 9, "minor": 0}, {"cuda": "13.0"}, "cuda", "sm_90"),
])
def test_a_backend_is_found_from_the_build_and_names_the_architecture(props, versions, name, arch):
    plat = backend.of_torch_build(**versions)
    assert plat.name == name and plat.arch_of(props) == arch
    assert backend.for_arch(arch) is plat and backend.get(name) is plat
    assert backend.of_torch_build() is backend.CPU


def test_an_unknown_backend_or_missing_architecture_is_named():
    with pytest.raises(ValueError, match="unknown backend 'xpu'; known: cuda, rocm, cpu"):
        backend.get("xpu")
    with pytest.raises(ValueError, match="reports no gfx architecture"):
        backend.ROCM.arch_of({"name": "odd", "gcnArchName": ""})
    with pytest.raises(ValueError, match="reports no compute capability"):
        backend.CUDA.arch_of({"name": "odd"})


def test_no_kit_module_compares_vendor_strings():
    """timing, params, isa, device ask the record: no `== "rocm"` / `in ("cuda", "rocm")` left in them."""
    for name in ("timing", "params", "isa", "device"):
        text = (UTILS / f"{name}.py").read_text()
        assert not re.search(r"""(==|!=|\bin)\s*\(?["'](rocm|cuda)["']""", text), name


# --- one run environment ------------------------------------------------------------------------------------

def test_course_env_is_the_one_run_environment():
    declared = paths.course_env_file()
    assert {"HF_HUB_OFFLINE", "HF_HUB_DISABLE_PROGRESS_BARS", "HF_HOME", "TRITON_CACHE_DIR",
            "JUPYTER_RUNTIME_DIR"} <= set(declared)
    env = paths.run_environment(Path("/learner/build"), keep_existing=False)
    assert env["HF_HOME"] == "/learner/build/cache/huggingface" and env["COURSE_BUILD_DIR"] == "/learner/build"
    assert "include course.env" in (ROOT / "Makefile").read_text()
    for user in (".ci/gpu-reference", "binder/start", "docs/jupyterhub/jupyterhub_config.py"):
        text = (ROOT / user).read_text()
        assert "utils.base.paths" in text, f"{user} does not read course.env"
        for name in declared:          # not spelled out again
            assert not re.search(rf"\b{name}=", text) and f'"{name}":' not in text, f"{user} sets {name} itself"


def test_course_env_refuses_a_line_it_cannot_read(tmp_path):
    bad = tmp_path / "course.env"
    bad.write_text("HF_HUB_OFFLINE=1\nexport X = 2\n")
    with pytest.raises(ValueError, match=r"course.env:2: not NAME=value"):
        paths.course_env_file(bad)


def test_the_shell_form_of_the_run_environment():
    out = subprocess.run([sys.executable, "-m", "utils.base.paths", "env"], capture_output=True, text=True,
                         check=True, cwd=ROOT, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}).stdout
    assert "export HF_HUB_OFFLINE=1" in out and f"export HF_HOME={ROOT}/build/cache/huggingface" in out
