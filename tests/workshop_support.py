"""Helpers of the workshop tests (tests/test_workshop_*.py): a fresh copy of the checkout, free ports, waiting for a
server to answer."""
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def copy_checkout(dest: Path) -> Path:
    """What a fresh clone has (tracked and new, not ignored files), plus this checkout's environment."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split("\n")
    for name in filter(None, names):
        src = ROOT / name
        if src.is_file() and not src.is_symlink():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    (dest / ".venv").symlink_to((ROOT / ".venv").resolve())
    return dest


def wait_until_serving(probe, proc: subprocess.Popen, failure, timeout: float = 90.0) -> None:
    """Call `probe` until it no longer raises OSError; pytest.fail(failure()) if `proc` exits or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            probe()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(failure())
            time.sleep(0.5)
