"""`make lab` in a real browser (headless Chromium driven by Selenium), as a learner uses it.

In a fresh copy of the checkout: `make lab` starts (with --allow-root as root), makes the learner's work/ and the
browser lands on work/00 at the repo root, nothing is marked changed, no news pop-up and no nbgrader; lab 00 with
its exercises solved through the editor passes under Run All with a rendered plot, and once saved survives
`make labs`; with a wrong answer the hint shows.
Screenshots go to build/workshop/ (CI artifacts). Run by `make test-workshop`, which installs Chromium,
chromium-driver and selenium; `make test` skips this module.
"""
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

if os.environ.get("COURSE_WORKSHOP_TESTS") != "1":
    pytest.skip("workshop browser test: run by `make test-workshop` (it installs Chromium, chromium-driver "
                "and selenium)", allow_module_level=True)

from selenium import webdriver  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402

from utils import solutions  # noqa: E402
from utils.graders import lab00 as graders  # noqa: E402
from utils.exercises import ExerciseFailed  # noqa: E402

from workshop_support import copy_checkout, free_port, wait_until_serving  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = Path(os.environ.get("COURSE_WORKSHOP_ARTIFACTS") or ROOT / "build" / "workshop")
LAB = "00_environment"
TOKEN = "workshop-browser-test"
WRONG = "return None"


def make_args(copy: Path) -> list[str]:
    """`make` in the copy, its install taken as done (the copy's .venv is this checkout's)."""
    stamps = [p.name for p in (copy / ".venv").iterdir() if p.name.startswith(".installed-")]
    return ["make", "--no-print-directory", *[f"-o.venv/{s}" for s in stamps]]


def learner_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER_", "COURSE_BUILD_DIR"))}


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """`make lab` in a copy of the checkout; yields (base url, log path, copy); stops its process group."""
    copy = copy_checkout(tmp_path_factory.mktemp("checkout"))
    assert not (copy / "work").exists(), "the copy of the checkout has a work/ (it is git-ignored)"
    port = free_port()
    log_path = ARTIFACTS / "make-lab.log"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    env = learner_env()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [*make_args(copy), "lab",
             f"LAB_ARGS=--no-browser --ServerApp.ip=127.0.0.1 --ServerApp.port={port} "
             f"--IdentityProvider.token={TOKEN}"],
            cwd=copy, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(lambda: urllib.request.urlopen(f"{base}/api/status?token={TOKEN}", timeout=2), proc,
                           lambda: f"make lab did not serve ({proc.poll()}):\n{log_path.read_text()[-3000:]}")
        yield base, log_path, copy
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        left = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert not left, f"make lab left processes {left}"


@pytest.fixture
def browser(lab):
    """A fresh Chromium per test, on a fresh copy of the learner's lab 00 (JupyterLab may have autosaved the last
    one)."""
    _, _, copy = lab
    shutil.copy2(solutions.LABS / f"{LAB}.ipynb", copy / "work" / f"{LAB}.ipynb")
    opts = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        opts.add_argument(arg)
    opts.binary_location = shutil.which("chromium") or shutil.which("google-chrome") or "/usr/bin/chromium"
    driver_path = shutil.which("chromedriver") or os.path.join(os.environ.get("CHROMEWEBDRIVER", "/usr/bin"),
                                                               "chromedriver")
    driver = webdriver.Chrome(options=opts, service=webdriver.ChromeService(executable_path=driver_path))
    driver.implicitly_wait(0)
    yield driver
    driver.quit()


def wait(what, fn, timeout=60.0, every=0.25):
    deadline = time.monotonic() + timeout
    while True:
        got = fn()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


# The notebook panel on show: other notebooks stay in the page as hidden tabs.
PANEL = "const P = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)') || document;"


def js(driver, script, *args):
    return driver.execute_script(script, *args)


def panel(driver, script, *args):
    """`script` with P, the visible notebook panel, in scope."""
    return driver.execute_script(PANEL + script, *args)


def kernel_idle(driver) -> bool:
    return panel(driver, "const e = P.querySelector('.jp-Notebook-ExecutionIndicator');"
                         "return !!e && e.getAttribute('data-status') === 'idle';")


