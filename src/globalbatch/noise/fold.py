"""A measured window's statistics as one float64 vector, queued, and the fold of queued windows.

The vector (summed over ranks): 0 units, 1 samples, 2 k, 3 replicas (1 per rank), 4 |G_big|² × replicas,
5 its Adam variant × replicas, then per configured variant ``[Σ b_i|g_i|², Σ s_i|g_i|²]``. On a device or
under DP it is a short tensor chain (one async all-reduce); on CPU with one replica, host arithmetic or,
under the StepDriver, the norms left in their ring row and computed for hundreds of windows at once
(:func:`globalbatch.noise.window.raw_vectors`). The fold turns the vectors into the unbiased pair
(tr(Σ)^, |G|²^) of every estimator (McCandlish et al. 2018, App. A.1; see
:mod:`globalbatch.noise.estimator`) and adds them to the EMA state matrix in one op chain.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from globalbatch.errors import SettingError
from globalbatch.noise.estimator import _B0, NEEDS_TWO_BATCH_SIZES, _as_tensor, ema_fold
from globalbatch.noise.hooks import _MicroHooks
from globalbatch.noise.sources import _FOLD_EVERY_HOST
from globalbatch.noise.window import _host_numbers, _host_weights, _scalars, raw_vectors

_FOLD_EVERY = 32  # measured windows queued (one small vector each) before they are folded in on the device


class _WindowFold(_MicroHooks):
    """A window's vector (:meth:`_measure_window`), the queue, and the fold into the estimators."""

    def _measure_window(self, loss_scale: Any, lr: Any, big_grad_multiplier: Any, *, big_from_driver: bool) -> None:
        """The window's sufficient statistics as one float64 vector (a short op chain), queued."""
        k_local = len(self._counts)
        if k_local * self.dp_world_size < 2:
            if not (self._empty_micros and (k_local + self._empty_micros) * self.dp_world_size >= 2):
                raise SettingError("grad_accum_steps", k_local, f"≥ 2 small batches per window (the noise scale "
                                   f"{NEEDS_TWO_BATCH_SIZES})", why=f"with dp_world_size {self.dp_world_size}")
            if self.dp_world_size == 1:
                self._last_measured = False  # empty micro-batches left fewer than two small batches: not measured
                return
            # Under DP the other ranks' small batches count too (k is summed by the all-reduce): this rank sends
            # its vector, all zeros when its whole window was empty; < 2 over all ranks is skipped at the fold.
        if self._device is None:
            g0 = next((p.grad for p in self._params if p.grad is not None), None)
            g0 = getattr(g0, "_local_tensor", g0)
            self._device = g0.device if g0 is not None else torch.device("cpu")
        dev = self._device
        buf = self._slots.buf
        if self._deferrable and big_from_driver and big_grad_multiplier is None and loss_scale is None \
                and dev.type == "cpu" and buf is not None and buf.device.type == "cpu" and self._host_path \
                and _host_numbers(self._counts) \
                and (self._mults is self._counts or _host_numbers(self._mults)):
            # CPU, one replica, under the StepDriver (|G_big|² from its on_step_end): leave the norms in
            # their ring row and keep the window's lists; the fold computes hundreds of windows' vectors
            # at once (:meth:`_raw_vectors`). Nothing here touches a tensor.
            samples_known = self._samples_known and len(self._samples) == k_local
            raw: Any = (self._slots.advance(), self._per_micro, self._counts, self._mults,
                   self._samples if samples_known else None)
            self._queue(None, None, samples_known, False, lr, True, raw=raw)
            return
        adam = self.config.adam and self._ensure_precond()
        # |G_big|²: under the StepDriver, its pre-clip gradient norm (read in its one host sync) arrives
        # in on_step_end at no cost; otherwise one read of .grad here.
        big_later = big_from_driver and big_grad_multiplier is None
        samples_known = self._samples_known and len(self._samples) == k_local
        local_samples = sum(self._samples) if samples_known else 0.0
        hw = _host_weights(self._counts, self._mults, self._samples if samples_known else None)
        if hw is not None and dev.type == "cpu" and self.dp_world_size == 1 and self._host_path:
            # CPU, one replica: the same vector with host arithmetic (reading a CPU tensor is no device
            # sync) — a few tensor calls instead of a chain of ~20 tiny ones, which cost more than the
            # arithmetic on small models.
            vec: Any = self._host_vector(hw, local_samples, k_local, big_later, adam, loss_scale, big_grad_multiplier)
            self._queue(None, vec, samples_known, adam, lr, big_later)
            return
        active = [i for i, p in enumerate(self._params) if p.grad is not None]
        grads: list[Any] = [self._params[i].grad for i in active]  # not None: active
        if self._fsdp is not None:  # sharded: local shard norms, × replicas so that Σ over ranks / R = |G|²
            local = [getattr(g, "_local_tensor", g) for g in grads]
            big = [torch.zeros((), dtype=torch.float64, device=dev) if big_later else
                   torch.linalg.vector_norm(torch.stack(torch._foreach_norm(local)), dtype=torch.float64)
                   * math.sqrt(self.dp_world_size)]
        else:
            big = [torch.zeros((), dtype=torch.float64, device=dev) if big_later else
                   torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)), dtype=torch.float64)]
        if self.config.adam:
            big.append(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(torch._foreach_mul(
                grads, [self._precond[i] for i in active]))), dtype=torch.float64) if adam else big[0])
        if hw is not None:  # counts on the host (numbers or CPU tensors): the weights in Python, one tensor
            units_f, w_rows, mult_sum_t_host = hw
            mult_sum_t: Any = mult_sum_t_host
            head = torch.tensor([units_f, local_samples, float(k_local), 1.0], dtype=torch.float64, device=dev)
            w = torch.tensor(w_rows, dtype=torch.float64, device=dev)
        else:  # device tensors: the same on the device, no host sync
            counts = _scalars(self._counts, dev)
            mults = counts if all(m is c for m, c in zip(self._mults, self._counts)) else _scalars(self._mults, dev)
            smp = torch.tensor(self._samples if samples_known else [0.0] * k_local, dtype=torch.float64, device=dev)
            # b_i/m_i² and s_i/m_i² turn |Δ_i|² = m_i²|g_i|² into b_i|g_i|² and s_i|g_i|²; a micro-batch with
            # count 0 (known only on the device here) is no small batch: weight 0, not counted in k
            nonempty = counts > 0
            w = torch.where(nonempty, torch.stack([counts, smp]) / mults.square(), 0.0)
            mult_sum_t = mults.sum()
            head = torch.stack([counts.sum(), (smp * nonempty).sum(), nonempty.sum().to(torch.float64),
                                torch.ones((), dtype=torch.float64, device=dev)])
        # Layout (summed over ranks): 0 units, 1 samples, 2 k, 3 replicas (1 per rank), 4 |G_big|² × replicas,
        # 5 its Adam variant × replicas, then per configured variant: [Σ b_i|g_i|², Σ s_i|g_i|²].
        big_sq = torch.stack(big if self.config.adam else big * 2).square()  # [|G_big|², its Adam variant]
        if big_grad_multiplier is not None:
            big_sq = big_sq / _as_tensor(big_grad_multiplier, dev) ** 2
        parts = [head, big_sq]
        for name in self._variants():
            source, is_adam = name.split("_")[0], name.endswith("_adam")
            if is_adam and not adam:
                parts.append(torch.zeros(2, dtype=torch.float64, device=dev))  # not present this window
            elif source == "micro":
                norms = (self._slots_adam if is_adam else self._slots).written()
                per = self._per_micro
                if not per:                                                 # DP: this rank's window was empty
                    per_micro = torch.zeros(0, dtype=torch.float64, device=dev)
                elif all(n == per[0] for n in per):                         # the usual case: same parameters
                    per_micro = torch.linalg.vector_norm(norms.view(k_local, per[0]), dim=1, dtype=torch.float64)
                else:
                    per_micro = torch.stack([torch.linalg.vector_norm(c, dtype=torch.float64) for c in norms.split(per)])
                parts.append(w @ per_micro.square())
            else:  # a_r = S·M_r·g_r with M_r = Σ m_i (= B_r for sum-loss): b_r|g_r|² = b_r·raw/(S·M_r)²
                hooked = self._hook_rank_adam if is_adam else self._hook_rank
                if not hooked:
                    raise RuntimeError("source 'rank': the DDP comm hook did not run in this window "
                                       "(was the last micro-batch run outside no_sync()?)")
                # A rank whose window had no loss-bearing unit (M_r = 0) is no small batch of this source,
                # and k here is the replicas: the window is left out of the rank source (NaN: skipped, all ranks).
                m_r = _as_tensor(mult_sum_t, dev).reshape(())
                raw = torch.where(m_r != 0, torch.stack(hooked).square().sum() / m_r ** 2, math.nan)
                parts.append(raw * head[0:2])
        vec = torch.cat(parts)
        if loss_scale is not None:  # the small norms carry S²; counts and the (unscaled) big norm do not
            vec = torch.cat([vec[:6], vec[6:] / _as_tensor(loss_scale, dev).reshape(()) ** 2])
        work = None
        if self.dp_world_size > 1:
            import torch.distributed as dist

            work = dist.all_reduce(vec, group=self._group, async_op=True)  # waited on at the fold
        self._queue(work, vec, samples_known, adam, lr, big_later)

    def _host_vector(self, hw: tuple[float, list[list[float]], float], local_samples: float, k_local: int,
                     big_later: bool, adam: bool, loss_scale: Any, big_grad_multiplier: Any) -> list[float]:
        """:meth:`_measure_window`'s vector from host arithmetic (CPU, one replica), as a list; equal to
        the tensor path's to rounding (``tests/test_noise.py::test_host_path_equals_tensor_path``).
        Measured in place after a backward, every torch call here costs 5–15 µs (cold caches), so
        the norms are read with one ``tolist()`` and the rest is Python."""
        units_f, (w_units, w_samples), _ = hw
        if big_later:
            big = [0.0, 0.0]
        else:
            active = [i for i, p in enumerate(self._params) if p.grad is not None]
            grads: list[Any] = [self._params[i].grad for i in active]  # not None: active
            b = float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)), dtype=torch.float64))
            b_adam = b
            if self.config.adam and adam:
                b_adam = float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(torch._foreach_mul(
                    grads, [self._precond[i] for i in active]))), dtype=torch.float64))
            big = [b * b, b_adam * b_adam]
        if big_grad_multiplier is not None:
            m2 = float(big_grad_multiplier) ** 2
            big = [x / m2 for x in big]
        vec = [units_f, local_samples, float(k_local), 1.0, *big]
        inv_s2 = 1.0 / float(loss_scale) ** 2 if loss_scale is not None else 1.0
        per = self._per_micro
        for name in self._variants():  # one replica: "micro" and "micro_adam" only
            if name.endswith("_adam") and not adam:
                vec += [0.0, 0.0]
                continue
            slots = self._slots_adam if name.endswith("_adam") else self._slots
            vals = slots.buf.tolist() if slots.buf is not None else []  # one call: the whole small buffer
            sq, pos = [], 0
            for n in per:
                sq.append(sum(x * x for x in vals[pos:pos + n]))
                pos += n
            vec += [sum(w * x for w, x in zip(w_units, sq)) * inv_s2, sum(w * x for w, x in zip(w_samples, sq)) * inv_s2]
        return vec

    def _queue(self, work: Any, vec: torch.Tensor | list[float] | None, samples_known: bool, adam: bool, lr: Any,
               big_later: bool, raw: tuple[Any, ...] | None = None) -> None:
        entry = {"work": work, "vec": vec, "raw": raw, "samples_known": samples_known, "adam": adam, "lr": lr,
                 "windows": float(self._elapsed), "dropped": False}
        if big_later:
            entry["big_sq"] = None  # filled by on_step_end; a window the driver never finished stays out
        self._pending.append(entry)
        limit = _FOLD_EVERY if isinstance(vec, torch.Tensor) else \
            _FOLD_EVERY_HOST if raw is None else min(_FOLD_EVERY_HOST, self._slots.capacity)
        if len(self._pending) > limit:  # the newest may still await on_step_end (a raw entry's ring row stays
            # valid: the ring has a row for each queued window, one awaiting its step and the next)
            self._flush(keep_last=True)

    def _raw_vectors(self, raws: list[tuple[Any, ...]]) -> torch.Tensor:
        """The deferred CPU windows' vectors, from the norms kept in the slots' ring."""
        return raw_vectors(self._slots.ring, raws)  # type: ignore[arg-type]  # a queued window: the ring exists

    def _flush(self, keep_last: bool = False) -> None:
        """Fold every queued window into the estimators at once (one op chain, no host sync). A window
        still waiting for the driver's on_step_end (its |G_big|²) stays queued. Timed: a fold is part
        of the monitor's cost, amortized over the windows it folds."""
        if not self._pending:
            return
        t0 = self._clock()
        n = len(self._pending)
        try:
            self._fold(keep_last)
        finally:
            dt = self._clock() - t0
            self._fold_s += dt
            self._fold_windows += n - len(self._pending)
            if not self._in_window_end:  # a read-out's fold (window_end's own time holds its folds)
                self._own += dt

    def _fold(self, keep_last: bool) -> None:
        if self._pending and self._last_measured and self._pending[-1].get("big_sq", 0.0) is None:
            keep_last = True
        pend = self._pending[:-1] if keep_last else self._pending
        if not pend:
            return
        self._pending = self._pending[-1:] if keep_last else []
        for p in pend:
            if p["work"] is not None:
                p["work"].wait()
        vecs = [p["vec"] for p in pend]
        raw = [p["raw"] for p in pend if p["raw"] is not None]
        if raw:                                                   # deferred CPU windows: computed together
            R = self._raw_vectors(raw)
            if len(raw) == len(pend):
                V = R
            else:
                rows = iter(R)
                V = torch.stack([next(rows) if v is None else torch.as_tensor(v, dtype=torch.float64) for v in vecs])
        elif all(isinstance(v, list) for v in vecs):              # the CPU host path: one tensor for all
            V = torch.tensor(vecs, dtype=torch.float64)
        else:
            V = torch.stack([v if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=torch.float64) for v in vecs])
        dev = V.device
        if any("big_sq" in p for p in pend):  # |G_big|² from the driver's host-side norm (× replicas, as summed)
            for p in pend:
                if p.get("big_sq", 0.0) is None:
                    p["dropped"] = True  # the driver refused the window before its step: never applied
            host = torch.tensor([[p.get("big_sq") or 0.0, float("big_sq" in p)] for p in pend], dtype=torch.float64,
                                device=dev)
            from_driver = (host[:, 1:2] * V[:, 3:4]) * host[:, 0:1]
            V[:, 4:6] = torch.where(host[:, 1:2] > 0, from_driver, V[:, 4:6])  # (no Adam variant on this path)
        names, idx, need_smp, need_adam = self._layout(dev)
        if self._unit is None and self._unit_checks < 4:
            known = [p["samples_known"] for p in pend]
            if any(known):
                gap = (V[known, 0] - V[known, 1]).abs().sum()
                self._unit_gap = gap if self._unit_gap is None else self._unit_gap + gap
                self._unit_checks += 1
        present = torch.tensor([[(p["samples_known"] or not s) and (p["adam"] or not a)
                                 for s, a in zip(need_smp, need_adam)] for p in pend], device=dev)
        vals = V[:, idx]                                           # (m, 4, n): Σ-terms, k or replicas, B, R·|G_big|²
        if any(p["dropped"] for p in pend):                       # the driver skipped these steps: not measured
            bad = torch.tensor([math.nan if p["dropped"] else 1.0 for p in pend], dtype=torch.float64, device=dev)
            vals = vals * bad[:, None, None]
        weighted, n_small, units, big_sq = vals.unbind(1)
        big_sq = big_sq / V[:, 3:4]
        # fewer than two small batches over all ranks (count-0 micro-batches left out under DP): skipped
        tr = torch.where(n_small >= 2, (weighted - units * big_sq) / (n_small - 1), math.nan)
        tg = torch.stack([tr, big_sq - tr / units], 2)
        state = self._rows(names)
        windows = torch.tensor([p["windows"] for p in pend], dtype=torch.float64, device=dev)[:, None]
        ema_fold(state, tg, units, self._decay(state, units, present, windows), present, lr=pend[-1]["lr"])

    def _layout(self, device: torch.device) -> tuple[list[str], torch.Tensor, list[bool], list[bool]]:
        """Estimator names and their gather indices into a window vector (fixed per monitor)."""
        hit = getattr(self, "_layout_cache", None)
        if hit is None or hit[1].device != device:
            units = (("sample", 0),) if self._unit == "sample" else (("token", 0), ("sample", 1))
            pairs = [(j, v, u, c) for j, v in enumerate(self._variants()) for u, c in units]
            idx = torch.tensor([[6 + 2 * j + c for j, v, u, c in pairs],                   # Σ b_i|g_i|² (or s_i)
                                [2 if v.startswith("micro") else 3 for j, v, u, c in pairs],  # k, or replicas
                                [c for j, v, u, c in pairs],                                 # B in the unit
                                [5 if v.endswith("_adam") else 4 for j, v, u, c in pairs]],  # R·|G_big|²
                               device=device)
            hit = self._layout_cache = ([f"{v}/{u}" for j, v, u, c in pairs], idx,
                                        [c == 1 for j, v, u, c in pairs], [v.endswith("_adam") for j, v, u, c in pairs])
        return hit

    def _decay(self, state: torch.Tensor, units: torch.Tensor, present: torch.Tensor,
               windows: torch.Tensor) -> torch.Tensor:
        """(m, n) EMA decays 0.5^(windows·B/half_life), on the device."""
        c = self.config
        if c.half_life is not None and math.isinf(c.half_life):
            return torch.ones_like(units)
        if c.half_life is None:  # half_life_windows × the first window's B of each estimator (kept in state)
            first = units.gather(0, present.to(torch.int8).argmax(0)[None])[0]
            b0 = torch.where((state[:, _B0] > 0) | ~present.any(0), state[:, _B0], first)
            state[:, _B0] = b0
            half = b0 * c.half_life_windows
        else:
            half = torch.full_like(units[0], c.half_life)
        return torch.exp2(-units * windows / half)
