""".ci/stage-vllm's pure parts, on small synthetic inputs (no network, no vLLM): splitting and joining with hash
checks, packing parts and wheels into calls, the import tracer, the pin check, markers and versions, the repacked
wheel's RECORD, the dependency closure and the device commands."""
import hashlib
import importlib.machinery
import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import ROOT


def _load():
    loader = importlib.machinery.SourceFileLoader("stage_vllm", str(ROOT / ".ci" / "stage-vllm"))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("stage_vllm", loader))
    sys.modules["stage_vllm"] = module  # dataclasses look their module up while the file runs
    loader.exec_module(module)
    return module


sv = _load()


# ---------------------------------------------------------------- splitting, joining, packing

def test_split_then_join_gives_the_file_back(tmp_path):
    data = bytes(range(256)) * 3 + b"tail"
    src = tmp_path / "x.whl"
    src.write_bytes(data)
    parts = sv.split_file(src, 100, tmp_path / "parts")
    assert [p.name for p in parts[:2]] == ["x.whl.part-01", "x.whl.part-02"]
    assert len(parts) == 8 and all(p.stat().st_size == 100 for p in parts[:-1]) and parts[-1].stat().st_size == 72
    out = sv.join_parts(parts, tmp_path / "joined.whl", hashlib.sha256(data).hexdigest())
    assert out.read_bytes() == data


def test_join_refuses_parts_that_do_not_make_the_hash(tmp_path):
    src = tmp_path / "x.whl"
    src.write_bytes(b"a" * 250)
    parts = sv.split_file(src, 100, tmp_path / "parts")
    expected = hashlib.sha256(b"a" * 250).hexdigest()
    with pytest.raises(ValueError, match="sha256"):
        sv.join_parts(parts[::-1][:2], tmp_path / "joined.whl", expected)  # a part missing
    assert not (tmp_path / "joined.whl").exists()
    parts[1].write_bytes(b"b" * 100)  # a part damaged
    with pytest.raises(ValueError, match="expected " + expected):
        sv.join_parts(parts, tmp_path / "joined.whl", expected)


def test_pack_calls_puts_one_part_a_call_and_wheels_where_there_is_room(tmp_path):
    def file(name, size):
        (tmp_path / name).write_bytes(b"x" * size)
        return tmp_path / name

    parts = [file("v.whl.part-01", 90), file("v.whl.part-02", 40)]
    wheels = [file("a.whl", 30), file("b.whl", 15), file("c.whl", 50)]
    calls = sv.pack_calls(parts, wheels, 100)
    assert [[p.name for p in call] for call in calls] == [
        ["v.whl.part-01"], ["v.whl.part-02", "c.whl"], ["a.whl", "b.whl"]]
    with pytest.raises(ValueError, match="larger than one call"):
        sv.pack_calls(parts, [file("huge.whl", 101)], 100)


def test_call_folders_hold_sums_of_their_files_and_the_whole_wheel(tmp_path):
    (tmp_path / "stage").mkdir()
    part = tmp_path / "stage" / "v.whl.part-01"
    part.write_bytes(b"part")
    dep = tmp_path / "d.whl"
    dep.write_bytes(b"dep")
    calls = sv.write_call_folders(tmp_path / "out", [[part], [dep]], Path("v.whl"), "f" * 64)
    assert [c["folder"] for c in calls] == [".vllm/1", ".vllm/2"] and calls[1]["carry"] == [".vllm/2"]
    sums = (tmp_path / "out" / "1" / "SHA256SUMS").read_text()
    assert sums == f"{hashlib.sha256(b'part').hexdigest()}  v.whl.part-01\n"
    assert (tmp_path / "out" / "2" / "WHEEL.sha256").read_text() == f"{'f' * 64}  v.whl\n"
    assert dep.exists() and not part.exists()  # wheels are copied, parts moved


def test_device_commands_fit_a_call_and_check_what_arrived():
    first, last = (sv.call_command(k, 3, f".vllm/{k}", "vllm-0.26.0-x.whl", ["pkgs"]) for k in (1, 3))
    assert first.startswith("set -e; rm -rf /root/vllm-parts;") and "sha256sum -c --strict" in first
    assert "check_present.py" in first and "pip install" not in first
    assert "seq 1 2" in last and "fresh machine" in last and "sha256sum -c --strict WHEEL.sha256" in last
    assert "--no-index --no-deps --no-compile --no-cache-dir --target /root/vllm-site" in last
    assert "export PYTHONPATH=/root/vllm-site:/root/vllm-site/pkgs" in last
    assert max(len(first), len(last)) < 2000