def dirty_tabs(driver) -> list[str]:
    return js(driver, "return Array.from(document.querySelectorAll('.lm-TabBar-tab.jp-mod-dirty'))"
                      ".map(e => e.textContent);")


def open_lab00(driver, base):
    """Open JupyterLab as `make lab`'s browser does (its default URL)."""
    driver.get(f"{base}/?token={TOKEN}")
    try:
        wait("lab 00 open", lambda: js(driver, "const t = document.querySelector("
             "'.lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current .lm-TabBar-tabLabel');"
             "return !!t && t.textContent;") == f"{LAB}.ipynb"
             and panel(driver, "return P.querySelectorAll('.jp-Notebook .jp-Cell').length") > 5)
    except AssertionError as exc:
        shot(driver, "failed-open")
        raise AssertionError(f"{exc}; at {driver.current_url}") from None
    wait("the kernel to be idle", lambda: kernel_idle(driver), timeout=90)


def cell_texts(driver) -> list[str]:
    """Each cell's outputs as text (textContent: cells outside the viewport are not laid out)."""
    return panel(driver, "return Array.from(P.querySelectorAll('.jp-Notebook .jp-Cell'))"
                         ".map(c => (c.querySelector('.jp-OutputArea') || {textContent: ''}).textContent);")


def replace_line(driver, marker: str, code: str):
    """Put the cursor on the editor line containing `marker`, select the line's text (Home stops after
    the indentation) and type `code` over it, as a learner does."""
    line = wait(f"an editor line with {marker!r}", lambda: panel(driver, """
        const lines = Array.from(P.querySelectorAll('.jp-Notebook .cm-line'));
        const l = lines.find(e => e.textContent.includes(arguments[0]));
        if (l) l.scrollIntoView({block: 'center'});
        return l || null;""", marker))
    line.click()
    editor = driver.switch_to.active_element
    editor.send_keys(Keys.END, Keys.SHIFT + Keys.HOME)
    editor.send_keys(code)
    wait(f"{code!r} in the editor", lambda: panel(driver, """
        return Array.from(P.querySelectorAll('.jp-Notebook .cm-line'))
            .some(e => e.textContent.trim() === arguments[0]);""", code), timeout=10)
    editor.send_keys(Keys.ESCAPE)


def menu(driver, top: str, item: str):
    driver.find_element(By.XPATH, f"//li[contains(@class,'lm-MenuBar-item')][.//div[text()='{top}']]").click()
    wait(f"menu item {item!r}", lambda: driver.find_elements(
        By.XPATH, f"//li[contains(@class,'lm-Menu-item')][.//div[text()='{item}']]"))[0].click()


def run_all(driver, timeout=240.0):
    """Run > Run All Cells; returns when the kernel is idle and no cell is queued or running."""
    menu(driver, "Run", "Run All Cells")
    time.sleep(1.0)
    wait("Run All to finish", lambda: kernel_idle(driver) and not panel(driver, """
        return Array.from(P.querySelectorAll('.jp-Notebook .jp-InputArea-prompt'))
            .some(p => p.textContent.includes('*'));"""), timeout=timeout, every=1.0)


def one_line_answers() -> dict[str, str]:
    """Lab 00's exercises whose solution is one line: {id: the line} (from the solution notebook)."""
    nb = solutions.read(solutions.notebook_path(LAB))
    answers = {}
    for r in solutions.regions(nb, LAB):
        body = nb.cells[r.cell].source.split("\n")[r.begin + 1:r.end]
        if len(body) == 1:
            answers[r.exercise] = body[0].strip()
    assert answers, "lab 00 has no one-line exercise for the browser test"
    return answers


