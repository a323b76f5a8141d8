"""(a) Gradient accumulation equals the big batch without BatchNorm, not with it; Ghost BN at the
micro-batch size makes the two agree.

Setup: the digits CNN in float64, SGD momentum 0.9 (registry "sgd", LR 0.05), global batch 64,
trained for ``--steps`` optimizer steps through StepDriver in two cuts of the same sample stream:
one micro-batch of 64 ("big") and 8 accumulated micro-batches of 8 ("accum"). Three comparisons:

1. no BatchNorm:                      big vs accum        (should agree to float64 rounding)
2. BatchNorm:                         big vs accum        (statistics over 64 vs over 8: differ)
3. Ghost BN (ghost 8) on the big cut  vs accum with plain BN (same statistics: should agree)

Measured per step: max |θ_big − θ_accum| over all parameters; at the end also the relative
distance ‖Δθ‖ / ‖θ_big − θ_0‖, the running-statistics difference and the held-out loss of both.

    OMP_NUM_THREADS=1 python experiments/a_accumulation_bn.py
"""

from __future__ import annotations

import logging
import time
import warnings

import torch

import common
from globalbatch.nn import convert_to_ghost_bn
from globalbatch.optim import build_optimizer

GLOBAL, MICRO, LR = 64, 8, 0.05


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def arm(norm: str, micro: int, seed: int, steps: int, data: common.Data, ghost: bool = False):
    model = common.cnn(norm, seed=seed, dtype=torch.float64)
    if ghost:
        convert_to_ghost_bn(model, MICRO)
    theta0 = flat(model).clone()
    opt = build_optimizer("sgd", model, lr=LR)
    traj: list[torch.Tensor] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the BatchNorm-under-accumulation warning is the point here
        common.train(model, opt, data, micro_batch=micro, global_batch=GLOBAL, samples=GLOBAL * steps, seed=seed,
                     on_step=lambda d: traj.append(flat(model).clone()))
    buffers = torch.cat([b.reshape(-1).double() for n, b in model.named_buffers() if "running" in n] or
                        [torch.zeros(1, dtype=torch.float64)])
    loss, acc = common.evaluate(model, data.x_test, data.y_test)
    return {"traj": traj, "theta0": theta0, "buffers": buffers, "test_loss": loss, "test_acc": acc}


def compare(a, b) -> dict:
    per_step = [float((x - y).abs().max()) for x, y in zip(a["traj"], b["traj"])]
    moved = float((a["traj"][-1] - a["theta0"]).norm())
    return {"max_abs_per_step": per_step, "final_max_abs": per_step[-1],
            "final_rel": float((a["traj"][-1] - b["traj"][-1]).norm()) / moved,
            "running_stats_max_abs": float((a["buffers"] - b["buffers"]).abs().max()),
            "test_loss_diff": a["test_loss"] - b["test_loss"], "test_acc_diff": a["test_acc"] - b["test_acc"],
            "test_loss": [a["test_loss"], b["test_loss"]]}


def main() -> None:
    p = common.parser(__doc__)
    p.add_argument("--steps", type=int, default=150, help="optimizer steps per run")
    args = p.parse_args()
    img, res = common.setup(args)
    logging.getLogger("globalbatch.step").setLevel(logging.ERROR)  # the BatchNorm warning, expected here
    t0 = time.perf_counter()
    steps = 3 if args.tiny else args.steps
    data = common.digits(torch.float64)
    cases = {"no BatchNorm: big vs accum": ("none", False), "BatchNorm: big vs accum": ("bn", False),
             "Ghost BN 8 (big) vs BN (accum)": ("bn", True)}
    out: dict[str, list[dict]] = {k: [] for k in cases}
    for seed in range(args.seeds):
        for name, (norm, ghost) in cases.items():
            big = arm(norm, GLOBAL, seed, steps, data, ghost=ghost)
            acc = arm(norm, MICRO, seed, steps, data)
            out[name].append(compare(big, acc))

    summary = {}
    for name, runs in out.items():
        summary[name] = {
            "final_max_abs_worst": max(r["final_max_abs"] for r in runs),
            "final_rel": common.mean_ci([r["final_rel"] for r in runs]),
            "running_stats_max_abs_worst": max(r["running_stats_max_abs"] for r in runs),
            "test_loss_diff": common.mean_ci([r["test_loss_diff"] for r in runs]),
            "test_acc_diff": common.mean_ci([r["test_acc_diff"] for r in runs]),
            "test_loss_big": common.mean_ci([r["test_loss"][0] for r in runs]),
            "test_loss_accum": common.mean_ci([r["test_loss"][1] for r in runs]),
        }
        s = summary[name]
        print(f"{name:34s} max|Δθ| {s['final_max_abs_worst']:.2e}  ‖Δθ‖/‖θ−θ0‖ {s['final_rel'][0]:.2e} ± "
              f"{s['final_rel'][1]:.1e}  running stats {s['running_stats_max_abs_worst']:.1e}  "
              f"held-out loss big {s['test_loss_big'][0]:.4f} accum {s['test_loss_accum'][0]:.4f} "
              f"(diff {s['test_loss_diff'][0]:+.4f} ± {s['test_loss_diff'][1]:.4f})")

    fig, (ax,) = common.figure(width=5.0, height=3.2)
    for name, runs in out.items():
        curves = torch.tensor([r["max_abs_per_step"] for r in runs]).clamp(min=1e-18)
        x = range(1, curves.shape[1] + 1)
        ax.plot(x, curves.mean(0), label=name)
        ax.fill_between(x, curves.min(0).values, curves.max(0).values, alpha=0.25)
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step (global batch 64)")
    ax.set_ylabel("max |θ_big − θ_accum|")
    ax.set_title("accumulation (8×8) vs one batch of 64", fontsize=9)
    ax.legend(fontsize=7)
    common.save(fig, img / "repro_a_accumulation_bn.png")
    common.write_json(res / "a_accumulation_bn.json", {"steps": steps, "seeds": args.seeds, "global_batch": GLOBAL,
                                                       "micro_batch": MICRO, "lr": LR, "summary": summary})
    common.banner("a_accumulation_bn", args, t0)


if __name__ == "__main__":
    main()