# ---------------------------------------------------------------- the import tracer

PACKAGE = {
    "pkg/__init__.py": "import os\nimport requests\nfrom . import core\n",
    "pkg/core.py": """\
from typing import TYPE_CHECKING
import contextlib
import numpy as np
from .util import helper
from pkg import sub
try:
    import fancy
except ImportError:
    fancy = None
with contextlib.suppress(ImportError):
    import suppressed
if TYPE_CHECKING:
    import typedep
if current_platform.is_rocm():
    import rocmdep
    from . import rocm_only
if has_thing():
    import thing
if FLAG:
    import flagdep
    from .cond import x


def f():
    import lazydep
    from . import lazymod


class K:
    import classdep
""",
    "pkg/util.py": "from .sub.deep import z\nhelper = 1\n",
    "pkg/sub/__init__.py": "",
    "pkg/sub/deep.py": "import yaml\nfrom ..util import helper\nfrom .. import core\nz = 2\n",
    "pkg/lazymod.py": "import neverloaded\n",
    "pkg/rocm_only.py": "import rocmthird\n",
    "pkg/cond.py": "import condthird\nx = 3\n",
    "pkg/entry.py": "def main():\n    import entrydep\n    from pkg import lazymod\n\n\ndef other():\n    import no\n",
    "pkg/_ext.abi3.so": "",
}


