"""Run several 2-rank check scripts' ``main()`` in one gloo process group, in turn (core_all.py, noise_all.py).

Each script's own ``init_process_group`` and ``destroy_process_group`` are skipped while it runs: a second
init_process_group under torchrun waits forever. Before each run torch's default dtype, seed and thread count are
set back to what a fresh process has, so every script sees the state it would see alone under torchrun.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.distributed as dist


def run_in_one_group(runs: Iterable[Callable[[], None]]) -> None:
    dtype, seed, threads = torch.get_default_dtype(), torch.initial_seed(), torch.get_num_threads()
    dist.init_process_group("gloo")
    init, destroy = dist.init_process_group, dist.destroy_process_group
    dist.init_process_group = dist.destroy_process_group = lambda *args, **kwargs: None  # type: ignore[assignment]
    try:
        for run in runs:
            torch.set_default_dtype(dtype)
            torch.manual_seed(seed)
            torch.set_num_threads(threads)
            run()
    finally:
        dist.init_process_group, dist.destroy_process_group = init, destroy
    dist.destroy_process_group()
