"""A Llama GGUF's forward pass in NumPy (float32, every weight decoded from its blocks): lab 08's reference backend."""
from __future__ import annotations

import time

import numpy as np

from utils import blocks
from utils.quant.llamacpp import Logits


def forward(model, tokens) -> np.ndarray:
    """The logits (positions x vocabulary, float32) of `tokens` under `model` (a utils.quant.gguffile.GGUFModel of
    the llama architecture), computed as llama.cpp's graph does it but on the decoded weights, with float32
    activations where llama.cpp's CPU backend quantizes them for its dot products: RMSNorm, rotary embeddings on
    adjacent pairs (ggml's ROPE_TYPE_NORM), grouped-query causal attention, a SwiGLU MLP. Each weight is decoded
    when its layer needs it, so at most one layer's weights are held decoded."""
    field = lambda key: model.field(key)
    tensors = {t.name: t for t in model.reader.tensors}

    def weight(name):
        t = tensors[name]
        kind = t.tensor_type.name
        return np.asarray(t.data, np.float32) if kind == "F32" else blocks.decode(t.data, kind)

    n_layers, heads, kv_heads = field("llama.block_count"), field("llama.attention.head_count"), \
        field("llama.attention.head_count_kv")
    eps, base = field("llama.attention.layer_norm_rms_epsilon"), field("llama.rope.freq_base")
    tokens = np.asarray(tokens)
    n = len(tokens)
    embed = tensors["token_embd.weight"]
    x = blocks.decode(embed.data[tokens], embed.tensor_type.name)          # only the rows of these tokens
    d = x.shape[1]
    hd = d // heads
    rms = lambda v, w: v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * w
    angle = np.arange(n)[:, None] * base ** (-np.arange(0, hd, 2) / hd)[None]
    cos, sin = np.cos(angle)[:, None, :].astype(np.float32), np.sin(angle)[:, None, :].astype(np.float32)

    def rope(q):                  # (positions, heads, head_dim): rotate adjacent pairs
        a, b = q[..., 0::2], q[..., 1::2]
        out = np.empty_like(q)
        out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
        return out

    mask = np.triu(np.full((n, n), -np.inf, np.float32), 1)
    for layer in range(n_layers):
        p = f"blk.{layer}."
        h = rms(x, weight(p + "attn_norm.weight"))
        q = rope((h @ weight(p + "attn_q.weight").T).reshape(n, heads, hd))
        k = np.repeat(rope((h @ weight(p + "attn_k.weight").T).reshape(n, kv_heads, hd)), heads // kv_heads, 1)
        v = np.repeat((h @ weight(p + "attn_v.weight").T).reshape(n, kv_heads, hd), heads // kv_heads, 1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        x = x + np.einsum("hqk,khd->qhd", s, v).reshape(n, d) @ weight(p + "attn_output.weight").T
        h = rms(x, weight(p + "ffn_norm.weight"))
        g = h @ weight(p + "ffn_gate.weight").T
        x = x + ((g / (1 + np.exp(-g))) * (h @ weight(p + "ffn_up.weight").T)) @ weight(p + "ffn_down.weight").T
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"     # tied embeddings (SmolLM2)
    return (rms(x, weight("output_norm.weight")) @ weight(head).T).astype(np.float32)


def logits(model, tokens) -> Logits:
    """`forward` as one more backend's view of a text (utils.quant.llamacpp.Logits), timed."""
    start = time.perf_counter()
    out = forward(model, tokens)
    return Logits("numpy", np.asarray(tokens), out, "CPU, NumPy float32", "the course's NumPy forward pass",
                  time.perf_counter() - start)


def chunk_logits(model, chunks) -> np.ndarray:
    """The reference's logits at the positions llama-perplexity scores: for each chunk of n_ctx tokens (evaluated
    alone, as the tool does), positions n_ctx/2 .. n_ctx-2; stacked like `llamacpp.read_kld_base`'s log-probabilities."""
    chunks = np.asarray(chunks)
    first = chunks.shape[1] // 2
    return np.concatenate([forward(model, c)[first:chunks.shape[1] - 1] for c in chunks])
