"""The course report: every lab's recorded figures (`utils.record`) and the run's status, beside the
GPU reference's figures of the same size, as build/report.md and build/report.html.

`make run` calls `build_report()`, which reads every sidecar under `build/results/` and the harness's
`status.json`: each lab's figures, which device and run they come from, and the H100 reference's figure
of the same size beside them (`utils/reference/h100.json`; a reference figure at another size, or with no
size recorded, is listed apart, never in the same row), and the published peaks.
`python -m utils.machinery.report reference OUT.json` turns the sidecars of a real run into such a reference.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import markdown

from utils.base import state
from utils.base.paths import build_dir
from utils.device import spec
from utils.machinery.executed import describe
from utils.record import load_reference, load_results

# GPUs whose published peaks every report shows next to the learner's own device.
PUBLISHED = ("mi300x", "h100_sxm")
# Published measurements quoted beside the peaks (key -> (value, unit, source)).
PUBLISHED_MEASURED = {
    "matmul.torch_tflops_8192": (708.0, "TFLOP/s", "AMD's measured max BF16 GEMM on MI300X"),
}
# What a reference record keeps of a metric besides value and unit (for like-with-like comparisons).
REFERENCE_KEYS = ("size", "label", "peak", "fraction_of_peak")
def load_status(build: Path | None = None) -> dict:
    """The harness's status.json ({"run": ..., "labs": ...}); missing, corrupt (with a warning) or of an
    old format -> no labs."""
    data = state.read_json(Path(build or build_dir()) / "status.json", {}, what="run status", shape=dict)
    if not isinstance(data, dict) or not isinstance(data.get("labs"), dict):
        data = {}
    data.setdefault("labs", {})
    return data


def lab_state(entry: dict, run: dict | None) -> str:
    """How the report describes a lab's status: never "ok" unless it finished in the latest run."""
    status = entry.get("status", "not run")
    this_run = run is not None and entry.get("run_id") == run.get("id")
    if not this_run:
        return f"not run in the latest run (last: {status} in run {entry.get('run_id', 'unknown')})"
    if status == "failed":
        return f"**FAILED**: {entry.get('error', 'unknown error')}"
    if status == "interrupted":
        return f"**INTERRUPTED**: {entry.get('error', 'interrupted')}"
    if status in ("not run", "running", "pending"):
        return "**NOT RUN**: the run " + ("was interrupted before it" if run.get("state") == "interrupted"
                                          else "ended before it")
    return status


def finished_results(results: dict[str, dict], status: dict) -> tuple[dict[str, dict], dict[str, str]]:
    """(the sidecars of the labs that finished in the latest run, {lab: why} for the others): a reference
    takes no figure from a lab that failed, was interrupted or belongs to an earlier run."""
    kept, left = {}, {}
    for lab, r in results.items():
        why = lab_state(status["labs"].get(lab, {}), status.get("run"))
        if why == "ok":
            kept[lab] = r
        else:
            left[lab] = why
    return kept, left


def make_reference(results: dict[str, dict]) -> dict:
    """A reference record (`utils/reference/<gpu>.json`) from the sidecars of one real run."""
    runs = [r for r in results.values() if r.get("metrics")]
    if not runs:
        raise ValueError("no recorded metrics: run the solutions first (make run)")
    devices = {r["device"]["name"] for r in runs if r.get("device")}
    if len(devices) != 1:
        raise ValueError(f"the results come from several devices or none: {sorted(devices)}")
    first = runs[0]
    metrics = {}
    for r in runs:
        for key, m in r["metrics"].items():
            metrics[key] = {"value": m["value"], "unit": m["unit"],
                            **{k: m[k] for k in REFERENCE_KEYS if k in m}}
    return {
        "device": first["device"]["name"],
        "arch": first["device"]["arch"],
        "date": max(r["date"] for r in runs)[:10],
        "software": first["software"],
        "labs": sorted(r["lab"] for r in runs),
        "metrics": dict(sorted(metrics.items())),
    }


def merge_reference(old: dict, new: dict) -> dict:
    """A reference whose figures of the labs ``new`` ran are replaced by ``new``'s (a later run of
    some labs on the same GPU); ``runs`` says which labs each run covered, when, with what software."""
    if old["device"] != new["device"]:
        raise ValueError(f"cannot merge a {new['device']} run into a {old['device']} reference")
    topics = {key.split(".", 1)[0] for key in new["metrics"]}
    metrics = {k: v for k, v in old["metrics"].items() if k.split(".", 1)[0] not in topics}
    metrics.update(new["metrics"])
    runs = old.get("runs") or [{"labs": old["labs"], "date": old["date"], "software": old["software"]}]
    runs = [dict(r, labs=[lab for lab in r["labs"] if lab not in new["labs"]]) for r in runs]
    runs = [r for r in runs if r["labs"]] + [{"labs": new["labs"], "date": new["date"], "software": new["software"]}]
    return {**old, "date": max(r["date"] for r in runs), "labs": sorted({*old["labs"], *new["labs"]}),
            "runs": runs, "metrics": dict(sorted(metrics.items()))}


