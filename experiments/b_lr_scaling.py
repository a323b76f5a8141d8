"""(b) Linear LR scaling with warmup (Goyal et al. 2017): held-out loss after a fixed sample budget
vs the global batch, for the LR rules none / sqrt / linear, with and without warmup.

Claim: with the LR scaled linearly in the batch and a warmup, the held-out loss after a fixed
number of epochs stays flat as the batch grows — up to a point where the rule breaks.

Beside it, the gradient noise scale B_simple = tr(Σ)/|G|² (McCandlish et al. 2018; the critical
batch's simple estimate) measured on the same task with globalbatch.noise's NoiseScaleMonitor
(micro-batches of 16 inside windows of 256, sqrt-scaled LR), after the first epoch and at the end.

Setup: the digits CNN with Ghost BN of 16 (BatchNorm statistics over 16 samples at every batch,
as Goyal et al. keep 32 per GPU), SGD-momentum (registry "sgd"), ``--epochs`` epochs at every
batch. Base LR tuned at batch 16 on a 4-point grid (seed 0, held-out loss); at batch B the peak
LR is ``globalbatch.plan.scale_lr(base, 16, B, rule)``. Schedule in samples
(``LRSchedule``): cosine to 0, with a linear warmup over the first 25 % of samples, or none.
≥ 3 seeds per point (seeds 1.., the tuning seed excluded), mean with a 95 % t-interval.

    OMP_NUM_THREADS=1 python experiments/b_lr_scaling.py
"""

from __future__ import annotations

import math
import time

import common
from globalbatch.noise.monitor import NoiseConfig, NoiseScaleMonitor
from globalbatch.nn import convert_to_ghost_bn
from globalbatch.optim import build_optimizer
from globalbatch.plan import scale_lr
from globalbatch.schedule import LRSchedule

BASE_BATCH, GHOST = 16, 16
BASE_GRID = (0.05, 0.1, 0.2, 0.4, 0.8)
BATCHES = (64, 256, 1024)
RULES = ("none", "sqrt", "linear")


