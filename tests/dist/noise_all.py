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
from one_group import run_in_one_group  # noqa: E402


def main() -> None:
    def run(script, windows: str):
        def go() -> None:
            sys.argv[1:] = [windows]
            script.main()
        return go

    run_in_one_group([run(noise_ddp, "300"), run(noise_fsdp2, "150"), run(noise_wrappers, "60")])


if __name__ == "__main__":
    from clean_exit import clean_exit

    main()
    clean_exit()  # every check passed: skip gloo's teardown (see clean_exit.py)
