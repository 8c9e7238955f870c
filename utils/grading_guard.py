"""What keeps a grade honest: the answer runs apart from the course's answers, under a time limit, on fresh inputs it
must leave as they were, graded by graders the notebook has not replaced (used by `utils.exercises.Lab.grade`)."""
from __future__ import annotations

import contextlib
import os
import secrets
import signal
import sys
import threading
from typing import Callable

EXPORT_PREFIX = "course_export_"      # the solution notebooks imported as modules (utils.solutions.load)
COURSE_ANSWERS = ("utils.solutions", "utils.graders.")
SEED_VAR = "COURSE_GRADE_SEED"        # set it to a failure's seed to draw the same inputs again
LIMIT_VAR = "COURSE_GRADE_TIMEOUT"    # seconds an exercise's grading may take on an idle machine
LIMIT_S = {"cpu": 120.0, "gpu": 600.0}   # idle-machine limits: every right answer grades in under 60 s on a 2-core CPU


# --- the course's answers, out of the answer's reach -----------------------------------------------------------------

def _answers_module(name: str) -> bool:
    return name.startswith(COURSE_ANSWERS) or name == "utils.solutions" or name.startswith(EXPORT_PREFIX)


def _learner_module(name: str) -> bool:
    """Code a learner wrote or runs as theirs: a notebook's cells (__main__), or a lab imported with answers."""
    return name == "__main__" or name.startswith(EXPORT_PREFIX)


class Watch:
    """While active, notes every call into the course's answers (`utils.solutions`, an exported solution notebook
    other than the caller's own, the `Lab.reference` of an exercise, and a `utils.graders` function called straight
    from learner code) made on behalf of learner code: the nearest frame below it that is the learner's or the
    course's decides whose call it is, so a grader computing its reference is not the learner reaching for it, and
    a reference kernel launched through Triton still is."""

    def __init__(self, sealed_codes=(), grading_codes=()):
        self.sealed = set(sealed_codes)
        self.grading = set(grading_codes)     # the grading cell's own lambda: it calls the grader, as it should
        self.reached: list[str] = []
        self._before = None

    def _profile(self, frame, event, arg):
        if event != "call":
            return
        name = frame.f_globals.get("__name__", "")
        if not (_answers_module(name) or frame.f_code in self.sealed):
            return
        if name.startswith("utils.graders."):    # a grader's function: only a direct call from learner code counts (a
            caller = frame.f_back                 # grader's hooks inside Triton's interpreter run under the kernel)
            if caller is None or not _learner_module(caller.f_globals.get("__name__", "")) or caller.f_code in self.grading:
                return
        f = frame.f_back
        while f is not None:
            owner = f.f_globals.get("__name__", "") if f.f_code not in self.grading else "utils.exercises"
            if _learner_module(owner) or _answers_module(owner) or owner == "utils.exercises":
                break
            f = f.f_back
        if f is not None and _learner_module(owner) and owner != name:
            what = f"{name}.{frame.f_code.co_name}" if frame.f_code not in self.sealed else "ex.reference"
            if what not in self.reached:
                self.reached.append(what)

    def __enter__(self):
        self._before = sys.getprofile()
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(self._before)
        return False


# --- the graders themselves, and what they rely on, as the course wrote them ----------------------------------------

def _genuine_functions() -> dict[str, Callable]:
    """The comparison functions graders use, as imported: a notebook that replaced one (to make a check pass) is
    refused. Taken at the first grade of a kernel (`snapshot`), before any answer ran under a grader."""
    found = {}
    torch = sys.modules.get("torch")
    if torch is not None:
        for name in ("allclose", "equal", "isclose", "isnan", "isfinite"):
            found[f"torch.{name}"] = getattr(torch, name)
        found["torch.testing.assert_close"] = torch.testing.assert_close
        found["torch.Tensor.__eq__"] = torch.Tensor.__eq__
    np = sys.modules.get("numpy")
    if np is not None:
        for name in ("allclose", "array_equal", "isclose"):
            found[f"numpy.{name}"] = getattr(np, name)
    return found


_GENUINE: dict[str, Callable] = {}


def snapshot() -> None:
    """Remember the functions graders rely on as they are now (once per process; `Lab()` calls it in the lab's
    setup cell, before any learner cell)."""
    for key, fn in _genuine_functions().items():
        _GENUINE.setdefault(key, fn)


def replaced(checker: Callable, genuine: dict[str, Callable]) -> list[str]:
    """What in this kernel is not as the course wrote it: the checker (defined in the notebook, or not the function
    its `utils.graders` module holds, or a function of that module replaced from the notebook), or a function of
    `genuine` (the course's own, by name) now another."""
    snapshot()
    out = []
    for grader in _graders_of(checker):
        module_name = getattr(grader, "__module__", "") or ""
        module, name = sys.modules.get(module_name), getattr(grader, "__name__", "?")
        if _learner_module(module_name) or (module_name.startswith("utils.graders.") and (
                getattr(module, name, None) is not grader
                or getattr(getattr(grader, "__code__", None), "co_filename", None) != getattr(module, "__file__", None))):
            out.append(f"the grader {name} is not utils.graders' own")
        elif module is not None and module_name.startswith("utils.graders."):
            out += [f"{module_name}.{n} was replaced" for n, v in vars(module).items()
                    if callable(v) and getattr(v, "__module__", None) == "__main__" and not n.startswith("__")]
    now = _genuine_functions()
    out += [f"{key} was replaced" for key, fn in _GENUINE.items() if now.get(key) is not fn]
    out += [f"{key} was replaced" for key, fn in genuine.items() if _resolve(key) is not fn]
    return out