def run(lr: float, batch: int, warmup: bool, seed: int, epochs: int, data: common.Data) -> dict:
    total = epochs * len(data.x_train)
    model = convert_to_ghost_bn(common.cnn("bn", seed=seed), GHOST)
    opt = build_optimizer("sgd", model, lr=lr)
    sched = LRSchedule(peak_lr=lr, total=total, warmup=total // 4 if warmup else 0, shape="cosine")
    r = common.train(model, opt, data, micro_batch=batch, global_batch=batch, samples=total, seed=seed,
                     lr_schedule=sched)
    loss = r.history[-1]["test_loss"]
    return {"test_loss": loss if not r.diverged and loss == loss else float("inf"), "steps": r.steps,
            "test_acc": r.history[-1]["test_acc"]}


def noise_scale(lr: float, seed: int, epochs: int, data: common.Data, batch: int = 256) -> dict:
    """B_simple in samples after epoch 1 and at the end (EMA, half-life 20 windows) of a batch-``batch`` run."""
    n = len(data.x_train)
    total = epochs * n
    model = convert_to_ghost_bn(common.cnn("bn", seed=seed), GHOST)
    opt = build_optimizer("sgd", model, lr=lr)
    monitor = NoiseScaleMonitor(model, optimizer=opt, config=NoiseConfig(sources=("micro",)), unit="sample")
    sched = LRSchedule(peak_lr=lr, total=total, warmup=total // 4, shape="cosine")
    marks: dict[str, float] = {}

    def on_step(driver) -> None:
        if "epoch 1" not in marks and driver.trained_samples >= n:
            marks["epoch 1"] = monitor.estimate("micro", "sample").b_simple  # host sync: once

    common.train(model, opt, data, micro_batch=GHOST, global_batch=batch, samples=total, seed=seed,
                 lr_schedule=sched, callbacks=(monitor,), on_step=on_step)
    marks["end"] = monitor.estimate("micro", "sample").b_simple
    return marks


def main() -> None:
    p = common.parser(__doc__)
    p.add_argument("--epochs", type=int, default=9)
    args = p.parse_args()
    img, res = common.setup(args)
    t0 = time.perf_counter()
    data = common.digits()
    epochs, batches, grid = args.epochs, BATCHES, BASE_GRID
    if args.tiny:
        data = common.Data(data.x_train[:128], data.y_train[:128], data.x_test[:64], data.y_test[:64])
        epochs, batches, grid = 1, (64,), BASE_GRID[:2]
    tuning = {lr: run(lr, BASE_BATCH, True, 0, epochs, data)["test_loss"] for lr in grid}
    base_lr = min(tuning, key=tuning.get)
    seeds = range(1, args.seeds + 1)
    base = [run(base_lr, BASE_BATCH, True, s, epochs, data) for s in seeds]
    results = {}
    for rule in RULES:
        for warmup in (True, False):
            key = f"{rule}{' + warmup' if warmup else ''}"
            pts = {BASE_BATCH: base}
            for b in batches:
                lr = scale_lr(base_lr, BASE_BATCH, b, rule)
                pts[b] = [run(lr, b, warmup, s, epochs, data) for s in seeds]
            results[key] = {str(b): {"lr": scale_lr(base_lr, BASE_BATCH, b, rule), "steps": v[0]["steps"],
                                     "test_loss": common.mean_ci([r["test_loss"] for r in v]),
                                     "test_acc": common.mean_ci([r["test_acc"] for r in v])}
                            for b, v in pts.items()}
            row = "  ".join(f"B={b}: {d['test_loss'][0]:.3f}±{d['test_loss'][1]:.3f}" for b, d in results[key].items())
            print(f"{key:18s} {row}")
    print(f"base LR {base_lr:g} at batch {BASE_BATCH} (grid {dict((str(k), round(v, 4)) for k, v in tuning.items())})")
    nb = 64 if args.tiny else 256
    noise = [noise_scale(scale_lr(base_lr, BASE_BATCH, nb, "sqrt"), s, epochs, data, nb) for s in seeds]
    b_simple = {k: common.mean_ci([m[k] for m in noise]) for k in ("epoch 1", "end")}
    print("B_simple (samples): " + ", ".join(f"{k} {v[0]:.0f} ± {v[1]:.0f}" for k, v in b_simple.items()))

    fig, (ax,) = common.figure(width=5.0, height=3.4)
    for i, rule in enumerate(RULES):
        for warmup in (True, False):
            key = f"{rule}{' + warmup' if warmup else ''}"
            bs = [int(b) for b in results[key]]
            m = [min(results[key][str(b)]["test_loss"][0], 10.0) for b in bs]
            h = [results[key][str(b)]["test_loss"][1] for b in bs]
            h = [0.0 if (x != x or x == float("inf")) else x for x in h]
            ax.errorbar(bs, m, yerr=h, color=f"C{i}", linestyle="-" if warmup else "--", marker="o" if warmup else "x",
                        capsize=2, label=key)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    for (k, (m, _)), style in zip(b_simple.items(), (":", "-.")):
        if math.isfinite(m) and m > 0:
            ax.axvline(m, color="gray", linestyle=style, linewidth=1)
            ax.text(m, 0.98, f" B_simple {k}", fontsize=6, va="top", rotation=90, color="gray",
                    transform=ax.get_xaxis_transform())
    ax.set_xlabel("global batch (samples)")
    ax.set_ylabel(f"held-out loss after {epochs} epochs")
    ax.set_title("LR rule × warmup (95 % CI; diverged runs drawn at 10)", fontsize=9)
    ax.legend(fontsize=6, loc="lower right")
    common.save(fig, img / "repro_b_lr_scaling.png")
    common.write_json(res / "b_lr_scaling.json", {"epochs": epochs, "seeds": args.seeds, "base_batch": BASE_BATCH,
                                                  "base_lr": base_lr, "b_simple_samples": b_simple, "tuning": {str(k): v for k, v in tuning.items()},
                                                  "results": results})
    common.banner("b_lr_scaling", args, t0)


if __name__ == "__main__":
    main()
