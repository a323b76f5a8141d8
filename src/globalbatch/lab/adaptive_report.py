"""The report of ``globalbatch adaptive``: four PNGs and a markdown page with the verdict.

1. ``loss_vs_tokens.png`` — held-out loss against trained tokens, seed mean per arm (band: min–max over
   seeds), the target dashed;
2. ``loss_vs_steps.png`` — the same against optimizer steps;
3. ``batch_over_time.png`` — the adaptive run's global batch against tokens, one line per seed;
4. ``steps_vs_tokens.png`` — steps against tokens to reach the target, one point per arm (95 % t-intervals
   over seeds as error bars), the fixed batches' front joined.

``report.md`` embeds them by relative path and tabulates tokens- and steps-to-target with intervals;
``result.json`` holds the analysis. matplotlib is imported lazily (Agg backend).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import numpy as np

from globalbatch._util import atomic_write_json, atomic_write_text
from globalbatch.lab.adaptive_run import AdaptiveAnalysis, analyze_adaptive
from globalbatch.lab.report_plots import _plt, _save

__all__ = ["write_adaptive_report", "format_analysis"]


def _mean_curve(runs: list[list[dict]], key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Seed-mean loss on a common x grid (each run interpolated in x), with min and max."""
    xs = np.unique(np.concatenate([[e[key] for e in r] for r in runs]).astype(float))
    ys = np.array([np.interp(xs, [e[key] for e in r], [e["val_loss"] for e in r]) for r in runs])
    return xs, ys.mean(0), ys.min(0), ys.max(0)


def _ci(d: dict) -> str:
    if not math.isfinite(d.get("mean", math.nan)):
        return "not reached"
    return f"{d['mean']:,.0f} [{d['low']:,.0f}, {d['high']:,.0f}]"


def _ratio(d: dict) -> str:
    if not math.isfinite(d.get("mean", math.nan)):
        return "n/a"
    return f"{d['mean']:.3f} [{d['low']:.3f}, {d['high']:.3f}]"


def _per_seed(a: AdaptiveAnalysis) -> str:
    out = []
    for s, v in zip(a.seeds, a.front_ratio.get("values") or [math.nan] * len(a.seeds)):
        dom = a.dominated_by.get(s, [])
        out.append(f"seed {s}: {v:.3f}" + (f" (dominated by {', '.join(dom)})" if dom else ""))
    return "; ".join(out)


def format_analysis(a: AdaptiveAnalysis) -> str:
    """A plain-text summary (the CLI prints it; the markdown page holds the same numbers)."""
    lines = [f"target held-out loss {a.target:.4f} ({a.target_source}); seeds {', '.join(map(str, a.seeds))}",
             f"{'arm':>10}  {'tokens to target (95% CI)':>34}  {'steps to target (95% CI)':>28}  final loss"]
    for arm, d in a.arms.items():
        lines.append(f"{arm:>10}  {_ci(d['tokens']):>34}  {_ci(d['steps']):>28}  {d['final_loss']['mean']:.4f}")
    lines.append(f"best fixed batch by tokens: {a.best_fixed}")
    lines.append(f"adaptive / front tokens at its steps: {_ratio(a.front_ratio)} (<= 1: on or beyond the front); "
                 f"per seed {_per_seed(a)}")
    lines.append(a.verdict)
    return "\n".join(lines)


