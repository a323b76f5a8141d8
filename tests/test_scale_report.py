"""``globalbatch report --scale scale.json``: the time-versus-GPU-hours section of the sweep's HTML report (plot
embedded, table per GPU count, assumptions) when asked, absent otherwise; a bad file is one line naming --scale."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest

from test_bad_inputs import _tree, run_main
from test_report import write_synthetic_sweep

SCALE = ["scale", "--prior", "kaplan", "--params", "1B", "--target-loss", "2.6", "--max-gpus", "64", "--seq-len", "2048",
         "--json"]


@pytest.fixture(scope="module")
def sweep_and_scale(tmp_path_factory):
    root = tmp_path_factory.mktemp("scale_report")
    write_synthetic_sweep(root / "sweep")
    code, out, err = run_main(SCALE)
    assert code == 0, err
    (root / "scale.json").write_text(out)
    return root, json.loads(out)


def test_report_with_scale_has_the_section_and_its_plot(sweep_and_scale):
    root, doc = sweep_and_scale
    code, out, err = run_main(["report", str(root / "sweep"), "--out", str(root / "with"), "--scale",
                               str(root / "scale.json")])
    assert code == 0, err
    page = (root / "with" / "report.html").read_text()
    m = re.search(r"<section id='scale'>(.*?)</section>", page, flags=re.S)
    assert m, "no scale section"
    section = m.group(1)
    png = re.search(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", section)
    assert png and base64.b64decode(png.group(1))[:8] == b"\x89PNG\r\n\x1a\n"
    assert base64.b64decode(png.group(1)) == (root / "with" / "scale_pareto.png").read_bytes()
    assert section.count("<tr>") == len(doc["rows"]) + 1  # the header and one row per GPU count
    assert f"{doc['best']['gpus']:,} GPUs" in section and "pareto" in section
    assert "Assumptions" in section and "Kaplan" in section and "EXTRAPOLATED" in section
    assert "not a measurement" in section and doc["cluster"]["name"] in section
    assert page.index("<section id='scale'>") < page.index('<p id="img-check"')  # counted by the page's self-check


def test_report_without_scale_has_no_section(sweep_and_scale):
    root, _ = sweep_and_scale
    code, out, err = run_main(["report", str(root / "sweep"), "--out", str(root / "without")])
    assert code == 0, err
    page = (root / "without" / "report.html").read_text()
    assert "id='scale'" not in page and not (root / "without" / "scale_pareto.png").exists()


@pytest.mark.parametrize("content, why", [
    (None, "No such file"),
    ("{not json", "Expecting"),
    (json.dumps({"rows": []}), "missing"),
    (json.dumps({"target_loss": 2.6, "rows": [{"gpus": 8}], "best": None, "objective": "time", "cluster": {},
                 "convergence": {}, "throughput_source": "", "notes": [], "model": {}}), "rows[0] lacks"),
])
def test_bad_scale_file_is_one_line_naming_the_flag(sweep_and_scale, tmp_path, content, why):
    root, _ = sweep_and_scale
    path = tmp_path / "s.json"
    if content is not None:
        path.write_text(content)
    before = _tree(root)
    code, out, err = run_main(["report", str(root / "sweep"), "--out", str(root / "bad"), "--scale", str(path)])
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("error: ") and "--scale" in lines[0] and why in lines[0], lines[0]
    assert _tree(root) == before and not Path(root / "bad").exists()
