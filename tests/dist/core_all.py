"""One 2-rank gloo launch for the core's distributed checks (launched by tests/test_core_two_ranks.py).

Runs ``main()`` of tests/dist/step_equivalence_script.py (the step driver, with step_skip_agree.py's check),
adaptive_agree.py and probe_agree.py in turn in one process group (each script's own init and destroy are skipped: a
second init_process_group under torchrun waits forever), each with its own scratch directory and with torch's default
dtype, seed and thread count as a fresh process has them: the workers import torch and globalbatch once instead of
three times. Each script still runs alone under torchrun. Argument 1: a scratch directory.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import adaptive_agree  # noqa: E402
import probe_agree  # noqa: E402
import step_equivalence_script  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main() -> None:
    out = Path(sys.argv[1])
    for name in ("step", "adaptive"):
        (out / name).mkdir(parents=True, exist_ok=True)
    dtype, seed, threads = torch.get_default_dtype(), torch.initial_seed(), torch.get_num_threads()

    def adaptive() -> None:
        sys.argv[1:] = [str(out / "adaptive")]
        adaptive_agree.main()

    runs = (lambda: step_equivalence_script.main(out / "step"), adaptive, probe_agree.main)
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


if __name__ == "__main__":
    from clean_exit import clean_exit

    main()
    clean_exit()  # every check passed: skip gloo's teardown (see clean_exit.py)
