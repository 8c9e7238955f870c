"""Lab 06: busbw formulas, topology parsing (NVIDIA and AMD fixtures), the tensor-parallel split against
transformers (ranks as threads, then real ranks), the launcher (failure, hang, kill, no listener off the loopback
interface, two "nodes" under torchrun, nothing left behind) and the graders of exercises 6.1-6.4 (utils/graders/lab06.py)."""
import json
import os
import re
import shutil
import stat
import subprocess
import textwrap
import threading
import time

import psutil
import pytest
import torch

from conftest import DATA
from grading import errors, grades_afresh, run_lab_with, stream_text
from utils import solutions
from utils.base import processes
from utils.multigpu import attribution, collectives, comm, launch, netns, oneshot, topology, tp
from utils.exercises import ExerciseFailed
from utils.graders import lab06 as graders

TOPO = DATA / "topology"
LAB = "06_multi_gpu"


# --- formulas --------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 16])
def test_bus_factors_are_nccl_tests(n):
    assert collectives.bus_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
    for name in ("all_gather", "reduce_scatter", "all_to_all"):
        assert collectives.bus_factor(name, n) == pytest.approx((n - 1) / n)
    assert collectives.bus_factor("broadcast", n) == 1.0


def test_bus_bandwidth_from_a_measurement():
    # 1 GiB all-reduced on 2 ranks in 6.5 ms: algbw 165 GB/s, busbw the same (factor 1 on 2 ranks)
    assert collectives.algbw_gbps(1 << 30, 6.5e-3) == pytest.approx(165.19, rel=1e-4)
    assert collectives.busbw_gbps("all_reduce", 1 << 30, 6.5e-3, 8) == pytest.approx(165.19 * 1.75, rel=1e-4)
    assert collectives.busbw_gbps("all_gather", 1 << 30, 6.5e-3, 8) == pytest.approx(165.19 * 0.875, rel=1e-4)
    with pytest.raises(ValueError, match="unknown collective 'gather'"):
        collectives.bus_factor("gather", 2)
    with pytest.raises(ValueError, match="n=0"):
        collectives.bus_factor("all_reduce", 0)


def test_element_counts_split_evenly_as_nccl_tests_does():
    assert collectives.element_count("all_reduce", 1024, 3) == 256
    assert collectives.element_count("all_gather", 1024, 3) == 255          # a multiple of 3
    assert collectives.element_count("reduce_scatter", 8, 8) == 8           # at least one per rank
    assert collectives.element_count("all_reduce", 2, 2) == 1


def test_half_bandwidth_size():
    # 20 us latency, 330 GB/s busbw, all_reduce on 2 ranks (factor 1): 6.6 MB
    assert collectives.half_bandwidth_bytes(20e-6, 330, "all_reduce", 2) == pytest.approx(6.6e6)


# --- topology ------------------------------------------------------------------------------------------

def test_nvidia_smi_2x_h200_nv18():
    t = topology.example("2x H200 (nvidia-smi)")
    assert (t.tool, t.gpus, t.pairs()) == ("nvidia-smi topo -m", ["GPU0", "GPU1"], [(0, 1, "NV18")])
    assert t.affinity[1] == {"CPU Affinity": "0-47", "NUMA Affinity": "0", "GPU NUMA ID": "N/A"}
    assert topology.link_kind("NV18") == ("NVLink", 18)
    assert topology.pair_peak_gbps("NV18", topology.link_spec("h200")) == 450


def test_nvidia_smi_8x_h100_with_nics_and_terminal_escapes():
    text = (TOPO / "nvidia-smi-8xh100-nics.txt").read_text()
    assert "\x1b[4m" in text                      # underlined header, as on a terminal
    t = topology.parse(text)
    assert len(t.gpus) == 8 and len(t.pairs()) == 28 and {lab for _, _, lab in t.pairs()} == {"NV18"}
    assert t.nics == ["NIC0 (mlx5_0)", "NIC1 (mlx5_1)", "NIC2 (mlx5_2)", "NIC3 (mlx5_3)"]
    assert t.affinity[5]["CPU Affinity"] == "56-111,168-223" and t.affinity[5]["NUMA Affinity"] == "1"


def test_nvidia_smi_pcie_only_with_an_empty_affinity_cell():
    t = topology.parse((TOPO / "nvidia-smi-2gpu-pcie.txt").read_text())
    assert t.pairs() == [(0, 1, "SYS")] and topology.link_kind("SYS") == ("PCIe", None)
    assert t.affinity[1] == {"CPU Affinity": "", "NUMA Affinity": "1", "GPU NUMA ID": "N/A"}
    assert "NUMA nodes" in topology.meaning("SYS")


@pytest.mark.parametrize("name, tool", [("8x MI300X (amd-smi)", "amd-smi topology"),
                                        ("8x MI300X (rocm-smi)", "rocm-smi --showtopo")])
def test_amd_mi300x_fixtures_are_an_xgmi_mesh(name, tool):
    t = topology.example(name)
    assert t.tool == tool and len(t.gpus) == 8
    assert {lab for _, _, lab in t.pairs()} == {"XGMI"} and len(t.pairs()) == 28
    assert set(t.tables["hops"].values()) == {"1"} and set(t.tables["weight"].values()) == {"15"}
    assert "public documentation" in topology.EXAMPLES[name][2]


def test_amd_pcie_fixtures():
    a = topology.parse((TOPO / "amd-smi-2gpu-pcie.txt").read_text())
    assert a.gpus == ["0000:03:00.0", "0000:0c:00.0"] and a.pairs() == [(0, 1, "PCIE")]
    assert a.tables["access"][(0, 1)] == "DISABLED"
    r = topology.parse((TOPO / "rocm-smi-4gpu-pcie.txt").read_text())
    assert len(r.pairs()) == 6 and set(r.tables["hops"].values()) == {"3"}
    assert r.affinity[2] == {"Numa Node": "2", "Numa Affinity": "2"}


def _broken(text, old, new):
    assert old in text
    return text.replace(old, new, 1)


@pytest.mark.parametrize("make, message", [
    (lambda: "hello\nworld\n", "not the output of"),
    (lambda: _broken((topology.EXAMPLES_DIR / "nvidia-smi-2xh200.txt").read_text(), "GPU1\tNV18\t X \t", "GPU2\tNV18\t X \t"),
     "no row for GPU1"),
    (lambda: _broken((topology.EXAMPLES_DIR / "nvidia-smi-2xh200.txt").read_text(), "GPU0\t X \t", "GPU0\tNV18\t"),
     "GPU0 to itself is 'NV18'"),
    (lambda: _broken((topology.EXAMPLES_DIR / "nvidia-smi-2xh200.txt").read_text(), "GPU1\tNV18\t X \t0-47\t0\t\tN/A", "GPU1\tNV18"),
     "GPU1 has 1 columns, the header 2 devices"),
    (lambda: _broken((topology.EXAMPLES_DIR / "amd-smi-8xmi300x.txt").read_text(), "SELF         XGMI", "XGMI"),
     "has 7 values for 8 columns"),
    (lambda: _broken((topology.EXAMPLES_DIR / "rocm-smi-8xmi300x.txt").read_text(), "Link Type between", "Link Kind between"),
     "no 'Link Type between two GPUs' table"),
])
def test_malformed_outputs_are_refused_with_where(make, message):
    with pytest.raises(topology.TopologyError, match=message):
        topology.parse(make())


def _fake_tool(tmp_path, name, text, code=0):
    tool = tmp_path / name
    (tmp_path / f"{name}.txt").write_text(text)
    tool.write_text(f"#!/bin/sh\n/bin/cat {tmp_path / (name + '.txt')}\nexit {code}\n")
    tool.chmod(0o755)


