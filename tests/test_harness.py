"""The `make run` harness: a failing lab does not stop the others, and the report says so."""
import json

import nbformat
from nbformat.v4 import new_code_cell, new_notebook

from utils import harness


def write_nb(path, *cells):
    nb = new_notebook(cells=[new_code_cell('DEVICE = "auto"', metadata={"tags": ["parameters"]})]
                      + [new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


def test_run_keeps_going_and_reports_the_failure(tmp_path, build_dir, capsys):
    bad = write_nb(tmp_path / "10_broken.ipynb", "raise RuntimeError('the kernel did not compile')")
    good = write_nb(tmp_path / "20_fine.ipynb",
                    "from utils import device, report\n"
                    "rec = report.start('20_fine', device.detect(DEVICE))\n"
                    "rec.metric('fine.value', 42.0, 'GB/s')")
    assert harness.main(["run", "--device", "cpu", str(bad), str(good)]) == 1
    status = json.loads((build_dir / "status.json").read_text())
    assert status["10_broken"]["status"] == "failed"
    assert "RuntimeError: the kernel did not compile" in status["10_broken"]["error"]
    assert status["20_fine"]["status"] == "ok" and status["20_fine"]["parameters"] == {"DEVICE": "cpu"}
    assert (build_dir / "executed" / "10_broken.ipynb").exists()
    md = (build_dir / "report.md").read_text()
    assert "**FAILED**: RuntimeError: the kernel did not compile" in md
    assert "executed/10_broken.ipynb" in md
    assert "| fine.value (`fine.value`) | 42 | GB/s |" in md
    assert "failed: 10_broken" in capsys.readouterr().out

    # Fixed, re-run: the entry is overwritten and the run succeeds.
    write_nb(bad, "print('fixed')")
    assert harness.main(["run", "--device", "cpu", str(bad)]) == 0
    status = json.loads((build_dir / "status.json").read_text())
    assert status["10_broken"]["status"] == "ok" and status["20_fine"]["status"] == "ok"
    assert "FAILED" not in (build_dir / "report.md").read_text()


def test_parameters_are_passed_as_json(tmp_path, build_dir):
    nb = new_notebook(cells=[new_code_cell('DEVICE = "auto"\nN = 1', metadata={"tags": ["parameters"]}),
                             new_code_cell("assert DEVICE == 'cpu' and N == 8, (DEVICE, N)")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, tmp_path / "30_params.ipynb")
    assert harness.main(["run", "--device", "cpu", "-p", "N", "8", str(tmp_path / "30_params.ipynb")]) == 0
