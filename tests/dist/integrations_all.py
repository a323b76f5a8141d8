"""One 2-rank gloo launch for the integration checks (launched by tests/integrations/test_two_ranks.py).

Runs ``main()`` of tests/dist/integrations_ddp.py, integrations_empty.py and integrations_fsdp.py in turn in the
same process group, each with its own scratch directory and with torch's default dtype and seed as a fresh process
has them: every worker imports torch, transformers, Accelerate and Lightning once instead of three times (each launch
costs ~12 s of CPU before its first check). FSDP last: it lifts Accelerate's CPU gate for FSDP (see
integrations_fsdp.py). Each script still runs alone under torchrun. Argument 1: a scratch directory.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import integrations_ddp  # noqa: E402
import integrations_empty  # noqa: E402
import integrations_fsdp  # noqa: E402
import torch  # noqa: E402


def main() -> None:
    out, dtype, seed = Path(sys.argv[1]), torch.get_default_dtype(), torch.initial_seed()
    for name, script in (("ddp", integrations_ddp), ("empty", integrations_empty), ("fsdp", integrations_fsdp)):
        scratch = out / name
        scratch.mkdir(parents=True, exist_ok=True)
        sys.argv[1:] = [str(scratch)]
        torch.set_default_dtype(dtype)
        torch.manual_seed(seed)
        script.main()


if __name__ == "__main__":
    from clean_exit import clean_exit

    main()
    clean_exit()  # every check passed: skip gloo's teardown (see clean_exit.py)
