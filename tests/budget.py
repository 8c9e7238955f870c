"""Where `make test`'s time goes, from the JUnit file it writes (build/test/junit.xml).

    python tests/budget.py [build/test/junit.xml] [--write]

Prints seconds per area (the rows of docs/authoring.md's budget table) and per xdist scope; `--write` also stores
the groups' seconds in tests/data/test_groups.json, which tests/conftest.py hands out longest first."""
from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from conftest import xdist_scope_of  # noqa: E402

GROUPS_FILE = ROOT / "tests" / "data" / "test_groups.json"
# area -> the groups (prefixes of them) that belong to it; the first area that matches wins
AREAS = [
    ("notebooks: the solutions under nbval (each runs once)", ("solutions/",)),
    ("notebooks: the generated labs, every exercise unfinished (each runs once)",
     ("tests/test_notebooks.py::TestLab",)),
    ("notebooks: structure, parameters, nbval bites", ("tests/test_notebooks.py",)),
    ("lab kernels and graders (labs 00-04: covering grids on the interpreter, machine code)",
     ("tests/test_lab00", "tests/test_lab01", "tests/test_lab02", "tests/test_lab03", "tests/test_lab04",
      "tests/test_isa", "tests/test_occupancy", "tests/test_simt", "tests/test_exercises")),
    ("LLM serving and decoding (lab 05)", ("tests/test_lab05", "tests/test_serving", "tests/test_loadgen",
                                            "tests/test_models", "tests/test_decode", "tests/test_vllm")),
    ("multi-GPU and the clinic (labs 06-07)", ("tests/test_lab06", "tests/test_lab07", "tests/test_doctor")),
    ("quantized inference (lab 08: graders, GGUF files, llama.cpp against the NumPy reference)", ("tests/test_lab08",)),
    ("shared machine, processes, harness, report", ("tests/test_workshop_shared", "tests/test_processes",
                                                     "tests/test_harness", "tests/test_report",
                                                     "tests/test_preflight")),
    ("the kit, environments, CI definitions", ("tests/",)),
    ("other (modules skipped whole)", ("",)),
]


def nodeid(case: ET.Element) -> str:
    """pytest's node id back from a JUnit test case (classname "tests.test_x" or "solutions.05_x.ipynb")."""
    cls, name = case.get("classname", ""), case.get("name", "")
    if cls.endswith(".ipynb"):
        return f"{cls.replace('.', '/', 1)}::{name}"
    parts = cls.split(".")
    for i in range(len(parts), 0, -1):       # the module is the longest prefix that is a file
        path = "/".join(parts[:i]) + ".py"
        if (ROOT / path).exists():
            return "::".join([path, *parts[i:], name])
    return f"{cls}::{name}"


def seconds_by_group(junit: Path) -> dict[str, float]:
    groups: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit).iter("testcase"):
        groups[xdist_scope_of(nodeid(case))] += float(case.get("time", 0))
    return dict(groups)


def area_of(group: str) -> str:
    return next(area for area, prefixes in AREAS if group.startswith(prefixes))


def main(argv: list[str]) -> int:
    write = "--write" in argv
    args = [a for a in argv if a != "--write"]
    junit = Path(args[0]) if args else ROOT / "build" / "test" / "junit.xml"
    groups = seconds_by_group(junit)
    areas: dict[str, float] = defaultdict(float)
    for group, s in groups.items():
        areas[area_of(group)] += s
    total = sum(groups.values())
    print("| area | test seconds (both workers) | share |\n|---|---|---|")
    for area, _ in AREAS:
        print(f"| {area} | {areas[area]:.0f} | {areas[area] / total:.0%} |")
    print(f"| **all** | **{total:.0f}** (about {total / 2:.0f} s of wall clock on 2 workers) | |")
    print("\nlongest scopes (what one worker runs in a row):")
    for group, s in sorted(groups.items(), key=lambda kv: -kv[1])[:15]:
        print(f"  {s:7.1f} s  {group}")
    if write:
        kept = {g: round(s, 1) for g, s in sorted(groups.items(), key=lambda kv: -kv[1]) if s >= 2.0}
        GROUPS_FILE.write_text(json.dumps({"about": "seconds per xdist scope in make test (tests/budget.py "
                                                    "--write)", "seconds": kept}, indent=1) + "\n")
        print(f"\n{GROUPS_FILE.relative_to(ROOT)}: {len(kept)} groups")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
