"""The course report: every lab's figures beside the GPU reference's, with a verdict each, as build/report.md and .html.

`make run` calls `build_report()`, which reads every sidecar under `build/results/` (`utils.record`) and the
harness's `status.json`: each lab's status, seconds and peak memory; its warnings; each figure with its size,
spread and the machine's state, beside the same lab's figure in the reference record `utils.record.find_reference`
picks for it (the course's record of the same GPU and GPU count, e.g. `utils/reference/h100x2.json` for lab 06 on
two H100s; else the H100 reference `utils/reference/h100.json`, with a note saying so) at the same size, or in a
size-independent form (fraction of peak) with both sizes shown; and a one-word verdict (as expected / slow /
suspicious / unreliable, with the reason).
`python -m utils.machinery.report reference OUT.json [--merge] [--gpus N]` turns the sidecars of a real run into a
reference record: each lab's reliable figures under that lab, and the number of GPUs the run used; `--merge`
replaces only the labs this run executed, and joins a lab's figures with those of an earlier run at the same commit
(one lab run once per parameter set, e.g. lab 05 once per serving engine).
"""
from __future__ import annotations

import argparse
import math
import sys
import warnings
from pathlib import Path

import markdown

from utils.base import state
from utils.base.paths import build_dir
from utils.device import spec
from utils.machine import summary
from utils.plots import md_cell
from utils.machinery.executed import commit, describe
from utils.record import (DEFAULT_REFERENCE, device_label, find_reference, gpus_of, load_reference, load_results,
                          record_gpus, reference_metrics, reference_path)

# GPUs whose published peaks every report shows next to the learner's own device.
PUBLISHED = ("mi300x", "h100_sxm")
# Published measurements quoted beside the peaks: the lab's metric key -> (value, unit, source, that figure as a
# reader finds it in the lab's table).
PUBLISHED_MEASURED = {
    "matmul.torch_tflops_8192": (708.0, "TFLOP/s", "AMD's measured max BF16 GEMM on MI300X",
                                 "lab 03's torch.matmul at 8192 x 8192 x 8192"),
}


def load_status(build: Path | None = None) -> dict:
    """The harness's status.json ({"run": ..., "labs": ...}); missing, corrupt (with a warning) or of an
    old format -> no labs."""
    path = Path(build or build_dir()) / "status.json"
    data = state.read_json(path, {}, what="run status", shape=dict)
    if not isinstance(data, dict) or not isinstance(data.get("labs"), dict):
        data = {}
    bad = [k for k, v in data.get("labs", {}).items() if not isinstance(v, dict)]
    if bad or not isinstance(data.get("run", {}), dict):
        warnings.warn(f"run status {path} has parts of the wrong shape ({', '.join(bad) or 'run'}); they are left out "
                      "(the next `make run` rewrites the file)", stacklevel=2)
        data = {"labs": {k: v for k, v in data["labs"].items() if k not in bad},
                **({"run": data["run"]} if isinstance(data.get("run"), dict) else {})}
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
    if status == "running":
        return ("**STOPPED WHILE RUNNING**: the run ended during this lab (killed, or the machine stopped); its "
                "executed notebook shows the last cell it ran")
    if status in ("not run", "pending"):
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


def make_reference(results: dict[str, dict], commit: str | None = None) -> dict:
    """A reference record (`utils/reference/<gpu>.json`, `<gpu>x<N>.json` for N GPUs) from the sidecars of one real
    run: each lab's figures under that lab, with their size, spread and machine state, and the number of GPUs the
    run used (`gpus`; `topology`, the link between them, when a lab recorded it); unreliable figures are left out
    (listed). All labs must come from one device and one GPU count."""
    runs = {lab: r for lab, r in results.items() if r.get("metrics")}
    if not runs:
        raise ValueError("no recorded metrics: run the solutions first (make run)")
    devices = {r["device"]["name"] for r in runs.values() if r.get("device")}
    if len(devices) != 1:
        raise ValueError(f"the results come from several devices or none: {sorted(devices)}")
    counts = {}
    for lab, r in sorted(runs.items()):
        counts.setdefault(gpus_of(r), []).append(lab)
    if len(counts) != 1:
        mix = "; ".join(f"{n} GPU{'s' if n != 1 else ''}: {', '.join(labs)}" for n, labs in sorted(counts.items()))
        raise ValueError(f"the results come from runs on different numbers of GPUs ({mix}): a record holds one count; "
                         "make it from the labs of one count (LABS=solutions/06_multi_gpu.ipynb .ci/gpu-reference "
                         "h100x2 for lab 06 on two GPUs)")
    first = next(iter(runs.values()))
    labs = {}
    for lab, r in sorted(runs.items()):
        kept = {k: m for k, m in r["metrics"].items() if m.get("verdict") != "unreliable"}
        left = {k: "; ".join(m.get("reasons", [])) for k, m in r["metrics"].items() if k not in kept}
        labs[lab] = {"date": r["date"][:10], "run_id": r.get("run_id"), "commit": commit,
                     "software": r["software"], "state": r.get("state", {}), "metrics": kept,
                     **({"parameters": r["parameters"]} if r.get("parameters") else {}),
                     **({"topology": r["topology"]} if r.get("topology") else {}),
                     **({"unreliable": left} if left else {})}
    topology = sorted({r["topology"] for r in runs.values() if r.get("topology")})
    return {"format": 2, "device": first["device"]["name"], "arch": first["device"]["arch"], "gpus": next(iter(counts)),
            **({"topology": "; ".join(topology)} if topology else {}), "labs": labs}


