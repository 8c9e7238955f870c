"""utils.record and utils.machinery.report: sidecars, the course report and reference records."""
import json

import pytest

from utils import device as devices
from utils import plots, record
from utils.machinery import report


@pytest.fixture
def h100(recorded):
    r = recorded["h100"]
    return devices.from_properties(r["properties"], cuda=r["cuda"])


def test_recorder_writes_a_sidecar_and_restarts_clean(build_dir, h100):
    rec = record.start("99_demo", h100)
    rec.metric("demo.add_gbps", 3000.0, "GB/s", peak=h100.peak_bandwidth_gbps, label="add")
    data = json.loads((build_dir / "results" / "99_demo.json").read_text())
    assert data["device"]["arch"] == "sm_90" and "torch" in data["software"]
    m = data["metrics"]["demo.add_gbps"]
    assert m["fraction_of_peak"] == pytest.approx(3000 / 3350) and m["unit"] == "GB/s"
    record.start("99_demo", h100)          # a re-run starts from nothing
    assert json.loads((build_dir / "results" / "99_demo.json").read_text())["metrics"] == {}


def test_metric_keys_are_checked(build_dir, h100):
    rec = record.start("99_demo", h100)
    with pytest.raises(ValueError, match="must look like"):
        rec.metric("Add GB/s", 1.0, "GB/s")


def test_figures_are_saved_and_listed(build_dir, h100):
    import matplotlib

    matplotlib.use("Agg")
    from utils import plots

    rec = record.start("99_demo", h100)
    fig = plots.achieved_vs_peak([("add", 3000.0, 3350.0, "GB/s")], title="demo")
    path = rec.figure(fig, "bars")
    assert path.exists() and path.stat().st_size > 1000
    assert rec.data["figures"] == ["99_demo/bars.png"]


def test_report_shows_figures_peaks_reference_and_failures(build_dir, h100):
    rec = record.start("00_environment", h100)
    rec.metric("environment.add_gbps", 3041.5, "GB/s", peak=3350, label="torch.add")
    (build_dir / "status.json").write_text(json.dumps({"run": {"id": "r1", "state": "finished"}, "labs": {
        "00_environment": {"status": "ok", "run_id": "r1", "executed": "build/executed/00_environment.ipynb"},
        "01_vector_add": {"status": "failed", "run_id": "r1", "error": "RuntimeError: boom", "seconds": 3.5,
                          "executed": "build/executed/01_vector_add.ipynb"}}}))
    md = report.build_report().read_text()
    assert "| torch.add (`environment.add_gbps`) | not recorded | 3,042 | GB/s | 91% |" in md
    assert "**FAILED**: RuntimeError: boom | 3.5 | build/executed/01_vector_add.ipynb" in md
    assert "AMD Instinct MI300X | 1,307 | 163.4 | 5,300 | 192" in md
    assert "NVIDIA H100 SXM | 989.4 | 67 | 3,350 | 80" in md
    html = (build_dir / "report.html").read_text()
    assert "<table>" in html and "FAILED" in html


def test_make_reference_from_sidecars(build_dir, h100):
    record.start("00_environment", h100).metric("environment.add_gbps", 3000.0, "GB/s", peak=3350)
    record.start("01_vector_add", h100).metric("vector_add.torch_gbps", 3010.0, "GB/s")
    ref = report.make_reference(record.load_results())
    assert ref["device"] == "NVIDIA H100 80GB HBM3" and ref["arch"] == "sm_90"
    assert ref["metrics"] == {"environment.add_gbps": {"value": 3000.0, "unit": "GB/s", "peak": 3350.0,
                                                       "fraction_of_peak": pytest.approx(3000 / 3350)},
                              "vector_add.torch_gbps": {"value": 3010.0, "unit": "GB/s"}}
    assert set(ref) >= {"device", "date", "software", "metrics"}


def test_merge_reference_replaces_only_the_labs_that_ran_again(build_dir, h100):
    record.start("00_environment", h100).metric("environment.add_gbps", 3000.0, "GB/s")
    record.start("05_llm_serving", h100).metric("serving.decode_b1_tokens_per_s", 100.0, "tokens/s")
    old = report.make_reference(record.load_results())
    old["software"] = {"transformers": "5.17.0"}
    record.start("05_llm_serving", h100).metric("serving.decode_b1_tokens_per_s", 120.0, "tokens/s")
    (build_dir / "results" / "00_environment.json").unlink()
    new = report.make_reference(record.load_results())
    merged = report.merge_reference(old, new)
    assert merged["metrics"] == {"environment.add_gbps": {"value": 3000.0, "unit": "GB/s"},
                                 "serving.decode_b1_tokens_per_s": {"value": 120.0, "unit": "tokens/s"}}
    assert merged["labs"] == ["00_environment", "05_llm_serving"]
    assert [r["labs"] for r in merged["runs"]] == [["00_environment"], ["05_llm_serving"]]
    assert merged["runs"][0]["software"] == {"transformers": "5.17.0"}
    with pytest.raises(ValueError, match="cannot merge"):
        report.merge_reference(dict(old, device="AMD Instinct MI300X"), new)


