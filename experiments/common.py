"""Shared pieces of the reproductions: data, a small CNN, one training loop on StepDriver, intervals, plots.

Every experiment trains through :class:`globalbatch.step.StepDriver` (the exact global-batch step)
with optimizers from the one registry (:func:`globalbatch.optim.build_optimizer`). Data never
downloads: scikit-learn's 1,797 real 8×8 digits, split once (seed 0) into 1,297 train / 500 held out.

Why not the lab's loop (:class:`globalbatch.lab.loop.Experiment`) here: these experiments need what
it does not offer — a float64 model cut into different micro-batches with the trajectory read
after every step (a), Ghost BN conversions of a CNN that is not a lab task (a–d), and a step-based
torch LR scheduler (d). The tinygpt part of (e) is a lab task and uses ``Experiment``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

REPO = Path(__file__).resolve().parents[1]
IMG = REPO / "docs" / "img"
RESULTS = Path(__file__).resolve().parent / "results"

import torch  # noqa: E402
from torch import nn  # noqa: E402

from globalbatch._util import atomic_write, atomic_write_json  # noqa: E402
from globalbatch.step import StepConfig, StepDriver  # noqa: E402


def parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="a seconds-long smoke run (tests); numbers meaningless")
    p.add_argument("--seeds", type=int, default=3, help="seeds per configuration (>= 3 for the committed numbers)")
    p.add_argument("--out", type=Path, default=None, help="folder for the PNG and JSON (default docs/img, experiments/results)")
    return p


def setup(args: argparse.Namespace) -> tuple[Path, Path]:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    img = args.out if args.out is not None else IMG
    res = args.out if args.out is not None else RESULTS
    img.mkdir(parents=True, exist_ok=True)
    res.mkdir(parents=True, exist_ok=True)
    return img, res


# ------------------------------------------------------------------------------ data


@dataclass
class Data:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def digits(dtype: torch.dtype = torch.float32, n_train: int = 1297) -> Data:
    """scikit-learn's 8×8 digits, pixels / 16, a fixed shuffled split (seed 0)."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=dtype).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    return Data(x[:n_train], y[:n_train], x[n_train:], y[n_train:])


# ----------------------------------------------------------------------------- model


