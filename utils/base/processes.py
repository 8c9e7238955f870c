"""Processes the course starts (lab 05's server, lab 06's ranks): owned, recorded, never left behind.

`Owned(cmd, ...)` runs a command in a process group of its own, under a small guard process
(`python -m utils.base.processes guard ...`, the group's leader). The guard ends the whole group when

- its owner (the Python process that started it: a notebook's kernel) goes away for any reason: it
  reads a pipe from the owner and reaches end-of-file when the owner exits, is killed (SIGKILL, out of
  memory) or is restarted, and Linux also sends it SIGTERM when its parent dies (PR_SET_PDEATHSIG);
- it gets SIGTERM, SIGINT or SIGHUP (what `Owned.stop()` sends);
- the command exits by itself (whatever it left behind in the group goes too).

Every group is recorded in `build/processes/<pgid>.json` with its leader's start time, its owner's pid and
start time, and this user's uid (processes are read through psutil).
`reap_orphans()` ends the groups whose owner is gone, and never one whose owner still runs (another
learner's, another run's), nor one whose leader is not the recorded process of this user (pid, start time
and uid must all match; a record that lacks any of them is forgotten without ending anything). The
command's environment carries a nonce (`COURSE_PROCESS_NONCE`): `port_owned_by(port, nonce)` tells whether
whoever listens on a port is really this group.
"""
from __future__ import annotations

import atexit
import ctypes
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from utils.base import state
from utils.base.paths import LOOPBACK, REPO_ROOT, build_dir, port_open

NONCE_VAR = "COURSE_PROCESS_NONCE"
PR_SET_PDEATHSIG = 1


def start_time(pid: int) -> float | None:
    """The start time of process `pid` (psutil's create_time), or None when it does not exist or is a
    zombie: with the pid it identifies a process even after the pid is reused."""
    try:
        proc = psutil.Process(pid)
        return None if proc.status() == psutil.STATUS_ZOMBIE else proc.create_time()
    except psutil.Error:
        return None


def alive(pid: int, started: float | None = None) -> bool:
    """Whether process `pid` runs (and, given `started`, is the same process that started then)."""
    now = start_time(pid)
    if now is None:
        return False
    return started is None or now == started


def uid_of(pid: int) -> int | None:
    """The real uid of process `pid`, or None when it does not exist or cannot be read."""
    try:
        return psutil.Process(pid).uids().real
    except psutil.Error:
        return None


def _group_members(pgid: int) -> list[int]:
    """Pids of the live (not zombie) processes of process group `pgid`."""
    found = []
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return found


def group_alive(pgid: int) -> bool:
    """Whether any process of process group `pgid` is still running (zombies count as gone)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return bool(_group_members(pgid))


def end_group(pgid: int, timeout: float = 20.0) -> None:
    """SIGTERM to the group, SIGKILL after `timeout` s, then wait (10 s at most) until none is left."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not group_alive(pgid):
                return
            time.sleep(0.05)


def records_dir() -> Path:
    return build_dir() / "processes"


class Owned:
    """`with Owned(cmd, log_path=..., env=...) as p:` ... `p.returncode`, `p.pgid`.

    The command runs under a guard in its own process group; leaving the block (or `stop()`, or the
    interpreter's exit, or the owner's death) ends the whole group."""

    def __init__(self, cmd: list[str], *, log_path: str | Path, env: dict | None = None,
                 stop_timeout: float = 20.0, label: str = "", cwd: str | None = None, extra: dict | None = None):
        self.cmd, self.log_path, self.stop_timeout = list(cmd), Path(log_path), stop_timeout
        self.env = dict(os.environ if env is None else env)
        self.nonce = secrets.token_hex(8)
        self.env[NONCE_VAR] = self.nonce
        self.label, self.cwd, self.extra = label or Path(cmd[0]).name, cwd, dict(extra or {})
        self.proc: subprocess.Popen | None = None
        self.pgid: int | None = None
        self.record: Path | None = None
        self.returncode: int | None = None

    def start(self) -> "Owned":
        reap_orphans()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:
            log.write("$ " + " ".join(self.cmd) + "\n")
        log = open(self.log_path, "a")
        guard = [sys.executable, "-m", "utils.base.processes", "guard", "--timeout", str(self.stop_timeout),
                 "--records", str(records_dir()), "--", *self.cmd]
        env = dict(self.env)
        root = str(REPO_ROOT)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        try:
            self.proc = subprocess.Popen(guard, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, env=env, cwd=self.cwd)
        finally:
            log.close()
        self.pgid = self.proc.pid
        self.record = records_dir() / f"{self.pgid}.json"
        state.write_json(self.record, {
            "pgid": self.pgid, "guard_start": start_time(self.pgid), "uid": os.getuid(), "owner_pid": os.getpid(),
            "owner_start": start_time(os.getpid()), "command": self.cmd, "label": self.label,
            "log": str(self.log_path), "nonce": self.nonce, "created": time.time(), **self.extra})
        atexit.register(self.stop)
        return self

    def poll(self) -> int | None:
        """The command's exit code once it has exited (the guard exits with it), else None."""
        if self.proc is not None and self.returncode is None:
            self.returncode = self.proc.poll()
        return self.returncode

    def stop(self) -> None:
        """End the group and forget its record; safe to call more than once."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        atexit.unregister(self.stop)
        end_group(proc.pid, self.stop_timeout)
        try:
            self.returncode = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        if proc.stdin:
            try:
                proc.stdin.close()
            except OSError:
                pass
        if self.record is not None:
            self.record.unlink(missing_ok=True)

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> "Owned":
        return self.start()

    def __exit__(self, *exc) -> bool:
        self.stop()
        return False


_RECORD_FIELDS = {"pgid": int, "guard_start": (int, float), "uid": int, "owner_pid": int, "owner_start": (int, float)}


def _complete(rec) -> bool:
    """Whether a process record names its group's leader, its owner and its user well enough to act on it."""
    if not isinstance(rec, dict):
        return False
    if any(isinstance(rec.get(k), bool) or not isinstance(rec.get(k), kind) for k, kind in _RECORD_FIELDS.items()):
        return False
    return rec["pgid"] > 1 and rec["owner_pid"] > 0 and rec["pgid"] != os.getpgrp()   # never killpg(0) or our own


