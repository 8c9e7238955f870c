"""The course website (`make site`): the labs as their GPU runs executed them (docs/executed/, never re-executed)
and the CPU report, built by Sphinx with myst-nb into build/site with nothing fetched, at build time or when viewed.

`build()` stages site/ (the configuration and the landing page) in build/site-src with one page per lab, each
headed by where its outputs come from (the `course_executed` stamp: GPU, commit, software) and a Binder link,
and with build/report.md and its plots; then runs Sphinx with every network connection refused, and checks that
no page loads a script, style, image or frame from off the site.

    python -m utils.machinery.site build [--repo owner/name] [--branch main]   # build/site
    python -m utils.machinery.site check build/site                              # only the off-site check
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import socket
import sys
import time
from html.parser import HTMLParser
from pathlib import Path

import nbformat

from utils.base.paths import REPO_ROOT, SOLUTIONS_DIR, build_dir
from utils.machinery.executed import COPIES, KEY, stale

SITE = REPO_ROOT / "site"
DEFAULT_REPO = "rocm-cuda-labs/rocm-cuda-labs"
SOFTWARE_NAMES = {"cuda": "CUDA", "hip": "HIP", "triton": "Triton"}


def provenance(lab: str, stamp: dict | None, why_stale: str | None) -> str:
    """The Markdown (MyST) that heads a lab's page: which GPU, commit and software gave its outputs; Binder."""
    notebook = f"{lab}.ipynb"
    launch = (f"{{binder}}`Launch this lab on Binder <lab/tree/work/{notebook}>` (CPU only: small sizes, Triton's "
              f"interpreter; your own copy with the exercises open) · {{download}}`download this notebook "
              f"<downloads/{notebook}>`")
    if not stamp:
        return (f":::{{warning}}\nNo GPU copy of this lab yet (`docs/executed/{notebook}`): the outputs below are the "
                f"ones stored in `solutions/{notebook}`, from a run **on a CPU** at small sizes.\n\n{launch}\n:::\n")
    software = ", ".join(f"{SOFTWARE_NAMES.get(k, k)} {v}" for k, v in sorted(stamp.get("software", {}).items()))
    commit = stamp.get("commit") or "unknown"
    lines = [f":::{{admonition}} Executed on {stamp.get('device') or 'an unrecorded device'}\n:class: note\n",
             f"The outputs and plots below are this lab as the course's GPU run executed it on "
             f"**{stamp.get('device') or 'an unrecorded device'}** on {str(stamp.get('date', '?'))[:10]}, at commit "
             + (f"{{commit}}`{commit[:10]} <{commit}>`" if commit != "unknown" else "unknown")
             + (" (with uncommitted changes to solutions/ or utils/)" if stamp.get("uncommitted_changes") else "")
             + (f", run `{stamp['run_id']}`" if stamp.get("run_id") else "")
             + f", with {software}. They were not re-executed for this page.\n", launch, ":::\n"]
    if why_stale:
        lines += [f":::{{warning}}\nThis copy is {why_stale}: `python -m utils.machinery.executed check`.\n:::\n"]
    return "\n".join(lines)


def lab_page(solution: Path, why_stale: dict[str, str]) -> tuple[nbformat.NotebookNode, Path]:
    """(the notebook to publish, the file it came from): the GPU copy, else the solution with its CPU outputs;
    the provenance goes right after the title cell."""
    copy = COPIES / solution.name
    source = copy if copy.exists() else solution
    nb = nbformat.read(source, as_version=4)
    stamp = nb.metadata.get(KEY) if source == copy else None
    head = nbformat.v4.new_markdown_cell(provenance(solution.stem, stamp, why_stale.get(solution.stem)))
    head.id = "course-site-provenance"
    nb.cells.insert(1 if nb.cells and nb.cells[0].cell_type == "markdown" else 0, head)
    return nb, source


def report_page(stage: Path, build: Path) -> bool:
    """report.md in the stage: build/report.md and its plots, else a page that says how to make it."""
    report = build / "report.md"
    if not report.exists():
        (stage / "report.md").write_text(
            "# The course report\n\nNo report was there when this site was built. `make run` writes it "
            "(`build/report.md`: every lab's headline figures beside the H100 reference's and the published peaks); "
            "on a machine without a GPU:\n\n```\n"
            "make run DEVICE=cpu TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu\nmake site\n```\n")
        return False
    def plot(m: re.Match) -> str:
        image = m.group(2)
        if not (build / image).exists():      # a later run of the lab replaced it
            return f"*({m.group(1)}: `build/{image}` is gone since this report was written; `make report`)*"
        (stage / image).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(build / image, stage / image)
        return m.group(0)
    text = re.sub(r"!\[([^\]]*)\]\((results/[^)\s]+)\)", plot, report.read_text())
    title, _, rest = text.partition("\n")
    (stage / "report.md").write_text(
        f"{title}\n\n:::{{note}}\nThe report of the `make run` beside which this site was built (its device is named "
        f"below), as `build/report.md`; the lab pages show the GPU runs.\n:::\n{rest}")
    return True


