"""The GPU check: what a lent GPU machine must confirm, in one short run (< 8 minutes on one GPU).

Run through ``benchmarks/gpu_check.sh``. Each check prints one ``SUMMARY`` line:

1. step equivalence on CUDA: StepDriver's accumulated gradient over ragged padded micro-batches equals one
   full-batch gradient (fp32: rtol 1e-5; bf16 autocast: relative 2e-2 of the gradient norm), while the
   naive mean of micro-batch means is measurably wrong (> 1e-3 relative);
2. a tiny sweep with ``--device cuda --precision bf16`` (both trials finish, the manifest records both);
3. ``globalbatch noise --device cuda`` (a finite B_simple);
4. the probe against a real CUDA out-of-memory: the process is capped to a small memory fraction, so the
   probe's largest fitting micro-batch is set by the allocator's own OOM;
5. the step-overhead benchmark on CUDA (driver vs a hand-written loop);
6. MFU of the tinygpt training step (bf16 autocast): model FLOPs counted by FlopCounterMode over the
   A100/H100/H200 table's dense bf16 peak (a measured matmul on CPU), and valid tokens/s.

7. ``fsdp``: GlobalBatchTrainer under the Trainer's own FSDP2 (Accelerate turns FSDP on only for GPU
   distributed types; on CPU the 2-rank test lifts that gate), one rank per GPU: exact and B_simple;
8. ``empty_device``: count-0 micro-batches whose counts are device tensors (the noise monitor's device path).

``--device cpu`` runs the same checks on a CPU (how the script itself is tested here); ``--only a,b``
runs the named ones.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(n_layer=2, d_model=64, n_head=4, seq_len=64, max_corpus_bytes=500_000)
TINY_ARGS = [a for k, v in TINY.items() for a in ("--task-arg", f"{k}={v}")]


def summary(name: str, ok: bool, text: str) -> bool:
    print(f"SUMMARY {name}: {'PASS' if ok else 'FAIL'} — {text}", flush=True)
    return ok


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()]).double()


def check_step_equivalence(device: torch.device) -> bool:
    from globalbatch.lab.tasks import load_task
    from globalbatch.lab.device import Precision
    from globalbatch.step import StepConfig, StepDriver

    task = load_task("tinygpt", **TINY)
    # ragged on purpose: 4 micro-batches of very different token counts (the shortest documents with the longest)
    by_len = sorted(range(task.num_train_samples), key=lambda i: int(task.train_lengths[i]))
    idx = by_len[:8] + by_len[-8:]
    ok = True
    for precision, rtol in (("fp32", 1e-5), ("bf16", 2e-2)):
        auto = Precision(precision).autocast
        model = task.build_model(0).to(device)

        def loss_fn(m, b):
            with auto(device):
                s, n = task.loss_sum(m, b)
            return s.float(), n

        # one full batch: the token-mean loss of all 16 ragged sequences
        model.zero_grad(set_to_none=True)
        s, n = loss_fn(model, task.collate(idx, device))
        (s / n).backward()
        full = flat_grad(model)
        # naive: mean of the 4 micro-batch means
        model.zero_grad(set_to_none=True)
        for i in range(0, 16, 4):
            s, n = loss_fn(model, task.collate(idx[i:i + 4], device))
            (s / n / 4).backward()
        naive = flat_grad(model)
        # the driver: exact token-normalised accumulation (lr 0 keeps the parameters; grads are read at the end)
        model.zero_grad(set_to_none=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        grads = {}

        class Grab:  # at window end the gradients are accumulated and normalised, before the optimizer step
            def on_window_end(self, driver, global_count, local_window_count):
                grads["g"] = flat_grad(model)

        driver = StepDriver(model, opt, StepConfig(micro_batch=4, global_batch=16), callbacks=[Grab()])
        driver.run_window([task.collate(idx[i:i + 4], device) for i in range(0, 16, 4)], loss_fn)
        ours = grads["g"]
        err = float((ours - full).norm() / full.norm())
        naive_err = float((naive - full).norm() / full.norm())
        good = err <= rtol and naive_err > 1e-3
        ok &= summary(f"step-equivalence-{precision}", good,
                      f"driver vs full batch {err:.2e} (tolerance {rtol:g}); naive mean of means {naive_err:.2e}")
    return ok


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "globalbatch.cli", *argv], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def check_sweep(device: str, out: Path) -> bool:
    t0 = time.time()
    r = run_cli("sweep", "--out", str(out), "--batches", "4,16", "--lrs", "3e-3", "--tokens", "30K", "--workers", "1",
                "--device", device, "--precision", "bf16", *TINY_ARGS)
    grid = json.loads((out / "manifest.json").read_text())["grid"] if (out / "manifest.json").is_file() else {}
    done = len(list(out.glob("trials/*/summary.json")))
    return summary("sweep-bf16", r.returncode == 0 and done == 2 and grid.get("precision") == "bf16",
                   f"exit {r.returncode}, {done}/2 trials, grid device {grid.get('device')} precision "
                   f"{grid.get('precision')}, {time.time() - t0:.0f} s" + (f"; stderr: {r.stderr[-300:]}" if r.returncode else ""))


def check_noise(device: str, out: Path) -> bool:
    r = run_cli("noise", "--out", str(out), "--steps", "20", "--device", device, "--precision", "bf16", *TINY_ARGS)
    line = next((x for x in r.stdout.splitlines() if x.startswith("B_simple")), "")
    return summary("noise", r.returncode == 0 and bool(line), line or f"exit {r.returncode}: {r.stderr[-300:]}")


def check_probe_oom(device: torch.device) -> bool:
    from globalbatch.lab.probe_run import probe_task

    if device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(0.02, device)  # ~2.8 GiB of 139: the allocator OOMs for real
    res = probe_task("tinygpt", device=str(device), max_micro_batch=4096, steps_per_trial=1,
                     memory_limit_bytes=None if device.type == "cuda" else 300 * 2**20,  # CPU dry run: a budget
                     task_overrides=dict(n_layer=4, d_model=256, n_head=4, seq_len=256, max_corpus_bytes=2_000_000))
    if device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    ooms = [t for t in res.trials if t.oom]
    return summary("probe-real-oom", res.largest_fit >= 1 and (bool(ooms) or device.type != "cuda"),
                   f"largest fit {res.largest_fit}, fastest {res.fastest}, {res.num_trials} trials, "
                   f"{len(ooms)} real OOM(s): {ooms[0].note[:80] if ooms else '-'}")


def check_overhead(device: str) -> bool:
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_overhead.py"), "--device", device,
                        "--pairs", "30"], capture_output=True, text=True, timeout=300)
    line = next((x for x in r.stdout.splitlines() if x.startswith("ratio driver/hand (wall)")), "")
    return summary("step-overhead", r.returncode == 0 and bool(line), line or r.stderr[-300:])


def check_mfu(device: torch.device) -> bool:
    import statistics

    from globalbatch.lab.loop import Experiment
    from globalbatch.lab.tasks import load_task

    big = dict(n_layer=4, d_model=512, n_head=8, seq_len=256, max_corpus_bytes=2_000_000)
    task = load_task("tinygpt", **(big if device.type == "cuda" else TINY))
    micro = 32 if device.type == "cuda" else 4
    exp = Experiment(task, batch=micro * 2, micro_batch=micro, lr=1e-3, device=device, precision="bf16",
                     measure_flops=True)
    order = task.sample_order(0)
    results = [exp.train_window(order).result for _ in range(8)][3:]  # 3 warm-up windows
    mfus = [r.mfu for r in results if r.mfu is not None]
    if not mfus:
        return summary("mfu", False, f"no MFU: peak {exp.peak} (a GPU missing from the table needs a peak)")
    med = statistics.median(mfus)
    return summary("mfu", 0 < med < 1,
                   f"MFU median {med:.1%} (min {min(mfus):.1%}, max {max(mfus):.1%}) against "
                   f"{exp.peak.flops_per_s / 1e12:,.1f} TFLOP/s ({exp.peak.source}); valid tokens/s "
                   f"{statistics.median(r.valid_tokens_per_s for r in results):,.0f}")


def check_fsdp(tmp: Path) -> bool:
    """GlobalBatchTrainer under the Trainer's own FSDP2 (Accelerate unpatched: on CPU it drops the plugin),
    one rank per GPU under torchrun: exact to 1e-10 in float64 against one big batch, B_simple equal to a DDP
    StepDriver's monitor (tests/dist/integrations_fsdp.py)."""
    n = max(1, torch.cuda.device_count())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
           str(ROOT / "tests" / "dist" / "integrations_fsdp.py"), str(tmp)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"), HF_HUB_OFFLINE="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("hf-fsdp2", "PASS"))]
    ok = proc.returncode == 0 and "PASS hf-fsdp-exact" in proc.stdout and "PASS hf-fsdp-noise" in proc.stdout
    return summary("fsdp", ok, f"{n} rank(s): " + " | ".join(lines or [proc.stderr[-300:]]))


