"""llama.cpp for lab 08: the engines on this machine (the `cyllama` wheel, a source build's tools), logits, benches.

Two ways in, one engine: the `cyllama-vulkan` wheel (llama.cpp built with its CPU and Vulkan backends, driven from
Python; what a CPU machine runs) and a llama.cpp source build's own tools, `llama-bench` and `llama-perplexity`, found
through $COURSE_LLAMA_CPP (what the GPU machine runs: one source build with its CPU, CUDA and Vulkan backends).
Each backend's logits are computed in a process of its own (`python -m utils.quant.llamacpp logits ...`): a
backend that crashes or hangs ends that process, not the notebook's kernel.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

WHEEL = "cyllama-vulkan"
WHEEL_INSTALL = ("pip install cyllama-vulkan==0.2.18 (a Python 3.11 wheel of llama.cpp with its CPU and Vulkan "
                 "backends)")
LAVAPIPE_INSTALL = "sudo apt-get install mesa-vulkan-drivers libvulkan1 (Mesa's lavapipe: Vulkan on the CPU)"
BUILD_VAR = "COURSE_LLAMA_CPP"     # a llama.cpp build's bin/ folder (llama-bench, llama-perplexity)
BUILD_HINT = (f"build llama.cpp from its source as its docs/build.md says (cmake -B build -DGGML_CUDA=ON / -DGGML_HIP=ON "
              f"/ -DGGML_VULKAN=ON, then cmake --build build) and set {BUILD_VAR}=<build>/bin")
VULKAN_LINE = re.compile(r"ggml_vulkan: (\d+) = (.+)")


def quant_size(name: str) -> tuple[int, int]:
    """(weights per block, bytes per block) of a GGUF type, as `gguf` (llama.cpp's own Python package) defines it."""
    import gguf

    return tuple(gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]])


# --- the wheel ---------------------------------------------------------------------------------------------------

def wheel_version() -> str | None:
    """The installed cyllama wheel's version, or None."""
    from importlib import metadata

    for dist in (WHEEL, "cyllama"):
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return None


def wheel_llama_version() -> str | None:
    """The llama.cpp release the wheel was built from ("b9190"): its build_config.json says."""
    import importlib.util

    spec = importlib.util.find_spec("cyllama")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        config = json.loads(Path(spec.submodule_search_locations[0], "build_config.json").read_text())
    except (OSError, ValueError):
        return None
    return (config.get("versions") or {}).get("llama_cpp_version")


def has_vulkan_loader() -> bool:
    """Whether the Vulkan loader (libvulkan.so.1) is on this machine: without it no Vulkan device exists."""
    import ctypes.util

    return bool(ctypes.util.find_library("vulkan")) or any(
        Path(d, "libvulkan.so.1").exists() for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"))


@dataclasses.dataclass
class Logits:
    """One backend's view of a text: the token ids, the logits at every position (tokens x vocabulary), the device
    line llama.cpp printed for it, the llama.cpp build that ran, and the seconds the evaluation took."""
    backend: str
    tokens: np.ndarray
    logits: np.ndarray
    device: str
    build: str
    seconds: float

    def next_token_pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """(logits at positions 0..n-2, the tokens they should predict, 1..n-1)."""
        return self.logits[:-1], self.tokens[1:]


def logits(model: Path, text: str, backend: str = "cpu", *, max_tokens: int = 64, threads: int | None = None,
           timeout: float = 600.0, workdir: Path) -> Logits:
    """Evaluate `text` (its first `max_tokens` tokens) with the wheel's llama.cpp on `backend` ("cpu" or "vulkan",
    the first Vulkan device, lavapipe included) in a process of its own. Raises RuntimeError naming what failed."""
    workdir = Path(workdir)
    out = workdir / f"logits-{backend}.npz"
    out.unlink(missing_ok=True)
    (workdir / "text.txt").write_text(text, encoding="utf-8")
    env = dict(os.environ)
    if backend == "vulkan":
        env.setdefault("GGML_VK_VISIBLE_DEVICES", "0")     # llama.cpp skips CPU-type Vulkan devices (lavapipe) unless named
    cmd = [sys.executable, "-m", "utils.quant.llamacpp", "logits", str(model), str(workdir / "text.txt"), str(out),
           "--backend", backend, "--max-tokens", str(max_tokens), "--threads", str(threads or os.cpu_count() or 1)]
    start = time.perf_counter()
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"llama.cpp's {backend} backend did not finish {max_tokens} tokens in {timeout:g} s") from None
    if run.returncode or not out.exists():
        tail = "\n".join((run.stdout + run.stderr).strip().splitlines()[-6:])
        raise RuntimeError(f"llama.cpp's {backend} backend failed (exit {run.returncode}):\n{tail}")
    data = np.load(out)
    device = (vulkan_line(run.stderr + run.stdout) or "") if backend == "vulkan" else "CPU"
    return Logits(backend, data["tokens"], data["logits"], device, str(data["build"]), time.perf_counter() - start)


