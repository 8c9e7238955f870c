import json
import os
from pathlib import Path

import pytest

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
