"""The sweep report: PNG plots and one self-contained HTML page with the recommendation.

Plots (McCandlish et al. 2018, arXiv 1812.06162, figs. 4–7 show the same views):

1. ``loss_vs_data.png`` — the EMA-smoothed training loss of every trial against
   consumed units (best LR of each batch drawn bold), validation loss as markers,
   loss targets dashed;
2. ``steps_vs_examples.png`` — steps against examples to reach each target, one point
   per batch (its best LR), with the fitted hyperbola (S/S_min − 1)(E/E_min − 1) = 1
   and B_crit ± SE in the legend;
3. ``batch_tradeoff.png`` — units to target, throughput and wall-clock to target
   against batch, at the primary target;
4. ``noise_scale.png`` — the gradient noise scale B_simple against units, only when
   the trials recorded it (``b_simple`` in their JSONL).

The plots are drawn by :mod:`globalbatch.lab.report_plots` (matplotlib, imported lazily with the Agg backend).
The HTML embeds the PNGs as base64 (no external file, no network) and lists the fits, the per-batch numbers
and the recommendation with its reasoning.
"""

from __future__ import annotations

import base64
import html
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from globalbatch.critical import Analysis
from globalbatch._util import atomic_write_json, atomic_write_text
from globalbatch.errors import SettingError
from globalbatch.critical.errors import TargetNotReachedError
from globalbatch.critical.joint import outside_band
from globalbatch.critical.settings import FIRST_SEED_NAMES, AnalysisSettings, settings_from
from globalbatch.critical.seeds import SeedAnalysis, lr_selection_text, seed_analysis_json
from globalbatch.lab.report_plots import (_chosen_lr, batch_label, plot_b_crit_vs_loss, plot_batch_tradeoff,
                                         plot_loss_vs_data, plot_noise_scale, plot_steps_vs_examples)
from globalbatch.lab.scale_section import pareto_figure, scale_section_html
from globalbatch.lab.sweep import SweepData, analyze_sweep
from globalbatch.lab.sweep.store import analyze_sweep_seeds_or_train

__all__ = ["ReportResult", "write_report", "analysis_table", "batch_label", "render_html"]


@dataclass(kw_only=True)
class ReportResult:
    html: str
    """Path of the HTML page."""
    plots: list[str]
    """Paths of the PNG files, in page order."""
    analysis_json: str
    analysis: Analysis
    data: SweepData
    seed_analysis: Optional[SeedAnalysis] = None
    """The analysis over every seed (held-out read-out by default): what the recommendation rests on."""


# ---------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------


def _fmt(x: Optional[float], spec: str = ",.0f") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    return format(x, spec)


def _fit_rows(data: SweepData, analysis: Analysis) -> list[list[str]]:
    rows = []
    for t in analysis.targets:
        if t.fit is None:
            failed = (t.fit_error or "").startswith("fit failed")
            rows.append([f"{t.target:.4f}" + (" (primary)" if t is analysis.targets[0] else ""), str(len(t.points)),
                         "fit failed" if failed else "–", "no bound" if failed else "–", "–", "–", t.fit_error or ""])
            continue
        f = t.fit
        bound = f.b_crit_bound(0.95)
        name = f"{t.target:.4f}" + (" (primary)" if t is analysis.targets[0] else "")
        if f.degenerate is not None or (bound is None and f.extrapolated):  # no interval and no bound to state
            rows.append([name, str(f.n_points), "no bound", "–", "–", f"{f.s_min:,.1f} / {f.e_min:,.0f}",
                         f.b_crit_text()])
            continue
        if bound is None:
            lo, hi = f.b_crit_interval(0.95)
            rows.append([name, str(f.n_points), f"{f.b_crit:,.0f} ± {f.se_b_crit:,.0f}", f"{lo:,.0f}–{hi:,.0f}",
                         f"{t.cbs_20:,.0f} ± {t.se_cbs_20:,.0f}", f"{f.s_min:,.1f} / {f.e_min:,.0f}", ""])
            continue
        # Extrapolated: the point estimate and a two-sided CI mean little; report the one-sided bound.
        kind, x = bound
        sign = ">" if kind == "lower" else "<"
        note = ("lower bound; all batches in the perfect-scaling regime" if kind == "lower"
                else "upper bound; all batches in the saturated regime")
        rows.append([name, str(f.n_points), f"{sign} {x:,.0f}", f"one-sided 95%: B_crit {sign} {x:,.0f}",
                     f"{sign} {0.2 * x:,.0f}", f"{f.s_min:,.1f} / {f.e_min:,.0f}", f"extrapolated: {note}"])
    return rows