def check_empty_device_counts(device: torch.device) -> bool:
    """Count-0 micro-batches with device-tensor counts (the monitor's device path: weight 0, not counted in k,
    no host sync): the estimate equals the same windows without them (relative 1e-9)."""
    import copy
    import math

    from globalbatch.noise import NoiseConfig, NoiseScaleMonitor
    from globalbatch.step import StepConfig, StepDriver

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 4)).to(device)
    x, y = torch.randn(512, 12, device=device), torch.randint(0, 4, (512,), device=device)
    plan = [[8, 8, 8], [8, 0, 8, 8], [8, 8, 0], [0, 8, 8, 8], [8, 8, 8]]
    gen = torch.Generator(device="cpu").manual_seed(1)
    draws = [[torch.randint(0, 512, (max(b, 1),), generator=gen).to(device) for b in w] for w in plan]
    got = []
    for with_empty in (True, False):
        m = copy.deepcopy(base)
        mon = NoiseScaleMonitor(m, unit="sample", config=NoiseConfig(half_life=math.inf))
        driver = StepDriver(m, torch.optim.SGD(m.parameters(), lr=0.0), StepConfig(micro_batch=8, global_batch=32),
                            callbacks=[mon])
        for window, idxs in zip(plan, draws):
            micros = [(b, i) for b, i in zip(window, idxs) if b or with_empty]
            for j, (b, i) in enumerate(micros):
                with driver.micro_step(last=j == len(micros) - 1):
                    loss = torch.nn.functional.cross_entropy(m(x[i]), y[i], reduction="sum")
                    count = torch.tensor(len(i), device=device)
                    if b == 0:
                        loss, count = loss * 0.0, torch.zeros((), dtype=torch.long, device=device)
                    driver.backward(loss, count, samples=b)
            driver.step()
        got.append(mon.estimate())
    a, b = got
    rel = max(abs(a.tr_sigma - b.tr_sigma) / abs(b.tr_sigma), abs(a.g_sq - b.g_sq) / abs(b.g_sq))
    return summary("empty_device", a.windows == b.windows == 5 and rel < 1e-9,
                   f"windows {a.windows} and {b.windows}, tr(Σ) and |G|² relative difference {rel:.1e}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--only", default=None, help="comma-separated check names (default: all)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, device {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""), flush=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, fn in (("step", lambda: check_step_equivalence(device)),
                         ("sweep", lambda: check_sweep(args.device, Path(tmp) / "sweep")),
                         ("noise", lambda: check_noise(args.device, Path(tmp) / "noise")),
                         ("probe", lambda: check_probe_oom(device)),
                         ("overhead", lambda: check_overhead(args.device)),
                         ("mfu", lambda: check_mfu(device)),
                         ("fsdp", lambda: check_fsdp(Path(tmp) / "fsdp")),
                         ("empty_device", lambda: check_empty_device_counts(device))):
            if args.only and name not in args.only.split(","):
                continue
            try:
                results.append(fn())
            except Exception as exc:  # one failing check must not hide the others' lines
                results.append(summary(name, False, f"{type(exc).__name__}: {str(exc)[:300]}"))
    print(f"SUMMARY all: {sum(results)}/{len(results)} passed", flush=True)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