@pytest.fixture
def tiny_package(tmp_path):
    for name, text in PACKAGE.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    modules = sv.index_modules(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    return modules, lambda path: (tmp_path / path).read_text()


def test_index_modules_knows_packages_modules_and_extensions(tiny_package):
    modules, _ = tiny_package
    assert modules["pkg"] == ("pkg/__init__.py", True) and modules["pkg.sub.deep"] == ("pkg/sub/deep.py", False)
    assert modules["pkg._ext"] == ("pkg/_ext.abi3.so", False)


def test_module_level_imports_are_followed_and_the_rest_sorted_by_kind(tiny_package):
    trace = sv.trace_imports(*tiny_package, ["pkg.core"], package="pkg")
    assert set(trace.modules) == {"pkg", "pkg.core", "pkg.util", "pkg.sub", "pkg.sub.deep", "pkg.cond"}
    assert trace.modules["pkg.cond"][0] == "conditional" and trace.modules["pkg.util"][0] == "module"
    assert set(trace.third_party) == {"requests", "numpy", "yaml", "classdep"}  # os is the standard library's
    assert set(trace.conditional) == {"flagdep", "condthird"}
    assert set(trace.optional) == {"fancy", "suppressed", "thing"}
    assert set(trace.lazy) == {"lazydep"}
    everything = {n for bucket in (trace.third_party, trace.conditional, trace.optional, trace.lazy) for n in bucket}
    assert not everything & {"typedep", "rocmdep", "rocmthird", "neverloaded"}  # TYPE_CHECKING, ROCm, lazy only
    assert trace.third_party["yaml"] == ["pkg/sub/deep.py:1 (module)"]
    assert trace.conditional["flagdep"] == ["pkg/core.py:20 if FLAG (conditional)"]


def test_relative_imports_resolve_against_the_package():
    sites = sv.imports_of("from ..util import helper\nfrom . import deep\nfrom .x import y\n", "pkg.sub.deep", False)
    assert [s.target for s in sites] == ["pkg.util", "pkg.util.helper", "pkg.sub", "pkg.sub.deep", "pkg.sub.x",
                                         "pkg.sub.x.y"]
    inside_package = sv.imports_of("from . import a\n", "pkg.sub", True)
    assert [s.target for s in inside_package] == ["pkg.sub", "pkg.sub.a"]


def test_a_root_function_is_followed_and_its_siblings_are_not(tiny_package):
    trace = sv.trace_imports(*tiny_package, ["pkg.entry:main"], package="pkg")
    assert "pkg.lazymod" in trace.modules and "neverloaded" in trace.third_party
    assert "entrydep" in trace.third_party and "no" in trace.lazy


def test_check_drops_keeps_a_file_that_the_path_imports_unconditionally(tiny_package):
    trace = sv.trace_imports(*tiny_package, ["pkg.core"], package="pkg")
    drop = {"pkg/util.py": ("said unused", "pkg.util"), "pkg/lazymod.py": ("lazy", "pkg.lazymod"),
            "pkg/gone.py": ("not in the wheel", "pkg.gone")}
    kept = sv.check_drops(drop, trace, set(PACKAGE))
    assert list(kept) == ["pkg/lazymod.py"]


# ---------------------------------------------------------------- pins, versions, markers

GOOD = ["torch==2.11.0", "torchvision==0.26.0", "torchaudio==2.11.0", "zentorch==2.11.0.0; extra == \"zen\""]


def test_pin_check_accepts_the_machines_torch():
    assert sv.check_pins(GOOD) == {"torch": "==2.11.0", "torchvision": "==0.26.0", "torchaudio": "==2.11.0"}


@pytest.mark.parametrize("requires", [
    ["torch==2.12.0", "torchvision==0.26.0", "torchaudio==2.11.0"],
    ["torch>=2.12", "torchvision==0.26.0", "torchaudio==2.11.0"],
    ["torchvision==0.26.0", "torchaudio==2.11.0"],
    ["torch==2.11.0; extra == \"cpu\"", "torch==2.12.0", "torchvision==0.26.0", "torchaudio==2.11.0"],
])
def test_pin_check_refuses_another_torch(requires):
    with pytest.raises(SystemExit, match=r"torch(==2\.12\.0|>=2\.12| \(not required at all\)).*torch 2\.11\.0"):
        sv.check_pins(requires)


@pytest.mark.parametrize("clause, version, allowed", [
    (">=5.5.3", "5.17.0", True), ("<81.0.0", "81.0.0", False), ("==2.11.0", "2.11.0+cu130", True),
    ("!=6.33.0.*", "6.33.0", False), ("!=6.33.0.*", "6.33.5", True), ("!=6.30.*", "6.31.1", True),
    ("~=0.1.0", "0.1.9", True), ("~=0.1.0", "0.2.0", False), ("<0.2", "0.1.10", True), ("==2.11", "2.11.0", True),
])
def test_version_clauses(clause, version, allowed):
    assert sv.version_allows(clause, version) is allowed


@pytest.mark.parametrize("marker, applies", [
    ('python_version > "3.11"', True), ('python_version < "3.12"', False),
    ('platform_machine == "x86_64" or platform_machine == "arm64"', True),
    ('sys_platform == "win32"', False), ('platform_system == "Linux" and (python_version >= "3.14")', False),
    ('extra == "zen"', False), ("", True),
])
def test_markers_are_read_for_the_gpu_machine(marker, applies):
    assert sv.marker_applies(marker) is applies


def test_requirements_parse_with_extras_and_markers():
    req = sv.parse_requirement('Fastapi[standard]<0.137.0,>=0.133.0 ; python_version >= "3.9"')
    assert req == sv.Requirement("fastapi", frozenset({"standard"}), "<0.137.0,>=0.133.0", 'python_version >= "3.9"')
    assert sv.marker_applies('extra == "crypto"', extras=frozenset({"crypto"}))


# ---------------------------------------------------------------- wheels and dependencies

def _wheel(path: Path, files: dict[str, bytes], record_rows=None) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        rows = []
        for name, data in files.items():
            zf.writestr(name, data)
            rows.append(",".join(sv.record_line(name, data)))
        record = "tiny-1.0.dist-info/RECORD"
        zf.writestr(record, "\n".join((record_rows or rows) + [f"{record},,"]) + "\n")
    return path


TINY = {"tiny/__init__.py": b"", "tiny/big.so": b"\0" * 1000, "tiny/data/a.txt": b"a", "tiny/keep.py": b"k = 1\n",
        "tiny-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tiny\nVersion: 1.0\nRequires-Dist: b>=1\n",
        "tiny-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}


def test_repacked_wheel_has_a_valid_record_and_installs(tmp_path):
    src = _wheel(tmp_path / "tiny-1.0-py3-none-any.whl", TINY)
    out = tmp_path / "repacked" / src.name
    out.parent.mkdir()
    dropped = sv.repack_wheel(src, out, lambda n: n == "tiny/big.so" or n.startswith("tiny/data/"))
    assert sorted(dropped) == ["tiny/big.so", "tiny/data/a.txt"]
    assert sv.record_problems(out) == []
    assert "tiny/big.so" not in zipfile.ZipFile(out).namelist()
    assert sv.wheel_requires(out) == ["b>=1"] and sv.wheel_top_level(out) == {"tiny"}
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--disable-pip-version-check", "--target", str(target), str(out)], check=True)
    assert (target / "tiny" / "keep.py").exists() and not (target / "tiny" / "big.so").exists()


def test_record_problems_names_what_is_wrong(tmp_path):
    stale = [",".join(sv.record_line(n, d)) for n, d in TINY.items()]
    stale[1] = "tiny/big.so,sha256=AAAA,1000"
    bad = _wheel(tmp_path / "bad.whl", {k: v for k, v in TINY.items() if k != "tiny/keep.py"}, stale)
    assert sorted(sv.record_problems(bad)) == ["tiny/big.so: hash or size differs",
                                               "tiny/keep.py: in RECORD, not in the wheel"]


def _resolved(**requires):
    return {name: {"metadata": {"name": name, "version": "1.0", "requires_dist": reqs},
                   "download_info": {"url": f"https://x/{name}-1.0-py3-none-any.whl"}}
            for name, reqs in requires.items()}


def test_closure_follows_missing_dists_markers_and_extras(monkeypatch):
    monkeypatch.setattr(sv, "DEVICE_PACKAGES", {"anyio", "typing-extensions"})
    resolved = _resolved(fastapi=["starlette>=0.4", "pydantic", 'uvloop; sys_platform == "win32"',
                                  'extras-only; extra == "all"'],
                         starlette=["anyio"], pydantic=["pyjwt[crypto]", "typing-extensions>=4.16"],
                         pyjwt=['cryptography; extra == "crypto"'], cryptography=[], uvloop=[], anyio=[],
                         **{"extras-only": [], "typing-extensions": []})
    assert sv.closure({"fastapi"}, resolved) == {"fastapi": "imported by vLLM", "starlette": "fastapi",
                                                 "pydantic": "fastapi", "pyjwt": "pydantic", "cryptography": "pyjwt"}
    present = sv.present_requirements({"anyio"}, {"pydantic"}, resolved, ["anyio>=4", "torch==2.11.0"])
    assert present == {"anyio": [">=4"], "typing-extensions": [">=4.16"]}
    assert sv.insurance(present, resolved, lambda d: 100) == {"anyio", "typing-extensions"}
    assert sv.insurance(present, resolved, lambda d: 10**6) == set()


def test_import_names_map_to_dists_through_their_wheels(tmp_path, monkeypatch):
    monkeypatch.setattr(sv, "DEVICE_PACKAGES", {"pyyaml"})
    wheels = {"pyzmq": _wheel(tmp_path / "pyzmq-1.0-py3-none-any.whl", {"zmq/__init__.py": b""}),
              "oddname": _wheel(tmp_path / "oddname-1.0-py3-none-any.whl", {"strange.py": b""})}
    fetched = []

    def fetch(dist):
        fetched.append(dist)
        return wheels[dist]

    resolved = _resolved(pyzmq=[], oddname=[], pyyaml=[])
    mapping, unknown = sv.map_imports({"zmq", "yaml", "strange", "nowhere"}, resolved, fetch)
    assert mapping == {"zmq": "pyzmq", "yaml": "pyyaml", "strange": "oddname"} and unknown == {"nowhere"}
    assert set(fetched) == {"pyzmq", "oddname"}


def test_star_follows_every_function_of_a_root(tiny_package):
    trace = sv.trace_imports(*tiny_package, ["pkg.entry:*"], package="pkg")
    assert {"entrydep", "no"} <= set(trace.third_party)


def test_names_that_a_newer_carried_wheel_lacks_are_reported(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text(
        "from dep.sub import Kept, Gone\nfrom dep import sub\nfrom dep.nomod import X\nfrom dep.star import Y\n")
    modules = sv.index_modules(["pkg/__init__.py"])
    trace = sv.trace_imports(modules, lambda p: (tmp_path / p).read_text(), ["pkg"], package="pkg")
    dep = _wheel(tmp_path / "dep-1.0-py3-none-any.whl", {"dep/__init__.py": b"", "dep/sub.py": b"class Kept: ...\n",
                                                         "dep/star.py": b"from dep._impl import *\n"})
    assert sv.unresolved_names(trace, modules, lambda p: (tmp_path / p).read_text(), [dep]) == [
        "pkg/__init__.py:1 dep.sub.Gone", "pkg/__init__.py:3 dep.nomod (no such module)"]
