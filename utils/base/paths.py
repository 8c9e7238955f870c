"""Where the course's files are, where it may write, its run environment (course.env) and its ports.

    python -m utils.base.paths env                # `export NAME=value` lines of course.env, for shell scripts
    python -m utils.base.paths private FOLDER...  # create (0700) and check the course's private folders
"""
from __future__ import annotations

import os
import re
import shlex
import stat
import socket
import sys
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]     # utils/
REPO_ROOT = PACKAGE_DIR.parent
DATA_DIR = PACKAGE_DIR / "data"
REFERENCE_DIR = PACKAGE_DIR / "reference"
SOLUTIONS_DIR = REPO_ROOT / "solutions"
LABS_DIR = REPO_ROOT / "labs"
ENV_FILE = REPO_ROOT / "course.env"
LOOPBACK = "127.0.0.1"
_LINE = re.compile(r"^(?P<name>[A-Z_][A-Z0-9_]*)=(?P<value>.*)$")


class UnsafePath(PermissionError):
    """A folder the course would keep private is a link, another user's, or writable by others; says which."""


def private_dir(folder: Path) -> Path:
    """`folder`, created by this user with mode 0700 if missing, and checked before use: a real folder (not a
    symbolic link), owned by this user, not writable by group or others. A folder of ours with a looser mode is
    tightened to 0700; anything else raises UnsafePath naming the path and what to do. Parents are made as
    `mkdir -p` makes them (inside a location of this user's: the checkout's build/, ~/.cache)."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(folder)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise UnsafePath(f"{folder} is {'a symbolic link' if stat.S_ISLNK(info.st_mode) else 'not a folder'}: the "
                         "course keeps its files in a private folder of its own; remove it (or set COURSE_BUILD_DIR "
                         "to a folder of yours) and run again")
    if info.st_uid != os.geteuid():
        raise UnsafePath(f"{folder} belongs to uid {info.st_uid}, not to you (uid {os.geteuid()}): another user "
                         "made it, so nothing in it is trusted; remove it or set COURSE_BUILD_DIR to a folder of yours")
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(folder, 0o700)
    return folder


def may_write(folder: Path) -> bool:
    """Whether this user may create or change files in `folder` (or, if it does not exist yet, in the
    nearest folder above it that does)."""
    folder = Path(folder)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return os.access(folder, os.W_OK)


class BuildFolderError(PermissionError):
    """The build folder exists but this user may not write in it; says which and how to fix it."""


_told_about_cache = False


def _writable_build(folder: Path) -> Path:
    """`folder`, unless it exists and this user may not write in it: then BuildFolderError naming it and the fix
    (results silently going elsewhere would leave the report and the status out of date)."""
    if folder.is_dir() and not os.access(folder, os.W_OK):
        owner, me = folder.stat().st_uid, os.geteuid()
        if owner == me:
            fix = f"make it yours again: chmod u+w {folder}, or set COURSE_BUILD_DIR to a folder of yours"
        else:
            fix = f"it belongs to uid {owner} (you are uid {me}): set COURSE_BUILD_DIR to a folder of yours"
        raise BuildFolderError(f"the build folder {folder} is not writable by you; {fix}")
    return folder


def build_dir() -> Path:
    """Where executed notebooks, results and the report go: $COURSE_BUILD_DIR, else ./build in the
    course checkout (an editable install), else ./build in the working directory; always a private folder
    (`private_dir`: 0700, this user's, not a link), also when a lab's code runs outside make. A build folder that exists
    but is not writable by this user raises BuildFolderError; a checkout shared read-only by several learners
    (the checkout and its build/, if any, not writable) falls back to ~/.cache/rocm-cuda-labs/build and says so
    once (a workshop's JupyterHub sets COURSE_BUILD_DIR per learner instead: docs/jupyterhub/)."""
    return private_dir(_locate_build())     # made 0700 by this user, checked, whoever asks first


def _locate_build() -> Path:
    global _told_about_cache
    env = os.environ.get("COURSE_BUILD_DIR")
    if env:
        return _writable_build(Path(env).resolve())
    if (REPO_ROOT / "pyproject.toml").exists():
        build = REPO_ROOT / "build"
        if may_write(REPO_ROOT) or (build.exists() and may_write(build)):
            return _writable_build(build)
        cache = Path.home() / ".cache" / "rocm-cuda-labs" / "build"
        if not _told_about_cache:
            _told_about_cache = True
            what = "and so is its build/" if build.exists() else "and has no build/"
            print(f"note: the checkout {REPO_ROOT} is read-only {what}: results go to {cache} "
                  "(set COURSE_BUILD_DIR to choose another folder)", file=sys.stderr)
        return cache
    return _writable_build(Path.cwd() / "build")


def results_dir() -> Path:
    """The labs' recorded figures (`utils.record`): build/results, what `make run` writes and `make report` reads;
    build/results-work for a notebook run in the learner's work/, so a Run All there never replaces them."""
    try:
        in_work = Path.cwd().name == "work"
    except OSError:                      # the folder it ran in is gone
        in_work = False
    return build_dir() / ("results-work" if in_work else "results")


def course_env_file(path: Path = ENV_FILE) -> dict[str, str]:
    """course.env as written: {NAME: value with ${...} unexpanded}. A line that is not a comment, blank
    or NAME=value is an error naming the file and the line."""
    found = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            raise ValueError(f"{path}:{number}: not NAME=value: {line!r}")
        found[m.group("name")] = m.group("value")
    return found


def run_environment(build: Path | None = None, *, keep_existing: bool = True) -> dict[str, str]:
    """The course's run environment (course.env) with ${COURSE_BUILD_DIR} set to `build` (default: this
    user's build folder), COURSE_BUILD_DIR included. `keep_existing`: a variable already in os.environ
    keeps its value (a learner's own HF_HOME, a test's private cache)."""
    build = Path(build) if build is not None else build_dir()
    env = {"COURSE_BUILD_DIR": str(build)}
    for name, value in course_env_file().items():
        env[name] = value.replace("${COURSE_BUILD_DIR}", str(build))
    if keep_existing:
        env = {k: os.environ.get(k, v) for k, v in env.items()}
    return env


def free_port(host: str = LOOPBACK) -> int:
    """A port that is free on `host` now (the caller binds it next; another process may take it first)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_open(port: int, host: str = LOOPBACK) -> bool:
    """Whether something accepts connections on host:port."""
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["env"]:
        try:
            environment = run_environment()
        except BuildFolderError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        for name, value in environment.items():
            print(f"export {name}={shlex.quote(value)}")
        return 0
    if argv[:1] == ["private"] and len(argv) > 1:
        try:
            for folder in argv[1:]:
                private_dir(Path(folder))
        except UnsafePath as exc:
            print(f"refused: {exc}", file=sys.stderr)
            return 1
        except OSError as exc:            # a read-only or full disk: named, with what to do, not a traceback
            print(f"cannot make {exc.filename or folder}: {exc.strerror}; set COURSE_BUILD_DIR to a folder of yours "
                  "on a writable disk and run again", file=sys.stderr)
            return 1
        return 0
    print("usage: python -m utils.base.paths env | private FOLDER...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
