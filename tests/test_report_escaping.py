"""A report page never runs what a run directory says: every value that reaches the HTML is escaped."""

from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path

import pytest

from globalbatch._util import SettingError
from globalbatch.lab.report import render_html, write_report
from globalbatch.lab.sweep import analyze_sweep
from test_report import write_synthetic_sweep

HOSTILE = ["<script>alert(1)</script>", "<img src=x onerror=alert(1)>", "\"'><svg onload=alert(1)>"]


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.script_text: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        self._in_script = tag == "script"

    def handle_endtag(self, tag):
        self._in_script = False

    def handle_data(self, data):
        if self._in_script:
            self.script_text.append(data)


def _hostile_sweep(root: Path, bad: str) -> Path:
    """A synthetic sweep with ``bad`` in every string field the page shows (manifest, summaries, metrics)."""
    d = root / "run"
    d.mkdir()
    write_synthetic_sweep(d)
    m = json.loads((d / "manifest.json").read_text())
    m["grid"].update(lr_shape=bad, task_overrides={bad: bad})
    (d / "manifest.json").write_text(json.dumps(m))
    for s_path in (d / "trials").glob("*/summary.json"):
        s = json.loads(s_path.read_text())
        s.update(unit=bad, device=bad, precision=bad)  # a trial name other than its directory's is refused
        s_path.write_text(json.dumps(s))
    for m_path in (d / "trials").glob("*/metrics.jsonl"):
        lines = m_path.read_text().splitlines()
        head = json.loads(lines[0])
        head.update(unit=bad, task=bad)
        m_path.write_text("\n".join([json.dumps(head)] + lines[1:]) + "\n")
    return d


def _page(d: Path, end_to_end: bool) -> str:
    if end_to_end:  # the command's path: analysis, PNG plots, the page on disk
        return Path(write_report(d).html).read_text()
    data, analysis = analyze_sweep(d)  # the page alone (no plots: 10× faster)
    return render_html(data, analysis, [])


@pytest.mark.parametrize("bad, end_to_end", [pytest.param(HOSTILE[0], True, marks=pytest.mark.slow),
                                             (HOSTILE[1], False), (HOSTILE[2], False)])
def test_hostile_strings_in_every_field_stay_text(tmp_path, bad, end_to_end):
    d = _hostile_sweep(tmp_path, bad)
    page = _page(d, end_to_end)
    assert bad not in page  # never verbatim
    assert page.count(bad.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
                      .replace('"', "&quot;").replace("'", "&#x27;")) >= 3  # shown, escaped (unit, lr_shape, overrides)
    parser = _Tags()
    parser.feed(page)
    tags = [t for t, _ in parser.tags]
    assert tags.count("script") == 1 and "alert" not in "".join(parser.script_text)  # only the page's own check
    assert "svg" not in tags
    assert all(not k.startswith("on") for _, attrs in parser.tags for k in attrs), "an event handler attribute"
    imgs = [a for t, a in parser.tags if t == "img"]
    assert all(a["src"].startswith("data:image/png;base64,") for a in imgs) and (imgs or not end_to_end)


@pytest.mark.parametrize("field, value", [("task", HOSTILE[0]), ("optimizer", HOSTILE[1])])
def test_hostile_settings_the_grid_checks_are_refused_with_the_file(tmp_path, field, value):
    """Grid settings with a closed set of values (task name, optimizer) are refused on load: one error."""
    d = tmp_path / "run"
    d.mkdir()
    write_synthetic_sweep(d)
    m = json.loads((d / "manifest.json").read_text())
    m["grid"][field] = value
    (d / "manifest.json").write_text(json.dumps(m))
    try:
        page = _page(d, end_to_end=False)
    except SettingError as exc:
        assert "manifest.json" in str(exc)
    else:  # accepted: then it must be escaped
        assert value not in page