def _graders_of(checker) -> list:
    """The graders a grade runs: the checker itself, or, for a lambda written in the grading cell
    (`lambda: check_add(...)`), the functions it calls; a lambda that calls no `utils.graders` function is itself
    what grades, and is refused as one the notebook wrote."""
    code = getattr(checker, "__code__", None)
    if code is None or checker.__name__ != "<lambda>":
        return [checker]
    names, codes = [], [code]
    while codes:
        c = codes.pop()
        names += c.co_names
        codes += [k for k in c.co_consts if hasattr(k, "co_names")]
    found = [checker.__globals__.get(n) for n in names]
    for cell in checker.__closure__ or ():
        try:
            found.append(cell.cell_contents)
        except ValueError:
            pass
    graders = [f for f in found if callable(f) and (getattr(f, "__module__", "") or "").startswith("utils.graders.")]
    return graders or [checker]


def _resolve(dotted: str):
    module, _, attr = dotted.rpartition(".")
    return getattr(sys.modules.get(module), attr, None)


# --- fresh inputs, with the seed that draws them again ----------------------------------------------------------------

_seeds: list[int] = []


def fresh_seed() -> int:
    """A seed for a grader's random inputs, new on every call (or $COURSE_GRADE_SEED's, to reproduce a failure); the
    grade's failure message names it. Graders draw their random shapes and values from it, beside fixed awkward cases."""
    value = os.environ.get(SEED_VAR, "").strip()
    seed = int(value) if value.isdigit() else secrets.randbelow(2**31)
    _seeds.append(seed)
    return seed


@contextlib.contextmanager
def seeds_drawn():
    """Collects the seeds `fresh_seed` hands out inside it (a list, filled as the grader runs)."""
    start = len(_seeds)
    drawn: list[int] = []
    try:
        yield drawn
    finally:
        drawn.extend(_seeds[start:])
        del _seeds[start:]


def reproduce_hint(seeds: list[int]) -> str:
    if not seeds:
        return ""
    return (f" (this grade drew its random inputs with seed {seeds[0]}: set {SEED_VAR}={seeds[0]} before the lab's "
            "setup cell to draw them again)")


# --- inputs the answer must not change -------------------------------------------------------------------------------

def _copies(args) -> list:
    out = []
    torch = sys.modules.get("torch")
    np = sys.modules.get("numpy")
    for a in args:
        if torch is not None and isinstance(a, torch.Tensor):
            out.append(a.detach().clone())
        elif np is not None and isinstance(a, np.ndarray):
            out.append(a.copy())
        else:
            out.append(None)
    return out


def _same(before, after) -> bool:
    """Whether `after` holds exactly `before`'s bytes (NaNs and signed zeros included), shape and dtype."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(before, torch.Tensor):
        as_bytes = lambda t: t.detach().contiguous().reshape(-1).view(torch.uint8)
        return isinstance(after, torch.Tensor) and before.shape == after.shape and before.dtype == after.dtype \
            and bool(torch.equal(as_bytes(before), as_bytes(after)))
    return before.shape == after.shape and before.dtype == after.dtype and before.tobytes() == after.tobytes()


def changed_inputs(args, call: Callable, names=None):
    """call(*args), then which of the tensors and arrays among `args` it changed ([(position or name, what)]), as
    (result, changed). The graders compute their reference from copies made before the call."""
    before = _copies(args)
    result = call(*args)
    changed = []
    for i, (a, b) in enumerate(zip(args, before)):
        if b is not None and not _same(b, a):
            changed.append(names[i] if names and i < len(names) else f"argument {i + 1}")
    return result, changed


# --- a time limit ----------------------------------------------------------------------------------------------------

def limit_seconds(on_gpu: bool) -> float:
    """How long one exercise's grading may run: $COURSE_GRADE_TIMEOUT or the idle limit (2x what the slowest right
    answer takes on a 2-core CPU), times the machine's load per core when it is busier than one: a right answer on
    a busy machine is never cut off."""
    value = os.environ.get(LIMIT_VAR, "").strip()
    try:
        base = float(value) if value else LIMIT_S["gpu" if on_gpu else "cpu"]
    except ValueError:
        base = LIMIT_S["gpu" if on_gpu else "cpu"]
    try:
        load = os.getloadavg()[0] / max(os.cpu_count() or 1, 1)
    except OSError:
        load = 1.0
    return base * max(1.0, load)


class TimeLimit(BaseException):
    """An answer ran past its grading's time limit (a BaseException, like KeyboardInterrupt: a grader's `except
    Exception` around the learner's call cannot swallow it)."""


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raises TimeLimit in the code that runs past `seconds` (SIGALRM: the main thread of a process on Linux or
    macOS; elsewhere no limit is set). Code inside a long C call is stopped when it returns."""
    usable = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread() and seconds > 0
    if not usable:
        yield
        return

    def expired(signum, frame):
        raise TimeLimit(f"too slow or never returned: the grading ran past its limit of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds, 5.0)      # again every 5 s, should a bare `except:` swallow one
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