FIT_HEADER = ["target loss", "points", "B_crit ± SE (McCandlish)", "95% CI (one-sided bound if extrapolated)",
              "CBS 20% ± SE (Zhang)", "S_min / E_min", "note"]


def _point_rows(data: SweepData, analysis: Analysis, pick: str = "◀ recommended") -> list[list[str]]:
    t = analysis.targets[0]
    rows = []
    rec = analysis.recommendation
    for p in t.points:
        mark = pick if rec is not None and rec.batch_size == p.batch_size else ""
        rows.append([batch_label(data, p.batch_size), f"{p.lr:g}", f"{p.steps:,.1f}", f"{p.examples:,.0f}",
                     _fmt(p.examples_per_s), _pct(data.mfu_at(p.batch_size)), _fmt(_in_trial(data, p.batch_size)),
                     _fmt(p.time_s, ",.1f"), mark])
    for u in t.unreached:
        rows.append([batch_label(data, u), "–", "not reached", "–", "–", _pct(data.mfu_at(u)),
                     _fmt(_in_trial(data, u)), "–", ""])
    return rows


def _in_trial(data: SweepData, units: float) -> Optional[float]:
    """The median in-trial units/s of the batch whose mean units per step is ``units``."""
    pairs = list(data.batch_units().items())
    if not pairs:
        return None
    return data.in_trial_units_per_s(min(pairs, key=lambda kv: abs(kv[1] - units))[0])


def _pct(x: Optional[float]) -> str:
    return "–" if x is None else f"{x:.1%}"


POINT_HEADER = ["batch", "best lr", "steps", "units to target", "units/s", "MFU", "in-trial units/s",
                "time to target (s)", ""]
"""units/s: loss-bearing units, i.e. valid (non-padding) tokens/s for a token task; MFU: the timing pass's
model FLOP/s over the device peak (``–`` without a timing pass)."""


def _trial_rows(data: SweepData) -> list[list[str]]:
    rows = []
    for name in sorted(data.summaries, key=lambda n: (data.summaries[n].batch, data.summaries[n].lr)):
        s = data.summaries[name]
        rows.append([name, str(s.steps), f"{s.consumed:,}", _fmt(s.units_per_s), _fmt(s.core_s_per_unit, ".3g"),
                     str(s.skipped_windows), _fmt(s.final_val_loss, ".4f"), _fmt(s.train_time_s, ",.1f")])
    return rows


TRIAL_HEADER = ["trial", "steps", "units", "units/s", "core-s/unit", "skipped", "final val loss", "train s"]


def analysis_table(data: SweepData, analysis: Analysis):
    """Rich renderables: per-batch numbers at the primary target and the fits at every target."""
    from rich.console import Group

    u = data.unit
    return Group(_table(f"to loss {analysis.targets[0].target:.4f} (primary target; best LR per batch)",
                        [h.replace("units", f"{u}s") for h in POINT_HEADER], _point_rows(data, analysis)),
                 _table(f"critical batch per target ({u}s per step)", FIT_HEADER, _fit_rows(data, analysis)))


def _table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]):
    """A rich Table of right-aligned columns."""
    from rich.table import Table

    t = Table(title=title)
    for h in header:
        t.add_column(h, justify="right")
    for r in rows:
        t.add_row(*r)
    return t


def _samples(data: SweepData, units: float) -> int:
    """Samples per step of the batch whose mean units per step is ``units``."""
    pairs = list(data.batch_units().items())
    return int(min(pairs, key=lambda kv: abs(kv[1] - units))[0]) if pairs else int(round(units))


def _seed_rows(data: SweepData, sa: SeedAnalysis) -> list[list[str]]:
    rows = []
    for st in sa.targets:
        per = "; ".join(f"s{s}: {_fmt(v)}" if v is not None else f"s{s}: – ({st.b_crit_text_per_seed.get(s, '')})"
                        for s, v in st.b_crit_per_seed.items())
        iv = st.interval()
        mono = sum(st.monotone.values())
        rows.append([f"{st.target:.4f}" + (" (primary)" if st is sa.primary else ""), st.median_text,
                     f"{_fmt(iv[0])}–{_fmt(iv[1])}" if iv else "–", per,
                     _fmt(st.joint_b_crit) + (f" ({_fmt(st.joint_interval[0])}–{_fmt(st.joint_interval[1])})"
                                              if st.joint_interval else ""),
                     f"{mono}/{len(st.monotone)}", _target_flags(st)])
    return rows