def test_make_reference_refuses_mixed_devices(build_dir, h100):
    record.start("00_environment", h100).metric("environment.add_gbps", 3000.0, "GB/s")
    record.start("01_vector_add", devices.cpu_info()).metric("vector_add.torch_gbps", 30.0, "GB/s")
    with pytest.raises(ValueError, match="several devices"):
        report.make_reference(record.load_results())


def test_committed_h100_reference_is_well_formed():
    ref = record.load_reference("h100")
    assert ref is not None, "utils/reference/h100.json is missing"
    assert "H100" in ref["device"] and ref["arch"] == "sm_90"
    assert ref["software"]["torch"] and ref["date"]
    for key, m in ref["metrics"].items():
        assert {"value", "unit"} <= set(m) <= {"value", "unit", *report.REFERENCE_KEYS}, key
        assert isinstance(m["value"], float), key
    assert 0 <= ref["metrics"]["timing.max_rel_diff_vs_do_bench"]["value"] < 0.05
    assert ref["metrics"]["environment.matmul_tflops"]["value"] > 100


def test_reference_figures_stand_beside_the_learners_only_at_the_same_size(build_dir, h100, monkeypatch):
    """Like with like: a reference figure is in the learner's row only when both recorded the same size;
    at another size, or with no size recorded, it is listed apart, with its own size."""
    monkeypatch.setattr(report, "load_reference", lambda name="h100": {
        "device": "NVIDIA H100 80GB HBM3", "arch": "sm_90", "date": "2026-11-22", "software": {"torch": "2.11"},
        "metrics": {"vector_add.torch_gbps": {"value": 3045.1, "unit": "GB/s", "size": "n=268435456"},
                    "vector_add.small_gbps": {"value": 1500.0, "unit": "GB/s", "size": "n=1048576",
                                              "fraction_of_peak": 0.45},
                    "vector_add.old_gbps": {"value": 2900.0, "unit": "GB/s"},
                    "vector_add.hand_gbps": {"value": 3054.5, "unit": "GB/s", "size": "n=268435456"},
                    "attention.triton_tflops": {"value": 406.6, "unit": "TFLOP/s"}}})
    rec = record.start("01_vector_add", devices.cpu_info())
    rec.metric("vector_add.torch_gbps", 145.1, "GB/s", label="torch.add", size={"n": 4194304})
    rec.metric("vector_add.small_gbps", 140.0, "GB/s", size="n=1048576")
    rec.metric("vector_add.old_gbps", 130.0, "GB/s")
    md = report.build_report().read_text()
    assert "| torch.add (`vector_add.torch_gbps`) | n=4194304 | 145.1 | GB/s | – | other size, below |" in md
    assert "| `vector_add.small_gbps` | n=1048576 | 140 | GB/s | – | 1,500 (45%) |" in md
    assert "| `vector_add.old_gbps` | not recorded | 130 | GB/s | – | size not recorded, below |" in md
    below = md.split("not comparable with yours row by row")[1].split("##")[0]
    assert "| `vector_add.torch_gbps` | n=268435456 | 3,045 | GB/s | – |" in below     # other size
    assert "| `vector_add.hand_gbps` | n=268435456 | 3,054 | GB/s | – |" in below      # GPU-only figure
    assert "`vector_add.old_gbps`" in below and "`vector_add.small_gbps`" not in below
    assert "figures with no counterpart in this run" in md and "| `attention.triton_tflops` | not recorded | 406.6 | TFLOP/s |" in md
    # which device and run each column comes from
    assert "**Yours:** " + devices.cpu_info().name in md and "run `outside make run`" in md
    assert "**Reference:** NVIDIA H100 80GB HBM3, run of 2026-11-22, torch 2.11" in md


