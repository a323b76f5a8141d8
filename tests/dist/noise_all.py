"""One 2-rank gloo launch for the noise monitor's distributed checks (launched by tests/test_noise.py).

Runs ``main()`` of tests/dist/noise_ddp.py (300 windows), noise_fsdp2.py (150) and noise_wrappers.py (60) in turn
in one process group (each script's own init and destroy are skipped: a second init_process_group under torchrun
waits forever), with torch's default dtype and seed as a fresh process has them: the workers import torch and
globalbatch once instead of three times. The compiled model last (torch.compile's state stays behind). Each script
still runs alone under torchrun.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import noise_ddp  # noqa: E402
import noise_fsdp2  # noqa: E402
import noise_wrappers  # noqa: E402
import torch  # noqa: E402


def main() -> None:
    import torch.distributed as dist

    dtype, seed = torch.get_default_dtype(), torch.initial_seed()
    dist.init_process_group("gloo")
    init, destroy = dist.init_process_group, dist.destroy_process_group
    dist.init_process_group = dist.destroy_process_group = lambda *args, **kwargs: None  # type: ignore[assignment]
    try:
        for script, windows in ((noise_ddp, "300"), (noise_fsdp2, "150"), (noise_wrappers, "60")):
            sys.argv[1:] = [windows]
            torch.set_default_dtype(dtype)
            torch.manual_seed(seed)
            script.main()
    finally:
        dist.init_process_group, dist.destroy_process_group = init, destroy
    dist.destroy_process_group()


if __name__ == "__main__":
    from clean_exit import clean_exit

    main()
    clean_exit()  # every check passed: skip gloo's teardown (see clean_exit.py)