def expected_hint(exercise: str) -> str:
    """The hint lab 00's grader gives for WRONG in `exercise`, with the exported module's answer (no browser)."""
    nb = solutions.read(solutions.notebook_path(LAB))
    grade = next(c.source for c in nb.cells if f'ex.grade("{exercise}"' in c.source)
    checker, fn = re.search(rf'ex\.grade\("{re.escape(exercise)}",\s*"[^"]*",\s*(\w+),\s*(\w+)', grade).groups()
    module = solutions.load(LAB, answers={exercise: WRONG})
    with pytest.raises(ExerciseFailed) as failed:     # the checker is in utils/graders/lab00.py
        getattr(graders, checker)(getattr(module, fn))
    return str(failed.value)


def shot(driver, name: str, show: str | None = None):
    """Save a screenshot; `show`: scroll the first cell whose output contains this text into view."""
    if show:
        panel(driver, """const c = Array.from(P.querySelectorAll('.jp-Notebook .jp-Cell')).find(
            c => (c.querySelector('.jp-OutputArea') || {textContent: ''}).textContent.includes(arguments[0]));
            if (c) c.scrollIntoView({block: 'start'});""", show)
        time.sleep(0.5)
    driver.save_screenshot(str(ARTIFACTS / f"{name}.png"))


def test_make_lab_opens_lab00_at_the_repo_root_clean(lab, browser):
    base, log_path, _ = lab
    open_lab00(browser, base)
    assert browser.current_url.startswith(f"{base}/lab/tree/work/{LAB}.ipynb"), browser.current_url
    time.sleep(4)   # the kernel's info arrives after idle: a metadata mismatch would mark the tab now
    shot(browser, "1-lab00-opened")
    assert dirty_tabs(browser) == [], "opening lab 00 marked it changed"
    text = js(browser, "return document.body.innerText;")
    assert "official Jupyter news" not in text, "JupyterLab asked about news"
    menus = js(browser, "return Array.from(document.querySelectorAll('.lm-MenuBar-itemLabel')).map(e => e.textContent);")
    assert "Run" in menus and not any("grader" in m.lower() for m in menus), menus
    assert "Create Assignment" not in text and "Formgrader" not in text
    # the file browser's root is the repo: work/ (the learner's copy, made by `make lab`) and solutions/ one click away
    browser.find_element(By.CSS_SELECTOR, ".jp-BreadCrumbs-home").click()
    listing = "return Array.from(document.querySelectorAll('.jp-DirListing-itemText')).map(e => e.textContent);"
    try:
        wait("work/, labs/ and solutions/ in the root listing",
             lambda: {"work", "labs", "solutions", "utils"} <= set(js(browser, listing)), timeout=15)
    finally:
        shot(browser, "1b-file-browser-root")
    # a solution (its metadata may be incomplete) opens clean too
    browser.get(f"{base}/lab/tree/solutions/{LAB}.ipynb?token={TOKEN}")
    wait("the solution open", lambda: js(browser, "const t = document.querySelector("
         "'.lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current .lm-TabBar-tabLabel');"
         "return !!t && t.textContent;") == f"{LAB}.ipynb" and kernel_idle(browser), timeout=90)
    time.sleep(4)
    assert dirty_tabs(browser) == [], "opening the solution marked it changed"
    log = log_path.read_text()
    if os.geteuid() == 0:
        assert "make lab: running as root" in log and "--allow-root" in log
    assert "nbgrader" not in log.lower(), "nbgrader's server extensions were loaded for a learner"
    # kernels are reached over CurveZMQ, and the websocket ping settings are ones tornado accepts (jupyter/)
    assert "without encryption" not in log and "websocket_ping_timeout" not in log, log


