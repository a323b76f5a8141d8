"""A sweep read back from its directory (:class:`SweepData`), its loss curves and the critical-batch analysis."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from globalbatch._util import SettingError, read_json_checked
from globalbatch.critical.errors import NoAnswerError, TargetNotReachedError
from globalbatch.critical.settings import FIRST_SEED_NAMES, AnalysisSettings, settings_from
from globalbatch.lab.records import TIMING as TIMING_FIELDS, TrialSummary, damaged, read_record, read_records, read_summary
from globalbatch.lab.sweep.config import SweepConfig, TrialSpec
from globalbatch.lab.sweep.timing import timing_path

__all__ = ["SweepData", "load_sweep", "curves_from_sweep", "analyze_sweep", "analyze_sweep_seeds"]


# ---------------------------------------------------------------------------
# Reading a sweep back
# ---------------------------------------------------------------------------


@dataclass(kw_only=True)
class SweepData:
    """A finished (or partly finished) sweep read from disk."""

    out_dir: str
    config: SweepConfig
    unit: str
    trials: dict[str, list[dict]]
    """Trial name → its step/eval records (finished trials only)."""
    summaries: dict[str, TrialSummary]
    """Trial name → its validated ``summary.json`` (finished trials only)."""
    missing: list[str]
    """Trials of the grid without a finished result."""
    timing: dict[int, dict] = field(default_factory=dict)
    """Batch (samples) → the sequential timing pass's record (``timing/b<batch>.json``), when run."""

    def units_per_s(self, batch: int) -> Optional[float]:
        """Throughput at ``batch`` for the analysis: the timing pass's, else the median in-trial one."""
        t = self.timing.get(int(batch))
        if t is not None and t.get("units_per_s") and math.isfinite(t["units_per_s"]) and t["units_per_s"] > 0:
            return float(t["units_per_s"])
        return self.in_trial_units_per_s(batch)

    def mfu_at(self, units: float) -> Optional[float]:
        """The timing pass's MFU of the batch whose mean units per step is ``units`` (None when not recorded)."""
        b = self._batch_of(units)
        t = self.timing.get(int(b)) if b is not None else None
        value = t.get("mfu") if t is not None else None
        return float(value) if value is not None and math.isfinite(value) else None

    def in_trial_units_per_s(self, batch: int) -> Optional[float]:
        """Median over the batch's trials of their in-trial units/s (measured while trials shared the cores)."""
        import statistics

        rates = [r for s in self.summaries.values() if s.batch == int(batch) and (r := s.rate()) is not None]
        return float(statistics.median(rates)) if rates else None

    def _batch_of(self, units: float) -> Optional[int]:
        pairs = list(self.batch_units().items())
        return min(pairs, key=lambda kv: abs(kv[1] - units))[0] if pairs else None

    def throughput_source(self, units: float) -> str:
        """Where the analysis' throughput of the batch with ``units`` per step comes from."""
        b = self._batch_of(units)
        t = self.timing.get(int(b)) if b is not None else None
        if t is not None and t.get("units_per_s") and math.isfinite(t["units_per_s"]) and t["units_per_s"] > 0:
            return "timed pass"
        return "in-trial, median over its LRs"

    def throughput_warnings(self, max_ratio: float = 1.5) -> list[str]:
        """One line per batch whose in-trial units/s differs by more than ``max_ratio``× across its LRs.

        Throughput does not depend on the LR, so such a spread is machine load (trials
        competing for the cores, or something else running): the in-trial numbers are
        unreliable, and the timing pass — when recorded — is what the analysis uses.
        """
        out = []
        for b in sorted(self.batch_units()):
            rates = {s.lr: r for s in self.summaries.values() if s.batch == b and (r := s.rate()) is not None}
            if len(rates) < 2:
                continue
            lo, hi = min(rates.values()), max(rates.values())
            if hi > max_ratio * lo:
                spread = ", ".join(f"lr {lr:g}: {r:,.0f}" for lr, r in sorted(rates.items()))
                used = "the timed pass is used" if b in self.timing else "time to target uses their median"
                out.append(f"batch {b}: in-trial {self.unit}s/s vary {hi / lo:.1f}× across its LRs ({spread}) — "
                           f"machine load, not the LR; {used}")
        for b, t in sorted(self.timing.items()):  # the timed pass itself, step by step
            steps = [r for r in t.get("step_units_per_s") or []
                     if isinstance(r, (int, float)) and math.isfinite(r) and r > 0]
            if len(steps) >= 2 and max(steps) > 5 * min(steps):  # the demo's idle passes: 1.1–3.4×
                out.append(f"batch {b}: the timing pass's steps vary {max(steps) / min(steps):.1f}× ({min(steps):,.0f}–"
                           f"{max(steps):,.0f} {self.unit}s/s over {len(steps)} steps) — machine load or a slow start; "
                           f"its {float(t.get('units_per_s') or math.nan):,.0f} {self.unit}s/s, which the time to target "
                           "uses, is uncertain (on an idle machine, delete timing/ and rerun the same sweep command: "
                           "finished trials are kept, the pass reruns)")
        return out

    def batch_units(self) -> dict[int, float]:
        """Mean loss-bearing units per step at each batch (samples), over its trials."""
        out: dict[int, list[float]] = {}
        for s in self.summaries.values():
            out.setdefault(s.batch, []).append(float(s.mean_batch_units))
        return {b: sum(v) / len(v) for b, v in sorted(out.items())}

    def label(self, units: float) -> str:
        """``"batch 64 (≈2,030 tokens)"`` for a token task, ``"batch 64"`` for a sample task."""
        pairs = list(self.batch_units().items())
        b = min(pairs, key=lambda kv: abs(kv[1] - units))[0] if pairs else None
        if b is None:
            return f"batch {units:,.0f}"
        return f"batch {b} (≈{units:,.0f} tokens)" if self.unit == "token" else f"batch {b}"


