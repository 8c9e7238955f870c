"""utils.record and utils.machinery.report: sidecars, the course report and reference records."""
import json

import pytest

from utils import device as devices
from utils import plots, record
from utils.machinery import executed, report


@pytest.fixture
def h100(recorded):
    r = recorded["h100"]
    return devices.from_properties(r["properties"], cuda=r["cuda"])


def test_recorder_writes_a_sidecar_and_restarts_clean(build_dir, h100):
    rec = record.start("99_demo", h100)
    rec.metric("demo.add_gbps", 3000.0, "GB/s", peak=h100.peak_bandwidth_gbps, label="add", size={"n": 1 << 28})
    data = json.loads((build_dir / "results" / "99_demo.json").read_text())
    assert data["device"]["arch"] == "sm_90" and "torch" in data["software"]
    m = data["metrics"]["demo.add_gbps"]
    assert m["fraction_of_peak"] == pytest.approx(3000 / 3350) and m["unit"] == "GB/s"
    assert m["size"] == "n=268435456" and m["label"] == "add" and m["verdict"] == "ok" and m["better"] == "higher"
    assert {"before", "after"} <= set(m["state"]) and "cpu" in m["state"]["after"]   # the machine around it
    record.start("99_demo", h100)          # a re-run starts from nothing
    assert json.loads((build_dir / "results" / "99_demo.json").read_text())["metrics"] == {}


def test_every_figure_needs_a_key_a_label_and_a_size(build_dir, h100):
    rec = record.start("99_demo", h100)
    with pytest.raises(ValueError, match="lower case"):
        rec.metric("Add GB/s", 1.0, "GB/s", label="add", size="n=1")
    with pytest.raises(ValueError, match="label="):
        rec.metric("add_gbps", 1.0, "GB/s", label=" ", size="n=1")
    for bad in ("", "  ", 4096, ["n", 1], {}):
        with pytest.raises(ValueError, match="size="):
            rec.metric("x_gbps", 1.0, "GB/s", label="x", size=bad)
    with pytest.raises(TypeError):
        rec.metric("x_gbps", 1.0, "GB/s", label="x")     # size is required


def test_figures_are_saved_and_listed(build_dir, h100):
    import matplotlib

    matplotlib.use("Agg")

    rec = record.start("99_demo", h100)
    fig = plots.achieved_vs_peak([("add", 3000.0, 3350.0, "GB/s")], title="demo")
    path = rec.figure(fig, "bars")
    assert path.exists() and path.stat().st_size > 1000
    assert rec.data["figures"] == ["99_demo/bars.png"] and "end" in rec.data["state"]


# --- the validity tests: synthetic runs, each with the verdict and the report row it must produce ---

def _timing(samples, window=None):
    from utils import timing
    return timing.Timing(tuple(samples), "perf_counter", window)


def test_a_load_level_that_completed_no_request_is_unreliable(build_dir, capsys):
    rec = record.start("05_llm_serving", devices.cpu_info())
    m = rec.metric("capacity_requests_per_s", 0.0956, "req/s", label="capacity", size="c=4",
                   samples=0, checks=[record.enough(0, 1, "requests completed at c=4")])
    assert m["verdict"] == "unreliable"
    assert "no requests completed at c=4 (needs 1)" in m["reasons"]
    assert "UNRELIABLE: capacity (c=4)" in capsys.readouterr().out
    row = next(line for line in report.build_report().read_text().splitlines() if line.startswith("| capacity"))
    assert "unreliable (0.0956 req/s)" in row and "**unreliable**: no requests completed" in row


def test_a_percentile_of_one_sample_is_unreliable(build_dir):
    assert [record.percentile_needs(q) for q in (50, 90, 99)] == [2, 10, 100]
    rec = record.start("05_llm_serving", devices.cpu_info())
    m = rec.metric("ttft_p99_ms", 812.0, "ms", label="TTFT p99", size="1 req/s", samples=1,
                   checks=[record.enough(1, record.percentile_needs(99), "requests for a p99")])
    assert m["verdict"] == "unreliable" and "only 1 requests for a p99 (needs 100)" in m["reasons"]
    assert "only 1 sample (needs 3)" in m["reasons"]
    ok = rec.metric("ttft_p50_ms", 80.0, "ms", label="TTFT p50", size="1 req/s", samples=40,
                    checks=[record.enough(40, record.percentile_needs(50), "requests for a p50")])
    assert ok["verdict"] == "ok" and ok["better"] == "lower"


def test_a_1500x_outlier_in_a_sweep_is_unreliable_and_never_a_plain_number(build_dir):
    rec = record.start("01_vector_add", devices.cpu_info())
    m = rec.metric("torch_gbps", 0.06547, "GB/s", label="torch.add", size={"n": 65536},
                   timing=_timing([0.06, 0.061, 0.062, 0.06, 0.063]),
                   checks=[record.not_far_below(0.06547, 98.2, 10, "torch.add at n=4096")])
    assert m["verdict"] == "unreliable" and m["reasons"] == ["1,500x below torch.add at n=4096 (98.2) in the same run"]
    assert rec.text("torch_gbps").startswith("unreliable (0.06547 GB/s): 1,500x below")
    assert record.not_far_below(40.0, 98.2, 10, "x") is None      # a cache effect is not an outlier


def test_samples_and_spread_are_recorded_and_judged(build_dir):
    rec = record.start("01_vector_add", devices.cpu_info())
    steady = rec.metric("a_gbps", 10.0, "GB/s", label="a", size="n=1", timing=_timing([1.0, 1.01, 0.99, 1.0, 1.02]))
    assert steady["verdict"] == "ok" and steady["samples"] == 5 and steady["spread"] < 0.05
    noisy = rec.metric("b_gbps", 10.0, "GB/s", label="b", size="n=1", timing=_timing([1.0, 3.0, 1.0, 2.0, 5.0]))
    assert noisy["verdict"] == "unreliable" and any("spread" in r and "above 25%" in r for r in noisy["reasons"])
    two = rec.metric("c_gbps", 10.0, "GB/s", label="c", size="n=1", timing=_timing([1.0, 1.0]))
    assert "only 2 samples (needs 3)" in two["reasons"]
    nan = rec.metric("d", float("nan"), "x", label="d", size="n=1")
    assert "the value is nan" in nan["reasons"]


