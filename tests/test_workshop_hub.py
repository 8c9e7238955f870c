"""Three learners on one machine through a real JupyterHub (docs/jupyterhub/jupyterhub_config.py, test mode).

The hub (with configurable-http-proxy from npm) starts on 127.0.0.1 over a shared copy of the checkout,
spawns three learners' servers (SimpleLocalProcessSpawner, a dummy authenticator) and runs lab 00 and then
lab 05 in each learner's kernel, all three learners at the same time, cell by cell through the hub's proxy
and the Jupyter server's session and kernel API, as JupyterLab's Run All does. Then: no error but the
exercises' NOT DONE; each learner's results, run status, caches and logs in their own build folder; no port
shared; the shared checkout unchanged; after shutdown no process and no port of theirs left.
Run by `make test-workshop` (it installs jupyterhub and configurable-http-proxy); `make test` skips it.
"""
import asyncio
import datetime as dt
import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

if os.environ.get("COURSE_WORKSHOP_TESTS") != "1":
    pytest.skip("workshop JupyterHub test: run by `make test-workshop` (it installs jupyterhub and "
                "configurable-http-proxy)", allow_module_level=True)

from tornado.httpclient import HTTPRequest  # noqa: E402
from tornado.websocket import websocket_connect  # noqa: E402
from workshop_support import ROOT, copy_checkout, free_port, wait_until_serving  # noqa: E402

LEARNERS = ("ada", "grace", "linus")
TOKEN = uuid.uuid4().hex
# Lab 05's load test at its smallest: three learners share two cores here.
OVERRIDES = {"00_environment": "", "05_llm_serving": "CONCURRENCY = [1, 2]\nOUTPUT_TOKENS = 4\nDECODE_TOKENS = 4\n"}
CELL_TIMEOUT = 300
WS_CONNECT_TIMEOUT = 150     # more than twice jupyter_server's kernel_info_timeout (60 s)


def api(base, path, method="GET", body=None, timeout=30):
    req = urllib.request.Request(f"{base}{path}", method=method, headers={"Authorization": f"token {TOKEN}"},
                                 data=None if body is None else json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=timeout) as r:
        data = r.read()
        return json.loads(data) if data else None


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in folder.rglob("*") if p.is_file() and not p.is_symlink()}


