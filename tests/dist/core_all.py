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
from one_group import run_in_one_group  # noqa: E402


def main() -> None:
    out = Path(sys.argv[1])
    for name in ("step", "adaptive"):
        (out / name).mkdir(parents=True, exist_ok=True)

    def adaptive() -> None:
        sys.argv[1:] = [str(out / "adaptive")]
        adaptive_agree.main()

    run_in_one_group((lambda: step_equivalence_script.main(out / "step"), adaptive, probe_agree.main))


if __name__ == "__main__":
    from clean_exit import clean_exit

    main()
    clean_exit()  # every check passed: skip gloo's teardown (see clean_exit.py)