def test_a_throttled_gpu_and_a_busy_cpu_make_a_figure_unreliable(build_dir, h100):
    """The machine's state recorded around a figure: a GPU that slowed itself down (NVML's thermal slowdown bit),
    whose clock fell, or a CPU other processes took."""
    from utils import machine

    cool = machine.from_nvml({"sm_clock_mhz": 1980, "max_sm_clock_mhz": 1980, "memory_clock_mhz": 2619,
                              "temperature_c": 41, "power_mw": 120_000, "power_limit_mw": 700_000, "reasons": 0x1,
                              "utilization_pct": 0, "pids": []})
    hot = machine.from_nvml({"sm_clock_mhz": 1410, "max_sm_clock_mhz": 1980, "temperature_c": 87,
                             "power_mw": 400_000, "power_limit_mw": 700_000, "reasons": 0x40,
                             "utilization_pct": 100, "pids": []})
    assert hot["slowdown"] == ["hardware thermal slowdown"] and hot["power_w"] == 400.0
    cpu = {"cores": 2, "load1": 0.3, "busy_s": 100.0, "own_s": 10.0}
    before = {"time": 0.0, "cpu": cpu, "gpu": cool}
    after = {"time": 10.0, "cpu": dict(cpu, busy_s=118.0, own_s=19.0, load1=2.9), "gpu": hot}
    reasons = machine.judge(before, after)
    assert "the GPU's clock fell from 1980 to 1410 MHz" in reasons
    assert any(r.startswith("the GPU slowed itself down (hardware thermal slowdown) at 87") for r in reasons)
    assert any(r.startswith("other processes used 45% of the 2 CPU cores") for r in reasons)
    capped = machine.from_nvml({"sm_clock_mhz": 1650, "max_sm_clock_mhz": 1980, "temperature_c": 63,
                                "power_mw": 692_900, "power_limit_mw": 700_000, "reasons": 0x4, "pids": []})
    steady = {"time": 10.0, "cpu": dict(cpu, busy_s=109.0, own_s=19.0), "gpu": capped}
    assert machine.judge(before, steady) == []   # 1980 -> 1650 MHz at the power cap: the sustained clock (H100, lab 04)
    unexplained = {"time": 10.0, "cpu": steady["cpu"], "gpu": dict(capped, slowdown=[])}
    assert machine.judge(before, unexplained) == ["the GPU's clock fell from 1980 to 1650 MHz"]
    rec = record.start("03_bf16_matmul", h100)
    m = rec.metric("torch_tflops", 500.0, "TFLOP/s", label="torch.matmul", size="8192^3", peak=989.4,
                   timing=_timing([1.0, 1.0, 1.0], {"before": before, "after": after}))
    assert m["verdict"] == "unreliable" and len(m["reasons"]) == 3
    assert "1410 MHz" in machine.summary(after) and "slowdown: hardware thermal slowdown" in machine.summary(after)


def test_amd_gpu_state_from_amdsmi_and_rocm_smi_fixtures():
    from utils import machine

    amd = machine.from_amdsmi({"clock": {"clk": 2100, "max_clk": 2100, "min_clk": 500},
                               "metrics": {"throttle_status": 0}, "temperature_c": 52,
                               "power": {"current_socket_power": "N/A", "average_socket_power": 344,
                                         "power_limit": 750}, "activity": {"gfx_activity": 98},
                               "processes": [{"pid": 4242, "name": "python3"}]})
    assert amd == {"source": "amdsmi", "sm_clock_mhz": 2100, "max_sm_clock_mhz": 2100, "temperature_c": 52,
                   "power_w": 344, "power_limit_w": 750, "slowdown": [], "utilization_pct": 98, "pids": [4242]}
    throttled = machine.from_amdsmi({"clock": {"clk": 1300}, "metrics": {"throttle_status": 1}})
    assert throttled["slowdown"] == ["thermal throttling"]
    smi = machine.from_rocm_smi({"card0": {"sclk clock speed:": "(2100Mhz)", "mclk clock speed:": "(1300Mhz)",
                                           "Temperature (Sensor edge) (C)": "40.0",
                                           "Temperature (Sensor junction) (C)": "47.0",
                                           "Current Socket Graphics Package Power (W)": "141.0", "GPU use (%)": "0"},
                                 "system": {"PID4242": "python3, 1, 1024, 0, unknown"}})
    assert smi == {"source": "rocm-smi", "sm_clock_mhz": 2100.0, "memory_clock_mhz": 1300.0, "temperature_c": 47.0,
                   "power_w": 141.0, "slowdown": [], "utilization_pct": 0.0, "pids": [4242]}


def test_two_labs_with_the_same_figure_name_keep_their_own(build_dir, h100):
    """Lab 02 and lab 07 both once recorded under "divergence.": each figure belongs to its lab."""
    record.start("02_wavefront_vs_warp", h100).metric("divergence.ratio", 1.9, "ratio", label="lab 02's", size="n=1")
    record.start("07_porting_clinic", h100).metric("divergence.ratio", 0.01, "ratio", label="lab 07's", size="n=1")
    ref = report.make_reference(record.load_results(), commit="abc")
    assert ref["labs"]["02_wavefront_vs_warp"]["metrics"]["divergence.ratio"]["label"] == "lab 02's"
    assert ref["labs"]["07_porting_clinic"]["metrics"]["divergence.ratio"]["label"] == "lab 07's"
    md = report.render_markdown(record.load_results(), {}, ref)
    sec02 = md.split("## 02_wavefront_vs_warp")[1].split("## 07")[0]
    assert "lab 02's" in sec02 and "lab 07's" not in sec02


def test_merging_one_lab_into_a_reference_of_eight_keeps_the_other_seven(build_dir, h100):
    labs = ["00_environment", "01_vector_add", "02_wavefront_vs_warp", "03_bf16_matmul", "04_flash_attention",
            "05_llm_serving", "06_multi_gpu", "07_porting_clinic"]
    for lab in labs:
        record.start(lab, h100).metric("same_name", 1.0, "x", label=lab, size="n=1")
    old = report.make_reference(record.load_results(), commit="old")
    for lab in labs:
        (build_dir / "results" / f"{lab}.json").unlink()
    record.start("07_porting_clinic", h100).metric("same_name", 2.0, "x", label="again", size="n=1")
    merged = report.merge_reference(old, report.make_reference(record.load_results(), commit="new"))
    assert list(merged["labs"]) == labs
    assert [merged["labs"][lab]["metrics"]["same_name"]["value"] for lab in labs] == [1.0] * 7 + [2.0]
    assert merged["labs"]["02_wavefront_vs_warp"]["commit"] == "old" and merged["labs"]["07_porting_clinic"]["commit"] == "new"
    with pytest.raises(ValueError, match="cannot merge"):
        report.merge_reference(dict(old, device="AMD Instinct MI300X"), old)


