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

from utils import isa

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

    def __init__(self, sealed_codes=(), grading_codes=(), kernels=()):
        self.sealed = set(sealed_codes)
        self.grading = set(grading_codes)     # the grading cell's own lambda: it calls the grader, as it should
        self.reached: list[str] = []
        self._before = None
        self.kernels = [k for k in kernels if isa.is_kernel(k)]    # the exercise's Triton kernels: were they run?
        self._launched: dict = {}             # id -> kernel launched (JITFunction.run; the interpreter's run)

    def _profile(self, frame, event, arg):
        if event != "call":
            return
        if self.kernels and frame.f_code.co_name == "run" and isa.is_kernel(frame.f_locals.get("self")):
            self._launched.setdefault(id(frame.f_locals["self"]), frame.f_locals["self"])
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
        if f is not None and _learner_module(owner) and (owner != name or frame.f_code in self.sealed):
            what = (f"{name}.{frame.f_code.co_name}" if frame.f_code not in self.sealed or not (
                name == "utils.exercises" or _learner_module(name)) else
                "ex.reference" if name == "utils.exercises" else f"the lab's {frame.f_code.co_name}")
            if what not in self.reached:
                self.reached.append(what)

    def not_run(self) -> list[str]:
        """The names of the exercise's kernels that the grade never ran: neither launched nor reached (at any
        depth) from a kernel that was."""
        reached = set()
        for k in self._launched.values():
            reached |= _reachable_codes(k)
        return [k.fn.__name__ for k in self.kernels if k.fn.__code__ not in reached]

    def __enter__(self):
        _watch_frames()
        self._before = sys.getprofile()
        _ACTIVE.append(self)
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(self._before)
        _ACTIVE.remove(self)
        return False


# --- the grader's frames, out of the answer's reach ------------------------------------------------------------------
# Above an answer on the call stack sit the grader's frames, whose locals hold what the answer is checked against. An
# answer that takes a frame object (sys._getframe, inspect.currentframe or .stack, a traceback's or generator's frame,
# every thread's frames, the garbage collector's lists) or installs a tracer while it is graded is reaching for them:
# CPython's audit hooks report each of these, and the frame that asked decides whose request it is.
FRAME_EVENTS = {"sys._getframe", "sys._current_frames", "sys.settrace", "sys.setprofile", "gc.get_objects",
                "gc.get_referrers", "gc.get_referents"}
FRAME_ATTRIBUTES = {"tb_frame", "gi_frame", "cr_frame", "ag_frame"}
FRAME_HELPERS = ("inspect", "traceback")     # stdlib modules that hand the caller frames: look through them
_ACTIVE: list[Watch] = []
_hook_state = threading.local()
_hook_installed = False


def _watch_frames() -> None:
    global _hook_installed
    if not _hook_installed:
        sys.addaudithook(_frame_audit)
        _hook_installed = True


def _frame_audit(event: str, args: tuple) -> None:
    if not _ACTIVE or getattr(_hook_state, "busy", False):
        return
    if event not in FRAME_EVENTS and not (event == "object.__getattr__" and len(args) > 1 and args[1] in FRAME_ATTRIBUTES):
        return
    _hook_state.busy = True
    try:
        frame = sys._getframe(1)          # the Python frame that asked (C functions have none)
        while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] in FRAME_HELPERS:
            frame = frame.f_back
        watch = _ACTIVE[-1]
        if frame is not None and _learner_module(frame.f_globals.get("__name__", "")) \
                and frame.f_code not in watch.grading:
            what = ("the grader's frames (" + (f"{args[1]}" if event == "object.__getattr__" else event) + ")")
            if what not in watch.reached:
                watch.reached.append(what)
    finally:
        _hook_state.busy = False


def _reachable_codes(kernel) -> set:
    """The code of `kernel` and of every @triton.jit function it names, at any depth (compiled into it on a GPU)."""
    return {k.fn.__code__ for k in isa.reachable_kernels(kernel)}


# --- the graders themselves, and what they rely on, as the course wrote them ----------------------------------------