def _target_flags(st) -> str:
    """The flags column of one target: reached in warmup, the median outside the joint fit's band."""
    flags = ["in warmup: " + ", ".join(st.reached_in_warmup)] if st.reached_in_warmup else []
    if outside_band(st.b_crit, st.joint_interval):
        flags.append("median outside the joint band")
    if st.seed_spread is not None and st.seed_spread.differ:
        flags.append(f"seeds differ beyond their noise (p {st.seed_spread.p_value:.2g})")
    return "; ".join(flags)


def joint_text(sa: SeedAnalysis) -> str:
    """The joint fit in one line; when flagged, labelled as a comparison with its flags (never the answer)."""
    j = sa.joint
    if j is None:
        return ""
    fit = (f"joint fit over targets and seeds: B_crit(L) = {j.b_ref:,.0f}·(L/{j.loss_ref:.3f})^{j.k:.2f} "
           f"(SE of the exponent {j.se_k:.2f}; Kaplan α_B = {j.alpha_b:.2f})")
    if not sa.joint_flags:
        return fit
    names = "; ".join(f.split(":")[0] for f in sa.joint_flags)
    per = ", ".join(f"{_fmt(st.joint_b_crit)} at {st.target:.4f}" for st in sa.targets)
    return (f"comparison, not the answer (flagged: {names}) — {fit}: {per}; the answer is the median over seeds "
            "per target")


SEED_HEADER = ["target loss", "B_crit (median over seeds)", "spread (seed range ∪ bootstrap 95%)", "per seed",
               "joint fit (95%)", "monotone seeds", "flags"]


def _steps_rows(data: SweepData, sa: SeedAnalysis) -> list[list[str]]:
    st = sa.primary
    rec = sa.recommendation
    rows = []
    for b in sorted(st.steps):
        cells = [f"{st.steps[b][s]:,.1f}" if st.steps[b][s] is not None else "not reached" for s in sa.seeds]
        lrs = [f"{st.best_lr[b][s]:g}" if st.best_lr[b][s] is not None else "–" for s in sa.seeds]
        lrs = lrs[:1] if len(set(lrs)) == 1 else lrs  # one LR per batch for every seed (critical_seeds.common_lr)
        t = rec.time_to_target.get(b) if rec is not None else None
        p = rec.probability_fastest.get(b) if rec is not None else None
        edge = sa.lr_edges.get(b)
        rows.append([batch_label(data, b), " / ".join(cells), " / ".join(lrs) + (f" (at {edge} edge)" if edge else ""),
                     f"{t[0]:,.1f} [{t[1]:,.1f}–{t[2]:,.1f}]" if t else "–", f"{p:.0%}" if p is not None else "–",
                     "◀ recommended" if rec is not None and rec.batch_size == b else ("tie" if rec is not None and b in rec.tie else "")])
    return rows


STEPS_HEADER = ["batch", "steps to target per seed", "lr (one per batch: least median steps)", "time to target s, median [range]",
                "P(fastest)", ""]


def seed_tables(data: SweepData, sa: SeedAnalysis):
    """Rich renderables of the analysis over seeds: steps at the primary target and B_crit per target."""
    from rich.console import Group

    title = (f"to held-out loss {sa.primary.target:.4f} (primary target; seeds {', '.join(map(str, sa.seeds))})"
             if sa.readout == "heldout" else f"to training loss {sa.primary.target:.4f} (primary target)")
    header, rows = SEED_HEADER, _seed_rows(data, sa)
    if sa.joint_flags:  # one answer per target: a flagged joint fit leaves the table (joint_text: a comparison)
        header, rows = header[:4] + header[5:], [r[:4] + r[5:] for r in rows]
    return Group(_table(title, STEPS_HEADER, _steps_rows(data, sa)),
                 _table(f"critical batch per target over seeds ({data.unit}s per step; McCandlish B_crit)", header,
                        rows))


def seed_json(data: SweepData, sa: SeedAnalysis) -> dict:
    """The ``globalbatch report --json`` document (batches keyed by samples per step)."""
    doc = seed_analysis_json(sa, lambda u: _samples(data, u))
    doc["grid"] = data.config.manifest()["grid"]
    doc["missing"] = data.missing
    doc["design"] = design_json(data.config.design, _design_text(data))
    return doc