def test_a_lab_run_twice_at_one_commit_keeps_both_runs_figures(build_dir, h100):
    """Lab 05 once per serving engine: the second run's figures join the first's; one measured by both is the
    later run's; the earlier run is listed with the figures only it holds. Another commit replaces the lab."""
    def one_run(commit, **figures):
        (build_dir / "results" / "05_llm_serving.json").unlink(missing_ok=True)
        rec = record.start("05_llm_serving", h100)
        for key, value in figures.items():
            rec.metric(key, value, "x", label=key, size="n=1")
        return report.make_reference(record.load_results(), commit=commit)

    first = one_run("c1", decode=1.0, vllm_ttft=2.0)
    joined = report.merge_reference(first, one_run("c1", decode=1.5, transformers_ttft=3.0))
    lab = joined["labs"]["05_llm_serving"]
    assert {k: m["value"] for k, m in lab["metrics"].items()} == {"decode": 1.5, "vllm_ttft": 2.0, "transformers_ttft": 3.0}
    assert [run["metrics"] for run in lab["earlier_runs"]] == [["vllm_ttft"]]
    later = report.merge_reference(joined, one_run("c2", decode=9.0))["labs"]["05_llm_serving"]
    assert list(later["metrics"]) == ["decode"] and "earlier_runs" not in later
    again = report.merge_reference(first, one_run("c1", decode=2.5, vllm_ttft=2.5))["labs"]["05_llm_serving"]
    assert {k: m["value"] for k, m in again["metrics"].items()} == {"decode": 2.5, "vllm_ttft": 2.5}
    assert "earlier_runs" not in again, "a run measured again whole leaves no empty earlier run behind"


def test_a_printed_record_line_names_its_run_and_sets_this_run_beside_it(build_dir, h100):
    """An executed copy must never pass the record as it stood before its own run off as its own figure."""
    old = record.start("00_environment", h100)
    old.metric("environment.add_gbps", 3000.0, "GB/s", label="torch.add", size="n=1")
    ref = report.make_reference(record.load_results(), commit="abcdef0123")
    ref["labs"]["00_environment"]["run_id"] = "20261126-1"
    source = record.record_source(ref, "00_environment")
    assert "utils/reference/h100.json" in source and "run 20261126-1" in source and "commit abcdef0" in source
    rec = record.start("00_environment", h100)
    rec.metric("environment.add_gbps", 3100.0, "GB/s", label="torch.add", size="n=1")
    line = record.beside_record(rec, "environment.add_gbps", ref, "00_environment")
    assert line.startswith("this run: 3,100 GB/s") and "the record: 3,000 GB/s" in line
    assert record.beside_record(rec, "environment.matmul_tflops", ref, "00_environment") == \
        "this run: not measured; the record: none"


def test_unreliable_figures_stay_out_of_a_reference(build_dir, h100):
    rec = record.start("05_llm_serving", h100)
    rec.metric("good", 1.0, "x", label="good", size="n=1")
    rec.metric("bad", 1.0, "x", label="bad", size="n=1", checks=[record.enough(0, 1, "requests")])
    ref = report.make_reference(record.load_results())
    assert list(ref["labs"]["05_llm_serving"]["metrics"]) == ["good"]
    assert ref["labs"]["05_llm_serving"]["unreliable"] == {"bad": "no requests (needs 1)"}


def test_report_sets_each_figure_beside_the_reference_with_a_verdict(build_dir, h100, monkeypatch):
    """Same device and size: a plain number and a ratio; another size: the fraction of peak with both sizes;
    a CPU: its own verdict; the busy-machine warning and the peak memory reach the report."""
    monkeypatch.setattr(report, "load_reference", lambda name="h100": {
        "format": 2, "device": h100.name, "arch": "sm_90", "labs": {"01_vector_add": {
            "date": "2026-11-26", "commit": "0123456789abcdef", "software": {"torch": "2.11"}, "metrics": {
                "torch_gbps": {"value": 3000.0, "unit": "GB/s", "size": "n=268435456", "label": "torch.add",
                               "fraction_of_peak": 0.9},
                "slow_gbps": {"value": 3000.0, "unit": "GB/s", "size": "n=1", "label": "slow"},
                "hot_gbps": {"value": 1000.0, "unit": "GB/s", "size": "n=1", "label": "hot"},
                "gpu_only": {"value": 7.0, "unit": "x", "size": "n=9", "label": "only on the GPU"}}}}})
    rec = record.start("01_vector_add", h100)
    rec.metric("torch_gbps", 2900.0, "GB/s", label="torch.add", size={"n": 1 << 28}, peak=3350)
    rec.metric("slow_gbps", 1500.0, "GB/s", label="slow", size="n=1")
    rec.metric("hot_gbps", 2000.0, "GB/s", label="hot", size="n=1")
    rec.metric("other_size_gbps", 100.0, "GB/s", label="other", size="n=4", peak=3350)
    rec.warn("this machine is slower than the defaults assume (busy?)")
    (build_dir / "status.json").write_text(json.dumps({"run": {"id": "r1", "state": "finished"}, "labs": {
        "01_vector_add": {"status": "ok", "run_id": "r1", "seconds": 12.0, "peak_memory_mb": 812.4}}}))
    md = report.build_report().read_text()
    rows = {line.split(" | ")[0].lstrip("| "): line for line in md.splitlines() if line.startswith("| ")}
    assert "| n=268435456 | 2,900 GB/s (87% of peak) | 3,000 GB/s (90% of peak) | as expected (0.97x the reference) |" \
        in rows["torch.add"]
    assert "**slow**: 0.50x the reference" in rows["slow"]
    assert "**suspicious**: 2.00x the reference" in rows["hot"]
    assert "| 01_vector_add | ok | 12.0 | 812 MB |" in md
    assert "> **Warning:** this machine is slower than the defaults assume (busy?)" in md
    assert "| only on the GPU | n=9 | 7 x |" in md
    assert "commit 0123456789" in md and f"**Device:** {h100.name} (cuda, sm_90" in md
    cpu = record.start("01_vector_add", devices.cpu_info())
    cpu.metric("torch_gbps", 20.0, "GB/s", label="torch.add", size={"n": 65536}, peak=100.0)
    md = report.build_report().read_text()
    row = next(line for line in md.splitlines() if line.startswith("| torch.add"))
    assert "| n=65536 | 20 GB/s (20% of peak) | 90% of peak at n=268435456 (3,000 GB/s) | as expected for a CPU" in row
    assert "(CPU: PyTorch's CPU kernels and Triton's interpreter, small sizes)" in md and "(cpu, cpu)" not in md


