"""The environment definitions, pyproject.toml and constraints.txt agree on the course's packages."""
import re
import tomllib

import pytest
import yaml
from packaging.requirements import Requirement

from conftest import ROOT

ENV_FILES = ["environment-cuda.yml", "environment-rocm.yml", "binder/environment.yml"]
# Per environment: where Triton comes from (ROCm: PyTorch's ROCm wheel brings pytorch-triton-rocm).
TRITON_BY_TORCH = {"environment-cuda.yml": "torch", "environment-rocm.yml": "torch",
                   "binder/environment.yml": "triton"}


def name_of(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def constraints() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[name_of(name)] = version.strip()
    return pins


def env_packages(path):
    env = yaml.safe_load((ROOT / path).read_text())
    conda, pip, options = set(), {}, []
    for dep in env["dependencies"]:
        if isinstance(dep, dict):
            for item in dep["pip"]:
                if item.startswith("-"):
                    options.append(item)
                else:
                    pip[name_of(item)] = item
        else:
            conda.add(name_of(dep))
    return env, conda, pip, options


@pytest.mark.parametrize("path", ENV_FILES)
def test_environment_has_the_course_package_set(path):
    _, conda, pip, _ = env_packages(path)
    have = conda | set(pip)
    py312 = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
             "platform_machine": "x86_64"}   # the environments' Python: a dependency marked for 3.11 is not theirs
    wanted = [d for d in pyproject()["dependencies"]
              if Requirement(d).marker is None or Requirement(d).marker.evaluate(py312)]
    missing = {name_of(d) for d in wanted} - have
    assert not missing, f"{path} lacks {sorted(missing)} that pyproject.toml depends on"
    if TRITON_BY_TORCH[path] == "triton":
        assert "triton" in have


@pytest.mark.parametrize("path", ENV_FILES)
def test_environment_pins_torch_as_constraints_do(path):
    env, conda, pip, options = env_packages(path)
    assert "python=3.12" in env["dependencies"], "Python 3.12: the GPU machine's version"
    version = re.search(r"==([\w.]+)", pip["torch"]).group(1)
    assert version == constraints()["torch"], f"{path} pins torch {version}, constraints.txt {constraints()['torch']}"


@pytest.mark.parametrize("path, index", [("environment-cuda.yml", "https://download.pytorch.org/whl/cu"),
                                         ("environment-rocm.yml", "https://download.pytorch.org/whl/rocm")])
def test_gpu_environments_take_torch_from_pytorch_index_only(path, index):
    _, _, pip, options = env_packages(path)
    assert any(o.startswith(f"--index-url {index}") for o in options)
    assert not any(o.startswith("--extra-index-url") for o in options)
    assert set(pip) == {"torch"}, "only PyTorch comes through the PyTorch index; the rest from conda-forge"


def test_binder_installs_the_cpu_build_and_the_constraints():
    _, _, pip, options = env_packages("binder/environment.yml")
    assert pip["torch"].endswith("+cpu")
    # no relative -c path (its meaning depends on where the builder runs pip): the pins are written in the file
    # (tests/test_containers.py checks they agree with constraints.txt) and postBuild, at the repository root,
    # applies constraints.txt to the rest
    assert not [o for o in options if o.startswith("-c")]
    assert "-c constraints.txt" in (ROOT / "binder" / "postBuild").read_text()
    assert (ROOT / "binder" / "postBuild").stat().st_mode & 0o111


def test_constraints_pin_every_course_package():
    pins = constraints()
    project = pyproject()
    names = {name_of(d) for d in project["dependencies"]}
    for extra in project["optional-dependencies"].values():
        names |= {name_of(d) for d in extra}
    assert not names - set(pins), f"constraints.txt does not pin {sorted(names - set(pins))}"
    # PyPI's CUDA build of torch 2.13.0 requires exactly this Triton; the two pins must move together.
    assert (pins["torch"], pins["triton"]) == ("2.13.0", "3.7.1")
