"""Where the monitor's small-batch norms come from: the norm slots the parameter hooks write, the
FSDP2 parameters they hook, and the DDP comm hook that measures each rank's bucket."""

from __future__ import annotations

from typing import Any, Callable

import torch

from globalbatch.errors import Raw, SettingError

_vector_norm = torch._C._linalg.linalg_vector_norm  # type: ignore[attr-defined]  # torch.linalg.vector_norm, called positionally in the hooks
_FOLD_EVERY_HOST = 256  # windows queued on the CPU host path before a fold: a fold costs ≈ 2 ms of small calls


def _fsdp_unsharded_params(module: torch.nn.Module) -> list[torch.Tensor] | None:
    """The unsharded parameters FSDP2 computes gradients for (one per sharded trainable parameter),
    or None before the first forward created them. FSDP2 keeps these objects across iterations
    (it frees and refills their storage), so hooks on them persist. Each is listed once: Accelerate's
    FSDP2 wrapping (GPT-2: the root, its embedding, final LayerNorm and tied LM head) reaches some
    parameters from two modules, and a hook registered twice counted their norms twice (B_simple
    19× off on the HF Trainer test). Private FSDP2 state: checked by the 2-rank tests against DDP on
    the same windows (tests/dist/noise_fsdp2.py, tests/dist/integrations_fsdp.py)."""
    out, seen = [], set()
    for m in module.modules():
        get = getattr(m, "_get_fsdp_state", None)
        if get is None:
            continue
        state = get()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            group = getattr(state, "_fsdp_param_group", None)
            groups = [group] if group is not None else []
        for group in groups:
            for fp in group.fsdp_params:
                if not fp.sharded_param.requires_grad:
                    continue
                if not hasattr(fp, "_unsharded_param"):
                    return None
                if id(fp._unsharded_param) in seen:  # a state reached from two modules, or tied weights: once
                    continue
                seen.add(id(fp._unsharded_param))
                out.append(fp._unsharded_param)
    return out