def test_report_shows_status_peaks_and_failures(build_dir, h100):
    rec = record.start("00_environment", h100)
    rec.metric("environment.add_gbps", 3041.5, "GB/s", peak=3350, label="torch.add", size="n=1")
    (build_dir / "status.json").write_text(json.dumps({"run": {"id": "r1", "state": "finished"}, "labs": {
        "00_environment": {"status": "ok", "run_id": "r1", "executed": "build/executed/00_environment.ipynb"},
        "01_vector_add": {"status": "failed", "run_id": "r1", "error": "RuntimeError: boom", "seconds": 3.5,
                          "executed": "build/executed/01_vector_add.ipynb"}}}))
    md = report.build_report().read_text()
    assert "**FAILED**: RuntimeError: boom | 3.5 | – | build/executed/01_vector_add.ipynb" in md
    assert "AMD Instinct MI300X | 1,307 | 163.4 | 5,300 | 192" in md
    assert "NVIDIA H100 SXM | 989.4 | 67 | 3,350 | 80" in md
    html = (build_dir / "report.html").read_text()
    assert "<table>" in html and "FAILED" in html


def test_make_reference_refuses_mixed_devices(build_dir, h100):
    record.start("00_environment", h100).metric("environment.add_gbps", 3000.0, "GB/s", label="a", size="n=1")
    record.start("01_vector_add", devices.cpu_info()).metric("vector_add.torch_gbps", 30.0, "GB/s", label="a", size="n=1")
    with pytest.raises(ValueError, match="several devices"):
        report.make_reference(record.load_results())


def test_committed_h100_reference_is_well_formed():
    ref = record.load_reference("h100")
    assert ref is not None, "utils/reference/h100.json is missing"
    assert ref["format"] == 2 and "H100" in ref["device"] and ref["arch"] == "sm_90"
    for lab, entry in ref["labs"].items():
        assert entry["software"]["torch"] and entry["date"], lab
        for key, m in entry["metrics"].items():
            assert {"value", "unit"} <= set(m), (lab, key)
            assert isinstance(m["value"], float) and m.get("verdict", "ok") == "ok", (lab, key)


def test_markdown_table():
    assert plots.markdown_table(["a", "b"], [[1, "x"], [2.5, None]]) == \
        "| a | b |\n|---|---|\n| 1 | x |\n| 2.5 | None |"
    assert plots.markdown_table(["a|b"], [["x | y\nz"]]) == "| a\\|b |\n|---|\n| x \\| y z |"


def test_a_bar_in_a_label_keeps_the_reports_table_whole(build_dir, h100):
    """A label with `|` (a learner's, or `SDPA | causal`) stays one cell: the row keeps its five cells and its value."""
    rec = record.start("00_environment", h100)
    rec.metric("environment.add_gbps", 3000.0, "GB/s", label="add | fp32", size="n=1")
    md = report.build_report().read_text()
    row = next(line for line in md.splitlines() if line.startswith("| add"))
    assert row.startswith("| add \\| fp32 | n=1 | 3,000 GB/s") and row.replace("\\|", "").count("|") == 6, row


def test_report_never_says_ok_for_a_lab_that_did_not_finish_in_the_latest_run(build_dir, h100):
    """An interrupted run: the lab that was running, the labs not reached, and a lab from an earlier run
    are each named as such; only the lab that finished in this run is "ok"."""
    rec = record.start("00_environment", h100)
    rec.metric("environment.add_gbps", 3000.0, "GB/s", label="add", size="n=1")
    rec.data["run_id"] = "old"
    rec._save()
    (build_dir / "status.json").write_text(json.dumps({
        "run": {"id": "new", "state": "interrupted", "signal": "SIGINT"},
        "labs": {"00_environment": {"status": "ok", "run_id": "old"},
                 "01_vector_add": {"status": "ok", "run_id": "new"},
                 "02_wavefront_vs_warp": {"status": "interrupted", "run_id": "new", "error": "interrupted (SIGINT)"},
                 "03_bf16_matmul": {"status": "not run", "run_id": "new"}}}))
    md = report.build_report().read_text()
    rows = {line.split(" | ")[0].lstrip("| "): line for line in md.splitlines() if line.startswith("| 0")}
    assert "not run in the latest run (last: ok in run old)" in rows["00_environment"]
    assert rows["01_vector_add"].startswith("| 01_vector_add | ok |")
    assert "**INTERRUPTED**" in rows["02_wavefront_vs_warp"]
    assert "**NOT RUN**: the run was interrupted before it" in rows["03_bf16_matmul"]
    assert "**interrupted** (SIGINT)" in md
    assert "*These figures are from run `old`" in md


def test_corrupt_state_files_are_named_not_tracebacks(build_dir, h100):
    record.start("00_environment", h100).metric("environment.add_gbps", 3000.0, "GB/s", label="add", size="n=1")
    (build_dir / "results" / "01_vector_add.json").write_text('{"lab": "01_vector_add", "metr')   # truncated
    (build_dir / "status.json").write_text("{not json")
    with pytest.warns(UserWarning) as caught:
        md = report.build_report().read_text()
    messages = [str(w.message) for w in caught]
    assert any("01_vector_add.json is corrupt" in m for m in messages), messages
    assert any("status.json is corrupt" in m for m in messages), messages
    assert "| add | n=1 |" in md


