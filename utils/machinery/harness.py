"""The course harness: execute the solutions, generate the labs, keep their outputs and exports current.

    python -m utils.machinery.harness run [--device auto|cpu|gpu|cuda|rocm] [-p NAME VALUE ...] [NOTEBOOK ...]
                                       (or -p NAME=VALUE; a VALUE such as -5 or -Infinity is a value)
    python -m utils.machinery.harness labs [--check]       labs/ from solutions/ (exercise regions -> stubs)
    python -m utils.machinery.harness outputs [LAB ...]    store the checked cells' outputs in solutions/ (CPU run)
    python -m utils.machinery.harness export               build/export/<lab>.py from the cells tagged `export`
    python -m utils.machinery.harness progress [--run]     which exercises are done in work/ (utils.machinery.learner)

`run` executes the notebooks with papermill into `build/executed/`, one after the other. Every run has
an id; `build/status.json` says, per lab, whether it finished in this run (ok), failed, was interrupted
or was not reached, and the report never calls a lab "ok" that did not finish in this run. Ctrl-C and
SIGTERM stop the run cleanly: the kernel is shut down (and with it whatever it started, see
`utils.base.processes`), the status says "interrupted", and the exit status is 130 or 143. A cell that runs
longer than `--cell-timeout` seconds fails its lab instead of hanging. While a lab runs, a line every 25 s
(COURSE_NARRATE_SECONDS; 0: none) says its section, cell and time so far, and one more says so when it runs far
longer than its last ok run (`utils.machinery.narrate`). Parameters are checked before
anything runs: an unknown name is an error that suggests the nearest one, a name only some notebooks
declare goes to those, and a bad value names the parameter and what it allows.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import signal
import sys
import threading
import time
import uuid
from pathlib import Path

import nbformat
import psutil

from utils import course, params, solutions
from utils.base import processes, state
from utils.base.paths import BuildFolderError, UnsafePath, build_dir, private_dir, run_environment
from utils.machinery import labs, learner, narrate, report

DEFAULT_CELL_TIMEOUT = 1800   # seconds; a GPU lab's longest cell (lab 05's sweep) takes a few minutes
CHECK_MARK = "# NBVAL_CHECK_OUTPUT"


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP: handled like Ctrl-C, so that the kernel and what it started are shut down."""


def notebook_env() -> dict[str, str]:
    """Environment for executing notebooks: the course's run environment (course.env: offline hub, no
    progress bars on stderr, which break nbval's comparisons; config and caches inside the build folder)."""
    return run_environment()


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


# --- parameters ----------------------------------------------------------------------------------

def declarations(notebook: Path) -> dict[str, params.Declared]:
    """The parameters a notebook declares in its `parameters` cell (`utils.params.declarations`)."""
    return params.declarations(course.parameters_cell(notebook), where=f"{Path(notebook).name}'s parameters cell")


def declared_parameters(notebook: Path) -> dict[str, object]:
    """{name: default value} of the notebook's `parameters` cell."""
    return {name: d.default for name, d in declarations(notebook).items()}


def plan_parameters(notebooks: list[Path], given: dict) -> tuple[dict[Path, dict], list[str]]:
    """Check `given` against the notebooks' own declarations (ParameterError on an unknown name, with the nearest
    one, or on a value a notebook's declaration refuses); returns each notebook's parameters and lines for the log."""
    declared = {nb: declarations(nb) for nb in notebooks}
    known = set().union(*declared.values()) if declared else set()
    log = []
    plan = {nb: {} for nb in notebooks}
    for name, value in given.items():
        if name not in known:
            raise params.ParameterError(params.unknown_message(name, known, "the selected notebooks"))
        takers = [nb for nb in notebooks if name in declared[nb]]
        for nb in takers:
            plan[nb][name] = declared[nb][name].check(value)
        if len(takers) < len(notebooks):
            log.append(f"{name} applies to {', '.join(nb.stem for nb in takers)} only (the other notebooks do not "
                       "declare it)")
    return plan, log


