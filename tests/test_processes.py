"""utils.base.processes: a started process group ends with its owner, whatever ends the owner, and a later run
ends the groups of dead owners only."""
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import ROOT
from utils.base import processes, state


def wait_until(predicate, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port):
    with socket.socket() as s:
        s.settimeout(0.3)
        return s.connect_ex(("127.0.0.1", port)) == 0


SERVE = [sys.executable, "-m", "http.server", "--bind", "127.0.0.1"]


def test_stop_ends_the_group_with_what_it_left_behind(build_dir, tmp_path):
    port = free_port()
    with processes.Owned(["bash", "-c", f"sleep 300 & exec {' '.join(SERVE)} {port}"],
                         log_path=tmp_path / "log") as owned:
        assert wait_until(lambda: listening(port))
        assert processes.port_owned_by(port, owned.nonce) is True
        assert processes.port_owned_by(port, "not-the-nonce") is False
        record = state.read_json(owned.record)
        assert record["owner_pid"] == os.getpid() and record["pgid"] == owned.pgid
        assert record["uid"] == os.getuid() and record["guard_start"] == processes.start_time(owned.pgid)
    assert not processes.group_alive(owned.pgid) and not listening(port)
    assert not owned.record.exists()


def test_a_command_that_exits_takes_its_leftovers_and_reports_its_code(build_dir, tmp_path):
    owned = processes.Owned(["bash", "-c", "sleep 300 & exit 7"], log_path=tmp_path / "log").start()
    assert wait_until(lambda: owned.poll() is not None)
    assert owned.returncode == 7
    assert wait_until(lambda: not processes.group_alive(owned.pgid))
    owned.stop()


OWNER = textwrap.dedent("""
    import sys, time
    from utils.base import processes
    p = processes.Owned(sys.argv[2:], log_path=sys.argv[1]).start()
    print(p.pgid, flush=True)
    time.sleep(600)
""")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_the_group_ends_when_its_owner_dies(build_dir, tmp_path, sig):
    """The owner (a notebook's kernel, here a plain Python process) is killed: nothing it started lives on, and no
    record of it is left behind (the owner's own clean-up never ran: the guard forgets the record)."""
    port = free_port()
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(tmp_path / "log"), *SERVE, str(port)],
                             cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE, text=True)
    pgid = int(owner.stdout.readline())
    assert wait_until(lambda: listening(port))
    owner.send_signal(sig)
    owner.wait(timeout=10)
    assert wait_until(lambda: not processes.group_alive(pgid)), "the group outlived its owner"
    assert not listening(port)
    assert wait_until(lambda: not (processes.records_dir() / f"{pgid}.json").exists()), "a stale process record"


def test_reap_orphans_ends_dead_owners_groups_and_spares_live_ones(build_dir, tmp_path):
    folder = processes.records_dir()
    # an orphan: a group whose recorded owner no longer exists (a process that has exited)
    orphan = subprocess.Popen(["sleep", "300"], start_new_session=True)
    gone = subprocess.Popen(["true"])
    gone.wait()
    state.write_json(folder / f"{orphan.pid}.json", {
        "pgid": orphan.pid, "guard_start": processes.start_time(orphan.pid), "uid": os.getuid(), "owner_pid": gone.pid,
        "owner_start": 1, "label": "stale server"})
    # another learner's live group: its owner runs
    live = subprocess.Popen(["sleep", "300"], start_new_session=True)
    state.write_json(folder / f"{live.pid}.json", {
        "pgid": live.pid, "guard_start": processes.start_time(live.pid), "uid": os.getuid(), "owner_pid": os.getpid(),
        "owner_start": processes.start_time(os.getpid()), "label": "live server"})
    # a record whose pid now belongs to another process (pid reuse): not touched, only forgotten
    reused = subprocess.Popen(["sleep", "300"], start_new_session=True)
    state.write_json(folder / f"{reused.pid}.json", {
        "pgid": reused.pid, "guard_start": 12345, "uid": os.getuid(), "owner_pid": gone.pid, "owner_start": 1})
    try:
        reaped = processes.reap_orphans()
        assert [r["pgid"] for r in reaped] == [orphan.pid]
        assert orphan.wait(timeout=15) is not None
        assert live.poll() is None and reused.poll() is None
        assert (folder / f"{live.pid}.json").exists() and not (folder / f"{orphan.pid}.json").exists()
        assert not (folder / f"{reused.pid}.json").exists()
    finally:
        for p in (orphan, live, reused):
            p.kill()
            p.wait()


@pytest.mark.parametrize("flaw", ["no start time", "start time null", "wrong start time", "another uid", "no uid",
                                  "no owner", "pgid 0"])
def test_a_record_that_does_not_prove_the_group_is_ours_ends_nothing(build_dir, flaw):
    """The owner is dead, the recorded pgid is a live process of ours, but the record lacks (or contradicts) its
    start time or its user: reap_orphans forgets the record and the process lives on."""
    folder = processes.records_dir()
    bystander = subprocess.Popen(["sleep", "30"], start_new_session=True)
    gone = subprocess.Popen(["true"])
    gone.wait()
    record = {"pgid": bystander.pid, "guard_start": processes.start_time(bystander.pid), "uid": os.getuid(),
              "owner_pid": gone.pid, "owner_start": 1.0, "label": "not ours to end"}
    if flaw == "no start time":
        del record["guard_start"]
    elif flaw == "start time null":
        record["guard_start"] = None
    elif flaw == "wrong start time":
        record["guard_start"] += 1
    elif flaw == "another uid":
        record["uid"] = os.getuid() + 1
    elif flaw == "no uid":
        del record["uid"]
    elif flaw == "no owner":
        del record["owner_pid"]
    elif flaw == "pgid 0":                 # os.killpg(0) would end our own group
        record["pgid"] = 0
    path = state.write_json(folder / f"{bystander.pid}.json", record)
    try:
        assert processes.reap_orphans() == []
        assert bystander.poll() is None, "a process the record did not prove ours was ended"
        assert not path.exists()
    finally:
        bystander.kill()
        bystander.wait()


def test_a_corrupt_record_is_dropped(build_dir):
    folder = processes.records_dir()
    folder.mkdir(parents=True)
    (folder / "123.json").write_text('{"pgid": 12')
    with pytest.warns(UserWarning, match="123.json is corrupt"):
        assert processes.reap_orphans() == []
    assert not (folder / "123.json").exists()