def test_a_corrupt_reference_names_its_file(tmp_path, monkeypatch):
    from utils.base import state

    monkeypatch.setattr(record, "REFERENCE_DIR", tmp_path)
    (tmp_path / "h100.json").write_text('{"device": "NVIDIA H1')
    with pytest.raises(state.CorruptStateError, match=r"reference record .*h100.json is corrupt"):
        record.load_reference()


def test_a_reference_takes_figures_only_from_labs_that_finished_in_the_latest_run(build_dir, h100, capsys):
    record.start("00_environment", h100).metric("environment.add_gbps", 3000.0, "GB/s", label="add", size="n=1")
    record.start("02_wavefront_vs_warp", h100).metric("divergence.time_p1_over_p32", 1.9, "ratio", label="r", size="n=1")
    record.start("03_bf16_matmul", h100).metric("matmul.torch_tflops_4096", 700.0, "TFLOP/s", label="mm", size="n=1")
    (build_dir / "status.json").write_text(json.dumps({"run": {"id": "r2", "state": "finished"}, "labs": {
        "00_environment": {"status": "ok", "run_id": "r2"},
        "02_wavefront_vs_warp": {"status": "failed", "run_id": "r2", "error": "TypeError: x"},
        "03_bf16_matmul": {"status": "ok", "run_id": "r1"}}}))
    out = build_dir / "ref.json"
    assert report.main(["reference", str(out)]) == 0
    ref = json.loads(out.read_text())
    assert list(ref["labs"]) == ["00_environment"] and list(ref["labs"]["00_environment"]["metrics"]) == ["environment.add_gbps"]
    printed = capsys.readouterr().out
    assert "02_wavefront_vs_warp: left out of the reference (**FAILED**: TypeError: x)" in printed
    assert "03_bf16_matmul: left out of the reference (not run in the latest run" in printed


def test_a_figure_recorded_after_its_measurement_is_judged_over_the_measurement(build_dir, monkeypatch):
    """A load level's percentiles are recorded a few milliseconds apart, after the minutes the level ran: their
    window is widened back to the last figure's moment that leaves enough time, so the load under it counts."""
    import time

    from utils import machine

    busy = {"cores": 2, "load1": 3.0, "busy_s": 100.0, "own_s": 40.0}
    monkeypatch.setattr(machine, "cpu_state", lambda: dict(busy))
    rec = record.start("05_llm_serving", devices.cpu_info())
    rec._marks.insert(0, {"time": time.time() - 60, "cpu": dict(busy, busy_s=0.0, own_s=0.0)})   # the level began 60 s ago
    m = rec.metric("ttft_p50_ms", 80.0, "ms", label="TTFT p50", size="c=1", samples=40)
    assert m["verdict"] == "unreliable" and m["reasons"][0].startswith("other processes used 50% of the 2 CPU cores")


def test_nvml_is_read_through_nvidia_ml_py_and_initialised_once(monkeypatch):
    """The NVML reader on a machine without NVIDIA's driver: a stand-in for nvidia-ml-py's module, two snapshots."""
    import sys
    import types

    from utils import backend, machine

    calls = []
    fake = types.SimpleNamespace(
        NVML_CLOCK_SM=0, NVML_CLOCK_MEM=1, NVML_TEMPERATURE_GPU=0,
        nvmlInit=lambda: calls.append("init"), nvmlDeviceGetHandleByIndex=lambda i: ("gpu", i),
        nvmlDeviceGetClockInfo=lambda h, kind: (1980, 2619)[kind], nvmlDeviceGetMaxClockInfo=lambda h, kind: 1980,
        nvmlDeviceGetTemperature=lambda h, kind: 41, nvmlDeviceGetPowerUsage=lambda h: 120_000,
        nvmlDeviceGetEnforcedPowerLimit=lambda h: 700_000, nvmlDeviceGetCurrentClocksEventReasons=lambda h: 0x4,
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=97),
        nvmlDeviceGetComputeRunningProcesses=lambda h: [types.SimpleNamespace(pid=4242)])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(machine, "_nvml_ready", False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    first, second = machine.gpu_state(backend.CUDA), machine.gpu_state(backend.CUDA)
    assert first == second == {"source": "nvml", "sm_clock_mhz": 1980, "max_sm_clock_mhz": 1980,
                               "memory_clock_mhz": 2619, "temperature_c": 41, "power_w": 120.0,
                               "power_limit_w": 700.0, "slowdown": ["power cap"], "utilization_pct": 97,
                               "pids": [4242]}
    assert calls == ["init"]


def test_a_copy_without_git_names_the_commit_it_was_sent_as(monkeypatch):
    """The GPU machine gets the working tree without .git: the record and the executed copies take the commit from
    $COURSE_COMMIT, and say "unknown" (None), not "clean", for uncommitted changes git cannot see."""
    monkeypatch.setattr(executed, "git", lambda *args: None)
    monkeypatch.setenv("COURSE_COMMIT", "0123abc")
    assert executed.commit() == "0123abc" and executed.uncommitted_changes() is None
    # a repository of the machine's own around the copy: its status says nothing about the named commit
    monkeypatch.setattr(executed, "git", lambda *args: "ffff999" if args[0] == "rev-parse" else " M utils/x.py")
    assert executed.commit() == "0123abc" and executed.uncommitted_changes() is None
    monkeypatch.setenv("COURSE_COMMIT", "ffff999")
    assert executed.uncommitted_changes() is True
    monkeypatch.delenv("COURSE_COMMIT")
    monkeypatch.setattr(executed, "git", lambda *args: None)
    assert executed.commit() is None


# --- how many GPUs ran a lab: the sidecar's count, the record it is set beside, the records and copies that name it ---

LINK = "GPU0-GPU1 NV18"


def _write_record(folder, stem, device, gpus=None, value=100.0, labs=("06_multi_gpu",)):
    """A format-2 reference record in `folder`: each of `labs` with one figure, allreduce bus bandwidth at 256 MiB."""
    data = {"format": 2, "device": device, "arch": "sm_90", **({"gpus": gpus} if gpus else {}), "labs": {
        lab: {"date": "2026-11-27", "commit": "feedc0ffee", "software": {"torch": "2.11"}, "metrics": {
            "allreduce_busbw": {"value": value, "unit": "GB/s", "size": "bytes=268435456", "label": "all-reduce"}}}
        for lab in labs}}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{stem}.json").write_text(json.dumps(data))


def _lab06(h100, gpus, value=100.0):
    rec = record.start("06_multi_gpu", h100)
    if gpus > 1:
        rec.ran_on(gpus, topology=LINK)
    rec.metric("allreduce_busbw", value, "GB/s", label="all-reduce", size={"bytes": 1 << 28})
    return rec


@pytest.fixture
def refs(tmp_path, monkeypatch):
    """An empty reference folder of the test's own (utils/reference/ as record.REFERENCE_DIR)."""
    folder = tmp_path / "reference"
    folder.mkdir()
    monkeypatch.setattr(record, "REFERENCE_DIR", folder)
    return folder


def _section(md, lab):
    return md.split(f"## {lab}\n")[1].split("\n## ")[0].lstrip()


def test_a_sidecar_says_how_many_gpus_its_lab_used(build_dir, h100):
    rec = record.start("06_multi_gpu", h100)
    path = build_dir / "results" / "06_multi_gpu.json"
    assert json.loads(path.read_text())["gpus"] == 1
    rec.ran_on(2, topology=LINK)                     # saved at once, like everything else
    saved = json.loads(path.read_text())
    assert saved["gpus"] == 2 and saved["topology"] == LINK and record.gpus_of(saved) == 2
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="whole number of GPUs"):
            rec.ran_on(bad)
    cpu = record.start("06_multi_gpu", devices.cpu_info())
    cpu.ran_on(2)                                    # two gloo ranks on a CPU: processes, not GPUs
    assert json.loads(path.read_text())["gpus"] == 0
    assert record.gpus_of({"device": {"name": h100.name, "backend": "cuda"}}) == 1      # a sidecar from before
    assert record.gpus_of({"device": {"name": "x86_64", "backend": "cpu"}}) == 0
    assert record.device_label(h100.name, 2) == f"2x {h100.name}" and record.device_label(h100.name, 1) == h100.name


