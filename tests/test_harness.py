"""The `make run` harness: a failing lab does not stop the others, an interrupted run says so, parameters
are checked before anything runs, nothing hangs, corrupt state does not block a run, a slow lab says where it is,
and the kernels' noise stays out."""
import json
import os
import signal
import subprocess
import sys
import time

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from conftest import ROOT
from utils.base import processes
from utils.machinery import harness, narrate


DEVICE_LINE = 'DEVICE = "auto"  # choice auto|cpu|gpu|cuda|rocm: where it runs'
REPS_LINE = "REPS = None  # count up to 10000: timed repetitions"


def write_nb(path, *cells, parameters=DEVICE_LINE):
    nb = new_notebook(cells=[new_code_cell(parameters, metadata={"tags": ["parameters"]})]
                      + [new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


def status_of(build_dir):
    return json.loads((build_dir / "status.json").read_text())


def test_run_keeps_going_and_reports_the_failure(tmp_path, build_dir, capsys):
    bad = write_nb(tmp_path / "10_broken.ipynb", "raise RuntimeError('the kernel did not compile')")
    good = write_nb(tmp_path / "20_fine.ipynb",
                    "from utils import device, record\n"
                    "rec = record.start('20_fine', device.detect(DEVICE))\n"
                    "rec.metric('fine.value', 42.0, 'x', label='fine', size='n=1')")
    assert harness.main(["run", "--device", "cpu", str(bad), str(good)]) == 1
    status = status_of(build_dir)
    labs = status["labs"]
    assert status["run"]["state"] == "finished"
    assert labs["10_broken"]["status"] == "failed" and labs["10_broken"]["run_id"] == status["run"]["id"]
    assert "RuntimeError: the kernel did not compile" in labs["10_broken"]["error"]
    assert labs["20_fine"]["status"] == "ok" and labs["20_fine"]["parameters"] == {"DEVICE": "cpu"}
    assert labs["20_fine"]["seconds"] > 0
    assert (build_dir / "executed" / "10_broken.ipynb").exists()
    md = (build_dir / "report.md").read_text()
    assert "**FAILED**: RuntimeError: the kernel did not compile" in md
    assert "executed/10_broken.ipynb" in md
    assert "| fine | n=1 | 42 x |" in md
    assert "failed: 10_broken" in capsys.readouterr().out

    # Fixed, re-run alone: it is ok in the new run; the other lab is from the earlier run, not "ok".
    write_nb(bad, "print('fixed')")
    assert harness.main(["run", "--device", "cpu", str(bad)]) == 0
    labs = status_of(build_dir)["labs"]
    assert labs["10_broken"]["status"] == "ok"
    md = (build_dir / "report.md").read_text()
    assert "FAILED" not in md
    assert "| 20_fine | not run in the latest run (last: ok in run" in md


def test_parameters_are_passed_as_json_to_the_notebooks_that_declare_them(tmp_path, build_dir, capsys):
    a = write_nb(tmp_path / "30_params.ipynb", "assert DEVICE == 'cpu' and REPS == 8, (DEVICE, REPS)",
                 parameters=f"{DEVICE_LINE}\nREPS = 1  # count: repetitions")
    b = write_nb(tmp_path / "31_other.ipynb", "assert 'REPS' not in globals()")
    assert harness.main(["run", "--device", "cpu", "-p", "REPS", "8", str(a), str(b)]) == 0
    assert "REPS applies to 30_params only" in capsys.readouterr().out


@pytest.mark.parametrize("name, value, message", [
    ("SIZESS", "5", "SIZESS is not a parameter of the selected notebooks"),
    ("REPSS", "5", "REPSS is not a parameter of the selected notebooks (did you mean REPS?)"),
    ("WARMUP_MS", "NaN", "WARMUP_MS=nan must be a number >= 0 and <= 60,000"),
    ("WARMUP_MS", "Infinity", "WARMUP_MS=inf must be a number >= 0 and <= 60,000"),
    ("REPS", "-2", "REPS=-2 must be a positive whole number (> 0)"),
    ("REPS", "2.5", "REPS=2.5 must be a positive whole number, not a fraction"),
    ("SEQ_LENS", "128", "SEQ_LENS=128 must be a non-empty list of positive whole numbers, e.g. [64, 128]"),
    ("DEVICE", "tpu", "DEVICE='tpu' is not allowed"),
])
def test_bad_parameters_stop_the_run_before_anything_runs(tmp_path, build_dir, capsys, name, value, message):
    nb = write_nb(tmp_path / "40_p.ipynb", "open('ran', 'w').write('1')",
                  parameters="\n".join([DEVICE_LINE, REPS_LINE, "WARMUP_MS = 100  # milliseconds up to 60000: warm-up",
                                         "SEQ_LENS = None  # counts: sequence lengths"]))
    args = ["run", "--device", "cpu", "-p", name, value, str(nb)] if name != "DEVICE" else \
        ["run", "--device", value, str(nb)]
    assert harness.main(args) == 2
    err = capsys.readouterr().err
    assert f"ParameterError: {message}" in err, err
    assert not (tmp_path / "ran").exists() and not (build_dir / "status.json").exists()


def test_a_cell_that_never_ends_fails_its_lab_after_the_cell_timeout(tmp_path, build_dir):
    slow = write_nb(tmp_path / "50_slow.ipynb", "import time\ntime.sleep(600)")
    after = write_nb(tmp_path / "51_after.ipynb", "print('still ran')")
    start = time.monotonic()
    assert harness.main(["run", "--device", "cpu", "--cell-timeout", "3", str(slow), str(after)]) == 1
    assert time.monotonic() - start < 120
    labs = status_of(build_dir)["labs"]
    assert labs["50_slow"]["status"] == "failed" and "timed out" in labs["50_slow"]["error"].lower()
    assert labs["51_after"]["status"] == "ok"


def test_a_corrupt_status_file_does_not_block_the_next_run(tmp_path, build_dir):
    build_dir.mkdir(parents=True)
    (build_dir / "status.json").write_text('{"labs": {"00_environment": {"sta')
    nb = write_nb(tmp_path / "60_ok.ipynb", "print(1)")
    with pytest.warns(UserWarning, match="status.json is corrupt"):
        assert harness.main(["run", "--device", "cpu", str(nb)]) == 0
    assert status_of(build_dir)["labs"]["60_ok"]["status"] == "ok"


def kernel_pids():
    return {int(p.name) for p in __import__("pathlib").Path("/proc").glob("[0-9]*")
            if "ipykernel_launcher" in (p / "cmdline").read_bytes().decode(errors="replace")
            if (p / "cmdline").exists()}


@pytest.mark.parametrize("sig, code, name", [(signal.SIGINT, 130, "SIGINT"), (signal.SIGTERM, 143, "SIGTERM")])
def test_an_interrupted_run_says_so_and_leaves_no_kernel(tmp_path, build_dir, sig, code, name):
    """Ctrl-C or SIGTERM of `make run`'s process group in the middle of a lab: the lab is 'interrupted',
    the later ones 'not run', the exit status 130/143, the report says so, and the kernel is gone."""
    first = write_nb(tmp_path / "70_first.ipynb", "print('done')")
    sleepy = write_nb(tmp_path / "71_sleepy.ipynb",
                      "import os, pathlib, time\npathlib.Path(os.environ['MARK']).write_text(str(os.getpid()))\n"
                      "time.sleep(600)")
    later = write_nb(tmp_path / "72_later.ipynb", "print('later')")
    mark = tmp_path / "kernel.pid"
    env = dict(os.environ, COURSE_BUILD_DIR=str(build_dir), MARK=str(mark), PYTHONPATH=str(ROOT))
    run = subprocess.Popen([sys.executable, "-m", "utils.machinery.harness", "run", "--device", "cpu",
                            str(first), str(sleepy), str(later)], cwd=ROOT, env=env, start_new_session=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not mark.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert mark.exists(), "the sleeping cell never started"
    kernel = int(mark.read_text())
    os.killpg(run.pid, sig)                         # what Ctrl-C in a terminal, or `kill`, sends
    out, _ = run.communicate(timeout=60)
    assert run.returncode == code, out
    assert f"interrupted ({name})" in out
    status = status_of(build_dir)
    assert status["run"]["state"] == "interrupted" and status["run"]["signal"] == name
    labs = status["labs"]
    assert labs["70_first"]["status"] == "ok"
    assert labs["71_sleepy"]["status"] == "interrupted"
    assert labs["72_later"]["status"] == "not run"
    md = (build_dir / "report.md").read_text()
    assert "| 71_sleepy | **INTERRUPTED**" in md and "| 72_later | **NOT RUN**" in md
    deadline = time.monotonic() + 15
    while processes.alive(kernel) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes.alive(kernel), "the notebook's kernel outlived the interrupted run"


def test_a_second_run_in_the_same_build_folder_stops_at_once(tmp_path, build_dir, capsys):
    """Two `make run` in one checkout would overwrite each other's status: the second one says so."""
    held = harness._lock_build(build_dir)
    try:
        nb = write_nb(tmp_path / "80_x.ipynb", "print(1)")
        assert harness.main(["run", "--device", "cpu", str(nb)]) == 2
        err = capsys.readouterr().err
        assert "is in use by another `make run` (pid" in err and "COURSE_BUILD_DIR=" in err
    finally:
        held.close()
    assert harness.main(["run", "--device", "cpu", str(nb)]) == 0


@pytest.mark.parametrize("value, message", [("-Infinity", "REPS=-inf must be a positive whole number, not -inf"),
                                            ("-5", "REPS=-5 must be a positive whole number (> 0)"),
                                            ("nan", "REPS='nan' must be a positive whole number")])
@pytest.mark.parametrize("form", ["-p NAME VALUE", "-p NAME=VALUE"])
def test_a_value_that_starts_with_a_dash_reaches_the_parameter_check(tmp_path, build_dir, capsys, value, message,
                                                                    form):
    """argparse takes `-Infinity` for an option ("expected 2 arguments"): the harness reads `-p NAME VALUE` itself,
    so the value is refused by the parameter's name."""
    nb = write_nb(tmp_path / "45_p.ipynb", "open('ran', 'w').write('1')", parameters=f"{DEVICE_LINE}\n{REPS_LINE}")
    pair = ["-p", "REPS", value] if form == "-p NAME VALUE" else ["-p", f"REPS={value}"]
    assert harness.main(["run", "--device", "cpu", *pair, str(nb)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"ParameterError: {message}", err
    assert not (tmp_path / "ran").exists() and not (build_dir / "status.json").exists()


def test_a_parameter_without_a_value_is_named_in_one_line(tmp_path, build_dir, capsys):
    assert harness.main(["run", "--device", "cpu", "-p", "REPS"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "-p REPS" in err and "-p NAME VALUE or -p NAME=VALUE" in err, err


@pytest.mark.parametrize("name, content, problem", [
    ("notes.txt", "hello\n", "is not a notebook"),
    ("truncated.ipynb", '{"cells": [', "is not a readable notebook (NotJSONError"),
    ("empty.ipynb", "", "is not a readable notebook (NotJSONError"),
    ("no_cells.ipynb", '{"nbformat": 4, "cells": 3}', "is not a readable notebook"),
    ("missing.ipynb", None, "no such notebook"),
])
def test_a_file_that_is_not_a_notebook_is_named_in_one_line(tmp_path, build_dir, capsys, name, content, problem):
    """`harness run notes.txt` (or a corrupt or missing notebook): one line naming the file, exit 2, no traceback,
    nothing run."""
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    assert harness.main(["run", "--device", "cpu", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {path}") and problem in err, err
    assert "Traceback" not in err and not (build_dir / "status.json").exists()


def test_a_full_disk_at_the_run_lock_is_named_with_the_fix(tmp_path, build_dir, capsys, monkeypatch):
    """ENOSPC while the run takes build/run.lock: one line naming the lock's path and what to do, exit 2."""
    import errno

    def no_space(path, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    nb = write_nb(tmp_path / "90_x.ipynb", "print(1)")
    monkeypatch.setattr(harness, "open", no_space, raising=False)      # the harness's own open(), nobody else's
    assert harness.main(["run", "--device", "cpu", str(nb)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot write {build_dir / 'run.lock'}: its disk is full"), err
    assert "free some space on it, or set COURSE_BUILD_DIR to a folder on another disk" in err


def test_a_slow_lab_says_where_it_is_and_that_it_is_slower_than_usual(tmp_path, build_dir, capfd, monkeypatch):
    """A line every COURSE_NARRATE_SECONDS with the lab, its section, its cell and the time so far; once the lab
    runs far past its last ok run on this device (faked: 0.2 s), one line saying so, with the machine's load."""
    nb = write_nb(tmp_path / "85_slow.ipynb", "import time", "time.sleep(3)")
    book = nbformat.read(nb, as_version=4)
    book.cells.insert(2, nbformat.v4.new_markdown_cell("# The lab\n\n## 3. The slow part\nIt sleeps."))
    nbformat.write(book, nb)
    build_dir.mkdir(parents=True)
    (build_dir / "status.json").write_text(json.dumps({
        "run": {"id": "earlier", "device": "cpu"},
        "labs": {"85_slow": {"status": "ok", "seconds": 0.2, "run_id": "earlier", "device": "cpu"}}}))
    monkeypatch.setenv(narrate.INTERVAL_VAR, "0.5")
    assert harness.main(["run", "--device", "cpu", str(nb)]) == 0
    out = capfd.readouterr().out
    assert "  85_slow  § 3. The slow part  cell 3/3 (for " in out, out
    slow = [line.strip() for line in out.splitlines() if "slower than usual" in line]
    assert len(slow) == 1, out
    assert slow[0].startswith("85_slow is slower than usual: ") and "in its last ok run on cpu (run earlier)" in slow[0]
    assert "load average" in slow[0] and "cores" in slow[0]
    assert status_of(build_dir)["labs"]["85_slow"]["device"] == "cpu"


def test_the_usual_seconds_come_from_the_same_device(tmp_path):
    """A lab's usual time is its last ok run on the same device; a CPU run without one falls back on the
    course's recorded CPU figures (docs/instructor.md)."""
    status = {"run": {"id": "r2", "device": "cpu"},
              "labs": {"01_vector_add": {"status": "ok", "seconds": 9.6, "run_id": "r2"},
                       "02_wavefront_vs_warp": {"status": "ok", "seconds": 170.0, "run_id": "r1", "device": "gpu"},
                       "03_bf16_matmul": {"status": "failed", "seconds": 1.0, "run_id": "r2"},
                       "85_x": {"status": "ok", "seconds": 2.0, "run_id": "r0"}}}
    cpu = narrate.usual_seconds(status, "cpu")
    assert cpu["01_vector_add"].seconds == 9.6 and "last ok run on cpu (run r2)" in cpu["01_vector_add"].source
    recorded = narrate.recorded_cpu_seconds()
    assert set(recorded) >= {"00", "05", "07"}
    assert cpu["02_wavefront_vs_warp"].seconds == recorded["02"] and "docs/instructor.md" in \
        cpu["02_wavefront_vs_warp"].source
    assert cpu["03_bf16_matmul"].seconds == recorded["03"] and "85_x" not in cpu
    gpu = narrate.usual_seconds(status, "gpu")
    assert set(gpu) == {"02_wavefront_vs_warp"}
    busy = narrate.slow_note("05_llm_serving", 420, narrate.Usual(39.0, "in its last ok run"), 7.9, 2)
    assert "7 min 00 s so far, 39 s in its last ok run; the machine is busy (load average 7.9 on 2 cores" in busy


def test_a_run_keeps_the_kernels_noise_out(tmp_path, build_dir, capfd, monkeypatch):
    """No "Kernel is running over TCP without encryption" warning from ipykernel (the connection is encrypted),
    and no SIGINT to the kernel at its shutdown (a cell here keeps its own SIGINT handler, which would mark it;
    jupyter_client's stock shutdown sends one, which prints "KeyboardInterrupt caught in kernel")."""
    mark = tmp_path / "sigint"
    monkeypatch.setenv("MARK", str(mark))
    nb = write_nb(tmp_path / "86_quiet.ipynb",
                  "import os, pathlib, signal\nkernel = get_ipython().kernel\n"
                  "kernel.pre_handler_hook = kernel.post_handler_hook = lambda: None   # keep the handler below\n"
                  "signal.signal(signal.SIGINT, lambda *_: pathlib.Path(os.environ['MARK']).write_text('SIGINT'))")
    assert harness.main(["run", "--device", "cpu", str(nb)]) == 0
    out, err = capfd.readouterr()
    assert "without encryption" not in out + err and "KeyboardInterrupt" not in out + err, out + err
    assert not mark.exists(), "the kernel got a SIGINT at its shutdown"
    assert status_of(build_dir)["labs"]["86_quiet"]["status"] == "ok"
