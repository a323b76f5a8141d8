"""The sweep report's plots (PNG, matplotlib with the Agg backend, imported lazily).

McCandlish et al. 2018 (arXiv 1812.06162), figs. 4–7, show the same views: the loss against consumed units,
steps against examples to each target with the fitted hyperbola (S/S_min − 1)(E/E_min − 1) = 1, the batch
trade-off at the primary target, the gradient noise scale along the trials, and B_crit against the loss.
:mod:`globalbatch.lab.report` lays them out on the page.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np

from globalbatch._util import atomic_write
from globalbatch.critical import Analysis, ema_smooth
from globalbatch.errors import Raw, SettingError
from globalbatch.critical.seeds import SeedAnalysis
from globalbatch.lab.sweep import SweepData

__all__ = ["batch_label", "plot_loss_vs_data", "plot_steps_vs_examples", "plot_batch_tradeoff", "plot_noise_scale",
           "plot_b_crit_vs_loss"]


def batch_label(data: SweepData, units: float) -> str:
    """The batch in samples with its mean units per step, e.g. ``"batch 64 (≈2,030 tokens)"``."""
    return data.label(units)


def _plt():
    try:
        import matplotlib
    except ImportError:
        raise SettingError("report", Raw("without matplotlib"), "pip install 'globalbatch[plot]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> str:
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110, bbox_inches="tight"))
    _plt().close(fig)
    return str(path)


def _legend(ax, **kwargs) -> None:
    """A legend only when the axes have labelled artists (else matplotlib warns on stderr)."""
    handles, _ = ax.get_legend_handles_labels()
    if handles:
        ax.legend(**kwargs)


def _colors(n: int):
    cmap = _plt().get_cmap("viridis")
    return [cmap(x) for x in np.linspace(0.05, 0.9, max(n, 1))]


def _chosen_lr(sa: Optional[SeedAnalysis]) -> dict[float, float]:
    """The seed analysis' one LR per batch (at its primary target), where it has one."""
    if sa is None:
        return {}
    out = {}
    for b, by_seed in sa.primary.best_lr.items():
        lrs = {lr for lr in by_seed.values() if lr is not None}
        if len(lrs) == 1:
            out[b] = lrs.pop()
    return out


def _best_lr_by_batch(analysis: Analysis) -> dict[float, float]:
    t = analysis.targets[0]
    return {p.batch_size: p.lr for p in t.points}