def test_find_reference_prefers_the_same_gpu_at_the_same_count(refs, h100):
    _write_record(refs, "h100", h100.name, labs=("01_vector_add", "06_multi_gpu"))
    (refs / "h100_attention_profile.json").write_text(json.dumps({"what": "a profile", "device": h100.name}))
    found, stem, note = record.find_reference(h100.name, 1)
    assert (stem, note) == ("h100", None) and "gpus" not in found         # a record without "gpus" is of one GPU
    assert record.find_reference(None, 0)[1:] == ("h100", None)            # a CPU: the course's record, no note
    assert record.find_reference("AMD EPYC 9654", 0)[1:] == ("h100", None)
    _, stem, note = record.find_reference(h100.name, 2)
    assert stem == "h100" and note == f"no 2-GPU record of {h100.name}: compared with the course's 1-GPU record " \
                                      f"({refs / 'h100.json'})"
    _write_record(refs, "h100x2", h100.name, gpus=2, value=300.0)
    found, stem, note = record.find_reference(h100.name, 2)
    assert stem == "h100x2" and note is None and found["gpus"] == 2
    _, stem, note = record.find_reference(h100.name, 4)
    assert stem == "h100x2" and note == f"no 4-GPU record of {h100.name}: compared with the course's 2-GPU record " \
                                        f"({refs / 'h100x2.json'})"
    assert record.find_reference(h100.name, 4, lab="01_vector_add")[1] == "h100"   # h100x2 holds lab 06 alone
    _, stem, note = record.find_reference("AMD Instinct MI300X", 2)
    assert stem == "h100" and f"course's 1-GPU record of {h100.name}" in note
    (refs / "h200x2.json").write_text('{"format": 2, "dev')
    from utils.base import state
    with pytest.raises(state.CorruptStateError, match="h200x2.json is corrupt"):
        record.find_reference(h100.name, 2)


def test_a_two_gpu_run_of_lab_06_is_set_beside_the_two_gpu_record(build_dir, h100, refs):
    _write_record(refs, "h100", h100.name, value=100.0, labs=("01_vector_add", "06_multi_gpu"))
    _write_record(refs, "h100x2", h100.name, gpus=2, value=300.0)
    _lab06(h100, 2, value=290.0)
    record.start("01_vector_add", h100).metric("allreduce_busbw", 95.0, "GB/s", label="all-reduce",
                                               size={"bytes": 1 << 28})
    md = report.build_report().read_text()
    lab06 = _section(md, "06_multi_gpu")
    assert f"| figure | size | yours | 2x {h100.name} ({refs / 'h100x2.json'}) | verdict |" in lab06
    assert f"**Reference:** 2x {h100.name} ({refs / 'h100x2.json'}), run of 2026-11-27" in lab06
    assert f"on 2 GPUs ({LINK})" in lab06 and "*Reference: no" not in lab06
    assert "| 290 GB/s | 300 GB/s | as expected (0.97x the reference) |" in lab06
    lab01 = _section(md, "01_vector_add")        # a one-GPU lab of the same run: the one-GPU record, as before
    assert f"| figure | size | yours | {h100.name} ({refs / 'h100.json'}) | verdict |" in lab01
    assert "as expected (0.95x the reference)" in lab01
    assert f"06_multi_gpu beside 2x {h100.name}" in md.split("## Labs")[0]


def test_a_two_gpu_run_without_a_two_gpu_record_falls_back_with_a_note(build_dir, h100, refs):
    _write_record(refs, "h100", h100.name, value=100.0)
    _lab06(h100, 2, value=290.0)
    lab06 = _section(report.build_report().read_text(), "06_multi_gpu")
    assert lab06.startswith(f"*Reference: no 2-GPU record of {h100.name}: compared with the course's 1-GPU record "
                            f"({refs / 'h100.json'}).*")
    assert f"| yours | {h100.name} ({refs / 'h100.json'}) |" in lab06
    row = next(line for line in lab06.splitlines() if line.startswith("| all-reduce"))
    assert "100 GB/s" in row and "no reference at this size or device to judge by" in row   # not 2.9x "suspicious"