def write_adaptive_report(out: str | Path, *, targets: Optional[list[float]] = None,
                          policy: Optional[dict] = None) -> tuple[list[AdaptiveAnalysis], list[str]]:
    """Analyse ``out`` at each target (default: the "half" and "all" targets of :func:`analyze_adaptive`) and
    write the PNGs (for the first target), ``report.md`` and ``result.json`` into ``out/report``."""
    if targets:
        analyses = [analyze_adaptive(out, target=t, policy=policy) for t in targets]
    else:
        # "half" first: the "all" target is often reached before the first change (then adaptive = its first batch)
        analyses = [analyze_adaptive(out, policy=policy, default=d) for d in ("half", "all")]
    a = analyses[0]
    rep = Path(out) / "report"
    plt = _plt()
    plots = []
    colors = plt.get_cmap("viridis")
    fixed = [k for k in a.arms if k != "adaptive"]
    style = {arm: dict(color=colors(i / max(1, len(fixed) - 1)), lw=1.2) for i, arm in enumerate(fixed)}
    style["adaptive"] = dict(color="crimson", lw=2.2)
    for key, name, xlabel in (("consumed", "loss_vs_tokens.png", "trained tokens"),
                              ("step", "loss_vs_steps.png", "optimizer steps")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for arm in a.arms:
            runs = [a.curves[arm][s][1:] for s in a.seeds]  # skip the read-out at 0 (log axis)
            x, m, lo, hi = _mean_curve(runs, key)
            ax.plot(x, m, label=arm, **style[arm])
            ax.fill_between(x, lo, hi, color=style[arm]["color"], alpha=0.15)
        for i, t in enumerate(analyses):
            ax.axhline(t.target, ls="--", color="grey", lw=1, label=f"target {t.target:.3f}" if i == 0 else
                       f"target {t.target:.3f}", alpha=1.0 if i == 0 else 0.6)
        ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out loss per token")
        ax.set_title(f"held-out loss vs {xlabel} (mean of {len(a.seeds)} seeds, band min–max)")
        ax.legend(fontsize=8)
        plots.append(_save(fig, rep / name))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for s in a.seeds:
        ev = a.curves["adaptive"][s]
        x0 = float(ev[1]["consumed"]) if len(ev) > 1 else 1.0  # the first read-out after 0 (log axis)
        xs, bs = [x0], [ev[0]["batch"]]
        for ch in a.changes.get(s, []):
            xs += [max(x0, ch["position"]), max(x0, ch["position"])]
            bs += [bs[-1], ch["new_batch"]]
        xs.append(float(ev[-1]["consumed"]))
        bs.append(bs[-1])
        ax.plot(xs, bs, label=f"seed {s}", lw=1.5)
    ax.set_xscale("log")
    ax.set_yscale("log", base=2)
    ax.set_xlabel("trained tokens")
    ax.set_ylabel("global batch (sequences)")
    ax.set_title("adaptive global batch over training")
    ax.legend(fontsize=8)
    plots.append(_save(fig, rep / "batch_over_time.png"))
    fig, ax = plt.subplots(figsize=(6, 4.5))
    pts = []
    for arm, d in a.arms.items():
        t, st = d["tokens"], d["steps"]
        if not math.isfinite(t["mean"]):
            continue
        ax.errorbar(st["mean"], t["mean"], xerr=[[st["mean"] - st["low"]], [st["high"] - st["mean"]]],
                    yerr=[[t["mean"] - t["low"]], [t["high"] - t["mean"]]], fmt="o", color=style[arm]["color"],
                    label=arm, capsize=3)
        if arm != "adaptive":
            pts.append((st["mean"], t["mean"]))
    if pts:
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color="grey", lw=1, ls=":", label="fixed-batch front")
    ax.set_xscale("log")
    ax.set_yscale("log")
    from matplotlib.ticker import NullFormatter

    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("optimizer steps to target")
    ax.set_ylabel("tokens to target")
    ax.set_title(f"steps vs tokens to loss {a.target:.3f}")
    ax.legend(fontsize=8)
    plots.append(_save(fig, rep / "steps_vs_tokens.png"))

    sections = []
    for t in analyses:
        sections += [f"## Target {t.target:.4f} ({t.target_source})", "", f"**Verdict.** {t.verdict}", "",
                     f"Best fixed batch by tokens: {t.best_fixed}. Adaptive tokens ÷ the fixed front's tokens at the "
                     f"adaptive run's steps: {_ratio(t.front_ratio)} (≤ 1: on or beyond the front); {_per_seed(t)}.", "",
                     "| arm | tokens to target (95% CI) | steps to target (95% CI) | final held-out loss |",
                     "|---|---|---|---|"]
        for arm, d in t.arms.items():
            sections.append(f"| {arm} | {_ci(d['tokens'])} | {_ci(d['steps'])} | {d['final_loss']['mean']:.4f} |")
        sections.append("")
    changes = []
    for s in a.seeds:
        chs = a.changes.get(s, [])
        changes.append(f"- seed {s}: " + (", ".join(f"{c['old_batch']} → {c['new_batch']} at {c['position']:,} tokens "
                                                     f"(step {c['step']}; lr × {c['lr_mult']:.3g}; {c['reason']})"
                                                     for c in chs) or "no change"))
    md = "\n".join([
        "# globalbatch adaptive: adaptive global batch vs fixed batches", "",
        f"Seeds {', '.join(map(str, a.seeds))}; intervals are 95% t-intervals over seeds (ratios: paired, "
        "geometric mean). Points to target are interpolated between held-out read-outs.", "",
        *sections,
        "## Batch changes", "", *changes, "",
        *[f"![{Path(p).stem}]({Path(p).name})" for p in plots], "",
    ])
    atomic_write_text(rep / "report.md", md)
    atomic_write_json(rep / "result.json",
                      json.loads(json.dumps({"targets": [t.as_dict() for t in analyses]}, default=float)))
    return analyses, plots + [str(rep / "report.md")]
