"""The course website (`make site`, build/site) in a real browser (headless Chromium driven by Selenium).

Every lab page says which GPU, commit and software gave its outputs and links to Binder, and its plots render (each
image loaded, natural width > 0, as many as the published notebook has); nothing is loaded from another host while
a page is viewed; a crawl of every internal link from the landing page finds each target file (and each #anchor).
Run by `make test-site`, which builds the site and installs Chromium, chromium-driver and selenium; `make test`
skips this module.
"""
import functools
import http.server
import os
import shutil
import threading
import time
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

if os.environ.get("COURSE_SITE_TESTS") != "1":
    pytest.skip("website browser test: run by `make test-site` (it builds the site and installs Chromium, "
                "chromium-driver and selenium)", allow_module_level=True)

import nbformat  # noqa: E402
from selenium import webdriver  # noqa: E402

from utils.base.paths import SOLUTIONS_DIR  # noqa: E402
from utils.machinery.executed import COPIES, KEY  # noqa: E402
from utils.machinery.site import SOFTWARE_NAMES  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SITE = Path(os.environ.get("COURSE_SITE_DIR") or ROOT / "build" / "site")
LABS = sorted(p.stem for p in SOLUTIONS_DIR.glob("*.ipynb"))


@pytest.fixture(scope="module")
def base():
    """build/site served on 127.0.0.1 (a free port), as GitHub Pages serves it."""
    assert (SITE / "index.html").exists(), f"no site in {SITE}: `make site` builds it"
    handler = functools.partial(QuietHandler, directory=str(SITE))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def browser():
    opts = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    opts.binary_location = shutil.which("chromium") or shutil.which("google-chrome") or "/usr/bin/chromium"
    driver_path = shutil.which("chromedriver") or os.path.join(os.environ.get("CHROMEWEBDRIVER", "/usr/bin"),
                                                               "chromedriver")
    driver = webdriver.Chrome(options=opts, service=webdriver.ChromeService(executable_path=driver_path))
    yield driver
    driver.quit()


def open_page(driver, url: str, timeout: float = 30.0) -> None:
    """Load `url` and wait until it and every image in it finished loading (or failed)."""
    driver.get(url)
    deadline = time.monotonic() + timeout
    while not driver.execute_script("return document.readyState === 'complete' && "
                                    "[...document.images].every(i => i.complete)"):
        assert time.monotonic() < deadline, f"{url} did not finish loading in {timeout:.0f} s"
        time.sleep(0.1)


def published(lab: str):
    """The notebook the site shows for a lab: its GPU copy, else its solution."""
    copy = COPIES / f"{lab}.ipynb"
    return nbformat.read(copy if copy.exists() else SOLUTIONS_DIR / f"{lab}.ipynb", as_version=4)


def plots_in(nb) -> int:
    return sum(any(k.startswith("image/") for k in o.get("data", {}))
               for c in nb.cells if c.cell_type == "code" for o in c.outputs)


def offsite_and_errors(driver, base: str) -> list[str]:
    """What the page loaded from another host, and the browser's errors (a missing file, a script error)."""
    loaded = driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    problems = [f"loaded from off the site: {u}" for u in loaded if not u.startswith(base + "/")]
    problems += [f"browser: {e['message']}" for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    return problems


@pytest.mark.parametrize("lab", LABS)
def test_each_lab_page_says_where_its_outputs_come_from_and_its_plots_render(browser, base, lab):
    open_page(browser, f"{base}/labs/{lab}.html")
    nb = published(lab)
    text = browser.execute_script("return document.querySelector('article').innerText")
    stamp = nb.metadata.get(KEY)
    if stamp:
        software = [f"{SOFTWARE_NAMES.get(k, k)} {v}" for k, v in stamp.get("software", {}).items()]
        for fact in (stamp.get("device") or "an unrecorded device", (stamp.get("commit") or "unknown")[:10], *software):
            assert fact in text, f"{lab}: the page does not say {fact!r}"
    else:
        assert "No GPU copy of this lab yet" in text
    links = browser.execute_script("return [...document.querySelectorAll('article a')].map(a => a.href)")
    assert any(u.startswith("https://mybinder.org/v2/gh/") and u.endswith(f"/work/{lab}.ipynb") for u in links), \
        f"{lab}: no Binder link"
    images = browser.execute_script("return [...document.querySelectorAll('article img')]"
                                    ".map(i => [i.currentSrc, i.complete, i.naturalWidth])")
    broken = [src for src, complete, width in images if not (complete and width > 0)]
    assert not broken, f"{lab}: images that did not render: {broken}"
    assert len(images) >= plots_in(nb), f"{lab}: {len(images)} images on the page, {plots_in(nb)} plots in it"
    assert images or not stamp, f"{lab}: a GPU copy with no plot"
    assert not offsite_and_errors(browser, base)


def test_every_internal_link_resolves_to_a_file_and_anchor(browser, base):
    """Crawl from the landing page: each internal href is a file of the site; each #anchor is an id in its page."""
    queue, seen, ids, broken, anchors = ["index.html"], {"index.html"}, {}, [], []
    while queue:
        page = queue.pop()
        open_page(browser, f"{base}/{page}")
        broken += [f"{page}: {p}" for p in offsite_and_errors(browser, base)]
        ids[page] = set(browser.execute_script("return [...document.querySelectorAll('[id]')].map(e => e.id)"))
        hrefs = browser.execute_script("return [...document.querySelectorAll('a[href]')].map(a => a.href)")
        for href in hrefs:
            url = urlsplit(href)
            if f"{url.scheme}://{url.netloc}" != base:
                continue
            path = unquote(url.path).lstrip("/") or "index.html"
            path = path + "index.html" if path.endswith("/") else path
            if not (SITE / path).is_file():
                broken.append(f"{page}: {href}")
                continue
            if url.fragment:
                anchors.append((page, path, unquote(url.fragment), href))
            if path.endswith(".html") and path not in seen:
                seen.add(path)
                queue.append(path)
    assert not broken, "links to files the site does not have, or errors:\n" + "\n".join(broken)
    missing = [f"{page}: {href}" for page, path, frag, href in anchors if path in ids and frag not in ids[path]]
    assert not missing, "links to anchors their page does not have:\n" + "\n".join(missing)
    assert {f"labs/{lab}.html" for lab in LABS} | {"report.html"} <= seen, "a lab page or the report is not linked"