def _genuine_functions() -> dict[str, Callable]:
    """The comparison functions graders use, as imported: a notebook that replaced one (to make a check pass) is
    refused. Taken at the first grade of a kernel (`snapshot`), before any answer ran under a grader."""
    found = {}
    for module_name in ("math", "numpy", "numpy.linalg", "torch", "torch.nn.functional", "torch.testing"):
        module = sys.modules.get(module_name)
        for name, value in (vars(module).items() if module is not None else ()):   # vars: no lazy attributes
            if callable(value) and not name.startswith("_") and not isinstance(value, type(sys)):
                found[f"{module_name}.{name}"] = value
    torch = sys.modules.get("torch")
    if torch is not None:
        for cls in (torch.Tensor, torch._C.TensorBase):
            for name, value in vars(cls).items():
                if callable(value) and (not name.startswith("_") or name in ("__eq__", "__ne__", "__lt__", "__le__",
                                                                            "__gt__", "__ge__", "__bool__")):
                    found.setdefault(f"torch.Tensor.{name}", value)
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
    known = {id(f) for f in _GENUINE.values()}
    out += [f"{key} was replaced" for key, fn in _GENUINE.items() if now.get(key) is not fn
            and _by_a_learner(now.get(key), known)]
    out += [f"{key} was replaced" for key, fn in genuine.items() if _resolve(key) is not fn]
    out += [f"{what} was changed" for what in _tampered() if f"{what} was replaced" not in out]
    return list(dict.fromkeys(out))       # each once


COURSE_MODULES = ("utils.graders.", "utils.simt", "utils.grading_guard", "utils.exercises", "utils.solutions",
                  "utils.blocks", "utils.isa")
_FRESH: dict[str, dict] = {}      # a course module's globals as its source defines them, executed apart


def _fresh_globals(module) -> dict:
    """`module`'s globals as its file defines them: executed once, in a module object of its own (what the notebook
    did to the loaded one does not reach it)."""
    import importlib.util

    name = module.__name__
    if name not in _FRESH:
        spec = importlib.util.spec_from_file_location(name, module.__file__)
        fresh = importlib.util.module_from_spec(spec)
        loaded = sys.modules.get(name)
        sys.modules[name] = fresh           # while it runs (dataclasses look their module up), then back
        try:
            spec.loader.exec_module(fresh)
        finally:
            sys.modules[name] = loaded
        _FRESH[name] = vars(fresh)
    return _FRESH[name]


def _code_of(obj):
    """The code of a function, of a decorated one, or of a Triton kernel; None for anything else."""
    if not callable(obj) or isinstance(obj, type):
        return None
    try:
        obj = getattr(obj, "__wrapped__", obj)
        obj = obj.fn if isa.is_kernel(obj) else obj
        return getattr(obj, "__code__", None)
    except Exception:  # noqa: BLE001 - an object whose attributes raise (torch's class proxies) has no code here
        return None


def _as_written(have, want, depth=0) -> bool:
    """Whether a value is what the module's source makes it: functions and kernels by their code, classes by their
    methods, tables element by element, plain values by equality; what cannot be judged counts as the same."""
    code = _code_of(want)
    if code is not None:
        return _code_of(have) == code
    if depth > 6:
        return True
    if isinstance(want, type):
        return isinstance(have, type) and all(_as_written(vars(have).get(n), v, depth + 1) for n, v in vars(want).items()
                                              if _code_of(v) is not None)
    if isinstance(want, (list, tuple)):
        return type(have).__name__ == type(want).__name__ and len(have) == len(want) and all(
            _as_written(h, w, depth + 1) for h, w in zip(have, want))
    if isinstance(want, dict):
        return isinstance(have, dict) and len(have) == len(want) and all(
            k in have and _as_written(have[k], v, depth + 1) for k, v in want.items())
    if isinstance(want, (bool, int, float, complex, str, bytes, set, frozenset, type(None))):
        try:
            return type(have) is type(want) and bool(have == want or (have != have and want != want))   # NaN: NaN
        except Exception:  # noqa: BLE001 - values that do not compare are not judged
            return True
    if isinstance(want, type(sys)):                   # a module the source imports: by its name
        return getattr(have, "__name__", None) == want.__name__
    if hasattr(want, "__dict__") and type(have).__name__ == type(want).__name__:    # a record (a dataclass)
        return _as_written(vars(have), vars(want), depth + 1)
    return True