def design_json(name: str, statement: str) -> dict:
    """``design`` in ``report --json`` (and ``sweep --json``): the design, whether the benchmark shows it to hold, what
    it measured (:mod:`globalbatch.lab.sweep.measured`) and the statement the page carries."""
    from globalbatch.lab.sweep.designs import DESIGNS

    d = DESIGNS[name]
    return {"name": name, "holds": d.holds, "measured": d.measured, "statement": statement}


def _design_text(data: SweepData) -> str:
    """The sweep's design (a cheaper one than the full grid says so, with its measured agreement)."""
    from globalbatch.lab.sweep.designs import design_statement

    cfg = data.config
    n_seeds = len(cfg.seeds) if cfg.seeds is not None else 1
    from globalbatch.lab.sweep.halving import run_statement, spent_text

    text = design_statement(cfg.design, len(cfg.batches), len(cfg.lrs), n_seeds, ran=run_statement(data.out_dir))
    if not text:
        return text
    return text + f" This run {spent_text(data.out_dir, cfg, data.unit)}."


# ---------------------------------------------------------------------------
# HTML
# ---------------------------------------------------------------------------


def _table_html(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _lead_seeds_html(data: SweepData, analysis: Analysis, sa: SeedAnalysis) -> str:
    """The answer from the analysis over seeds: the batch, how sure (P(fastest), ties), B_crit(L) with its spread."""
    rec, st = sa.recommendation, sa.primary
    unit = html.escape(data.unit)
    readout = "held-out" if sa.readout == "heldout" else "training"
    n = len(sa.seeds)
    if rec is None:
        head = ("<p class='rec'>No recommendation: over the seeds, a batch missed the primary target or has no "
                "throughput.</p>")
    else:
        name = lambda b: html.escape(batch_label(data, b))  # noqa: E731
        p = rec.probability_fastest
        others = ", ".join(f"{name(b)} in {p[b]:.0%}" for b in sorted(p, key=lambda b: -p[b])
                           if p[b] > 0 and b != rec.batch_size)
        t = rec.time_to_target.get(rec.batch_size)
        per_seed = ", ".join(f"seed {s}: {name(b) if b else '–'}" for s, b in rec.per_seed.items())
        if len(rec.tie) > 1:
            tie = (f"A tie: {', '.join(name(b) for b in rec.tie)} cannot be separated (within the tolerance of the "
                   f"fastest, or fastest in ≥ 20 % of the resamples); {name(rec.batch_size)} needs the fewest {unit}s "
                   "of them.")
        else:
            tie = "No tie: every other batch is slower beyond the tolerance and fastest in under 20 % of the resamples."
        head = (f"<p class='rec'>Recommended batch: <b>{name(rec.batch_size)}</b> at lr {rec.lr:g}</p><ul>"
                f"<li>Fastest to {readout} loss {rec.target:.4f} in <b>{p.get(rec.batch_size, 0):.0%}</b> of 1,000 "
                f"bootstrap resamples of the {n} seed(s)" + (f"; {others}" if others else "") + ". " + tie + "</li>"
                + (f"<li>Time to target {t[0]:,.1f} s, {t[1]:,.1f}–{t[2]:,.1f} s over seeds; winner per seed: "
                   f"{per_seed}.</li>" if t else ""))
    iv = st.interval()
    spread = f"; {html.escape(st.seed_spread.text())}" if st.seed_spread is not None else ""
    if st.b_crit is not None:
        bc = (f"<li>Critical batch at loss {st.target:.4f}: <b>B_crit {_fmt(st.b_crit)} {unit}s per step</b>"
              + (f", {_fmt(iv[0])}–{_fmt(iv[1])} ({html.escape(st.interval_source)})" if iv else "")
              + f"; median over the seeds whose steps to target fall with the batch ({sum(st.monotone.values())} of "
              f"{len(st.monotone)}){spread}.</li>")
    elif st.b_crit_median_bound is not None:
        kind, x = st.b_crit_median_bound
        bc = (f"<li>Critical batch at loss {st.target:.4f}: <b>B_crit {'&gt;' if kind == 'lower' else '&lt;'} {_fmt(x)} "
              f"{unit}s per step</b>, a bound: the median over the seeds whose steps to target fall with the batch "
              f"({html.escape(st.bound_note)}){spread}.</li>")
    else:
        bc = f"<li>No B_crit at loss {st.target:.4f}: no seed gives a usable fit (see the per-seed numbers below).</li>"
    trend = ""
    if sa.joint is not None and sa.joint_flags:
        trend = ("<li>No trend across targets: the joint fit of B_crit(L) is flagged ("
                 + html.escape("; ".join(f.split(":")[0] for f in sa.joint_flags))
                 + "): the medians per target below are the answer; the fit is a comparison among the numbers "
                 "behind the answer.</li>")
    elif sa.joint is not None:
        trend = (f"<li>Across targets B_crit(L) ∝ L^{sa.joint.k:.2f} (one joint fit over targets and seeds): "
                 + ("it rises as the loss falls" if sa.joint.k < 0 else "it does not rise as the loss falls")
                 + ".</li>")
    head += bc + trend + ("</ul>" if rec is not None else "")
    if rec is None:
        head = head.replace("<li>", "<p>").replace("</li>", "</p>")
    rows = []
    for tgt in sa.targets:
        iv = tgt.interval()
        cell = _fmt(tgt.b_crit) + (f" [{_fmt(iv[0])}–{_fmt(iv[1])}]" if tgt.b_crit is not None and iv else "")
        if tgt.b_crit is None:
            cell = tgt.median_text if tgt.b_crit_median_bound is not None else "– (no usable fit)"
        rows.append([f"{tgt.target:.4f}" + (" (primary)" if tgt is st else ""), cell,
                     f"{sum(tgt.monotone.values())} of {len(tgt.monotone)}"])
    table = _table_html(["target loss (" + readout + ")", f"B_crit, {data.unit}s per step: median over seeds "
                         "[seed range ∪ bootstrap 95%]", "seeds fitted (monotone)"], rows)
    design = _design_text(data)
    caveats = ([html.escape(design)] if design else []) \
        + [html.escape(w) for w in sa.warnings if w not in analysis.warnings] \
        + [html.escape("warning: " + w) for w in analysis.warnings if w.startswith(_READOUT_NOTE)]
    return (head + table + "".join(f"<p class='warn'>{c}</p>" for c in caveats))


_READOUT_NOTE = "this sweep has too few held-out evaluations"
COMPARISON_PLOTS = ("steps_vs_examples.png", "batch_tradeoff.png")
"""With an analysis over seeds, these plots (from the first seed's training loss) go with that comparison."""


def _lead_first_seed_html(data: SweepData, analysis: Analysis) -> str:
    """The answer when there is no analysis over seeds: the (first seed's) training-loss analysis."""
    rec = analysis.recommendation
    head = (f"<p class='rec'>Recommended batch: <b>{html.escape(batch_label(data, rec.batch_size))}</b> at lr "
            f"{rec.lr:g}</p><pre>{html.escape(rec.text())}</pre>" if rec is not None else
            "<p class='rec'>No recommendation: no batch reached the target, or no throughput was recorded.</p>")
    rows = [[r[0], r[2], r[3]] for r in _fit_rows(data, analysis)]
    table = _table_html(["target loss (training, EMA)", f"B_crit ± SE, {data.unit}s per step (McCandlish)",
                         "95% CI (one-sided bound if extrapolated)"], rows)
    warns = "".join(f"<p class='warn'>warning: {html.escape(w)}</p>" for w in analysis.warnings)
    return head + "<p>One seed: no spread over seeds is known; the interval is the fit's alone.</p>" + table + warns


def _first_seed_comparison_html(data: SweepData, analysis: Analysis, figures: str = "") -> str:
    """The first seed's training-loss analysis, as a comparison with the answer (its own pick and B_crit)."""
    rec = analysis.recommendation
    text = "\n".join("first seed's pick: " + line[len("recommend "):] if line.startswith("recommend ") else line
                     for line in rec.text().splitlines()) if rec is not None else ""
    pick = (f"<p>On the first seed's training loss alone the pick would be "
            f"{html.escape(batch_label(data, rec.batch_size))} at lr {rec.lr:g}.</p><pre>{html.escape(text)}</pre>"
            if rec is not None else "<p>On the first seed's training loss alone no batch can be picked.</p>")
    return pick + _numbers_html(data, analysis, pick="◀ first seed's pick") + figures


def _numbers_html(data: SweepData, analysis: Analysis, pick: str = "◀ recommended") -> str:
    return (f"<h3>At the primary target ({analysis.targets[0].target:.4f})</h3>"
            + _table_html([h.replace('units', data.unit + 's') for h in POINT_HEADER], _point_rows(data, analysis, pick))
            + "<h3>Critical batch at each loss target</h3>"
            "<p>B_crit = E_min/S_min from the fit of S(B) = S_min(1 + B_crit/B) in log space (McCandlish et al. 2018); "
            "SE from the fit covariance, CI with a Student-t quantile; when B_crit falls outside the swept batches only "
            "a one-sided 95% bound is reported. CBS 20% = batch where steps exceed the linear-scaling ideal E_min/B by "
            "20% (Zhang et al. 2024) = 0.2·B_crit. The two definitions differ by 5×. Units: "
            f"{html.escape(data.unit)}s per step.</p>" + _table_html(FIT_HEADER, _fit_rows(data, analysis)))


def _seed_details_html(data: SweepData, analysis: Analysis, sa: SeedAnalysis) -> str:
    u = html.escape(data.unit)
    return ("<p>Steps to each target from the monotone fit of the held-out loss (a fixed random held-out draw, "
            "log-spaced evaluations), at one LR per batch for every seed and target (least median steps over seeds at "
            "the primary target); fits per seed (non-monotone cells flagged and left out), the median over seeds with "
            "the seed range and a bootstrap over seeds, and one joint fit of B_crit(L) = B_ref·(L/L_ref)^k across "
            "targets and seeds.</p>"
            + f"<p>{html.escape(lr_selection_text(sa))}</p>"
            + (f"<pre>{html.escape(sa.recommendation.text())}</pre>" if sa.recommendation is not None else "")
            + _table_html(STEPS_HEADER, _steps_rows(data, sa)) + _table_html(SEED_HEADER, _seed_rows(data, sa))
            + (f"<p class='warn'>{html.escape(joint_text(sa))}</p>" if sa.joint_flags else "")
            + "".join(f"<p>B_simple at loss {t:.4f} (chosen-LR trials; depends on the LR): local "
                      f"{_fmt(v.get('local'))}, path-averaged {_fmt(v.get('path_averaged'))} {u}s</p>"
                      for t, v in sa.b_simple.items()))


def _details(summary: str, body: str, *, open_: bool = False) -> str:
    return (f"<details{' open' if open_ else ''}><summary>{html.escape(summary)}</summary>"
            f"<div class='inner'>{body}</div></details>")


def render_html(data: SweepData, analysis: Analysis, plots: Sequence[tuple[str, str]], *, title: str = "globalbatch sweep report",
                seed_analysis: Optional[SeedAnalysis] = None, extra_html: str = "") -> str:
    """The page: one answer first (``<section id="answer">``: the recommended batch, how sure, B_crit(L) with its
    spread), then the plots, then the numbers behind it and the comparisons, collapsed (``<details>``).

    The answer comes from the analysis over seeds when there is one; the first seed's training-loss analysis is
    then a comparison (collapsed, labelled so). Every value that comes from the run directory is escaped
    (``html.escape``): a page never runs what a directory says (a shared report with
    ``"unit": "<img onerror=…>"`` stays text).
    """
    def esc(value: object) -> str:
        return html.escape(str(value), quote=True)

    u = esc(data.unit)
    cfg = data.config
    sa = seed_analysis
    imgs: list[str] = []
    comparison_imgs: list[str] = []
    for caption, path in plots:
        b64 = base64.b64encode(Path(path).read_bytes()).decode("ascii")
        fig = (f"<figure><img alt='{html.escape(caption)}' src='data:image/png;base64,{b64}'>"
               f"<figcaption>{html.escape(caption)}</figcaption></figure>")
        (comparison_imgs if sa is not None and Path(path).name in COMPARISON_PLOTS else imgs).append(fig)
    notes = [w for w in analysis.warnings if sa is None or not w.startswith(_READOUT_NOTE)]
    notes_html = ("" if sa is None or not notes else  # (without seeds the lead shows them)
                  "<div class='notes'>" + "".join(f"<p class='warn'>warning: {html.escape(w)}</p>" for w in notes)
                  + "</div>")
    if sa is not None:
        readout = "held-out" if sa.readout == "heldout" else "training"
        lead = _lead_seeds_html(data, analysis, sa)
        source = (f"From the {readout} loss of {len(sa.seeds)} seed(s) ({esc(', '.join(map(str, sa.seeds)))}); "
                  "the numbers behind it and the comparisons are below the plots.")
        below = (_details(f"The numbers behind the answer: steps to target and B_crit per seed ({readout} loss)",
                          _seed_details_html(data, analysis, sa))
                 + _details("Comparison, not the answer: the first seed alone, training-loss read-out (EMA)",
                            _first_seed_comparison_html(data, analysis, "".join(comparison_imgs))))
    else:
        lead = _lead_first_seed_html(data, analysis)
        source = "From the training loss (EMA) of one seed; the numbers behind it are below the plots."
        below = _details("The numbers behind the answer: steps to target and B_crit per target",
                         _numbers_html(data, analysis))
    below += _details("All trials", _table_html([h.replace('unit', data.unit) for h in TRIAL_HEADER], _trial_rows(data)))
    missing = (f"<p class='warn'>{len(data.missing)} trial(s) not finished: {html.escape(', '.join(data.missing))}</p>"
               if data.missing else "")
    overrides = f" {html.escape(json.dumps(cfg.task_overrides))}" if cfg.task_overrides else ""
    grid = (f"task <code>{esc(cfg.task)}</code>{overrides}; batches "
            f"{esc(cfg.batches)} samples; lrs {esc(cfg.lrs)} at batch {esc(cfg.base_batch or min(cfg.batches))}, LR rule "
            f"{esc(cfg.lr_rule_resolved())}; budget {esc(f'{cfg.budget:,}')} {u}s per trial; seeds {esc(cfg.seed_list())}; "
            f"optimizer {esc(cfg.optimizer)}; LR warmup {esc(f'{cfg.warmup_units():,}')} {u}s"
            + (f" and at least {esc(cfg.warmup_min_steps)} steps of each batch (at most half the budget)"
               if cfg.warmup_min_steps else "") + f" then {esc(cfg.lr_shape)}; "
            + (f"EMA half-life {analysis.halflife_steps:g} steps" if analysis.halflife_steps is not None
               else f"EMA half-life {analysis.ema_fraction:g} × each trial's steps to the target") + " (lag-corrected)")
    css = ("body{font-family:sans-serif;max-width:1200px;margin:2em auto;color:#222}"
           "table{border-collapse:collapse;margin:1em 0;font-size:13px}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
           "th{background:#f3f3f3}figure{margin:1.5em 0}img{max-width:100%;border:1px solid #ddd}"
           "#answer{border:2px solid #4a7;border-radius:6px;padding:0.2em 1.2em 0.6em;background:#f6fbf7}"
           "details{margin:0.8em 0;border:1px solid #ddd;border-radius:4px;padding:0.4em 0.8em}"
           "summary{cursor:pointer;font-weight:bold}.inner{margin-top:0.6em}.grid{color:#555;font-size:0.9em}.notes{font-size:0.85em}"
           ".rec{font-size:1.3em}.warn{color:#a60}pre{background:#f7f7f7;padding:0.8em;white-space:pre-wrap}")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title><style>{css}</style></head>
<body>
<h1>{html.escape(title)}</h1>
{missing}
<section id="answer">
<h2>The answer</h2>
{lead}
<p class="grid">{source}</p>
</section>
<p class="grid">{grid}</p>
{notes_html}
<h2>Plots</h2>
{''.join(imgs)}
<h2>The numbers behind it, and comparisons</h2>
{below}
{extra_html}
<p id="img-check" class="foot">images rendered: checking…</p>
<script>
// Self-check for headless browsers: count the embedded plots the browser actually decoded.
window.addEventListener("load", function () {{
  var imgs = document.querySelectorAll("figure img"), ok = 0;
  imgs.forEach(function (im) {{ if (im.complete && im.naturalWidth > 0) ok++; }});
  document.getElementById("img-check").textContent = "images rendered: " + ok + " of " + imgs.length;
}});
</script>
<p class="foot">Generated {time.strftime('%Y-%m-%d %H:%M:%S')} by globalbatch from {html.escape(data.out_dir)}.
{html.escape(_throughput_note(data))}</p>
</body></html>
"""


def _throughput_note(data: SweepData) -> str:
    if data.timing:
        return ("Throughput, time and cost to target come from the sequential timing pass (each batch alone, all "
                "threads, its best LR); the in-trial units/s were measured while trials shared the cores.")
    return ("Throughput is measured inside each trial (evaluation excluded), median over each batch's LRs, "
            "while trials shared the machine.")


def seed_analysis_or_note(run_dir: str | os.PathLike, *, settings: Optional[AnalysisSettings] = None,
                          **old: Any) -> tuple[Optional[SeedAnalysis], Optional[str]]:
    """The analysis over seeds, falling back to the training read-out for a sweep without enough held-out
    evaluations (older sweeps, ``--eval-every`` runs); ``(None, why)`` when there is none. ``settings``: a
    :class:`globalbatch.critical.AnalysisSettings`; ``old``: the keywords before ``settings`` (deprecated)."""
    s = settings_from(settings, old, caller="seed_analysis_or_note")
    try:
        _, sa, note = analyze_sweep_seeds_or_train(run_dir, s)
        return sa, note
    except TargetNotReachedError:
        raise  # a target no batch reaches: no page to write
    except SettingError as exc:
        return None, f"no analysis over seeds: {exc}"


REPORT_NAMES = {**FIRST_SEED_NAMES, "seed_targets": "targets"}
"""The old keywords of :func:`write_report` → the settings' fields (``targets`` were the first seed's)."""


def write_report(run_dir: str | os.PathLike, out_dir: Optional[str | os.PathLike] = None, *,
                 settings: Optional[AnalysisSettings] = None, scale: Optional[dict[str, Any]] = None,
                 **old: Any) -> ReportResult:
    """Analyse the sweep in ``run_dir`` and write the plots, ``analysis.json`` and ``report.html``.

    Args:
        out_dir: where to write; default ``run_dir/report``.
        settings: a :class:`globalbatch.critical.AnalysisSettings` for both analyses: the analysis over seeds
            (:func:`analyze_sweep_seeds`) and the first seed's training-loss one (its ``first_seed_`` fields).
        scale: a ``globalbatch scale --json`` answer (:func:`globalbatch.lab.scale_section.load_scale_json`): adds
            its section (the Pareto plot ``scale_pareto.png``, the table per GPU count, the assumptions) to the page.
        old: the keywords before ``settings`` (deprecated: ``targets``/``n_targets`` are its ``first_seed_``
            ones, ``seed_targets`` its ``targets``).
    """
    s = settings_from(settings, old, caller="write_report", renames=REPORT_NAMES)
    seed_analysis, seed_note = seed_analysis_or_note(run_dir, settings=s)
    data, analysis = analyze_sweep(run_dir, settings=s)
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    plots: list[tuple[str, str]] = [
        ("Loss against consumed data per batch", plot_loss_vs_data(data, analysis, out / "loss_vs_data.png",
                                                                   chosen_lr=_chosen_lr(seed_analysis))),
        ("Steps against examples with the fitted hyperbola (first seed, training-loss read-out)",
         plot_steps_vs_examples(data, analysis, out / "steps_vs_examples.png")),
        ("Units to target, throughput and wall-clock against batch (first seed, training-loss read-out)",
         plot_batch_tradeoff(data, analysis, out / "batch_tradeoff.png")),
    ]
    if seed_note is not None:
        analysis.warnings.append(seed_note)
    if seed_analysis is not None:
        plots.append(("Critical batch against the loss, per seed, with the joint fit",
                      plot_b_crit_vs_loss(data, seed_analysis, out / "b_crit_vs_loss.png")))
    noise = plot_noise_scale(data, out / "noise_scale.png")
    if noise is not None:
        plots.append(("Gradient noise scale against consumed data", noise))
    if seed_analysis is not None:  # page order: the first seed's plots sit with that comparison, at the end
        plots.sort(key=lambda cp: Path(cp[1]).name in COMPARISON_PLOTS)
    summary = {"analysis": analysis.to_dict(), "batch_units": data.batch_units(), "missing": data.missing,
               "grid": data.config.manifest()["grid"],
               "seeds": seed_json(data, seed_analysis) if seed_analysis is not None else None}
    atomic_write_json(out / "analysis.json", summary)
    extra_html, plot_paths = "", [p for _, p in plots]
    if scale is not None:
        scale_plot = pareto_figure(scale, out / "scale_pareto.png")
        extra_html = scale_section_html(scale, scale_plot)
        plot_paths.append(scale_plot)
    page = render_html(data, analysis, plots, seed_analysis=seed_analysis, extra_html=extra_html)
    atomic_write_text(out / "report.html", page)
    return ReportResult(html=str(out / "report.html"), plots=plot_paths, analysis_json=str(out / "analysis.json"),
                        analysis=analysis, data=data, seed_analysis=seed_analysis)