def stage(out: Path, build: Path) -> dict:
    """build/site-src: site/, one page per lab (labs/), the executed notebooks to download, the report."""
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(SITE, out, ignore=shutil.ignore_patterns("__pycache__"))
    (out / "labs" / "downloads").mkdir(parents=True)
    why = stale()
    pages = {}
    for solution in sorted(SOLUTIONS_DIR.glob("*.ipynb")):
        nb, source = lab_page(solution, why)
        nbformat.write(nb, out / "labs" / solution.name)
        shutil.copy2(source, out / "labs" / "downloads" / solution.name)
        pages[solution.stem] = source
    (out / "_include").mkdir()
    shutil.copy2(REPO_ROOT / "README.md", out / "_include" / "README.md")      # the landing page quotes it
    return {"pages": pages, "report": report_page(out, build)}


@contextlib.contextmanager
def no_network():
    """Every attempt to reach a network address inside raises, and is listed in the list yielded."""
    tried, saved = [], (socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo)

    def refuse(where):
        def refused(*args, **kwargs):
            tried.append(f"{where}{args[1:] if where != 'getaddrinfo' else args[:2]}")
            raise OSError(f"the site build may not use the network ({where})")
        return refused
    socket.socket.connect, socket.socket.connect_ex = refuse("connect"), refuse("connect_ex")
    socket.getaddrinfo = refuse("getaddrinfo")
    try:
        yield tried
    finally:
        socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo = saved


class _Assets(HTMLParser):
    """What a page loads as it is viewed: (tag, url) of scripts, styles, images, frames, media, inline CSS urls."""
    LOADS = {"script": "src", "img": "src", "iframe": "src", "source": "src", "video": "src", "audio": "src",
             "embed": "src", "object": "data", "link": "href"}

    def __init__(self):
        super().__init__()
        self.found = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "link" and attrs.get("rel") in ("canonical", "alternate"):
            return
        if attrs.get(self.LOADS.get(tag, "")):
            self.found.append((tag, attrs[self.LOADS[tag]]))
        urls = CSS_URL.findall(attrs.get("style") or "") + (attrs.get("srcset") or "").split()
        self.found += [(tag, u) for u in urls]


CSS_URL = re.compile(r"""(?:url\(\s*['"]?|@import\s+['"])([^'")\s]+)""")
OFFSITE = re.compile(r"^(?:[a-z][a-z0-9+.-]*:)?//", re.I)


def offsite_assets(site: Path) -> list[str]:
    """Every script, style, image, frame or CSS url a page or stylesheet of the built site loads from another host."""
    found = []
    for page in sorted(site.rglob("*.html")):
        parser = _Assets()
        parser.feed(page.read_text(errors="replace"))
        found += [f"{page.relative_to(site)}: <{tag}> {url}" for tag, url in parser.found if OFFSITE.match(url)]
    for css in sorted(site.rglob("*.css")):
        found += [f"{css.relative_to(site)}: {url}" for url in CSS_URL.findall(css.read_text(errors="replace"))
                  if OFFSITE.match(url)]
    return found


def build(out: Path | None = None, *, repo: str = DEFAULT_REPO, branch: str = "main") -> Path:
    """Stage and build the site into `out` (build/site) offline; raise if anything reached for the network or a
    built page loads something from off the site."""
    from sphinx.cmd.build import build_main    # the `site` extra: `make site` installs it

    build = build_dir()
    out = Path(out or build / "site")
    src = build / "site-src"
    start = time.monotonic()
    staged = stage(src, build)
    shutil.rmtree(out, ignore_errors=True)
    os.environ.update(COURSE_SITE_REPO=repo, COURSE_SITE_BRANCH=branch)
    with no_network() as tried:
        code = build_main(["-b", "html", "-q", "-W", "--keep-going", "-d", str(src / ".doctrees"), str(src), str(out)])
    if tried:
        raise RuntimeError("the site build tried the network: " + "; ".join(tried[:5]))
    if code:
        raise RuntimeError(f"sphinx-build failed (exit {code}); its messages are above")
    if off := offsite_assets(out):
        raise RuntimeError("pages load from off the site:\n  " + "\n  ".join(off[:20]))
    gpu = sum(p.parent == COPIES for p in staged["pages"].values())
    print(f"site: {out} ({len(staged['pages'])} lab pages, {gpu} from GPU copies in docs/executed/; report: "
          f"{'build/report.md' if staged['report'] else 'none yet, the page says how'}; Binder: {repo}@{branch}; "
          f"{time.monotonic() - start:.0f} s, nothing fetched)")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m utils.machinery.site", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build the website into build/site (offline)")
    b.add_argument("--out", type=Path)
    b.add_argument("--repo", default=DEFAULT_REPO, help="GitHub owner/name that Binder launches (default %(default)s)")
    b.add_argument("--branch", default="main")
    c = sub.add_parser("check", help="list what built pages load from off the site (exit 1 if anything)")
    c.add_argument("site", type=Path, nargs="?", default=build_dir() / "site")
    args = ap.parse_args(argv)
    if args.cmd == "build":
        try:
            build(args.out, repo=args.repo, branch=args.branch)
        except RuntimeError as e:
            print(f"make site: {e}", file=sys.stderr)
            return 1
        return 0
    off = offsite_assets(args.site)
    print("\n".join(off) or f"{args.site}: nothing loaded from off the site")
    return 1 if off else 0


if __name__ == "__main__":
    sys.exit(main())