def merge_reference(old: dict, new: dict) -> dict:
    """``old`` with the labs ``new`` ran replaced by ``new``'s (a later run of some labs on the same GPU, at the same
    GPU count), or joined with them where both ran that lab at one commit; every other lab's figures are kept."""
    if old["device"] != new["device"]:
        raise ValueError(f"cannot merge a {new['device']} run into a {old['device']} reference")
    if record_gpus(old) != record_gpus(new):
        raise ValueError(f"cannot merge a {record_gpus(new)}-GPU run into a {record_gpus(old)}-GPU reference "
                         f"({old['device']}): write it to a record of its own (.ci/gpu-reference "
                         f"<gpu>x{record_gpus(new)})")
    if old.get("format") != 2:
        raise ValueError("the old reference is not in the per-lab format (format 2): regenerate it")
    merged = {k: v for k, v in old.items() if k != "labs"}
    merged["gpus"] = record_gpus(new)
    if new.get("topology"):
        merged["topology"] = new["topology"]
    labs = dict(old["labs"])
    for lab, entry in new["labs"].items():
        labs[lab] = _join_runs(labs[lab], entry) if _same_code(labs.get(lab), entry) else entry
    return {**merged, "labs": dict(sorted(labs.items()))}


def _same_code(old: dict | None, new: dict) -> bool:
    return bool(old and old.get("commit") and old.get("commit") == new.get("commit"))


def _join_runs(old: dict, new: dict) -> dict:
    """One lab run twice at one commit with other parameters (lab 05: ENGINE=vllm, then ENGINE=transformers): the
    union of both runs' figures, the later run's where both measured one; each earlier run is listed under
    ``earlier_runs`` with its date, machine state and the figures only it holds (a run whose figures the later run
    all measured again holds none, and is not listed: the lab simply ran again)."""
    only_old = sorted(set(old["metrics"]) - set(new["metrics"]))
    earlier = [*old.get("earlier_runs", []),
               *([{"run_id": old.get("run_id"), "date": old.get("date"), "state": old.get("state", {}),
                   **({"parameters": old["parameters"]} if old.get("parameters") else {}), "metrics": only_old}]
                 if only_old else [])]
    unreliable = {**{k: v for k, v in old.get("unreliable", {}).items() if k not in new["metrics"]},
                  **new.get("unreliable", {})}
    return {**new, "metrics": {**{k: old["metrics"][k] for k in only_old}, **new["metrics"]},
            **({"unreliable": unreliable} if unreliable else {}), **({"earlier_runs": earlier} if earlier else {})}


def _fmt(v: float | None, digits: int = 4) -> str:
    if v is None:
        return "–"
    return f"{v:,.{digits}g}" if abs(v) < 1e4 else f"{v:,.0f}"


def comparable(mine: dict | None, ref: dict | None) -> bool:
    """A reference figure may stand beside the learner's as a plain number only when both were measured at
    a recorded, equal size, in the same unit."""
    return bool(mine and ref and mine.get("size") and mine.get("size") == ref.get("size")
                and mine.get("unit") == ref.get("unit"))


def _frac(m: dict) -> str:
    return f"{m['fraction_of_peak']:.0%}" if "fraction_of_peak" in m else "–"


def _value(m: dict) -> str:
    peak = f" ({_frac(m)} of peak)" if "fraction_of_peak" in m else ""
    return f"{_fmt(m['value'])} {m['unit']}{peak}"