def load_sweep(out_dir: str | os.PathLike) -> SweepData:
    """Read ``manifest.json`` and every finished trial; unfinished ones are listed in ``missing``."""
    out = Path(out_dir)
    manifest = out / "manifest.json"
    allowed = "a sweep directory (written by globalbatch sweep)"
    if not manifest.is_file():
        raise SettingError("run_dir", str(out), allowed, why="no manifest.json")
    doc = read_json_checked(manifest)
    if isinstance(doc, dict) and "grid" not in doc and "branch" in doc:
        raise SettingError("run_dir", str(out), allowed, why="it is a branch test, not a sweep")
    if not isinstance(doc, dict) or not isinstance(doc.get("grid"), dict):
        raise SettingError("run_dir", str(out), allowed, why=f"{manifest} has no sweep grid")
    try:
        config = SweepConfig.from_dict(doc["grid"])
    except (TypeError, ValueError) as exc:
        raise SettingError("run_dir", str(out), allowed, why=f"{manifest} holds an invalid grid: {exc}") from None
    trials: dict[str, list[dict]] = {}
    summaries: dict[str, TrialSummary] = {}
    batches, seeds = set(config.all_batches()), set(config.seed_list())
    for path in sorted((out / "trials").glob("*/summary.json")):  # base cells, LR- and batch-edge extensions
        s = read_summary(TrialSummary, path, run_dir=out)  # written last and atomically: any flaw is damage
        spec = TrialSpec(batch=s.batch, lr=s.lr, seed=s.seed)
        if s.batch not in batches or s.seed not in seeds:
            continue  # a cell of this directory outside the grid read back: not part of this analysis
        if spec.name != path.parent.name or s.trial != spec.name or not s.completed:
            raise damaged(out, str(path), f"it names trial {s.trial!r} (batch {s.batch}, lr {s.lr:g}, seed {s.seed}, "
                                          f"completed {str(s.completed).lower()}), not its directory's finished trial")
        if not (path.parent / "metrics.jsonl").is_file():
            raise damaged(out, str(path.parent), "a summary.json without its metrics.jsonl")
        summaries[spec.name] = s
    summaries = dict(sorted(summaries.items(), key=lambda kv: (kv[1].seed, kv[1].batch, kv[1].lr)))
    for name in summaries:
        trials[name] = read_records(out / "trials" / name / "metrics.jsonl", run_dir=out)
    missing = [t.name for t in config.trials() if t.name not in summaries]
    timing = {}
    for b in config.all_batches():
        path = timing_path(out, b)
        if path.is_file():
            timing[b] = read_record(path, *TIMING_FIELDS, run_dir=out)
    units = sorted({s.unit for s in summaries.values()})
    if len(units) > 1:
        raise SettingError("run_dir", str(out), allowed, why=f"its trials' summary.json files name different units ({', '.join(units)})")
    return SweepData(out_dir=str(out), config=config, unit=units[0] if units else "unit", trials=trials, summaries=summaries,
                     missing=missing, timing=timing)


def curves_from_sweep(data: SweepData):
    """One :class:`globalbatch.critical.Curve` per finished trial; batch in units per step.

    Each curve carries the training loss of every step and the held-out evaluations
    (``eval_examples``, ``eval_steps``, ``eval_loss``: the loss after that many updates), its
    seed and the units of LR warmup.
    """
    import numpy as np

    from globalbatch.critical import Curve

    units = data.batch_units()
    warm = data.config.warmup_units()
    curves = []
    for name, recs in data.trials.items():
        s = data.summaries[name]
        steps = [r for r in recs if r.get("kind") == "step" and not r.get("skipped")]
        if not steps:
            continue
        evals = [r for r in recs if r.get("val_loss") is not None and r.get("kind") in ("step", "eval")]
        tput = data.units_per_s(s.batch)  # the sequential timing pass when recorded
        head = next((r for r in recs if r.get("kind") == "header"), {})
        curves.append(
            Curve(
                batch_size=units[s.batch],
                lr=float(s.lr),
                examples=np.array([r["consumed"] for r in steps], dtype=float),
                loss=np.array([r["loss"] for r in steps], dtype=float),
                examples_per_s=tput if tput and math.isfinite(tput) and tput > 0 else None,
                label=name,
                seed=s.seed,
                eval_examples=np.array([r["consumed"] for r in evals], dtype=float),
                eval_steps=np.array([r["step"] for r in evals], dtype=float),
                eval_loss=np.array([r["val_loss"] if r["val_loss"] is not None else math.nan for r in evals], dtype=float),
                warmup_examples=float(head.get("warmup_units", warm)),
                b_simple=[(float(r["consumed"]), float(r["b_simple"])) for r in evals
                          if r.get("b_simple") is not None and not r.get("b_simple_flags")
                          and math.isfinite(r["b_simple"]) and r["b_simple"] > 0],
            )
        )
    return curves