def test_a_four_gpu_run_with_only_a_two_gpu_record_names_what_it_used(build_dir, h100, refs):
    _write_record(refs, "h100", h100.name, value=100.0)
    _write_record(refs, "h100x2", h100.name, gpus=2, value=300.0)
    _lab06(h100, 4, value=500.0)
    lab06 = _section(report.build_report().read_text(), "06_multi_gpu")
    assert lab06.startswith(f"*Reference: no 4-GPU record of {h100.name}: compared with the course's 2-GPU record "
                            f"({refs / 'h100x2.json'}).*")
    assert f"| yours | 2x {h100.name} ({refs / 'h100x2.json'}) |" in lab06 and "on 4 GPUs" in lab06
    assert "**suspicious**" not in lab06


def test_a_reference_record_holds_one_gpu_count(build_dir, h100, capsys):
    _lab06(h100, 2)
    two = report.make_reference(record.load_results(), commit="c2")
    assert two["gpus"] == 2 and two["topology"] == LINK and two["labs"]["06_multi_gpu"]["topology"] == LINK
    record.start("01_vector_add", h100).metric("add_gbps", 3000.0, "GB/s", label="add", size="n=1")
    with pytest.raises(ValueError, match=r"different numbers of GPUs \(1 GPU: 01_vector_add; 2 GPUs: 06_multi_gpu\)"):
        report.make_reference(record.load_results())
    (build_dir / "results" / "01_vector_add.json").unlink()
    _lab06(h100, 1)
    one = report.make_reference(record.load_results(), commit="c1")
    assert one["gpus"] == 1 and "topology" not in one
    with pytest.raises(ValueError, match="cannot merge a 2-GPU run into a 1-GPU reference"):
        report.merge_reference(one, two)
    legacy = {k: v for k, v in one.items() if k != "gpus"}          # h100.json as committed: no "gpus", one GPU
    assert report.merge_reference(legacy, one)["gpus"] == 1
    with pytest.raises(ValueError, match="cannot merge a 1-GPU run into a 2-GPU reference"):
        report.merge_reference(two, one)
    (build_dir / "status.json").write_text(json.dumps({"run": {"id": None, "state": "finished"}, "labs": {
        "06_multi_gpu": {"status": "ok", "run_id": None}}}))
    out = build_dir / "h100x2.json"
    assert report.main(["reference", str(out), "--gpus", "2"]) == 2 and not out.exists()
    assert "is a record of 2 GPUs, but this run's labs used 1" in capsys.readouterr().err


def test_an_executed_copy_of_a_two_gpu_run_is_stamped_with_its_gpus(tmp_path, h100):
    import nbformat

    from utils.machinery import site

    sol = tmp_path / "solutions" / "06_multi_gpu.ipynb"
    sol.parent.mkdir()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# lab 06"), nbformat.v4.new_code_cell("1")])
    nbformat.write(nb, sol)
    run = tmp_path / "build" / "executed" / sol.name
    run.parent.mkdir(parents=True)
    nbformat.write(nb, run)
    sidecar = tmp_path / "build" / "results" / "06_multi_gpu.json"
    sidecar.parent.mkdir()
    sidecar.write_text(json.dumps({"device": {"name": h100.name, "backend": "cuda"}, "gpus": 2, "topology": LINK,
                                   "software": {"torch": "2.11"}, "run_id": "r2"}))
    stamp = nbformat.read(executed.make_copy(run, tmp_path / "out", solution=sol), as_version=4).metadata[executed.KEY]
    assert stamp["device"] == f"2x {h100.name}" and stamp["gpus"] == 2
    assert f"Executed on 2x {h100.name}" in site.provenance("06_multi_gpu", stamp, None)
    assert f"06_multi_gpu.ipynb` (2x {h100.name}, commit" in executed.describe(tmp_path / "out", sol.parent)[0]
    sidecar.write_text(json.dumps({"device": {"name": h100.name, "backend": "cuda"}, "software": {}}))  # one GPU
    stamp = nbformat.read(executed.make_copy(run, tmp_path / "out", solution=sol), as_version=4).metadata[executed.KEY]
    assert stamp["device"] == h100.name and stamp["gpus"] == 1


def test_a_prose_only_change_reaches_the_executed_copy_and_a_code_change_does_not(tmp_path, h100):
    """`executed prose`: a copy whose code cells are its solution's takes the new markdown (its outputs, injected
    parameters and the commit it ran at stay; the commit of the prose is added) and is current again; a changed
    code cell leaves it as it was, stale."""
    import nbformat

    new = nbformat.v4
    sol = tmp_path / "solutions" / "01_vector_add.ipynb"
    sol.parent.mkdir()
    cells = [new.new_markdown_cell("# lab 01", id="m1"), new.new_code_cell("N = 1", id="p1"),
             new.new_code_cell("print(N)", id="c1"), new.new_markdown_cell("It prints 1.", id="m2")]
    nbformat.write(new.new_notebook(cells=cells), sol)
    run = tmp_path / "build" / "executed" / sol.name
    run.parent.mkdir(parents=True)
    ran = new.new_notebook(cells=[cells[0], cells[1],
                                  new.new_code_cell("N = 1", id="inj", metadata={"tags": ["injected-parameters"]}),
                                  new.new_code_cell("print(N)", id="c1", outputs=[new.new_output("stream", text="1\n")]),
                                  cells[3]])
    nbformat.write(ran, run)
    copy = executed.make_copy(run, tmp_path / "out", solution=sol, device=h100.name)
    executed_at = nbformat.read(copy, as_version=4).metadata[executed.KEY]["commit"]
    nb = nbformat.read(sol, as_version=4)
    nb.cells[3].source = "It prints one."
    nb.cells.insert(1, new.new_markdown_cell("A new paragraph.", id="m0"))
    nbformat.write(nb, sol)
    assert "01_vector_add" in executed.stale(tmp_path / "out", sol.parent)
    assert executed.take_prose(copy, sol)
    out = nbformat.read(copy, as_version=4)
    assert [c.get("id") for c in out.cells] == ["m1", "m0", "p1", "inj", "c1", "m2"]
    assert out.cells[-1].source == "It prints one." and out.cells[4].outputs[0]["text"] == "1\n"
    stamp = out.metadata[executed.KEY]
    assert stamp["commit"] == executed_at and "prose_commit" in stamp
    assert executed.stale(tmp_path / "out", sol.parent) == {}
    assert not executed.take_prose(copy, sol)                      # nothing new
    nb.cells[3].source = "print(N + 1)"                            # code: only a GPU run brings it
    nbformat.write(nb, sol)
    assert not executed.take_prose(copy, sol)
    assert "01_vector_add" in executed.stale(tmp_path / "out", sol.parent)


