"""Exercise plumbing shared by every lab.

Solutions mark the code a learner writes with `### BEGIN SOLUTION` / `### END SOLUTION`; the lab
generator (nbgrader's ClearSolutions, see `utils.harness`) replaces it with `STUB`, which raises
`NotImplementedError("exercise not done ...")`. `check()` turns a comparison into one PASS line or
an AssertionError carrying a precise hint.
"""
from __future__ import annotations

import re

EXERCISE_NOT_DONE = "exercise not done"
STUB = f'raise NotImplementedError("{EXERCISE_NOT_DONE}: replace this line with your code, then re-run the cell")'


def is_exercise_stub_error(ename: str, evalue: str) -> bool:
    """Whether an error output (its name and value) is the stub's own error: raised by the stub, or,
    for a stub inside a `@triton.jit` kernel, the interpreter's wrapper of it (InterpreterError) or
    the compiler's error that quotes the stub line."""
    if ename == "NotImplementedError" and evalue.startswith(EXERCISE_NOT_DONE):
        return True
    return re.search(r"NotImplementedError\(['\"]" + EXERCISE_NOT_DONE, evalue) is not None


def check(name: str, ok: bool, hint: str) -> None:
    """Print `PASS: name`, or raise AssertionError("name: hint")."""
    if not ok:
        raise AssertionError(f"{name}: {hint}")
    print(f"PASS: {name}")
