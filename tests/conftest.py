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

from utils.base.paths import run_environment  # noqa: E402

# The course's run environment (course.env) also when pytest is started without make; a value already set wins.
os.environ.update(run_environment())

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"

# `make test` runs two xdist workers with `--dist loadscope`: a notebook's cells (nbval), a test module, and a test
# class stay on one worker (each generated lab's run is a class of its own: tests/test_notebooks.py). With
# `--no-loadscope-reorder` the scopes go out in collection order, which this hook makes longest first, so that
# neither worker is left with the long tail. Seconds: `make test` (docs/authoring.md's budget table; refresh with
# `python tests/budget.py --write`). Scopes not listed are short and follow in collection order.
LONGEST_FIRST = json.loads((DATA / "test_groups.json").read_text())["seconds"]


def xdist_scope_of(nodeid: str) -> str:
    """What `--dist loadscope` keeps on one worker: a test's module, class or notebook."""
    return nodeid.rsplit("::", 1)[0]


# `make test-gpu` runs the gpu-marked tests in parts, each one pytest command that finishes within 8 minutes on an
# H100 (the GPU machine's limit is 10 minutes a command; README, "GPU tests", has each part's count and time):
# `--gpu-part NAME` keeps the tests of that part's files. The Makefile's GPU_PARTS lists the names in the order
# `make test-gpu` runs them. Every file with gpu tests belongs to one part: with --gpu-part, collection stops
# with a usage error naming a file that is in none.
GPU_PARTS = {
    "kernels": ("test_lab01.py", "test_occupancy.py", "test_timing.py"),   # lab 01's hand-written kernels (memcheck
                                                            # too), Triton's; the timer against do_bench
    "warps": ("test_lab02.py",),                            # lab 02's hand-written kernels (memcheck too)
    "matmul": ("test_lab03.py",),                           # in 8 workers (the Makefile's GPU_WORKERS)
    "attention": ("test_lab04.py",),
    "models": ("test_decode.py", "test_lab06.py", "test_lab07.py"),
}


def pytest_addoption(parser):
    parser.addoption("--gpu-part", choices=sorted(GPU_PARTS), default=None,
                     help="only the tests of this part's files (tests/conftest.py's GPU_PARTS); `make test-gpu PART=...`")


def gpu_part(config, items):
    """With --gpu-part NAME: keep the tests of NAME's files (the others deselected); refuse gpu tests in no part."""
    part = config.getoption("--gpu-part")
    if part is None:
        return
    placed = {name for files in GPU_PARTS.values() for name in files}
    stray = sorted({Path(item.path).name for item in items if item.get_closest_marker("gpu")} - placed)
    if stray:
        raise pytest.UsageError(f"gpu tests in {', '.join(stray)} belong to no part: add the file to one of "
                                "GPU_PARTS in tests/conftest.py")
    keep = [item for item in items if Path(item.path).name in GPU_PARTS[part]]
    if len(keep) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if Path(item.path).name not in GPU_PARTS[part]])
        items[:] = keep


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    gpu_part(config, items)
    order = {scope: i for i, scope in enumerate(sorted(LONGEST_FIRST, key=LONGEST_FIRST.get, reverse=True))}
    items.sort(key=lambda item: order.get(xdist_scope_of(item.nodeid), len(order)))   # stable: cells keep their order


@pytest.fixture(scope="session")
def recorded():
    """Recorded device properties: {"mi300x": {"hip": ..., "cuda": ..., "properties": {...}}, ...}."""
    data = json.loads((DATA / "device_properties.json").read_text())
    data.pop("_about")
    return data


@pytest.fixture(autouse=True)
def environment_restored():
    """Each test starts from the same environment: what a test (or the harness it runs in-process, which sets
    COURSE_RUN_ID and the notebooks' environment) changes in os.environ ends with it."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture
def build_dir(tmp_path, monkeypatch):
    """A private build folder (results, status, report) for one test."""
    monkeypatch.setenv("COURSE_BUILD_DIR", str(tmp_path / "build"))
    return tmp_path / "build"


def notebook_device() -> str:
    """The device notebooks run on in the tests: COURSE_DEVICE (set by `make test DEVICE=...`)."""
    return os.environ.get("COURSE_DEVICE") or "auto"
