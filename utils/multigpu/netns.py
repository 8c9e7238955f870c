"""A private network for lab 06's two-"node" demonstration: TCP stores on 127.0.0.1 only, inside a Linux network
namespace with only a loopback interface where the machine allows one.

torch's TCP store (the c10d rendezvous of torchrun's agents, and the store node 0's agent shares with its ranks)
listens on every interface of the machine (`ss -ltn` shows `*:PORT`, IPv4 and IPv6), whatever address it is given.
``python -m utils.multigpu.netns torchrun ARGS...`` is torchrun (``torch.distributed.run``'s own ``main``) with every
TCPStore that starts a server given a socket the course bound to its host, which must be a loopback address
(TCPStore's ``master_listen_fd``): the stores listen on 127.0.0.1 and nowhere else (``loopback_store_class``).

The namespace is a second wall, around whatever else the agents and ranks might open: inside a network namespace of
its own the only interface is that namespace's loopback, so no other machine, and no other local user's process, can
reach the store. ``Namespace()`` starts a small holder process in a new user + network namespace (util-linux's ``unshare``), brings its
loopback up, and gives the command prefix (``nsenter``) that runs a process inside it. No root is needed where the
kernel lets an unprivileged user create user namespaces, as the mainline kernel does by default and Debian's does
since Debian 11. Ubuntu restricts them through AppArmor since 23.10 (``kernel.apparmor_restrict_unprivileged_userns=1``,
the default of 24.04 LTS and later): a program that no AppArmor profile allows ``userns``, ``unshare`` among them,
gets a user namespace without any capability in it, so the network namespace cannot be made; likewise
``user.max_user_namespaces=0`` (RHEL 7's default) or a container that forbids them. Where the machine refuses (no
``unshare``/``nsenter``, or any of those), ``Namespace.start()`` returns the reason and the caller runs without a
namespace, on the machine's loopback interface only (``utils.multigpu.launch.torchrun_agents``): reachable by other
users of this machine, not from the network.

    python -m utils.multigpu.netns hold PIDFILE      # the holder (started by Namespace)
    python -m utils.multigpu.netns torchrun ARGS...  # torchrun, its TCP stores on the loopback interface only
"""
from __future__ import annotations

import fcntl
import functools
import ipaddress
import os
import shutil
import socket
import struct
import sys
import time
from pathlib import Path

from utils.base import processes

SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
STORE_BACKLOG = 1024       # the listen() backlog of the socket handed to a TCP store
APPARMOR_USERNS = Path("/proc/sys/kernel/apparmor_restrict_unprivileged_userns")   # Ubuntu 23.10 and later


def restriction() -> str:
    """Why this kernel may refuse an unprivileged user namespace, where it says so ("" otherwise)."""
    try:
        if APPARMOR_USERNS.read_text().strip() == "1":
            return "AppArmor restricts unprivileged user namespaces here: kernel.apparmor_restrict_unprivileged_userns=1"
    except OSError:
        pass
    return ""


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
        why = "; ".join(filter(None, [log[-1] if log else "no output", restriction()]))
        return f"this machine refused a network namespace ({why})"

    def prefix(self) -> list[str]:
        """The command prefix that runs a process inside the namespace, as this user."""
        return ["nsenter", f"--target={self.pid}", "--user", "--net", "--preserve-credentials", "--"]

    def stop(self) -> None:
        if self.holder is not None:
            self.holder.stop()


def loopback_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host`:`port` (port 0: a free port) and listening; `host` must be, or resolve to, a
    loopback address (IPv4 first: "localhost" is 127.0.0.1), else ValueError."""
    infos = sorted(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM), key=lambda i: i[0] != socket.AF_INET)
    family, _, _, _, address = infos[0]
    if not ipaddress.ip_address(address[0]).is_loopback:
        raise ValueError(f"a TCP store of this run may listen on the loopback interface only, not on {host!r} "
                         f"({address[0]}): give it 127.0.0.1")
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(STORE_BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


@functools.cache
def loopback_store_class():
    """`LoopbackTCPStore`: torch's TCPStore, whose server (`is_master=True`) listens on a socket bound to its host
    (`loopback_socket`: loopback only) rather than on every interface. Made on first use (it imports torch)."""
    from datetime import timedelta

    import torch.distributed as dist

    class LoopbackTCPStore(dist.TCPStore):
        def __init__(self, host_name: str, port: int, world_size: int | None = None, is_master: bool = False,
                     timeout: timedelta = timedelta(seconds=300), wait_for_workers: bool = True,
                     multi_tenant: bool = False, master_listen_fd: int | None = None, use_libuv: bool = True):
            sock = None
            if is_master and master_listen_fd is None:
                sock = loopback_socket(host_name, port)
                port, master_listen_fd = sock.getsockname()[1], sock.fileno()
            try:
                super().__init__(host_name, port, world_size, is_master, timeout, wait_for_workers, multi_tenant,
                                 master_listen_fd, use_libuv)
            except BaseException:
                if sock is not None:
                    sock.close()
                raise
            if sock is not None:
                sock.detach()      # the store's server owns the socket now, and closes it when it ends

    LoopbackTCPStore.__doc__ = loopback_store_class.__doc__
    return LoopbackTCPStore


def install_loopback_stores() -> None:
    """Make every TCPStore of this process a `LoopbackTCPStore`: torch.distributed's, and the name in each of torch's
    modules that imported it (the rendezvous modules are imported first, so none keeps torch's own)."""
    import torch.distributed as dist

    loopback = loopback_store_class()
    original = loopback.__mro__[1]
    dist.TCPStore = loopback
    import torch.distributed.elastic.rendezvous.c10d_rendezvous_backend  # noqa: F401
    import torch.distributed.elastic.rendezvous.dynamic_rendezvous  # noqa: F401
    import torch.distributed.elastic.utils.distributed  # noqa: F401
    import torch.distributed.rendezvous  # noqa: F401
    import torch.distributed.run  # noqa: F401
    for name, module in list(sys.modules.items()):
        if name.startswith("torch") and getattr(module, "TCPStore", None) is original:
            setattr(module, "TCPStore", loopback)


def _torchrun(argv: list[str]) -> None:
    install_loopback_stores()
    from torch.distributed.run import main

    main(argv)


def _hold(pidfile: str) -> int:
    loopback_up()
    tmp = Path(pidfile).with_suffix(".tmp")
    tmp.write_text(str(os.getpid()))
    tmp.replace(pidfile)
    while True:            # until the course ends the group (utils.base.processes)
        time.sleep(3600)


USAGE = "usage: python -m utils.multigpu.netns hold PIDFILE | torchrun ARGS..."

if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "hold":
        sys.exit(_hold(sys.argv[2]))
    if len(sys.argv) >= 2 and sys.argv[1] == "torchrun":
        sys.exit(_torchrun(sys.argv[2:]))
    sys.exit(USAGE)
