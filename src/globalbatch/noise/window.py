"""The per-window arithmetic of the monitor's host paths (CPU, one replica).

A window's sufficient statistics, as :meth:`NoiseScaleMonitor._measure_window` lays them out:
0 units, 1 samples, 2 k, 3 replicas, 4 |G_big|² × replicas, 5 its Adam variant, then per
variant [Σ b_i|g_i|², Σ s_i|g_i|²] with |g_i|² = |Δ_i|²/m_i² (Δ_i = m_i·g_i, what micro-batch i
added to ``.grad``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from globalbatch.noise.estimator import _as_tensor


def _scalars(values: list[Any], device: torch.device) -> torch.Tensor:
    """Per-micro scalars (host numbers or 0-d tensors) as one float64 vector on ``device``."""
    if all(isinstance(v, torch.Tensor) for v in values):
        return torch.stack([v.reshape(()) for v in values]).to(device=device, dtype=torch.float64)
    if not any(isinstance(v, torch.Tensor) for v in values):
        return torch.tensor(values, dtype=torch.float64, device=device)
    return torch.stack([_as_tensor(v, device).reshape(()) for v in values]).to(device)


def _host_weights(counts: list[Any], mults: list[Any],
                  samples: list[float] | None) -> tuple[float, list[list[float]], float] | None:
    """Σ b_i, the weights [[b_i/m_i²...], [s_i/m_i²...]] and Σ m_i as host floats, when every count and
    multiplier is a number or a CPU tensor (reading those is no device sync); else None."""
    def host(v: Any) -> float | None:
        if isinstance(v, torch.Tensor):
            return v.item() if v.device.type == "cpu" else None  # a CPU tensor: no device sync
        return float(v)

    cs, ms = [], []
    for c, m in zip(counts, mults):
        cv = host(c)
        mv = cv if m is c else host(m)
        if cv is None or mv is None:
            return None
        cs.append(cv)
        ms.append(mv)
    # b_i = 0: no small batch (weight 0; the monitor leaves such micro-batches out before this); m_i = 0 with
    # b_i > 0 cannot be rescaled: NaN, the window is skipped
    inv = [(1.0 / (m * m) if m else (0.0 if c == 0 else math.nan)) for c, m in zip(cs, ms)]
    smp = samples if samples is not None else [0.0] * len(cs)
    return sum(cs), [[c * i for c, i in zip(cs, inv)], [s * i for s, i in zip(smp, inv)]], float(sum(ms))


def _host_numbers(values: list[Any]) -> bool:
    return all(type(v) is int or type(v) is float for v in values)


def raw_vectors(ring: torch.Tensor, raws: list[tuple[Any, ...]]) -> torch.Tensor:
    """The window vectors (|G_big|² left 0, for the driver's) of deferred CPU windows, each
    (ring row, norms per micro-batch, counts b_i, multipliers m_i, samples s_i or None), with the
    micro source only. Windows of the same shape are computed together: one gather each."""
    out = torch.zeros(len(raws), 8, dtype=torch.float64)
    groups: dict[Any, list[int]] = {}
    for j, (_, per, *_rest) in enumerate(raws):
        k = len(per)
        groups.setdefault((k, per[0]) if per[0] > 0 and per.count(per[0]) == k else j, []).append(j)
    for key, js in groups.items():
        if isinstance(key, tuple):  # k micro-batches of P norms each: one gather for the group
            k, width = key
            rows = torch.tensor([raws[j][0] for j in js])
            sq = ring[rows, :k * width].view(len(js), k, width).double().square_().sum(2)
        else:                       # norms per micro-batch differ (a parameter without gradient)
            row, per = raws[key][0], raws[key][1]
            norms = ring[row, :sum(per)].double()
            sq = torch.stack([c.square().sum() for c in norms.split(per)])[None]
        counts = torch.tensor([raws[j][2] for j in js], dtype=torch.float64)
        mult = torch.tensor([raws[j][3] for j in js], dtype=torch.float64)
        inv = torch.where(mult != 0, mult.square().reciprocal(), 0.0)  # count-0 micro-batches are never queued
        smp = torch.tensor([raws[j][4] if raws[j][4] is not None else [0.0] * len(raws[j][2]) for j in js],
                           dtype=torch.float64)
        sel = torch.tensor(js)
        out[sel, 0] = counts.sum(1)
        out[sel, 1] = smp.sum(1)
        out[sel, 2] = float(counts.shape[1])
        out[sel, 3] = 1.0
        out[sel, 6] = (counts * inv * sq).sum(1)  # Σ b_i|g_i|² (|Δ_i|² = m_i²|g_i|²)
        out[sel, 7] = (smp * inv * sq).sum(1)     # Σ s_i|g_i|²
    return out