class _NormSlots:
    """A float32 buffer the parameter hooks write |Δ| into, one 0-d view per slot: no tensor is
    created or freed per norm, and the window reads them all as one slice.

    The CPU host path keeps finished windows in a ring of rows (:meth:`advance`: one row copy), so
    that a fold reads hundreds of windows at once instead of a tensor call per window."""

    ROWS = _FOLD_EVERY_HOST + 3  # the queued windows, one awaiting its step, and room to spare
    RING_ELEMENTS = 1 << 22  # fewer rows when a window has many norms: ≈ 16 MB of float32 at the ring's build

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        self.views: tuple[torch.Tensor, ...] = ()
        self.n = 0      # slots written in this window
        self.mark = 0   # slots closed by micro_backward
        self.ring: torch.Tensor | None = None              # (ROWS, len(buf)): kept windows
        self._ring_rows: tuple[torch.Tensor, ...] = ()
        self._next_row = 0

    def put(self, grad: torch.Tensor) -> None:
        j = self.n
        if (j >= len(self.views) or self.buf.device != grad.device  # type: ignore[union-attr]  # views: buf is set
                or (grad.dtype == torch.float64 and self.buf.dtype != torch.float64)):  # type: ignore[union-attr]
            self._grow(grad.device, j, float64=grad.dtype == torch.float64)
        v = self.views[j]
        if grad.dtype == v.dtype:
            torch.linalg.vector_norm(grad, out=v)
        elif grad.dtype in (torch.float16, torch.bfloat16):
            v.copy_(torch.linalg.vector_norm(grad, dtype=torch.float32))  # accumulate half precision in float32
        else:
            v.copy_(torch.linalg.vector_norm(grad))
        self.n = j + 1

    def _grow(self, device: torch.device, need: int, *, float64: bool) -> None:
        """A bigger buffer (float64 once any float64 gradient was seen, else float32), contents kept."""
        old = self.buf
        dtype = torch.float64 if float64 or (old is not None and old.dtype == torch.float64) else torch.float32
        size = max(64, 2 * (need + 1), len(old) if old is not None else 0)  # never smaller: queued ring rows fit
        self.buf = torch.zeros(size, dtype=dtype, device=device)
        if old is not None and old.device == device:
            self.buf[:self.n].copy_(old[:self.n])
        self.views = self.buf.unbind(0)

    def advance(self) -> int:
        """Keep this window's norms in a row of the ring (returned); the next window starts empty."""
        ring, buf = self.ring, self.buf
        if buf is None:
            buf = torch.zeros(64)
        if ring is None or ring.shape[1] != len(buf) or ring.dtype != buf.dtype or ring.device != buf.device:
            # the rows are fixed at the first build (queued windows keep their row numbers)
            rows = ring.shape[0] if ring is not None else max(8, min(self.ROWS, self.RING_ELEMENTS // len(buf)))
            new = torch.zeros(rows, len(buf), dtype=buf.dtype, device=buf.device)
            if ring is not None:  # the buffer grew (it never shrinks) or turned float64: queued rows keep their norms
                new[:, :ring.shape[1]].copy_(ring.to(device=buf.device, dtype=buf.dtype))
            self.ring, self._ring_rows = new, new.unbind(0)
        row = self._next_row
        self._ring_rows[row].copy_(buf)
        self._next_row = row + 1 if row + 1 < len(self._ring_rows) else 0
        self.n = self.mark = 0
        return row

    @property
    def capacity(self) -> int:
        """Windows that may wait in the ring: its rows less one awaiting its step and the next."""
        return (len(self._ring_rows) if self.ring is not None else self.ROWS) - 3

    def close_micro(self) -> int:
        """Norms written since the last call."""
        n, self.mark = self.n - self.mark, self.n
        return n

    def drop(self) -> None:
        """Forget what was written since the last close (a backward that is not measured)."""
        self.n = self.mark

    def reset(self) -> None:
        self.n = self.mark = 0

    def written(self) -> torch.Tensor:
        return self.buf[:self.n] if self.buf is not None else torch.zeros(0)


class _CommHookDispatch:
    """The one comm hook of a DDP model: every attached monitor measures the bucket, then the user's
    hook (or DDP's default all-reduce) reduces it. Lives on the DDP module, so any number of monitors
    share it."""

    def __init__(self, user_hook: Callable[..., Any] | None, user_state: Any) -> None:
        self.user_hook, self.user_state = user_hook, user_state
        self.monitors: list[Any] = []  # NoiseScaleMonitor

    @staticmethod
    def attach(ddp: Any, group: Any, monitor: Any, user_hook: Any, user_state: Any) -> None:
        disp = getattr(ddp, "_globalbatch_noise_hook", None)
        if disp is None:
            if getattr(ddp, "_comm_hooks", None):
                raise SettingError("model", Raw("a DDP model with a comm hook"), "yours passed to the monitor "
                                   "(NoiseScaleMonitor(..., comm_hook=hook, comm_state=state)) instead of registered, "
                                   "or sources=('micro',) (no comm hook needed)", why="DDP allows one comm hook")
            disp = _CommHookDispatch(user_hook, user_state)
            ddp.register_comm_hook(group, disp.hook_for(group))
            ddp._globalbatch_noise_hook = disp
        elif user_hook is not None and user_hook is not disp.user_hook:
            raise SettingError("comm_hook", Raw(getattr(user_hook, "__name__", type(user_hook).__name__)),
                               "None (the monitors share it)",
                               why="this DDP model's comm hook is already set through another monitor")
        disp.monitors.append(monitor)

    def hook_for(self, group: Any) -> Callable[..., Any]:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        def hook(state, bucket):  # no annotations: DDP checks them (and ours are postponed strings)
            for m in self.monitors:
                m._hook_bucket(bucket)
            if self.user_hook is not None:
                return self.user_hook(self.user_state, bucket)
            return default_hooks.allreduce_hook(state, bucket)

        return hook