def processes_of(homes: Path) -> dict[int, str]:
    """Processes with a learner's build folder in their environment (servers, kernels, engines; not the hub)."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes()
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if f"COURSE_BUILD_DIR={homes}/".encode() in env:
            found[int(proc.name)] = cmd[:120]
    return found


def listening_ports() -> set[int]:
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A running hub over a shared checkout; yields (base url, checkout, homes); stops it all."""
    tmp = tmp_path_factory.mktemp("hub")
    checkout = copy_checkout(tmp / "checkout")
    # the instructor's step before the room arrives: the converted SmolLM2 in the shared models folder
    # (FP32 for the learners' kernels, BF16 for lab 05's server)
    models = ROOT / "build" / "models"
    folders = ("smollm2-135m-instruct", "smollm2-135m-instruct-bf16")
    if all((models / f).is_dir() for f in folders):
        for f in folders:
            shutil.copytree(models / f, checkout / "build" / "models" / f, copy_function=os.link)
    else:
        subprocess.run([str(checkout / ".venv" / "bin" / "python"), "-c",
                        "from utils.llm import models; models.smollm2(); models.smollm2(dtype='bfloat16')"],
                       cwd=checkout, env=dict(os.environ, PYTHONPATH=str(checkout)), check=True, timeout=300)
    homes, state = tmp / "homes", tmp / "state"
    homes.mkdir()
    state.mkdir()
    port = free_port()
    (state / "test_config.py").write_text(
        "c = get_config()\n"
        f"load_subconfig({str(checkout / 'docs' / 'jupyterhub' / 'jupyterhub_config.py')!r})\n"
        f"c.JupyterHub.services = [{{'name': 'workshop-test', 'api_token': {TOKEN!r}}}]\n"
        "c.JupyterHub.load_roles = [{'name': 'workshop-test', 'services': ['workshop-test'], 'scopes': "
        "['admin:users', 'admin:servers', 'access:servers', 'proxy']}]\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER_", "COURSE_BUILD_DIR", "PYTHONPATH"))}
    env.update(COURSE_HUB_MODE="test", COURSE_HUB_CHECKOUT=str(checkout), COURSE_HUB_HOMES=str(homes),
               COURSE_HUB_STATE=str(state), COURSE_HUB_PORT=str(port), COURSE_HUB_API_PORT=str(free_port()),
               COURSE_HUB_PROXY_PORT=str(free_port()), COURSE_HUB_THREADS="1", COURSE_DEVICE="cpu")
    (ROOT / "build" / "workshop").mkdir(parents=True, exist_ok=True)
    log = open(ROOT / "build" / "workshop" / "jupyterhub.log", "w")
    proc = subprocess.Popen([str(checkout / ".venv" / "bin" / "jupyterhub"), "-f", str(state / "test_config.py")],
                            cwd=state, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(lambda: api(base, "/hub/api/", timeout=3), proc,
                           lambda: f"jupyterhub did not start ({proc.poll()}); see build/workshop/jupyterhub.log")
        yield base, checkout, homes
    finally:
        for name in LEARNERS:
            try:
                api(base, f"/hub/api/users/{name}/server", "DELETE", timeout=60)
            except OSError:
                pass
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()


async def run_notebook(base: str, user: str, lab: str) -> dict:
    """Run a learner's lab the way Run All does: every code cell in order in one kernel (a session on the
    notebook's path), OVERRIDES after the parameters cell, stopping at the first error."""
    prefix = f"/user/{user}/api"
    loop = asyncio.get_running_loop()
    path = f"work/{lab}.ipynb"       # the learner's copy (utils/machinery/workspace.py)
    nb = (await loop.run_in_executor(None, api, base, f"{prefix}/contents/{path}"))["content"]
    session = await loop.run_in_executor(None, lambda: api(base, f"{prefix}/sessions", "POST", {
        "path": path, "name": f"{lab}.ipynb", "type": "notebook", "kernel": {"name": "python3"}}))
    # The server answers the upgrade only once the new kernel has replied to kernel_info (jupyter_server waits up to
    # its kernel_info_timeout, 60 s): with three learners' engines on two cores a kernel can take longer to start than
    # tornado's default 20 s request timeout, which is the client giving up, not the server failing.
    ws = await websocket_connect(HTTPRequest(
        base.replace("http", "ws") + f"{prefix}/kernels/{session['kernel']['id']}/channels",
        headers={"Authorization": f"token {TOKEN}"}, connect_timeout=WS_CONNECT_TIMEOUT,
        request_timeout=WS_CONNECT_TIMEOUT))
    out = {"text": [], "error": None, "cells": 0}
    codes = []
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            codes.append(cell["source"])
            if "parameters" in cell["metadata"].get("tags", []) and OVERRIDES[lab]:
                codes.append(OVERRIDES[lab])
    try:
        for code in codes:
            msg_id = uuid.uuid4().hex
            ws.write_message(json.dumps({
                "header": {"msg_id": msg_id, "username": user, "session": session["id"], "version": "5.3",
                           "msg_type": "execute_request", "date": dt.datetime.now(dt.timezone.utc).isoformat()},
                "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
                "content": {"code": code, "silent": False, "store_history": True, "user_expressions": {},
                            "allow_stdin": False, "stop_on_error": True}}))
            while True:
                raw = await asyncio.wait_for(ws.read_message(), CELL_TIMEOUT)
                assert raw is not None, f"{user}: the kernel's websocket closed during {lab}"
                if isinstance(raw, bytes):
                    continue
                msg = json.loads(raw)
                if msg.get("parent_header", {}).get("msg_id") != msg_id:
                    continue
                kind, content = msg["msg_type"], msg["content"]
                if kind == "stream":
                    out["text"].append(content["text"])
                elif kind in ("execute_result", "display_data"):
                    out["text"].append(content["data"].get("text/plain", ""))
                    out.setdefault("images", 0)
                    out["images"] += "image/png" in content["data"]
                elif kind == "error":
                    out["error"] = f"{content['ename']}: {content['evalue']}"
                elif kind == "status" and content["execution_state"] == "idle":
                    break
            out["cells"] += 1
            if out["error"]:
                break
    finally:
        ws.close()
        await loop.run_in_executor(None, lambda: api(base, f"{prefix}/sessions/{session['id']}", "DELETE"))
    return out


async def learner(base: str, user: str) -> dict:
    return {lab: await run_notebook(base, user, lab) for lab in ("00_environment", "05_llm_serving")}


def test_three_learners_run_lab00_and_lab05_at_once(hub):
    base, checkout, homes = hub
    before = snapshot(checkout)
    for name in LEARNERS:
        api(base, f"/hub/api/users/{name}", "POST")
    with ThreadPoolExecutor(len(LEARNERS)) as pool:   # the room logs in at once
        list(pool.map(lambda n: api(base, f"/hub/api/users/{n}/server", "POST", timeout=120), LEARNERS))
    deadline = time.monotonic() + 180
    while not all(api(base, f"/hub/api/users/{n}")["servers"].get("", {}).get("ready") for n in LEARNERS):
        assert time.monotonic() < deadline, "the learners' servers did not become ready"
        time.sleep(1)
    routes = api(base, "/hub/api/proxy")
    targets = {spec["target"] for path, spec in routes.items() if path.startswith("/user/")}
    assert len(targets) == len(LEARNERS), f"servers share a port: {routes}"

    async def everyone():     # every learner runs to its end: one learner's failure is reported, not the others' cancellation
        return await asyncio.gather(*(learner(base, n) for n in LEARNERS), return_exceptions=True)

    started = time.monotonic()
    results = dict(zip(LEARNERS, asyncio.run(everyone())))
    failed = {name: f"{type(r).__name__}: {r}" for name, r in results.items() if isinstance(r, BaseException)}
    assert not failed, f"learners failed: {failed}"
    seconds = time.monotonic() - started
    running = processes_of(homes)
    (ROOT / "build" / "workshop" / "hub-learners.json").write_text(json.dumps(
        {"seconds": round(seconds, 1), "results": {u: {lab: {"cells": r["cells"], "error": r["error"],
         "tail": "".join(r["text"])[-1500:]} for lab, r in labs.items()} for u, labs in results.items()}}, indent=1))

    server_ports = {}
    for name, labs in results.items():
        for lab, r in labs.items():
            assert r["error"] is None, f"{name}'s {lab} stopped: {r['error']}\n{''.join(r['text'])[-2000:]}"
        assert "NOT DONE: exercise 0.1" in "".join(labs["00_environment"]["text"])   # the labs, unfinished
        assert labs["00_environment"].get("images"), f"{name}'s lab 00 drew no plot"
        build = homes / name / "rocm-cuda-labs" / "build"
        for lab in ("00_environment", "05_llm_serving"):
            sidecar = json.loads((build / "results-work" / f"{lab}.json").read_text())   # work/'s, apart
            assert sidecar["lab"] == lab and sidecar["metrics"], (name, lab)
        assert (build / "cache" / "matplotlib").is_dir() and (build / "logs").is_dir()
        server_ports[name] = set(re.findall(r"127\.0\.0\.1:(\d+)", "".join(labs["05_llm_serving"]["text"])))
    seen = [p for ports in server_ports.values() for p in ports]
    assert len(seen) == len(set(seen)), f"lab 05 servers shared a port: {server_ports}"
    assert snapshot(checkout) == before, "a learner wrote into the shared checkout"
    assert running, "no learner process was found while the servers ran"

    # every learner's server and whatever it started ends with the hub
    for name in LEARNERS:
        api(base, f"/hub/api/users/{name}/server", "DELETE", timeout=60)
    deadline = time.monotonic() + 60
    while processes_of(homes) and time.monotonic() < deadline:
        time.sleep(1)
    assert not processes_of(homes), f"left behind: {processes_of(homes)}"
    ports = {int(t.rsplit(":", 1)[1].rstrip("/")) for t in targets}
    ports |= {int(p) for p in seen}
    assert not ports & listening_ports(), f"ports still listening: {ports & listening_ports()}"