def test_metric_size_is_recorded_in_sidecar_and_reference(build_dir, h100):
    rec = record.start("01_vector_add", h100)
    rec.metric("vector_add.torch_gbps", 3000.0, "GB/s", size={"n": 1 << 28, "dtype": "fp32"}, label="add")
    assert rec.data["metrics"]["vector_add.torch_gbps"]["size"] == "n=268435456, dtype=fp32"
    ref = report.make_reference(record.load_results())
    assert ref["metrics"]["vector_add.torch_gbps"]["size"] == "n=268435456, dtype=fp32"
    assert report.comparable(rec.data["metrics"]["vector_add.torch_gbps"], ref["metrics"]["vector_add.torch_gbps"])
    assert not report.comparable({"value": 1, "unit": "GB/s"}, {"value": 2, "unit": "GB/s"})   # sizes unknown
    assert not report.comparable({"unit": "GB/s", "size": "n=1"}, {"unit": "TB/s", "size": "n=1"})
    for bad in ("", "  ", 4096, ["n", 1]):
        with pytest.raises(ValueError, match="size="):
            rec.metric("vector_add.x_gbps", 1.0, "GB/s", size=bad)


def test_merged_reference_names_the_run_of_each_lab(build_dir, h100, monkeypatch):
    monkeypatch.setattr(report, "load_reference", lambda name="h100": {
        "device": "NVIDIA H100 80GB HBM3", "arch": "sm_90", "date": "2026-11-23", "software": {"torch": "2.11"},
        "runs": [{"labs": ["00_environment"], "date": "2026-11-22", "software": {"torch": "2.10"}},
                 {"labs": ["05_llm_serving"], "date": "2026-11-23", "software": {"torch": "2.11"}}],
        "metrics": {}})
    record.start("00_environment", h100).metric("environment.add_gbps", 3000.0, "GB/s")
    record.start("05_llm_serving", h100).metric("serving.copy_gbps", 2000.0, "GB/s")
    md = report.build_report().read_text()
    sec00 = md.split("## 00_environment")[1].split("## 05")[0]
    sec05 = md.split("## 05_llm_serving")[1]
    assert "run of 2026-11-22, torch 2.10" in sec00 and "run of 2026-11-23, torch 2.11" in sec05


def test_markdown_table():
    assert plots.markdown_table(["a", "b"], [[1, "x"], [2.5, None]]) == \
        "| a | b |\n|---|---|\n| 1 | x |\n| 2.5 | None |"


def test_report_never_says_ok_for_a_lab_that_did_not_finish_in_the_latest_run(build_dir, h100):
    """An interrupted run: the lab that was running, the labs not reached, and a lab from an earlier run
    are each named as such; only the lab that finished in this run is "ok"."""
    rec = record.start("00_environment", h100)
    rec.metric("environment.add_gbps", 3000.0, "GB/s")
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
    record.start("00_environment", h100).metric("environment.add_gbps", 3000.0, "GB/s")
    (build_dir / "results" / "01_vector_add.json").write_text('{"lab": "01_vector_add", "metr')   # truncated
    (build_dir / "status.json").write_text("{not json")
    with pytest.warns(UserWarning) as caught:
        md = report.build_report().read_text()
    messages = [str(w.message) for w in caught]
    assert any("01_vector_add.json is corrupt" in m for m in messages), messages
    assert any("status.json is corrupt" in m for m in messages), messages
    assert "environment.add_gbps" in md


def test_a_corrupt_reference_names_its_file(tmp_path, monkeypatch):
    from utils.base import state

    monkeypatch.setattr(record, "REFERENCE_DIR", tmp_path)
    (tmp_path / "h100.json").write_text('{"device": "NVIDIA H1')
    with pytest.raises(state.CorruptStateError, match=r"reference record .*h100.json is corrupt"):
        record.load_reference()


def test_a_reference_takes_figures_only_from_labs_that_finished_in_the_latest_run(build_dir, h100, capsys):
    record.start("00_environment", h100).metric("environment.add_gbps", 3000.0, "GB/s")
    record.start("02_wavefront_vs_warp", h100).metric("divergence.time_p1_over_p32", 1.9, "ratio")
    record.start("03_bf16_matmul", h100).metric("matmul.torch_tflops_4096", 700.0, "TFLOP/s")
    (build_dir / "status.json").write_text(json.dumps({"run": {"id": "r2", "state": "finished"}, "labs": {
        "00_environment": {"status": "ok", "run_id": "r2"},
        "02_wavefront_vs_warp": {"status": "failed", "run_id": "r2", "error": "TypeError: x"},
        "03_bf16_matmul": {"status": "ok", "run_id": "r1"}}}))
    out = build_dir / "ref.json"
    assert report.main(["reference", str(out)]) == 0
    ref = json.loads(out.read_text())
    assert ref["labs"] == ["00_environment"] and list(ref["metrics"]) == ["environment.add_gbps"]
    printed = capsys.readouterr().out
    assert "02_wavefront_vs_warp: left out of the reference (**FAILED**: TypeError: x)" in printed
    assert "03_bf16_matmul: left out of the reference (not run in the latest run" in printed