def _finished_curves(data: SweepData, seed: Optional[int] = None) -> list:
    """The sweep's curves (of ``seed`` only, when given); a sweep without a finished trial is a SettingError."""
    curves = [c for c in curves_from_sweep(data) if seed is None or c.seed == seed]
    if not curves:
        raise SettingError("run_dir", data.out_dir, "a sweep with at least one finished trial",
                           why=f"no finished trial yet, {len(data.missing)} pending")
    return curves


def analyze_sweep(out_dir: str | os.PathLike, *, settings: Optional[AnalysisSettings] = None, **old: Any):
    """Load a sweep and run :func:`globalbatch.critical.analyze` on its first seed; returns ``(data, analysis)``.

    ``settings``: a :class:`globalbatch.critical.AnalysisSettings` (its ``first_seed_*``, smoothing, objective and
    tolerance fields); ``old``: the keywords before ``settings`` (deprecated, ``n_targets`` is
    ``first_seed_n_targets``)."""
    from globalbatch.critical import analyze

    s = settings_from(settings, old, caller="analyze_sweep", renames=FIRST_SEED_NAMES)
    data = load_sweep(out_dir)
    curves = _finished_curves(data, seed=data.config.seed_list()[0])  # one seed: see analyze_sweep_seeds for all
    analysis = analyze(curves, settings=s, unit=data.unit, label=data.label,
                       throughput_source=data.throughput_source, warnings=data.throughput_warnings())
    return data, analysis


def analyze_sweep_seeds(out_dir: str | os.PathLike, *, settings: Optional[AnalysisSettings] = None, **old: Any):
    """Load a sweep and run :func:`globalbatch.critical.seeds.analyze_seeds` over all its seeds.

    ``readout="train"`` reads the training loss instead of the held-out evaluations, with an
    EMA window of at least ``min_window_fraction`` × the budget in units for every batch.
    ``settings``: a :class:`globalbatch.critical.AnalysisSettings`; ``old``: the keywords before ``settings``
    (deprecated). Returns ``(data, seed_analysis)``.
    """
    from globalbatch.critical.seeds import analyze_seeds

    s = settings_from(settings, old, caller="analyze_sweep_seeds")
    data = load_sweep(out_dir)
    curves = _finished_curves(data)
    if s.readout == "heldout" and any(c.eval_loss is None or c.eval_loss.size < 4 for c in curves):
        raise SettingError("readout", s.readout, "train (this sweep has too few held-out evaluations)")
    try:
        analysis = analyze_seeds(curves, settings=s, min_window_examples=s.min_window_fraction * data.config.budget,
                                 unit=data.unit, label=data.label, warnings=data.throughput_warnings())
    except TargetNotReachedError:
        raise  # names the targets, not the directory
    except NoAnswerError as exc:
        raise SettingError("run_dir", data.out_dir, "a sweep whose batches share a loss range",
                           why=str(exc)) from None
    return data, analysis


TRAIN_FALLBACK_NOTE = "this sweep has too few held-out evaluations: the analysis over seeds reads the training loss"
"""What a report says when :func:`analyze_sweep_seeds_or_train` fell back to the training read-out."""


def analyze_sweep_seeds_or_train(out_dir: str | os.PathLike, settings: AnalysisSettings):
    """:func:`analyze_sweep_seeds` at ``settings``; a held-out read-out on a sweep with too few held-out
    evaluations (older sweeps, ``--eval-every`` runs) falls back to the training loss. Returns ``(data,
    seed_analysis, note)``, ``note`` :data:`TRAIN_FALLBACK_NOTE` after a fallback, else None; raises what
    :func:`analyze_sweep_seeds` raises otherwise."""
    from dataclasses import replace

    try:
        data, sa = analyze_sweep_seeds(out_dir, settings=settings)
        return data, sa, None
    except SettingError as exc:
        if exc.field != "readout" or settings.readout != "heldout":
            raise
    data, sa = analyze_sweep_seeds(out_dir, settings=replace(settings, readout="train"))
    return data, sa, TRAIN_FALLBACK_NOTE

