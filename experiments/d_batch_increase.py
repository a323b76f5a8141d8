"""(d) Smith, Kindermans, Ying & Le 2018, "Don't Decay the Learning Rate, Increase the Batch Size".

Claim: dividing the LR by k at a milestone and multiplying the batch by k there instead give the
same held-out curve per epoch (the SGD noise scale ε·N/B falls by k either way), the second in
far fewer optimizer steps.

Setup: the digits CNN with Ghost BN of 16 (so BatchNorm statistics are over 16 samples in both
arms, as Smith et al. keep them fixed), SGD momentum 0.9 (registry "sgd"), ``--epochs`` epochs,
milestones at 1/3 and 2/3 of them, factor 4:

* "decay LR":       batch 16 throughout; LR 0.2 → 0.05 → 0.0125 (torch MultiStepLR, in steps)
* "increase batch": LR 0.2 throughout; batch 16 → 64 → 256 from globalbatch.schedule's
  StepBatchSchedule in samples (``lr_rule="none"``: the LR does not follow the batch)
* "constant (control)": batch 16 and LR 0.2 throughout — shows the schedule matters at all

Held-out loss/accuracy every epoch, ≥ 3 seeds (model init and data order), mean with 95 % t-interval.

    OMP_NUM_THREADS=1 python experiments/d_batch_increase.py
"""

from __future__ import annotations

import math
import time

import torch

import common
from globalbatch.nn import convert_to_ghost_bn
from globalbatch.optim import build_optimizer
from globalbatch.schedule import StepBatchSchedule

BASE_BATCH, LR, FACTOR = 16, 0.2, 4


def run(arm: str, seed: int, epochs: int, data: common.Data, lr: float = LR) -> common.Run:
    n = len(data.x_train)
    total = epochs * n
    m1, m2 = (epochs // 3) * n, (2 * epochs // 3) * n
    model = convert_to_ghost_bn(common.cnn("bn", seed=seed), BASE_BATCH)
    opt = build_optimizer("sgd", model, lr=lr)
    if arm == "constant (control)":
        return common.train(model, opt, data, micro_batch=BASE_BATCH, global_batch=BASE_BATCH, samples=total,
                            seed=seed, eval_every=n)
    if arm == "decay LR":
        steps_at = [math.ceil(m / BASE_BATCH) for m in (m1, m2)]
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=steps_at, gamma=1.0 / FACTOR)
        return common.train(model, opt, data, micro_batch=BASE_BATCH, global_batch=BASE_BATCH, samples=total,
                            seed=seed, lr_scheduler=sched, eval_every=n)
    batches = StepBatchSchedule(steps=((0, BASE_BATCH), (m1, BASE_BATCH * FACTOR), (m2, BASE_BATCH * FACTOR ** 2)),
                                lr_rule="none")
    return common.train(model, opt, data, micro_batch=BASE_BATCH, batch_schedule=batches, samples=total, seed=seed,
                        eval_every=n)


def main() -> None:
    p = common.parser(__doc__)
    p.add_argument("--epochs", type=int, default=9)
    p.add_argument("--lr", type=float, default=LR)
    args = p.parse_args()
    img, res = common.setup(args)
    t0 = time.perf_counter()
    data = common.digits()
    if args.tiny:
        data = common.Data(data.x_train[:96], data.y_train[:96], data.x_test[:64], data.y_test[:64])
    epochs = 3 if args.tiny else args.epochs
    arms = ("decay LR", "increase batch", "constant (control)")
    runs = {a: [run(a, s, epochs, data, args.lr) for s in range(args.seeds)] for a in arms}

    summary = {}
    for a in arms:
        last = [r.history[-1] for r in runs[a]]
        summary[a] = {"steps": [r.steps for r in runs[a]],
                      "test_loss": common.mean_ci([h["test_loss"] for h in last]),
                      "test_acc": common.mean_ci([h["test_acc"] for h in last]),
                      "train_loss": common.mean_ci([h["train_loss"] for h in last]),
                      "curve_test_loss": [common.mean_ci([r.history[i]["test_loss"] for r in runs[a]])
                                          for i in range(len(runs[a][0].history))],
                      "curve_epochs": [h["epochs"] for h in runs[a][0].history],
                      "curve_steps": [h["steps"] for h in runs[a][0].history]}
        s = summary[a]
        print(f"{a:15s} steps {s['steps'][0]:6d}  held-out loss {s['test_loss'][0]:.4f} ± {s['test_loss'][1]:.4f}  "
              f"acc {s['test_acc'][0]:.4f} ± {s['test_acc'][1]:.4f}  train loss {s['train_loss'][0]:.4f}")
    diffs = [ra.history[-1]["test_loss"] - rb.history[-1]["test_loss"]
             for ra, rb in zip(runs["decay LR"], runs["increase batch"])]
    summary["paired_test_loss_diff_decay_minus_increase"] = common.mean_ci(diffs)
    print(f"paired held-out loss difference (decay − increase): {common.fmt_ci(diffs, 4)}; steps ratio "
          f"{summary['decay LR']['steps'][0] / summary['increase batch']['steps'][0]:.2f}")

    fig, axes = common.figure(ncols=2, width=4.0, height=3.0)
    for a in arms:
        s = summary[a]
        m = [c[0] for c in s["curve_test_loss"]]
        h = [0.0 if math.isnan(c[1]) else c[1] for c in s["curve_test_loss"]]
        for ax, x in zip(axes, (s["curve_epochs"], s["curve_steps"])):
            ax.plot(x, m, label=a)
            ax.fill_between(x, [u - v for u, v in zip(m, h)], [u + v for u, v in zip(m, h)], alpha=0.25)
    axes[0].set_xlabel("epoch")
    axes[1].set_xlabel("optimizer steps")
    for ax in axes:
        ax.set_ylabel("held-out loss")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    axes[0].set_title("per epoch (95 % CI band)", fontsize=9)
    axes[1].set_title("per optimizer step", fontsize=9)
    common.save(fig, img / "repro_d_batch_increase.png")
    common.write_json(res / "d_batch_increase.json", {"epochs": epochs, "seeds": args.seeds, "lr": LR,
                                                      "base_batch": BASE_BATCH, "factor": FACTOR, "summary": summary})
    common.banner("d_batch_increase", args, t0)


if __name__ == "__main__":
    main()
