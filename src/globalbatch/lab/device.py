"""Devices and precision for the lab's experiments: ``--device`` and ``--precision``.

``resolve_device`` checks that the device exists *before* anything is written (a
``cuda`` run on a machine without CUDA is one error line, exit 2, not a traceback
after the manifest); ``Precision`` is the forward pass's autocast and, for fp16, the
``GradScaler`` the step driver scales, unscales and steps through.

* ``fp32``: no autocast.
* ``bf16``: ``torch.autocast(device, dtype=torch.bfloat16)``; parameters, gradients and
  optimizer states stay float32 (bf16 has float32's range: no loss scaling). Works on
  CPU too, which is how the tests exercise it.
* ``fp16``: ``torch.autocast(device, dtype=torch.float16)`` with a ``torch.amp.GradScaler``;
  an overflowing window is skipped whole by the driver and the scale backs off.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from globalbatch._util import SettingError

__all__ = ["DEVICE_HELP", "PRECISIONS", "resolve_device", "check_device", "Precision", "device_for_worker", "checked_device"]

PRECISIONS = ("fp32", "bf16", "fp16")
DEVICE_HELP = "cpu, cuda, cuda:N or mps"


def resolve_device(text: Any, *, field: str = "device"):
    """``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"mps"`` → a ``torch.device`` that exists here.

    Raises :class:`SettingError` naming ``field`` when the name is malformed or the device
    is absent (no CUDA, index ≥ the device count, no MPS).
    """
    import torch

    if not isinstance(text, str) or not text.strip():
        raise SettingError(field, text, DEVICE_HELP)
    name = text.strip().lower()
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise SettingError(field, text, DEVICE_HELP) from None
    if dev.type == "cpu":
        if dev.index not in (None, 0):
            raise SettingError(field, text, DEVICE_HELP, why="there is one CPU device")
        return torch.device("cpu")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise SettingError(field, text, "cpu (or a CUDA device on a machine with one)",
                               why="CUDA is not available on this machine")
        n = torch.cuda.device_count()
        if dev.index is not None and dev.index >= n:
            raise SettingError(field, text, f"cuda:0 … cuda:{n - 1}", why=f"this machine has {n} CUDA device(s)")
        return dev
    if dev.type == "mps":
        backend = getattr(torch.backends, "mps", None)
        if backend is None or not backend.is_available():
            raise SettingError(field, text, "cpu", why="MPS is not available on this machine")
        return dev
    raise SettingError(field, text, DEVICE_HELP)


def check_device(text: Any, precision: Any = "fp32", *, field: str = "device", precision_field: str = "precision") -> None:
    """Validate a device name and a precision together (fp16 on MPS is refused: no GradScaler there)."""
    dev = resolve_device(text, field=field)
    Precision.check(precision, field=precision_field)
    if precision == "fp16" and dev.type == "mps":
        raise SettingError(precision_field, precision, "fp32 or bf16 on mps", why="no GradScaler on MPS")


def device_for_worker(device: str, worker_index: int):
    """The device of the ``worker_index``-th worker of a local pool: one CUDA device each, round robin.

    ``"cuda"`` (no index) spreads workers over every visible GPU; an explicit ``cuda:N``,
    ``cpu`` or ``mps`` is used as given.
    """
    import torch

    if device.strip().lower() == "cuda" and torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return torch.device("cuda", worker_index % torch.cuda.device_count())
    return resolve_device(device)


@dataclass(frozen=True)
class Precision:
    """The forward pass's numeric recipe: ``fp32``, ``bf16`` (autocast) or ``fp16`` (autocast + GradScaler)."""

    name: str = "fp32"

    def __post_init__(self) -> None:
        self.check(self.name)

    @staticmethod
    def check(name: Any, *, field: str = "precision") -> None:
        if name not in PRECISIONS:
            raise SettingError(field, name, ", ".join(PRECISIONS))

    def autocast(self, device) -> contextlib.AbstractContextManager:
        """The autocast context for ``device`` (a null context for fp32)."""
        import torch

        if self.name == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.name == "bf16" else torch.float16
        return torch.autocast(device_type=torch.device(device).type, dtype=dtype)

    def grad_scaler(self, device):
        """A ``GradScaler`` for fp16, else None (bf16 and fp32 need no loss scaling)."""
        import torch

        if self.name != "fp16":
            return None
        return torch.amp.GradScaler(torch.device(device).type)


def checked_device(text: Any, field: str = "device", *, precision: Any = None, precision_field: str = "precision",
           default_cuda: bool = False) -> str:
    """A device that exists here (:func:`resolve_device`), with its precision; returns its name.

    ``text=None`` with ``default_cuda`` means cuda when available, else cpu.
    """
    import torch

    if text is None and default_cuda:
        text = "cuda" if torch.cuda.is_available() else "cpu"
    check_device(text, "fp32" if precision is None else precision, field=field, precision_field=precision_field)
    return str(text)