def _theirs(mine: dict, ref: dict | None) -> str:
    """The reference's figure beside the learner's: at the same size, or in a size-independent form."""
    if ref is None:
        return "–"
    if comparable(mine, ref):
        return _value(ref)
    if "fraction_of_peak" in ref:
        return f"{_frac(ref)} of peak at {ref.get('size', 'a size not recorded')} ({_fmt(ref['value'])} {ref['unit']})"
    return f"{_fmt(ref['value'])} {ref['unit']} at {ref.get('size', 'a size not recorded')} (not comparable)"


def verdict(mine: dict, ref: dict | None, device: dict | None, ref_device: str | None, *,
            same_gpus: bool = True) -> str:
    """One word for a learner's figure, with its reason: as expected / slow / suspicious / unreliable. Its value is
    set against the reference's only on the same device (`ref_device`, the record's) at the same GPU count
    (`same_gpus`); otherwise against its fraction of peak."""
    if mine.get("verdict") == "unreliable":
        return "**unreliable**: " + "; ".join(mine.get("reasons", ["no reason recorded"]))
    if mine.get("fraction_of_peak", 0) > 1.05:
        return "**suspicious**: above the published peak (a wrong size, or a measurement that missed the work)"
    if (device or {}).get("backend") == "cpu":
        return "as expected for a CPU (see above the tables)"
    if ref is None:
        return "no reference figure to judge by"
    better = mine.get("better")
    if comparable(mine, ref) and (device or {}).get("name") == ref_device and same_gpus:
        ratio, against = mine["value"] / ref["value"] if ref["value"] else math.inf, "the reference"
        low, high = 0.8, 1.25
    elif "fraction_of_peak" in mine and ref.get("fraction_of_peak"):
        ratio, against = mine["fraction_of_peak"] / ref["fraction_of_peak"], "the reference's fraction of peak"
        low, high = 0.5, 2.0
    else:
        return "no reference at this size or device to judge by"
    if better == "lower":
        ratio = 1 / ratio if ratio else math.inf
    if better is None:
        return "as expected" if low <= ratio <= high else f"differs: {ratio:.2f}x {against}"
    if ratio < low:
        return f"**slow**: {ratio:.2f}x {against}"
    if ratio > high:
        return f"**suspicious**: {ratio:.2f}x {against} (check the size, the clocks and what else ran)"
    return f"as expected ({ratio:.2f}x {against})"


def _device_line(device: dict) -> str:
    if device.get("backend") == "cpu":
        return f"{device['name']} (CPU: PyTorch's CPU kernels and Triton's interpreter, small sizes)"
    return (f"{device['name']} ({device['backend']}, {device['arch']}"
            f"{', warp size ' + str(device['warp_size']) if device.get('warp_size') else ''})")


def _reference_name(reference: dict | None, stem: str) -> str:
    """A record as a lab's table names it: "2x NVIDIA H100 80GB HBM3 (utils/reference/h100x2.json)"."""
    if not reference:
        return "reference"
    return f"{device_label(reference.get('device'), record_gpus(reference))} ({reference_path(stem)})"


def _provenance(r: dict, reference: dict | None, lab: str, stem: str = DEFAULT_REFERENCE) -> str:
    """Which run each column of a lab's table comes from, and the machine's state."""
    sw = r.get("software") or {}
    st = r.get("state") or {}
    gpus = gpus_of(r)
    mine = (f"**Yours:** run `{r.get('run_id') or 'outside make run'}` of {r.get('date', '?')}"
            + (f" on {gpus} GPUs" if gpus > 1 else "")
            + (f" ({r['topology']})" if gpus > 1 and r.get("topology") else "")
            + (f", torch {sw['torch']}" if sw.get("torch") else "")
            + f". Machine at the start: {summary(st.get('start'))}"
            + (f"; at the end: {summary(st['end'])}" if st.get("end") else "") + ".")
    ref = ((reference or {}).get("labs") or {}).get(lab)
    if not ref:
        return mine
    rsw = ref.get("software") or {}
    return (mine + f" **Reference:** {_reference_name(reference, stem)}, run of {ref.get('date', '?')}"
            + (f", commit {str(ref['commit'])[:10]}" if ref.get("commit") else "")
            + (f", torch {rsw['torch']}" if rsw.get("torch") else "")
            + (f"; machine: {summary(ref['state'].get('start'))}" if (ref.get("state") or {}).get("start") else "")
            + (f" ({ref['note']})" if ref.get("note") else "") + ".")


def _peak_memory(st: dict | None) -> str:
    return f"{st['peak_memory_mb']:,.0f} MB" if st and st.get("peak_memory_mb") else "–"


