"""The scale section of a sweep's HTML report: the time-versus-GPU-hours Pareto front of ``globalbatch scale``.

The answer of ``globalbatch scale`` depends on a cluster, a target loss and a GPU range chosen on its command line,
not on the sweep alone; so the report does not recompute it: it reads what ``globalbatch scale RUN_DIR --json``
printed (``globalbatch report RUN_DIR --scale scale.json``) and shows the Pareto plot, the table per GPU count, the
best batch, the best ramp and every assumption the JSON states (convergence source, cluster and its sources, MFU
curve, notes). :func:`pareto_figure` is also the plot of ``globalbatch scale --plot``.
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Any

from globalbatch._util import atomic_write
from globalbatch.errors import SettingError

__all__ = ["load_scale_json", "pareto_figure", "scale_section_html"]

_ROW_KEYS = ("gpus", "global_batch", "global_batch_tokens", "geometry", "steps", "tokens", "compute_s", "comm_exposed_s",
             "bubble_s", "mfu", "time_s", "gpu_hours", "statistical_efficiency", "pareto", "meets_limits")
_TOP_KEYS = ("target_loss", "rows", "best", "objective", "cluster", "convergence", "throughput_source", "notes", "model")


def load_scale_json(path: str, field: str = "scale") -> dict[str, Any]:
    """A ``globalbatch scale --json`` output, every key the section reads checked; errors name ``field``."""
    allowed = "a `globalbatch scale ... --json` output (a JSON file)"
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise SettingError(field, path, allowed, why=" ".join(str(exc).split())[:120]) from None
    if not isinstance(doc, dict):
        raise SettingError(field, path, allowed, why="not a JSON object")
    missing = [k for k in _TOP_KEYS if k not in doc]
    if missing:
        raise SettingError(field, path, allowed, why="missing " + ", ".join(missing))
    rows = doc["rows"]
    if not isinstance(rows, list) or not rows:
        raise SettingError(field, path, allowed, why="'rows' is not a non-empty list")
    for i, r in enumerate(rows):
        if not isinstance(r, dict) or any(k not in r for k in _ROW_KEYS):
            raise SettingError(field, path, allowed, why=f"rows[{i}] lacks " +
                               ", ".join(k for k in _ROW_KEYS if not isinstance(r, dict) or k not in r))
        for k in ("gpus", "time_s", "gpu_hours"):
            v = r[k]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise SettingError(field, path, allowed, why=f"rows[{i}].{k} is {v!r}, not a number > 0")
    if not isinstance(doc["cluster"], dict) or not isinstance(doc["convergence"], dict):
        raise SettingError(field, path, allowed, why="'cluster' and 'convergence' must be objects")
    return doc


def pareto_figure(doc: dict[str, Any], path: str | Path) -> str:
    """Time to target against GPU-hours, one point per GPU count, the Pareto front joined, the best starred
    (matplotlib, Agg); ``doc`` is ``ScaleResult.to_dict()`` (what ``--json`` prints). Written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["rows"]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ax.scatter([r["gpu_hours"] for r in rows], [r["time_s"] / 3600 for r in rows], s=14, c="#888",
               label="best batch per GPU count")
    front = sorted((r for r in rows if r["pareto"]), key=lambda r: r["gpu_hours"])
    ax.plot([r["gpu_hours"] for r in front], [r["time_s"] / 3600 for r in front], "o-", c="C0", label="Pareto front")
    for r in front[:: max(1, len(front) // 8)]:
        ax.annotate(f"{r['gpus']:,}", (r["gpu_hours"], r["time_s"] / 3600), fontsize=7, xytext=(3, 3),
                    textcoords="offset points")
    best = doc.get("best")
    if best is not None:
        ax.plot([best["gpu_hours"]], [best["time_s"] / 3600], "*", ms=12, c="C3", label=f"best ({doc['objective']})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("GPU-hours to target")
    ax.set_ylabel("hours to target")
    ax.set_title(f"target loss {doc['target_loss']:g}: time vs GPU-hours ({doc['cluster'].get('name', '?')})", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110))
    plt.close(fig)
    return str(path)


def _s(x: float) -> str:
    for lim, div, unit in ((1, 1e-3, "ms"), (120, 1, "s"), (7200, 60, "min"), (3 * 86400, 3600, "h")):
        if x < lim:
            return f"{x / div:,.1f} {unit}" if unit != "s" else f"{x:,.2f} s"
    return f"{x / 86400:,.1f} d"


def scale_section_html(doc: dict[str, Any], plot_path: str | Path) -> str:
    """``<section id="scale">``: the plot embedded (base64), the table per GPU count, the best batch and ramp, and
    the assumptions. Every value from the file is escaped."""
    def e(v: object) -> str:
        return html.escape(str(v), quote=True)

    b64 = base64.b64encode(Path(plot_path).read_bytes()).decode("ascii")
    cap = f"Time against GPU-hours to loss {doc['target_loss']:g} per GPU count, Pareto front joined"
    head = ("GPUs", "batch (tokens)", "geometry", "steps", "tokens", "step: compute / comm / bubble / overhead", "MFU",
            "time", "GPU-hours", "stat. eff.", "")
    body = []
    best = doc.get("best")
    for r in doc["rows"]:
        g = r["geometry"] if isinstance(r["geometry"], dict) else {}
        geo = f"{g.get('micro_batch')}×{g.get('grad_accum_steps')}×DP{g.get('dp')} TP{g.get('tp')} PP{g.get('pp')}"
        marks = [m for m, on in (("best", best is not None and best.get("gpus") == r["gpus"]), ("pareto", r["pareto"]),
                                 ("over limits", not r["meets_limits"])) if on]
        split = " / ".join(_s(float(x)) for x in (r["compute_s"], r["comm_exposed_s"], r["bubble_s"],
                                                   g.get("overhead_s", 0.0)))
        cells = (f"{r['gpus']:,}", f"{r['global_batch_tokens']:,.0f}", geo, f"{r['steps']:,.0f}", f"{r['tokens']:,.4g}",
                 split, f"{r['mfu']:.0%}", _s(float(r["time_s"])), f"{r['gpu_hours']:,.4g}",
                 f"{r['statistical_efficiency']:.0%}", ", ".join(marks))
        body.append("<tr>" + "".join(f"<td>{e(c)}</td>" for c in cells) + "</tr>")
    table = ("<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr>" + "".join(body) + "</table>")
    lines = []
    if best is not None:
        lines.append(f"<p class='rec'>Best ({e(doc['objective'])}): {best['gpus']:,} GPUs, batch "
                     f"{best['global_batch']:,} sequences ({best['global_batch_tokens']:,.0f} tokens), "
                     f"{best['steps']:,.0f} steps, {e(_s(float(best['time_s'])))}, {best['gpu_hours']:,.4g} GPU-hours.</p>")
    else:
        lines.append("<p class='warn'>No GPU count meets the deadline / GPU-hour budget.</p>")
    ramp = doc.get("best_ramp")
    if isinstance(ramp, dict):
        ratio = float(ramp.get("time_ratio_vs_constant") or 0.0)
        lines.append(f"<p>Best ramp at {e(ramp.get('gpus'))} GPUs: batch schedule <code>{e(ramp.get('schedule'))}</code> "
                     f"({e(ramp.get('lr_text'))}), {ratio:.3f}× the best constant batch's time "
                     "(above 1 the constant batch is the answer).</p>")
    conv, clus, model = doc["convergence"], doc["cluster"], doc["model"]
    assumptions = [
        "Every time and GPU-hour here is a prediction of the step-time and convergence models "
        "(docs/scale.md), not a measurement.",
        f"Convergence: {conv.get('kind')} — {conv.get('source')}; conditions: {conv.get('conditions')}"
        + (f"; fitted losses {conv['loss_range'][0]:.4g}–{conv['loss_range'][1]:.4g}" if conv.get("loss_range") else "")
        + ("; the target is EXTRAPOLATED outside them" if doc.get("extrapolated") else ""),
        f"Cluster {clus.get('name')} ({clus.get('gpus_per_node')} GPUs per node): {clus.get('source')}",
        f"MFU curve: {doc['throughput_source']}",
        f"Model: {model.get('params', 0):,.0f} parameters, sequence {model.get('seq_len')}, "
        f"{model.get('flops_per_token', 0):,.4g} FLOPs per token, sharding {model.get('sharding')}",
        "B_crit depends on the loss only (Kaplan et al. 2020 §5.1, the transfer assumption); the LR follows the batch "
        "by the stated rule at each ramp change.",
    ] + [f"note: {n}" for n in (doc.get("notes") or [])]
    return (f"<section id='scale'><h2>Scaling: time against GPU-hours to loss {e(doc['target_loss'])} "
            f"({e(clus.get('name'))})</h2>"
            f"<figure><img alt='{e(cap)}' src='data:image/png;base64,{b64}'><figcaption>{e(cap)}</figcaption></figure>"
            + "".join(lines) + table + "<h3>Assumptions</h3><ul>" + "".join(f"<li>{e(a)}</li>" for a in assumptions)
            + "</ul></section>\n")
