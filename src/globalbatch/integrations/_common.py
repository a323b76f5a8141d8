"""What the framework integrations share: the plan line and check, and the per-window throughput meter."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

from globalbatch.errors import SettingError
from globalbatch.plan import solve_geometry

__all__ = ["derive_grad_accum_steps", "check_plan", "plan_line", "WindowMeter", "noise_metrics", "CallbackSettings"]


class CallbackSettings:
    """The settings every framework's ``GlobalBatchCallback`` takes, checked, and its per-run state."""

    def __init__(self, *, global_batch: Optional[int] = None, noise: bool = True, noise_config: Any = None) -> None:
        from globalbatch.validate import whole

        self.global_batch = None if global_batch is None else whole(global_batch, "global_batch")
        self.noise = bool(noise)
        self.noise_config = noise_config
        self.meter = WindowMeter()
        self.monitor: Any = None
        self.plan: Optional[str] = None


def derive_grad_accum_steps(global_batch: int, micro_batch: int, dp_world_size: int) -> int:
    """Accumulation steps that keep ``global_batch`` on this world size; a SettingError with the numbers if none does."""
    return solve_geometry(global_batch=global_batch, micro_batch=micro_batch, dp_world_size=dp_world_size).grad_accum_steps


def check_plan(*, global_batch: Optional[int], micro_batch: int, grad_accum_steps: int, dp_world_size: int) -> int:
    """The global batch the framework will run; with a pinned ``global_batch`` a mismatch is a SettingError with the numbers."""
    actual = micro_batch * grad_accum_steps * dp_world_size
    if global_batch is not None and actual != global_batch:
        raise SettingError(
            "global_batch", global_batch,
            f"grad_accum_steps = {global_batch} / ({micro_batch} × {dp_world_size}) when it divides "
            "(GlobalBatchTrainer(global_batch=...) re-derives it), else change micro_batch or the world size",
            why=f"this run would train micro_batch {micro_batch} × grad_accum_steps {grad_accum_steps} × "
                f"dp_world_size {dp_world_size} = {actual}")
    return actual


def plan_line(*, micro_batch: int, grad_accum_steps: int, dp_world_size: int, pinned: bool) -> str:
    """One line for the log: the global batch in sequences and how it is made."""
    gb = micro_batch * grad_accum_steps * dp_world_size
    return (f"globalbatch plan: global batch {gb} sequences = micro_batch {micro_batch} × grad_accum_steps "
            f"{grad_accum_steps} × dp_world_size {dp_world_size}" + (" (pinned)" if pinned else "")
            + "; loss normalized by the valid target tokens of the whole global batch")


@dataclass
class WindowMeter:
    """Valid tokens, padded tokens and samples per optimizer step, and their rates between reads."""

    windows: int = 0
    valid_tokens: float = 0.0
    padded_tokens: float = 0.0
    samples: float = 0.0
    last_window_valid_tokens: float = float("nan")
    last_window_samples: float = float("nan")
    _since_valid: float = 0.0
    _since_padded: float = 0.0
    _t_read: Optional[float] = field(default=None)

    def start(self) -> None:
        if self._t_read is None:
            self._t_read = time.perf_counter()

    def record(self, valid_tokens: float, padded_tokens: float, samples: float) -> None:
        """One window, all ranks (host numbers)."""
        self.start()
        self.windows += 1
        self.valid_tokens += valid_tokens
        self.padded_tokens += padded_tokens
        self.samples += samples
        self._since_valid += valid_tokens
        self._since_padded += padded_tokens
        self.last_window_valid_tokens = valid_tokens
        self.last_window_samples = samples

    def first_window_line(self) -> str:
        """After the first window: its size in valid tokens, for the plan printout."""
        share = (f"padding share {1.0 - self.valid_tokens / self.padded_tokens:.1%}" if self.padded_tokens
                 else "padding share unknown: the batch has no input_ids")
        return (f"globalbatch: first global batch {int(self.last_window_samples)} sequences, "
                f"{int(self.last_window_valid_tokens)} valid target tokens ({share})")

    def read(self) -> dict[str, float]:
        """Metrics since the last read: valid tokens per second, padding share; plus totals."""
        now = time.perf_counter()
        dt = now - self._t_read if self._t_read is not None else float("nan")
        out = {
            "globalbatch/valid_tokens_per_s": self._since_valid / dt if dt and dt > 0 else float("nan"),
            "globalbatch/padding_share": (1.0 - self._since_valid / self._since_padded) if self._since_padded else float("nan"),
            "globalbatch/global_batch_valid_tokens": self.last_window_valid_tokens,
            "globalbatch/global_batch_sequences": self.last_window_samples,
            "globalbatch/valid_tokens_total": self.valid_tokens,
        }
        self._since_valid = self._since_padded = 0.0
        self._t_read = now
        return out


def noise_metrics(monitor: Any) -> dict[str, float]:
    """``noise/b_simple_tokens`` and its interval from a NoiseScaleMonitor (one host sync: call at log steps)."""
    if monitor is None:
        return {}
    try:
        est = monitor.estimate()
    except ValueError:  # no window measured yet
        return {}
    d = est.as_dict("noise/")
    out = {k: d[k] for k in ("noise/b_simple_tokens", "noise/b_simple_stderr_tokens", "noise/b_simple_low_tokens",
                             "noise/b_simple_high_tokens", "noise/windows", "noise/ok") if k in d}
    # windows the estimate could not use (fewer than two small batches with targets over all ranks, a
    # non-finite norm, a step the driver skipped): the flag beside B_simple
    out["noise/skipped_windows"] = float(est.skipped_windows)
    return out