def lab_reference(r: dict | None, lab: str, default: dict | None) -> tuple[dict | None, str, str | None]:
    """(the record a lab's figures are set beside, its stem, a note or None), by `find_reference` from the lab's
    sidecar (its device's name and how many GPUs it used); `default` stands for h100.json (the record the caller
    loaded: CPU runs, one GPU and GPUs without a record of their own)."""
    device = (r or {}).get("device") or {}
    found, stem, note = find_reference(device.get("name"), gpus_of(r), lab=lab)
    return (default, stem, note) if stem == DEFAULT_REFERENCE else (found, stem, note)


def render_markdown(results: dict[str, dict], status: dict, reference: dict | None) -> str:
    """The report's Markdown. `reference`: the course's one-GPU record (h100.json); a lab run on several GPUs is
    set beside the course's record of that many where there is one (`lab_reference`)."""
    run = status.get("run")
    status = status.get("labs", {})
    labs = sorted(set(results) | set(status))
    device = next((r["device"] for r in results.values() if r.get("device")), None)
    out = ["# rocm-cuda-labs: course report", ""]
    if device:
        peaks = ", ".join(f"{label} {_fmt(device[k])}" for k, label in
                          (("peak_bandwidth_gbps", "GB/s"), ("peak_bf16_tflops", "BF16 TFLOP/s"))
                          if device.get(k))
        out.append(f"**Device:** {_device_line(device)}{' · published peaks: ' + peaks if peaks else ''}")
        sw = next(r["software"] for r in results.values() if r.get("software"))
        out += ["", "**Software:** " + ", ".join(f"{k} {v}" for k, v in sw.items())]
    chosen = {lab: lab_reference(results.get(lab), lab, reference) for lab in labs}
    others = [f"{lab} beside {_reference_name(ref, stem)}" for lab, (ref, stem, _) in chosen.items()
              if ref and stem != DEFAULT_REFERENCE]
    if reference:
        out += ["", f"**Reference:** {reference['device']} ({reference['arch']}), `utils/reference/`: each lab's "
                    "figures from its own run (dates below)" + ("; " + "; ".join(others) if others else "")]
    elif others:
        out += ["", "**Reference:** " + "; ".join(others)]
    if run:
        out += ["", f"**Run:** `{run.get('id')}`, started {run.get('started')}, "
                    + {"finished": "finished", "interrupted": f"**interrupted** ({run.get('signal', '')})",
                       "running": "**still running or killed**"}.get(run.get("state"), str(run.get("state")))]
    unreliable = [(lab, k) for lab, r in results.items() for k, m in r.get("metrics", {}).items()
                  if m.get("verdict") == "unreliable"]
    total = sum(len(r.get("metrics", {})) for r in results.values())
    out += ["", f"**Figures:** {total} recorded, {len(unreliable)} unreliable (each with its reason below; an "
                "unreliable figure is never a measurement of the kernel alone)."]
    if (device or {}).get("backend") == "cpu":
        out += ["", "On a CPU the figures come from small sizes, PyTorch's CPU kernels and Triton's interpreter: "
                    "they are set beside the GPU's by fraction of peak, never by value, and judged only as unreliable "
                    "(with the reason) or as expected for a CPU."]
    out += ["", "## Labs", "", "| lab | status | seconds | peak memory | executed notebook |", "|---|---|---|---|---|"]
    for lab in labs:
        st = status.get(lab)
        text = lab_state(st, run) if st else "no status: figures recorded outside `make run`"
        out.append(f"| {lab} | {text} | {st.get('seconds', '–') if st else '–'} | {_peak_memory(st)} | "
                   f"{st.get('executed', '–') if st else '–'} |")
    for lab in labs:
        r = results.get(lab)
        lab_ref, stem, note = chosen[lab]
        ref_metrics = reference_metrics(lab_ref, lab)
        ref_name = _reference_name(lab_ref, stem)
        same_gpus = lab_ref is None or record_gpus(lab_ref) == max(gpus_of(r), 1)
        out += ["", f"## {lab}", ""]
        if note and r and r.get("metrics"):
            out += [f"*Reference: {note}.*", ""]
        if status.get(lab, {}).get("status") in ("failed", "interrupted"):
            out += [f"This lab {status[lab]['status']}: {status[lab].get('error', '')}. "
                    f"Open `{status[lab].get('executed', '')}` to see the last cell it ran.", ""]
        for warning in (r or {}).get("warnings", []):
            out += [f"> **Warning:** {warning}", ""]
        if not r or not r.get("metrics"):
            out.append("No figures recorded.")
            continue
        if run and r.get("run_id") != run.get("id"):
            out += [f"*These figures are from run `{r.get('run_id') or 'outside make run'}` of {r.get('date', '?')}, "
                    "not from the latest run.*", ""]
        out += [_provenance(r, lab_ref, lab, stem), ""]
        out += [f"| figure | size | yours | {ref_name} | verdict |", "|---|---|---|---|---|"]
        lab_device, ref_device = r.get("device") or device, (lab_ref or {}).get("device")
        for key, m in r["metrics"].items():
            yours = (f"unreliable ({_fmt(m['value'])} {m['unit']})" if m.get("verdict") == "unreliable"
                     else _value(m))
            if m.get("samples"):
                yours += f"; n={m['samples']}" + (f", spread {m['spread']:.0%}" if "spread" in m else "")
            cells = [m.get("label", key), m.get("size", "not recorded"), yours, _theirs(m, ref_metrics.get(key)),
                     verdict(m, ref_metrics.get(key), lab_device, ref_device, same_gpus=same_gpus)]
            out.append("| " + " | ".join(md_cell(c) for c in cells) + " |")
        rest = {k: m for k, m in ref_metrics.items() if k not in r["metrics"]}
        if rest:
            out += ["", f"{device_label(lab_ref['device'], record_gpus(lab_ref))}'s other figures of this lab "
                        "(no counterpart in your run):", "",
                    "| figure | size | value |", "|---|---|---|"]
            out += ["| " + " | ".join(md_cell(c) for c in (m.get("label", k), m.get("size", "not recorded"), _value(m)))
                    + " |" for k, m in rest.items()]
        for fig in r.get("figures", []):
            out += ["", f"![{lab}: {Path(fig).stem}](results/{fig})"]
    out += ["", "## Published peaks (dense)", "",
            "| GPU | BF16 TFLOP/s | FP32 TFLOP/s | memory bandwidth GB/s | memory GB |",
            "|---|---|---|---|---|"]
    rows = [spec(k) for k in PUBLISHED]
    if device and device.get("spec") and device["spec"] not in PUBLISHED:
        rows.append(spec(device["spec"]))
    for row in rows:
        out.append(f"| {row['name']} | {_fmt(row['peak_bf16_tflops'])} | {_fmt(row['peak_fp32_tflops'])} | "
                   f"{_fmt(row['peak_bandwidth_gbps'])} | {row['memory_gb']} |")
    for value, unit, source, compare in PUBLISHED_MEASURED.values():
        out.append(f"\nPublished measurement: {source}: {_fmt(value)} {unit} (compare {compare}).")
    return "\n".join(out) + "\n"


