"""A learner's own folder on a workshop hub (labs/ copied into work/, their copy, solutions/ linked, a private build folder), made by
the learner's own process, never by root.

    python -m utils.machinery.workspace FOLDER --checkout CHECKOUT      # run as the learner (the hub's hook does)

The hub's hook (docs/jupyterhub/jupyterhub_config.py) starts this as the learner's uid and gid, so whatever the
learner put at FOLDER (a link to a tree that is not theirs, say) gives them nothing they could not do already:
nothing here changes the owner of anything, and nothing follows a link it did not make.
"""
from __future__ import annotations

import argparse
import os
import shutil
import stat
import sys
from pathlib import Path

from utils.base.paths import UnsafePath, private_dir


def prepare(folder: Path, checkout: Path) -> None:
    """FOLDER/work (the learner's copy of the checkout's labs/, kept across restarts: it holds their work, as
    work/ does in a checkout), FOLDER/solutions (a link to the shared checkout's) and FOLDER/build (0700). FOLDER must be a real folder of this user's, or missing."""
    folder, checkout = Path(folder), Path(checkout)
    private_dir(folder)                                 # refuses a link or another user's folder by name
    private_dir(folder / "build")
    private_dir(folder / "build" / "cache")
    work = folder / "work"
    if not os.path.lexists(work):
        shutil.copytree(checkout / "labs", work, symlinks=True)
    elif not stat.S_ISDIR(os.lstat(work).st_mode):
        raise UnsafePath(f"{work} is not a folder (a link?): move it away and restart your server")
    solutions = folder / "solutions"
    if not os.path.lexists(solutions):
        solutions.symlink_to(checkout / "solutions")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m utils.machinery.workspace", description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--checkout", type=Path, required=True)
    args = ap.parse_args(argv)
    try:
        prepare(args.folder, args.checkout)
    except (UnsafePath, OSError) as exc:
        print(f"workspace refused: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
