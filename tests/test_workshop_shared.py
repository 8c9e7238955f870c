"""Workshop pieces that run in every `make test` (no browser, no hub): free memory on a shared GPU, per-learner
folders, the hub config's per-learner environment, the course's Jupyter settings, and the executed GPU copies."""
import json
import types
from pathlib import Path

import nbformat
import pytest

from utils import device as devices
from utils import params, solutions
from utils.base import paths
from utils.machinery import labs, report
from utils.llm import models
from utils.machinery import executed

ROOT = Path(__file__).resolve().parents[1]


def h100(recorded):
    r = recorded["h100"]
    return devices.from_properties(r["properties"], cuda=r["cuda"])


# --- a shared GPU: free memory, not total ------------------------------------------------------------

@pytest.fixture
def fake_cuda(monkeypatch):
    import torch

    state = {"free": 10 * 2**30, "reserved": 0, "allocated": 0}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (state["free"], 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: state["reserved"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: state["allocated"])
    return state


def test_available_memory_is_the_free_memory_of_a_shared_gpu(recorded, fake_cuda):
    dev = h100(recorded)
    assert dev.memory_bytes > 70 * 2**30                       # the total
    assert params.available_memory_bytes(dev) == 10 * 2**30    # what other learners left
    fake_cuda.update(reserved=3 * 2**30, allocated=1 * 2**30)   # this process's cache can be reused
    assert params.available_memory_bytes(dev) == 12 * 2**30


def test_sizes_shrink_to_fit_a_shared_gpu(recorded, fake_cuda):
    dev = h100(recorded)
    need = lambda n: 3 * n * n * 2                                # noqa: E731 (three bf16 matrices)
    assert params.size("MATMUL_N", 8192, device=dev, cpu=256, gpu=8192, bytes_needed=need) == 8192
    fake_cuda["free"] = 300 * 2**20
    with pytest.raises(params.ParameterError, match=r"MATMUL_N=8192 needs .* GiB free .*use MATMUL_N=4096 or less"):
        params.size("MATMUL_N", 8192, device=dev, cpu=256, gpu=8192, bytes_needed=need)


def test_without_a_gpu_runtime_the_total_is_used(recorded, monkeypatch):
    import torch

    def no_runtime(*a):
        raise RuntimeError("Found no NVIDIA driver on your system")

    monkeypatch.setattr(torch.cuda, "mem_get_info", no_runtime)
    assert params.available_memory_bytes(h100(recorded)) == h100(recorded).memory_bytes


# --- a checkout shared read-only: per-learner folders -------------------------------------------------

def test_models_and_build_fall_back_to_the_learners_own_folders(tmp_path, monkeypatch):
    monkeypatch.delenv("COURSE_MODELS_DIR", raising=False)
    monkeypatch.delenv("COURSE_BUILD_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    shared = paths.REPO_ROOT / "build"
    real_access = models.os.access
    def read_only_checkout(p, mode):   # the checkout and everything in it, as for a learner on a hub
        p = Path(models.os.path.abspath(p))   # not resolved: build/models may be a link elsewhere
        return False if p == paths.REPO_ROOT or p.is_relative_to(shared) else real_access(p, mode)

    monkeypatch.setattr(models.os, "access", read_only_checkout)
    assert paths.build_dir() == tmp_path / "home" / ".cache" / "rocm-cuda-labs" / "build"
    assert models.models_dir() == tmp_path / "home" / ".cache" / "rocm-cuda-labs" / "build" / "models"
    monkeypatch.setenv("COURSE_BUILD_DIR", str(tmp_path / "learner" / "build"))
    assert models.models_dir() == tmp_path / "learner" / "build" / "models"
    monkeypatch.setattr(models.os, "access", real_access)
    assert models.models_dir() == shared / "models"          # writable: the shared cache, as before


def test_hub_config_gives_each_learner_their_own_folders(tmp_path, monkeypatch):
    """Load docs/jupyterhub/jupyterhub_config.py as JupyterHub does and ask it for two learners' setup."""
    from traitlets.config import Config

    monkeypatch.setenv("COURSE_HUB_MODE", "test")
    monkeypatch.setenv("COURSE_HUB_HOMES", str(tmp_path / "homes"))
    monkeypatch.setenv("COURSE_HUB_STATE", str(tmp_path / "state"))
    monkeypatch.setenv("COURSE_HUB_GPUS", "0,1")
    c = Config()
    ns = {"get_config": lambda: c, "__file__": str(ROOT / "docs" / "jupyterhub" / "jupyterhub_config.py")}
    exec(compile(Path(ns["__file__"]).read_text(), ns["__file__"], "exec"), ns)
    assert c.JupyterHub.bind_url.startswith("http://127.0.0.1:") and c.JupyterHub.authenticator_class == "dummy"
    envs = {}
    for name in ("ada", "grace"):
        spawner = types.SimpleNamespace(user=types.SimpleNamespace(name=name), environment={},
                                        home_dir=str(tmp_path / "homes" / name))
        ns["prepare"](spawner)
        envs[name] = spawner.environment
        work = tmp_path / "homes" / name / "rocm-cuda-labs"
        assert (work / "work" / "00_environment.ipynb").is_file() and (work / "solutions").is_symlink()
        assert spawner.environment["COURSE_BUILD_DIR"] == str(work / "build")
        assert spawner.environment["JUPYTER_CONFIG_PATH"] == str(ROOT / "jupyter")
        assert spawner.environment["CUDA_VISIBLE_DEVICES"] in ("0", "1")
    for key in ("COURSE_BUILD_DIR", "HF_HOME", "MPLCONFIGDIR", "TRITON_CACHE_DIR", "IPYTHONDIR"):
        assert envs["ada"][key] != envs["grace"][key], key
    assert envs["ada"]["PYTHONPATH"] == envs["grace"]["PYTHONPATH"] == str(ROOT)


def test_hub_room_mode_uses_real_accounts_and_https(tmp_path, monkeypatch):
    from traitlets.config import Config

    monkeypatch.setenv("COURSE_HUB_MODE", "room")
    monkeypatch.setenv("COURSE_HUB_STATE", str(tmp_path))
    monkeypatch.setenv("COURSE_HUB_SSL_CERT", "/etc/letsencrypt/live/hub/fullchain.pem")
    monkeypatch.setenv("COURSE_HUB_SSL_KEY", "/etc/letsencrypt/live/hub/privkey.pem")
    c = Config()
    path = ROOT / "docs" / "jupyterhub" / "jupyterhub_config.py"
    exec(compile(path.read_text(), str(path), "exec"), {"get_config": lambda: c, "__file__": str(path)})
    assert c.JupyterHub.authenticator_class == "pam" and c.JupyterHub.spawner_class == "localprocess"
    assert c.JupyterHub.bind_url == "https://0.0.0.0:443" and c.JupyterHub.ssl_key.endswith("privkey.pem")


def test_z2jh_values_have_nvidia_and_amd_profiles():
    import yaml

    values = yaml.safe_load((ROOT / "docs" / "jupyterhub" / "z2jh-values.yaml").read_text())
    profiles = {p["slug"]: p for p in values["singleuser"]["profileList"]}
    assert profiles["nvidia"]["kubespawner_override"]["extra_resource_limits"] == {"nvidia.com/gpu": "1"}
    assert profiles["amd"]["kubespawner_override"]["extra_resource_limits"] == {"amd.com/gpu": "1"}
    assert values["proxy"]["https"]["enabled"] is True
    assert values["hub"]["config"]["JupyterHub"]["authenticator_class"] != "dummy"


# --- the course's Jupyter settings --------------------------------------------------------------------

def test_learner_settings_hide_news_and_nbgrader():
    overrides = json.loads((ROOT / "jupyter" / "lab" / "settings" / "overrides.json").read_text())
    assert overrides["@jupyterlab/apputils-extension:notification"]["fetchNews"] == "false"
    page = json.loads((ROOT / "jupyter" / "labconfig" / "page_config.json").read_text())
    assert page["disabledExtensions"]["@jupyter/nbgrader"] is True
    server = json.loads((ROOT / "jupyter" / "jupyter_server_config.json").read_text())
    enabled = server["ServerApp"]["jpserver_extensions"]
    assert enabled and not any(enabled.values()) and all(k.startswith("nbgrader.") for k in enabled)


def test_labs_carry_complete_notebook_metadata():
    for lab in sorted(solutions.LABS.glob("*.ipynb")):
        meta = nbformat.read(lab, as_version=4).metadata
        assert meta["kernelspec"] == labs.KERNELSPEC, lab.name
        assert meta["language_info"] == labs.LANGUAGE_INFO, lab.name


def test_write_solution_metadata_changes_only_the_metadata(tmp_path):
    src = solutions.SOLUTIONS / "00_environment.ipynb"
    copy = tmp_path / src.name
    nb = nbformat.read(src, as_version=4)
    nb.metadata["language_info"] = {"name": "python"}
    copy.write_text(nbformat.writes(nb) + "\n")
    assert labs.write_solution_metadata([copy]) == [copy]
    again = nbformat.read(copy, as_version=4)
    assert again.metadata["language_info"] == labs.LANGUAGE_INFO
    assert [c.source for c in again.cells] == [c.source for c in nb.cells]
    assert [c.get("id") for c in again.cells] == [c.get("id") for c in nb.cells]
    assert labs.write_solution_metadata([copy]) == []         # already complete: not rewritten


# --- executed GPU copies ------------------------------------------------------------------------------

def fake_executed(tmp_path: Path, solution: Path) -> Path:
    """A solution 'executed': papermill's injected cell, a normal output, a huge one, a plot."""
    nb = nbformat.read(solution, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    nb.cells.insert(2, nbformat.v4.new_code_cell("DEVICE = 'gpu'", metadata={"tags": ["injected-parameters"]}))
    code[0].outputs = [nbformat.v4.new_output("stream", name="stdout", text="running on cuda\n")]
    code[1].outputs = [nbformat.v4.new_output("stream", name="stdout", text="x" * 200_000)]
    code[2].outputs = [nbformat.v4.new_output("display_data", data={"image/png": "iVBOR" + "A" * 1000,
                                                                    "text/plain": "<Figure>"})]
    path = tmp_path / "build" / "executed" / solution.name
    path.parent.mkdir(parents=True)
    nbformat.write(nb, path)
    (tmp_path / "build" / "results").mkdir()
    (tmp_path / "build" / "results" / f"{solution.stem}.json").write_text(json.dumps(
        {"device": {"name": "NVIDIA H100 80GB HBM3"}, "software": {"torch": "2.11.0+cu130"}, "run_id": "r7"}))
    return path


def test_executed_copy_is_stamped_trimmed_and_current(tmp_path):
    sols = tmp_path / "solutions"
    sols.mkdir()
    sol = sols / "00_environment.ipynb"
    sol.write_text((solutions.SOLUTIONS / sol.name).read_text())
    run = fake_executed(tmp_path, sol)
    out = tmp_path / "docs" / "executed"
    copy = executed.make_copy(run, out, solution=sol)
    nb = nbformat.read(copy, as_version=4)
    stamp = nb.metadata[executed.KEY]
    assert stamp["device"] == "NVIDIA H100 80GB HBM3" and stamp["software"]["torch"] == "2.11.0+cu130"
    assert stamp["run_id"] == "r7" and stamp["solution"] == "solutions/00_environment.ipynb"
    assert stamp["commit"] is None or len(stamp["commit"]) == 40
    code = [c for c in nb.cells if c.cell_type == "code" and "injected-parameters" not in c.metadata.get("tags", [])]
    assert code[0].outputs[0]["text"] == "running on cuda\n"
    assert "left out of this copy" in code[1].outputs[0]["text"] and len(code[1].outputs[0]["text"]) < 40_000
    assert code[2].outputs[0]["data"]["image/png"].startswith("iVBOR")          # plots are kept
    assert executed.stale(out, sols) == {}
    assert "— current" in executed.describe(out, sols)[0]


def test_a_copy_older_than_its_solution_is_reported(tmp_path):
    sols = tmp_path / "solutions"
    sols.mkdir()
    sol = sols / "00_environment.ipynb"
    sol.write_text((solutions.SOLUTIONS / sol.name).read_text())
    out = tmp_path / "docs" / "executed"
    executed.make_copy(fake_executed(tmp_path, sol), out, solution=sol)
    nb = nbformat.read(sol, as_version=4)
    nb.cells[-1].source += "\nOne more sentence."
    nbformat.write(nb, sol)
    (sols / "01_vector_add.ipynb").write_text((solutions.SOLUTIONS / "01_vector_add.ipynb").read_text())
    why = executed.stale(out, sols)
    assert "older than its solution" in why["00_environment"] and why["01_vector_add"] == "no executed copy yet"
    lines = executed.describe(out, sols)
    assert "**older than its solution" in lines[0] and "no executed copy yet" in lines[1]


def test_an_oversized_copy_is_refused(tmp_path, monkeypatch):
    sols = tmp_path / "solutions"
    sols.mkdir()
    sol = sols / "00_environment.ipynb"
    sol.write_text((solutions.SOLUTIONS / sol.name).read_text())
    monkeypatch.setattr(executed, "MAX_COPY_BYTES", 10_000)
    with pytest.raises(ValueError, match="the copy would be"):
        executed.make_copy(fake_executed(tmp_path, sol), tmp_path / "out", solution=sol)


def test_report_lists_the_executed_copies(build_dir):
    md = report.build_report().read_text()
    assert "## Executed GPU copies (`docs/executed/`)" in md
    for sol in solutions.solution_notebooks():
        assert f"- {sol.stem}: " in md


def test_binder_start_uses_the_course_settings():
    import subprocess

    out = subprocess.run(["bash", str(ROOT / "binder" / "start"), "env"], capture_output=True, text=True,
                         check=True, env={"PATH": "/usr/bin:/bin", "JUPYTER_CONFIG_PATH": "/elsewhere"}).stdout
    env = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    assert env["JUPYTER_CONFIG_PATH"] == f"{ROOT}/jupyter:/elsewhere"
    assert env["PYTHONPATH"] == str(ROOT) and env["HF_HUB_OFFLINE"] == "1"
    assert (ROOT / "binder" / "start").stat().st_mode & 0o111


def test_a_copy_whose_run_the_record_now_holds_says_its_record_lines_predate_it(tmp_path):
    """A copy prints the record as it stood before its own run was merged: once the record holds the run, the copy
    carries a note with the record's figures today (and its source hash, so its staleness, does not change)."""
    copy = tmp_path / "00_environment.ipynb"
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# Lab 00"), nbformat.v4.new_code_cell("print(1)")]
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", text="Beside the course's H100 record "
                                                                    "(utils/reference/h100.json: run OLD): 724.1\n")]
    nb.metadata[executed.KEY] = {"run_id": "RUN-1"}
    copy.write_text(nbformat.writes(nb))
    before = executed.source_hash(nbformat.read(copy, as_version=4))
    metric = {"value": 759.1, "unit": "TFLOP/s", "label": "torch.matmul | bf16", "size": {"n": 8192}}
    records = {"h100": {"labs": {"00_environment": {"run_id": "RUN-1", "metrics": {"environment.matmul_tflops": metric}}}}}
    assert executed.add_record_note(copy, records=records)
    again = nbformat.read(copy, as_version=4)
    note = again.cells[1]
    assert note.get("id") == executed.NOTE_ID and "759.1 TFLOP/s" in note.source and "RUN-1" in note.source
    assert "torch.matmul / bf16" in note.source                # a bar in a label keeps the table whole
    assert executed.source_hash(again) == before
    assert not executed.add_record_note(copy, records=records)                     # already there: unchanged
    other = {"h100": {"labs": {"00_environment": {"run_id": "RUN-2", "metrics": {}}}}}
    assert executed.add_record_note(copy, records=other)                           # no longer applies: removed
    assert all(c.get("id") != executed.NOTE_ID for c in nbformat.read(copy, as_version=4).cells)


def test_every_committed_copy_carries_the_record_note_it_needs():
    for copy in sorted(executed.COPIES.glob("*.ipynb")):
        nb = nbformat.read(copy, as_version=4)
        note = executed.record_note(nb, copy.stem)
        notes = [c.source for c in nb.cells if c.get("id") == executed.NOTE_ID]
        assert notes == ([note] if note else []), f"{copy.name}: run python -m utils.machinery.executed prose"