def _logits_main(a) -> int:
    """The child process: load the model with the wheel, evaluate every token at once, save every position's logits."""
    import cyllama.llama.llama_cpp as L

    L.ggml_backend_load_all()                   # the CPU and Vulkan backends are loaded here
    mp = L.LlamaModelParams()
    mp.n_gpu_layers = 99 if a.backend == "vulkan" else 0

    class Model(L.LlamaModel):                  # cyllama 0.2.18's get_logits_ith reads model.n_vocab, which it lacks
        n_vocab = 0

    model = Model(a.model, mp)
    vocab = model.get_vocab()
    Model.n_vocab = vocab.n_vocab
    text = Path(a.text).read_text(encoding="utf-8")
    tokens = vocab.tokenize(text, True, False)[: a.max_tokens]
    cp = L.LlamaContextParams()
    cp.n_ctx = cp.n_batch = cp.n_ubatch = max(32, len(tokens))
    cp.n_threads = cp.n_threads_batch = a.threads
    if a.backend == "cpu":
        cp.op_offload = False                   # nothing handed to a Vulkan device behind the CPU backend's back
    ctx = L.LlamaContext(model, cp)
    batch = L.LlamaBatch(n_tokens=len(tokens), embd=0, n_seq_max=1)
    for i, t in enumerate(tokens):
        batch.add(t, i, [0], True)              # logits at every position
    ctx.decode(batch)
    ctx.synchronize()
    out = np.stack([np.asarray(ctx.get_logits_ith(i), dtype=np.float32) for i in range(len(tokens))])
    build = f"llama.cpp {wheel_llama_version() or '?'} ({wheel_version() or 'cyllama'})"
    tmp = Path(a.out).with_suffix(".part.npz")
    np.savez(tmp, tokens=np.asarray(tokens), logits=out, build=build)
    tmp.replace(a.out)
    return 0


# --- a source build's tools --------------------------------------------------------------------------------------

def build_bin() -> Path | None:
    """The folder of a llama.cpp build's tools ($COURSE_LLAMA_CPP), if it holds llama-bench and llama-perplexity."""
    where = os.environ.get(BUILD_VAR)
    if not where:
        return None
    path = Path(where).expanduser()
    return path if (path / "llama-bench").exists() and (path / "llama-perplexity").exists() else None