def test_read_runs_the_tool_and_trusts_its_output_not_its_status(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert topology.read() == (None, "none of nvidia-smi, amd-smi, rocm-smi is installed")
    _fake_tool(tmp_path, "rocm-smi", "ERROR: No AMD GPUs specified\n", code=0)   # rocm-smi without a GPU
    found, how = topology.read()
    assert found is None and "rocm-smi --showtopo" in how and "not the output of" in how
    _fake_tool(tmp_path, "nvidia-smi", (topology.EXAMPLES_DIR / "nvidia-smi-2xh200.txt").read_text())
    found, how = topology.read()
    assert how == "nvidia-smi topo -m" and found.pairs() == [(0, 1, "NV18")]


def test_peaks_switch_and_mesh():
    h200, mi300x = topology.link_spec("h200"), topology.link_spec("mi300x")
    assert [topology.peak_busbw_gbps(h200, n) for n in (2, 4, 8)] == [450, 450, 450]
    assert [topology.peak_busbw_gbps(mi300x, n) for n in (2, 4, 8)] == [64, 192, 448]
    assert topology.peak_busbw_gbps(h200, 1) is None and topology.link_spec("rtx4090") is None
    assert topology.pair_peak_gbps("XGMI", mi300x) == 64 and topology.pair_peak_gbps("PIX", h200) == 64


@pytest.mark.parametrize("key, both_ways", [("h100_sxm", 900), ("h200", 900), ("a100_80gb", 600),
                                            ("mi300x", 896), ("mi325x", 896)])
def test_link_fields_add_up_to_the_data_sheets(key, both_ways):
    s = topology.link_spec(key)
    assert s["link_count"] * s["link_gbps"] * 2 == both_ways
    assert s["link_fabric"] in ("switch", "mesh")


# --- the tensor-parallel split ------------------------------------------------------------------------

class ThreadRanks:
    """`world` ranks as threads of this process; sums and gathers through a barrier (no torch.distributed).
    `broken` makes a wrong communication: "no-reduce" (each rank keeps its partial sum), "gather-order"."""

    def __init__(self, world, broken=None):
        self.world, self.broken = world, broken
        self.barrier, self.slots = threading.Barrier(world), [None] * world

    def comm(self, rank):
        ranks = self

        class Comm:
            def all_reduce(self, x):
                if ranks.broken == "no-reduce":
                    return x
                return ranks._exchange(rank, x, lambda xs: sum(xs[1:], xs[0].clone()))

            def all_gather(self, x):
                order = reversed if ranks.broken == "gather-order" else list
                return ranks._exchange(rank, x, lambda xs: torch.cat(list(order(xs)), 0))

        return Comm()

    def _exchange(self, rank, x, combine):
        self.slots[rank] = x
        self.barrier.wait(timeout=60)
        out = combine(list(self.slots))
        self.barrier.wait(timeout=60)
        return out

    def logits(self, model_dir, tokens, dtype=torch.float32, **kw):
        models = [tp.TPLlama(model_dir, rank=r, world=self.world, comm=self.comm(r), dtype=dtype, max_len=32, **kw)
                  for r in range(self.world)]
        out = [None] * self.world

        def run(r):
            out[r] = tp.teacher_forced_logits(models[r], models[r].decode_step, tokens)

        threads = [threading.Thread(target=run, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out


TOKENS = [3, 17, 99, 400, 5, 511, 0, 42]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny Llama saved in FP32 and BF16, with transformers' logits for TOKENS (one forward pass)."""
    from transformers import AutoModelForCausalLM

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        folder = tp.save_random_model("tiny", tmp_path_factory.mktemp(str(dtype)[6:]), dtype=dtype)
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        out[dtype] = (folder, tp.hf_reference_logits(hf, TOKENS))
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_split_matches_transformers_in_fp32(tiny, world):
    folder, reference = tiny[torch.float32]
    logits = ThreadRanks(world).logits(folder, TOKENS) if world > 1 else [
        tp.teacher_forced_logits(m, m.decode_step, TOKENS) for m in [tp.TPLlama(folder, max_len=32)]]
    assert all(torch.equal(x, logits[0]) for x in logits)          # every rank has the same logits
    assert tp.compare(logits[0], reference) <= tp.tolerance(torch.float32)


@pytest.mark.parametrize("batch, fuse", [(3, True), (2, False)])
def test_a_batch_and_separate_products_give_the_same_logits(tiny, batch, fuse):
    folder, reference = tiny[torch.float32]
    logits = ThreadRanks(2).logits(folder, TOKENS, batch=batch, fuse=fuse)
    assert tp.compare(logits[1], reference) <= tp.tolerance(torch.float32)
    model = tp.TPLlama(folder, max_len=32)
    model.set_batch(batch)                              # new caches and buffers, the same weights
    assert model.layers[0].k_cache.shape[0] == batch and model.logits.shape[0] == batch
    step = lambda: model.decode_step()                  # noqa: E731
    assert tp.compare(tp.teacher_forced_logits(model, step, TOKENS), reference) <= tp.tolerance(torch.float32)
    rate = tp.decode_rate(model, step, 3, start=len(TOKENS), rounds=3, warmup=1)
    assert rate["tokens_per_s"] == pytest.approx(batch * 1e3 / rate["step_ms"]) and len(rate["samples_ms"]) == 3
    with pytest.raises(ValueError, match="batch=0"):
        model.set_batch(0)


def test_split_matches_transformers_in_bf16(tiny):
    folder, reference = tiny[torch.bfloat16]
    logits = ThreadRanks(2).logits(folder, TOKENS, dtype=torch.bfloat16)
    assert tp.compare(logits[1], reference) <= tp.tolerance(torch.bfloat16)


@pytest.mark.parametrize("broken", ["no-reduce", "gather-order"])
def test_a_wrong_communication_fails_the_check(tiny, broken):
    folder, reference = tiny[torch.float32]
    logits = ThreadRanks(2, broken).logits(folder, TOKENS)
    assert tp.compare(logits[0], reference) > 100 * tp.tolerance(torch.float32)


def test_split_refuses_what_does_not_divide(tiny):
    folder, _ = tiny[torch.float32]
    with pytest.raises(ValueError, match="num_attention_heads=8 does not split over 3 ranks"):
        tp.TPLlama(folder, rank=0, world=3, comm=object())
    with pytest.raises(ValueError, match=r"cannot be compared"):
        tp.compare(torch.zeros(2, 3), torch.zeros(3, 2))
    assert tp.tolerance(torch.bfloat16, noise=0.03) == pytest.approx(0.09)


def test_each_ranks_mlp_partial_is_the_learners_split(tiny):
    """tp.mlp_partial (the shard TPLlama reads, the MLP it runs) equals lab 06's column- and row-parallel answers
    rank by rank, and the partial sums add up to the whole MLP: the check the notebook runs against the ranks."""
    from safetensors import safe_open

    folder, _ = tiny[torch.float32]
    ref = load()
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        wg, wu, wd = (f.get_tensor(f"model.layers.1.mlp.{m}_proj.weight").double() for m in ("gate", "up", "down"))
    x = torch.randn(3, wg.shape[1], generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    F = torch.nn.functional
    whole = F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)
    for world in (1, 2, 4):
        course = [tp.mlp_partial(folder, 1, x, rank=r, world=world) for r in range(world)]
        mine = [ref.row_parallel_linear(F.silu(ref.column_parallel_linear(x, wg, r, world))
                                        * ref.column_parallel_linear(x, wu, r, world), wd, r, world) for r in range(world)]
        assert all(torch.allclose(a, b, rtol=1e-12, atol=1e-12) for a, b in zip(course, mine))
        assert torch.allclose(sum(course), whole, rtol=1e-10, atol=1e-10)


def test_graph_mode_needs_a_gpu(tiny):
    model = tp.TPLlama(tiny[torch.float32][0], max_len=16)
    with pytest.raises(RuntimeError, match="graph mode needs a GPU"):
        tp.make_step(model, "graph")
    with pytest.raises(ValueError, match="mode='fast'"):
        tp.make_step(model, "fast")


def test_dtensor_plans_are_the_split_by_hand(tiny):
    """parallelize_module's plan: column-parallel q/k/v and gate/up, row-parallel o_proj and down_proj (TPLlama's
    split), the output layer split by vocabulary and gathered, unless it shares the embedding's weight."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    cfg = tp.model_config("tiny")
    layer, top = tp.dtensor_plans(cfg)
    assert {k for k, v in layer.items() if type(v) is ColwiseParallel} == {
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"}
    assert {k for k, v in layer.items() if type(v) is RowwiseParallel} == {"self_attn.o_proj", "mlp.down_proj"}
    assert layer["self_attn.o_proj"].output_layouts == (Replicate(),)           # the all-reduce
    assert layer["self_attn.q_proj"].output_layouts == (Shard(-1),)             # no communication
    assert list(top) == ["lm_head"] and top["lm_head"].output_layouts == (Replicate(),)   # the all-gather
    assert tp.dtensor_plans(tp.model_config("tiny", tie_word_embeddings=True))[1] == {}
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny[torch.float32][0])
    names = {n for n, _ in hf.named_modules()}
    assert all(f"model.layers.0.{k}" in names for k in layer) and "lm_head" in names   # the plan names real modules


def test_profiler_names_of_collectives():
    assert attribution.collective_name("nccl:all_reduce") == "all_reduce"
    assert attribution.collective_name("gloo:all_gather") == "all_gather"
    assert attribution.collective_name("nccl:_reduce_scatter_base") == "reduce_scatter"
    assert attribution.collective_name("course::one_shot_all_reduce") == "all_reduce"
    assert attribution.collective_name("aten::mm") is None
    assert attribution.collective_kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)") \
        == "all_reduce"
    assert attribution.collective_kernel("ncclDevKernel_AllGather_RING_LL(x)") == "all_gather"
    assert attribution.collective_kernel(
        "void (anonymous namespace)::one_shot_all_reduce_kernel<c10::BFloat16, 16, 2>(c10::BFloat16**, ...)") == "all_reduce"
    # torch.compile names its kernels after what they fuse: an add fed by the all-reduce is compute, not communication
    assert attribution.collective_kernel("triton_red_fused_mm_one_shot_all_reduce_t_view_5") is None
    assert attribution.collective_kernel("nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT") is None
    for name, kind in (("nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT", "matrix products"),
                       ("triton_red_fused__to_copy_add_mean_mm_mul_pow_rsqrt_t_7", "matrix products"),
                       ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16", "attention"),
                       ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "other")):
        assert attribution.compute_kind(name) == kind, name


class Event:
    """A row of torch.profiler's key_averages(), with the fields attribution.split reads."""

    def __init__(self, key, count, device, *, annotation=False, device_us=0.0, cpu_us=0.0):
        from torch.autograd import DeviceType

        self.key, self.count, self.is_user_annotation = key, count, annotation
        self.device_type = DeviceType.CPU if device == "cpu" else DeviceType.CUDA
        self.self_device_time_total, self.cpu_time_total = device_us, cpu_us


def eager_events(steps, layers=32):
    """What torch.profiler recorded for `steps` eager steps of the split on a GPU: each collective as a host operation
    AND as a GPU user annotation of the same name (the shape that once counted 128 all-reduces for 64), besides its
    NCCL kernel."""
    ar, ag = 2 * layers * steps, steps
    return [Event("nccl:all_reduce", ar, "cpu", cpu_us=40.0 * ar), Event("nccl:all_gather", ag, "cpu"),
            Event("nccl:all_reduce", ar, "cuda", annotation=True, device_us=9.0 * ar),
            Event("nccl:all_gather", ag, "cuda", annotation=True, device_us=12.0 * ag),
            Event("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(x)", ar, "cuda", device_us=7.0 * ar),
            Event("ncclDevKernel_AllGather_RING_LL(x)", ag, "cuda", device_us=10.0 * ag),
            Event("nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT", 4 * layers * steps, "cuda", device_us=20.0 * layers * steps),
            Event("triton_red_fused_add_one_shot_all_reduce_3", layers * steps, "cuda", device_us=2.0 * layers * steps),
            Event("aten::mm", 4 * layers * steps, "cpu", cpu_us=5.0)]


def test_a_collective_is_counted_once_though_the_profiler_records_it_twice():
    steps = 4
    out = attribution.split(eager_events(steps), steps, wall_s=steps * 5e-3, gpu=True)
    assert out["counts"] == {"all_reduce": 64, "all_gather": 1}               # not 128 / 2
    assert out["kernel_counts"] == {"all_reduce": 64, "all_gather": 1}
    assert out["comm_ms"] == pytest.approx((64 * 7 + 10) / 1e3)              # kernels only, never the annotations
    assert out["compute_ms"] == pytest.approx((32 * 20 + 32 * 2) / 1e3)
    assert out["compute_by_kind"]["matrix products"] == pytest.approx(32 * 20 / 1e3)
    assert out["kernels"] == 64 + 1 + 128 + 32
    assert out["idle_ms"] == pytest.approx(5.0 - out["comm_ms"] - out["compute_ms"])
    # a replayed graph launches no host operation: its collectives are its kernels
    graph = [e for e in eager_events(steps) if e.device_type != Event("x", 1, "cpu").device_type
             and not e.is_user_annotation]
    out = attribution.split(graph, steps, wall_s=steps * 4e-3, gpu=True, step_ms=3.5)
    assert out["counts"] == {} and out["kernel_counts"] == {"all_reduce": 64, "all_gather": 1}
    assert out["wall_ms"] == 3.5
    # gloo on a CPU: host operations only, their time is the communication
    cpu = [Event("gloo:all_reduce", 8, "cpu", cpu_us=800.0), Event("gloo:all_gather", 2, "cpu", cpu_us=100.0)]
    out = attribution.split(cpu, 2, wall_s=2e-3, gpu=False)
    assert out["counts"] == {"all_reduce": 4, "all_gather": 1} and out["comm_ms"] == pytest.approx(0.45)
    assert out["compute_ms"] == pytest.approx(0.55)


def test_variants_presets_and_ranks():
    v = tp.Variant.parse("graph+symm+tuned")
    assert (v.mode, v.fuse, v.comm, v.tune, v.name) == ("graph", True, "symm", True, "graph+symm+tuned")
    assert tp.Variant.parse("graph+tuned+symm").name == "graph+symm+tuned"
    assert tp.Variant.parse("eager+unfused").fuse is False
    for bad, words in (("fast", "mode must be one of"), ("graph+turbo", "unknown"), ("eager+tuned", "graph mode only")):
        with pytest.raises(ValueError, match=words):
            tp.Variant.parse(bad)
    assert all(tp.Variant.parse(v).name == v for preset in tp.PRESETS.values() for v in preset)
    assert tp.one_gpu_variants(tp.PRESETS["ladder"]) == ["eager", "graph", "graph+tuned"]
    assert tp.Variant.parse("graph+arnorm+tuned").comm == "arnorm"
    with pytest.raises(ValueError, match="choose one all-reduce"):
        tp.Variant.parse("graph+symm+arnorm")
    cfg = tp.model_config("llama-3.1-8b")
    assert [tp.ranks_for(cfg, n)[0] for n in (1, 2, 3, 4, 5, 8)] == [1, 2, 2, 4, 4, 8]
    assert tp.ranks_for(cfg, 4)[1] is None and "num_key_value_heads=8" in tp.ranks_for(cfg, 3)[1]


def test_symmetric_memory_says_why_it_cannot_run_here():
    assert "needs GPUs" in comm.symm_skip_reason("cpu")
    with pytest.raises(RuntimeError, match="needs GPUs"):
        comm.SymmMemCollectives(object(), numel=8, dtype=torch.float32, device="cpu")
    with pytest.raises(RuntimeError, match="needs GPUs"):
        comm.OneShotNormCollectives(object(), rows=1, hidden=8, dtype=torch.float32, device="cpu")
    assert oneshot.layout(16, 4096, torch.bfloat16, 4) == (2 * 16 * 4096 * 2 + 4 * 16 * 4, 2 * 16 * 4096 * 2 // 4)


@pytest.mark.parametrize("world, rows", [(2, 3), (4, 1)])
def test_one_shot_all_reduce_add_rms_norm_kernel(world, rows):
    """The course's fused kernel (utils.multigpu.oneshot), rank by rank in one process (Triton's interpreter on a
    CPU; the peers' buffers and flags set as if they had arrived first): every rank gets the same bits, within BF16
    rounding of all-reduce + add + RMSNorm, counts the barrier and announces it in every peer's flags."""
    g = torch.Generator().manual_seed(0)
    D, slot, dt = 96, 1, torch.bfloat16                # D not a power of two: the masked tail
    xs = [torch.randn(rows, D, generator=g).to(dt) for _ in range(world)]
    residual, weight = torch.randn(rows, D, generator=g).to(dt), torch.randn(D, generator=g).to(dt)
    want_h = residual.float() + sum(x.float() for x in xs)
    want_y = tp.rms_norm(want_h, weight.float(), 1e-5)
    outs = []
    size, flags_at = oneshot.layout(rows, D, dt, world)
    for rank in range(world):
        raws = [torch.zeros(size, dtype=torch.uint8) for _ in range(world)]
        data = [r[: 4 * flags_at].view(dt) for r in raws]
        flags = [r[4 * flags_at:].view(torch.int32).view(rows, world) for r in raws]
        epochs = torch.full((rows,), 6, dtype=torch.int32)       # six barriers behind it
        off = slot * rows * D
        for r in range(world):
            if r != rank:
                data[r][off:off + rows * D] = xs[r].flatten()
                flags[rank][:, r] = 7                           # peer r has reached barrier 7
        table = torch.tensor([t.data_ptr() for t in raws], dtype=torch.int64)
        h, y = oneshot.launch(xs[rank], residual, weight, 1e-5, buffer_ptrs=table.data_ptr(), flags_at=flags_at,
                              epochs=epochs, rank=rank, world=world, slot_offset=off)
        assert torch.equal(data[rank][off:off + rows * D], xs[rank].flatten())     # its own partial, in its slot
        assert epochs.eq(7).all()                                               # barrier 7, every row
        for r in range(world):
            assert flags[r][:, rank].eq(7 if r != rank else 0).all()            # announced at every peer
        outs.append((h, y))
    assert all(torch.equal(h, outs[0][0]) and torch.equal(y, outs[0][1]) for h, y in outs)
    assert tp.compare(outs[0][0], want_h) <= 1e-2 and tp.compare(outs[0][1], want_y) <= 2e-2


def test_the_fused_all_reduce_is_called_with_alternating_slots(tiny):
    """TPLlama hands a communication object that has `all_reduce_add_norm` each all-reduce with the add and norm
    after it, its two calls per layer in slots 0 then 1 (the one-shot kernel's buffer reuse rests on it); the
    logits are those of the plain all-reduce."""
    folder, reference = tiny[torch.float32]
    ranks = ThreadRanks(2)
    slots, plain = {0: [], 1: []}, ranks.comm

    def fused(rank):
        base = plain(rank)

        class Fused:
            all_gather = base.all_gather

            def all_reduce_add_norm(self, x, residual, weight, eps, slot):
                slots[rank].append(slot)
                h = residual + base.all_reduce(x)
                return h, tp.rms_norm(h, weight, eps)

        return Fused()

    ranks.comm = fused
    logits = ranks.logits(folder, TOKENS)
    assert tp.compare(logits[0], reference) <= tp.tolerance(torch.float32)
    calls = len(TOKENS) * 2 * tp.TINY["num_hidden_layers"]
    assert slots[0] == slots[1] == [0, 1] * (calls // 2)


# --- the launcher -----------------------------------------------------------------------------------------

def nothing_left(run):
    """No process of the run (found by its groups, and by the nonce in every rank's environment), no listener
    on its rendezvous port (torchrun's) and no file store left (one machine's)."""
    assert run.gone()
    assert launch.processes_with_nonce(run.nonces) == []
    assert run.port is None or not launch.port_listening(run.port)
    assert run.store is None or not run.store.parent.exists()
    assert not any(processes.group_alive(g) for g in run.pgids)
    assert list(processes.records_dir().glob("*.json")) == []      # the course's records of them are gone too


@pytest.fixture
def scripts(tmp_path):
    """A folder of tiny rank programs (no torch but in sleepy_rank, which joins a gloo group: they start fast), on
    the ranks' PYTHONPATH."""
    (tmp_path / "hang_rank.py").write_text("import time\ntime.sleep(600)\n")
    (tmp_path / "sleepy_rank.py").write_text(textwrap.dedent("""
        import json, os, sys, time
        from pathlib import Path
        import torch.distributed as dist
        from utils.multigpu import collectives
        collectives.init("gloo", timeout_s=60)
        dist.barrier()
        names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_ERROR_FILE",
                 "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NCCL_NVLS_ENABLE", "MASTER_PORT")
        out = Path(sys.argv[sys.argv.index("--out") + 1])
        (out / f"ready-{dist.get_rank()}.json").write_text(json.dumps({n: os.environ.get(n) for n in names}))
        print(f"rank {dist.get_rank()} of {dist.get_world_size()} joined", flush=True)
        time.sleep(2)
        dist.barrier()
        dist.destroy_process_group()
    """))
    (tmp_path / "waiting_rank.py").write_text(textwrap.dedent("""
        import json, os, time
        from pathlib import Path
        import torch.distributed as dist
        from utils.multigpu import collectives
        collectives.init("gloo", timeout_s=120)
        dist.barrier()
        ready = Path(os.environ["READY_DIR"])
        names = ("RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")
        (ready / f"ready-{dist.get_rank()}.json").write_text(json.dumps({n: os.environ.get(n) for n in names}))
        deadline = time.monotonic() + 150
        while not (ready / "go").exists() and time.monotonic() < deadline:   # until the test has looked
            time.sleep(0.1)
        dist.barrier()
        dist.destroy_process_group()
    """))
    (tmp_path / "killed_rank.py").write_text(textwrap.dedent("""
        import os, signal, time
        if os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(600)
    """))
    return {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def test_a_failing_variant_keeps_what_was_measured_before_it(tiny, build_dir):
    folder, _ = tiny[torch.float32]
    res, run, failed = tp.launch_split(folder, TOKENS, nproc=2, decode=2, variants=["eager", "eager+warp"],
                                       timeout=120, name="test-partial")
    assert isinstance(failed, launch.RankFailed) and "unknown ['warp']" in str(failed)
    assert res["partial"] and res["hand"]["batches"]["1"]["eager"]["tokens_per_s"] > 0
    nothing_left(run)


def test_libraries_collectives_per_token_are_all_counted_on_a_cpu(tiny, build_dir):
    """Two CPU ranks (gloo): DTensor's decode step counts its lm_head all-gather as the GPUs do (2 x layers
    all-reduces, one all-gather). Its functional collectives are waited on lazily and gloo ends each profiler event
    on its own thread: the profiler used to stop with the all-gather still running, miss it, and race its end
    (a rank once died of SIGSEGV in the profiler's __exit__)."""
    folder, _ = tiny[torch.float32]
    res, run, failed = tp.launch_split(folder, TOKENS, nproc=2, decode=2, variants=["eager"], dtensor=True,
                                       timeout=300, name="test-dtensor-cpu")
    assert failed is None, failed
    assert res["dtensor"]["counts"] == {"all_reduce": 4, "all_gather": 1}
    nothing_left(run)


def test_a_failing_rank_ends_the_group_and_shows_its_traceback(build_dir):
    with pytest.raises(launch.RankFailed) as err:
        launch.torchrun("utils.multigpu.collectives", ["--sizes", "1024", "--fail-rank", "1", "--backend", "gloo"],
                        nproc=2, timeout=240, name="test-fail")
    e = err.value
    assert e.rank == 1 and e.error.startswith("ValueError: rank 1 fails on purpose")
    assert 'raise ValueError(f"rank {rank} fails on purpose' in e.traceback
    lines = e._render_traceback_()
    assert lines[0].startswith("RankFailed: rank 1 of the run 'test-fail' failed") and "--- traceback of rank 1 ---" in lines
    nothing_left(e.run)


def test_a_hanging_rank_is_ended_at_the_time_limit(build_dir, scripts):
    with pytest.raises(launch.RankTimeout, match="did not finish in 8 s; every rank was ended") as err:
        launch.torchrun("hang_rank", [], nproc=2, timeout=8, name="test-hang", env=scripts)
    nothing_left(err.value.run)


def test_a_killed_rank_without_an_error_file(build_dir, scripts):
    with pytest.raises(launch.RankFailed, match="no rank left an error file") as err:
        launch.torchrun("killed_rank", [], nproc=2, timeout=120, name="test-killed", env=scripts)
    assert "Signal 9" in str(err.value) or "SIGKILL" in str(err.value) or "exitcode" in str(err.value)
    nothing_left(err.value.run)


def _listeners(pids):
    """(address, pid) of the TCP sockets listening in processes `pids`: psutil's view of each process, and where
    iproute2's `ss` is installed, what `ss -ltnpH` shows of them too (the same sockets, seen from outside)."""
    seen = {(f"[{c.laddr.ip}]" if ":" in c.laddr.ip else c.laddr.ip) + f":{c.laddr.port}"
            for pid in pids for c in psutil.Process(pid).net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
    found = [(address, None) for address in sorted(seen)]
    if shutil.which("ss") is None:
        print("`ss` (iproute2) is not installed: the listening sockets were read through psutil only")
        return found
    for line in subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout.splitlines():
        found += [(line.split()[3], pid) for pid in map(int, re.findall(r"pid=(\d+)", line)) if pid in pids]
    return found


def test_one_machine_ranks_listen_on_no_network_address(build_dir, scripts):
    """While two gloo ranks run (started by the course, no torchrun), every socket they listen on is on the
    loopback interface: the rendezvous is a file store in a 0700 folder, removed afterwards."""
    with launch.start_ranks("sleepy_rank", [], nproc=2, name="test-listen", env=scripts) as ranks:
        run = ranks.run
        assert stat.S_IMODE(run.store.parent.stat().st_mode) == 0o700
        assert stat.S_IMODE(run.store.parent.parent.stat().st_mode) == 0o700
        ready = [run.out_dir / f"ready-{r}.json" for r in range(2)]
        deadline = time.monotonic() + 90
        while not all(p.exists() for p in ready) and time.monotonic() < deadline and None in ranks.poll():
            time.sleep(0.1)
        assert all(p.exists() for p in ready), launch.processes_log_tail(run.log)
        pids = set(launch.processes_with_nonce(run.nonces))
        assert len(pids) >= 4                                  # a guard and a rank per rank
        listening = _listeners(pids)
        assert listening, "gloo's ranks listen for their peers (on the loopback interface)"
        off_loopback = [(a, p) for a, p in listening if not a.startswith(("127.0.0.1:", "[::1]:"))]
        assert off_loopback == [], f"listening off the loopback interface: {off_loopback}"
        run = ranks.wait(timeout=120)
    envs = [json.loads(p.read_text()) for p in ready]
    for r, e in enumerate(envs):
        ranks_env = (e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"])
        assert ranks_env == (str(r), str(r), "2", "2", "0")
        assert e["TORCHELASTIC_ERROR_FILE"] == str(run.log_dir / "attempt_0" / str(r) / "error.json")
        sockets = (e["GLOO_SOCKET_IFNAME"], e["NCCL_SOCKET_IFNAME"], e["NCCL_NVLS_ENABLE"], e["MASTER_PORT"])
        assert sockets == ("lo", "lo", "0", None)         # the loopback interface, NVLS off, no TCP store's port
    log = run.log.read_text()
    assert "[rank0]: rank 0 of 2 joined" in log and "[rank1]: rank 1 of 2 joined" in log
    assert run.returncodes == [0, 0] and run.port is None
    nothing_left(run)


def test_two_nodes_on_one_machine(build_dir):
    """Two torchrun agents on 127.0.0.1 as two "nodes" of one rank each: one group of 2 ranks over the c10d
    rendezvous; every collective checked and its bus bandwidth by nccl-tests' formula; nothing left."""
    run = launch.torchrun("utils.multigpu.collectives", ["--sizes", "1000,65536", "--iters", "2", "--warmup", "1",
                                                "--latency-iters", "2", "--backend", "gloo"],
                          nproc=1, nnodes=2, timeout=240, name="test-two-nodes")
    res = run.result()
    assert (res["world"], res["nodes"], res["backend"]) == (2, 2, "gloo")
    assert len(run.command) == 2 and "is_host=1" in run.command[0] and "is_host=0" in run.command[1]
    assert run.command[1][run.command[1].index("--nnodes") + 1] == "2"
    assert {r["collective"] for r in res["rows"]} == set(collectives.COLLECTIVES)
    for r in res["rows"]:
        assert r["wrong"] == 0 and r["time_s"] > 0
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * collectives.bus_factor(r["collective"], 2))
    assert collectives.row_at(res["rows"], "all_gather", 1000)["bytes"] == 1000
    assert collectives.row_at(res["rows"], "all_gather", 4096) is None
    nothing_left(run)


def test_two_nodes_without_a_namespace_listen_on_loopback_only(build_dir, scripts, tmp_path, monkeypatch, capsys):
    """Where the machine refuses a network namespace (forced here), the two torchrun agents and their ranks run on
    the machine's own network, and every socket any of their processes listens on is on 127.0.0.1: the c10d
    rendezvous store (--rdzv-endpoint), the store node 0's agent shares with the ranks (MASTER_ADDR:MASTER_PORT)
    and gloo's sockets; none on 0.0.0.0 or :: (where torch's TCPStore would listen by itself). The NOTE says so."""
    import uuid

    monkeypatch.setattr(launch.Namespace, "start", lambda self, timeout=10.0: "refused by the test")
    mark = uuid.uuid4().hex
    env = {**scripts, "READY_DIR": str(tmp_path), "LAB06_LISTEN_TEST": mark}
    outcome = {}

    def two_nodes():
        try:
            outcome["run"] = launch.torchrun("waiting_rank", [], nproc=1, nnodes=2, timeout=240,
                                             name="test-loopback", env=env)
        except BaseException as e:  # noqa: BLE001 - shown by the assertions below
            outcome["error"] = e

    worker = threading.Thread(target=two_nodes, daemon=True)
    worker.start()
    try:
        ready = [tmp_path / f"ready-{r}.json" for r in range(2)]
        deadline = time.monotonic() + 180
        while not all(p.exists() for p in ready) and time.monotonic() < deadline and worker.is_alive():
            time.sleep(0.1)
        assert all(p.exists() for p in ready), outcome.get("error")
        pids = {pid for pid in psutil.pids() if processes.environ(pid).get("LAB06_LISTEN_TEST") == mark}
        commands = {pid: psutil.Process(pid).cmdline() for pid in pids}
        agents = [pid for pid, cmd in commands.items() if "guard" not in cmd
                  and any(tuple(cmd[i:i + 2]) == launch.LOOPBACK_TORCHRUN for i in range(len(cmd)))]
        assert len(agents) == 2, commands                       # torchrun's agents, one per "node"
        assert not any("nsenter" in cmd for cmd in commands.values())
        here = os.readlink("/proc/self/ns/net")
        assert all(os.readlink(f"/proc/{pid}/ns/net") == here for pid in agents)   # the machine's own network
        endpoint = {cmd[cmd.index("--rdzv-endpoint") + 1] for pid, cmd in commands.items() if pid in agents}
        envs = [json.loads(p.read_text()) for p in ready]
        assert {(e["MASTER_ADDR"], e["TORCHELASTIC_USE_AGENT_STORE"]) for e in envs} == {("127.0.0.1", "True")}
        listening = _listeners(pids)
        elsewhere = [(a, p) for a, p in listening if not a.startswith("127.0.0.1:")]
        assert elsewhere == [], f"listening off 127.0.0.1: {elsewhere}"
        addresses = {a for a, _ in listening}
        assert endpoint <= addresses, (endpoint, listening)                  # the rendezvous store
        assert f"127.0.0.1:{envs[0]['MASTER_PORT']}" in addresses, listening  # the store shared with the ranks
    finally:
        (tmp_path / "go").write_text("")
        worker.join(timeout=240)
    assert not worker.is_alive()
    assert "error" not in outcome, outcome.get("error")
    run = outcome["run"]
    assert run.returncodes == [0, 0]
    note = capsys.readouterr().out
    assert "NOTE: test-loopback: no network namespace for the agents (refused by the test)" in note
    assert "listen on and connect to 127.0.0.1 only" in note
    nothing_left(run)


def test_the_agents_tcp_stores_listen_on_loopback_only(tmp_path, monkeypatch):
    """netns's TCPStore for the agents: a server listens on 127.0.0.1 (torch's own listens on every interface), a
    client reaches it, and a host off the loopback interface is refused. netns names Ubuntu's AppArmor restriction."""
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=30)
    store = netns.loopback_store_class()
    server = store("127.0.0.1", 0, is_master=True, multi_tenant=True, timeout=timeout)
    try:
        client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timeout)
        client.set("k", "v")
        assert server.get("k") == b"v"
        mine = {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections(kind="inet")
                if c.status == psutil.CONN_LISTEN and c.laddr.port == server.port}
        assert mine == {("127.0.0.1", server.port)}
        del client
    finally:
        del server
    with pytest.raises(ValueError, match="loopback interface only"):
        store("192.0.2.1", 0, is_master=True, timeout=timeout)
    flag = tmp_path / "apparmor_restrict_unprivileged_userns"
    flag.write_text("1\n")
    monkeypatch.setattr(netns, "APPARMOR_USERNS", flag)
    assert "kernel.apparmor_restrict_unprivileged_userns=1" in netns.restriction()
    flag.write_text("0\n")
    assert netns.restriction() == ""


def test_launch_environment_and_commands():
    env = launch.rank_env({"PATH": "/bin"})
    assert {k: env[k] for k in launch.NVLS_OFF} == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                                                     "NVSHMEM_DISABLE_NVLS": "1"}
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "lo"
    from torch.distributed.run import get_args_parser

    cmd = launch.torchrun_command("utils.multigpu.tp", ["--model", "m"], nproc=2, nnodes=2, endpoint="127.0.0.1:29500",
                                  rdzv_id="x", log_dir="logs", is_host=True)
    args = get_args_parser().parse_args(cmd[3:])                       # torchrun itself accepts it
    assert (args.nnodes, args.nproc_per_node, args.rdzv_endpoint, args.module) == ("2", "2", "127.0.0.1:29500", True)
    cmd = launch.torchrun_command("utils.multigpu.tp", ["--model", "m"], nproc=2, nnodes=2, endpoint="127.0.0.1:29500",
                                  rdzv_id="x", local_addr="127.0.0.1", launcher=launch.LOOPBACK_TORCHRUN)
    assert cmd[1:4] == ["-m", "utils.multigpu.netns", "torchrun"]        # the demonstration's agents
    args = get_args_parser().parse_args(cmd[4:])
    assert (args.local_addr, args.rdzv_endpoint, args.training_script) == ("127.0.0.1", "127.0.0.1:29500", "utils.multigpu.tp")
    script = launch.slurm_script("utils.multigpu.collectives", ["--sizes", "1024"], nodes=2, gpus_per_node=8)
    line = next(l for l in script.splitlines() if l.startswith("export "))
    assert line == "export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1"
    srun = " ".join(l.rstrip("\\") for l in script.splitlines() if l.startswith(("srun", "  ")))
    args = get_args_parser().parse_args(srun.split()[2:])
    assert (args.nnodes, args.nproc_per_node, args.module, args.training_script) == ("2", "8", True, "utils.multigpu.collectives")


def test_failure_explains_itself_from_the_error_files(tmp_path):
    import json

    run = launch.Run(name="x", command=[["torchrun"]], log=tmp_path / "x.log", log_dir=tmp_path / "logs",
                     out_dir=tmp_path, port=1)
    for rank, message, stamp in ((0, "RuntimeError: Connection closed by peer [127.0.0.1]:1", "100"),
                                 (1, "ValueError: the real cause", "100")):
        d = tmp_path / "logs" / "node0" / "run_x" / "attempt_0" / str(rank)
        d.mkdir(parents=True)
        (d / "error.json").write_text(json.dumps({"message": {"message": message, "extraInfo": {
            "py_callstack": f"Traceback ...\n{message}\n", "timestamp": stamp}}}))
    e = launch.failure(run, 1)
    assert (e.rank, e.error) == (1, "ValueError: the real cause")  # a peer's "connection closed" comes second


# --- exercises --------------------------------------------------------------------------------------------

def load(answers=None):
    return solutions.load("06", answers=answers)


def test_references_pass():
    ref = load()
    graders.check_bus_factor(ref.bus_factor)
    graders.check_column_parallel(ref.column_parallel_linear)
    graders.check_row_parallel(ref.row_parallel_linear)
    graders.check_collectives_per_token(ref.collectives_per_token)


ALTERNATIVES = {
    "6.1": "return {'all_reduce': 2 * (n - 1) / n, 'broadcast': 1.0}.get(collective, (n - 1) / n)",
    "6.2": "return torch.nn.functional.linear(x, weight.chunk(world, dim=0)[rank])",
    "6.3": "return torch.nn.functional.linear(x_part, torch.tensor_split(weight, world, dim=1)[rank])",
    "6.4": "return (layers * 2, dtype_bytes * hidden)",
}


MORE_ALTERNATIVES = [
    ("6.1", "from fractions import Fraction\nif collective == 'broadcast':\n    return 1\n"
            "return Fraction(2 if collective == 'all_reduce' else 1) * Fraction(n - 1, n)"),
    ("6.1", "match collective:\n    case 'all_reduce':\n        return 2 - 2 / n\n    case 'broadcast':\n"
            "        return 1.0\n    case _:\n        return 1 - 1 / n"),
    ("6.1", "import numpy as np\nreturn np.float64({'all_reduce': 2.0, 'broadcast': n / (n - 1) if n > 1 else 1.0}"
            ".get(collective, 1.0) * (n - 1) / n) if n > 1 or collective != 'broadcast' else 1.0"),
    ("6.2", "return (x @ weight.T).chunk(world, dim=-1)[rank]"),
    ("6.2", "share = weight.shape[0] // world\nreturn torch.einsum('ti,oi->to', x, weight.narrow(0, rank * share, share))"),
    ("6.3", "return torch.einsum('ti,oi->to', x_part, weight.chunk(world, dim=1)[rank])"),
    ("6.3", "cols = x_part.shape[1]\nreturn torch.mm(x_part.contiguous(), weight[:, rank * cols:(rank + 1) * cols].t())"),
    ("6.4", "return [2 * layers, hidden * dtype_bytes]"),
    ("6.4", "import numpy as np\nreturn np.int64(2 * layers), np.int64(hidden) * dtype_bytes"),
]


@pytest.mark.parametrize("exercise, code", [*sorted(ALTERNATIVES.items()), *MORE_ALTERNATIVES],
                         ids=[*sorted(ALTERNATIVES), *(f"{e}-more-{i}" for i, (e, _) in enumerate(MORE_ALTERNATIVES))])
def test_alternative_answers_pass(exercise, code):
    mod = load({exercise: code})
    checker, fn = {"6.1": ("check_bus_factor", "bus_factor"), "6.2": ("check_column_parallel", "column_parallel_linear"),
                   "6.3": ("check_row_parallel", "row_parallel_linear"),
                   "6.4": ("check_collectives_per_token", "collectives_per_token")}[exercise]
    getattr(graders, checker)(getattr(mod, fn))


WRONG = [
    ("6.1", "return (n - 1) / n", "check_bus_factor", "bus_factor", "reduce-scatter followed by an all-gather"),
    ("6.1", "return 2 * (n - 1) / n if collective == 'all_reduce' else (n - 1) / n", "check_bus_factor", "bus_factor",
     "all the data leaves the root"),
    ("6.1", "return 2.0 if collective == 'all_reduce' else 1.0 if collective == 'broadcast' else (n - 1) / n",
     "check_bus_factor", "bus_factor", "which is 0 on one rank"),
    ("6.2", "return x @ weight.T", "check_column_parallel", "column_parallel_linear", "it computed all output features"),
    ("6.2", "return x @ weight[rank::world].T", "check_column_parallel", "column_parallel_linear",
     "yours takes every world-th row"),
    ("6.2", "rows = weight.shape[0] // world\nreturn x @ weight[(world - 1 - rank) * rows:(world - rank) * rows].T",
     "check_column_parallel", "column_parallel_linear", "side by side must be the full output"),
    ("6.3", "return x_part @ weight.T", "check_row_parallel", "row_parallel_linear", "multiply it by the matching columns"),
    ("6.3", "cols = weight.shape[1] // world\nreturn x_part @ weight[:, rank * cols:(rank + 1) * cols].T / world",
     "check_row_parallel", "row_parallel_linear", "do not divide by world"),
    ("6.3", "cols = weight.shape[1] // world\nreturn x_part @ weight[rank * cols:(rank + 1) * cols, :cols].T",
     "check_row_parallel", "row_parallel_linear", "full shape"),
    ("6.4", "return 2 * layers + 1, hidden * dtype_bytes", "check_collectives_per_token", "collectives_per_token",
     "keeps the embedding whole"),
    ("6.4", "return layers, hidden * dtype_bytes", "check_collectives_per_token", "collectives_per_token",
     "two per layer"),
    ("6.4", "return 2 * layers, hidden", "check_collectives_per_token", "collectives_per_token", "bytes, not numbers"),
    ("6.4", "return 2 * layers", "check_collectives_per_token", "collectives_per_token", "return a pair"),
    # 6.1: integer division is floor division, named as such; the other mistakes named by what they compute
    ("6.1", "return 2 * (n - 1) // n if collective == 'all_reduce' else 1.0 if collective == 'broadcast' else (n - 1) // n",
     "check_bus_factor", "bus_factor", "all_reduce on 3 ranks: expected 1.333, got 1; `//` is floor division"),
    ("6.1", "return 2 * ((n - 1) // n) if collective == 'all_reduce' else 1.0 if collective == 'broadcast' else (n - 1) / n",
     "check_bus_factor", "bus_factor", "all_reduce on 2 ranks: expected 1, got 0; `//` is floor division"),
    ("6.1", "return 2 * (n - 1) / n if collective == 'all_reduce' else 1.0 if collective == 'broadcast' else (n - 1) // n",
     "check_bus_factor", "bus_factor", "all_gather on 2 ranks: expected 0.5, got 0; `//` is floor division"),
    ("6.1", "return (n / (2 * (n - 1)) if n > 1 else 0.0) if collective == 'all_reduce' else 1.0 if collective == "
            "'broadcast' else (n - 1) / n", "check_bus_factor", "bus_factor", "upside down"),
    ("6.1", "return 2 * n / (n + 1) if collective == 'all_reduce' else 1.0 if collective == 'broadcast' else (n - 1) / n",
     "check_bus_factor", "bus_factor", "off by one in n"),
    ("6.1", "return 1.0 if collective == 'broadcast' else 2 * (n - 1) / n", "check_bus_factor", "bus_factor",
     "all_gather on 2 ranks: expected 0.5, got 1; only an all-reduce moves the data twice"),
    ("6.1", "return 1.0 if collective in ('all_reduce', 'broadcast') else (n - 1) / n", "check_bus_factor",
     "bus_factor", "all_reduce on 3 ranks: expected 1.333, got 1$"),
    ("6.1", "return {'all_reduce': 2 * (n - 1) / n, 'all_gather': (n - 1) / n, 'broadcast': 1.0}[collective]",
     "check_bus_factor", "bus_factor", "on bus_factor\\('reduce_scatter', 2\\) your code raised KeyError"),
    ("6.1", "return f'{2 * (n - 1) / n:.3f}'", "check_bus_factor", "bus_factor", "should return a number, got '1.000'"),
    # 6.2 and 6.3: shape and dtype slips are hints that name the inputs, never a traceback
    ("6.2", "rows = weight.shape[0] // world\nreturn x @ weight[rank * rows:(rank + 1) * rows]", "check_column_parallel",
     "column_parallel_linear", "on x \\[1, 8\\] float64, weight \\[8, 8\\] float64, rank=0, world=2 your code raised "
     "RuntimeError: .*the shapes do not multiply"),
    ("6.2", "rows = weight.shape[0] // world\nreturn x.float() @ weight[rank * rows:(rank + 1) * rows].float().T",
     "check_column_parallel", "column_parallel_linear", "return the result in x's dtype \\(float64\\), got float32"),
    ("6.2", "rows = weight.shape[0] // world\nreturn list(x @ weight[rank * rows:(rank + 1) * rows].T)",
     "check_column_parallel", "column_parallel_linear", "return a tensor, got list"),
    ("6.2", "rows = weight.shape[1] // world\nreturn x @ weight[rank * rows:(rank + 1) * rows].T",
     "check_column_parallel", "column_parallel_linear", "3 tokens, 12 -> 24, 4 ranks\\): shape: each rank returns"),
    ("6.2", "rows = weight.shape[0] // world\nreturn x @ weight[(world - 1 - rank) * rows:(world - rank) * rows].T",
     "check_column_parallel", "column_parallel_linear", "yours gives rank r the share of rank world-1-r"),
    ("6.3", "cols = weight.shape[1] // world\nreturn (x_part.float() @ weight[:, rank * cols:(rank + 1) * cols].float().T)",
     "check_row_parallel", "row_parallel_linear", "return the result in x's dtype \\(float64\\), got float32"),
    ("6.3", "cols = weight.shape[1] // world\nreturn weight[:, rank * cols:(rank + 1) * cols] @ x_part.T",
     "check_row_parallel", "row_parallel_linear", "each rank returns a partial output of the full shape \\[1, 8\\], got "
     "\\[\\(8, 1\\)\\]"),
    ("6.3", "cols = weight.shape[1] // world\nreturn x_part @ weight[:, rank * cols:(rank + 1) * cols].T * world",
     "check_row_parallel", "row_parallel_linear", "each rank returns only its own partial product"),
    ("6.3", "cols = weight.shape[1] // world\nreturn torch.mm(x_part, weight[:, rank * cols:(rank + 1) * cols].T.float())",
     "check_row_parallel", "row_parallel_linear", "on x_part \\[1, 4\\] float64 \\(a strided slice\\), weight \\[8, 8\\] "
     "float64, rank=0, world=2 your code raised RuntimeError"),
    # 6.4: units and counts
    ("6.4", "return 2 * layers, hidden * dtype_bytes * 8", "check_collectives_per_token", "collectives_per_token",
     "bytes, not bits"),
    ("6.4", "return 7 * layers, hidden * dtype_bytes", "check_collectives_per_token", "collectives_per_token",
     "only the row-parallel layers"),
    ("6.4", "return 2 * layers - 1, hidden * dtype_bytes", "check_collectives_per_token", "collectives_per_token",
     "count the row-parallel layers of one decoder layer"),
    ("6.4", "return {'count': 2 * layers, 'bytes': hidden * dtype_bytes}", "check_collectives_per_token",
     "collectives_per_token", "return a pair of numbers"),
    ("6.4", "return 2 * layers, hidden * dtype_bytes * layers", "check_collectives_per_token", "collectives_per_token",
     "each all-reduce carries one token's hidden vector"),
    # issue 46: an answer that writes into its input fails at once, naming it
    ("6.2", "rows = weight.shape[0] // world\nout = x @ weight[rank * rows:(rank + 1) * rows].T\nweight.zero_()\n"
            "return out", "check_column_parallel", "column_parallel_linear",
     "on x \\[1, 8\\] float64, weight \\[8, 8\\] float64, rank=0, world=2 your code changed its input weight"),
    ("6.3", "cols = weight.shape[1] // world\nx_part *= 2\nreturn x_part @ weight[:, rank * cols:(rank + 1) * cols].T / 2",
     "check_row_parallel", "row_parallel_linear", "your code changed its input x_part: read the inputs"),
]


@pytest.mark.parametrize("exercise, code, checker, fn, hint", WRONG, ids=[f"{w[0]}-{i}" for i, w in enumerate(WRONG)])
def test_wrong_answers_fail_with_their_hint(exercise, code, checker, fn, hint):
    mod = load({exercise: code})
    with pytest.raises(ExerciseFailed, match=hint):
        getattr(graders, checker)(getattr(mod, fn))


@pytest.mark.parametrize("checker, fn", [("check_bus_factor", "bus_factor"),
                                         ("check_column_parallel", "column_parallel_linear"),
                                         ("check_row_parallel", "row_parallel_linear"),
                                         ("check_collectives_per_token", "collectives_per_token")])
def test_every_grade_draws_fresh_cases(checker, fn, monkeypatch, capsys):
    """Issue 46: beside the fixed cases, each grade draws new rank counts and sizes, without PASS lines of their own:
    an answer that replays an earlier grade's answers fails, and what a right answer prints stays the same."""
    grades_afresh(getattr(graders, checker), getattr(load(), fn), monkeypatch, capsys)


def test_the_misleading_6_1_hints_are_gone():
    """Integer division is not steered toward another formula, and an all-reduce of factor 1 is not told it is an
    all-gather."""
    mod = load({"6.1": "return 1.0 if collective in ('all_reduce', 'broadcast') else (n - 1) / n"})
    with pytest.raises(ExerciseFailed) as err:
        graders.check_bus_factor(mod.bus_factor)
    assert "1/n of the result" not in str(err.value)
    mod = load({"6.1": "return 2 * (n - 1) // n if collective == 'all_reduce' else 1.0 if collective == 'broadcast' "
                       "else (n - 1) / n"})
    with pytest.raises(ExerciseFailed) as err:
        graders.check_bus_factor(mod.bus_factor)
    assert "floor division" in str(err.value) and "(n-1)/n of the buffer" not in str(err.value)


def test_lab_with_a_wrong_answer_stops_at_its_grade(tmp_path, build_dir):
    nb, err = run_lab_with(LAB, {"6.1": "return (n - 1) / n"}, tmp_path)
    assert err and err[0] == "ExerciseFailed" and "reduce-scatter followed by an all-gather" in err[1]
    assert not (build_dir / "lab06" / "runs").exists()     # it stopped before any rank was started


# --- on GPUs (make test-gpu) ----------------------------------------------------------------------------

@pytest.mark.gpu
def test_graph_step_matches_eager_on_a_gpu(tiny):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    folder, _ = tiny[torch.bfloat16]
    model = tp.TPLlama(folder, device="cuda", dtype=torch.bfloat16, max_len=64)
    eager = tp.teacher_forced_logits(model, tp.make_step(model, "eager"), TOKENS)
    graph = tp.teacher_forced_logits(model, tp.make_step(model, "graph"), TOKENS)
    assert tp.compare(graph, eager) <= tp.tolerance(torch.bfloat16)


@pytest.mark.gpu
def test_collectives_over_nccl(build_dir):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    run = launch.torchrun("utils.multigpu.collectives", ["--sizes", "1048576", "--iters", "5"], nproc=2, timeout=300,
                          name="test-nccl")
    res = run.result()
    assert res["backend"] == "nccl" and all(r["wrong"] == 0 for r in res["rows"])
    nothing_left(run)


@pytest.mark.gpu
def test_parallelize_module_matches_the_split_by_hand_on_gpus(tiny, build_dir):
    """Two GPUs: PyTorch's parallelize_module (DTensor) and the hand-written split give the single process's BF16
    logits within tolerance, and the same collectives per token (2 x layers all-reduces, one all-gather)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    folder, reference = tiny[torch.bfloat16]
    run = launch.torchrun("utils.multigpu.tp", ["--model", folder, "--tokens", ",".join(map(str, TOKENS)),
                                                "--decode", 8, "--variants", "eager", "--dtensor"],
                          nproc=2, timeout=600, name="test-dtensor")
    res = run.result()
    assert "error" not in res["dtensor"], res["dtensor"]
    for r in range(2):
        hand = torch.load(run.out_dir / f"hand-eager-b1-rank{r}.pt")
        dt = torch.load(run.out_dir / f"dtensor-rank{r}.pt")
        assert tp.compare(dt, reference) <= tp.tolerance(torch.bfloat16)
        assert tp.compare(dt, hand) <= tp.tolerance(torch.bfloat16)
    assert res["dtensor"]["counts"] == {"all_reduce": 4, "all_gather": 1}
    assert res["dtensor"]["tokens_per_s"] > 0
    nothing_left(run)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_every_variant_of_the_split_on_gpus(tiny, build_dir, world):
    """2 and 4 GPUs: every variant of the hand-written split (eager; compiled in one graph; separate products; the
    one-shot all-reduce over symmetric memory; tuned), at batch 1 and 4: every rank's logits within tolerance of
    transformers', and 2 x layers all-reduce kernels and one all-gather per step (host operations too, eager)."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs; this machine has {torch.cuda.device_count()}")
    folder, reference = tiny[torch.bfloat16]
    res, run, failed = tp.launch_split(folder, TOKENS, nproc=world, decode=8, variants=tp.PRESETS["all"], large_batch=4,
                                       large_variants=tp.LARGE_VARIANTS, timeout=600, variant_timeout=300,
                                       name=f"test-variants-{world}")
    assert failed is None, failed
    want = {"all_reduce": 2 * tp.TINY["num_hidden_layers"], "all_gather": 1}
    assert set(res["hand"]["batches"]) == {"1", "4"}
    for batch, entries in res["hand"]["batches"].items():
        for name, entry in entries.items():
            assert "tokens_per_s" in entry, (batch, name, entry)
            for r in range(world):
                logits = torch.load(run.out_dir / f"hand-{name}-b{batch}-rank{r}.pt")
                assert tp.compare(logits, reference) <= tp.tolerance(torch.bfloat16), (batch, name, r)
            assert entry["profile"]["kernel_counts"] == want, (batch, name, entry["profile"])
            if name.startswith("eager"):
                assert entry["profile"]["counts"] == want
    nothing_left(run)


def test_the_two_node_rendezvous_listens_only_inside_its_own_network(build_dir, tmp_path):
    """A store that listens on every interface, inside the namespace, cannot be reached from the machine's network;
    where the machine refuses a namespace, the reason is given (and the run goes on as before)."""
    import subprocess
    import sys

    from utils.multigpu import netns

    network = netns.Namespace(tmp_path)
    refused = network.start()
    if refused:
        pytest.skip(f"no network namespace here: {refused}")
    try:
        port = launch.free_port()
        listen = ("import socket, sys, time; s = socket.socket(); s.bind(('0.0.0.0', int(sys.argv[1]))); s.listen(); "
                  "print('listening', flush=True); time.sleep(30)")
        inside = subprocess.Popen(network.prefix() + [sys.executable, "-c", listen, str(port)], stdout=subprocess.PIPE,
                                  text=True)
        try:
            assert inside.stdout.readline().strip() == "listening"
            assert not launch.port_listening(port), "a listener inside the namespace is reachable from outside"
        finally:
            inside.kill()
            inside.wait()
    finally:
        network.stop()
    assert not processes.group_alive(network.holder.pgid)
