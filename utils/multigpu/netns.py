"""A private network for lab 06's two-"node" demonstration: a Linux network namespace with only a loopback interface.

torch's TCP store (the c10d rendezvous of torchrun's agents) listens on every interface of the machine, whatever
address it is given. Inside a network namespace of its own the only interface is that namespace's loopback, so no
other machine, and no other local user's process, can reach the store. ``Namespace()`` starts a small holder process
in a new user + network namespace (util-linux's ``unshare``; no root needed where the kernel allows unprivileged user
namespaces, as Debian and Ubuntu do), brings its loopback up, and gives the command prefix (``nsenter``) that runs a
process inside it. Where the machine refuses (no ``unshare``/``nsenter``, user namespaces off, a container that
forbids them), ``Namespace.start()`` returns the reason and the caller runs on the machine's network as before.

    python -m utils.multigpu.netns hold PIDFILE     # the holder (started by Namespace)
"""
from __future__ import annotations

import fcntl
import os
import shutil
import socket
import struct
import sys
import time
from pathlib import Path

from utils.base import processes

SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


def loopback_up() -> None:
    """Bring this namespace's loopback interface up (a new network namespace starts with it down)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sH", fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sH", b"lo", 0)))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | IFF_UP))


class Namespace:
    """A user + network namespace held open by a process the course owns (``utils.base.processes.Owned``)."""

    def __init__(self, folder: Path, *, label: str = "network namespace"):
        self.folder, self.label = Path(folder), label
        self.holder: processes.Owned | None = None
        self.pid: int | None = None

    def start(self, timeout: float = 10.0) -> str | None:
        """Start the holder; None when the namespace is ready, else why it cannot be made here."""
        missing = [tool for tool in ("unshare", "nsenter") if shutil.which(tool) is None]
        if missing:
            return f"{' and '.join(missing)} not found (util-linux)"
        pidfile = self.folder / "netns.pid"
        pidfile.unlink(missing_ok=True)
        self.holder = processes.Owned(
            ["unshare", "--user", "--map-root-user", "--net", "--", sys.executable, "-m", "utils.multigpu.netns",
             "hold", str(pidfile)], log_path=self.folder / "netns.log", label=self.label, stop_timeout=5).start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.holder.poll() is None and not pidfile.exists():
            time.sleep(0.05)
        if pidfile.exists():
            self.pid = int(pidfile.read_text())
            return None
        self.stop()
        log = (self.folder / "netns.log").read_text(errors="replace").strip().splitlines()
        return f"this machine refused a network namespace ({log[-1] if log else 'no output'})"

    def prefix(self) -> list[str]:
        """The command prefix that runs a process inside the namespace, as this user."""
        return ["nsenter", f"--target={self.pid}", "--user", "--net", "--preserve-credentials", "--"]

    def stop(self) -> None:
        if self.holder is not None:
            self.holder.stop()


def _hold(pidfile: str) -> int:
    loopback_up()
    tmp = Path(pidfile).with_suffix(".tmp")
    tmp.write_text(str(os.getpid()))
    tmp.replace(pidfile)
    while True:            # until the course ends the group (utils.base.processes)
        time.sleep(3600)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "hold":
        sys.exit("usage: python -m utils.multigpu.netns hold PIDFILE")
    sys.exit(_hold(sys.argv[2]))
