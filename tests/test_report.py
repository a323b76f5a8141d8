"""report.py on a synthetic sweep directory with a known critical batch; HTML checked by parsing and in Chromium."""

from __future__ import annotations

import base64
import html
import io
import json
import math
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from globalbatch._util import atomic_write_json
from globalbatch.lab.sweep import SweepConfig, load_sweep
from globalbatch.critical import AnalysisSettings
from globalbatch.lab.report import write_report

TOKENS_PER_SAMPLE = 20
B_CRIT_TOKENS = 1600.0  # = 80 samples × 20 tokens


def write_synthetic_sweep(out: Path, *, with_noise_scale: bool = True, seed: int = 0,
                          seeds: list[int] | None = None) -> SweepConfig:
    """A sweep directory in sweep.py's format whose best-LR curves follow the hyperbola exactly.

    Loss = 2 + 3/(1 + s/τ), τ = 10·(1 + B_crit/B)·slowdown(lr) with B in tokens: steps to any
    target ℓ are τ·(3/(ℓ − 2) − 1), so B_crit = 1,600 tokens at every target. Throughput
    grows as √B, so wall-clock to target ∝ (1 + B/B_crit)/√B is lowest at B = B_crit.
    """
    rng = np.random.default_rng(seed)
    cfg = SweepConfig(task="tinygpt", batches=[16, 32, 64, 128, 256, 512], lrs=[1e-3, 3e-3], budget=400_000, lr_rule="none",
                      seeds=seeds)
    atomic_write_json(out / "manifest.json", cfg.manifest())
    slow = {1e-3: 1.0, 3e-3: 1.3}
    for t in cfg.trials():
        b_tok = t.batch * TOKENS_PER_SAMPLE
        n = cfg.budget // b_tok
        s = np.arange(0, n)  # loss[i] at the parameters after i updates, as a sweep logs it
        tau = 10.0 * (1.0 + B_CRIT_TOKENS / b_tok) * slow[t.lr]
        loss = 2.0 + 3.0 / (1.0 + s / tau) + rng.normal(0.0, 0.03 / math.sqrt(t.batch), n)
        rate = 2000.0 * math.sqrt(b_tok)
        recs = [{"kind": "header", "trial": t.name, "batch": t.batch, "lr": t.lr, "unit": "token"},
                {"kind": "eval", "step": 0, "consumed": 0, "val_loss": 5.0}]
        for i in range(n):
            r = {"kind": "step", "step": i + 1, "consumed": int((i + 1) * b_tok), "batch": t.batch, "batch_units": b_tok,
                 "loss": float(loss[i]), "grad_norm": 1.0, "lr": t.lr, "skipped": False, "skipped_total": 0,
                 "units_per_s": rate, "train_time_s": (i + 1) * b_tok / rate}
            if (i + 1) % max(1, n // 4) == 0:
                r["val_loss"] = float(loss[i] + 0.05)
            if with_noise_scale and (i + 1) % 5 == 0:
                r["b_simple"] = 400.0 * (1 + (i + 1) * b_tok / 1e5)
            recs.append(r)
        d = out / "trials" / t.name
        d.mkdir(parents=True)
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        atomic_write_json(d / "summary.json", {
            "completed": True, "trial": t.name, "batch": t.batch, "lr": t.lr, "seed": t.seed, "unit": "token", "steps": n,
            "consumed": n * b_tok, "mean_batch_units": float(b_tok), "units_per_s": rate, "core_s_per_unit": 1 / rate,
            "skipped_windows": 0, "final_val_loss": float(loss[-1]), "train_time_s": n * b_tok / rate, "micro_batch": 16,
        })
    return cfg


class _Images(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.srcs: list[str] = []
        self.external: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "img":
            self.srcs.append(a.get("src", ""))
        for key in ("src", "href"):
            if a.get(key, "").startswith(("http:", "https:", "//", "file:")):
                self.external.append(a[key])


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep")
    write_synthetic_sweep(out)
    return write_report(out, settings=AnalysisSettings(first_seed_n_targets=3))


def test_report_recovers_known_b_crit_end_to_end(report):
    for t in report.analysis.targets:
        assert t.fit is not None
        assert t.fit.b_crit == pytest.approx(B_CRIT_TOKENS, rel=0.05)
    rec = report.analysis.recommendation
    # time ∝ (1 + B/1600)/√B is flat near B_crit: 1,280 and 2,560 tokens are within 5% of each other;
    # the tie goes to the one that needs fewer tokens.
    assert rec is not None and rec.batch_size == 64 * TOKENS_PER_SAMPLE
    assert "batch 64 (≈1,280 tokens)" in rec.text()


def test_report_files_and_html_embed_every_plot(report):
    names = [Path(p).name for p in report.plots]
    assert names == ["loss_vs_data.png", "steps_vs_examples.png", "batch_tradeoff.png", "noise_scale.png"]
    page = Path(report.html).read_text()
    parser = _Images()
    parser.feed(page)
    assert parser.external == []  # self-contained: no network, no sibling files
    assert len(parser.srcs) == len(report.plots)
    import matplotlib.image as mpimg

    for src, path in zip(parser.srcs, report.plots):
        assert src.startswith("data:image/png;base64,")
        raw = base64.b64decode(src.split(",", 1)[1], validate=True)
        assert raw == Path(path).read_bytes()
        img = mpimg.imread(io.BytesIO(raw), format="png")
        assert img.shape[0] > 200 and img.shape[1] > 400 and img.std() > 0.05  # decodes and is not blank
    assert "Recommended batch" in page and "B_crit ± SE (McCandlish)" in page and "CBS 20%" in page
    analysis = json.loads(Path(report.analysis_json).read_text())
    assert analysis["analysis"]["targets"][0]["fit"]["b_crit"] == pytest.approx(report.analysis.targets[0].fit.b_crit)


def test_no_noise_plot_without_b_simple_and_partial_sweep_is_reported(tmp_path):
    write_synthetic_sweep(tmp_path, with_noise_scale=False)
    shutil.rmtree(tmp_path / "trials" / "b512_lr0.003_s0")  # an unfinished trial
    res = write_report(tmp_path, tmp_path / "r")
    assert [Path(p).name for p in res.plots] == ["loss_vs_data.png", "steps_vs_examples.png", "batch_tradeoff.png"]
    assert load_sweep(tmp_path).missing == ["b512_lr0.003_s0"]
    assert "1 trial(s) not finished: b512_lr0.003_s0" in Path(res.html).read_text()


def test_report_of_a_non_sweep_dir_names_it(tmp_path):
    with pytest.raises(ValueError, match="no manifest.json"):
        write_report(tmp_path)


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chromium-headless-shell"):
        path = shutil.which(name)
        if path:
            return path
    return None


def test_html_renders_in_headless_chromium(report, tmp_path):
    """The browser decodes every embedded plot (the page's own check) and the screenshot is not blank.

    Needs Chromium (``apt-get install -y chromium``). Missing Chromium fails the test;
    set GLOBALBATCH_SKIP_BROWSER=1 to skip it explicitly.
    """
    browser = _chromium()
    if browser is None:
        if os.environ.get("GLOBALBATCH_SKIP_BROWSER") == "1":
            pytest.skip("GLOBALBATCH_SKIP_BROWSER=1: Chromium check skipped on request")
        pytest.fail("Chromium not found: apt-get install -y chromium (or set GLOBALBATCH_SKIP_BROWSER=1)")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--no-first-run", "--hide-scrollbars",
             f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=5000"]
    url = Path(report.html).resolve().as_uri()
    dom = subprocess.run([browser, *flags, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    n = len(report.plots)
    assert f"images rendered: {n} of {n}" in dom.stdout, re.findall(r"images rendered[^<]*", dom.stdout)
    shot = tmp_path / "shot.png"
    run = subprocess.run([browser, *flags, "--window-size=1280,4000", f"--screenshot={shot}", url],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and shot.is_file(), run.stderr[-2000:]
    import matplotlib.image as mpimg

    img = mpimg.imread(shot)[..., :3]
    # Plot colours (viridis lines, orange/green series) cover a visible share of the page.
    colourful = (img.max(axis=2) - img.min(axis=2)) > 0.25
    assert colourful.mean() > 0.002, colourful.mean()


def test_throughput_comes_from_the_timing_pass_not_the_contended_trials(tmp_path):
    """In-trial rates (cores shared) make batch 16 look fastest; the sequential timing pass is what counts."""
    write_synthetic_sweep(tmp_path, with_noise_scale=False)
    for b in (16, 32, 64, 128, 256, 512):
        atomic_write_json(tmp_path / "timing" / f"b{b}.json", {"batch": b, "units_per_s": 2000.0 * math.sqrt(b * TOKENS_PER_SAMPLE)})
        d = tmp_path / "trials"
        for f in d.glob(f"b{b}_lr*/summary.json"):
            s = json.loads(f.read_text())
            s["units_per_s"] = 1e9 if b == 16 else 1e3  # contention-distorted in-trial numbers
            atomic_write_json(f, s)
    res = write_report(tmp_path, tmp_path / "r", settings=AnalysisSettings(first_seed_n_targets=1))
    assert res.analysis.recommendation.batch_size == 64 * TOKENS_PER_SAMPLE
    page = Path(res.html).read_text()
    assert "in-trial tokens/s" in page and "1,000,000,000" in page
    assert "<th>MFU</th>" in page and "–" in page  # no MFU recorded in these timing records


def test_report_shows_the_timing_pass_mfu(tmp_path):
    write_synthetic_sweep(tmp_path, with_noise_scale=False)
    for i, b in enumerate((16, 32, 64, 128, 256, 512)):
        atomic_write_json(tmp_path / "timing" / f"b{b}.json",
                          {"batch": b, "units_per_s": 2000.0 * math.sqrt(b * TOKENS_PER_SAMPLE), "mfu": 0.125 + i / 100})
    res = write_report(tmp_path, tmp_path / "r", settings=AnalysisSettings(first_seed_n_targets=1))
    page = Path(res.html).read_text()
    shown = [f"{0.125 + i / 100:.1%}" for i in range(6)]
    assert sum(s in page for s in shown) >= 3  # the batches that reached the target show their MFU


def test_the_old_analysis_keywords_still_work_with_a_future_warning(tmp_path):
    """write_report, analyze_sweep, analyze_sweep_seeds and seed_analysis_or_note took their settings as keywords
    before AnalysisSettings; for one release they still do, with a FutureWarning naming the new spelling."""
    from globalbatch.errors import SettingError
    from globalbatch.lab.report import seed_analysis_or_note
    from globalbatch.lab.sweep import analyze_sweep, analyze_sweep_seeds

    write_synthetic_sweep(tmp_path, with_noise_scale=False)
    first = AnalysisSettings(first_seed_n_targets=1)
    with pytest.warns(FutureWarning, match=r"write_report\(n_targets=\) is deprecated: pass "
                                           r"settings=AnalysisSettings\(first_seed_n_targets=\)"):
        res = write_report(tmp_path, tmp_path / "r", n_targets=1)
    with pytest.warns(FutureWarning, match=r"analyze_sweep\(n_targets=\)"):
        _, old = analyze_sweep(tmp_path, n_targets=1)
    _, new = analyze_sweep(tmp_path, settings=first)
    assert [t.target for t in res.analysis.targets] == [t.target for t in old.targets] == [t.target for t in new.targets]
    assert len(new.targets) == 1 + first.n_tighter and res.analysis.recommendation.batch_size == new.recommendation.batch_size
    with pytest.warns(FutureWarning, match=r"analyze_sweep_seeds\(readout=\)"), \
            pytest.raises(SettingError, match="share a loss range"):
        analyze_sweep_seeds(tmp_path, readout="heldout")
    with pytest.warns(FutureWarning, match=r"seed_analysis_or_note\(readout=\)"):
        assert seed_analysis_or_note(tmp_path, readout="heldout")[1] is not None
    with pytest.raises(TypeError, match=r"write_report\(\) got unexpected keyword argument\(s\): n_tagrets"):
        write_report(tmp_path, n_tagrets=1)

def test_extrapolated_b_crit_is_reported_as_a_one_sided_bound(tmp_path):
    """Every batch in the perfect-scaling regime: no two-sided CI, a lower bound instead."""
    cfg = SweepConfig(task="tinygpt", batches=[4, 8, 16, 32], lrs=[1e-3], budget=64_000, lr_rule="none")
    atomic_write_json(tmp_path / "manifest.json", cfg.manifest())
    for t in cfg.trials():
        b_tok = t.batch * TOKENS_PER_SAMPLE
        n = cfg.budget // b_tok
        i = np.arange(n)
        loss = 3.0 - 2e-5 * b_tok * i  # progress per token independent of B: S ∝ 1/B
        recs = [{"kind": "header", "trial": t.name, "batch": t.batch, "lr": t.lr, "unit": "token"}]
        recs += [{"kind": "step", "step": j + 1, "consumed": int((j + 1) * b_tok), "batch": t.batch, "batch_units": b_tok,
                  "loss": float(loss[j]), "skipped": False} for j in range(n)]
        d = tmp_path / "trials" / t.name
        d.mkdir(parents=True)
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        atomic_write_json(d / "summary.json", {"completed": True, "trial": t.name, "batch": t.batch, "lr": t.lr, "unit": "token",
                                               "steps": n, "consumed": n * b_tok, "mean_batch_units": float(b_tok),
                                               "units_per_s": 1000.0, "final_val_loss": float(loss[-1])})
    res = write_report(tmp_path, tmp_path / "r", settings=AnalysisSettings(first_seed_targets=[2.0]))
    t = res.analysis.targets[0]
    assert t.fit is not None and t.b_crit_bound is not None and t.b_crit_bound[0] == "lower" and t.b_crit_ci95 is None
    page = Path(res.html).read_text()
    assert "lower bound; all batches in the perfect-scaling regime" in page and "one-sided 95%: B_crit &gt;" in page


def test_no_legend_warning_when_nothing_is_labelled(tmp_path):
    """A target nobody reaches leaves no labelled artist: matplotlib's 'No artists with labels' must not leak."""
    import warnings

    write_synthetic_sweep(tmp_path, with_noise_scale=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any UserWarning fails the test
        res = write_report(tmp_path, tmp_path / "r", settings=AnalysisSettings(first_seed_targets=[0.5]))
    assert res.analysis.recommendation is None and res.analysis.targets[0].points == []


def test_header_throughput_source_and_load_warning(tmp_path):
    """No empty `{}` after the task; the recommendation says where its throughput comes from; a >1.5× in-trial
    spread across one batch's LRs is a warning (machine load), in the text and on the page."""
    write_synthetic_sweep(tmp_path, with_noise_scale=False)
    f = tmp_path / "trials" / "b32_lr0.003_s0" / "summary.json"
    s = json.loads(f.read_text())
    s["units_per_s"] *= 2.1
    atomic_write_json(f, s)
    res = write_report(tmp_path, tmp_path / "r", settings=AnalysisSettings(first_seed_n_targets=1))
    page = Path(res.html).read_text()
    assert "task <code>tinygpt</code>; batches" in page and "{}" not in page.split("<h2>")[0]
    text = res.analysis.recommendation.text()
    assert "(in-trial, median over its LRs)" in text and ") (lr" not in text and "), lr 0.001:" in text
    # (the fixture's few validation points share no loss range: the analysis over seeds says so in a second warning)
    load = [w for w in res.analysis.warnings if not w.startswith("no analysis over seeds")]
    assert len(load) == 1 and load[0].startswith("batch 32: in-trial tokens/s vary 2.1×")
    assert "warning: batch 32: in-trial tokens/s vary 2.1×" in text and "warning: batch 32" in page
    for b in (16, 32, 64, 128, 256, 512):
        atomic_write_json(tmp_path / "timing" / f"b{b}.json", {"batch": b, "units_per_s": 1000.0 * b})
    res = write_report(tmp_path, tmp_path / "r2", settings=AnalysisSettings(first_seed_n_targets=1))
    assert "(timed pass)" in res.analysis.recommendation.text() and "the timed pass is used" in res.analysis.warnings[0]
    assert "timing pass" in Path(res.html).read_text()
    assert not any("the timing pass's steps vary" in w for w in res.analysis.warnings)
    # a timing pass whose steps vary > 5× (a slow start, machine load): its rate is flagged as uncertain
    atomic_write_json(tmp_path / "timing" / "b64.json", {"batch": 64, "units_per_s": 64_000.0,
                                                         "step_units_per_s": [2_000.0, 60_000.0, 70_000.0, 66_000.0]})
    res = write_report(tmp_path, tmp_path / "r3", settings=AnalysisSettings(first_seed_n_targets=1))
    slow = [w for w in res.analysis.warnings if "the timing pass's steps vary" in w]
    assert len(slow) == 1 and slow[0].startswith("batch 64: the timing pass's steps vary 35.0× (2,000–70,000 tokens/s")


class _Sections(HTMLParser):
    """The text inside ``<section id="answer">``, inside each ``<details>`` (with its summary), and outside both."""

    def __init__(self) -> None:
        super().__init__()
        self.answer, self.details, self.summaries, self.outside = [], [], [], []
        self._in_answer = self._details_depth = 0
        self._in_summary = False
        self.answer_tables, self.answer_headers = 0, []
        self._in_th = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "section" and a.get("id") == "answer":
            self._in_answer = 1
        elif tag == "details":
            self._details_depth += 1
            self.details.append("")
        elif tag == "summary":
            self._in_summary = True
            self.summaries.append("")
        elif tag == "table" and self._in_answer:
            self.answer_tables += 1
        elif tag == "th" and self._in_answer:
            self._in_th = True
            self.answer_headers.append("")

    def handle_endtag(self, tag):
        if tag == "section":
            self._in_answer = 0
        elif tag == "details":
            self._details_depth -= 1
        elif tag == "summary":
            self._in_summary = False
        elif tag == "th":
            self._in_th = False

    def handle_data(self, data):
        if self._in_th:
            self.answer_headers[-1] += data
        if self._in_summary:
            self.summaries[-1] += data
        if self._in_answer:
            self.answer.append(data)
        elif self._details_depth:
            self.details[-1] += data
        else:
            self.outside.append(data)


@pytest.fixture(scope="module")
def seeds_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep_seeds")
    write_synthetic_sweep(out, seeds=[0, 1, 2], with_noise_scale=False)
    return write_report(out, settings=AnalysisSettings(first_seed_n_targets=3, readout="train"))  # (its few held-out points share no loss range)


def test_one_answer_per_page_comparisons_collapsed(seeds_report):
    """One recommendation, in the lead section, from the analysis over seeds; the first seed's training-loss pick and
    every per-seed table are collapsed and labelled; the lead has one B_crit column."""
    res = seeds_report
    assert res.seed_analysis is not None and res.seed_analysis.recommendation is not None
    page = Path(res.html).read_text()
    sec = _Sections()
    sec.feed(page)
    answer = "".join(sec.answer)
    assert page.count("Recommended batch") == 1 and answer.count("Recommended batch") == 1
    rec = res.seed_analysis.recommendation
    assert f"Recommended batch: {res.data.label(rec.batch_size)} at lr {rec.lr:g}" in answer
    assert "P(fastest)" not in answer and "bootstrap resamples of the 3 seed(s)" in answer  # how sure, in words
    assert "From the training loss of 3 seed(s)" in answer
    assert f"B_crit {res.seed_analysis.primary.b_crit:,.0f} tokens per step" in answer
    spread = res.seed_analysis.primary.seed_spread  # whether the seed range is the seeds' or the fits' noise
    assert spread is not None and html.escape(spread.text()) in page and spread.text().split(":")[0] in answer
    assert sec.answer_tables == 1 and sum("B_crit" in h for h in sec.answer_headers) == 1
    # comparisons: collapsed and labelled, nothing of them outside a <details>
    comparison = [d for s, d in zip(sec.summaries, sec.details) if s.startswith("Comparison, not the answer")]
    assert len(comparison) == 1 and "first seed's pick" in comparison[0] and "Recommended" not in comparison[0]
    assert "CBS 20%" in comparison[0] and "CBS 20%" not in "".join(sec.outside) + answer
    per_seed = [d for s, d in zip(sec.summaries, sec.details) if s.startswith("The numbers behind the answer")]
    assert len(per_seed) == 1 and "steps to target per seed" in per_seed[0] and "joint fit (95%)" in per_seed[0]
    assert "◀ recommended" in per_seed[0] and page.count("◀ recommended") == 1
    # the first seed's plots go with its comparison, in page order
    names = [Path(p).name for p in res.plots]
    assert names == ["loss_vs_data.png", "b_crit_vs_loss.png", "steps_vs_examples.png", "batch_tradeoff.png"]
    parser = _Images()
    parser.feed(page)
    for src, path in zip(parser.srcs, res.plots):
        assert base64.b64decode(src.split(",", 1)[1]) == Path(path).read_bytes()


def test_one_seed_page_leads_with_its_answer(report):
    """Without an analysis over seeds the (one) training-loss analysis is the answer: one recommendation, one
    B_crit column in the lead, the full tables collapsed."""
    page = Path(report.html).read_text()
    sec = _Sections()
    sec.feed(page)
    answer = "".join(sec.answer)
    assert page.count("Recommended batch") == 1 and "Recommended batch: batch 64 (≈1,280 tokens)" in answer
    assert sec.answer_tables == 1 and sum("B_crit" in h for h in sec.answer_headers) == 1
    assert not any(s.startswith("Comparison") for s in sec.summaries)
    assert any("CBS 20%" in d for d in sec.details)


def test_loss_plot_legend_has_one_entry_per_batch(seeds_report, tmp_path, monkeypatch):
    """36 trials (6 batches × 2 LRs × 3 seeds): one legend entry per batch, at its chosen LR, outside the axes."""
    import globalbatch.lab.report_plots as report_mod

    figs = []
    monkeypatch.setattr(report_mod, "_save", lambda fig, path: figs.append(fig) or str(path))
    res = seeds_report
    report_mod.plot_loss_vs_data(res.data, res.analysis, tmp_path / "l.png", chosen_lr=report_mod._chosen_lr(res.seed_analysis))
    legend = figs[0].axes[0].get_legend()
    texts = [t.get_text() for t in legend.get_texts()]
    assert len(res.data.trials) == 36 and len(texts) == 6
    assert texts[0].startswith("batch 16 (≈320 tokens), lr ")
    bbox = legend.get_window_extent()
    assert bbox.x0 >= figs[0].axes[0].get_window_extent().x1  # outside the axes, right of them
    report_mod._plt().close(figs[0])


def test_no_recommendation_over_seeds_is_said_once_and_the_first_seed_stays_a_comparison(seeds_report):
    import dataclasses

    from globalbatch.lab.report import render_html

    res = seeds_report
    sa = dataclasses.replace(res.seed_analysis, recommendation=None)
    page = render_html(res.data, res.analysis, [], seed_analysis=sa)
    sec = _Sections()
    sec.feed(page)
    answer = "".join(sec.answer)
    assert "Recommended batch" not in page and answer.count("No recommendation") == 1
    assert "B_crit" in answer and "<li>" not in page.split('<section id="answer">')[1].split("</section>")[0]
    assert any(s.startswith("Comparison, not the answer") for s in sec.summaries)


def test_report_target_no_batch_reaches_is_one_line_exit_2_nothing_written(tmp_path, capsys):
    """``--targets`` below every trial's lowest held-out loss: exit 2, one line naming the flag, the value and
    the lowest loss reached, no page and no report directory (checked before anything is written)."""
    from globalbatch.cli import main
    from globalbatch.critical.errors import NoAnswerError

    write_synthetic_sweep(tmp_path / "sw", seeds=[0, 1], with_noise_scale=False)
    with pytest.raises(SystemExit) as exc:
        main(["report", str(tmp_path / "sw"), "--targets", "2.5,1.5"])
    err = capsys.readouterr()
    assert exc.value.code == 2 and err.out == ""
    line = err.err.strip()
    assert "\n" not in line and line.startswith("error: --targets 1.5 is not allowed (no batch reaches 1.5;")
    low = float(re.search(r"lowest held-out loss any trial reached is ([0-9.]+)", line).group(1))
    assert 2.0 < low < 2.5 and f"allowed: targets ≥ {low:.4f}" in line
    assert not (tmp_path / "sw" / "report").exists()
    with pytest.raises(NoAnswerError, match="no batch reaches 1.5"):  # the library's answer (README)
        write_report(tmp_path / "sw", settings=AnalysisSettings(targets=(1.5,), first_seed_targets=(1.5,)))
    assert not (tmp_path / "sw" / "report").exists()


def test_a_flagged_joint_fit_is_a_labelled_comparison_not_a_second_answer(seeds_report):
    """The synthetic B_crit is the same at every target; the training-loss read-out's joint fit has B_crit falling
    as the loss falls (k > 2 SE): flagged, so the page, the terminal table and the JSON lead with the medians per
    target and show the fit only as a labelled comparison."""
    from rich.console import Console

    from globalbatch.critical.seeds import seed_analysis_json
    from globalbatch.lab.report import joint_text, seed_tables

    sa = seeds_report.seed_analysis
    assert [f.split(":")[0] for f in sa.joint_flags] == ["B_crit falls as the loss falls"]
    assert any(w.startswith("joint fit B_crit(L): B_crit falls as the loss falls") for w in sa.warnings)
    p = _Sections()
    p.feed(Path(seeds_report.html).read_text())
    answer = "".join(p.answer)
    assert "No trend across targets: the joint fit of B_crit(L) is flagged (B_crit falls as the loss falls)" in answer
    assert "∝ L^" not in answer and f"B_crit {sa.primary.b_crit:,.0f}" in answer
    assert any("comparison, not the answer (flagged: B_crit falls as the loss falls)" in d for d in p.details)
    assert joint_text(sa).startswith("comparison, not the answer (flagged: ")
    console = Console(width=200, record=True)
    console.print(seed_tables(seeds_report.data, sa))
    table = console.export_text()
    assert "joint fit" not in table and "B_crit (median over seeds)" in table
    doc = seed_analysis_json(sa, int)
    assert list(doc)[0] == "b_crit_answer" and doc["b_crit_answer"]["b_crit"] == pytest.approx(sa.primary.b_crit)
    assert doc["joint_role"] == "comparison (flagged)" and doc["joint_flags"] == sa.joint_flags


def test_b_crit_plot_labels_a_flagged_joint_fit_as_a_comparison(seeds_report, tmp_path, monkeypatch):
    import globalbatch.lab.report_plots as report_mod

    figs = []
    monkeypatch.setattr(report_mod, "_save", lambda fig, path: figs.append(fig) or str(path))
    report_mod.plot_b_crit_vs_loss(seeds_report.data, seeds_report.seed_analysis, tmp_path / "b.png")
    texts = [t.get_text() for t in figs[0].axes[0].get_legend().get_texts()]
    assert "joint fit, a comparison (flagged: B_crit falls as the loss falls)" in texts
    assert not any(t.startswith("joint fit: B_crit ∝") for t in texts)
    report_mod._plt().close(figs[0])


def test_fit_rows_state_no_bound_where_b_crit_lies_outside_and_the_data_support_none():
    """B_crit fitted far below the swept batches with no one-sided bound the scatter supports: the comparison row says
    so instead of asking for an interval that does not exist (which raised and lost the whole page)."""
    from types import SimpleNamespace

    from globalbatch.critical.fit import fit_hyperbola
    from globalbatch.critical.recommend import TargetResult
    from globalbatch.lab.report import _fit_rows

    fit = fit_hyperbola([16, 32, 64], [59.582, 15.773, 15.457])
    assert fit.extrapolated and fit.b_crit_bound(0.95) is None
    rows = _fit_rows(None, SimpleNamespace(targets=[TargetResult(target=2.5, points=[], unreached=[], fit=fit)]))
    assert rows[0][2] == "no bound" and "supports no bound" in rows[0][-1]