# --- peak memory ---------------------------------------------------------------------------------

class PeakMemory:
    """The peak memory of this process's children while the block runs: the kernel and every process it
    started (lab 05's model server and its workers), not the harness. Sampled every `every` seconds in a thread
    as the sum of each process's PSS (its private pages plus its share of pages shared with others, so torch's
    libraries mapped by both the kernel and the server count once; RSS where PSS cannot be read). Reading PSS
    walks the page tables (about 12 ms for a 450 MB process on the course's CPU machine), so the wait between
    samples grows to ten times the last read: the sampling takes at most a tenth of one core from the lab.
    `peak_mb`: the largest sum seen, in MB (10^6 bytes); a peak shorter than the wait can be missed."""

    def __init__(self, every: float = 0.2):
        self.every, self.peak_bytes = every, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="peak-memory")

    @staticmethod
    def tree_bytes() -> int:
        total = 0
        for proc in psutil.Process().children(recursive=True):
            try:
                try:
                    total += proc.memory_full_info().pss
                except (psutil.AccessDenied, AttributeError):   # another user's process; no PSS (macOS)
                    total += proc.memory_info().rss
            except psutil.Error:     # ended between listing and reading
                continue
        return total

    def _watch(self) -> None:
        while True:
            start = time.perf_counter()
            self.peak_bytes = max(self.peak_bytes, self.tree_bytes())
            if self._stop.wait(max(self.every, 10 * (time.perf_counter() - start))):
                return

    @property
    def peak_mb(self) -> float:
        return round(self.peak_bytes / 1e6, 1)

    def __enter__(self) -> "PeakMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> bool:
        self._stop.set()
        self._thread.join(timeout=5)
        return False


# --- executing the course -----------------------------------------------------------------------

def status_path() -> Path:
    return build_dir() / "status.json"


class BuildBusy(RuntimeError):
    """Another `make run` is using the same build folder."""