def build_report(root: Path | None = None) -> Path:
    """Write `report.md` and `report.html` into the build folder; return the Markdown path."""
    build = Path(root) if root else build_dir()
    results = load_results(build / "results")
    text = render_markdown(results, load_status(build), load_reference())
    mine = sorted(p.stem for p in (build / "results-work").glob("*.json"))
    if mine:
        text += (f"\n*Your notebooks in `work/` recorded their own figures ({', '.join(mine)}) in "
                 "`build/results-work/`, kept apart from `make run`'s, which this report shows.*\n")
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
    ref.add_argument("--gpus", type=int, help="the number of GPUs the record is of: refuse a run of another count")
    args = ap.parse_args(argv)
    if args.cmd == "build":
        print(build_report())
    else:
        results, left = finished_results(load_results(), load_status())
        for lab, why in left.items():
            print(f"{lab}: left out of the reference ({why})")
        try:
            data = make_reference(results, commit=commit())
            if args.gpus is not None and data["gpus"] != args.gpus:
                raise ValueError(f"{args.out} is a record of {args.gpus} GPU{'s' if args.gpus != 1 else ''}, but this "
                                 f"run's labs used {data['gpus']} (lab 06's ranks: its RANKS parameter)")
            for lab, entry in data["labs"].items():
                for key, why in entry.get("unreliable", {}).items():
                    print(f"{lab}: {key} left out of the reference (unreliable: {why})")
            if args.merge and args.out.exists():
                data = merge_reference(state.read_json(args.out, what='reference record', on_corrupt='raise',
                                                       shape=dict), data)
        except ValueError as e:
            print(f"report reference: {e}", file=sys.stderr)
            return 2
        state.write_json(args.out, data)
        print(f"{args.out}: {sum(len(e['metrics']) for e in data['labs'].values())} figures of "
              f"{len(data['labs'])} labs from {device_label(data['device'], data['gpus'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