def _ours(rec: dict) -> bool:
    """Whether the recorded group's leader still runs and is the very process recorded: same pid, same start
    time, and this user's (a reused pid, another user's process, or a record of another user is not)."""
    return (rec["uid"] == os.getuid() and start_time(rec["pgid"]) == rec["guard_start"]
            and uid_of(rec["pgid"]) == rec["uid"])


def reap_orphans(folder: Path | None = None, timeout: float = 10.0) -> list[dict]:
    """End the recorded groups whose owner is gone; returns their records. A group whose owner still
    runs is left alone, whoever it belongs to; a group is ended only when its leader's pid, start time and
    uid match the record, and a record lacking any of them is forgotten without ending anything."""
    folder = folder or records_dir()
    reaped = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        rec = state.read_json(path, None, what="process record", shape=dict)
        if not _complete(rec):
            path.unlink(missing_ok=True)     # nothing in it identifies a process surely: end nothing
            continue
        if alive(rec["owner_pid"], rec["owner_start"]):
            continue
        if _ours(rec):
            end_group(rec["pgid"], timeout)
            reaped.append(rec)
        path.unlink(missing_ok=True)     # an owner that is gone, and a group that is gone or was never ours
    return reaped


# --- who listens on a port -------------------------------------------------------------------------

def listener_pids(port: int) -> set[int]:
    """Pids of the processes (those this user may inspect) that hold a socket listening on `port`."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return set()
    return {c.pid for c in conns if c.pid and c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port}


def environ(pid: int) -> dict[str, str]:
    """Process `pid`'s environment ({} if it is gone or not this user's)."""
    try:
        return psutil.Process(pid).environ()
    except psutil.Error:
        return {}


def port_owned_by(port: int, nonce: str, host: str = LOOPBACK) -> bool | None:
    """True if the process listening on `port` carries `nonce` in its environment; False if another process
    listens there, one of this user's or one this user cannot see (another user's: it may have taken the port
    first, and must never be sent a key or a prompt); None if nothing listens yet."""
    pids = listener_pids(port)
    if not pids:
        return False if port_open(port, host) else None
    return any(environ(pid).get(NONCE_VAR) == nonce for pid in pids)


# --- the guard ------------------------------------------------------------------------------------

def _guard(cmd: list[str], timeout: float, records: Path | None = None) -> int:
    """Run `cmd` in this process group; end the group when the owner goes away or a signal comes, and then forget
    the group's record in `records` (an owner killed by SIGTERM or SIGKILL never runs its own clean-up)."""
    try:   # Linux: SIGTERM when the parent (the owner) dies, whatever killed it
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    ending, ended = threading.Lock(), threading.Event()

    def end(reason: str) -> None:
        if not ending.acquire(blocking=False):
            return                          # already ending (the group's SIGTERM reaches us too)
        print(f"[utils.base.processes guard] {reason}: ending process group {os.getpgrp()}", flush=True)
        _end_others(timeout)
        if records is not None:
            _forget_own_record(Path(records))
        ended.set()

    def on_signal(signum, frame):
        end(f"signal {signal.Signals(signum).name}")

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
    if os.getppid() == 1:                  # the owner died before prctl took effect
        end("owner gone before start")

    def watch_owner() -> None:
        try:
            while sys.stdin.buffer.read(4096):
                pass
        except (OSError, ValueError):
            pass
        end("owner gone (its pipe closed)")

    threading.Thread(target=watch_owner, daemon=True).start()
    code = child.wait()
    end(f"{Path(cmd[0]).name} exited with code {code}")   # whatever it left behind in the group goes too
    ended.wait(timeout + 15)
    return code if code >= 0 else 128 - code


def _forget_own_record(records: Path) -> None:
    """Remove this group's record, if it is this group's (its pgid and leader's start time are ours)."""
    path = records / f"{os.getpgrp()}.json"
    rec = state.read_json(path, None, what="process record", shape=dict) if path.exists() else None
    if rec and rec.get("pgid") == os.getpgrp() and rec.get("guard_start") == start_time(os.getpid()):
        path.unlink(missing_ok=True)


def _end_others(timeout: float) -> None:
    """SIGTERM to every other process of this group, SIGKILL to those left after `timeout` s."""
    for pid in _others_in_group():
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _others_in_group():
        time.sleep(0.05)
    for pid in _others_in_group():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _others_in_group() -> list[int]:
    me = os.getpid()
    return [pid for pid in _group_members(os.getpgrp()) if pid != me]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 4 or argv[0] != "guard" or "--" not in argv:
        print("usage: python -m utils.base.processes guard --timeout SECONDS [--records DIR] -- COMMAND...",
              file=sys.stderr)
        return 2
    split = argv.index("--")
    timeout = float(argv[argv.index("--timeout") + 1]) if "--timeout" in argv[:split] else 20.0
    records = Path(argv[argv.index("--records") + 1]) if "--records" in argv[:split] else None
    code = _guard(argv[split + 1:], timeout, records)
    sys.stdout.flush()
    os._exit(code)   # not a normal exit: the thread still reading the owner's pipe must not block it


if __name__ == "__main__":
    raise SystemExit(main())