def test_state_files_of_the_wrong_shape_are_named_and_the_report_still_builds(build_dir, h100):
    """Valid JSON of the wrong shape (a hand edit, another program's file): named in a warning, left out."""
    record.start("00_environment", h100).metric("environment.add_gbps", 3000.0, "GB/s", label="add", size="n=1")
    (build_dir / "results" / "01_vector_add.json").write_text(json.dumps({"lab": "01_vector_add", "metrics": [1]}))
    (build_dir / "results" / "02_wavefront_vs_warp.json").write_text(json.dumps({"metrics": {}, "figures": "x"}))
    (build_dir / "status.json").write_text(json.dumps({"run": "x", "labs": {"00_environment": 3}}))
    with pytest.warns(UserWarning) as caught:
        md = report.build_report().read_text()
    said = " ".join(str(w.message) for w in caught)
    assert "01_vector_add.json has the wrong shape ('metrics' is not an object of objects)" in said
    assert "02_wavefront_vs_warp.json has the wrong shape ('figures' is not a list)" in said
    assert "status.json has parts of the wrong shape (00_environment)" in said
    assert "3,000 GB/s" in md


def test_a_value_above_its_peak_is_drawn_hollow_with_the_reason():
    """Noise is not drawn as data: a bar above its peak (lab 00's "107 % of peak") or one given a reason is hollow,
    hatched, and says why; a plausible one is solid."""
    import matplotlib

    matplotlib.use("Agg")
    fig = plots.achieved_vs_peak([("add", 3.2, 3.0, "TB/s"), ("copy", 2.5, 3.0, "TB/s"),
                                  ("mm", 500.0, 989.0, "TFLOP/s", "the clock fell during the measurement")])
    above, fine, told = fig.axes
    assert above.patches[0].get_facecolor()[3] == 0 and above.patches[0].get_hatch() == "//"
    assert "107% of the peak: above it" in above.get_xlabel()
    assert fine.patches[0].get_facecolor()[3] == 1 and fine.get_xlabel() == ""
    assert "the clock fell" in told.get_xlabel() and told.patches[0].get_hatch() == "//"


def test_a_lab_killed_while_running_is_not_said_to_be_not_run(build_dir, h100):
    build_dir.mkdir(parents=True, exist_ok=True)
    (build_dir / "status.json").write_text(json.dumps({
        "run": {"id": "new", "state": "running"},
        "labs": {"04_flash_attention": {"status": "running", "run_id": "new"},
                 "05_llm_serving": {"status": "not run", "run_id": "new"}}}))
    md = report.build_report().read_text()
    rows = {line.split(" | ")[0].lstrip("| "): line for line in md.splitlines() if line.startswith("| 0")}
    assert "**STOPPED WHILE RUNNING**" in rows["04_flash_attention"]
    assert "**NOT RUN**: the run ended before it" in rows["05_llm_serving"]


def test_a_run_all_in_work_keeps_its_figures_apart_from_make_runs(build_dir, h100, tmp_path, monkeypatch):
    from utils.base.paths import results_dir

    assert results_dir() == build_dir / "results"
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")              # the learner's Run All in JupyterLab
    assert results_dir() == build_dir / "results-work"
    record.start("00_environment", h100).metric("environment.add_gbps", 1.0, "GB/s", label="add", size="n=1")
    assert (build_dir / "results-work" / "00_environment.json").exists()
    assert not (build_dir / "results" / "00_environment.json").exists()
    monkeypatch.chdir(tmp_path)
    assert "recorded their own figures (00_environment) in `build/results-work/`" in report.build_report().read_text()


def test_a_sweep_point_that_fails_its_validity_test_is_drawn_hollow_with_its_reason():
    """Lab 01's sweep: noise (a timing whose samples disagree) is never drawn as data."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from utils import plots, timing

    fig, ax = plt.subplots()
    steady = timing.Timing((1.0, 1.0, 1.01, 0.99, 1.0), "perf_counter")
    noisy = timing.Timing((1.0, 3.0, 0.5, 2.0, 1.0), "perf_counter")
    why = plots.line_with_doubts(ax, [1, 2], [5.0, 6.0], [record.timing_problems(t) for t in (steady, noisy)],
                                 label="torch.add", x_name="bytes moved")
    assert why == ["torch.add at bytes moved 2: spread 100% (IQR/median) above 25%"]
    hollow = [line for line in ax.lines if line.get_markerfacecolor() == "white"]
    assert len(hollow) == 1 and list(hollow[0].get_xdata()) == [2]
    plt.close(fig)


def test_a_roofline_point_or_bar_whose_figure_is_unreliable_is_drawn_hollow_with_its_reasons(tmp_path):
    """Labs 00 and 03: a scatter point and a bar take the recorder's verdict (Recorder.doubt), not only the peak."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from utils import plots, timing

    rec = record.start("00_environment", devices.cpu_info(), root=tmp_path)
    rec.metric("t.steady", 5.0, "GB/s", label="steady", size="n=1",
               timing=timing.Timing((1.0, 1.0, 1.01, 0.99, 1.0), "perf_counter"))
    rec.metric("t.noisy", 6.0, "GB/s", label="noisy", size="n=1",
               timing=timing.Timing((1.0, 3.0, 0.5, 2.0, 1.0), "perf_counter"))
    assert rec.doubt("t.steady") is None and "spread" in rec.doubt("t.noisy")
    fig, ax = plt.subplots()
    why = plots.points_with_doubts(ax, [1.0, 2.0], [5.0, 6.0], [rec.doubt("t.steady"), rec.doubt("t.noisy")],
                                   label="measured", names=["add", "matmul"])
    assert why == [f"measured, matmul: {rec.doubt('t.noisy')}"]
    hollow = [line for line in ax.lines if line.get_markerfacecolor() == "white"]
    assert len(hollow) == 1 and list(hollow[0].get_xdata()) == [2.0]
    plt.close(fig)
    fig = plots.achieved_vs_peak([("noisy", 6.0, 100.0, "GB/s", rec.doubt("t.noisy"))])
    bar = fig.axes[0].patches[0]
    assert bar.get_facecolor()[3] == 0 and "unreliable" in fig.axes[0].get_xlabel()
    plt.close(fig)