def _tampered() -> list[str]:
    """The globals of the course's grading modules now in memory that are not as their sources make them (a
    grader's table shortened, a function of utils.simt or grading_guard rebound, a method patched); private
    values (`_cache`) are the modules' own state and only their functions are judged."""
    out = []
    for name, module in list(sys.modules.items()):
        loaded = getattr(module, "__course_as_loaded__", None) if name.startswith(EXPORT_PREFIX) else None
        if loaded is not None:          # a solution notebook imported by utils.solutions: its functions as loaded
            lab = name[len(EXPORT_PREFIX):].split("_")[0]
            out += [f"utils.solutions.load({lab!r}).{key}" for key, want in loaded.items() if not key.startswith("__")
                    and _code_of(want) is not None and vars(module).get(key) is not want]
            continue
        if not name.startswith(COURSE_MODULES) or not getattr(module, "__file__", None):
            continue
        try:
            fresh = _fresh_globals(module)
        except Exception:  # noqa: BLE001 - a module that cannot run apart is not judged
            continue
        here = vars(module)
        for key, want in fresh.items():
            if key.startswith("__") or (key.startswith("_") and _code_of(want) is None and not isinstance(want, type)):
                continue
            if key not in here or not _as_written(here[key], want):
                out.append(f"{name}.{key}")
    return out


def _by_a_learner(value, known: set) -> bool:
    """Whether a library function's new value is a learner's doing: code a notebook (or a lab imported with
    answers) defined, a lambda, or another of the functions snapshotted (numpy.max = numpy.min); a library that
    wraps a function when it is imported (transformers, vLLM) is not judged."""
    module = getattr(value, "__module__", "") or ""
    return (value is None or _learner_module(module) or getattr(value, "__name__", "") == "<lambda>"
            or id(value) in known)


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


def sealed_by(checker, args) -> set:
    """The code of the functions the checker's graders name in `may_not_call`, each "module.function" (the
    course's own function that computes the answer, or a library's) or "answer:function" (a function of the
    answer's own namespace: the lab's cell that holds the answer, as `paged_attention_loop` holds 5.5's)."""
    codes = set()
    for grader in _graders_of(checker):
        for entry in getattr(grader, "may_not_call", ()):
            if entry.startswith("answer:"):
                found = [getattr(a, "__globals__", {}).get(entry[len("answer:"):]) for a in args]
            else:
                found = [_resolve(entry)]
            codes |= {c for f in found if (c := _code_of(f)) is not None}
    return codes


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


GIVE_UP_AFTER = 4      # alarms swallowed in a row: then the answer cannot be stopped from inside the process


@contextlib.contextmanager
def time_limit(seconds: float, on_give_up: Callable[[str], None] | None = None):
    """Raises TimeLimit in the code that runs past `seconds` (SIGALRM: the main thread of a process on Linux or
    macOS; elsewhere no limit is set), again every 2 s should a bare `except:` swallow it. Code inside a long C call
    is stopped when it returns. An answer that swallows it GIVE_UP_AFTER times (a loop around `except
    BaseException: pass`) cannot be stopped from inside: `on_give_up(message)` records the verdict, the message goes
    to stderr and the process ends (a notebook's kernel restarts): never a hang."""
    usable = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread() and seconds > 0
    if not usable:
        yield
        return
    message = f"too slow or never returned: the grading ran past its limit of {seconds:.0f} s"
    alarms = []

    def expired(signum, frame):
        alarms.append(signum)
        if len(alarms) >= GIVE_UP_AFTER:
            final = (f"{message}, and the answer swallowed that {len(alarms) - 1} times (an `except` that catches "
                     "everything, in a loop): the grade stops this Python process; restart the kernel and run the lab "
                     "from the top")
            with contextlib.suppress(Exception):
                if on_give_up is not None:
                    on_give_up(final)
            with contextlib.suppress(Exception):
                sys.__stderr__.write(f"FAIL: {final}\n")
                sys.__stderr__.flush()
            os._exit(70)
        raise TimeLimit(message)

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds, 2.0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