def cnn(norm: str = "bn", *, width: int = 16, seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Conv(1→w) → norm → ReLU → Conv(w→2w, stride 2) → norm → ReLU → Linear(2w·16 → 10).

    ``norm``: ``"bn"`` (BatchNorm2d) or ``"none"``. Convolutions before a norm carry no bias.
    """
    torch.manual_seed(seed)
    bn = norm == "bn"

    def block(cin: int, cout: int, stride: int) -> list[nn.Module]:
        layers: list[nn.Module] = [nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=not bn)]
        if bn:
            layers.append(nn.BatchNorm2d(cout))
        return layers + [nn.ReLU()]

    model = nn.Sequential(*block(1, width, 1), *block(width, 2 * width, 2), nn.Flatten(),
                          nn.Linear(2 * width * 16, 10))
    return model.to(dtype)


# ------------------------------------------------------------------------------ loop


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) in eval mode (BatchNorm on running statistics)."""
    was = model.training
    model.eval()
    logits = model(x)
    loss = nn.functional.cross_entropy(logits, y).item()
    acc = (logits.argmax(1) == y).float().mean().item()
    model.train(was)
    return loss, acc


@dataclass
class Run:
    steps: int = 0
    samples: int = 0
    history: list[dict[str, float]] = field(default_factory=list)
    diverged: bool = False


def train(model: nn.Module, optimizer: torch.optim.Optimizer, data: Data, *, micro_batch: int,
          samples: int, seed: int, global_batch: Optional[int] = None, batch_schedule: Any = None,
          lr_schedule: Any = None, lr_scheduler: Any = None, eval_every: Optional[int] = None,
          on_step: Optional[Callable[[StepDriver], None]] = None, callbacks: tuple = ()) -> Run:
    """Train on ``samples`` training samples (a continuous stream of per-epoch permutations).

    Each optimizer step is one window of ``driver.global_batch`` samples cut into micro-batches of
    ``micro_batch`` (the last may be shorter), summed cross-entropy with the sample count as the
    unit count: the step is on the global mean loss, whatever the cut. ``eval_every``: held-out
    and training loss/accuracy every so many samples (and at the end) into ``Run.history``.
    """
    cfg = StepConfig(micro_batch=micro_batch, global_batch=global_batch, batch_schedule=batch_schedule,
                     lr_schedule=lr_schedule, unit="sample")  # a per-sample loss: schedules count samples
    driver = StepDriver(model, optimizer, cfg, lr_scheduler=lr_scheduler, callbacks=callbacks)
    gen = torch.Generator().manual_seed(1000 + seed)
    n = len(data.x_train)
    stream = torch.empty(0, dtype=torch.long)
    run = Run()
    next_eval = eval_every
    model.train()
    while run.samples < samples:
        batch = min(driver.global_batch, samples - run.samples)
        while len(stream) < batch:
            stream = torch.cat([stream, torch.randperm(n, generator=gen)])
        idx, stream = stream[:batch], stream[batch:]
        chunks = idx.split(micro_batch)
        for i, c in enumerate(chunks):
            with driver.micro_step(last=i == len(chunks) - 1):
                out = model(data.x_train[c])
                driver.backward(nn.functional.cross_entropy(out, data.y_train[c], reduction="sum"), len(c),
                                samples=len(c))
        result = driver.step()
        run.steps += 1
        run.samples += batch
        if on_step is not None:
            on_step(driver)
        if not math.isfinite(result.loss_per_unit) or result.loss_per_unit > 1e3:
            run.diverged = True
            break
        if next_eval is not None and (run.samples >= next_eval or run.samples >= samples):
            run.history.append(_point(model, data, run, result.lr, batch))
            while next_eval <= run.samples:
                next_eval += eval_every
    if not run.history or run.history[-1]["samples"] != run.samples:
        run.history.append(_point(model, data, run, float(optimizer.param_groups[0]["lr"]), driver.global_batch))
    return run


def _point(model, data, run, lr, batch):
    test_loss, test_acc = evaluate(model, data.x_test, data.y_test)
    train_loss, train_acc = evaluate(model, data.x_train, data.y_train)
    return {"samples": run.samples, "steps": run.steps, "epochs": run.samples / len(data.x_train), "lr": lr,
            "global_batch": batch, "test_loss": test_loss, "test_acc": test_acc, "train_loss": train_loss,
            "train_acc": train_acc}


# ------------------------------------------------------------------------ statistics


def mean_ci(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95 % Student-t interval (nan for a single value)."""
    from scipy import stats

    v = [float(x) for x in values]
    m = sum(v) / len(v)
    if len(v) < 2:
        return m, float("nan")
    sd = math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1))
    return m, float(stats.t.ppf(0.975, len(v) - 1) * sd / math.sqrt(len(v)))


def fmt_ci(values: list[float], digits: int = 3) -> str:
    m, h = mean_ci(values)
    return f"{m:.{digits}f} ± {h:.{digits}f}"


# ------------------------------------------------------------------------------ output


def figure(ncols: int = 1, width: float = 4.2, height: float = 3.0):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, list(axes[0])


def save(fig, path: Path) -> None:
    import io

    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    atomic_write(path, lambda f: f.write(buf.getvalue()))
    import matplotlib.pyplot as plt

    plt.close(fig)


def write_json(path: Path, obj: Any) -> None:
    atomic_write_json(path, obj)


def banner(name: str, args: argparse.Namespace, t0: float) -> None:
    print(f"{name}: done in {time.perf_counter() - t0:.0f} s with {torch.get_num_threads()} thread(s)"
          f"{' (tiny mode: numbers meaningless)' if args.tiny else ''}", file=sys.stderr)