def _fmt(v: float | None, digits: int = 4) -> str:
    if v is None:
        return "–"
    return f"{v:,.{digits}g}" if abs(v) < 1e4 else f"{v:,.0f}"


def comparable(mine: dict | None, ref: dict | None) -> bool:
    """A reference figure may stand beside the learner's only when both were measured at a recorded,
    equal size, in the same unit."""
    return bool(mine and ref and mine.get("size") and mine.get("size") == ref.get("size")
                and mine.get("unit") == ref.get("unit"))


def _name(key: str, m: dict) -> str:
    return f"{m['label']} (`{key}`)" if m.get("label") else f"`{key}`"


def _frac(m: dict) -> str:
    return f"{m['fraction_of_peak']:.0%}" if "fraction_of_peak" in m else "–"


def _reference_run(reference: dict, lab: str) -> dict:
    """The run of a (merged) reference record that measured `lab`: its date and software."""
    for run in reference.get("runs") or []:
        if lab in run.get("labs", []):
            return run
    return {"date": reference.get("date"), "software": reference.get("software", {})}


def _provenance(r: dict, reference: dict | None, lab: str) -> str:
    """Which device and run each column of a lab's table comes from."""
    dev = r.get("device") or {}
    sw = r.get("software") or {}
    mine = (f"**Yours:** {dev.get('name', 'unknown device')} ({dev.get('backend', '?')}), "
            f"run `{r.get('run_id') or 'outside make run'}` of {r.get('date', '?')}"
            + (f", torch {sw['torch']}" if sw.get("torch") else ""))
    if not reference:
        return mine + "."
    run = _reference_run(reference, lab)
    rsw = run.get("software") or {}
    return (mine + f". **Reference:** {reference['device']}, run of {run.get('date', '?')}"
            + (f", torch {rsw['torch']}" if rsw.get("torch") else "") + " (`utils/reference/`).")