def _lock_build(build: Path):
    """Hold build/run.lock for this run: a second run in the same build folder stops at once (it would
    overwrite this one's status and results) and says how to run beside it."""
    import fcntl

    with state.storage_errors(build):
        private_dir(build)      # this user's own, 0700; a link or another user's folder is refused by name
    with state.storage_errors(build / "run.lock"):
        lock = open(build / "run.lock", "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "another process"
        lock.close()
        raise BuildBusy(f"{build} is in use by another `make run` ({holder}); wait for it to finish, or give "
                        f"this run its own folder: COURSE_BUILD_DIR=/some/other/build make run") from None
    try:
        with state.storage_errors(build / "run.lock"):
            lock.seek(0)
            lock.truncate()
            lock.write(f"pid {os.getpid()}, started {now()}\n")
            lock.flush()
    except BaseException:
        with contextlib.suppress(OSError):      # closing flushes again, and fails again, on a full disk
            lock.close()
        raise
    return lock


def run_notebooks(notebooks: list[Path], device: str = "auto", parameters: dict | None = None,
                  cell_timeout: float = DEFAULT_CELL_TIMEOUT) -> dict:
    """Execute `notebooks` with papermill into build/executed/; returns the status record. Raises
    KeyboardInterrupt (Terminated for SIGTERM) after recording an interruption."""
    parameters = dict(parameters or {})
    plan, log = plan_parameters(notebooks, {"DEVICE": device, **parameters})
    for line in log:
        print(line)
    lock = _lock_build(build_dir())
    try:
        return _run_locked(notebooks, plan, device, cell_timeout)
    finally:
        lock.close()


def _run_locked(notebooks: list[Path], plan: dict, device: str, cell_timeout: float) -> dict:
    import papermill as pm
    from tqdm.auto import tqdm

    build = build_dir()
    executed = build / "executed"
    executed.mkdir(parents=True, exist_ok=True)
    for rec in processes.reap_orphans():
        print(f"ended an orphaned {rec.get('label', 'process group')} (pgid {rec['pgid']}) left by a dead run")
    run_id = _dt.datetime.now().strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
    status = report.load_status()
    usual = narrate.usual_seconds(status, device)    # before this run overwrites the labs' entries
    status["run"] = {"id": run_id, "started": now(), "ended": None, "state": "running", "device": device,
                     "labs": [nb.stem for nb in notebooks]}
    for nb in notebooks:
        status["labs"][nb.stem] = {"status": "not run", "run_id": run_id, "parameters": plan[nb]}
    state.write_json(status_path(), status)
    os.environ.update(notebook_env())
    os.environ["COURSE_RUN_ID"] = run_id

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    stopping = []

    def terminate(signum, frame):
        # End the kernel first: papermill's wait for the running cell can miss the KeyboardInterrupt (it may land
        # in a thread or callback that swallows it), and a dead kernel ends that wait whatever happens to it.
        stopping.append(signal.Signals(signum).name)
        _kill_kernels()
        raise KeyboardInterrupt("SIGINT") if signum == signal.SIGINT else Terminated(stopping[-1])

    for sig in previous:
        signal.signal(sig, terminate)
    bar = tqdm(notebooks, desc="labs", unit="notebook", file=sys.stdout)
    narrator = narrate.Narrator(bar.write)     # a line every 25 s while a lab runs (COURSE_NARRATE_SECONDS)
    try:
        for nb in bar:
            bar.set_postfix_str(nb.stem)
            out = executed / nb.name
            entry = {"executed": os.path.relpath(out, build.parent), "parameters": plan[nb], "run_id": run_id,
                     "status": "running", "started": now(), "device": device}
            status["labs"][nb.stem] = entry
            state.write_json(status_path(), status)
            start = time.perf_counter()
            memory = PeakMemory()
            try:
                with narrator.lab(nb, usual.get(nb.stem)), memory:
                    pm.execute_notebook(str(nb), str(out), parameters=plan[nb], cwd=str(nb.parent),
                                        kernel_name="python3", progress_bar=False, log_output=False,
                                        execution_timeout=cell_timeout, on_cell_start=narrator.cell_started,
                                        kernel_manager_class=narrate.QuietKernelManager)
                entry["status"] = "ok"
            except KeyboardInterrupt as stop:
                entry["status"] = "interrupted"
                entry["error"] = f"interrupted ({stop.args[0] if stop.args else 'SIGINT'})"
                raise
            except Exception as exc:  # a failing lab must not stop the others
                if stopping:          # the kernel was ended by a signal whose KeyboardInterrupt got lost
                    entry["status"] = "interrupted"
                    entry["error"] = f"interrupted ({stopping[0]})"
                    raise (KeyboardInterrupt("SIGINT") if stopping[0] == "SIGINT" else Terminated(stopping[0])) \
                        from exc
                entry["status"] = "failed"
                entry["error"] = _short_error(exc)
                bar.write(f"FAILED {nb.name}: {entry['error']} (see {entry['executed']})")
            finally:
                entry["seconds"] = round(time.perf_counter() - start, 1)
                entry["peak_memory_mb"] = memory.peak_mb
                state.write_json(status_path(), status)
        status["run"]["state"] = "finished"
    except KeyboardInterrupt as stop:
        status["run"]["state"] = "interrupted"
        status["run"]["signal"] = stop.args[0] if stop.args else "SIGINT"
        raise
    finally:
        bar.close()
        status["run"]["ended"] = now()
        state.write_json(status_path(), status)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return status


def _kill_kernels() -> None:
    """SIGKILL this process's Jupyter kernels (its children running ipykernel)."""
    for child in psutil.Process().children():
        try:
            if any("ipykernel" in part for part in child.cmdline()):
                child.kill()
        except psutil.Error:
            continue


def _short_error(exc: Exception) -> str:
    ename, evalue = getattr(exc, "ename", None), getattr(exc, "evalue", None)
    text = f"{ename}: {evalue}" if ename else f"{type(exc).__name__}: {exc}"
    line = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return line[:300]


# --- stored outputs of the checked cells ----------------------------------------------------------

def checked(cell) -> bool:
    return cell.cell_type == "code" and CHECK_MARK in cell.source


def store_outputs(solution: Path, executed: Path) -> int:
    """Copy the outputs of the `# NBVAL_CHECK_OUTPUT` cells of an executed copy into the solution
    (nbval compares them); every other cell's output is cleared. Returns how many cells were stored."""
    sol, run = solutions.read(solution), solutions.read(executed)
    run_cells = [c for c in run.cells if "injected-parameters" not in c.metadata.get("tags", [])]
    if len(run_cells) != len(sol.cells):
        raise RuntimeError(f"{executed} has {len(run_cells)} cells, {solution} {len(sol.cells)}")
    stored = 0
    for cell, ran in zip(sol.cells, run_cells):
        if cell.cell_type != "code":
            continue
        cell.execution_count = None
        cell.outputs = []
        if checked(cell):   # nbval wants an execution count on a cell with outputs
            cell.outputs, cell.execution_count = ran.outputs, ran.execution_count
            stored += 1
        for key in ("execution", "papermill"):
            cell.metadata.pop(key, None)
    sol.metadata.pop("papermill", None)
    state.write_text_atomic(solution, nbformat.writes(sol) + "\n")
    return stored


def regenerate_outputs(notebooks: list[Path]) -> None:
    """Execute the solutions on the CPU (default parameters) and store their checked outputs."""
    import tempfile

    import papermill as pm

    os.environ.update(notebook_env())
    for nb in notebooks:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / nb.name
            pm.execute_notebook(str(nb), str(out), parameters={"DEVICE": "cpu"}, cwd=str(nb.parent),
                                kernel_name="python3", progress_bar=False, execution_timeout=DEFAULT_CELL_TIMEOUT,
                                kernel_manager_class=narrate.QuietKernelManager)
            print(f"{nb.name}: {store_outputs(nb, out)} checked cells stored")


# --- progress -------------------------------------------------------------------------------------

def progress_table(run: bool = False) -> str:
    """"N of M exercises done" and each exercise's state in the learner's work/ (`run`: execute work/ first);
    the logic is utils.machinery.learner's."""
    return learner.progress_table(run=run, cell_timeout=DEFAULT_CELL_TIMEOUT)


# --- command line ---------------------------------------------------------------------------------

PARAMETER_FLAGS = ("-p", "--parameter")


class UsageError(ValueError):
    """A command line the harness cannot read; the message says what is wrong and the form it wants."""


def split_parameters(argv: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """`run`'s `-p NAME VALUE` and `-p NAME=VALUE` pairs taken out of `argv` before argparse reads the rest:
    argparse takes a VALUE that starts with '-' (-Infinity, -5e3) for an option; here it stays a value, for the
    parameter check to judge by name."""
    if argv[:1] != ["run"]:
        return list(argv), []
    rest, pairs, i = ["run"], [], 1
    while i < len(argv):
        if argv[i] == "--":
            rest += argv[i:]
            break
        if argv[i] not in PARAMETER_FLAGS:
            rest.append(argv[i])
            i += 1
            continue
        following = argv[i + 1:i + 3]
        name, equals, value = following[0].partition("=") if following else ("", "", "")
        if equals and name.isidentifier():                      # -p NAME=VALUE
            pairs.append((name, value))
            i += 2
        elif len(following) == 2 and following[0].isidentifier():   # -p NAME VALUE
            pairs.append((following[0], following[1]))
            i += 3
        else:
            raise UsageError(f"{' '.join([argv[i], *following])} is not a parameter: write -p NAME VALUE or "
                             "-p NAME=VALUE (e.g. -p REPS 5)")
    return rest, pairs


def notebook_problem(path: Path) -> str | None:
    """None when `path` is a notebook the harness can run; otherwise what is wrong with it, in one line."""
    if not path.exists():
        return f"{path}: no such notebook"
    if not path.is_file():
        return f"{path} is not a notebook: it is a folder"
    if path.suffix != ".ipynb":
        return f"{path} is not a notebook: give the harness .ipynb files (e.g. solutions/00_environment.ipynb)"
    try:
        nbformat.validate(nbformat.read(path, as_version=4))
    except Exception as exc:    # nbformat raises many kinds (JSON, Unicode, schema, type errors) for a broken file
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        return f"{path} is not a readable notebook ({type(exc).__name__}: {reason}); restore it (git checkout) or " \
               "give the harness another .ipynb file"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m utils.machinery.harness", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="execute the solutions and build the report")
    run.add_argument("--device", default=os.environ.get("COURSE_DEVICE") or "auto")
    run.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                     help="a parameter for the notebooks that declare it, also as -p NAME=VALUE (VALUE is read as "
                          "JSON if it parses; one that starts with '-', such as -5, is a value)")
    run.add_argument("--cell-timeout", type=float,
                     default=float(os.environ.get("COURSE_CELL_TIMEOUT") or DEFAULT_CELL_TIMEOUT),
                     help="seconds one cell may run before its lab fails (default %(default)s)")
    run.add_argument("notebooks", nargs="*", type=Path)
    labs_cmd = sub.add_parser("labs", help="generate labs/ from solutions/")
    labs_cmd.add_argument("--check", action="store_true", help="only report labs that are out of date")
    outputs = sub.add_parser("outputs", help="store the checked cells' outputs in solutions/ (a CPU run)")
    outputs.add_argument("notebooks", nargs="*", type=Path)
    sub.add_parser("export", help="write build/export/<lab>.py from the cells tagged 'export'")
    progress = sub.add_parser("progress", help="which exercises are done in your work/ on this machine")
    progress.add_argument("--run", action="store_true", help="execute your notebooks in work/ first")
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv, parameter_pairs = split_parameters(argv)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    args = ap.parse_args(argv)

    if args.cmd == "labs":
        stale = labs.write_labs(check=args.check)
        for line in stale:
            print(line)
        if args.check and stale:
            print("run `make labs` to regenerate labs/ from solutions/")
            return 1
        print(f"labs/: {len(solutions.solution_notebooks())} notebooks {'checked' if args.check else 'written'}")
        return 0
    if args.cmd == "outputs":
        regenerate_outputs([p.resolve() for p in args.notebooks] or solutions.solution_notebooks())
        return 0
    if args.cmd == "export":
        for path in labs.write_exports():
            print(path)
        return 0
    if args.cmd == "progress":
        print(progress_table(run=args.run))
        return 0

    given = {}
    for name, value in [*args.parameter, *parameter_pairs]:
        try:
            given[name] = json.loads(value)
        except json.JSONDecodeError:
            given[name] = value
    notebooks = [p.resolve() for p in args.notebooks] or solutions.solution_notebooks()
    problems = [problem for problem in map(notebook_problem, notebooks) if problem]
    if problems:
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
        return 2
    if not (args.cell_timeout > 0 and args.cell_timeout < float("inf")):
        print(f"error: --cell-timeout={args.cell_timeout} must be a positive number of seconds", file=sys.stderr)
        return 2
    try:
        status = run_notebooks(notebooks, device=args.device, parameters=given, cell_timeout=args.cell_timeout)
    except params.ParameterError as err:
        print(f"ParameterError: {err}", file=sys.stderr)
        return 2
    except (BuildBusy, UnsafePath, BuildFolderError, state.StorageError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:
        path = report.build_report()
        name = stop.args[0] if stop.args else "SIGINT"
        print(f"interrupted ({name}): see {os.path.relpath(path)}; the labs not finished are marked so")
        return 143 if name == "SIGTERM" else 130
    path = report.build_report()
    failed = [nb.stem for nb in notebooks if status["labs"][nb.stem]["status"] != "ok"]
    print(f"report: {os.path.relpath(path)} ({len(notebooks) - len(failed)} of {len(notebooks)} labs ran)")
    if failed:
        print("failed: " + ", ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