def plot_loss_vs_data(data: SweepData, analysis: Analysis, path: Path,
                      chosen_lr: Optional[dict[float, float]] = None) -> str:
    """``chosen_lr``: batch (units per step) → the LR drawn bold (the seed analysis' one LR per
    batch); default the first seed's best LR at its first target."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9.5, 5))
    units = data.batch_units()
    colors = dict(zip(units, _colors(len(units))))
    best = chosen_lr if chosen_lr else _best_lr_by_batch(analysis)
    labelled: set[int] = set()  # one legend entry per batch: its chosen LR (every seed drawn alike)
    for name, recs in sorted(data.trials.items(), key=lambda kv: (data.summaries[kv[0]].batch, data.summaries[kv[0]].lr)):
        s = data.summaries[name]
        b, lr = s.batch, float(s.lr)
        steps = [r for r in recs if r.get("kind") == "step"]
        if not steps:
            continue
        x = np.array([r["consumed"] for r in steps], dtype=float)
        y, _ = ema_smooth(np.array([r["loss"] for r in steps], dtype=float), analysis.halflife_for(len(steps)))
        is_best = best.get(units[b]) == lr
        label = None
        if is_best and b not in labelled:
            labelled.add(b)
            label = f"{batch_label(data, units[b])}, lr {lr:g}"
        ax.plot(x, y, color=colors[b], lw=1.8 if is_best else 0.6, alpha=0.9 if is_best else 0.25, label=label,
                zorder=3 if is_best else 2)
        ev = [r for r in recs if "val_loss" in r and r["consumed"] > 0]
        if is_best and ev:
            ax.plot([r["consumed"] for r in ev], [r["val_loss"] for r in ev], "o", ms=2.5, color=colors[b], mfc="white",
                    mew=0.8, zorder=4)
    for t in analysis.targets:
        ax.axhline(t.target, color="grey", ls="--", lw=0.7)
    ax.set_xscale("log")
    ax.set_xlabel(f"{data.unit}s consumed")
    ax.set_ylabel("training loss (EMA) · validation ○")
    ax.set_title("Loss against consumed data (bold: each batch at its chosen LR, every seed; faint: the other LRs; "
                 "dashed: targets)", fontsize=9)
    _legend(ax, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, frameon=False,
            title="batch, chosen lr", title_fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_steps_vs_examples(data: SweepData, analysis: Analysis, path: Path) -> str:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5.5))
    colors = _colors(len(analysis.targets))
    for t, c in zip(analysis.targets, colors):
        if not t.points:
            continue
        e = np.array([p.examples for p in t.points])
        s = np.array([p.steps for p in t.points])
        label = f"loss {t.target:.3f}"
        if t.fit is not None:
            f = t.fit
            bound = f.b_crit_bound(0.95)
            label += (f": B_crit {f.b_crit:,.0f} ± {f.se_b_crit:,.0f}" if bound is None
                      else f": B_crit {'>' if bound[0] == 'lower' else '<'} {bound[1]:,.0f} (extrapolated)")
            bb = np.geomspace(min(f.batch_range[0], f.b_crit) / 4, max(f.batch_range[1], f.b_crit) * 4, 200)
            ax.plot(f.examples(bb), f.steps(bb), color=c, lw=1.2)
            ax.plot([2 * f.e_min], [2 * f.s_min], marker="*", ms=11, color=c, mec="black", mew=0.5, ls="none")
        ax.plot(e, s, "o", color=c, label=label, ms=6)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"{data.unit}s to reach target (E)")
    ax.set_ylabel("optimizer steps to reach target (S)")
    ax.set_title("Steps vs examples: (S/S_min − 1)(E/E_min − 1) = 1  (★ = B_crit: 2·S_min, 2·E_min)")
    _legend(ax, fontsize=8)
    ax.grid(alpha=0.3, which="both")
    return _save(fig, path)


def plot_batch_tradeoff(data: SweepData, analysis: Analysis, path: Path) -> str:
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    t = analysis.targets[0]
    b = np.array([p.batch_size for p in t.points])
    e = np.array([p.examples for p in t.points])
    axes[0].plot(b, e, "o-", label="measured (best LR)")
    if t.fit is not None:
        bb = np.geomspace(b.min(), b.max(), 100) if b.size else np.array([])
        axes[0].plot(bb, t.fit.examples(bb), "--", label=f"fit, B_crit {t.fit.b_crit:,.0f}")
        axes[0].axvline(t.fit.b_crit, color="grey", ls=":", lw=1)
    for u in t.unreached:
        axes[0].axvline(u, color="red", alpha=0.3, lw=4)
    axes[0].set_title(f"{data.unit}s to loss {t.target:.3f} (red: not reached)")
    tp_b, tp = [], []
    units = data.batch_units()
    in_b, in_tp = [], []
    for batch, u in units.items():
        rate = data.units_per_s(batch)
        if rate:
            tp_b.append(u)
            tp.append(rate)
        inner = data.in_trial_units_per_s(batch)
        if inner and data.timing:
            in_b.append(u)
            in_tp.append(inner)
    axes[1].plot(tp_b, tp, "o-", color="tab:green", label="timing pass (alone)" if data.timing else "in-trial (median over LRs)")
    if in_b:
        axes[1].plot(in_b, in_tp, "x:", color="grey", label="in-trial (shared cores)")
    _legend(axes[1], fontsize=8)
    axes[1].set_title(f"throughput ({data.unit}s/s)")
    times = [(p.batch_size, p.time_s) for p in t.points if p.time_s is not None]
    if times:
        axes[2].plot([x for x, _ in times], [y for _, y in times], "o-", color="tab:orange")
    if analysis.recommendation is not None:
        for ax in axes:
            ax.axvline(analysis.recommendation.batch_size, color="tab:red", ls="--", lw=1, label="recommended")
    axes[2].set_title("wall-clock to target (s)")
    ticks = sorted(units.values())
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xticks(ticks)
        ax.set_xticklabels([f"{u:,.0f}" for u in ticks], rotation=45, fontsize=8)
        ax.minorticks_off()
        ax.set_xlabel(f"batch ({data.unit}s per step)")
        ax.grid(alpha=0.3, which="both")
    _legend(axes[0], fontsize=8)
    _legend(axes[2], fontsize=8)
    fig.tight_layout()
    return _save(fig, path)


def plot_noise_scale(data: SweepData, path: Path) -> Optional[str]:
    series = []
    for name, recs in data.trials.items():
        pts = [(r["consumed"], r["b_simple"]) for r in recs
               if r.get("b_simple") is not None and np.isfinite(r["b_simple"]) and r["b_simple"] > 0
               and not r.get("b_simple_flags")]
        if pts:
            series.append((name, pts))
    if not series:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, pts in sorted(series):
        ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1, label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"{data.unit}s consumed")
    ax.set_ylabel(f"B_simple ({data.unit}s)")
    ax.set_title("Gradient noise scale B_simple = tr(Σ)/|G|² (McCandlish 2018; unflagged estimates)")
    _legend(ax, fontsize=7, ncol=2)
    ax.grid(alpha=0.3, which="both")
    return _save(fig, path)


def plot_b_crit_vs_loss(data: SweepData, sa: SeedAnalysis, path: Path) -> str:
    """B_crit per seed and its median at every target, with the joint power law B_crit(L) and its band."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    colors = dict(zip(sa.seeds, _colors(len(sa.seeds))))
    for st in sa.targets:
        for s, v in st.b_crit_per_seed.items():
            if v is not None:
                ax.plot([st.target], [v], "o", color=colors[s], ms=4, alpha=0.8,
                        label=f"seed {s}" if st is sa.targets[0] else None)
        if st.b_crit is not None:
            ax.plot([st.target], [st.b_crit], "_", color="black", ms=14, mew=2,
                    label="median over seeds" if st is sa.targets[0] else None)
    if sa.joint is not None:
        ls = np.linspace(min(t.target for t in sa.targets), max(t.target for t in sa.targets), 50)
        flags = "; ".join(f.split(":")[0] for f in sa.joint_flags)
        ax.plot(ls, [sa.joint.b_crit(x) for x in ls], "--" if flags else "-", color="tab:red",
                label=(f"joint fit, a comparison (flagged: {flags})" if flags else
                       f"joint fit: B_crit ∝ L^{sa.joint.k:.2f} (α_B = {sa.joint.alpha_b:.2f})"))
        band = np.array([sa.joint.interval(x) for x in ls])
        ax.fill_between(ls, band[:, 0], band[:, 1], color="tab:red", alpha=0.15)
    ax.set_yscale("log")
    ax.invert_xaxis()
    ax.set_xlabel(f"target loss ({'held-out' if sa.readout == 'heldout' else 'training'})")
    ax.set_ylabel(f"B_crit ({data.unit}s per step)")
    ax.set_title("Critical batch against the loss (McCandlish 2018; joint power law as Kaplan 2020)")
    _legend(ax, fontsize=8)
    ax.grid(alpha=0.3, which="both")
    return _save(fig, path)
