"""A workshop machine shared by many learners: nothing shared is trusted. The course's folders are private (0700,
checked before use), a compiled helper runs only if it is the one this user built, and the hub's root-side hook
never follows a learner's link nor changes the owner of anything. The attacks run as real second users where the
tests run as root (CI does); elsewhere those tests skip and say why."""
import errno
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import types
import uuid
from pathlib import Path

import pytest

from conftest import ROOT
from utils import simt
from utils.base import paths
from utils.base.paths import UnsafePath, private_dir

# what a second user runs: the system's Python (the course's modules used here need only the standard library)
LEARNER_PYTHON = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("useradd"),
                               reason="needs root (and useradd) to create the second local users of the attack")


# --- private folders ----------------------------------------------------------------------------------------

def test_a_private_folder_is_made_0700_and_a_loose_one_of_ours_is_tightened(tmp_path):
    made = private_dir(tmp_path / "build" / "cache")
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o777)
    os.chmod(loose, 0o777)
    assert stat.S_IMODE(private_dir(loose).stat().st_mode) == 0o700


def test_a_link_in_place_of_a_private_folder_is_refused_by_name(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "build").symlink_to(elsewhere)
    with pytest.raises(UnsafePath, match=r"build is a symbolic link"):
        private_dir(tmp_path / "build")
    out = subprocess.run([sys.executable, "-m", "utils.base.paths", "private", str(tmp_path / "build")],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 1 and "refused:" in out.stderr and "symbolic link" in out.stderr


def test_the_simt_helper_cache_is_private_and_a_changed_helper_is_rebuilt_not_run(tmp_path, monkeypatch):
    """Lab 02's compiled helper: in this user's build folder (0700), run only while its bytes match the digest
    recorded when it was built; a replaced program is rebuilt, never executed."""
    if not shutil.which("g++") and not shutil.which("c++"):
        pytest.skip("needs a C++ compiler")
    monkeypatch.setenv("COURSE_BUILD_DIR", str(tmp_path / "build"))
    source = "__global__ void copy(float *out, const float *x) { out[threadIdx.x] = x[threadIdx.x]; }"
    import numpy as np

    x = np.arange(32, dtype=np.float32)
    run = lambda: simt.run_kernel(source, "copy", [("out", np.zeros(32, np.float32)), ("x", x)], grid=1, block=32,
                                  width=32, platform="cuda")
    run()
    cache = tmp_path / "build" / "cache" / "simt"
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    helpers = [p for p in cache.iterdir() if p.suffix != ".sha256" and p.is_file()]
    assert len(helpers) == 1 and helpers[0].with_suffix(".sha256").is_file()
    marker = tmp_path / "planted-ran"
    helpers[0].write_text(f"#!/bin/sh\ntouch {marker}\n")      # someone replaced the program
    os.chmod(helpers[0], 0o700)
    run()
    assert not marker.exists(), "a helper whose bytes changed was executed"


# --- two local users ----------------------------------------------------------------------------------------

@pytest.fixture
def second_users():
    """Two non-root users made for this test (unique names per worker), with homes in a folder others can
    enter; removed afterwards."""
    tag = uuid.uuid4().hex[:6]
    base = Path(tempfile.mkdtemp(prefix="course-homes-"))
    os.chmod(base, 0o755)
    made = []
    for role in ("victim", "attacker"):
        name = f"c{role[0]}{tag}"
        subprocess.run(["useradd", "--create-home", "--home-dir", str(base / name), "--shell", "/bin/sh", name],
                       check=True, capture_output=True)
        made.append(pwd.getpwnam(name))
    try:
        probe = as_user(made[0], [LEARNER_PYTHON, "-c", "import utils.base.paths"])
        if probe.returncode != 0:
            pytest.skip(f"a second user cannot run {LEARNER_PYTHON} on this checkout ({ROOT}): "
                        f"{probe.stderr.strip().splitlines()[-1:]}")
        yield types.SimpleNamespace(victim=made[0], attacker=made[1], base=base)
    finally:
        for user in made:
            subprocess.run(["userdel", "--remove", user.pw_name], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


def as_user(user, cmd, **kwargs):
    return subprocess.run(cmd, user=user.pw_uid, group=user.pw_gid, extra_groups=[], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "HOME": user.pw_dir, "PYTHONPATH": str(ROOT)}, **kwargs)


def hub_config(monkeypatch, tmp_path, mode="room"):
    from traitlets.config import Config

    monkeypatch.setenv("COURSE_HUB_MODE", mode)
    monkeypatch.setenv("COURSE_HUB_STATE", str(tmp_path / "state"))
    monkeypatch.setenv("COURSE_HUB_LEARNER_PYTHON", LEARNER_PYTHON)
    c = Config()
    ns = {"get_config": lambda: c, "__file__": str(ROOT / "docs" / "jupyterhub" / "jupyterhub_config.py")}
    exec(compile(Path(ns["__file__"]).read_text(), ns["__file__"], "exec"), ns)
    return ns


@ROOT_ONLY
def test_a_learners_link_gains_them_nothing_through_the_hub_hook(second_users, tmp_path, monkeypatch):
    """The hook runs as root. A learner replaces ~/rocm-cuda-labs by a link to a root-owned tree: their next
    server start is refused with the reason, and the tree keeps its owner and its contents."""
    ns = hub_config(monkeypatch, tmp_path)
    learner = second_users.attacker
    target = second_users.base / "root-owned"
    target.mkdir()
    (target / "secret").write_text("root's\n")
    os.chmod(target, 0o755)
    link = Path(learner.pw_dir) / "rocm-cuda-labs"
    as_user(learner, ["ln", "-s", str(target), str(link)], check=True)
    spawner = types.SimpleNamespace(user=types.SimpleNamespace(name=learner.pw_name), environment={})
    with pytest.raises(RuntimeError, match="symbolic link"):
        ns["prepare"](spawner)
    for path in (target, target / "secret"):
        assert os.lstat(path).st_uid == 0, f"{path} changed owner"
    assert sorted(p.name for p in target.iterdir()) == ["secret"]


@ROOT_ONLY
def test_the_hub_hook_prepares_a_learners_folder_as_the_learner(second_users, tmp_path, monkeypatch):
    ns = hub_config(monkeypatch, tmp_path)
    learner = second_users.victim
    spawner = types.SimpleNamespace(user=types.SimpleNamespace(name=learner.pw_name), environment={})
    ns["prepare"](spawner)
    folder = Path(learner.pw_dir) / "rocm-cuda-labs"
    for path in (folder, folder / "build", folder / "work", folder / "work" / "00_environment.ipynb"):
        assert os.lstat(path).st_uid == learner.pw_uid, path
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and (folder / "solutions").is_symlink()
    assert spawner.environment["COURSE_BUILD_DIR"] == str(folder / "build")


@ROOT_ONLY
def test_another_user_cannot_read_a_learners_private_folders(second_users):
    """make lab's runtime folder (the token's file) and the compiled helpers are in private folders: another
    local user can neither list them nor plant a program there."""
    victim, attacker = second_users.victim, second_users.attacker
    runtime = Path(victim.pw_dir) / "rocm-cuda-labs" / "build" / "cache" / "jupyter" / "runtime"
    made = as_user(victim, [LEARNER_PYTHON, "-m", "utils.base.paths", "private", str(runtime.parents[3]),
                            str(runtime.parents[2]), str(runtime.parents[1]), str(runtime.parent), str(runtime)])
    assert made.returncode == 0, made.stderr
    as_user(victim, ["sh", "-c", f"echo token=abc > {runtime}/jpserver-1-open.html"], check=True)
    assert as_user(attacker, ["cat", str(runtime / "jpserver-1-open.html")]).returncode != 0
    assert as_user(attacker, ["ls", str(runtime.parents[2])]).returncode != 0
    simt_cache = runtime.parents[1] / "simt"
    assert as_user(attacker, ["mkdir", "-p", str(simt_cache)]).returncode != 0


@ROOT_ONLY
def test_a_folder_another_user_made_first_is_refused(second_users):
    """The attacker creates the victim's cache folder first (in a place both can write): the victim's course
    refuses it by name instead of using it."""
    shared = second_users.base / "shared-tmp"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    planted = shared / "course-cache"
    as_user(second_users.attacker, ["mkdir", str(planted)], check=True)
    out = as_user(second_users.victim, [LEARNER_PYTHON, "-m", "utils.base.paths", "private", str(planted)])
    assert out.returncode == 1 and f"belongs to uid {second_users.attacker.pw_uid}" in out.stderr
    assert paths.may_write(shared)


def test_atomic_writes_keep_a_files_mode_and_give_new_ones_the_usual_one(tmp_path):
    """A generated lab stays readable for the learners a hub copies it for (mkstemp alone would make it 0600);
    privacy is the folders' job."""
    from utils.base import state

    new = state.write_text_atomic(tmp_path / "lab.ipynb", "{}\n")
    assert stat.S_IMODE(new.stat().st_mode) == 0o666 & ~0o022 or stat.S_IMODE(new.stat().st_mode) & 0o044
    os.chmod(new, 0o600)
    state.write_text_atomic(new, "{ }\n")
    assert stat.S_IMODE(new.stat().st_mode) == 0o600


# --- a build folder that is not writable, a checkout that is read-only ------------------------------------------

@pytest.fixture
def learner(request, tmp_path):
    """Runs commands as a non-root user (root ignores file modes): this user when not root, else the victim of
    `second_users`; `folder` is a folder of that user's, `own(path)` gives them what the test made."""
    if os.geteuid() != 0:
        return types.SimpleNamespace(
            folder=tmp_path, own=lambda path: None,
            run=lambda cmd: subprocess.run(cmd, capture_output=True, text=True, env={
                "PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}))
    if not shutil.which("useradd"):
        pytest.skip("runs as root without useradd: no non-root user to check file modes with")
    user = request.getfixturevalue("second_users").victim
    folder = Path(user.pw_dir) / "work"
    folder.mkdir()

    def own(path):
        for part in [path, *Path(path).rglob("*")]:
            os.lchown(part, user.pw_uid, user.pw_gid)

    own(folder)
    return types.SimpleNamespace(folder=folder, own=own, run=lambda cmd: as_user(user, cmd))


BUILD_DIR_OF = """
import sys
from pathlib import Path
from utils.base import paths
paths.REPO_ROOT = Path(sys.argv[1])          # a checkout of the learner's, not this one
try:
    print(paths.build_dir())
    print(paths.build_dir())
except PermissionError as exc:
    print(f"{type(exc).__name__}: {exc}")
"""


@pytest.mark.parametrize("chosen_by", ["the checkout", "COURSE_BUILD_DIR"])
def test_a_build_folder_that_is_not_writable_is_an_error_not_a_detour(learner, chosen_by):
    """The learner's build/ exists but is read-only for them: the course stops naming it and the fix, instead of
    writing the results to ~/.cache where the report and `make run` never look."""
    checkout = learner.folder / "checkout"
    (checkout / "build").mkdir(parents=True)
    (checkout / "pyproject.toml").write_text("")
    learner.own(checkout)
    os.chmod(checkout / "build", 0o500)
    script = BUILD_DIR_OF if chosen_by == "the checkout" else \
        f"import os; os.environ['COURSE_BUILD_DIR'] = {str(checkout / 'build')!r}\n" + BUILD_DIR_OF
    out = learner.run([LEARNER_PYTHON, "-c", script, str(checkout)])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (f"BuildFolderError: the build folder {checkout / 'build'} is not writable by you; "
                                  f"make it yours again: chmod u+w {checkout / 'build'}, or set COURSE_BUILD_DIR "
                                  "to a folder of yours"), out.stdout


def test_a_read_only_checkout_without_build_uses_the_cache_and_says_so_once(learner):
    checkout = learner.folder / "checkout"
    checkout.mkdir()
    (checkout / "pyproject.toml").write_text("")
    learner.own(checkout)
    os.chmod(checkout, 0o555)
    out = learner.run([LEARNER_PYTHON, "-c", BUILD_DIR_OF, str(checkout)])
    assert out.returncode == 0, out.stderr
    used = out.stdout.split()
    assert len(used) == 2 and used[0] == used[1] and used[0].endswith(".cache/rocm-cuda-labs/build"), out.stdout
    assert out.stderr.count("\n") == 1 and f"the checkout {checkout} is read-only and has no build/" in out.stderr \
        and used[0] in out.stderr, out.stderr


def test_a_build_folder_that_is_not_writable_stops_the_shell_environment_in_one_line(learner):
    """`eval "$(python -m utils.base.paths env)"` (binder/start): an error line, exit 1, no traceback."""
    build = learner.folder / "build"
    build.mkdir()
    learner.own(build)
    os.chmod(build, 0o500)
    out = learner.run(["env", f"COURSE_BUILD_DIR={build}", LEARNER_PYTHON, "-m", "utils.base.paths", "env"])
    assert out.returncode == 1 and out.stdout == "", out
    assert out.stderr.startswith(f"error: the build folder {build} is not writable by you") and \
        out.stderr.count("\n") == 1, out.stderr


# --- a full disk, a used-up quota, a read-only file system name the file and what to do ------------------------

def refuse(code):
    def refused(*args, **kwargs):
        raise OSError(code, os.strerror(code))
    return refused


@pytest.mark.parametrize("call, code, advice", [
    ("fsync", errno.ENOSPC, "its disk is full (No space left on device); free some space on it, or set "
                            "COURSE_BUILD_DIR to a folder on another disk, and run again"),
    ("replace", errno.EDQUOT, "your disk quota is used up"),
    ("open", errno.EROFS, "its file system is read-only (Read-only file system); set COURSE_BUILD_DIR to a "
                          "writable folder elsewhere"),
])
def test_a_state_file_that_cannot_be_written_names_itself_and_what_to_do(tmp_path, monkeypatch, call, code, advice):
    """The old file stays whole, no temporary file is left, and the error (an OSError with the errno) says which
    file and what to do, not a bare `[Errno 28]`."""
    from utils.base import state

    path = state.write_json(tmp_path / "status.json", {"run": "earlier"})
    monkeypatch.setattr(os, call, refuse(code))
    with pytest.raises(state.StorageError) as caught:
        state.write_json(path, {"run": "this one"})
    monkeypatch.undo()
    assert str(caught.value).startswith(f"cannot write {path}: {advice}"), caught.value
    assert caught.value.errno == code and isinstance(caught.value, OSError)
    assert state.read_json(path) == {"run": "earlier"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["status.json"]


def test_a_full_disk_while_taking_a_state_files_lock_names_the_lock(tmp_path, monkeypatch):
    from utils.base import state

    monkeypatch.setattr(state, "open", refuse(errno.ENOSPC), raising=False)   # state's own open(), nobody else's
    with pytest.raises(state.StorageError, match=rf"cannot write {tmp_path / 'progress.json.lock'}: its disk is full"):
        state.update_json(tmp_path / "progress.json", lambda data: {"done": 1}, {})
    assert not (tmp_path / "progress.json").exists()


# --- broken state files name themselves -----------------------------------------------------------------------

@pytest.mark.parametrize("content, found", [(b"\xff\xfe not utf-8", "UnicodeDecodeError"),
                                            (b'{"run": ', "JSONDecodeError"),
                                            (b"[1, 2, 3]", "expected a JSON object, found list")])
def test_a_broken_status_file_is_named_and_the_report_still_builds(build_dir, content, found):
    from utils.machinery import report

    build_dir.mkdir(parents=True)
    (build_dir / "status.json").write_bytes(content)
    with pytest.warns(UserWarning, match=rf"run status .*status.json is corrupt .*{found}"):
        status = report.load_status(build_dir)
    assert status == {"labs": {}}
    with pytest.warns(UserWarning, match="status.json is corrupt"):   # said again, caught: not a real problem in the log
        assert report.build_report(build_dir).is_file()


@pytest.mark.parametrize("content", [b"\xff\xfe", b'["not", "a", "record"]'])
def test_a_broken_reference_record_stops_with_its_name_and_the_fix(tmp_path, monkeypatch, content):
    from utils import record
    from utils.base.state import CorruptStateError

    monkeypatch.setattr(record, "REFERENCE_DIR", tmp_path)
    (tmp_path / "h100.json").write_bytes(content)
    with pytest.raises(CorruptStateError, match=r"reference record .*h100.json is corrupt .*delete it or restore it"):
        record.load_reference()


def test_a_sidecar_of_the_wrong_shape_is_left_out_by_name(tmp_path):
    from utils import record

    (tmp_path / "01_vector_add.json").write_text('"just a string"')
    with pytest.warns(UserWarning, match="results sidecar .*01_vector_add.json is corrupt"):
        assert record.load_results(tmp_path) == {}


# --- caches and the build folder, also outside make (found by a second-user probe) --------------------------

def test_every_cache_the_labs_use_is_inside_the_private_build_folder(tmp_path, monkeypatch):
    """torch.compile's cache was /tmp/torchinductor_$USER: another user made it first (0777), planted a compiled
    module, and the victim's next torch.compile ran it. Every cache is now inside the build folder (0700)."""
    build = tmp_path / "build"
    monkeypatch.setenv("COURSE_BUILD_DIR", str(build))
    env = paths.run_environment(keep_existing=False)
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TORCH_EXTENSIONS_DIR", "TRITON_CACHE_DIR", "HF_HOME", "IPYTHONDIR",
                 "MPLCONFIGDIR", "JUPYTER_RUNTIME_DIR"):
        assert Path(env[name]).is_relative_to(build), name
    assert stat.S_IMODE(os.stat(build).st_mode) == 0o700         # build_dir() made it private on the way


def test_the_build_folder_is_private_whoever_asks_first(tmp_path, monkeypatch):
    """A lab's code called outside make (a learner's script) made build/ 0755 before; now build_dir() makes it."""
    build = tmp_path / "checkout" / "build"
    monkeypatch.setenv("COURSE_BUILD_DIR", str(build))
    assert paths.build_dir() == build and stat.S_IMODE(os.stat(build).st_mode) == 0o700
    build.chmod(0o755)
    paths.results_dir()
    assert stat.S_IMODE(os.stat(build).st_mode) == 0o700


def test_a_lab_started_outside_make_gets_the_course_caches(tmp_path, monkeypatch):
    from utils import course

    monkeypatch.setenv("COURSE_BUILD_DIR", str(tmp_path / "build"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(course, "check_parameters", lambda lab, scope: None)
    monkeypatch.setattr(course.devices, "detect", lambda d: types.SimpleNamespace(is_gpu=True))
    monkeypatch.setattr(course.record, "start", lambda lab, dev: types.SimpleNamespace(given=lambda parameters: None))
    course.start("00_environment", {"DEVICE": "cpu"})
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "build" / "cache" / "torchinductor")