def test_run_all_with_the_exercises_solved_passes_and_plots_and_survives_make_labs(lab, browser):
    base, _, copy = lab
    open_lab00(browser, base)
    answers = one_line_answers()
    for exercise, code in answers.items():
        replace_line(browser, f"exercise not done: {exercise},", code)
    run_all(browser)
    shot(browser, "2-lab00-solved-run-all", show="PASS: exercise")
    outputs = "\n".join(cell_texts(browser))
    for exercise in answers:
        assert f"PASS: exercise {exercise}" in outputs, outputs[-3000:]
    for exercise in answers:      # lab 00's longer exercises stay unfinished here: they may say NOT DONE
        assert f"NOT DONE: exercise {exercise} " not in outputs, exercise
    assert "ExerciseFailed" not in outputs and "Traceback" not in outputs
    images = panel(browser, "return Array.from(P.querySelectorAll('.jp-OutputArea-output img'))"
                         ".map(i => [i.naturalWidth, i.naturalHeight]);")
    assert images and all(w > 100 and h > 100 for w, h in images), images
    # every code cell ran
    prompts = panel(browser, "return Array.from(P.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt'))"
                          ".map(p => p.textContent.trim());")
    assert prompts and all(re.fullmatch(r"\[\d+\]:", p) for p in prompts), prompts
    # saved (Ctrl+S), the solved notebook is the learner's: `make labs` regenerates labs/ and leaves it as it is
    mine = copy / "work" / f"{LAB}.ipynb"
    webdriver.ActionChains(browser).key_down(Keys.CONTROL).send_keys("s").key_up(Keys.CONTROL).perform()
    wait("the notebook saved", lambda: not dirty_tabs(browser) and all(
        code in mine.read_text() for code in answers.values()), timeout=30)
    saved = mine.read_bytes()
    (copy / "labs" / f"{LAB}.ipynb").write_text("{}")        # labs/ out of date: `make labs` rewrites it
    out = subprocess.run([*make_args(copy), "labs"], cwd=copy, env=learner_env(), capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (copy / "labs" / f"{LAB}.ipynb").read_bytes() == (solutions.LABS / f"{LAB}.ipynb").read_bytes()
    assert mine.read_bytes() == saved and "PASS: exercise" in mine.read_text()


def test_a_wrong_answer_shows_the_checkers_hint(lab, browser):
    base, _, _ = lab
    open_lab00(browser, base)
    exercise = sorted(one_line_answers())[0]
    hint = expected_hint(exercise)
    replace_line(browser, f"exercise not done: {exercise},", WRONG)
    run_all(browser)
    shot(browser, "3-lab00-wrong-answer", show="ExerciseFailed")
    outputs = "\n".join(cell_texts(browser))
    assert f"ExerciseFailed: {hint}" in outputs, outputs[-3000:]
    assert f"PASS: exercise {exercise}" not in outputs


ALL_LABS = sorted(p.stem for p in solutions.LABS.glob("*.ipynb"))


@pytest.mark.skipif(os.environ.get("COURSE_WORKSHOP_ALL_LABS") != "1",
                    reason="every lab's Run All in the browser takes ~10 minutes on CPU: "
                           "make test-workshop ALL_LABS=1")
@pytest.mark.parametrize("name", ALL_LABS)
def test_run_all_reaches_the_end_of_every_unfinished_lab(lab, browser, name):
    """The generated lab as a learner first opens it, exercises unfinished: Run All runs every code cell."""
    base, _, copy = lab
    shutil.copy2(solutions.LABS / f"{name}.ipynb", copy / "work" / f"{name}.ipynb")
    browser.get(f"{base}/lab/tree/work/{name}.ipynb?token={TOKEN}")
    wait(f"{name} open", lambda: js(browser, "const t = document.querySelector("
         "'.lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current .lm-TabBar-tabLabel');"
         "return !!t && t.textContent;") == f"{name}.ipynb"
         and panel(browser, "return P.querySelectorAll('.jp-Notebook .jp-Cell').length") > 3, timeout=90)
    wait("the kernel to be idle", lambda: kernel_idle(browser), timeout=90)
    run_all(browser, timeout=900)
    shot(browser, f"4-run-all-{name}", show="NOT DONE")
    prompts = panel(browser, "return Array.from(P.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt'))"
                          ".map(p => p.textContent.trim());")
    unrun = [i for i, p in enumerate(prompts) if not re.fullmatch(r"\[\d+\]:", p)]
    outputs = "\n".join(cell_texts(browser))
    assert not unrun, f"{name}: Run All stopped; code cells {unrun} did not run\n{outputs[-2000:]}"
    assert "Traceback" not in outputs and "ExerciseFailed" not in outputs, outputs[-2000:]
    assert "NOT DONE: exercise" in outputs
