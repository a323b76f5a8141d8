"""(c) The generalization gap of large batches at equal epochs, and what closes it.

Claims (Keskar et al. 2017; Hoffer et al. 2017; Goyal et al. 2017): at the same number of
epochs a large batch reaches a worse held-out loss/accuracy than a small one; scaling the LR
with warmup, Ghost BatchNorm and training longer (more steps) close most of that gap.

Setup: the digits CNN with BatchNorm, SGD-momentum (registry "sgd"), cosine LR schedule in
samples (LRSchedule). Small batch 32 with its LR tuned on a 3-point grid (seed 0, held-out
loss); large batch ``--large`` (one micro-batch) at the same ``--epochs``:

1. large, the small batch's LR (no rule, no warmup)
2. + linear LR scaling and a linear warmup over the first 25 % of samples (``plan.scale_lr``)
3. + Ghost BN of 32 (BatchNorm statistics over 32 samples, as at the small batch)
4. + training 4× longer (4× the epochs and steps; Hoffer et al.'s "regime adaptation", partly)

Reported: held-out loss and accuracy and the training loss at the end, seeds 1..``--seeds``
(the tuning seed excluded), mean with a 95 % t-interval; the gap is large − small.

    OMP_NUM_THREADS=1 python experiments/c_generalization_gap.py
"""

from __future__ import annotations

import time

import common
from globalbatch.nn import convert_to_ghost_bn
from globalbatch.optim import build_optimizer
from globalbatch.plan import scale_lr
from globalbatch.schedule import LRSchedule

SMALL, GHOST = 32, 32
GRID = (0.025, 0.05, 0.1)


def run(batch: int, lr: float, seed: int, epochs: int, data: common.Data, *, warmup: bool = False,
        ghost: bool = False) -> dict:
    total = epochs * len(data.x_train)
    model = common.cnn("bn", seed=seed)
    if ghost:
        convert_to_ghost_bn(model, GHOST)
    opt = build_optimizer("sgd", model, lr=lr)
    sched = LRSchedule(peak_lr=lr, total=total, warmup=total // 4 if warmup else 0, shape="cosine")
    r = common.train(model, opt, data, micro_batch=batch, global_batch=batch, samples=total, seed=seed,
                     lr_schedule=sched)
    h = r.history[-1]
    bad = r.diverged or h["test_loss"] != h["test_loss"]
    return {"test_loss": float("inf") if bad else h["test_loss"], "test_acc": 0.0 if bad else h["test_acc"],
            "train_loss": h["train_loss"], "steps": r.steps}


def main() -> None:
    p = common.parser(__doc__)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--large", type=int, default=512)
    args = p.parse_args()
    img, res = common.setup(args)
    t0 = time.perf_counter()
    data = common.digits()
    epochs, large, grid = args.epochs, args.large, GRID
    if args.tiny:
        data = common.Data(data.x_train[:128], data.y_train[:128], data.x_test[:64], data.y_test[:64])
        epochs, large, grid = 1, 64, GRID[:2]
    tuning = {lr: run(SMALL, lr, 0, epochs, data)["test_loss"] for lr in grid}
    lr = min(tuning, key=tuning.get)
    lr_large = scale_lr(lr, SMALL, large, "linear")
    seeds = range(1, args.seeds + 1)
    arms = {
        f"small {SMALL}": lambda s: run(SMALL, lr, s, epochs, data),
        f"large {large}": lambda s: run(large, lr, s, epochs, data),
        "+ linear LR + warmup": lambda s: run(large, lr_large, s, epochs, data, warmup=True),
        f"+ Ghost BN {GHOST}": lambda s: run(large, lr_large, s, epochs, data, warmup=True, ghost=True),
        "+ 4x longer": lambda s: run(large, lr_large, s, 4 * epochs, data, warmup=True, ghost=True),
    }
    raw = {k: [f(s) for s in seeds] for k, f in arms.items()}
    out = {}
    small = raw[f"small {SMALL}"]
    for k, v in raw.items():
        out[k] = {key: common.mean_ci([r[key] for r in v]) for key in ("test_loss", "test_acc", "train_loss")}
        out[k]["steps"] = v[0]["steps"]
        out[k]["gap_test_acc"] = common.mean_ci([r["test_acc"] - s["test_acc"] for r, s in zip(v, small)])
        out[k]["gap_test_loss"] = common.mean_ci([r["test_loss"] - s["test_loss"] for r, s in zip(v, small)])
        o = out[k]
        print(f"{k:22s} steps {o['steps']:5d}  held-out loss {o['test_loss'][0]:.4f} ± {o['test_loss'][1]:.4f}  "
              f"acc {o['test_acc'][0]:.4f} ± {o['test_acc'][1]:.4f}  train loss {o['train_loss'][0]:.4f}  "
              f"gap (acc) {o['gap_test_acc'][0]:+.4f} ± {o['gap_test_acc'][1]:.4f}")
    print(f"small-batch LR {lr:g} (grid {dict((str(k), round(v, 4)) for k, v in tuning.items())}); large LR {lr_large:g}")

    fig, axes = common.figure(ncols=2, width=4.0, height=3.1)
    names = list(out)
    for ax, key, label in ((axes[0], "test_loss", "held-out loss"), (axes[1], "gap_test_acc", "accuracy − small batch")):
        m = [min(out[k][key][0], 10.0) for k in names]
        h = [out[k][key][1] if out[k][key][1] == out[k][key][1] else 0.0 for k in names]
        ax.bar(range(len(names)), m, yerr=h, capsize=3, color=[f"C{i}" for i in range(len(names))])
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=35, fontsize=7, ha="right")
        ax.set_ylabel(label)
    axes[1].axhline(0.0, color="k", linewidth=0.6)
    axes[0].set_title(f"{epochs} epochs (95 % CI)", fontsize=9)
    common.save(fig, img / "repro_c_generalization_gap.png")
    common.write_json(res / "c_generalization_gap.json", {"epochs": epochs, "seeds": args.seeds, "small": SMALL,
                                                          "large": large, "lr_small": lr, "lr_large": lr_large,
                                                          "tuning": {str(k): v for k, v in tuning.items()},
                                                          "results": out})
    common.banner("c_generalization_gap", args, t0)


if __name__ == "__main__":
    main()