def render_markdown(results: dict[str, dict], status: dict, reference: dict | None) -> str:
    run = status.get("run")
    status = status.get("labs", {})
    labs = sorted(set(results) | set(status))
    device = next((r["device"] for r in results.values() if r.get("device")), None)
    out = ["# rocm-cuda-labs: course report", ""]
    if device:
        peaks = ", ".join(f"{label} {_fmt(device[k])}" for k, label in
                          (("peak_bandwidth_gbps", "GB/s"), ("peak_bf16_tflops", "BF16 TFLOP/s"))
                          if device.get(k))
        out.append(f"**Device:** {device['name']} ({device['backend']}, {device['arch']}"
                   f"{', warp size ' + str(device['warp_size']) if device.get('warp_size') else ''})"
                   f"{' · published peaks: ' + peaks if peaks else ''}")
        sw = next(r["software"] for r in results.values() if r.get("software"))
        out += ["", "**Software:** " + ", ".join(f"{k} {v}" for k, v in sw.items())]
    if reference:
        out += ["", f"**Reference:** {reference['device']} ({reference['arch']}), "
                    f"run of {reference['date']} (`utils/reference/`)"]
    if run:
        out += ["", f"**Run:** `{run.get('id')}`, started {run.get('started')}, "
                    + {"finished": "finished", "interrupted": f"**interrupted** ({run.get('signal', '')})",
                       "running": "**still running or killed**"}.get(run.get("state"), str(run.get("state")))]
    out += ["", "## Labs", "", "| lab | status | seconds | executed notebook |", "|---|---|---|---|"]
    for lab in labs:
        st = status.get(lab)
        text = lab_state(st, run) if st else "no status: figures recorded outside `make run`"
        out.append(f"| {lab} | {text} | {st.get('seconds', '–') if st else '–'} | "
                   f"{st.get('executed', '–') if st else '–'} |")
    ref_metrics = (reference or {}).get("metrics", {})
    ref_name = reference["device"] if reference else "reference"
    shown = set()
    for lab in labs:
        r = results.get(lab)
        out += ["", f"## {lab}", ""]
        if status.get(lab, {}).get("status") in ("failed", "interrupted"):
            out += [f"This lab {status[lab]['status']}: {status[lab].get('error', '')}. "
                    f"Open `{status[lab].get('executed', '')}` to see the last cell it ran.", ""]
        if not r or not r.get("metrics"):
            out.append("No figures recorded.")
            continue
        if run and r.get("run_id") != run.get("id"):
            out += [f"*These figures are from run `{r.get('run_id') or 'outside make run'}` of {r.get('date', '?')}, "
                    "not from the latest run.*", ""]
        out += [_provenance(r, reference, lab), ""]
        prefixes = {key.split(".", 1)[0] for key in r["metrics"]}
        # the reference's figures of this lab (same key prefix) that are not at the learner's size
        elsewhere = {key: ref for key, ref in ref_metrics.items()
                     if key.split(".", 1)[0] in prefixes and not comparable(r["metrics"].get(key), ref)}
        out += [f"| figure | size | yours | unit | of peak | {ref_name}, same size |", "|---|---|---|---|---|---|"]
        for key, m in r["metrics"].items():
            ref = ref_metrics.get(key)
            if ref is None:
                theirs = "–"
            elif key in elsewhere:
                theirs = "other size, below" if ref.get("size") and m.get("size") else "size not recorded, below"
            else:
                theirs = _fmt(ref["value"]) + (f" ({_frac(ref)})" if "fraction_of_peak" in ref else "")
            out.append(f"| {_name(key, m)} | {m.get('size', 'not recorded')} | {_fmt(m['value'])} | "
                       f"{m['unit']} | {_frac(m)} | {theirs} |")
        if elsewhere:
            out += ["", f"{ref_name}'s figures of this lab at its own sizes (or sizes not recorded): "
                        "not comparable with yours row by row.", "",
                    "| figure | size | value | unit | of peak |", "|---|---|---|---|---|"]
            out += [f"| {_name(key, ref)} | {ref.get('size', 'not recorded')} | {_fmt(ref['value'])} | "
                    f"{ref['unit']} | {_frac(ref)} |" for key, ref in elsewhere.items()]
        shown |= prefixes
        for fig in r.get("figures", []):
            out += ["", f"![{lab}: {Path(fig).stem}](results/{fig})"]
    rest = {k: v for k, v in ref_metrics.items() if k.split(".", 1)[0] not in shown}
    if rest:
        out += ["", f"## {ref_name} figures with no counterpart in this run", "",
                "| figure | size | value | unit |", "|---|---|---|---|"]
        out += [f"| `{key}` | {m.get('size', 'not recorded')} | {_fmt(m['value'])} | {m['unit']} |"
                for key, m in rest.items()]
    out += ["", "## Published peaks (dense)", "",
            "| GPU | BF16 TFLOP/s | FP32 TFLOP/s | memory bandwidth GB/s | memory GB |",
            "|---|---|---|---|---|"]
    rows = [spec(k) for k in PUBLISHED]
    if device and device.get("spec") and device["spec"] not in PUBLISHED:
        rows.append(spec(device["spec"]))
    for row in rows:
        out.append(f"| {row['name']} | {_fmt(row['peak_bf16_tflops'])} | {_fmt(row['peak_fp32_tflops'])} | "
                   f"{_fmt(row['peak_bandwidth_gbps'])} | {row['memory_gb']} |")
    for key, (value, unit, source) in PUBLISHED_MEASURED.items():
        out.append(f"\nPublished measurement: {source}: {_fmt(value)} {unit} (compare `{key}`).")
    return "\n".join(out) + "\n"


def build_report(root: Path | None = None) -> Path:
    """Write `report.md` and `report.html` into the build folder; return the Markdown path."""
    build = Path(root) if root else build_dir()
    results = load_results(build / "results")
    text = render_markdown(results, load_status(build), load_reference())
    text += ("\n## Executed GPU copies (`docs/executed/`)\n\nEach solution as the course's GPU reference run "
             "executed it, outputs and plots kept; a copy older than its solution is marked.\n\n"
             + "\n".join(describe()) + "\n")
    md_path = state.write_text_atomic(build / "report.md", text)
    body = markdown.markdown(text, extensions=["tables"])
    state.write_text_atomic(build / "report.html",
        "<!doctype html><html><head><meta charset='utf-8'><title>rocm-cuda-labs report</title>"
        "<style>body{font-family:sans-serif;max-width:60em;margin:2em auto}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.3em .6em}"
        "img{max-width:100%}</style></head><body>\n" + body + "\n</body></html>\n")
    return md_path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m utils.machinery.report", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("build", help="write build/report.md and build/report.html")
    ref = sub.add_parser("reference", help="write a reference JSON from build/results")
    ref.add_argument("out", type=Path)
    ref.add_argument("--merge", action="store_true",
                     help="keep OUT's figures of the labs this run did not execute")
    args = ap.parse_args(argv)
    if args.cmd == "build":
        print(build_report())
    else:
        results, left = finished_results(load_results(), load_status())
        for lab, why in left.items():
            print(f"{lab}: left out of the reference ({why})")
        data = make_reference(results)
        if args.merge and args.out.exists():
            data = merge_reference(state.read_json(args.out, what='reference record', on_corrupt='raise', shape=dict), data)
        state.write_json(args.out, data)
        print(f"{args.out}: {len(data['metrics'])} metrics from {data['device']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
