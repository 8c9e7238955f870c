import json
import os
from pathlib import Path

import pytest

# Triton decides between compiled and interpreted kernels when they are defined, and test modules (and
# the labs' exported modules they load) define kernels at import: so the choice is made once, here, for
# the whole test process. No GPU -> Triton's interpreter on CPU tensors (ahead-of-time compilation for
# gfx942/sm_90 then runs in a child process, see utils.isa).
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:
    pass

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture(scope="session")
def recorded():
    """Recorded device properties: {"mi300x": {"hip": ..., "cuda": ..., "properties": {...}}, ...}."""
    data = json.loads((DATA / "device_properties.json").read_text())
    data.pop("_about")
    return data


@pytest.fixture
def build_dir(tmp_path, monkeypatch):
    """A private build folder (results, status, report) for one test."""
    monkeypatch.setenv("COURSE_BUILD_DIR", str(tmp_path / "build"))
    return tmp_path / "build"


def notebook_device() -> str:
    """The device notebooks run on in the tests: COURSE_DEVICE (set by `make test DEVICE=...`)."""
    return os.environ.get("COURSE_DEVICE") or "auto"