def tool(bin_dir: Path, name: str, *args: str, timeout: float = 600.0) -> subprocess.CompletedProcess:
    """Run one of the build's tools; its output is returned whatever it exits with."""
    try:
        return subprocess.run([str(Path(bin_dir) / name), *args], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        return subprocess.CompletedProcess(exc.cmd, 124, exc.stdout or "", f"timed out after {timeout:g} s")


def devices(bin_dir: Path) -> list[str]:
    """The devices the build's backends found ("CUDA0: NVIDIA H100 ...", "Vulkan0: ..."): llama-bench --list-devices."""
    run = tool(bin_dir, "llama-bench", "--list-devices", timeout=120)
    return [line.strip() for line in (run.stdout + run.stderr).splitlines()
            if re.match(r"\s*(CUDA|Vulkan|ROCm|HIP|Metal|SYCL)\d+\s*:", line)]


def bench(bin_dir: Path, model: Path, device: str, *, prompt: int = 512, gen: int = 128, reps: int = 3,
          timeout: float = 600.0) -> list[dict]:
    """llama-bench's JSON rows (pp and tg tests, avg_ts, stddev_ts, samples_ts) for `device` ("CPU": no layer
    offloaded; "CUDA0", "Vulkan0": every layer there)."""
    args = ["-m", str(model), "-p", str(prompt), "-n", str(gen), "-r", str(reps), "-o", "json", *_device_args(device)]
    run = tool(bin_dir, "llama-bench", *args, timeout=timeout)
    start = run.stdout.find("[")
    if run.returncode or start < 0:
        raise RuntimeError(f"llama-bench on {device} failed (exit {run.returncode}): {(run.stderr or run.stdout)[-600:]}")
    return json.loads(run.stdout[start:])


def read_kld_base(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What `llama-perplexity --kl-divergence-base FILE` saved: (the chunks' tokens, chunks x n_ctx; the next token
    of each scored position; the log-probabilities, scored positions x vocabulary). It scores the second half of each
    chunk (positions n_ctx/2 .. n_ctx-2 predict the tokens after them). Format (tools/perplexity/perplexity.cpp): "_logits_",
    n_ctx, n_vocab, n_chunk (int32), the chunks' tokens (int32), then per chunk the second half of its positions,
    each as a float32 scale and minimum and n_vocab uint16 steps above the minimum (padded to even, + 4 uint16)."""
    raw = Path(path).read_bytes()
    if raw[:8] != b"_logits_":
        raise ValueError(f"{path}: not a llama-perplexity logits file (no _logits_ magic)")
    n_ctx, n_vocab, n_chunk = np.frombuffer(raw, np.int32, 3, 8)
    tokens = np.frombuffer(raw, np.int32, n_chunk * n_ctx, 20).reshape(n_chunk, n_ctx)
    nv = 2 * ((n_vocab + 1) // 2) + 4
    first = n_ctx // 2
    per_chunk = n_ctx - 1 - first
    rows = np.frombuffer(raw, np.uint16, n_chunk * per_chunk * nv, 20 + 4 * n_chunk * n_ctx).reshape(-1, nv)
    head = rows[:, :4].copy().view(np.float32)                  # scale, minimum
    logp = head[:, 1:2] + head[:, 0:1] * rows[:, 4:4 + n_vocab].astype(np.float32)
    nxt = tokens[:, first + 1:first + 1 + per_chunk].reshape(-1)
    return tokens, nxt, logp


def build_version(bin_dir: Path) -> str:
    """"llama.cpp b7000 (abc1234)": the build's own `--version` line."""
    run = tool(bin_dir, "llama-perplexity", "--version", timeout=60)     # llama-bench has no --version
    text = run.stdout + run.stderr      # "version: 7000 (abc1234)" or, since 2026, "version: ... (build 7000, commit abc1234)"
    m = re.search(r"\(build (\d+), commit ([0-9a-f]+)\)", text) or re.search(r"version: (\d+) \(([0-9a-f]+)\)", text)
    return f"llama.cpp b{m.group(1)} ({m.group(2)})" if m else "llama.cpp (version unknown)"


def _device_args(device: str) -> list[str]:
    return ["-ngl", "0", "-dev", "none"] if device == "CPU" else ["-ngl", "99", "-dev", device]


def perplexity_kld(bin_dir: Path, model: Path, text_file: Path, device: str, save: Path, *, ctx: int = 128,
                   compare_to: Path | None = None, timeout: float = 600.0) -> dict:
    """llama-perplexity on `device`, its log-probabilities saved to `save` (--kl-divergence-base); with `compare_to`,
    first its own KL divergence against that saved reference (--kl-divergence). Returns {"ppl", and with
    compare_to "kld", "same_top"} as the tool printed them."""
    common = ["-m", str(model), "-c", str(ctx), "-b", str(ctx), *_device_args(device)]
    run = tool(bin_dir, "llama-perplexity", *common, "-f", str(text_file), "--kl-divergence-base", str(save),
               timeout=timeout)
    text = run.stdout + run.stderr
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", text)
    if run.returncode or not m:
        raise RuntimeError(f"llama-perplexity on {device} failed (exit {run.returncode}): {text[-600:]}")
    out = {"ppl": float(m.group(1)), "log": text}
    if compare_to is not None:
        run = tool(bin_dir, "llama-perplexity", *common, "--kl-divergence-base", str(compare_to), "--kl-divergence",
                   timeout=timeout)
        text = run.stdout + run.stderr
        kld = re.search(r"Mean\s+KLD:\s+([-0-9.e]+)", text)
        top = re.search(r"Same top p:\s+([0-9.]+)", text)
        if run.returncode or not kld:
            raise RuntimeError(f"llama-perplexity --kl-divergence on {device} failed: {text[-600:]}")
        out.update(kld=float(kld.group(1)), same_top=float(top.group(1)) if top else float("nan"), kld_log=text)
    return out


def kld_logprobs_pair(ref: Path, test: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(reference log-probabilities, tested log-probabilities, next tokens) from two --kl-divergence-base files of
    one text: what `backend_stats` takes (log-probabilities are logits too: log-softmax leaves them unchanged)."""
    _, tok_r, lp_r = read_kld_base(ref)
    _, tok_t, lp_t = read_kld_base(test)
    if not np.array_equal(tok_r, tok_t):
        raise ValueError(f"{ref.name} and {test.name} scored different tokens: not the same text and context")
    return lp_r, lp_t, tok_r


def vulkan_line(text: str) -> str | None:
    """The first "ggml_vulkan: 0 = <device> | uma | fp16 | ... | matrix cores: ..." line llama.cpp printed."""
    m = VULKAN_LINE.search(text or "")
    return m.group(2).strip() if m else None


def vulkan_lines(bin_dir: Path) -> list[str]:
    """Every Vulkan device line the build prints (from llama-bench --list-devices, which initializes the backends)."""
    run = tool(bin_dir, "llama-bench", "--list-devices", timeout=120)
    return [m.group(2).strip() for m in VULKAN_LINE.finditer(run.stdout + run.stderr)]


def vulkan_fields(line: str) -> dict[str, str]:
    """{"uma": "0", "fp16": "1", "warp size": "32", "matrix cores": "KHR_coopmat", ...} of a Vulkan device line."""
    return {k.strip(): v.strip() for k, _, v in (part.partition(":") for part in line.split("|")[1:]) if v}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m utils.quant.llamacpp", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    lg = sub.add_parser("logits", help="every position's logits of a text, with the wheel's llama.cpp (a child process)")
    lg.add_argument("model")
    lg.add_argument("text")
    lg.add_argument("out")
    lg.add_argument("--backend", choices=("cpu", "vulkan"), default="cpu")
    lg.add_argument("--max-tokens", type=int, default=64)
    lg.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    return _logits_main(a)


if __name__ == "__main__":
    sys.exit(main())
